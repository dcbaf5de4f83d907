"""Whether an optional part of drafting is worth its time this step, and when to measure it
again after it was skipped: the heads beside a lookup match at one row (:class:`HeadsWorth`,
asked by :class:`~.merged.MergedDrafter` each step).

A step that verifies T expected tokens in t ms without the part gains
G tokens with it and costs p ms more to draft and v ms more to verify, so the part pays when
(T + G) / (t + p + v) > T / t — with G, p and v measured on the steps it took part in.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..cost import LINEAR_COST
from .candidates import CandidateBatch, Candidates
from .width import WidthChooser, width_scores


def moving_average(previous: float | None, value: float, weight: float = 0.2) -> float:
    """An exponential moving average (the first value starts it)."""
    return value if previous is None else (1.0 - weight) * previous + weight * value


def pays(expected: float, step_ms: float, gain: float, extra_ms: float) -> bool:
    """(T + G) / (t + p + v) > T / t: ``expected`` T tokens in ``step_ms`` t without the part,
    ``gain`` G more tokens with it for ``extra_ms`` p + v more."""
    return (expected + gain) * step_ms > expected * (step_ms + extra_ms)


@dataclass
class Recheck:
    """When a part that does not pay is measured again: after ``every`` skipped steps in a row
    it takes part once (a slow first call, or text that changed, never rules it out for good);
    each recheck after which it still does not pay doubles the wait, up to ``most``, and one
    after which it pays sets the wait back."""

    every: int = 8
    most: int = 64
    wait: int = field(init=False)  # the current wait; ``every`` at the start of a request
    rechecked: bool = False  # the last step was a recheck: the next verdict sets the wait
    skipped_in_a_row: int = 0

    def __post_init__(self) -> None:
        self.wait = self.every

    def restart(self) -> None:
        """A new request: new text, rechecked at the usual pace."""
        self.wait, self.rechecked = self.every, False

    def decide(self, worth_it: bool) -> bool:
        """Whether the part takes part this step, given whether it pays."""
        if self.rechecked:  # the verdict right after a recheck sets the wait before the next one
            self.wait = self.every if worth_it else min(2 * self.wait, self.most)
            self.rechecked = False
        if not worth_it and self.skipped_in_a_row >= self.wait:
            self.rechecked = True
            return True
        return worth_it

    def count(self, took_part: bool) -> None:
        """A step the part took part in (the run of skipped steps ends) or was skipped in."""
        self.skipped_in_a_row = 0 if took_part else self.skipped_in_a_row + 1


def expected_tokens(tries: CandidateBatch, width: int) -> float:
    """Expected tokens of a step that verifies each row's first ``width`` − 1 nodes (best-first
    order), the root's token included: Σ_rows 1 + Σ kept scores."""
    return tries.rows + float(tries.score_block(width - 1).sum())


def reach(tree: Candidates, tokens: Sequence[int]) -> int:
    """How many of ``tokens`` (the base's continuation after the root) a prefix-closed tree
    accepts: the depth of its deepest node on that path."""
    paths, depth = tree.paths(), 0
    while depth < len(tokens) and tuple(tokens[: depth + 1]) in paths:
        depth += 1
    return depth


#: how many of the heads' latest proposal times their cost estimate is the median of: a cold
#: first call (a kernel built per new row count, many warm calls' time) must not price the
#: heads out for dozens of steps. evidence: results/drafting_sources/drafting_phases
HEADS_MS_WINDOW = 9


