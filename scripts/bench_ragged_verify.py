"""What a ragged verification step costs, three ways: rows of different node counts padded to
the widest and computed whole, the padding left out of the linear layers and the LM head only
(``computed_rows``), and the rows packed into one sequence with only attention unpacking them
(:class:`draftheads.decoding.base.attention.RaggedRows`, what the decoder runs). Uniform steps of
1-4 slots a row are the yardstick: a ragged step should cost about what its real slots cost.

    python scripts/bench_ragged_verify.py --batch-size 16 --context 1000 --out results/attention/ragged_verify/bf16

One verify forward + LM head over a synthetic cache of ``--context`` slots a row (costs do not
depend on the values), chains as trees, medians of ``--reps`` after a warm-up; the three ways run
interleaved per pattern. Writes ``ragged_verify.json`` and ``ragged_verify.png``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from draftheads.decoding.base.attention import RaggedRows, use_packed_sdpa
from draftheads.decoding.base.cache import tree_attention_mask
from draftheads.decoding.base.forward import lm_logits, verify
from draftheads.decoding.base.loading import dtype_name, load_base
from draftheads.decoding.base.packing import use_packed_linears
from draftheads.decoding.calibration import _synthetic_cache, device_name
from draftheads.decoding.base.rows import computed_rows
from draftheads.training.figures import figure

#: node counts per row of 16 (cut or repeated to the batch size): one long row, a few, a spread
PATTERNS = {
    "1 row of 3, others 1": [3] + [1] * 15,
    "1 row of 5, others 1": [5] + [1] * 15,
    "1 row of 9, others 1": [9] + [1] * 15,
    "3 rows of 5, others 1": [5] * 3 + [1] * 13,
    "2 rows of 9, others 2": [9] * 2 + [2] * 14,
    "4 rows of 4, others 2": [4] * 4 + [2] * 12,
    "8 rows of 3, others 1": [3] * 8 + [1] * 8,
    "a spread, 6 to 1": [6, 4, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1],
}
WAYS = ("padded", "padding skipped", "packed")


def fit(pattern: list[int], batch: int) -> list[int]:
    return [pattern[i % len(pattern)] for i in range(batch)]


def step_fn(model, cache, kv_valid: torch.Tensor, sizes: list[int], way: str):
    """One verify + LM head over chains of ``sizes`` nodes per row, the cache cropped back after."""
    width = max(sizes)
    valid = torch.arange(width)[None] < torch.tensor(sizes)[:, None]  # (B, N)
    ancestor = torch.tril(torch.ones(width, width, dtype=torch.bool)).expand(len(sizes), width, width)
    mask = tree_attention_mask(kv_valid, ancestor)
    positions = kv_valid.sum(1, keepdim=True) + torch.arange(width)[None]
    tokens = torch.randint(3, 1000, (len(sizes), width))
    ragged = None if way == "padded" or bool(valid.all()) else valid

    def run() -> None:
        with computed_rows(ragged):
            states = verify(model, tokens, positions, mask, cache, ragged if way == "packed" else None)
            lm_logits(model, states)
        cache.crop(-width)

    return run


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("results/attention/ragged_verify"))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model, _ = load_base(dtype=args.dtype)
    use_packed_linears(model)
    use_packed_sdpa(model)
    batch, kv_len = args.batch_size, args.context
    cache = _synthetic_cache(model, batch, kv_len)
    kv_valid = torch.ones(batch, kv_len, dtype=torch.bool)
    uniform = {q: median_ms(step_fn(model, cache, kv_valid, [q] * batch, "padded"), args.reps) for q in (1, 2, 3, 4)}
    print("uniform slots a row → ms:", {q: round(ms, 1) for q, ms in uniform.items()}, flush=True)
    rows = []
    for name, pattern in PATTERNS.items():
        sizes = fit(pattern, batch)
        split = RaggedRows.from_valid(torch.arange(max(sizes))[None] < torch.tensor(sizes)[:, None]).split
        ms = {way: median_ms(step_fn(model, cache, kv_valid, sizes, way), args.reps) for way in WAYS}
        rows.append({"pattern": name, "sizes": sizes, "real_slots": sum(sizes), "widest": max(sizes),
                     "attention_split": {"first_slots": split[0],
                                         "long_rows": None if split[1] is None else split[1].tolist()},
                     **{f"{way}_ms": round(v, 2) for way, v in ms.items()}})
        print(f"{name:24s} real {sum(sizes):3d}  " + "  ".join(f"{w} {v:6.1f}" for w, v in ms.items()), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python scripts/bench_ragged_verify.py " + " ".join(argv or sys.argv[1:]),
            "device": device_name(torch.device("cpu")), "dtype": dtype_name(next(model.parameters()).dtype),
            "threads": torch.get_num_threads(), "batch_size": batch, "context": kv_len, "reps": args.reps,
            "date": time.strftime("%Y-%m-%d")}
    result = {"meta": meta, "uniform_ms": {str(q): round(v, 2) for q, v in uniform.items()}, "patterns": rows}
    (args.out / "ragged_verify.json").write_text(json.dumps(result, indent=1))
    with figure(args.out / "ragged_verify.png", 1, 1, figsize=(9, 4.5)) as (fig, ax):
        xs = range(len(rows))
        for k, way in enumerate(WAYS):
            ax.bar([x + (k - 1) * 0.27 for x in xs], [r[f"{way}_ms"] for r in rows], width=0.27, label=way)
        for q, ms in uniform.items():
            ax.axhline(ms, color="grey", lw=0.6, ls=":")
            ax.text(len(rows) - 0.5, ms, f"{q} slot{'s' if q > 1 else ''} a row", fontsize=7, va="bottom", ha="right")
        ax.set_xticks(list(xs), [f"{r['pattern']}\n({r['real_slots']} real)" for r in rows], fontsize=7, rotation=20)
        ax.set_ylabel("ms per verify + LM head")
        ax.set_title(f"Ragged steps, bs {batch}, context {kv_len}, {meta['dtype']}")
        ax.legend(fontsize=8)
    print(f"wrote {args.out / 'ragged_verify.json'} and .png")


if __name__ == "__main__":
    main()
