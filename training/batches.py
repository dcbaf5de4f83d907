"""Training data as the trainer reads it: examples split into train/held-out, cached or
on-the-fly base features, the chunking of contextual families, and the exact, resumable data
order (a pure function of seed, epoch and micro-step).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .data.records import DataError, example_features, shifted_rows
from .features import Example, Features, extract_features, load_shards


def split_examples(examples: list[Example], eval_examples: int) -> tuple[list[Example], list[Example]]:
    """Held-out = the last ``eval_examples`` examples (never trained on)."""
    if len(examples) <= eval_examples:
        raise DataError(f"Only {len(examples)} usable examples but data.eval_examples={eval_examples}: "
                        "lower data.eval_examples or add data.")
    return examples[: len(examples) - eval_examples], examples[len(examples) - eval_examples:]


def cached_features(base, examples: list[Example], directory: Path, fp: dict, accelerator,
                    layers: list[int] | tuple[int, ...] = ()) -> Features:
    """Extract (or resume extracting) feature shards on the main process, then every process
    loads them; shards from another base are refused by :func:`load_shards`. ``layers``: the
    base layers the heads read beside the final state (shards without them are rebuilt)."""
    with accelerator.main_process_first():
        paths = extract_features(base, examples, directory, fp, layers=layers) if accelerator.is_main_process else None
    if paths is None:
        paths = extract_features(base, examples, directory, fp, layers=layers)  # all shards exist now: only lists them
    return load_shards(paths, fp, layers)


class FeatureBatches:
    """Training items = cached positions (the fast path); for contextual families (Hydra++,
    whose layer reads the context) items are sequence chunks and a batch is their rows,
    right-padded with -1 (B, T)."""

    def __init__(self, table: Features, num_heads: int, chunk_length: int | None = None,
                 prompt_ids: torch.Tensor | None = None):
        self.table = table
        self.prompt_ids = prompt_ids  # the prompts' token ids, where known (draft-vocabulary ties)
        self.next_rows = shifted_rows(table.targets, num_heads)
        self.chunks = None if chunk_length is None else sequence_chunks(table, chunk_length)

    def __len__(self) -> int:
        return len(self.table) if self.chunks is None else len(self.chunks)

    def batch(self, items: torch.Tensor) -> tuple[Features, torch.Tensor, torch.Tensor]:
        if self.chunks is None:
            return self.table, items, self.next_rows[items]
        rows = chunk_rows([self.chunks[i] for i in items.tolist()])
        return self.table, rows, self.next_rows[rows[rows >= 0]]


def sequence_chunks(table: Features, max_length: int) -> list[tuple[int, int]]:
    """Contiguous row ranges [start, end) of at most ``max_length`` positions (0: whole
    sequences) that never cross a sequence: ``table.sequences`` where given, else found from
    the targets (the cache keeps each example's positions in order, and an example's last
    position is the only one whose x_{t+2} is past the end, ``targets[:, 1] < 0``)."""
    if table.sequences is not None:
        bounds = table.sequences.tolist()
    else:
        ends = (table.targets[:, 1] < 0).nonzero().squeeze(1).tolist()
        bounds = list(zip([0] + [e + 1 for e in ends[:-1]], [e + 1 for e in ends]))
    chunks = []
    for start, end in bounds:
        step = max_length or end - start
        chunks += [(s, min(s + step, end)) for s in range(start, end, step)]
    return chunks


def chunk_rows(chunks: list[tuple[int, int]]) -> torch.Tensor:
    """Row indices of each chunk, right-padded with -1: (B, T)."""
    width = max(e - s for s, e in chunks)
    rows = torch.full((len(chunks), width), -1, dtype=torch.long)
    for i, (s, e) in enumerate(chunks):
        rows[i, : e - s] = torch.arange(s, e)
    return rows


class OnTheFlyBatches:
    """Training items = examples; each batch runs the frozen base over its sequences (for
    contextual families the batch's rows come as sequence chunks, as in :class:`FeatureBatches`),
    keeping the states of ``layers`` too."""

    def __init__(self, base, examples: list[Example], num_heads: int, chunk_length: int | None = None,
                 layers: list[int] | tuple[int, ...] = ()):
        self.base, self.examples, self.num_heads, self.chunk_length = base, examples, num_heads, chunk_length
        self.layers = list(layers)

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, items: torch.Tensor) -> tuple[Features, torch.Tensor, torch.Tensor]:
        table = example_features(self.base, [self.examples[i] for i in items.tolist()], self.layers)
        shifted = shifted_rows(table.targets, self.num_heads)
        if self.chunk_length is None:
            return table, torch.arange(len(table)), shifted
        rows = chunk_rows(sequence_chunks(table, self.chunk_length))
        return table, rows, shifted[rows[rows >= 0]]


def epoch_order(num_items: int, seed: int, epoch: int) -> torch.Tensor:
    """The item order of an epoch: a function of (seed, epoch) only, so a resumed run sees the
    same order whatever happened before."""
    return torch.randperm(num_items, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def micro_batch_items(num_items: int, micro: int, batch: int, world: int, rank: int, seed: int) -> torch.Tensor:
    """This process's items for global micro-step ``micro``: slice ``rank`` of the global batch
    of ``batch · world`` items (the last incomplete global batch of an epoch is dropped)."""
    global_batch = batch * world
    per_epoch = num_items // global_batch
    epoch, index = divmod(micro, per_epoch)
    start = index * global_batch + rank * batch
    return epoch_order(num_items, seed, epoch)[start: start + batch]
