"""Hidden-state feature cache: run the frozen base once over the training text and keep its
last hidden states (fp16 shards), so head training never re-runs the base.

Each shard is written to a temporary name and renamed when complete, so a killed run resumes
at the first missing shard and a partial shard is never mistaken for a complete one.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from tqdm.auto import tqdm

from ..decoding.base.architecture import decoder_body
from ..core.atomic import atomic_file

MAX_TARGETS = 9  # future tokens stored per position: x_{t+1} (the root) + enough for up to 8 heads
SHARD_EXAMPLES = 128  # examples per feature shard (the held-out split is counted in shards)
FEATURE_FORMAT = 2  # 2: ``targets`` start at x_{t+1} and shards carry ``teacher`` labels


@dataclass
class Example:
    """One training sequence: prompt (chat template applied) followed by the response."""

    input_ids: list[int]
    response_start: int  # index of the first response token


def read_jsonl(path: str | Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{line_no} is not valid JSON ({err}).") from None


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a user prompt wrapped in the model's chat template, ready for the answer; a
    pretrained base without a chat template (Gemma 3 270M's GGUF) continues the plain text."""
    if getattr(tokenizer, "chat_template", "") is None:  # a transformers tokenizer that has none
        return list(tokenizer(prompt)["input_ids"])
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    return list(ids)


def selfdistill_examples(records: Iterable[dict], tokenizer, max_length: int = 1024) -> list[Example]:
    """Self-distilled records (``prompt`` + the base's own ``response_ids``) → examples."""
    examples = []
    for record in records:
        if "response_ids" not in record or "prompt" not in record:
            raise ValueError("A self-distillation record needs 'prompt' and 'response_ids' fields; "
                             f"got keys {sorted(record)}.")
        prompt = chat_prompt_ids(tokenizer, record["prompt"])
        ids = (prompt + list(record["response_ids"]))[:max_length]
        if len(ids) > len(prompt) + 1:
            examples.append(Example(ids, len(prompt)))
    return examples


def shift_targets(input_ids: torch.Tensor, start: int) -> torch.Tensor:
    """For positions t = start-1 .. L-2 (the hidden state that predicts token t+1), the text
    tokens t+1 .. t+MAX_TARGETS; -1 past the end. Column 0 is the root the base emits, column
    k+1 what head k must predict (and what sequential heads read as their k-th draft token)."""
    return _ahead(input_ids, start - 1, input_ids.shape[0] - 1, first_offset=1)


def shift_teacher(predicted: torch.Tensor) -> torch.Tensor:
    """The base's own greedy predictions lined up like :func:`shift_targets`. ``predicted``
    holds the base's argmax at positions start-1 .. L-1 (its guess for the token after each),
    so row i (position t = start-1+i) column c is the base's choice for token t+c+1 after the
    text up to t+c. On self-distilled text this equals the text; on any other text it is the
    label that makes heads draft what the base would accept (distillation, hard labels)."""
    return _ahead(predicted, 0, predicted.shape[0] - 1, first_offset=0)


def _ahead(values: torch.Tensor, first: int, stop: int, first_offset: int) -> torch.Tensor:
    """rows t = first .. stop-1 of values[t + first_offset + c] for c < MAX_TARGETS, -1 past the end."""
    positions = torch.arange(first, stop)
    index = positions[:, None] + torch.arange(first_offset, first_offset + MAX_TARGETS)[None, :]
    padded = torch.cat([values, torch.full((MAX_TARGETS + 2,), -1, dtype=values.dtype)])
    return padded[index.clamp(max=padded.shape[0] - 1)]


