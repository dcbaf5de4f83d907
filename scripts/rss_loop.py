#!/usr/bin/env python3
"""Memory over a long ``generate`` loop (issue 22): 1,000 calls with short MT-Bench prompts and
8 new tokens, alternating batch size 1 and batch size 4 (500 calls each, one loop: measured
times in the JSON), recording the process RSS after a gc at calls 1, 500 and 1,000
(and every 100 for the noise). Growth beyond noise would mean something (cache, stats,
scores) is kept between calls.

    taskset -c 1 env OMP_NUM_THREADS=1 python scripts/rss_loop.py --calls 1000 --out results/rss_loop/rss.json
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path

import torch

from draftheads.bench import left_pad
from draftheads.prompts import read_prompts
from draftheads.decoding import DraftHeadsModel


def rss_mib() -> float:
    """Resident set size of this process (Linux /proc), MiB."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def loop(model: DraftHeadsModel, batches: list[tuple[torch.Tensor, torch.Tensor]], calls: int,
         marks: set[int], pad: int) -> dict:
    """Call generate ``calls`` times cycling over ``batches``; RSS (after a gc) at ``marks``."""
    out, started = {}, time.perf_counter()
    for call in range(1, calls + 1):
        ids, mask = batches[(call - 1) % len(batches)]
        model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=pad)
        if call in marks:
            gc.collect()
            out[str(call)] = round(rss_mib(), 1)
            print(f"call {call} (bs {ids.shape[0]}): RSS {out[str(call)]} MiB, "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    return {"rss_mib_after_call": out, "seconds": round(time.perf_counter() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-hydra")
    parser.add_argument("--prompts", default="mt-bench", help="a built-in prompt set or a JSON-lines file")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--out", default="results/rss_loop/rss.json")
    args = parser.parse_args()
    model = DraftHeadsModel.from_pretrained(args.heads)
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    # short prompts: the first 80 characters of 16 MT-Bench questions, without the chat template
    prompts = [model.tokenizer(p["prompt"][:80])["input_ids"] for p in read_prompts(args.prompts, 16)]
    marks = {1, args.calls // 2, args.calls, *range(100, args.calls, 100)}
    result = {"command": "scripts/rss_loop.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
              "heads": args.heads, "max_new_tokens": 8, "calls": args.calls, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "machine": platform.machine(),
              "prompt_tokens": [len(p) for p in prompts], "rss_mib_after_load": round(rss_mib(), 1)}
    singles = [left_pad([p], pad) for p in prompts]
    fours = [left_pad(prompts[i: i + 4], pad) for i in range(0, len(prompts), 4)]
    alternating = [batch for pair in zip(singles, fours * 4) for batch in pair]  # bs 1, bs 4, bs 1, ...
    result["loop"] = loop(model, alternating, args.calls, marks, pad)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["loop"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
