"""Store source: a row's view of the model store (:mod:`draftheads.decoding.drafters.store`), matching the row's last
tokens against the base's own answers (HD's "model-dependent" database, SuffixDecoding's
global tree)."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from ..candidates import CandidateBatch, Candidates
from ..registry import SourceSpec, source_id
from ..store import ModelStore, StoreConfig
from ..tries import counted_tries


class StoreSource:
    """One row's view of a :class:`ModelStore`: only the last n tokens matter, so an append is
    O(1) and nothing is rescanned."""

    def __init__(self, store: ModelStore, prompt: Sequence[int], config: StoreConfig = StoreConfig()):
        self.store, self.config = store, config
        self.tail: list[int] = list(prompt)[-store.header.n:]

    def extend(self, tokens: Sequence[int]) -> None:
        self.tail = (self.tail + [int(t) for t in tokens])[-self.store.header.n:]

    def propose(self, budget: int, q: float | None = None) -> Candidates:
        return StoreSource.propose_rows([self], budget, q).split()[0]

    @staticmethod
    def propose_rows(sources: Sequence["StoreSource | None"], budget: int, q: float | None = None) -> CandidateBatch:
        """Every row's proposal at once (``None``: a row that does not ask the store): the
        longest store match of each row's tail, its sampled continuations counted into a trie
        (``q`` = the prior for the match length unless given), the ``budget`` best nodes kept.
        The rows share one store and configuration."""
        live = [(row, s) for row, s in enumerate(sources) if s is not None]
        if budget <= 0 or not live:
            return CandidateBatch.empty(len(sources))
        store, cfg = live[0][1].store, live[0][1].config
        m, lo, hi = store.match_many([s.tail for _, s in live], cfg.min_match)
        seqs, lengths, owner = store.continuations(lo, hi, replace(cfg, max_depth=min(cfg.max_depth, budget)))
        if not lengths.size:
            return CandidateBatch.empty(len(sources))
        rows = np.array([row for row, _ in live], dtype=np.int64)
        bucket = np.zeros(len(sources), dtype=np.int64)
        bucket[rows] = m
        return counted_tries(seqs, lengths, rows[owner], len(sources), source_id("store"), bucket, budget, q)


def store_prior(bucket: int) -> float:
    """Store matches are trusted more the longer they are, less than context ones (the base's
    answers to other prompts; SAM-Decoding penalises them by 5 tokens)."""
    return min(0.8, 0.2 + 0.08 * bucket)


#: continuations from the model store: needs the store, learns nothing during a request
STORE = SourceSpec("store", store_prior, StoreConfig,
                   start=lambda prompt, config, store: StoreSource(store, prompt, config),
                   propose_rows=StoreSource.propose_rows, static=True, needs=("store",),
                   shared=lambda loaded: loaded["store"])
