"""Hidden-state feature cache: run the frozen base once over the training text and keep its
last hidden states (fp16 shards), so head training never re-runs the base.

Heads that read more of the base (``HeadConfig.feature_layers``, :mod:`draftheads.heads.fusion`)
get the residual stream after the named layers from the same forward (``output_hidden_states``):
a shard keeps them beside the final state, as ``layers`` (P, n · d) fp16, and records which
(``"layers": [8, 22]`` in its metadata). A shard that lacks a layer a run reads is rebuilt; one
that holds more serves the layers asked (:func:`layer_columns`); shards without ``layers`` (every
shard before them) serve heads that read the final state only.

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
from ..decoding.base.forward import tapped_layers
from ..core.atomic import atomic_file
from ..core.errors import DataError

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


@dataclass
class Captured:
    """One example's positions response_start-1 .. L-2 from one base forward: ``hidden`` the final
    (normed) state (R, d) fp16, ``layers`` the named layers' states side by side (R, n · d) fp16 or
    None, and ``predicted`` the base's argmax at positions response_start-1 .. L-1 (R + 1,)."""

    hidden: torch.Tensor
    predicted: torch.Tensor
    layers: torch.Tensor | None = None


@torch.no_grad()
def captured_states(model, batch: list[Example], layers: list[int] | tuple[int, ...] = ()) -> list[Captured]:
    """Per example what :class:`Captured` holds, from one forward of the base's body over the
    batch (right-padded); the named ``layers`` come from the same forward."""
    longest = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), longest), 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, example in enumerate(batch):
        ids[row, : len(example.input_ids)] = torch.tensor(example.input_ids)
        mask[row, : len(example.input_ids)] = 1
    device = next(model.parameters()).device
    out = decoder_body(model)(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False,
                              **({"output_hidden_states": True} if layers else {}))
    states, named = out.last_hidden_state, tapped_layers(out.hidden_states, layers)
    result = []
    for row, e in enumerate(batch):
        span = states[row, e.response_start - 1: len(e.input_ids)]
        predicted = model.get_output_embeddings()(span).argmax(-1).cpu()
        extra = None if named is None else named[row, e.response_start - 1: len(e.input_ids) - 1]
        result.append(Captured(span[:-1].to("cpu", torch.float16), predicted,
                               None if extra is None else extra.to("cpu", torch.float16)))
    return result


def hidden_states(model, batch: list[Example]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per example: last-layer hidden states (after the final norm) at positions
    response_start-1 .. L-2, and the base's argmax at positions response_start-1 .. L-1."""
    return [(c.hidden, c.predicted) for c in captured_states(model, batch)]


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
                metadata: dict, layers: torch.Tensor | None = None) -> None:
    from safetensors.torch import save_file

    tensors = {"hidden": hidden.contiguous(), "targets": targets.to(torch.int32).contiguous(),
               "teacher": teacher.to(torch.int32).contiguous()}
    if layers is not None:  # the named layers' states (metadata "layers" says which)
        tensors["layers"] = layers.contiguous()
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={k: json.dumps(v) for k, v in metadata.items()})


