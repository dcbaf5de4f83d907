"""Held-out evaluation: per-head top-k accuracy and the rank table tree search reads.
"""
from __future__ import annotations

import torch

from ..heads import DraftHeads
from .features import Features
from .losses import label_ranks, topk_accuracy
from .objective import head_labels
from .recipe_sections import Recipe
from .batches import chunk_rows, head_logits, sequence_chunks


EVAL_RANK_CAP = 16  # ranks beyond this only matter as "missed" for trees and top-k


@torch.no_grad()
def evaluate(heads: DraftHeads, table: Features, recipe: Recipe, dtype: torch.dtype, accelerator,
             batch_size: int = 2048) -> tuple[dict, torch.Tensor]:
    """Per-head top-1/top-5 on held-out positions (teacher-forced path tokens); returns the
    accuracies and the rank matrix (P, K) the tree search uses."""
    was_training = heads.training
    heads.eval()
    with accelerator.autocast():
        ranks = rank_table(heads, table, recipe.loss.labels, dtype, accelerator.device, recipe.run.eval_positions,
                           recipe.train.chunk_length, batch_size)
    heads.train(was_training)
    return topk_accuracy(ranks), ranks


@torch.no_grad()
def rank_table(heads: DraftHeads, table: Features, labels_from: str = "teacher", dtype=torch.float32, device="cpu",
               max_positions: int = 0, chunk_length: int = 256, batch_size: int = 2048) -> torch.Tensor:
    """Rank of each held-out label in its head's draft distribution (P, K), capped at
    EVAL_RANK_CAP, over the first ``max_positions`` rows (0 = all; contextual families score
    whole sequence chunks, so they may stop a little past it)."""
    count = min(len(table), max_positions) if max_positions else len(table)
    if heads.contextual:
        chunks = [c for c in sequence_chunks(table, chunk_length) if c[0] < count]
        batches = [chunk_rows(chunks[i: i + 8]) for i in range(0, len(chunks), 8)]
    else:
        batches = [torch.arange(s, min(s + batch_size, count)) for s in range(0, count, batch_size)]
    ranks = []
    for rows in batches:
        logits, flat = head_logits(heads, table, rows, heads.num_heads, device, dtype)
        labels = head_labels(table, flat, heads, labels_from).to(device)
        ranks.append(label_ranks(logits.float(), labels, EVAL_RANK_CAP).cpu())
    return torch.cat(ranks)
