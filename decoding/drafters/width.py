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
        gain = np.zeros(widest)  # gain[w-1] = Σ_b Σ_{i<w-1} s_b,i
        for s in scores:
            cum = np.concatenate([[0.0], np.cumsum(s[: widest - 1])])
            gain += np.pad(cum, (0, widest - len(cum)), mode="edge")
        rate = [(batch + gain[w - 1]) / self.cost.step_ms(batch, w, ctx) for w in range(1, widest + 1)]
        return 1 + int(np.argmax(rate))
