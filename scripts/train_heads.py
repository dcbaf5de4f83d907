"""Train shipped draft heads (any family) for the embedded SmolLM2 base, end to end on a CPU.

    python scripts/train_heads.py --family hydra --out checkpoints/smollm2-135m-hydra \\
        --conversations ../shared/data/train_conversations.jsonl --sources gpteacher-roleplay,self-instruct

1. features: the base (bf16, for speed) reads the self-distilled answers in
   ``../shared/data/selfdistill_smollm2.jsonl`` (the base's own greedy answers) and,
   optionally, reference conversations; its last hidden states and its own greedy choices
   (teacher labels) are cached in resumable fp16 shards;
2. train: heads on the cached features (CE on the base's greedy choices, 0.8^k head
   weights), held-out top-k accuracy, checkpoint + trees chosen from the accuracies.
   Re-running skips the finished shards.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from draftheads.decoding.base import fingerprint, load_base
from draftheads.training.features import (SHARD_EXAMPLES, conversation_examples, extract_features,
                                          load_shards, read_jsonl, selfdistill_examples)
from draftheads.training.heads_trainer import HeadTrainConfig, train_and_save
from draftheads.training.data import read_shards

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DEFAULT_DATA = SHARED / "selfdistill_smollm2.jsonl"


def read_records(source: Path) -> list[dict]:
    """A JSONL file, or a directory of answer shards written by scripts/selfdistill.py."""
    if source.is_dir():
        return read_shards(sorted(source.glob("answers-*.jsonl")))
    return list(read_jsonl(source))


def select_records(records: list[dict], sources: str, caps: list[str]) -> list[dict]:
    """Keep records whose ``source`` starts with one of the comma-separated ``sources``
    (all when empty), at most N per ``PREFIX=N`` cap, in file order."""
    keep = tuple(s for s in sources.split(",") if s)
    limits = {}
    for cap in caps:
        prefix, _, count = cap.partition("=")
        if not prefix or not count.isdigit():
            raise SystemExit(f"error: --source-cap wants PREFIX=N, got {cap!r}")
        limits[prefix] = int(count)
    taken = dict.fromkeys(limits, 0)
    selected = []
    for record in records:
        source = str(record.get("source", ""))
        if keep and not source.startswith(keep):
            continue
        capped = [p for p in limits if source.startswith(p)]
        if any(taken[p] >= limits[p] for p in capped):
            continue
        for p in capped:
            taken[p] += 1
        selected.append(record)
    return selected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", action="append", default=None,
                        help="self-distilled JSONL file or directory of answer shards; repeatable "
                             f"(default: {DEFAULT_DATA}); held-out positions come from the first")
    parser.add_argument("--conversations", default=None,
                        help="reference conversations (JSONL with 'messages'), labelled by the base itself")
    parser.add_argument("--sources", default="",
                        help="comma-separated prefixes of the records' 'source' to keep (default: all)")
    parser.add_argument("--source-cap", action="append", default=[], metavar="PREFIX=N",
                        help="keep at most N records whose source starts with PREFIX (repeatable)")
    parser.add_argument("--features", default="data_cache/features-smollm2-selfdistill",
                        help="feature cache of the first --data; the others get <features>-<name>")
    parser.add_argument("--out", default="checkpoints/smollm2-135m-medusa")
    parser.add_argument("--limit", type=int, default=0, help="use only the first N records of each source (0 = all)")
    parser.add_argument("--eval-examples", type=int, default=256)
    parser.add_argument("--features-only", action="store_true")
    HeadTrainConfig.add_arguments(parser)
    args = parser.parse_args(argv)

    base, tokenizer = load_base(dtype=torch.bfloat16)
    fp = fingerprint(base).to_dict()
    sources = [Path(s) for s in (args.data or [str(DEFAULT_DATA)])]
    jobs = [(s, selfdistill_examples, args.features if i == 0 else f"{args.features}-{s.stem}")
            for i, s in enumerate(sources)]
    if args.conversations:
        jobs.append((Path(args.conversations), conversation_examples, f"{args.features}-conversations"))
    train_paths, eval_paths, total_records = [], [], 0
    for number, (source, to_examples, cache) in enumerate(jobs):
        records = select_records(read_records(source), args.sources, args.source_cap)
        if args.limit:
            records = records[: args.limit]
        total_records += len(records)
        started = time.time()
        paths = extract_features(base, to_examples(records, tokenizer), cache, fp)
        print(f"features of {source}: {len(records)} records, {len(paths)} shards in {time.time() - started:.0f}s",
              file=sys.stderr)
        if number == 0:
            n_eval_shards = max(1, args.eval_examples // SHARD_EXAMPLES)
            eval_paths, paths = paths[-n_eval_shards:], paths[:-n_eval_shards]
        train_paths += paths
    if args.features_only:
        return 0
    train = load_shards(train_paths, fp)
    held_out = load_shards(eval_paths, fp)
    config = HeadTrainConfig.from_arguments(args)
    kinds = "prompts answered by the base itself, greedy"
    if args.sources or args.source_cap:
        kinds += f" (sources {args.sources or 'all'}, caps {args.source_cap or 'none'})"
    if args.conversations:
        kinds += ", plus reference conversations labelled by the base's greedy choices"
    provenance = {"data": ", ".join(s.name for s, _, _ in jobs), "records": total_records, "data_kind": kinds,
                  "command": " ".join(["python"] + sys.argv), "feature_dtype": "bfloat16 base, fp16 cache"}
    train_and_save(config, train, held_out, base, args.out, provenance)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
