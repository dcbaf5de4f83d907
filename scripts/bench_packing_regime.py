"""The default decoder (shipped heads + lookups, the calibrated tree, bs 1, greedy) with its
packing plan timed as the decoder now times it — each product over copies of its weight that
stream from memory, as a base's weights do in decoding (``decoding.base.plan.STREAM_BYTES``) —
against the plan timed with each weight warm in cache (what it was before), on the dev prompts.
Both plans are measured in this process; per prompt both run back to back on one model, the order
alternating. Writes the two plans' paths per shape and row bucket, tokens/s, ms a step, and
whether the answers are the same tokens.

    python scripts/bench_packing_regime.py --out results/packing_regime/avx512_bf16
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python scripts/bench_packing_regime.py --out results/packing_regime/avx2_fp32
"""
from __future__ import annotations

import functools
import json
import sys
import time
from contextlib import contextmanager

import torch

from draftheads.bench.ab import ab_parser, ab_records, ab_totals
from draftheads.decoding.base import plan as plan_module
from draftheads.decoding.base.siblings import stacking_exact
from draftheads.decoding.calibration import device_name
from draftheads.prompts import DEV_PROMPTS
from draftheads.training.figures import figure

WAYS = ("streamed", "warm")


@contextmanager
def plan_timings(timings: dict):
    """The process's packing plan decides from ``timings`` inside the block."""
    plan = plan_module.PLAN
    kept = dict(plan.timings)

    def use(entries: dict) -> None:
        plan.replace(entries)
        stacking_exact.cache_clear()  # whether a fused product is bit-exact depends on the paths taken

    use(timings)
    try:
        yield
    finally:
        use(kept)


def warm_plan(streamed: dict) -> dict:
    """Every shape of the streamed plan timed again with its weight warm in cache."""
    warm = {}
    for key in streamed:
        dtype, shape = key.split(" ")
        out_features, in_features = (int(n) for n in shape.split("x"))
        warm[key] = plan_module.measure_shape(getattr(torch, dtype), out_features, in_features, footprint=0)
    return warm


def main(argv=None) -> None:
    args = ab_parser(__doc__.split("\n\n")[0], "results/packing_regime").parse_args(argv)
    from draftheads.decoding import DraftHeadsModel
    from draftheads.prompts import chat_input, read_prompts

    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = DraftHeadsModel.from_pretrained(args.heads, dtype=args.dtype)
    plans = {"streamed": dict(plan_module.PLAN.timings)}
    plans["warm"] = warm_plan(plans["streamed"])
    prompts = read_prompts(DEV_PROMPTS)
    for name in WAYS:
        with plan_timings(plans[name]):
            model.generate(chat_input(model.tokenizer, prompts[0]["prompt"]), max_new_tokens=16)  # warm-up
    ways = {name: functools.partial(plan_timings, plans[name]) for name in WAYS}
    records = ab_records(model, prompts, ways, args.max_new_tokens)
    summary = ab_totals(records, list(WAYS))
    paths = {name: {key: list(plan_module.fastest_paths(entry)) for key, entry in plans[name].items()} for name in WAYS}
    dtype = str(model.base.dtype).removeprefix("torch.")
    result = {"meta": {"command": "python scripts/bench_packing_regime.py " + " ".join(argv or sys.argv[1:]),
                       "device": device_name(torch.device("cpu")), "threads": torch.get_num_threads(),
                       "date": time.strftime("%Y-%m-%d"), "dtype": dtype, "heads": args.heads,
                       "stream_bytes": plan_module.STREAM_BYTES, "row_buckets": list(plan_module.ROW_BUCKETS),
                       "prompts": list(DEV_PROMPTS), "max_new_tokens": args.max_new_tokens},
              "summary": summary, "paths": paths, "timings": plans, "prompts": records}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "packing_regime.json").write_text(json.dumps(result, indent=1))
    with figure(args.out / "packing_regime.png", 1, 2, figsize=(9, 3.6)) as (fig, axes):
        for ax, key, label in zip(axes, ("tokens_per_second", "ms_per_step"), ("tokens/s", "ms a verification step")):
            ax.bar(range(len(WAYS)), [summary[n][key] for n in WAYS], color=["C0", "C1"])
            ax.set_xticks(range(len(WAYS)), [f"plan timed {n}" for n in WAYS])
            ax.set_ylabel(label)
        fig.suptitle(f"The default decoder, {len(records)} dev prompts, {dtype}, bs 1 "
                     f"({summary['same_tokens']} of {len(records)} answers the same)")
    print(json.dumps({name: {k: v for k, v in paths[name].items()} for name in WAYS}, indent=None)[:2000])
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out / 'packing_regime.json'} and .png")


if __name__ == "__main__":
    main()
