"""What leaving out each row's leading hidden key blocks buys (draftheads.decoding.base.key_blocks),
two ways:

1. the decoder's attention alone (``_attend``) on a synthetic batch: rows cut in 1-16 runs, each
   reading every key or all but the first block: the price of one more run in (row, key) reads
   (what :data:`ATTENTION_CALL_KEYS` stands for);
2. whole batched decodes under the adaptive policy (the heads alone, or ``--strategy``), on the batch bench's batches
   (MT-Bench and Spec-Bench dev, categories dealt round-robin, left padding): the cut and the
   row grouping on against both off, interleaved, alternating which runs first.

    python scripts/bench_key_blocks.py --batch-size 16 --batches 2 --reps 3 --out results/attention/key_blocks
    python scripts/bench_key_blocks.py --strategy adaptive+heads+context+store+stats --out results/attention/key_blocks/default

Writes ``key_blocks.json`` and ``key_blocks.png``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

import draftheads.decoding.base.attention as attention
from draftheads.decoding.base.key_blocks import KV_BLOCK
from draftheads.decoding.calibration import _best_of, device_name
from draftheads.training.figures import figure


class _Groups:
    """The attention module's one attribute the decoder's attention reads (SmolLM2: 9 query heads, 3 key/value)."""
    num_key_value_groups = 3
    is_causal = True


def runs_table(dtype: torch.dtype, batch: int, context: int) -> list[dict]:
    """ms of one layer's attention with the rows cut in n equal runs, each from key 0 or from KV_BLOCK."""
    rows = []
    for q in (1, 2, 3):
        query = torch.randn(batch, 9, q, 64, dtype=dtype)
        key, value = (torch.randn(batch, 3, context + 200, 64, dtype=dtype)[:, :, :context] for _ in range(2))
        mask = torch.ones(batch, 1, q, context, dtype=torch.bool)
        mask[:, :, :, : KV_BLOCK + 88] = False
        for n in (1, 2, 4, 8, 16):
            size = max(1, batch // n)
            for cut in (0, KV_BLOCK):
                runs = tuple((a, min(a + size, batch), cut) for a in range(0, batch, size))
                with mock.patch.object(attention, "key_runs", lambda m, runs=runs: runs):
                    ms = _best_of(lambda: attention._attend(_Groups(), query, key, value, mask, 0.0, 0.125, None,
                                                           **{attention.PACK_FLAG: True}), reps=30)
                rows.append({"q": q, "runs": len(runs), "first_key": cut, "ms": round(ms, 4)})
    return rows


def call_keys(rows: list[dict], batch: int, context: int) -> dict:
    """Per q: the ms one more run adds (16 runs against 1, every key read), in (row, key) reads."""
    out = {}
    for q in (1, 2, 3):
        ms = {(r["runs"], r["first_key"]): r["ms"] for r in rows if r["q"] == q}
        one, most = ms[1, 0], max(n for n, _ in ms)
        per_run = (ms[most, 0] - one) / (most - 1)
        out[str(q)] = {"ms_a_run": round(per_run, 4), "row_keys": round(per_run / (one / (batch * context)))}
    return out


def decode_ab(batch: int, batches: int, reps: int, dtype: str, strategy: str, log=print) -> list[dict]:
    """Every batch ``reps`` times each way, the order alternating: one record per decode.
    ``strategy``: a batch bench strategy name ("adaptive": the heads alone; "adaptive+" and the
    sources joined by "+": drafting from those)."""
    from draftheads import DraftHeadsModel
    from draftheads.bench.batched import BatchBench, batches_of, left_pad
    from draftheads.prompts import BATCH_PROMPTS, chat_input, read_prompts, round_robin

    model = DraftHeadsModel.from_pretrained("checkpoints/smollm2-135m-hydra", dtype=dtype)
    sources = strategy.split("+")[1:] or None
    bench = BatchBench.prepare(model, [0, 1, 2, 4, 8, 16], False, sources, False, log=log)
    if strategy not in bench.names:
        raise SystemExit(f"--strategy {strategy}: not one of {', '.join(bench.names)}")
    encoded = [chat_input(model.tokenizer, p["prompt"])[0].tolist() for p in round_robin(read_prompts(BATCH_PROMPTS))]
    bench.warm_up(encoded[:2])

    def off():
        return mock.patch.multiple(attention, key_runs=lambda m: None), \
            mock.patch("draftheads.decoding.loop.grouped_order", lambda valid: None)

    records = []
    for rep in range(reps):
        for bi, rows in enumerate(batches_of(encoded, batch, batches)):
            ids, mask = left_pad(rows, bench.pad)
            for way in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                patches = off() if way == "off" else (nullcontext(), nullcontext())
                with patches[0], patches[1]:
                    start = time.perf_counter()
                    out, stats, _ = bench.run(strategy, ids, mask, 128)
                    seconds = time.perf_counter() - start
                decode = seconds - stats.prefill_seconds
                records.append({"rep": rep, "batch": bi, "way": way, "seconds": round(seconds, 3),
                                "prefill_seconds": round(stats.prefill_seconds, 3), "decode_seconds": round(decode, 3),
                                "steps": stats.steps, "tau": round(stats.tau, 4), "new_tokens": stats.new_tokens,
                                "decode_tokens_per_second": round(stats.decode_tokens_per_second, 2),
                                "prompt_tokens": sorted(int(m) for m in mask.sum(1)), "output_ids_sum": int(out.sum())})
                log(f"rep {rep} batch {bi} {way}: {seconds:.2f} s, prefill {stats.prefill_seconds:.2f}, "
                    f"decode {decode:.2f} ({stats.steps} steps, τ {stats.tau:.2f})")
    return records


def summary(records: list[dict]) -> dict:
    """Per way: medians over the decodes of each batch, summed over batches; after/before ratios."""
    out = {}
    for way in ("off", "on"):
        per_batch = {}
        for r in records:
            if r["way"] == way:
                per_batch.setdefault(r["batch"], []).append(r)
        med = {k: sum(statistics.median(r[k] for r in rs) for rs in per_batch.values())
               for k in ("prefill_seconds", "decode_seconds", "seconds", "steps")}
        out[way] = {k: round(v, 3) for k, v in med.items()}
        out[way]["decode_ms_a_step"] = round(1e3 * med["decode_seconds"] / med["steps"], 2)
    out["decode_ms_a_step_on_vs_off"] = round(out["on"]["decode_ms_a_step"] / out["off"]["decode_ms_a_step"], 4)
    out["prefill_on_vs_off"] = round(out["on"]["prefill_seconds"] / out["off"]["prefill_seconds"], 4)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--context", type=int, default=900, help="keys a row of the synthetic attention table")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--strategy", default="adaptive",
                    help='"adaptive" (the heads alone) or e.g. "adaptive+heads+context+store+stats" (the default drafting)')
    ap.add_argument("--out", type=Path, default=Path("results/attention/key_blocks"))
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    table = runs_table(dtype, args.batch_size, args.context)
    calls = call_keys(table, args.batch_size, args.context)
    print("one more run:", calls, flush=True)
    records = decode_ab(args.batch_size, args.batches, args.reps, args.dtype, args.strategy)
    result = {"meta": {"command": "python scripts/bench_key_blocks.py " + " ".join(argv or sys.argv[1:]),
                       "device": device_name(torch.device("cpu")), "dtype": args.dtype,
                       "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"), "kv_block": KV_BLOCK,
                       "strategy": args.strategy},
              "attention_runs": table, "one_more_run": calls, "decodes": records, "summary": summary(records)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "key_blocks.json").write_text(json.dumps(result, indent=1))
    with figure(args.out / "key_blocks.png", 1, 2, figsize=(11, 4.2)) as (fig, (left, right)):
        for q in (1, 2, 3):
            for cut, style in ((0, "-"), (KV_BLOCK, "--")):
                pts = [(r["runs"], r["ms"]) for r in table if r["q"] == q and r["first_key"] == cut]
                left.plot(*zip(*pts), style, marker="o", label=f"q {q}, from key {cut}")
        left.set_xscale("log", base=2)
        left.set_xlabel("runs (kernel calls) a layer")
        left.set_ylabel("ms, one layer's attention")
        left.set_title(f"bs {args.batch_size}, {args.context} keys, {args.dtype}")
        left.legend(fontsize=7)
        s = result["summary"]
        names = ["prefill s", "decode s", "decode ms/step"]
        for k, way in enumerate(("off", "on")):
            vals = [s[way]["prefill_seconds"], s[way]["decode_seconds"], s[way]["decode_ms_a_step"] / 10]
            right.bar([x + (k - 0.5) * 0.4 for x in range(3)], vals, width=0.4,
                      label="key blocks " + ("cut, rows grouped" if way == "on" else "read (before)"))
        right.set_xticks(range(3), [*names[:2], "decode ms/step ÷ 10"])
        right.set_title(f"{args.strategy}, bs {args.batch_size}: medians of {args.reps}, {args.batches} batches", fontsize=9)
        right.legend(fontsize=8)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {args.out / 'key_blocks.json'} and .png")


if __name__ == "__main__":
    main()
