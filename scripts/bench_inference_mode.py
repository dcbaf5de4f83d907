"""The default decoder (shipped heads + lookups, the calibrated tree, bs 1, greedy) with its loop
under ``torch.inference_mode`` (``decoding.generate.LOOP_MODE``, the default) against the same
loop under ``torch.no_grad`` (what it ran before), on the dev prompts. Per prompt both ways run
back to back on the same model, the order alternating; tokens/s, ms per verification step, and
whether the two answers are the same tokens.

    python scripts/bench_inference_mode.py --out results/inference_mode/avx512_bf16
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python scripts/bench_inference_mode.py --out results/inference_mode/avx2_fp32

Writes ``inference_mode.json`` and ``inference_mode.png``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from draftheads.decoding.calibration import device_name
from draftheads.prompts import DEV_PROMPTS
from draftheads.training.figures import figure

MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def run(model, prompts: list[dict], max_new_tokens: int, log=print) -> list[dict]:
    """One record per prompt: each mode's new tokens, steps and seconds, and whether they agree."""
    from draftheads.decoding import generate as generate_module
    from draftheads.prompts import chat_input

    names = list(MODES)
    records = []
    for i, item in enumerate(prompts):
        ids = chat_input(model.tokenizer, item["prompt"])
        record = {"category": item.get("category", "?"), "prompt_tokens": int(ids.shape[1])}
        answers = {}
        for name in (names if i % 2 == 0 else names[::-1]):
            generate_module.LOOP_MODE = MODES[name]
            try:
                start = time.perf_counter()
                out = model.generate(ids, max_new_tokens=max_new_tokens)
                seconds = time.perf_counter() - start
            finally:
                generate_module.LOOP_MODE = torch.inference_mode
            answers[name] = out[0, ids.shape[1]:].tolist()
            record[name] = {"new_tokens": len(answers[name]), "steps": model.last_stats.steps,
                            "seconds": round(seconds, 4)}
        record["same_tokens"] = answers[names[0]] == answers[names[1]]
        records.append(record)
        log(f"prompt {i}: " + ", ".join(f"{n} {record[n]['new_tokens']} tokens, {record[n]['steps']} steps, "
                                        f"{record[n]['seconds']:.2f} s" for n in names))
    return records


def totals(records: list[dict]) -> dict:
    out = {}
    for name in MODES:
        tokens = sum(r[name]["new_tokens"] for r in records)
        steps = sum(r[name]["steps"] for r in records)
        seconds = sum(r[name]["seconds"] for r in records)
        out[name] = {"tokens_per_second": round(tokens / seconds, 2), "ms_per_step": round(1e3 * seconds / steps, 2),
                     "tau": round((tokens - len(records)) / max(1, steps), 4)}
    ratios = [r["no_grad"]["seconds"] / r["inference_mode"]["seconds"] for r in records]
    out["inference_over_no_grad"] = {
        "tokens_per_second": round(out["inference_mode"]["tokens_per_second"] / out["no_grad"]["tokens_per_second"], 4),
        "ms_per_step": round(out["inference_mode"]["ms_per_step"] / out["no_grad"]["ms_per_step"], 4),
        "median_prompt_speedup": round(statistics.median(ratios), 4)}
    out["same_tokens"] = sum(r["same_tokens"] for r in records)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="checkpoints/smollm2-135m-hydra")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("results/inference_mode"))
    args = ap.parse_args(argv)
    from draftheads.decoding import DraftHeadsModel
    from draftheads.prompts import read_prompts

    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = DraftHeadsModel.from_pretrained(args.heads, dtype=args.dtype)
    prompts = read_prompts(DEV_PROMPTS)
    from draftheads.prompts import chat_input
    model.generate(chat_input(model.tokenizer, prompts[0]["prompt"]), max_new_tokens=16)  # warm-up
    records = run(model, prompts, args.max_new_tokens)
    summary = totals(records)
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
