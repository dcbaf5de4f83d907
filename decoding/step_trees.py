"""One step's trees (:class:`StepTrees`): a token tree per live row, padded to a common width.

Rows of a batch may verify different trees (heads plus lookups give each row its own shape);
the base still runs one forward over a dense (B, N) block. A row with fewer than N nodes
gets *padding slots*: they attend only to themselves, are never accepted, and their outputs
are ignored. When every row has the same shape (heads alone), ``shape`` holds that
:class:`~.tree.Tree` and every per-row tensor is an expanded view of its buffers (no copy).

Slot 0 of every row is the root (the token the base produced last, emitted, not yet in the
cache); every other valid slot's parent comes before it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..core import kept as kept_tensors
from .tree import Tree

#: a step leaves its padding slots out of the base's linear layers and LM head when at least
#: this many of its slots are padding (:meth:`StepTrees.skips_padding`): gathering and scattering
#: the rows has its own cost, which a handful of padding slots does not repay
SKIP_PADDING_SLOTS = 16


@dataclass(eq=False)
class StepTrees:
    tokens: torch.Tensor  # (B, N) long; column 0 = the roots
    parent: torch.Tensor  # (B, N) long; -1 at the root and at padding slots
    depth: torch.Tensor  # (B, N) long; 0 at the root and at padding slots
    path_slots: torch.Tensor  # (B, N, D+1) long: slots root→slot, padded with the slot itself
    valid: torch.Tensor  # (B, N) bool; False at padding slots
    shape: Tree | None = None  # the one shape every row has, when uniform
    #: the policy's tree these trees stand for — its shape, or (a dynamic tree) as many nodes in
    #: each row — which the policy learns from; None: the drafter chose the size
    chosen: Tree | None = None

    @property
    def batch(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_nodes(self) -> int:
        """Slots per row of the verification forward (padding included)."""
        return int(self.tokens.shape[1])

    @property
    def max_depth(self) -> int:
        return int(self.path_slots.shape[-1]) - 1

    def nodes_per_row(self) -> torch.Tensor:
        """(B,) real slots per row, root included."""
        return self.valid.sum(1)

    @property
    def ancestor(self) -> torch.Tensor:
        """(B, N, N) bool: ancestor[b, i, j] ⇔ slot j is slot i or one of its ancestors in row b."""
        if self.shape is not None:
            return self.shape.ancestor.to(self.tokens.device).expand(self.batch, -1, -1)
        batch, nodes = self.tokens.shape
        mask = torch.zeros(batch, nodes, nodes, dtype=torch.bool, device=self.tokens.device)
        return mask.scatter_(2, self.path_slots, True)

    def children(self) -> torch.Tensor:
        """(B, N, W) each slot's children in slot order, padded with -1 (the lossless walk's table)."""
        if self.shape is not None:
            return children_table(self.shape.parent).to(self.tokens.device).expand(self.batch, -1, -1)
        return children_table(self.parent)

    @classmethod
    def uniform(cls, tree: Tree, tokens: torch.Tensor) -> "StepTrees":
        """Every row drafts ``tree``: tokens (B, N) fill it."""
        batch, device = tokens.shape[0], tokens.device
        expand = lambda t: t.to(device).expand(batch, *t.shape)  # noqa: E731
        valid = torch.ones(batch, tree.num_nodes, dtype=torch.bool, device=device)
        return cls(tokens, expand(tree.parent), expand(tree.depth), expand(tree.path_slots), valid, tree, tree)

    @classmethod
    def from_rows(cls, roots: torch.Tensor, parents: Sequence[Sequence[int]],
                  tokens: Sequence[Sequence[int]]) -> "StepTrees":
        """Per-row tries → padded trees. roots (B,); for row b, ``parents[b]`` and ``tokens[b]`` list
        its draft nodes parents-first, a parent given as the node's index in that list (-1 = the
        root). Children keep their list order (the order the lossless walk tries them in)."""
        batch = roots.shape[0]
        sizes = [len(t) for t in tokens]
        nodes = 1 + max(sizes, default=0)
        parent = np.full((batch, nodes), -1, dtype=np.int64)
        depth = np.zeros((batch, nodes), dtype=np.int64)
        token = np.zeros((batch, nodes), dtype=np.int64)
        valid = np.zeros((batch, nodes), dtype=bool)
        valid[:, 0] = True
        for b in range(batch):
            n = sizes[b]
            if n == 0:
                continue
            up = np.asarray(parents[b], dtype=np.int64)
            if np.any(up >= np.arange(n)) or np.any(up < -1):
                raise ValueError(f"StepTrees.from_rows: row {b} lists a node before its parent (parents first, -1 = root).")
            slot_parent = up + 1  # list index → slot (the root is slot 0)
            parent[b, 1: n + 1] = slot_parent
            for i in range(1, n + 1):
                depth[b, i] = depth[b, slot_parent[i - 1]] + 1
            token[b, 1: n + 1] = tokens[b]
            valid[b, : n + 1] = True
        max_depth = int(depth.max())
        path_slots = np.repeat(np.arange(nodes)[None, :, None], max_depth + 1, axis=2).repeat(batch, 0)
        for b in range(batch):
            for i in range(1, sizes[b] + 1):
                chain = [i]
                while parent[b, chain[-1]] >= 0:
                    chain.append(int(parent[b, chain[-1]]))
                chain.reverse()
                path_slots[b, i, : len(chain)] = chain
        device = roots.device
        out = torch.from_numpy(token).to(device)
        out[:, 0] = roots
        return cls(out, torch.from_numpy(parent).to(device), torch.from_numpy(depth).to(device),
                   torch.from_numpy(path_slots).to(device), torch.from_numpy(valid).to(device))

    def skips_padding(self) -> bool:
        """Whether this step's padding slots (rows with fewer nodes than the widest) are worth
        leaving out of the base's linear layers and LM head."""
        return self.shape is None and self.valid.numel() - int(self.valid.sum()) >= SKIP_PADDING_SLOTS

    def accepted_tokens(self, path: torch.Tensor, accepted: torch.Tensor) -> list[list[int]]:
        """Per row, the draft tokens on its accepted path (the bonus excluded). path (B, D+1), accepted (B,)."""
        taken = self.tokens.gather(1, path).tolist()
        return [row[1: 1 + int(a)] for row, a in zip(taken, accepted.tolist())]


def children_table(parent: torch.Tensor) -> torch.Tensor:
    """Parent slots (N,) → (N, W), or per row (B, N) → (B, N, W): each slot's children in slot
    order, padded with -1. Slots are sorted by rank within a parent, so children are tried best
    draft first (the order changes only how often a child is accepted, never the output
    distribution); padding slots (parent -1, not the root) are nobody's child."""
    if parent.dim() == 1:
        return _children(tuple(parent.tolist())).to(parent.device)
    rows = [_children(tuple(p)) for p in parent.tolist()]
    table = torch.full((*parent.shape, max(t.shape[1] for t in rows)), -1, dtype=torch.long)
    for b, t in enumerate(rows):
        table[b, :, : t.shape[1]] = t
    return table.to(parent.device)


@functools.lru_cache(maxsize=512)
@kept_tensors.kept
def _children(parent: tuple[int, ...]) -> torch.Tensor:
    """(N,) parent slots → (N, W) each slot's children in slot order, padded with -1."""
    kids: list[list[int]] = [[] for _ in parent]
    for slot, up in enumerate(parent):
        if up >= 0:
            kids[up].append(slot)
    width = max((len(k) for k in kids), default=0)
    return torch.tensor([k + [-1] * (width - len(k)) for k in kids], dtype=torch.long).reshape(len(parent), width)
