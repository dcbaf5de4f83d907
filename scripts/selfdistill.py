"""Let the embedded base answer training prompts (resumable shards), for head training.

    python scripts/selfdistill.py --skip 3072 --limit 1600 --exclude-source gsm8k-train --out data_cache/selfdistill-extra

The first 3,072 prompts of train_prompts.jsonl are already answered in
../shared/data/selfdistill_smollm2.jsonl; ``--skip`` starts after them.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from draftheads.decoding.base import fingerprint, load_base
from draftheads.training.features import read_jsonl
from draftheads.training.selfdistill import generate_shards

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default=str(DATA / "train_prompts.jsonl"))
    parser.add_argument("--skip", type=int, default=3072)
    parser.add_argument("--limit", type=int, default=1600)
    parser.add_argument("--exclude-source", action="append", default=[])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default="data_cache/selfdistill-extra")
    args = parser.parse_args()
    records = [r for r in list(read_jsonl(args.prompts))[args.skip:] if r.get("source") not in args.exclude_source]
    records = records[: args.limit]
    model, tokenizer = load_base(dtype=torch.bfloat16)
    provenance = {"base_fingerprint": fingerprint(model).to_dict(), "dtype": "bfloat16", "greedy": True,
                  "max_new_tokens": args.max_new_tokens, "prompts": Path(args.prompts).name, "skip": args.skip}
    generate_shards(model, tokenizer, records, args.out, batch_size=args.batch_size,
                    max_new_tokens=args.max_new_tokens, provenance=provenance)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
