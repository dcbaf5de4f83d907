"""All lookup sources of a batch behind one object (:class:`LookupSources`): per-row sources of
the registered lookup kinds (context, store, stats, … each row's a
:class:`~.interface.LookupSource`, see :mod:`.registry`), one shared :class:`HitRate`, and the
merge — what the merged drafter (:mod:`.merged`) wraps.

Rows are keyed by the caller's ids (a row keeps its id while others finish), so nothing here
depends on the batch layout. Each step: :meth:`tries_rows` (every source's tries for every live
row at once, one :class:`~.candidates.CandidateBatch` per source), verify, then
:meth:`observe_rows` the accepted draft tokens and :meth:`extend` with everything emitted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ...core.errors import InputError
from .candidates import CandidateBatch, Candidates
from .hitrate import HitRate
from .registry import available, lookup_names, needing, spec_of
from .store import ModelStore
from .tries import merge


@dataclass(frozen=True)
class LookupConfig:
    #: the lookup sources' configurations, each an instance of the config class its source
    #: registered (:attr:`.registry.SourceSpec.config`); a source without one here runs on its
    #: config's defaults
    configs: tuple = ()
    #: a static source (:attr:`.registry.SourceSpec.static`: "store", "stats") that proposed on
    #: this many steps of a row without one accepted draft stops being asked for that row (the
    #: request is not in its data); 0 = never. The context is always asked: it grows with the
    #: answer, so its matches come later.
    mute_after: int = 16

    def of(self, name: str) -> Any:
        """The configuration of the lookup source ``name``."""
        kind = spec_of(name).config
        for config in self.configs:
            if type(config) is kind:
                return config
        return kind()


def check_proposals(name: str, batch: Any, rows: int, vocab: int | None) -> None:
    """A source's proposals before they enter a tree: a :class:`CandidateBatch` of ``rows`` rows
    whose ids lie in [0, ``vocab``) — a bad one is one line naming the source, not a crash inside
    the verify forward. One min and one max over the step's ids (a few µs a step)."""
    if not isinstance(batch, CandidateBatch) or batch.rows != rows:
        got = f"of {batch.rows} row(s) " if isinstance(batch, CandidateBatch) else ""
        raise InputError(f"draft source {name!r}: propose_rows returned {type(batch).__name__} {got}for {rows} "
                         "row(s); it must return a CandidateBatch with one row per source it was given "
                         "(CandidateBatch.from_rows).")
    if vocab is None or not len(batch):
        return
    low, high = int(batch.token.min()), int(batch.token.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise InputError(f"draft source {name!r} proposed token id {bad}, outside the base's vocabulary [0, {vocab}): "
                         "fix its propose_rows to draft ids of the base's tokenizer (or unregister it).")


@dataclass
class SourceRecord:
    """One source's record in one row's request: steps it proposed on, and steps its own trie
    held the first accepted draft."""

    steps: int = 0
    hits: int = 0


class LookupSources:
    """The chosen lookup ``sources`` (default: every registered one there is data for: the
    context, plus the store and its bigram statistics when a store is given)."""

    def __init__(self, store: ModelStore | None = None, config: LookupConfig = LookupConfig(),
                 hitrate: HitRate | None = None, sources: Sequence[str] | None = None, vocab: int | None = None):
        loaded = {"store": store}
        if sources is None:
            sources = available([k for k, v in loaded.items() if v is not None], lookups_only=True)
        unknown = [s for s in sources if s not in lookup_names()]
        if unknown:
            raise ValueError(f"Unknown lookup source(s) {unknown}; choose from {list(lookup_names())}.")
        if store is None and needing("store", sources):
            names = " and ".join(repr(n) for n in needing("store", lookup_names()))
            rest = " or ".join(repr(n) for n in lookup_names() if not needing("store", [n]))
            raise ValueError(f"The {names} lookup sources need a model store: build one with "
                             "`draftheads store build --data <the base's answers.jsonl> --out <heads dir>/"
                             f"lookup_store.safetensors`, or draft with {rest} only.")
        self.store, self.config, self.sources = store, config, tuple(sources)
        self.vocab = vocab  # the base's embedding rows: every proposed id is checked below it (None: unchecked)
        self.specs = [spec_of(name) for name in self.sources]
        self.shared = [spec.shared(loaded) for spec in self.specs]  # what every row of a source reads
        self.hitrate = hitrate if hitrate is not None else HitRate()
        self.rows: dict[int, list] = {}
        self.records: dict[int, list[SourceRecord]] = {}  # per row, per source: steps proposed, steps hit
        self._last: tuple[list[int], list[CandidateBatch]] = ([], [])  # the last step's rows and each source's tries

    def reset(self) -> None:
        """Forget every row (a new request)."""
        self.rows.clear()
        self.records.clear()
        self._last = ([], [])

    def start(self, row: int, prompt: Sequence[int]) -> None:
        """Seed a row with its prompt (each source indexes it once)."""
        self.rows[row] = [spec.start(prompt, self.config.of(spec.name), shared)
                          for spec, shared in zip(self.specs, self.shared)]
        self.records[row] = [SourceRecord() for _ in self.sources]

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        for source in self.rows[row]:
            source.extend(tokens)

    def muted(self, row: int) -> list[str]:
        """The static sources this row no longer asks (see ``LookupConfig.mute_after``)."""
        limit = self.config.mute_after
        return [spec.name for spec, record in zip(self.specs, self.records[row])
                if limit and spec.static and record.steps >= limit and record.hits == 0]

    def tries_rows(self, rows: Sequence[int], budget: int) -> list[CandidateBatch]:
        """Each source's tries for ``rows`` (up to ``budget`` nodes a row), every row at once and
        rescored on the P(accepted) scale; a muted source proposes nothing for that row (and
        costs nothing)."""
        muted = {row: self.muted(row) for row in rows}
        proposed = [spec.propose_rows([None if spec.name in muted[row] else self.rows[row][k] for row in rows], budget)
                    for k, spec in enumerate(self.specs)]
        for spec, batch in zip(self.specs, proposed):
            check_proposals(spec.name, batch, len(rows), self.vocab)
        batches = self.hitrate.rescore_all(proposed)
        self._last = (list(rows), batches)
        return batches

    def tries(self, row: int, budget: int) -> list[Candidates]:
        """One row's :meth:`tries_rows`: each source's trie."""
        return [batch.split()[0] for batch in self.tries_rows([row], budget)]

    def propose(self, row: int, budget: int) -> Candidates:
        """The sources' tries merged to ``budget`` nodes."""
        return merge(self.tries(row, budget), budget)

    def observe_rows(self, rows: Sequence[int], proposed: CandidateBatch,
                     accepted_tokens: Sequence[Sequence[int]]) -> np.ndarray:
        """Calibrate the hit rates on what each row's tree proposed (``proposed`` row b is the
        caller's ``rows[b]``); count, per source and row, the steps it proposed on and those its
        own trie held the first accepted draft. Returns (B,) each row's accepted proposed nodes."""
        step_rows, batches = self._last
        index = {row: b for b, row in enumerate(step_rows)}
        first = np.full(len(step_rows), -1, dtype=np.int64)
        for row, tokens in zip(rows, accepted_tokens):
            if tokens and row in index:
                first[index[row]] = int(tokens[0])
        observed = [index[row] for row in rows if row in index]
        for k, batch in enumerate(batches):
            hit = (batch.depth == 1) & (batch.token == first[batch.row])
            steps = batch.sizes()[observed] > 0
            hits = np.bincount(batch.row[hit], minlength=len(step_rows))[observed] > 0
            for b, stepped, held in zip(observed, steps.tolist(), hits.tolist()):
                record = self.records[step_rows[b]][k]
                record.steps += stepped
                record.hits += held
        return self.hitrate.observe_rows(rows, proposed, accepted_tokens)

    def observe(self, row: int, proposed: Candidates, accepted_tokens: Sequence[int]) -> int:
        """One row's :meth:`observe_rows`."""
        return int(self.observe_rows([row], CandidateBatch.from_rows([proposed]), [accepted_tokens])[0])

    def drop(self, row: int) -> None:
        self.rows.pop(row, None)
        self.records.pop(row, None)
