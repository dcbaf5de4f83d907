"""The default decoder (shipped heads + lookups, the calibrated tree, bs 1, greedy) with its
packing plan timed as the decoder now times it — each product over copies of its weight that
stream from memory, as a base's weights do in decoding (``decoding.base.plan.STREAM_BYTES``) —
against the plan timed with each weight warm in cache (what it was before), on the dev prompts.
Both plans are measured in this process; per prompt both run back to back on one model, the order
alternating. Writes the two plans' paths per shape and row bucket, tokens/s, ms a step, and
whether the answers are the same tokens.

    python scripts/bench_packing_regime.py --out results/cpu_classes/packing_regime/avx512_bf16
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python scripts/bench_packing_regime.py --out results/cpu_classes/packing_regime/avx2_fp32
"""
from __future__ import annotations

import functools
import json
from contextlib import contextmanager

import torch

from draftheads.bench.ab import ab_meta, ab_parser, ab_records, ab_totals, ab_write
from draftheads.decoding.base import plan as plan_module
from draftheads.decoding.base.siblings import stacking_exact
from draftheads.prompts import DEV_PROMPTS

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
    args = ab_parser(__doc__.split("\n\n")[0], "results/cpu_classes/packing_regime").parse_args(argv)
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
    meta = ab_meta("bench_packing_regime.py", argv, model, args, DEV_PROMPTS)
    meta.update(stream_bytes=plan_module.STREAM_BYTES, row_buckets=list(plan_module.ROW_BUCKETS))
    result = {"meta": meta, "summary": summary, "paths": paths, "timings": plans, "prompts": records}
    print(json.dumps(paths, indent=None)[:2000])
    ab_write(args.out, "packing_regime", result, {name: f"plan timed {name}" for name in WAYS}, "The default decoder")


if __name__ == "__main__":
    main()
