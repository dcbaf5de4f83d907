"""How much of the evaluation answers a draft vocabulary can draft at all.

    python scripts/draft_vocab_coverage.py --job data_cache/selfdistill-smollm2 \\
        --eval-job data_cache/eval-clean-smollm2 --sizes 8192,12288,16384,24576,32768 \\
        --out results/data_scaling/draft_vocab_coverage.json

Heads draft over the ``draft_vocab_size`` most frequent tokens of their training answers
(:func:`draftheads.training.losses.draft_vocab`, ties to the prompts' tokens); a token outside it
is never drafted, so the share of the evaluation answers' tokens inside it caps every head's
top-1 there. Per size and per prompt source of the evaluation job: that share, for the vocabulary
chosen from the answers alone and with the prompts' tokens breaking ties.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from draftheads.training.data.job_data import sequence_sources
from draftheads.training.losses import draft_vocab


def job_sequences(job: Path) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Each sequence of a job's finished shards as (its prompt source, prompt ids, answer ids):
    token ids only, no states."""
    for folder in sorted((job / "shards").glob("shard-[0-9]*")):
        tokens, offsets = np.load(folder / "tokens.npy"), np.load(folder / "offsets.npy")
        starts = np.load(folder / "answer_starts.npy")
        for k, source in enumerate(sequence_sources(folder, len(starts))):
            yield source, tokens[offsets[k]: offsets[k] + starts[k]], tokens[offsets[k] + starts[k]: offsets[k + 1]]


def token_counts(job: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """All answer tokens and all prompt tokens of a job."""
    answers, prompts = [], []
    for _, prompt, answer in job_sequences(job):
        prompts.append(prompt)
        answers.append(answer)
    return (torch.from_numpy(np.concatenate(answers).astype(np.int64)),
            torch.from_numpy(np.concatenate(prompts).astype(np.int64)))


def eval_answers(job: Path) -> dict[str, np.ndarray]:
    """The evaluation job's answer tokens per prompt source."""
    groups: dict[str, list[np.ndarray]] = {}
    for source, _, answer in job_sequences(job):
        groups.setdefault(source, []).append(answer)
    return {source: np.concatenate(parts).astype(np.int64) for source, parts in groups.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", required=True)
    parser.add_argument("--eval-job", required=True)
    parser.add_argument("--sizes", default="8192,12288,16384,24576,32768")
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    answers, prompts = token_counts(Path(args.job))
    groups = eval_answers(Path(args.eval_job))
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        row = {"size": size}
        for name, then in (("answers", None), ("answers_then_prompts", prompts)):
            inside = np.zeros(args.vocab_size, bool)
            inside[draft_vocab(answers, size, args.vocab_size, then).numpy()] = True
            row[name] = {source: round(float(inside[tokens].mean()), 4) for source, tokens in groups.items()}
        rows.append(row)
        print(json.dumps(row))
    result = {"job": args.job, "eval_job": args.eval_job, "answer_tokens": int(answers.numel()),
              "distinct_answer_tokens": int(answers.unique().numel()),
              "distinct_prompt_tokens": int(prompts.unique().numel()),
              "eval_tokens": {s: int(t.size) for s, t in groups.items()}, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
