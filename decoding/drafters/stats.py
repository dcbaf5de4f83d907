"""Statistics source: the bigram / Max-Gram table (most likely next token per token), the
cheap bottom of the cascade (CS Drafting's MaG fallback, HD's statistics level). A chain
follows the table from the row's last token; one array read per drafted token."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .candidates import Candidates, Source
from .hitrate import default_q

STATS_BUCKET = 1  # the chain is conditioned on one token


@dataclass(frozen=True)
class StatsConfig:
    max_depth: int = 8
    min_prob: float = 0.0  # stop the chain once the path's product of frequencies falls below this
    eos_token_id: int | None = None


@dataclass(frozen=True)
class BigramTable:
    next_token: np.ndarray  # (V,) int32, -1 = never followed
    prob: np.ndarray  # (V,) float32, count(t, next) / count(t, ·)

    @classmethod
    def from_store(cls, store) -> "BigramTable":
        return cls(np.asarray(store.bigram_next), np.asarray(store.bigram_prob))

    def chain(self, last: int, max_depth: int, min_prob: float = 0.0, eos: int | None = None) -> tuple[list[int], list[float]]:
        """Tokens and per-token frequencies following ``last``; stops at an unseen token, after
        EOS, or when the path frequency drops below ``min_prob``."""
        tokens, shares, path = [], [], 1.0
        t = int(last)
        for _ in range(max_depth):
            if not 0 <= t < self.next_token.shape[0] or self.next_token[t] < 0:
                break
            p = float(self.prob[t])
            path *= p
            if path < min_prob:
                break
            t = int(self.next_token[t])
            tokens.append(t)
            shares.append(p)
            if t == eos:
                break
        return tokens, shares


class StatsSource:
    """One row: remembers its last token only."""

    def __init__(self, table: BigramTable, prompt: Sequence[int], config: StatsConfig = StatsConfig()):
        self.table, self.config = table, config
        self.last: int | None = int(prompt[-1]) if len(prompt) else None

    def extend(self, tokens: Sequence[int]) -> None:
        if len(tokens):
            self.last = int(tokens[-1])

    def propose(self, budget: int, q: float | None = None) -> Candidates:
        if self.last is None or budget <= 0:
            return Candidates.empty()
        cfg = self.config
        tokens, shares = self.table.chain(self.last, min(cfg.max_depth, budget), cfg.min_prob, cfg.eos_token_id)
        q = default_q(Source.STATS, STATS_BUCKET) if q is None else q
        scores = np.cumprod(np.asarray(shares) * q).tolist()
        n = len(tokens)
        return Candidates.from_lists(list(range(-1, n - 1)), tokens, scores, [Source.STATS] * n, [STATS_BUCKET] * n, shares)
