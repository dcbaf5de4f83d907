"""All lookup sources of a batch behind one object: per-row context / store / stats sources,
one shared :class:`HitRate`, and the merge — what the loop's ``Drafter`` will wrap.

Rows are keyed by the caller's ids (a row keeps its id while others finish), so nothing here
depends on the batch layout. Each step: :meth:`propose` a trie per row, verify, then
:meth:`observe` the accepted draft tokens and :meth:`extend` with everything emitted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .candidates import Candidates, merge
from .context import ContextConfig, ContextSource
from .hitrate import HitRate
from .stats import BigramTable, StatsConfig, StatsSource
from .store import ModelStore, StoreConfig, StoreSource


@dataclass(frozen=True)
class LookupConfig:
    context: ContextConfig = field(default_factory=ContextConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)


class LookupDrafter:
    """Context source always; store and bigram sources when a store is given."""

    def __init__(self, store: ModelStore | None = None, config: LookupConfig = LookupConfig(),
                 hitrate: HitRate | None = None):
        self.store, self.config = store, config
        self.table = BigramTable.from_store(store) if store is not None else None
        self.hitrate = hitrate if hitrate is not None else HitRate()
        self.rows: dict[int, list] = {}

    def start(self, row: int, prompt: Sequence[int]) -> None:
        """Seed a row with its prompt (the context index scans it once)."""
        cfg = self.config
        sources: list = [ContextSource(prompt, cfg.context)]
        if self.store is not None:
            sources += [StoreSource(self.store, prompt, cfg.store), StatsSource(self.table, prompt, cfg.stats)]
        self.rows[row] = sources

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        for source in self.rows[row]:
            source.extend(tokens)

    def propose(self, row: int, budget: int) -> Candidates:
        """Each source's trie rescored on the P(accepted) scale, merged to ``budget`` nodes."""
        return merge([self.hitrate.rescore(s.propose(budget)) for s in self.rows[row]], budget)

    def observe(self, row: int, proposed: Candidates, accepted_tokens: Sequence[int]) -> int:
        return self.hitrate.observe(row, proposed, accepted_tokens)

    def drop(self, row: int) -> None:
        self.rows.pop(row, None)
