"""Train the shipped Medusa heads for the embedded SmolLM2 base, end to end on a CPU.

    python scripts/train_medusa.py --out checkpoints/smollm2-135m-medusa

1. features: the base (bf16, for speed) reads the self-distilled answers in
   ``../shared/data/selfdistill_smollm2.jsonl`` (the base's own greedy answers) and its last
   hidden states are cached in resumable fp16 shards;
2. train: Medusa heads on the cached features (CE on the base's own next tokens,
   0.8^k head weights), held-out top-k accuracy, checkpoint + trees chosen from the
   accuracies. Re-running skips the finished shards.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from draftheads.decoding.base import fingerprint, load_base
from draftheads.training.features import extract_features, read_jsonl, selfdistill_examples, load_shards
from draftheads.training.medusa_trainer import MedusaTrainConfig, train_and_save

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "selfdistill_smollm2.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--features", default="data_cache/features-smollm2-selfdistill")
    parser.add_argument("--out", default="checkpoints/smollm2-135m-medusa")
    parser.add_argument("--limit", type=int, default=0, help="use only the first N records (0 = all)")
    parser.add_argument("--eval-examples", type=int, default=256)
    parser.add_argument("--features-only", action="store_true")
    MedusaTrainConfig.add_arguments(parser)
    args = parser.parse_args(argv)

    base, tokenizer = load_base(dtype=torch.bfloat16)
    fp = fingerprint(base).to_dict()
    records = list(read_jsonl(args.data))
    if args.limit:
        records = records[: args.limit]
    examples = selfdistill_examples(records, tokenizer)
    started = time.time()
    paths = extract_features(base, examples, args.features, fp)
    print(f"features: {len(paths)} shards in {time.time() - started:.0f}s", file=sys.stderr)
    if args.features_only:
        return 0
    shard_examples = 128
    n_eval_shards = max(1, args.eval_examples // shard_examples)
    train = load_shards(paths[:-n_eval_shards], fp)
    held_out = load_shards(paths[-n_eval_shards:], fp)
    config = MedusaTrainConfig.from_arguments(args)
    provenance = {"data": Path(args.data).name, "records": len(records), "command": " ".join(["python"] + sys.argv),
                  "feature_dtype": "bfloat16 base, fp16 cache"}
    train_and_save(config, train, held_out, base, args.out, provenance)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
