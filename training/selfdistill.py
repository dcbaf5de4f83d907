"""Self-distillation data: the base model writes its own answers to a prompt set.

Heads trained on the base's own outputs learn what the base will actually write. Answers are
generated greedily in length-sorted, left-padded batches and written in JSONL shards (one
shard = a fixed slice of the prompt list, written to a temporary name and renamed), so a
killed run resumes at the first missing shard and never duplicates or drops a prompt.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import torch
from tqdm.auto import tqdm

from ..decoding.generate import eos_token_ids
from .features import chat_prompt_ids


@torch.no_grad()
def answer_batch(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """Greedy answers (token ids, up to and including EOS) for a batch of chat prompts."""
    encoded = [chat_prompt_ids(tokenizer, p) for p in prompts]
    width = max(len(e) for e in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(encoded):
        ids[row, width - len(e):] = torch.tensor(e)
        mask[row, width - len(e):] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    eos = set(eos_token_ids(model.generation_config))
    answers = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:end])
    return answers


def generate_shards(model, tokenizer, records: list[dict], directory: str | Path, shard_size: int = 64,
                    batch_size: int = 16, max_new_tokens: int = 256, provenance: dict | None = None) -> list[Path]:
    """Answer ``records`` (each with ``prompt``) shard by shard; returns every shard path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards = [directory / f"answers-{i:05d}.jsonl" for i in range((len(records) + shard_size - 1) // shard_size)]
    eos = set(eos_token_ids(model.generation_config))
    for index in tqdm([i for i, p in enumerate(shards) if not p.is_file()], desc="self-distillation", unit="shard"):
        chunk = records[index * shard_size: (index + 1) * shard_size]
        order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]["prompt"]))
        answers: dict[int, list[int]] = {}
        for start in range(0, len(order), batch_size):
            batch = order[start: start + batch_size]
            for i, ids in zip(batch, answer_batch(model, tokenizer, [chunk[i]["prompt"] for i in batch], max_new_tokens)):
                answers[i] = ids
        tmp = shards[index].with_suffix(".partial")
        with open(tmp, "w", encoding="utf-8") as handle:
            for i, record in enumerate(chunk):
                ids = answers[i]
                handle.write(json.dumps({"id": record.get("id"), "source": record.get("source"), "prompt": record["prompt"],
                                         "response": tokenizer.decode(ids, skip_special_tokens=True),
                                         "response_ids": ids, "finished": bool(ids and ids[-1] in eos),
                                         **({"provenance": provenance} if provenance and i == 0 else {})}) + "\n")
        os.replace(tmp, shards[index])
    return shards


def read_shards(paths: Iterable[Path]) -> list[dict]:
    records = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            records.extend(json.loads(line) for line in handle if line.strip())
    return records