@dataclass
class HeadsWorth:
    """Whether the heads' proposal pays this step beside the lookups' tries (:meth:`pays`), and
    what it has been worth: ``ms`` per proposal (the median of the last ``HEADS_MS_WINDOW``
    calls), ``gain`` the tokens the base accepted beyond what the lookups' own tree would have
    given, per unit of the lookups' first-token miss rate, and ``extra_ms`` the verification
    ms their extra nodes cost (moving averages). What is learned carries over requests."""

    #: after this many skipped steps in a row the heads propose again, so their cost and worth
    #: are measured afresh; each recheck after which they still do not pay doubles the wait, up
    #: to ``recheck_most`` (:class:`Recheck`): a recheck costs a proposal and its nodes, so where
    #: the heads never pay the rechecks stay a small share of the steps
    recheck_every: int = 8
    recheck_most: int = 64
    #: the most live rows at which the heads' proposal is weighed against its cost. Above, a step's
    #: heads are not skipped for a lookup match: the rows without one set how many steps a batch
    #: takes (evidence: results/batch/batch_drafting_bf16_v4); the batch's mode — merged, lookups
    #: alone, heads alone — is chosen by measured speed instead (:class:`~.modes.BatchModes`)
    weigh_up_to: int = 1
    ms: float | None = None
    gain: float | None = None
    extra_ms: float | None = None
    #: a step's wall time beyond what the cost model prices (its forward at the chosen width) and the
    #: heads' proposal: the lookups' drafting, acceptance, the cache's commit, the loop (a moving
    #: average, :meth:`stepped`); T tokens come in t + this, so the heads' p weighs against all of it
    overhead_ms: float | None = None
    recheck: Recheck = field(init=False)
    _times: deque = field(default_factory=lambda: deque(maxlen=HEADS_MS_WINDOW))
    _misses: float = 0.0  # the lookups' first-token miss rate summed over rows, on the step the heads proposed in
    _alone_kept: CandidateBatch | None = None  # on that step, the tree the lookups alone would have verified
    _alone_step: tuple | None = None  # (tries, kv_len, (width, expected tokens, ms)) of :meth:`lookups_step`

    def __post_init__(self) -> None:
        self.recheck = Recheck(self.recheck_every, self.recheck_most)

    def restart(self) -> None:
        """A new request: what the heads learned (cost, worth) carries over; new text is
        rechecked at the usual pace."""
        self.recheck.restart()

    def new_step(self) -> None:
        """A step begins: no miss rate counted yet."""
        self._misses = 0.0

    def weighs(self, rows: int) -> bool:
        """Whether the heads' proposal is weighed against its cost at ``rows`` live rows
        (``weigh_up_to``); above, the heads always propose."""
        return rows <= self.weigh_up_to

    def timed(self, ms: float) -> None:
        """One proposal's time joins the median the heads are priced at."""
        self._times.append(ms)
        self.ms = float(np.median(self._times))

    def count(self, proposed: bool) -> None:
        """A step the heads could draft in: they proposed, or :meth:`pays` skipped them."""
        self.recheck.count(proposed)

    def stepped(self, wall_ms: float, priced_ms: float) -> None:
        """One whole step took ``wall_ms`` where the cost model and the heads' proposal account for
        ``priced_ms``: the rest joins :attr:`overhead_ms`."""
        self.overhead_ms = moving_average(self.overhead_ms, max(0.0, wall_ms - priced_ms))

    def priced(self, tries: CandidateBatch, kv_len: int) -> tuple[int, float, float] | None:
        """:meth:`lookups_step`'s answer for these very tries, if it gave one this step."""
        step = self._alone_step
        return step[2] if step is not None and step[0] is tries and step[1] == kv_len else None

    def lookups_step(self, tries: CandidateBatch, kv_len: int, width: WidthChooser) -> tuple[int, float, float]:
        """The step the lookups' tries alone would make under ``width``: (width, expected tokens,
        ms); asked by :meth:`pays` and again by :meth:`learn` for the same tries, so kept."""
        priced = self.priced(tries, kv_len)
        if priced is not None:
            return priced
        chosen = width.choose(width_scores(tries), kv_len)
        step = (chosen, expected_tokens(tries, chosen), width.cost.step_ms(tries.rows, chosen, kv_len))
        self._alone_step = (tries, kv_len, step)
        return step

    def pays(self, tries: CandidateBatch, kv_len: int, width: WidthChooser) -> bool:
        """Whether the heads' proposal is worth its time this step, given the lookups' tries.

        The heads draft below the root only, so where a lookup's first token is accepted with
        probability s₁ their tree adds accepted tokens only in the other 1 − s₁ of cases: the
        gain is G = Σ_rows (1 − s₁) · g, g the tokens the base accepted beyond what the lookups'
        own tree (at their own width) would have accepted of the same continuation, per unit of
        that miss rate on the steps they proposed in — measured, not their calibrated scores, and
        not the tokens of heads-sourced nodes: a heads node often carries a token the lookups
        proposed too, and heads nodes can push lookup nodes out of the cut, so what the heads
        bought is the difference, which can be negative. It costs p ms to
        propose plus v ms to verify their extra nodes, on a step of t ms that yields T expected
        tokens from the lookups alone (the width chooser's step, plus the step's measured wall time
        beyond it: :attr:`overhead_ms`), so it pays when
        (T + G) / (t + p + v) > T / t. Until measured (the first proposals), again after a run of
        skipped steps (see ``recheck_every``), and whenever more than ``weigh_up_to`` rows are
        live, the heads propose."""
        if self.ms is None or self.gain is None or width.cost is LINEAR_COST or not self.weighs(tries.rows):
            return True  # LINEAR_COST is relative, not ms: no step time to weigh the heads' ms against
        _, expected, step_ms = self.lookups_step(tries, kv_len, width)
        gain = float((1.0 - tries.first_scores()).sum()) * self.gain
        step_ms += self.overhead_ms or 0.0  # what the step costs beyond its forward, heads or not
        return self.recheck.decide(pays(expected, step_ms, gain, self.ms + (self.extra_ms or 0.0)))

    def learn(self, alone: CandidateBatch, merged: CandidateBatch, merged_width: float, kv_len: int,
              width: WidthChooser) -> None:
        """On a step the heads propose in: what their extra nodes cost to verify (ms, a moving
        average), and the lookups' first-token miss rate their gain is counted against once the
        base has verified the step (:meth:`observe`)."""
        if width.cost is LINEAR_COST:
            return
        alone_width, _, alone_ms = self.lookups_step(alone, kv_len, width)
        self._misses = max(float((1.0 - alone.first_scores()).sum()), 1e-3)
        self._alone_kept = alone.first(alone_width - 1)
        extra_ms = width.cost.step_ms(merged.rows, merged_width, kv_len) - alone_ms
        self.extra_ms = moving_average(self.extra_ms, max(0.0, extra_ms))

    def observe(self, accepted: Sequence[list[int]], bonus: torch.Tensor) -> None:
        """After the verification: on a step the heads proposed in (and :meth:`learn` counted),
        what they bought — the tokens each row accepted beyond the lookups' own tree's
        :func:`reach` of the same continuation (``accepted`` per row, ``bonus`` (B,) the base's
        token after them) — per unit of the lookups' miss rate, into ``gain``."""
        if self._misses > 0 and self._alone_kept is not None:  # the heads proposed in this step
            bought = sum(len(taken) - reach(alone, taken + [extra]) for alone, taken, extra
                         in zip(self._alone_kept.split(), accepted, bonus.tolist()))
            self.gain = moving_average(self.gain, bought / self._misses)
        self._misses, self._alone_kept = 0.0, None
