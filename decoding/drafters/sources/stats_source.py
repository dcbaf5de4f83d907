"""Statistics source: the bigram / Max-Gram table (most likely next token per token), the
cheap bottom of the cascade (CS Drafting's MaG fallback, HD's statistics level). A chain
follows the table from the row's last token; one array read per drafted token."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..candidates import CandidateBatch, Candidates
from ..hitrate import default_q
from ..registry import SourceSpec, source_id

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
        return StatsSource.propose_rows([self], budget, q).split()[0]

    @staticmethod
    def propose_rows(sources: Sequence["StatsSource | None"], budget: int, q: float | None = None) -> CandidateBatch:
        """Every row's chain (``None``: a row that does not ask the table) as one batch; a node's
        score is Π (q × frequency) along the chain. Following the table is a few dict-free array
        reads per row, cheaper in Python than as array steps over the rows."""
        rows = len(sources)
        chains = [([], []) if s is None or s.last is None or budget <= 0 else
                  s.table.chain(s.last, min(s.config.max_depth, budget), s.config.min_prob, s.config.eos_token_id)
                  for s in sources]
        sizes = np.array([len(tokens) for tokens, _ in chains], dtype=np.int64)
        total = int(sizes.sum())
        if total == 0:
            return CandidateBatch.empty(rows)
        source = source_id("stats")
        q = default_q(source, STATS_BUCKET) if q is None else q
        row = np.repeat(np.arange(rows, dtype=np.int64), sizes)
        first = np.arange(total) == np.repeat(np.cumsum(sizes) - sizes, sizes)  # each chain's depth-1 node
        share = np.array([p for _, shares in chains for p in shares], dtype=np.float64)
        depth = (np.arange(total) - np.repeat(np.cumsum(sizes) - sizes, sizes) + 1).astype(np.int32)
        factor = share * q
        score = np.concatenate([np.cumprod(factor[s - n: s]) for s, n in zip(np.cumsum(sizes).tolist(), sizes.tolist()) if n])
        return CandidateBatch(rows, row, np.where(first, -1, np.arange(total) - 1),
                              np.array([t for tokens, _ in chains for t in tokens], dtype=np.int64), depth, score,
                              np.full(total, source, dtype=np.int8), np.full(total, STATS_BUCKET, dtype=np.int16),
                              share)


def stats_prior(bucket: int) -> float:
    """The bigram table is the least trusted source: one token of context."""
    return 0.4


#: bigram chains from the model store's statistics: needs the store, learns nothing during a request
STATS = SourceSpec("stats", stats_prior, StatsConfig,
                   start=lambda prompt, config, table: StatsSource(table, prompt, config),
                   propose_rows=StatsSource.propose_rows, static=True, needs=("store",),
                   shared=lambda loaded: BigramTable.from_store(loaded["store"]))
