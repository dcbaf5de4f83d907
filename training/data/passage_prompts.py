"""Tasks over passages: summaries and questions about texts the base itself wrote (its finished
answers in a self-distillation job), so the training mixture holds long-passage prompts like the
summarization and retrieval-QA ones users send, with no outside text and under the base's licence.

    python -m draftheads.training.data.passage_prompts --job DIR --out DIR/passage_prompts.jsonl --count 512

A passage is one or more consecutive finished answers (of the sources named, in job order) joined
until it reaches ``min_chars``; each passage gets one instruction, summary and question kinds
alternating, their wordings taken in turn. Deterministic: the same job gives the same file.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ...decoding.base.loading import load_tokenizer
from ...core.atomic import write_text_atomic
from .config_cli import parse_config, run_cli
from .records import DataError
from .distill_job import finished_shards
from .distill_shards import ShardError, open_shard

SUMMARY = ("Summarize: {passage}",
           "Summarize the following text.\n\n{passage}",
           "{passage}\n\nSummarize the text above in a few sentences.",
           "Write a short summary of this article:\n\n{passage}")
QUESTION = ("{passage}\n\nWhat is the main point of this passage?",
            "Read the passage below and list its key facts.\n\n{passage}",
            "{passage}\n\nBased on the text above, what should the reader take away from it?",
            "Answer from the passage: which problem does it address, and how?\n\n{passage}")


@dataclass
class PassagePromptsConfig:
    job: str = ""  # a self-distillation job folder whose answers are the passages
    out: str = ""
    count: int = 512
    min_chars: int = 1500  # consecutive answers are joined until a passage is this long
    max_chars: int = 4000
    skip_sources: list[str] = field(default_factory=lambda: ["gsm8k", "gpteacher-codegen"])  # id prefixes: math, code
    base: str | None = None  # the base whose tokenizer reads the job's ids


def answers(job: Path, skip: list[str], tokenizer):
    """The job's finished answers as text, in job order, leaving out the sources ``skip`` names."""
    shards = finished_shards(job)
    if not shards:
        raise DataError(f"{job}: no finished shards; run python -m draftheads.training.data.distill_job --out {job} first.")
    for _, folder in shards:
        try:
            shard = open_shard(folder, {}, f"python -m draftheads.training.data.distill_job --out {job}", with_hidden=False)
        except ShardError as err:
            raise DataError(str(err)) from None
        for k, text_id in enumerate(shard.ids):  # an id is its source's tag and an index
            if shard.finished[k] and not text_id.startswith(tuple(skip)):
                ids = shard.sequence(k)[int(shard.answer_starts[k]):].tolist()
                yield text_id, tokenizer.decode(ids, skip_special_tokens=True).strip()


def passages(texts, min_chars: int, max_chars: int):
    """(ids, passage): consecutive texts joined by a blank line until ``min_chars``; a passage
    that would pass ``max_chars`` is dropped and joining starts over."""
    ids, parts = [], []
    for text_id, text in texts:
        ids.append(text_id)
        parts.append(text)
        joined = "\n\n".join(parts)
        if len(joined) >= min_chars:
            if len(joined) <= max_chars:
                yield ids, joined
            ids, parts = [], []


def task_prompt(n: int, passage: str) -> tuple[str, str]:
    """Passage ``n``'s (kind, prompt): summaries on even n, questions on odd, wordings in turn."""
    kind, wordings = ("summary", SUMMARY) if n % 2 == 0 else ("question", QUESTION)
    return kind, wordings[(n // 2) % len(wordings)].format(passage=passage)


def run(config: PassagePromptsConfig) -> int:
    tokenizer = load_tokenizer(config.base)
    records = []
    for n, (ids, passage) in enumerate(passages(answers(Path(config.job), config.skip_sources, tokenizer),
                                                config.min_chars, config.max_chars)):
        if n == config.count:
            break
        kind, prompt = task_prompt(n, passage)
        records.append({"id": f"self-passage:{n}", "source": f"self-passage-{kind}", "prompt": prompt,
                        "passage_of": ids})
    if len(records) < config.count:
        print(f"{config.job} gives {len(records)} passages, fewer than --count {config.count}", file=sys.stderr)
    write_text_atomic(Path(config.out), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    print(f"{len(records)} passage prompts in {config.out}")
    return 0


def parse_args(argv: list[str] | None = None) -> PassagePromptsConfig:
    return parse_config(PassagePromptsConfig, argv, "python -m draftheads.training.data.passage_prompts", __doc__, required=("job", "out"))


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv), (DataError,))


if __name__ == "__main__":
    raise SystemExit(main())
