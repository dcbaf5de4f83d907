"""All lookup sources of a batch behind one object (:class:`LookupSources`): per-row context /
store / stats sources (each a :class:`~.interface.LookupSource`), one shared :class:`HitRate`,
and the merge — what the merged drafter (:mod:`.merged`) wraps.

Rows are keyed by the caller's ids (a row keeps its id while others finish), so nothing here
depends on the batch layout. Each step: :meth:`propose` a trie per row, verify, then
:meth:`observe` the accepted draft tokens and :meth:`extend` with everything emitted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .candidates import Candidates, merge
from .context_source import ContextConfig, ContextSource
from .hitrate import HitRate
from .stats import BigramTable, StatsConfig, StatsSource
from .store import ModelStore, StoreConfig, StoreSource


@dataclass(frozen=True)
class LookupConfig:
    context: ContextConfig = field(default_factory=ContextConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    #: a static source ("store", "stats") that proposed on this many steps of a row without one
    #: accepted draft stops being asked for that row (the request is not in its data); 0 = never.
    #: The context is always asked: it grows with the answer, so its matches come later.
    mute_after: int = 16


#: the sources whose data does not change during a request (see ``LookupConfig.mute_after``)
STATIC_SOURCES = ("store", "stats")


@dataclass
class SourceRecord:
    """One source's record in one row's request: steps it proposed on, and steps its own trie
    held the first accepted draft."""

    steps: int = 0
    hits: int = 0


#: the lookup sources, most local first (Hierarchy Drafting's order)
LOOKUP_SOURCES = ("context", "store", "stats")


class LookupSources:
    """The chosen ``sources`` (default: context, plus store and bigram statistics when a store
    is given); "store" and "stats" need the store (the bigram table is read from it)."""

    def __init__(self, store: ModelStore | None = None, config: LookupConfig = LookupConfig(),
                 hitrate: HitRate | None = None, sources: Sequence[str] | None = None):
        if sources is None:
            sources = LOOKUP_SOURCES if store is not None else ("context",)
        unknown = [s for s in sources if s not in LOOKUP_SOURCES]
        if unknown:
            raise ValueError(f"Unknown lookup source(s) {unknown}; choose from {list(LOOKUP_SOURCES)}.")
        if store is None and any(s in ("store", "stats") for s in sources):
            raise ValueError("The 'store' and 'stats' lookup sources need a model store: build one with "
                             "`python scripts/build_store.py --data <the base's answers.jsonl> --out <heads dir>/"
                             "lookup_store.safetensors`, or draft with 'context' only.")
        self.store, self.config, self.sources = store, config, tuple(sources)
        self.table = BigramTable.from_store(store) if "stats" in self.sources else None
        self.hitrate = hitrate if hitrate is not None else HitRate()
        self.rows: dict[int, list] = {}
        self.records: dict[int, list[SourceRecord]] = {}  # per row, per source: steps proposed, steps hit
        self._last: dict[int, list[Candidates]] = {}  # per row: each source's trie of the last step

    def reset(self) -> None:
        """Forget every row (a new request)."""
        self.rows.clear()
        self.records.clear()
        self._last.clear()

    def start(self, row: int, prompt: Sequence[int]) -> None:
        """Seed a row with its prompt (each source indexes it once)."""
        cfg = self.config
        make = {"context": lambda: ContextSource(prompt, cfg.context),
                "store": lambda: StoreSource(self.store, prompt, cfg.store),
                "stats": lambda: StatsSource(self.table, prompt, cfg.stats)}
        self.rows[row] = [make[name]() for name in self.sources]
        self.records[row] = [SourceRecord() for _ in self.sources]
        self._last[row] = []

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        for source in self.rows[row]:
            source.extend(tokens)

    def muted(self, row: int) -> list[str]:
        """The static sources this row no longer asks (see ``LookupConfig.mute_after``)."""
        limit = self.config.mute_after
        return [name for name, record in zip(self.sources, self.records[row])
                if limit and name in STATIC_SOURCES and record.steps >= limit and record.hits == 0]

    def tries(self, row: int, budget: int) -> list[Candidates]:
        """Each source's trie (up to ``budget`` nodes) rescored on the P(accepted) scale; a
        muted source proposes nothing (and costs nothing)."""
        muted = self.muted(row)
        self._last[row] = [Candidates.empty() if name in muted else self.hitrate.rescore(s.propose(budget))
                           for name, s in zip(self.sources, self.rows[row])]
        return self._last[row]

    def propose(self, row: int, budget: int) -> Candidates:
        """The sources' tries merged to ``budget`` nodes."""
        return merge(self.tries(row, budget), budget)

    def observe(self, row: int, proposed: Candidates, accepted_tokens: Sequence[int]) -> int:
        """Calibrate the hit rates on what the tree proposed; count, per source, the steps it
        proposed on and those its own trie held the first accepted draft."""
        for trie, record in zip(self._last.get(row, []), self.records.get(row, [])):
            if len(trie):
                record.steps += 1
                record.hits += bool(accepted_tokens) and bool((trie.token[trie.depth == 1] == accepted_tokens[0]).any())
        return self.hitrate.observe(row, proposed, accepted_tokens)

    def drop(self, row: int) -> None:
        self.rows.pop(row, None)
        self.records.pop(row, None)
        self._last.pop(row, None)