def extract_features(model, examples: list[Example], directory: str | Path, fingerprint: dict,
                     shard_examples: int = SHARD_EXAMPLES, max_batch_tokens: int = 4096,
                     layers: list[int] | tuple[int, ...] = ()) -> list[Path]:
    """Write (or resume writing) feature shards for ``examples``, with the states of the base's
    ``layers`` beside the final one; returns all shard paths. A shard that lacks one of ``layers``
    is rebuilt (with exactly ``layers``), like any shard that does not fit."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layers = list(layers)
    num_shards = (len(examples) + shard_examples - 1) // shard_examples
    paths = [shard_path(directory, i) for i in range(num_shards)]
    chunks = [examples[i * shard_examples: (i + 1) * shard_examples] for i in range(num_shards)]
    digests = [examples_digest(chunk) for chunk in chunks]
    todo = [i for i, p in enumerate(paths) if _shard_problem(p, fingerprint, digests[i], layers) is not None]
    for index in tqdm(todo, desc="feature shards", unit="shard"):
        chunk = chunks[index]
        hidden, named, targets, teacher = [], [], [], []
        for batch in batches_by_tokens(chunk, max_batch_tokens):
            for example, captured in zip(batch, captured_states(model, batch, layers)):
                hidden.append(captured.hidden)
                named.append(captured.layers)
                targets.append(shift_targets(torch.tensor(example.input_ids), example.response_start))
                teacher.append(shift_teacher(captured.predicted))
        metadata = {"fingerprint": fingerprint, "examples": len(chunk), "format": FEATURE_FORMAT,
                    "digest": digests[index], **({"layers": layers} if layers else {})}
        stored = check_fp16(torch.cat(named), layers, paths[index]) if layers else None
        write_shard(paths[index], torch.cat(hidden), torch.cat(targets), torch.cat(teacher), metadata, stored)
    return paths


def check_fp16(states: torch.Tensor, layers, where) -> torch.Tensor:
    """The named layers' states as stored (float16): a residual stream past float16's range would
    be stored as infinities, so it is one line naming the layers and ``where`` instead."""
    if not bool(torch.isfinite(states).all()):
        raise DataError(f"{where}: a state of base layers {list(layers)} overflows float16 (this base's residual "
                        "stream is too large there); read other layers (heads.feature_layers).")
    return states


def examples_digest(examples: list[Example]) -> str:
    """Content hash of a shard's examples: a cache made from other data (another filter, a
    data set that grew or changed) is recomputed, never reused because its size matches."""
    digest = hashlib.sha256()
    for example in examples:
        digest.update(repr((example.response_start, example.input_ids)).encode())
    return digest.hexdigest()[:32]


def layer_columns(recorded: list[int], layers: list[int] | tuple[int, ...], hidden_size: int) -> list[int] | None:
    """Column indices of ``layers``' states in a ``layers`` array that holds ``recorded``'s side
    by side (each ``hidden_size`` wide), in the order of ``layers``; None when one is missing."""
    if not set(layers) <= set(recorded):
        return None
    return [recorded.index(layer) * hidden_size + c for layer in layers for c in range(hidden_size)]


def layers_text(layers) -> str:
    """How a message names the layers a shard or run holds or reads."""
    return f"base layers {list(layers)}" if layers else "no base layer (the final state only)"


def layers_problem(recorded, asked) -> str | None:
    """Why a shard holding the states of base layers ``recorded`` cannot serve heads reading
    ``asked`` beside the final state (it must hold each; more is fine), or None."""
    if set(asked) <= set(recorded or []):
        return None
    return f"it holds {layers_text(recorded or [])}, this run reads {layers_text(asked)}"


def _shard_problem(path: Path, fingerprint: dict, digest: str, layers: list[int] | tuple[int, ...] = ()) -> str | None:
    """Why ``path`` is not a finished shard for the same base (and dtype: the fingerprint hashes
    the LM head as loaded), format, examples and ``layers`` (it holds each), or None. A shard
    that exists but does not fit is named in one line and rebuilt, never read; an unreadable
    one is rebuilt too."""
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
        if problem is None:
            problem = layers_problem(json.loads(meta.get("layers", "[]")), layers)
    except Exception as err:  # noqa: BLE001 - a damaged file of any kind is rebuilt, never trusted
        problem = f"unreadable ({type(err).__name__})"
    if problem is not None:
        print(f"[draftheads] {path}: {problem}; rebuilding it.", file=sys.stderr, flush=True)
    return problem


@dataclass
class Features:
    """Cached training positions: hidden (P, d) fp16 (the base's final state); targets and
    teacher (P, MAX_TARGETS) long, -1 past the end of a sequence (see :func:`shift_targets`,
    :func:`shift_teacher`). ``sequences`` (S, 2): each sequence's [start, end) rows, where rows
    without labels (a prompt's, read by a context layer) would hide where sequences end; None:
    an answer's rows only, its last one the only row whose x_{t+2} is −1. ``layers`` (P, n · d)
    fp16: the states of the base layers the heads read beside the final one, in their order
    (None: the final state only); the heads' input is :meth:`inputs`. ``next_tokens`` (P,) long:
    the text token after each row, where the table has rows without targets (a prompt's, read by a
    context layer): heads that pair each state with the token after it (EAGLE-3) read it there."""

    hidden: torch.Tensor
    targets: torch.Tensor
    teacher: torch.Tensor
    sequences: torch.Tensor | None = None
    layers: torch.Tensor | None = None
    next_tokens: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.hidden.shape[0])

    def select(self, index) -> "Features":
        return Features(self.hidden[index], self.targets[index], self.teacher[index],
                        layers=None if self.layers is None else self.layers[index],
                        next_tokens=None if self.next_tokens is None else self.next_tokens[index])

    def inputs(self, index, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The heads' input at rows ``index`` (in ``dtype``, when given): the final state, then the
        named layers' (..., d · (1 + n)) — what :meth:`draftheads.heads.DraftHeads.read` reads. The
        parts are cast before they are joined (under CPU autocast, ``cat`` refuses float16 parts)."""
        hidden = self.hidden[index] if dtype is None else self.hidden[index].to(dtype)
        if self.layers is None:
            return hidden
        return torch.cat([hidden, self.layers[index].to(hidden.dtype)], dim=-1)


def load_shards(paths: Iterable[Path], fingerprint: dict | None = None,
                layers: list[int] | tuple[int, ...] = ()) -> Features:
    """Concatenate shards, with the states of ``layers`` (each shard must hold them); refuse
    shards made from a different base, in an older format or without one of ``layers``."""
    from safetensors import safe_open

    hidden, named, targets, teacher = [], [], [], []
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
            if layers:
                named.append(_shard_layers(handle, path, meta, layers, hidden[-1].shape[1]))
    return Features(torch.cat(hidden), torch.cat(targets), torch.cat(teacher),
                    layers=torch.cat(named) if layers else None)


def _shard_layers(handle, path: Path, meta: dict, layers, hidden_size: int) -> torch.Tensor:
    """The states of ``layers`` a feature shard holds (P, n · d); a shard without one of them is
    one line naming it and the fix, never read as the final state only."""
    recorded = json.loads(meta.get("layers", "[]"))
    columns = layer_columns(recorded, layers, hidden_size)
    if columns is None:
        raise DataError(f"{path} holds {layers_text(recorded)}, but the heads read {layers_text(layers)}; re-run "
                        "the feature extraction (it rebuilds such shards) or delete the cache directory.")
    stored = handle.get_tensor("layers")
    return stored if columns == list(range(stored.shape[1])) else stored[:, columns]
