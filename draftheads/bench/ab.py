"""Two (or more) ways of running the same decoder, compared prompt by prompt: each prompt runs
every way back to back on one model, the order alternating, so a slow spell of a shared machine
hits the ways alike (the scripts that A/B one switch: ``scripts/bench_inference_mode.py``,
``scripts/bench_packing_regime.py``)."""
from __future__ import annotations

import argparse
import statistics
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
