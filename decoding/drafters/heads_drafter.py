"""The heads as a drafter: they fill the policy's tree, the same shape for every row."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from ...heads import DraftHeads
from ..tree import Tree
import numpy as np
import torch

from .candidates import CandidateBatch, Candidates, Source, path_products
from .drafts import Drafts
from .interface import DraftState, plain_drafts

if TYPE_CHECKING:
    from ..accept import Acceptance


@dataclass
class HeadsDrafter:
    """The heads fill the policy's tree (cut to the shallowest row's room); no state."""

    heads: DraftHeads | None

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        """Heads read hidden states, not token histories."""

    def propose(self, state: DraftState, tree: Tree) -> Drafts:
        tree = tree.fitting(min(state.room))
        if self.heads is None or tree.num_nodes == 1:
            return plain_drafts(state.roots)
        return Drafts.uniform(tree, self.heads.propose(state.hidden, state.roots, tree.spec))

    def observe(self, drafts: Drafts, result: Acceptance, rows: Sequence[int]) -> None:
        """Nothing to learn: the policy observes acceptance itself."""


def head_trie(tree: Tree, tokens: Sequence[int], probs: Sequence[float]) -> Candidates:
    """One row of the heads' tree (slots 1..N−1) as candidates scored by draft probability."""
    parent = (tree.parent[1:] - 1).tolist()  # slot → index among the drafts (root = -1)
    return Candidates.from_heads(parent, list(tokens)[1:], list(probs)[1:])


def heads_batch(tree: Tree, tokens: torch.Tensor, probs: torch.Tensor) -> CandidateBatch:
    """Every row's heads' tree as candidates (:func:`head_trie` for all rows at once): tokens and
    probs (B, N) over the tree's slots, slot 0 the root."""
    batch, slots = tokens.shape
    drafts = slots - 1
    local = (tree.parent[1:] - 1).cpu().numpy().astype(np.int64)  # slot → index among the drafts (root = -1)
    row = np.repeat(np.arange(batch, dtype=np.int64), drafts)
    parent = np.where(np.tile(local, batch) >= 0, np.tile(local, batch) + row * drafts, -1)
    depth = np.tile(tree.depth[1:].cpu().numpy().astype(np.int32), batch)
    share = probs[:, 1:].float().cpu().numpy().astype(np.float64).reshape(-1)
    return CandidateBatch(batch, row, parent, tokens[:, 1:].cpu().numpy().astype(np.int64).reshape(-1), depth,
                          path_products(share, parent, depth), np.full(row.size, Source.HEADS, dtype=np.int8),
                          depth.astype(np.int16), share)
