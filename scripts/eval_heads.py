"""Held-out accuracy of head checkpoints on the base's own answers to an evaluation set.

    python scripts/eval_heads.py checkpoints/smollm2-135m-medusa checkpoints/smollm2-135m-hydra \\
        --prompts mt-bench --limit 20 --out results/heads/heads_eval/eval.json

The base (same dtype as decoding, fp32 by default) answers the prompts greedily (cached under
``data_cache/``), its hidden states are extracted once, and every checkpoint is scored on the
same positions: per-head top-1/top-5 and the τ each stored tree would reach (the joint
empirical acceptance of its paths, no independence assumption). A quick predictor of the τ a
full ``draftheads bench`` measures, and of how far the evaluation text is from the training text.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftheads.prompts import read_prompts
from draftheads.decoding.base.loading import load_base
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.head_scoring import answer_features, answers_cache_path, base_answers, score_heads
from draftheads.heads import load_heads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--prompts", default="mt-bench", help="a built-in prompt set or a JSON-lines file")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    base, tokenizer = load_base(dtype=args.dtype)
    fp = fingerprint(base).to_dict()
    prompts = read_prompts(args.prompts, args.limit)
    cache = answers_cache_path(args.prompts, args.limit, args.max_new_tokens, args.dtype)
    answers = base_answers(base, tokenizer, prompts, args.max_new_tokens, cache)
    tables = {(): answer_features(base, tokenizer, answers)}  # per set of base layers the heads read
    results = {"prompts": args.prompts, "limit": args.limit, "positions": len(tables[()]), "dtype": args.dtype,
               "checkpoints": {}}
    for path in args.checkpoints:
        heads = load_heads(path, expected_fingerprint=fp, dtype=torch.float32)
        if heads.feature_layers not in tables:
            tables[heads.feature_layers] = answer_features(base, tokenizer, answers, heads.feature_layers)
        scored = score_heads(heads, base, tables[heads.feature_layers])
        results["checkpoints"][path] = {"family": heads.family, "accuracy": scored["accuracy"],
                                        "tree_tau": scored["tree_tau"]}
        print(f"{path}: {heads.family} top1 {scored['accuracy']['top1']} τ by budget {scored['tree_tau']}",
              file=sys.stderr)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
