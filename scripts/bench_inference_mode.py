"""The default decoder (shipped heads + lookups, the calibrated tree, bs 1, greedy) with its loop
under ``torch.inference_mode`` (``decoding.output.LOOP_MODE``, the default) against the same
loop under ``torch.no_grad`` (what it ran before), on the dev prompts. Per prompt both ways run
back to back on the same model, the order alternating; tokens/s, ms per verification step, and
whether the two answers are the same tokens.

    python scripts/bench_inference_mode.py --out results/loop/inference_mode/avx512_bf16
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python scripts/bench_inference_mode.py --out results/loop/inference_mode/avx2_fp32

Writes ``inference_mode.json`` and ``inference_mode.png``.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

from draftheads.bench.ab import ab_meta, ab_parser, ab_records, ab_totals, ab_write
from draftheads.prompts import DEV_PROMPTS

MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


@contextmanager
def loop_under(mode):
    """The decoder's loop under ``mode`` inside the block (``output.LOOP_MODE`` swapped)."""
    from draftheads.decoding import output

    kept, output.LOOP_MODE = output.LOOP_MODE, mode
    try:
        yield
    finally:
        output.LOOP_MODE = kept


def main(argv=None) -> None:
    args = ab_parser(__doc__.split("\n\n")[0], "results/loop/inference_mode").parse_args(argv)
    from draftheads.decoding import DraftHeadsModel
    from draftheads.prompts import read_prompts

    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = DraftHeadsModel.from_pretrained(args.heads, dtype=args.dtype)
    prompts = read_prompts(DEV_PROMPTS)
    from draftheads.prompts import chat_input
    model.generate(chat_input(model.tokenizer, prompts[0]["prompt"]), max_new_tokens=16)  # warm-up
    ways = {name: functools.partial(loop_under, mode) for name, mode in MODES.items()}
    records = ab_records(model, prompts, ways, args.max_new_tokens)
    summary = ab_totals(records, list(MODES))
    result = {"meta": ab_meta("bench_inference_mode.py", argv, model, args, DEV_PROMPTS),
              "summary": summary, "prompts": records}
    ab_write(args.out, "inference_mode", result, {name: name for name in MODES}, "The default decoder's loop")


if __name__ == "__main__":
    main()
