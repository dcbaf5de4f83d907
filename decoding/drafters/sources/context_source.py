"""Context source: suffix matches of a row's own prompt + accepted output (prompt lookup,
the context level of Hierarchy Drafting, SuffixDecoding's per-request tree).

Two incremental structures answer "the longest suffix of the history that occurred before,
and where it continued":

* :class:`NgramIndex` — for n = 1..max_ngram, a dict n-gram → continuation positions. An
  append adds max_ngram keys; a query probes at most max_ngram keys, longest first. Match
  length is capped at ``max_ngram``; several occurrences give several branches.
* :class:`SuffixAutomaton` — the online suffix automaton (amortised O(1) per append), exact
  longest match of any length, but one occurrence (its first) per match.

Both index only n-grams that already have a following token, so the history's own suffix is
never its own match (the trivial self-match). The automaton is the faster of the two by tens
of µs a step, but the n-gram index's branches are accepted more often in every category, worth
far more next to a verification forward: :class:`ContextSource` defaults to the n-gram index;
``ContextConfig(structure="automaton")`` keeps the other. evidence: results/drafting_sources/lookup_sources
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..candidates import CandidateBatch, Candidates
from ..registry import SourceSpec, source_id
from ..tries import continuation_tries


@dataclass(frozen=True)
class ContextConfig:
    max_ngram: int = 4  # longest suffix matched (keys held per position)
    max_depth: int = 16  # tokens per proposed chain
    max_occurrences: int = 8  # most recent occurrences turned into branches
    eos_token_id: int | None = None  # drafts are cut after EOS
    structure: str = "ngram"  # "ngram" (branches, match ≤ max_ngram) or "automaton" (one chain, exact match)


class NgramIndex:
    """Rolling n-gram → continuation-start positions (ascending), n = 1..max_ngram."""

    def __init__(self, max_ngram: int, tokens: Sequence[int] = ()):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}.")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; each registers the n-grams that end just before it (they now have a
        continuation). Cost O(max_ngram) per token, independent of the history length."""
        hist, table, nmax = self.tokens, self.table, self.max_ngram
        for t in tokens:
            end = len(hist)
            for n in range(1, min(nmax, end) + 1):
                key = tuple(hist[end - n:end])
                positions = table.get(key)
                if positions is None:
                    table[key] = [end]
                else:
                    positions.append(end)
            hist.append(int(t))

    def match(self) -> tuple[int, list[int]]:
        """(match length, continuation starts most recent first) of the longest indexed suffix."""
        hist = self.tokens
        for n in range(min(self.max_ngram, len(hist)), 0, -1):
            positions = self.table.get(tuple(hist[len(hist) - n:]))
            if positions:
                return n, positions[::-1]
        return 0, []


class SuffixAutomaton:
    """Online suffix automaton over the history (Blumer et al.); ``first`` = end position of a
    state's first occurrence. The longest suffix seen before is the suffix link of the state
    of the whole history."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.first: list[int] = [-1]
        self.last = 0
        self.extend(tokens)

    def _state(self, length: int, first: int, link: int, nxt: dict[int, int]) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.first.append(first)
        return len(self.length) - 1

    def extend(self, tokens: Sequence[int]) -> None:
        nxt, link, length = self.next, self.link, self.length
        for t in tokens:
            t = int(t)
            pos = len(self.tokens)
            self.tokens.append(t)
            cur = self._state(length[self.last] + 1, pos, -1, {})
            p = self.last
            while p != -1 and t not in nxt[p]:
                nxt[p][t] = cur
                p = link[p]
            if p == -1:
                link[cur] = 0
            else:
                q = nxt[p][t]
                if length[p] + 1 == length[q]:
                    link[cur] = q
                else:
                    clone = self._state(length[p] + 1, self.first[q], link[q], dict(nxt[q]))
                    while p != -1 and nxt[p].get(t) == q:
                        nxt[p][t] = clone
                        p = link[p]
                    link[q] = link[cur] = clone
            self.last = cur

    def match(self) -> tuple[int, list[int]]:
        """(length, [continuation start of the first earlier occurrence]) or (0, [])."""
        s = self.link[self.last] if self.tokens else -1
        if s <= 0:
            return 0, []
        return self.length[s], [self.first[s] + 1]


def continuations(tokens: Sequence[int], starts: Sequence[int], max_depth: int, eos: int | None) -> list[list[int]]:
    """The ``max_depth`` tokens after each start, cut after EOS (never padded)."""
    out = []
    for s in starts:
        seq = list(tokens[s:s + max_depth])
        if eos is not None and eos in seq:
            seq = seq[:seq.index(eos) + 1]
        if seq:
            out.append(seq)
    return out


class ContextSource:
    """One row's context drafter: seed with the prompt, :meth:`extend` with accepted tokens,
    :meth:`propose` each step."""

    def __init__(self, prompt: Sequence[int], config: ContextConfig = ContextConfig()):
        if config.structure not in ("ngram", "automaton"):
            raise ValueError(f"ContextConfig.structure must be 'ngram' or 'automaton', got {config.structure!r}.")
        self.config = config
        self.index = NgramIndex(config.max_ngram, prompt) if config.structure == "ngram" else SuffixAutomaton(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        self.index.extend(tokens)

    def continuations(self, budget: int) -> tuple[int, list[list[int]]]:
        """(match length, the continuations of the most recent occurrences of the longest match),
        each at most ``budget`` tokens: a chain deeper than the budget could never be kept whole."""
        n, starts = self.index.match()
        if n == 0 or budget <= 0:
            return 0, []
        cfg = self.config
        return n, continuations(self.index.tokens, starts[:cfg.max_occurrences], min(cfg.max_depth, budget),
                                cfg.eos_token_id)

    def propose(self, budget: int, q: float | None = None) -> Candidates:
        """Up to ``budget`` nodes: branches from the most recent occurrences of the longest
        match; ``q`` = per-token calibration for this match length (default: the prior)."""
        return ContextSource.propose_rows([self], budget, q).split()[0]

    @staticmethod
    def propose_rows(sources: Sequence["ContextSource | None"], budget: int, q: float | None = None) -> CandidateBatch:
        """Every row's :meth:`propose` at once (``None``: a row that does not ask this source)."""
        found = [(row, *s.continuations(budget)) for row, s in enumerate(sources) if s is not None]
        return continuation_tries(found, len(sources), source_id("context"), budget, q)


def context_prior(bucket: int) -> float:
    """Context matches are trusted more the longer they are (``bucket``: the match length)."""
    return min(0.9, 0.35 + 0.1 * bucket)


#: suffix matches in the row's own prompt and answer so far: needs no file, grows with the answer
CONTEXT = SourceSpec("context", context_prior, ContextConfig,
                     start=lambda prompt, config, shared: ContextSource(prompt, config),
                     propose_rows=ContextSource.propose_rows)
