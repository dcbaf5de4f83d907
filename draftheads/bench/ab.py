"""Two (or more) ways of running the same decoder, compared prompt by prompt: each prompt runs
every way back to back on one model, the order alternating, so a slow spell of a shared machine
hits the ways alike (the scripts that A/B one switch: ``scripts/bench_inference_mode.py``,
``scripts/bench_packing_regime.py``)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, ContextManager


def ab_parser(description: str, out: str) -> argparse.ArgumentParser:
    """The options every A/B script takes: the heads, the dtype, new tokens a prompt, the output folder."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-hydra")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path(out))
    return parser


def ab_records(model, prompts: list[dict], ways: dict[str, Callable[[], ContextManager]], max_new_tokens: int,
               log=print) -> list[dict]:
    """One record per prompt: each way's new tokens, verification steps and seconds (the way's
    context entered around its call), and whether every way gave the same tokens."""
    from draftheads.prompts import chat_input

    names = list(ways)
    records = []
    for i, item in enumerate(prompts):
        ids = chat_input(model.tokenizer, item["prompt"])
        record = {"category": item.get("category", "?"), "prompt_tokens": int(ids.shape[1])}
        answers = {}
        for name in (names if i % 2 == 0 else names[::-1]):
            with ways[name]():
                start = time.perf_counter()
                out = model.generate(ids, max_new_tokens=max_new_tokens)
                seconds = time.perf_counter() - start
            answers[name] = out[0, ids.shape[1]:].tolist()
            record[name] = {"new_tokens": len(answers[name]), "steps": model.last_stats.steps,
                            "seconds": round(seconds, 4)}
        record["same_tokens"] = all(answers[n] == answers[names[0]] for n in names)
        records.append(record)
        log(f"prompt {i}: " + ", ".join(f"{n} {record[n]['new_tokens']} tokens, {record[n]['steps']} steps, "
                                        f"{record[n]['seconds']:.2f} s" for n in names))
    return records


def ab_totals(records: list[dict], names: list[str]) -> dict:
    """Per way: tokens/s, ms a step and τ over all prompts; the first way over the second (tokens/s,
    ms a step, the median prompt's speedup); how many prompts gave the same tokens every way."""
    out = {}
    for name in names:
        tokens = sum(r[name]["new_tokens"] for r in records)
        steps = sum(r[name]["steps"] for r in records)
        seconds = sum(r[name]["seconds"] for r in records)
        out[name] = {"tokens_per_second": round(tokens / seconds, 2), "ms_per_step": round(1e3 * seconds / steps, 2),
                     "tau": round((tokens - len(records)) / max(1, steps), 4)}
    first, second = names[0], names[1]
    out[f"{first}_over_{second}"] = {
        "tokens_per_second": round(out[first]["tokens_per_second"] / out[second]["tokens_per_second"], 4),
        "ms_per_step": round(out[first]["ms_per_step"] / out[second]["ms_per_step"], 4),
        "median_prompt_speedup": round(statistics.median(r[second]["seconds"] / r[first]["seconds"] for r in records), 4)}
    out["same_tokens"] = sum(r["same_tokens"] for r in records)
    return out


def ab_meta(script: str, argv: list[str] | None, model, args: argparse.Namespace, prompts: list[str]) -> dict:
    """What a result says of its run: the command, the machine, the date, the dtype, the heads,
    the prompts and new tokens."""
    import torch

    from ..decoding.calibration import device_name

    return {"command": f"python scripts/{script} " + " ".join(argv or sys.argv[1:]),
            "device": device_name(torch.device("cpu")), "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"), "dtype": str(model.base.dtype).removeprefix("torch."),
            "heads": args.heads, "prompts": list(prompts), "max_new_tokens": args.max_new_tokens}


def ab_write(out: Path, stem: str, result: dict, labels: dict[str, str], title: str) -> None:
    """``OUT/STEM.json`` (``result``) and ``OUT/STEM.png``: tokens/s and ms a step per way (the
    ways of ``labels``, in its order, labelled by its values), under ``title``."""
    from ..training.figures import figure

    summary, names = result["summary"], list(labels)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    with figure(out / f"{stem}.png", 1, 2, figsize=(9, 3.6)) as (fig, axes):
        for ax, key, label in zip(axes, ("tokens_per_second", "ms_per_step"), ("tokens/s", "ms a verification step")):
            ax.bar(range(len(names)), [summary[n][key] for n in names], color=[f"C{i}" for i in range(len(names))])
            ax.set_xticks(range(len(names)), [labels[n] for n in names])
            ax.set_ylabel(label)
        records = len(result["prompts"])
        fig.suptitle(f"{title}, {records} dev prompts, {result['meta']['dtype']}, bs 1 "
                     f"({summary['same_tokens']} of {records} answers the same)")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out / stem}.json and .png")
