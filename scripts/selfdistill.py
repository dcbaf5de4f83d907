"""Let the base answer training prompts (resumable shards → a ``datasets`` dataset with
provenance), for head training. Same as ``python -m draftheads.training.data``:

    python scripts/selfdistill.py --skip 3072 --limit 768 --exclude-source gsm8k-train --out data_cache/selfdistill-extra

The first 3,072 prompts of train_prompts.jsonl are already answered in
../shared/data/selfdistill_smollm2.jsonl; ``--skip 3072`` starts after them. Re-running the
same command resumes at the first unfinished shard.
"""
from draftheads.training.data import main

if __name__ == "__main__":
    raise SystemExit(main())
