"""How many slots a merged step keeps: the width with the most expected tokens per
millisecond under the cost model (:mod:`..cost`)."""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from ..cost import LINEAR_COST, CostModel


@dataclass
class WidthChooser:
    """The step's node count: best-first trees are prefix-closed at every width, so keeping the
    first W−1 drafts of each row's ranked trie is always a valid tree; choose the W that
    maximizes Σ_rows E[tokens] / step time = Σ_b (1 + Σ_{i<W−1} s_b,i) / cost(B, W)."""

    cost: CostModel = field(default_factory=lambda: LINEAR_COST)
    max_nodes: int = 33

    def choose(self, scores: np.ndarray, ctx: int) -> int:
        """scores (B, K): each row's best-first scores, zero-padded (:meth:`~.candidates.CandidateBatch.score_block`)."""
        block = np.atleast_2d(np.asarray(scores, dtype=np.float64))
        batch = block.shape[0]
        widest = min(self.max_nodes, 1 + block.shape[1])
        # gain[w-1] = Σ_b Σ_{i<w-1} s_b,i
        gain = np.concatenate([[0.0], np.cumsum(block[:, : widest - 1].sum(0))])
        rate = (batch + gain) / self.cost.step_ms_many(batch, np.arange(1, widest + 1), ctx)
        return 1 + int(np.argmax(rate))
