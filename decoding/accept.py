"""Acceptance rules: which drafted tree path each sequence keeps.

Greedy: a child is accepted when its token equals the base's argmax at its parent slot and its
parent was accepted; each row keeps its deepest accepted node. The token after it (the
*bonus*) is the base's argmax there, so every emitted token is the base's own greedy choice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Acceptance:
    best: torch.Tensor  # (B,) slot of the deepest accepted node per row
    accepted: torch.Tensor  # (B,) number of accepted draft tokens (depth of ``best``)
    path: torch.Tensor  # (B, D+1) slots root→best, padded with ``best``
    bonus: torch.Tensor  # (B,) the base's token after ``best``


def greedy_accept(tokens: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor, path_slots: torch.Tensor,
                  predicted: torch.Tensor, valid: torch.Tensor | None = None) -> Acceptance:
    """tokens, predicted (B, N): drafted tokens and the base's argmax per slot; parent, depth
    (N,) or (B, N); path_slots (N, D+1) or (B, N, D+1); valid (B, N) masks padded slots of
    ragged per-row trees."""
    batch, nodes = tokens.shape
    parent = parent.expand(batch, nodes)
    depth = depth.expand(batch, nodes)
    parent_safe = parent.clamp(min=0)
    match = tokens == predicted.gather(1, parent_safe)
    if valid is not None:
        match &= valid
    accepted = depth == 0
    for level in range(1, int(depth.max()) + 1):
        at_level = depth == level
        accepted = accepted | (at_level & match & accepted.gather(1, parent_safe))
    score = torch.where(accepted, depth, torch.full_like(depth, -1))
    best = score.argmax(1)
    rows = torch.arange(batch, device=tokens.device)
    if path_slots.dim() == 2:
        path = path_slots[best]
    else:
        path = path_slots[rows, best]
    return Acceptance(best, depth[rows, best], path, predicted[rows, best])
