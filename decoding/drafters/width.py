"""How many slots a merged step keeps: the width with the most expected tokens per
millisecond under the cost model (:mod:`..cost`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..cost import LINEAR_COST, CostModel


@dataclass
class WidthChooser:
    """The step's node count: best-first trees are prefix-closed at every width, so keeping the
    first W−1 drafts of each row's ranked trie is always a valid tree; choose the W that
    maximizes Σ_rows E[tokens] / step time = Σ_b (1 + Σ_{i<W−1} s_b,i) / cost(B, W)."""

    cost: CostModel = field(default_factory=lambda: LINEAR_COST)
    max_nodes: int = 33

    def choose(self, scores: Sequence[np.ndarray], ctx: int) -> int:
        batch = len(scores)
        widest = min(self.max_nodes, 1 + max((len(s) for s in scores), default=0))
        # gain[w-1] = Σ_b Σ_{i<w-1} s_b,i: every row's scores padded to one (B, widest−1) block
        block = np.zeros((batch, widest - 1))
        for b, s in enumerate(scores):
            head = s[: widest - 1]
            block[b, : len(head)] = head
        gain = np.concatenate([[0.0], np.cumsum(block.sum(0))])
        rate = (batch + gain) / self.cost.step_ms_many(batch, np.arange(1, widest + 1), ctx)
        return 1 + int(np.argmax(rate))
