"""Held-out accuracy of head checkpoints on the base's own answers to an evaluation set.

    python scripts/eval_heads.py checkpoints/smollm2-135m-medusa checkpoints/smollm2-135m-hydra \\
        --prompts ../shared/data/mt_bench.jsonl --limit 20 --out results/heads_eval.json

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
import tempfile
from pathlib import Path

import torch

from draftheads.cli import read_prompts
from draftheads.decoding.base import fingerprint, load_base
from draftheads.decoding.tree import tree_from_paths
from draftheads.heads import load_heads
from draftheads.training.features import (chat_prompt_ids, extract_features, load_shards, read_jsonl,
                                          selfdistill_examples)
from draftheads.training.losses import topk_accuracy
from draftheads.training.train import rank_table


def base_answers(base, tokenizer, prompts: list[dict], max_new_tokens: int, cache: Path) -> list[dict]:
    """The base's greedy answers (one prompt at a time: no padding effects), cached as JSONL."""
    if cache.is_file():
        records = list(read_jsonl(cache))
        if [r["prompt"] for r in records] == [p["prompt"] for p in prompts]:
            return records
    records = []
    for item in prompts:
        ids = torch.tensor([chat_prompt_ids(tokenizer, item["prompt"])])
        out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        records.append({"id": item["id"], "category": item["category"], "prompt": item["prompt"],
                        "response_ids": out[0, ids.shape[1]:].tolist()})
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def tree_tau(ranks: torch.Tensor, paths: list[list[int]]) -> float:
    """τ of a fixed tree on measured ranks: 1 + mean depth of the deepest fully matching path."""
    tree = tree_from_paths(paths)
    depth = ranks.shape[1]
    best = torch.zeros(ranks.shape[0])
    for path in tree.paths:
        if len(path) > depth:
            continue
        hit = (ranks[:, : len(path)] == torch.tensor(path)).all(1)
        best = torch.where(hit, torch.maximum(best, torch.tensor(float(len(path)))), best)
    return round(1.0 + float(best.mean()), 4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--prompts", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "data"
                                                 / "mt_bench.jsonl"))
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    base, tokenizer = load_base(dtype=args.dtype)
    fp = fingerprint(base).to_dict()
    prompts = read_prompts(args.prompts, args.limit)
    cache = Path("data_cache") / f"answers-{Path(args.prompts).stem}-{args.limit}-{args.max_new_tokens}-{args.dtype}.jsonl"
    records = base_answers(base, tokenizer, prompts, args.max_new_tokens, cache)
    with tempfile.TemporaryDirectory() as tmp:
        features = load_shards(extract_features(base, selfdistill_examples(records, tokenizer), tmp, fp), fp)
    results = {"prompts": args.prompts, "limit": args.limit, "positions": len(features), "dtype": args.dtype,
               "checkpoints": {}}
    for path in args.checkpoints:
        heads = load_heads(path, expected_fingerprint=fp, dtype=torch.float32)
        heads.bind(base.get_output_embeddings().weight.float(), base.get_input_embeddings().weight.float())
        ranks = rank_table(heads, features, "teacher", torch.float32, "cpu")
        taus = {budget: tree_tau(ranks, paths) for budget, paths in heads.config.trees.items()}
        results["checkpoints"][path] = {"family": heads.family, "accuracy": topk_accuracy(ranks), "tree_tau": taus}
        print(f"{path}: {heads.family} top1 {topk_accuracy(ranks)['top1']} τ by budget {taus}", file=sys.stderr)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
