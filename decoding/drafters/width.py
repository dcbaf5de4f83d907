"""How many slots a merged step keeps: the width with the most expected tokens per
millisecond under the cost model (:mod:`..cost`)."""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from ..cost import LINEAR_COST, CostModel
from .candidates import CandidateBatch
from .drafts import SKIP_PADDING_SLOTS


@dataclass
class WidthChooser:
    """The step's node count: best-first trees are prefix-closed at every width, so keeping the
    first W−1 drafts of each row's ranked trie is always a valid tree; choose the W that
    maximizes Σ_rows E[tokens] / step time = Σ_b (1 + Σ_{i<W−1} s_b,i) / cost(B, W)."""

    cost: CostModel = field(default_factory=lambda: LINEAR_COST)
    max_nodes: int = 33
    #: each row its own node count under one batch budget (:meth:`counts`) instead of one width
    per_row: bool = False

    def choose(self, scores: np.ndarray, ctx: int) -> int:
        """scores (B, K): each row's best-first scores, zero-padded (:meth:`~.candidates.CandidateBatch.score_block`)."""
        block = np.atleast_2d(np.asarray(scores, dtype=np.float64))
        batch = block.shape[0]
        widest = min(self.max_nodes, 1 + block.shape[1])
        # gain[w-1] = Σ_b Σ_{i<w-1} s_b,i
        gain = np.concatenate([[0.0], np.cumsum(block[:, : widest - 1].sum(0))])
        rate = (batch + gain) / self.cost.step_ms_many(batch, np.arange(1, widest + 1), ctx)
        return 1 + int(np.argmax(rate))

    def counts(self, tries: CandidateBatch, ctx: int) -> np.ndarray:
        """(B,) draft nodes per row under one batch budget: every row's ranked nodes in one queue
        by score (a node never outranks its parent, so a row's share is a best-first prefix of
        its own trie), cut at the total Q that maximizes Σ_b E[tokens] / step time — a row
        whose lookup match is long takes many nodes, a row with nothing likely none (a plain
        step for it): vLLM's adaptive verification budget, for trees.

        The step is priced at the slots it computes plus what its padding still costs: rows
        are padded to the widest, and where the padding is left out of the linear layers
        (:meth:`~.drafts.Drafts.skips_padding`) a padding slot still costs about
        :data:`PADDED_SLOT_SHARE` of a real one (attention, norms, the gather and scatter)."""
        batch = tries.rows
        rank = tries.rank_in_row()
        keep = np.flatnonzero(rank < self.max_nodes - 1)
        order = keep[np.lexsort((rank[keep], tries.row[keep], tries.depth[keep], -tries.score[keep]))]
        gain = np.concatenate([[0.0], np.cumsum(tries.score[order])])
        computed = batch + np.arange(order.size + 1)  # slots with a token: roots + Q drafts
        widest = 1 + np.concatenate([[0], np.maximum.accumulate(rank[order] + 1)])  # a row's nodes enter in rank order
        padding = batch * widest - computed
        slots = np.where(padding >= SKIP_PADDING_SLOTS, (computed + PADDED_SLOT_SHARE * padding) / batch, widest)
        rate = (batch + gain) / self.cost.step_ms_many(batch, slots, ctx)
        return np.bincount(tries.row[order[: int(np.argmax(rate))]], minlength=batch)


#: what a padding slot left out of the linear layers still costs, as a share of a computed one:
#: SmolLM2 bf16 at bs 16, context 300, one verify forward + LM head (medians of 5, 2026-11-26):
#: 60 tokens padded to 9 slots a row 133-145 ms with the padding skipped (174 ms computed), 54
#: tokens padded to 13: 156 ms (239), against ~22-25 ms per computed slot a row
PADDED_SLOT_SHARE = 0.3
