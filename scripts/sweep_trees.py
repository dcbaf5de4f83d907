"""Measure tokens/s and τ of every stored tree budget (and plain HF generate) on a few
prompts, in one run, to pick a checkpoint's default budget for this machine.

    python scripts/sweep_trees.py --heads checkpoints/smollm2-135m-medusa --limit 6 --out results/trees/sweep
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from draftheads.bench import timed
from draftheads.arguments import find_heads
from draftheads.prompts import chat_input, read_prompts
from draftheads.decoding import DraftHeadsModel, tree_for_budget
from draftheads.decoding.loop import tau


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-medusa")
    parser.add_argument("--prompts", default="mt-bench", help="a built-in prompt set or a JSON-lines file")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--budgets", default="0,1,2,3,4,6,8,12,16,24")
    parser.add_argument("--out", default="results/trees/sweep")
    args = parser.parse_args()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = DraftHeadsModel.from_pretrained(find_heads(args.heads), dtype=dtype)
    prompts = [chat_input(model.tokenizer, p["prompt"]) for p in read_prompts(args.prompts, None)[:: max(1, 80 // args.limit)][: args.limit]]
    budgets = [int(b) for b in args.budgets.split(",")]
    rows = {"hf": {"tokens": 0, "seconds": 0.0}} | {b: {"tokens": 0, "seconds": 0.0, "steps": 0, "accepted": 0} for b in budgets}
    model.generate(prompts[0], max_new_tokens=8)
    for ids in prompts:
        out, seconds = timed(lambda: model.base.generate(ids, attention_mask=torch.ones_like(ids),
                                                         max_new_tokens=args.max_new_tokens, do_sample=False))
        rows["hf"]["seconds"] += seconds
        rows["hf"]["tokens"] += out.shape[1] - ids.shape[1]
        for budget in budgets:
            model.policy.tree = tree_for_budget(model.heads, budget)
            out, seconds = timed(lambda: model.generate(ids, max_new_tokens=args.max_new_tokens))
            row = rows[budget]
            row["seconds"] += seconds
            row["tokens"] += out.shape[1] - ids.shape[1]
            row["steps"] += model.last_stats.steps
            row["accepted"] += sum(model.last_stats.accepted)
    hf_tps = rows["hf"]["tokens"] / rows["hf"]["seconds"]
    summary = {"dtype": args.dtype, "hf_tokens_per_second": round(hf_tps, 2), "budgets": {}}
    for budget in budgets:
        row = rows[budget]
        tps = row["tokens"] / row["seconds"]
        summary["budgets"][budget] = {"tokens_per_second": round(tps, 2), "speedup": round(tps / hf_tps, 3),
                                      "tau": round(tau(row["accepted"], row["steps"]), 3)}
        print(f"budget {budget:>3}: {tps:6.2f} tok/s  speedup {tps / hf_tps:.2f}x  τ {summary['budgets'][budget]['tau']:.2f}")
    print(f"HF generate: {hf_tps:.2f} tok/s")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"sweep_{args.dtype}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
