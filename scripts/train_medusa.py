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
from draftheads.training.features import (SHARD_EXAMPLES, extract_features, load_shards, read_jsonl,
                                          selfdistill_examples)
from draftheads.training.medusa_trainer import MedusaTrainConfig, train_and_save
from draftheads.training.selfdistill import read_shards

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "selfdistill_smollm2.jsonl"


def read_records(source: Path) -> list[dict]:
    """A JSONL file, or a directory of answer shards written by scripts/selfdistill.py."""
    if source.is_dir():
        return read_shards(sorted(source.glob("answers-*.jsonl")))
    return list(read_jsonl(source))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", action="append", default=None,
                        help="self-distilled JSONL file or directory of answer shards; repeatable "
                             f"(default: {DEFAULT_DATA}); held-out positions come from the first")
    parser.add_argument("--features", default="data_cache/features-smollm2-selfdistill",
                        help="feature cache of the first --data; the others get <features>-<name>")
    parser.add_argument("--out", default="checkpoints/smollm2-135m-medusa")
    parser.add_argument("--limit", type=int, default=0, help="use only the first N records (0 = all)")
    parser.add_argument("--eval-examples", type=int, default=256)
    parser.add_argument("--features-only", action="store_true")
    MedusaTrainConfig.add_arguments(parser)
    args = parser.parse_args(argv)

    base, tokenizer = load_base(dtype=torch.bfloat16)
    fp = fingerprint(base).to_dict()
    sources = args.data or [str(DEFAULT_DATA)]
    train_paths, eval_paths, total_records = [], [], 0
    for number, source in enumerate(sources):
        records = read_records(Path(source))
        if args.limit:
            records = records[: args.limit]
        total_records += len(records)
        examples = selfdistill_examples(records, tokenizer)
        started = time.time()
        cache = args.features if number == 0 else f"{args.features}-{Path(source).stem}"
        paths = extract_features(base, examples, cache, fp)
        print(f"features of {source}: {len(paths)} shards in {time.time() - started:.0f}s", file=sys.stderr)
        if number == 0:
            n_eval_shards = max(1, args.eval_examples // SHARD_EXAMPLES)
            eval_paths, paths = paths[-n_eval_shards:], paths[:-n_eval_shards]
        train_paths += paths
    if args.features_only:
        return 0
    train = load_shards(train_paths, fp)
    held_out = load_shards(eval_paths, fp)
    config = MedusaTrainConfig.from_arguments(args)
    provenance = {"data": ", ".join(Path(s).name for s in sources), "records": total_records,
                  "command": " ".join(["python"] + sys.argv), "feature_dtype": "bfloat16 base, fp16 cache"}
    train_and_save(config, train, held_out, base, args.out, provenance)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
