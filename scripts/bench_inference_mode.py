"""The default decoder (shipped heads + lookups, the calibrated tree, bs 1, greedy) with its loop
under ``torch.inference_mode`` (``decoding.output.LOOP_MODE``, the default) against the same
loop under ``torch.no_grad`` (what it ran before), on the dev prompts. Per prompt both ways run
back to back on the same model, the order alternating; tokens/s, ms per verification step, and
whether the two answers are the same tokens.

    python scripts/bench_inference_mode.py --out results/inference_mode/avx512_bf16
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python scripts/bench_inference_mode.py --out results/inference_mode/avx2_fp32

Writes ``inference_mode.json`` and ``inference_mode.png``.
"""
from __future__ import annotations

import functools
import json
import sys
import time
from contextlib import contextmanager

import torch

from draftheads.bench.ab import ab_parser, ab_records, ab_totals
from draftheads.decoding.calibration import device_name
from draftheads.prompts import DEV_PROMPTS
from draftheads.training.figures import figure

MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


@contextmanager
def loop_mode(mode):
    """The decoder's loop under ``mode`` inside the block."""
    from draftheads.decoding import output

    kept, output.LOOP_MODE = output.LOOP_MODE, mode
    try:
        yield
    finally:
        output.LOOP_MODE = kept


def main(argv=None) -> None:
    args = ab_parser(__doc__.split("\n\n")[0], "results/inference_mode").parse_args(argv)
    from draftheads.decoding import DraftHeadsModel
    from draftheads.prompts import read_prompts

    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = DraftHeadsModel.from_pretrained(args.heads, dtype=args.dtype)
    prompts = read_prompts(DEV_PROMPTS)
    from draftheads.prompts import chat_input
    model.generate(chat_input(model.tokenizer, prompts[0]["prompt"]), max_new_tokens=16)  # warm-up
    ways = {name: functools.partial(loop_mode, mode) for name, mode in MODES.items()}
    records = ab_records(model, prompts, ways, args.max_new_tokens)
    summary = ab_totals(records, list(MODES))
    dtype = str(model.base.dtype).removeprefix("torch.")
    result = {"meta": {"command": "python scripts/bench_inference_mode.py " + " ".join(argv or sys.argv[1:]),
                       "device": device_name(torch.device("cpu")), "threads": torch.get_num_threads(),
                       "date": time.strftime("%Y-%m-%d"), "dtype": dtype, "heads": args.heads,
                       "prompts": list(DEV_PROMPTS), "max_new_tokens": args.max_new_tokens},
              "summary": summary, "prompts": records}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "inference_mode.json").write_text(json.dumps(result, indent=1))
    with figure(args.out / "inference_mode.png", 1, 2, figsize=(9, 3.6)) as (fig, axes):
        names = list(MODES)
        for ax, key, label in zip(axes, ("tokens_per_second", "ms_per_step"), ("tokens/s", "ms a verification step")):
            ax.bar(range(len(names)), [summary[n][key] for n in names], color=["C0", "C1"])
            ax.set_xticks(range(len(names)), names)
            ax.set_ylabel(label)
        fig.suptitle(f"The default decoder's loop, {len(records)} dev prompts, {dtype}, bs 1 "
                     f"({summary['same_tokens']} of {len(records)} answers the same)")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out / 'inference_mode.json'} and .png")


if __name__ == "__main__":
    main()
