"""The heads as a drafter: they fill the policy's tree — the same shape for every row, or each
row's best nodes of a larger tree the heads offer (a dynamic tree) — and the heads as a draft
source of the registry (:data:`~.sources.heads_source.HEADS`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from ...heads import DraftHeads
from ..tree import Tree
from .candidates import CandidateBatch, path_products, step_trees
from .hitrate import HitRate
from ..step_trees import StepTrees
from .interface import DraftState, plain_step
from .registry import source_id
from .tries import select_rows

if TYPE_CHECKING:
    from ..accept import Acceptance


@dataclass
class HeadsDrafter:
    """The heads fill the policy's tree (cut to the shallowest row's room).

    ``offer`` (None: the policy's tree as is, every row one shape — Medusa's and Hydra's static
    tree): the policy's tree → a larger tree the heads fill instead; each row then verifies as
    many nodes as the policy's tree has, its best by calibrated path confidence (a dynamic tree,
    as EAGLE-2 draws one). A node's confidence is its head probability scaled by the hit rate
    its depth has shown (:class:`~.hitrate.HitRate`, learned from every verification: the
    heads are over-confident on text unlike their training data), multiplied along its path."""

    heads: DraftHeads | None
    offer: Callable[[Tree], Tree] | None = None
    hitrate: HitRate = field(default_factory=HitRate)
    _proposed: CandidateBatch | None = None  # the last dynamic step's nodes, every row

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        """Heads read hidden states, not token histories (the hit rates carry over requests)."""

    def propose(self, state: DraftState, tree: Tree) -> StepTrees:
        tree = tree.fitting(min(state.room))
        self._proposed = None
        if self.heads is None or tree.num_nodes == 1:
            return plain_step(state.roots)
        if self.offer is None:
            return StepTrees.uniform(tree, heads_propose(self.heads, state, tree.spec))
        offer = self.offer(tree).fitting(min(state.room))
        self._proposed = select_rows(heads_tries(self.heads, state, offer, self.hitrate), tree.num_nodes - 1)
        return step_trees(state.roots, self._proposed, chosen=tree)

    def max_nodes(self, tree_nodes: int) -> int:
        """The most slots a row's step verifies under a policy tree of ``tree_nodes``: that tree's
        (a dynamic step keeps as many of the offer's nodes)."""
        return tree_nodes

    def observe(self, trees: StepTrees, result: Acceptance, rows: Sequence[int]) -> None:
        """A dynamic step's accepted drafts calibrate the heads' hit rates (the policy observes
        acceptance itself)."""
        if self._proposed is not None:
            self.hitrate.observe_rows(rows, self._proposed, trees.accepted_tokens(result.path, result.accepted))


def heads_tries(heads: DraftHeads, state: DraftState, tree: Tree, hitrate: HitRate) -> CandidateBatch:
    """Every live row's heads' proposal on ``tree`` as candidates, scored on the P(accepted)
    scale by ``hitrate``'s calibration: what a dynamic tree and the merged tree choose from."""
    tokens, probs = heads_propose(heads, state, tree.spec, with_probs=True)
    return hitrate.rescore(heads_batch(tree, tokens, probs))


def heads_propose(heads: DraftHeads, state: DraftState, spec, with_probs: bool = False):
    """The heads' tree for the live rows, given their own context where they draft in it (EAGLE-3)."""
    extra = {"context": state.context} if heads.drafts_in_context else {}
    return heads.propose(state.hidden, state.roots, spec, with_probs=with_probs, **extra)


def heads_batch(tree: Tree, tokens: torch.Tensor, probs: torch.Tensor) -> CandidateBatch:
    """Every row's heads' tree as candidates: tokens and probs (B, N) over the tree's slots, slot
    0 the root. A node's share is its head probability and its bucket its depth, so the hit rates
    learn one calibration per head depth and head nodes compete with lookup nodes on the
    P(accepted) scale (:meth:`~.candidates.Candidates.from_heads` for one row); scores start as
    the product of probabilities along the path (rescore with a HitRate to calibrate)."""
    batch, slots = tokens.shape
    drafts = slots - 1
    local = (tree.parent[1:] - 1).cpu().numpy().astype(np.int64)  # slot → index among the drafts (root = -1)
    row = np.repeat(np.arange(batch, dtype=np.int64), drafts)
    local = np.tile(local, batch)
    parent = np.where(local >= 0, local + row * drafts, -1)
    depth = np.tile(tree.depth[1:].cpu().numpy().astype(np.int32), batch)
    share = probs[:, 1:].float().cpu().numpy().astype(np.float64).reshape(-1)
    return CandidateBatch(batch, row, parent, tokens[:, 1:].cpu().numpy().astype(np.int64).reshape(-1), depth,
                          path_products(share, parent, depth), np.full(row.size, source_id("heads"), dtype=np.int8),
                          depth.astype(np.int16), share)
