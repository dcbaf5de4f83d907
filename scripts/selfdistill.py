"""Let the base answer training prompts (resumable shards → a ``datasets`` dataset with
provenance), for head training. Same as ``python -m draftheads.training.data.self_distillation``.
The prompts are a local file or folder, or a Hub dataset id (``--name``, ``--split``, ``--columns`` FROM:TO):

    python scripts/selfdistill.py --prompts openai/gsm8k --name main --columns question:prompt \\
        --limit 3072 --out data_cache/selfdistill-gsm8k
    python scripts/selfdistill.py --prompts ../shared/data/train_prompts.jsonl --skip 3072 --limit 768 \\
        --exclude-source gsm8k-train --out data_cache/selfdistill-extra

On this machine the first 3,072 prompts of the local train_prompts.jsonl are already answered in
selfdistill_smollm2.jsonl beside it; ``--skip 3072`` starts after them. Re-running the same
command resumes at the first unfinished shard.
"""
from draftheads.training.data.self_distillation import main

if __name__ == "__main__":
    raise SystemExit(main())
