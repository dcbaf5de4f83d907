"""The prefill of a padded batch two ways: every row's padded length through the base, or only
the real tokens packed into one sequence (draftheads.decoding.base.forward._forward_packed, what
the decoder runs), on the batch bench's batches (MT-Bench and Spec-Bench dev, categories dealt
round-robin, chat template, left padding); interleaved, alternating which runs first. Also checks
that the two give the same states at every real position and the same first token per row.

    python scripts/bench_packed_prefill.py --dtypes bfloat16,float32 --batch-size 16 --batches 2 --reps 2 --out results/attention/packed_prefill
    python scripts/bench_packed_prefill.py --base gemma3-270m --dtypes bfloat16 --out results/attention/packed_prefill/gemma3_270m

Writes ``packed_prefill.json`` and ``packed_prefill.png``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

import draftheads.decoding.base.forward as forward
from draftheads.decoding.calibration import device_name
from draftheads.training.figures import figure


def prefill_ab(dtype: str, batch: int, batches: int, reps: int, base: str | None = None, log=print) -> list[dict]:
    """One record per batch: each way's seconds (every rep), prompt tokens, and how far apart
    the two ways' states and first tokens are. ``base``: a ``--base`` name or path (None: the embedded default)."""
    from draftheads.bench.batched import batches_of
    from draftheads.decoding.base.loading import load_base
    from draftheads.decoding.base.packing import use_packed_linears
    from draftheads.decoding.base.attention import use_packed_sdpa
    from draftheads.decoding.request import left_pad
    from draftheads.prompts import BATCH_PROMPTS, chat_input, read_prompts, round_robin

    model, tokenizer = load_base(base, dtype=dtype)
    use_packed_linears(model)
    use_packed_sdpa(model)
    encoded = [chat_input(tokenizer, p["prompt"])[0].tolist() for p in round_robin(read_prompts(BATCH_PROMPTS))]
    pad = model.generation_config.pad_token_id or 0
    warm_ids, warm_mask = left_pad(encoded[:2], pad)
    forward.forward_all(model, warm_ids, warm_mask)
    records = []
    for bi, rows in enumerate(batches_of(encoded, batch, batches)):
        ids, mask = left_pad(rows, pad)
        seconds: dict[str, list[float]] = {"padded": [], "packed": []}
        states = {}
        for rep in range(reps):
            for way in (("padded", "packed") if rep % 2 == 0 else ("packed", "padded")):
                patch = mock.patch.object(forward, "packs_prompts", lambda m, a: False) if way == "padded" \
                    else mock.patch.object(forward, "packs_prompts", forward.packs_prompts)
                with patch:
                    start = time.perf_counter()
                    _, hidden = forward.forward_all(model, ids, mask)
                    seconds[way].append(round(time.perf_counter() - start, 3))
                states[way] = hidden
        real = mask.bool()
        diff = float((states["packed"][real].float() - states["padded"][real].float()).abs().max())
        first = {way: forward.lm_logits(model, h[:, -1]).argmax(-1) for way, h in states.items()}
        records.append({"batch": bi, "prompt_tokens": sorted(int(n) for n in mask.sum(1)), "padded_tokens": mask.numel(),
                        "seconds": seconds, "median_seconds": {w: statistics.median(s) for w, s in seconds.items()},
                        "max_state_difference": diff,
                        "same_first_tokens": bool(torch.equal(first["packed"], first["padded"]))})
        log(f"{dtype} batch {bi}: padded {seconds['padded']} s, packed {seconds['packed']} s, "
            f"real tokens {int(mask.sum())} of {mask.numel()}, max state difference {diff:.3g}")
    return records


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=None, help="a --base name or path (default: the embedded SmolLM2)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("results/attention/packed_prefill"))
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    runs = {dtype: prefill_ab(dtype, args.batch_size, args.batches, args.reps, args.base)
            for dtype in args.dtypes.split(",")}
    summary = {dtype: {"padded_seconds": round(sum(r["median_seconds"]["padded"] for r in recs), 3),
                       "packed_seconds": round(sum(r["median_seconds"]["packed"] for r in recs), 3),
                       "max_state_difference": max(r["max_state_difference"] for r in recs),
                       "same_first_tokens": all(r["same_first_tokens"] for r in recs)} for dtype, recs in runs.items()}
    for s in summary.values():
        s["packed_vs_padded"] = round(s["packed_seconds"] / s["padded_seconds"], 4)
    result = {"meta": {"command": "python scripts/bench_packed_prefill.py " + " ".join(argv or sys.argv[1:]),
                       "device": device_name(torch.device("cpu")), "threads": torch.get_num_threads(),
                       "date": time.strftime("%Y-%m-%d"), "batch_size": args.batch_size, "reps": args.reps,
                       "base": args.base or "embedded"},
              "batches": runs, "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "packed_prefill.json").write_text(json.dumps(result, indent=1))
    with figure(args.out / "packed_prefill.png", 1, 1, figsize=(8, 4)) as (fig, ax):
        labels, x = [], 0
        for dtype, recs in runs.items():
            for r in recs:
                for k, way in enumerate(("padded", "packed")):
                    ax.bar(x + (k - 0.5) * 0.4, r["median_seconds"][way], width=0.4, color=f"C{k}",
                           label=way if x == 0 else None)
                labels.append(f"{dtype}\nbatch {r['batch']}: {sum(r['prompt_tokens'])} of {r['padded_tokens']} real")
                x += 1
        ax.set_xticks(range(x), labels, fontsize=8)
        ax.set_ylabel("prefill seconds (median)")
        ax.set_title(f"Prefill of a padded batch of {args.batch_size}, {args.base or 'SmolLM2'}, 2 CPU cores")
        ax.legend(fontsize=8)
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out / 'packed_prefill.json'} and .png")


if __name__ == "__main__":
    main()