@torch.no_grad()
def hidden_states(model, batch: list[Example]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per example: last-layer hidden states (after the final norm) at positions
    response_start-1 .. L-2, and the base's argmax at positions response_start-1 .. L-1."""
    longest = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), longest), 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, example in enumerate(batch):
        ids[row, : len(example.input_ids)] = torch.tensor(example.input_ids)
        mask[row, : len(example.input_ids)] = 1
    device = next(model.parameters()).device
    out = decoder_body(model)(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    states = out.last_hidden_state
    result = []
    for row, e in enumerate(batch):
        span = states[row, e.response_start - 1: len(e.input_ids)]
        predicted = model.get_output_embeddings()(span).argmax(-1).cpu()
        result.append((span[:-1].to("cpu", torch.float16), predicted))
    return result


def batches_by_tokens(examples: list[Example], max_tokens: int) -> Iterator[list[Example]]:
    """Length-sorted batches under a padded-token budget (less padding, steady memory)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
    batch: list[Example] = []
    for index in order:
        candidate = batch + [examples[index]]
        if batch and len(candidate) * len(candidate[-1].input_ids) > max_tokens:
            yield batch
            candidate = [examples[index]]
        batch = candidate
    if batch:
        yield batch


def shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:05d}.safetensors"


def write_shard(path: Path, hidden: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor,
                metadata: dict) -> None:
    from safetensors.torch import save_file

    tensors = {"hidden": hidden.contiguous(), "targets": targets.to(torch.int32).contiguous(),
               "teacher": teacher.to(torch.int32).contiguous()}
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={k: json.dumps(v) for k, v in metadata.items()})


def extract_features(model, examples: list[Example], directory: str | Path, fingerprint: dict,
                     shard_examples: int = SHARD_EXAMPLES, max_batch_tokens: int = 4096) -> list[Path]:
    """Write (or resume writing) feature shards for ``examples``; returns all shard paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    num_shards = (len(examples) + shard_examples - 1) // shard_examples
    paths = [shard_path(directory, i) for i in range(num_shards)]
    chunks = [examples[i * shard_examples: (i + 1) * shard_examples] for i in range(num_shards)]
    digests = [examples_digest(chunk) for chunk in chunks]
    todo = [i for i, p in enumerate(paths) if _shard_problem(p, fingerprint, digests[i]) is not None]
    for index in tqdm(todo, desc="feature shards", unit="shard"):
        chunk = chunks[index]
        hidden, targets, teacher = [], [], []
        for batch in batches_by_tokens(chunk, max_batch_tokens):
            for example, (states, predicted) in zip(batch, hidden_states(model, batch)):
                hidden.append(states)
                targets.append(shift_targets(torch.tensor(example.input_ids), example.response_start))
                teacher.append(shift_teacher(predicted))
        write_shard(paths[index], torch.cat(hidden), torch.cat(targets), torch.cat(teacher),
                    {"fingerprint": fingerprint, "examples": len(chunk), "format": FEATURE_FORMAT,
                     "digest": digests[index]})
    return paths


def examples_digest(examples: list[Example]) -> str:
    """Content hash of a shard's examples: a cache made from other data (another filter, a
    data set that grew or changed) is recomputed, never reused because its size matches."""
    digest = hashlib.sha256()
    for example in examples:
        digest.update(repr((example.response_start, example.input_ids)).encode())
    return digest.hexdigest()[:32]


def _shard_problem(path: Path, fingerprint: dict, digest: str) -> str | None:
    """Why ``path`` is not a finished shard for the same base (and dtype: the fingerprint hashes
    the LM head as loaded), format and examples, or None. A shard that exists but does not fit
    is named in one line and rebuilt, never read; an unreadable one is rebuilt too."""
    from safetensors import safe_open

    if not path.is_file():
        return "missing"
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
        problem = (None if json.loads(meta.get("fingerprint", "null")) == fingerprint else
                   "made from another base or dtype")
        if problem is None and json.loads(meta.get("format", "1")) != FEATURE_FORMAT:
            problem = "an older format"
        if problem is None and json.loads(meta.get("digest", "null")) != digest:
            problem = "made from other examples"
    except Exception as err:  # noqa: BLE001 - a damaged file of any kind is rebuilt, never trusted
        problem = f"unreadable ({type(err).__name__})"
    if problem is not None:
        print(f"[draftheads] {path}: {problem}; rebuilding it.", file=sys.stderr, flush=True)
    return problem


@dataclass
class Features:
    """Cached training positions: hidden (P, d) fp16; targets and teacher (P, MAX_TARGETS)
    long, -1 past the end of a sequence (see :func:`shift_targets`, :func:`shift_teacher`).
    ``sequences`` (S, 2): each sequence's [start, end) rows, where rows without labels (a
    prompt's, read by a context layer) would hide where sequences end; None: an answer's rows
    only, its last one the only row whose x_{t+2} is −1."""

    hidden: torch.Tensor
    targets: torch.Tensor
    teacher: torch.Tensor
    sequences: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.hidden.shape[0])

    def select(self, index) -> "Features":
        return Features(self.hidden[index], self.targets[index], self.teacher[index])


def load_shards(paths: Iterable[Path], fingerprint: dict | None = None) -> Features:
    """Concatenate shards; refuse shards made from a different base or in an older format."""
    from safetensors import safe_open

    hidden, targets, teacher = [], [], []
    for path in paths:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            if fingerprint is not None and json.loads(meta.get("fingerprint", "null")) != fingerprint:
                raise ValueError(f"{path} was computed with a different base model than the one loaded; "
                                 "delete the feature cache or point to the right base.")
            if json.loads(meta.get("format", "1")) != FEATURE_FORMAT:
                raise ValueError(f"{path} is a feature shard of an older format; re-run the feature extraction "
                                 "(it rewrites stale shards) or delete the cache directory.")
            hidden.append(handle.get_tensor("hidden"))
            targets.append(handle.get_tensor("targets").long())
            teacher.append(handle.get_tensor("teacher").long())
    return Features(torch.cat(hidden), torch.cat(targets), torch.cat(teacher))
