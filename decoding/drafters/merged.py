"""The merged drafter: the heads' tree and the lookup sources (context, model store, bigram
statistics) in one trie per row, ranked by calibrated P(accepted) (:class:`~.hitrate.HitRate`);
each step keeps the width that maximizes expected tokens per millisecond under the cost model
(:class:`~.width.WidthChooser`). Without heads it is a pure lookup drafter
(:class:`~.lookup.LookupDrafter`; the Hierarchy Drafting order falls out of the ranking).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ...heads import DraftHeads
from ..cost import LINEAR_COST
from ..tree import Tree
from .candidates import CandidateBatch, Candidates
from .drafts import Drafts
from .heads_drafter import heads_batch
from .lookup import LookupConfig, LookupSources
from .interface import DraftState
from .review import review
from .tries import merge_rows
from .width import WidthChooser, finish_weights
from .worth import Recheck, moving_average, pays

if TYPE_CHECKING:
    from ..accept import Acceptance


def expected_tokens(tries: CandidateBatch, width: int) -> float:
    """Expected tokens of a step that verifies each row's first ``width`` − 1 nodes (best-first
    order), the root's token included: Σ_rows 1 + Σ kept scores."""
    return tries.rows + float(tries.score_block(width - 1).sum())


def width_scores(tries: CandidateBatch) -> np.ndarray:
    """(B, K) the rows' best-first scores as the width chooser reads them."""
    return tries.score_block(int(tries.sizes().max(initial=0)))


def reach(tree: Candidates, tokens: Sequence[int]) -> int:
    """How many of ``tokens`` (the base's continuation after the root) a prefix-closed tree
    accepts: the depth of its deepest node on that path."""
    paths, depth = tree.paths(), 0
    while depth < len(tokens) and tuple(tokens[: depth + 1]) in paths:
        depth += 1
    return depth


#: how many of the heads' latest proposal times their cost estimate is the median of
HEADS_MS_WINDOW = 9


@dataclass
class MergedDrafter:
    """Heads (optional) + lookup sources in one tree per row (see the module docstring).

    ``lookup_nodes``: the most draft nodes a row's lookup sources propose per step (prompt
    lookup proposes 10, SuffixDecoding up to 24-64); the merged tree then keeps the width the
    :class:`WidthChooser` finds best, at most the policy's tree size + ``lookup_nodes``.

    ``review`` (the *vertical cascade* of CS Drafting, off by default): the heads review the
    lookups' drafts before they take verification slots — each lookup node within the heads'
    depth is scored again with the heads' probability of its token given the root and the path
    before it (:meth:`~draftheads.heads.DraftHeads.path_probs`) as one more feature of its
    calibrated hit rate (:func:`review`)."""

    heads: DraftHeads | None
    lookup: LookupSources
    width: WidthChooser = field(default_factory=WidthChooser)
    lookup_nodes: int = 16
    review: bool = False
    _seen: dict[int, int] = field(default_factory=dict)
    _proposed: CandidateBatch | None = None  # the last step's tries, every row
    #: what the heads' proposal has been worth (see :meth:`_heads_pay`): ms per call — the median
    #: of the last ``HEADS_MS_WINDOW`` calls, so a cold first call (oneDNN builds a kernel per new
    #: row count: 20-50 ms against ~3 warm) cannot price the heads out for dozens of steps; the
    #: tokens the base accepted beyond what the lookups' own tree would have given, per unit of
    #: the lookups' first-token miss rate, and the verification ms their extra nodes cost (moving
    #: averages)
    _heads_ms: float | None = None
    _heads_gain: float | None = None
    _heads_extra_ms: float | None = None
    _misses: float = 0.0  # the lookups' first-token miss rate summed over rows, on the step the heads proposed in
    _alone_kept: CandidateBatch | None = None  # on that step, the tree the lookups alone would have verified
    _heads_times: deque = field(default_factory=lambda: deque(maxlen=HEADS_MS_WINDOW))
    #: steps of the current request this drafter proposed with and without the heads (reports, tests)
    heads_steps: int = 0
    skipped_heads_steps: int = 0
    #: after this many skipped steps in a row the heads propose again, so their cost and worth
    #: are measured afresh; each recheck after which they still do not pay doubles the wait, up
    #: to ``recheck_heads_max`` (:class:`~.worth.Recheck`; a recheck costs a proposal and its
    #: nodes: ~5 ms on a ~34 ms bf16 step, so one in 9 steps is an estimated ~1.5 % where the
    #: heads never pay)
    recheck_heads_every: int = 8
    recheck_heads_max: int = 64
    _heads_recheck: Recheck = field(init=False)
    #: the most live rows at which the heads' proposal is weighed against its cost (above: the
    #: heads always propose). In a batch the rows without a lookup match set how many steps it
    #: takes, and the heads are what drafts for them; skipping the heads for the batch as a whole
    #: cost those rows their drafts (bf16, bs 4: 99-105 steps against 81 with the heads always on)
    weigh_heads_up_to: int = 1
    #: the tree the heads fill in place of the policy's (None: the policy's). The default model
    #: sets a larger one than the heads-alone default (``MERGED_OFFER_SCALE`` in
    #: :mod:`draftheads.decoding.generate`): the width chooser verifies only what pays of it
    heads_tree: Tree | None = None
    _alone_step: tuple | None = None  # (tries, ctx, (width, expected tokens, ms)) of :meth:`_lookups_step`
    _weights: np.ndarray | None = None  # (B,) this step's :func:`~.width.finish_weights` for per-row counts (None: all 1)

    def __post_init__(self) -> None:
        self._heads_recheck = Recheck(self.recheck_heads_every, self.recheck_heads_max)

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        self.lookup.reset()
        self._seen.clear()
        self.heads_steps = self.skipped_heads_steps = 0  # what the heads learned (cost, worth) carries over
        # new text: recheck at the usual pace
        self._heads_recheck.restart()
        for row, prompt in enumerate(prompts):
            self.lookup.start(row, prompt)
            self._seen[row] = 0

    def propose(self, state: DraftState, tree: Tree) -> Drafts:
        if self.heads_tree is not None and tree.num_nodes > 1:  # a plain step stays plain
            tree = self.heads_tree
        tree = tree.fitting(min(state.room))
        budget = tree.num_nodes - 1 + self.lookup_nodes
        for row in state.rows:
            new = state.generated[row][self._seen[row]:]  # what the row emitted since it last drafted
            if new:
                self.lookup.extend(row, new)
                self._seen[row] += len(new)
        self._weights = self._finish_weights(state)
        ctx = state.context_length
        width, self._misses = None, 0.0
        heads_on = self.heads is not None and tree.num_nodes > 1
        parts = self.lookup.tries_rows(state.rows, self.lookup_nodes)
        if heads_on and not self._weighs_heads(len(state.rows)) and not self.review:
            # in a batch the heads always propose: every source is merged at once
            tries = merge_rows(parts + [self._heads_tries(state, tree)], budget).cap_depth(state.room)
            width, keep = self._cut(tries, ctx)
            self._count_heads_step(proposed=True)
        else:
            if self.review and self.heads is not None:
                reviewed = review(self.heads, state, merge_rows(parts, self.lookup_nodes).split(), self.lookup.hitrate)
                parts = [CandidateBatch.from_rows(reviewed)]
            tries = merge_rows(parts, budget).cap_depth(state.room)
            if heads_on and self._heads_pay(tries, ctx):
                alone = tries
                # the lookups' tries are merged already: the best ``budget`` of (their union + the
                # heads') are among (their best ``budget``) + the heads' (a node never outranks its parent)
                tries = merge_rows([tries, self._heads_tries(state, tree)], budget).cap_depth(state.room)
                width, keep = self._cut(tries, ctx)
                if self._weighs_heads(tries.rows):
                    self._learn_heads_worth(alone, tries, width, ctx)
            if heads_on:
                self._count_heads_step(proposed=width is not None)
        if width is None:
            priced = self._priced(tries, ctx)  # the lookups' own step, when :meth:`_heads_pay` priced it
            width, keep = (priced[0], priced[0] - 1) if priced and not self.width.per_row else self._cut(tries, ctx)
        # best-first order: each row's first nodes (width − 1, or its own count) are a prefix-closed tree
        self._proposed = tries.first(keep)
        return Drafts.from_candidates(state.roots, self._proposed)

    def _count_heads_step(self, proposed: bool) -> None:
        """A step the heads could draft in: they proposed, or :meth:`_heads_pay` skipped them."""
        self._heads_recheck.count(proposed)
        if proposed:
            self.heads_steps += 1
        else:
            self.skipped_heads_steps += 1

    def _heads_tries(self, state: DraftState, tree: Tree) -> CandidateBatch:
        """The heads' proposal for every live row on ``tree``, rescored on the P(accepted) scale;
        its time joins the median the heads are priced at (:meth:`_heads_pay`)."""
        started = time.perf_counter()
        tokens, probs = self.heads.propose(state.hidden, state.roots, tree.spec, with_probs=True)
        heads = self.lookup.hitrate.rescore(heads_batch(tree, tokens, probs))
        self._heads_times.append((time.perf_counter() - started) * 1e3)
        self._heads_ms = float(np.median(self._heads_times))
        return heads

    def _finish_weights(self, state: DraftState) -> np.ndarray | None:
        """(B,) what a token of each live row is worth this step (:func:`~.width.finish_weights`),
        where rows take their own node counts (``width.per_row``); None at one row, with
        ``width.finish_power`` 0, or with one width for every row: there the weights moved
        nothing but the width, and measured no better (bf16, dev mix, decode tok/s with / without:
        bs 4 145 / 152 and 99 / 106 (medians of 4 batches), bs 8 204 / 209 and 148 / 155, bs 16
        180 / 189), while per-row counts gained from them (bs 8 177 / 161, bs 16 152 / 145)."""
        if len(state.rows) < 2 or not self.width.finish_power or not self.width.per_row:
            return None
        emitted = [len(state.generated[row]) for row in state.rows] if state.generated else [1] * len(state.rows)
        return finish_weights(np.asarray(state.room) + 1, np.asarray(emitted), self.width.finish_power)

    def _cut(self, tries: CandidateBatch, ctx: int) -> tuple[float, int | np.ndarray]:
        """The step's width as the cost model prices it, and the nodes each row keeps: one width
        for every row (W, W − 1), or each row its own count (``width.per_row``: their mean slots
        per row, the (B,) counts)."""
        if not self.width.per_row:
            width = self.width.choose(width_scores(tries), ctx)
            return width, width - 1
        counts = self.width.counts(tries, ctx, self._weights)
        return 1.0 + float(counts.sum()) / max(tries.rows, 1), counts

    def _priced(self, tries: CandidateBatch, ctx: int) -> tuple[int, float, float] | None:
        """:meth:`_lookups_step`'s answer for these very tries, if it gave one this step."""
        step = self._alone_step
        return step[2] if step is not None and step[0] is tries and step[1] == ctx else None

    def _lookups_step(self, tries: CandidateBatch, ctx: int) -> tuple[int, float, float]:
        """The step the lookups' tries alone would make: (width, expected tokens, ms); asked by
        :meth:`_heads_pay` and again by :meth:`_learn_heads_worth` for the same tries, so kept."""
        priced = self._priced(tries, ctx)
        if priced is not None:
            return priced
        width = self.width.choose(width_scores(tries), ctx)
        step = (width, expected_tokens(tries, width), self.width.cost.step_ms(tries.rows, width, ctx))
        self._alone_step = (tries, ctx, step)
        return step

    def _learn_heads_worth(self, alone: CandidateBatch, merged: CandidateBatch, width: int, ctx: int) -> None:
        """On a step the heads propose in: what their extra nodes cost to verify (ms, a moving
        average), and the lookups' first-token miss rate their gain is counted against once the
        base has verified the step (:meth:`observe`)."""
        if self.width.cost is LINEAR_COST:
            return
        alone_width, _, alone_ms = self._lookups_step(alone, ctx)
        self._misses = max(float((1.0 - alone.first_scores()).sum()), 1e-3)
        self._alone_kept = alone.first(alone_width - 1)
        extra_ms = self.width.cost.step_ms(merged.rows, width, ctx) - alone_ms
        self._heads_extra_ms = moving_average(self._heads_extra_ms, max(0.0, extra_ms))

    def _weighs_heads(self, rows: int) -> bool:
        """Whether the heads' proposal is weighed against its cost at ``rows`` live rows
        (``weigh_heads_up_to``); above, the heads always propose."""
        return rows <= self.weigh_heads_up_to

    def _heads_pay(self, tries: CandidateBatch, ctx: int) -> bool:
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
        tokens from the lookups alone (the width chooser's step), so it pays when
        (T + G) / (t + p + v) > T / t. Until measured (the first proposals), again after a run of
        skipped steps (see ``recheck_heads_every``), and whenever more than
        ``weigh_heads_up_to`` rows are live, the heads propose."""
        if (self._heads_ms is None or self._heads_gain is None or self.width.cost is LINEAR_COST
                or not self._weighs_heads(tries.rows)):
            return True  # LINEAR_COST is relative, not ms: no step time to weigh the heads' ms against
        _, expected, step_ms = self._lookups_step(tries, ctx)
        gain = float((1.0 - tries.first_scores()).sum()) * self._heads_gain
        return self._heads_recheck.decide(pays(expected, step_ms, gain, self._heads_ms + (self._heads_extra_ms or 0.0)))

    def observe(self, drafts: Drafts, result: Acceptance, rows: Sequence[int]) -> None:
        """Each row's accepted drafts calibrate the hit rates of the sources that proposed them."""
        accepted = drafts.accepted_tokens(result.path, result.accepted)
        self.lookup.observe_rows(rows, self._proposed, accepted)
        if self._misses > 0 and self._alone_kept is not None:  # the heads proposed in this step
            bought = sum(len(taken) - reach(alone, taken + [bonus]) for alone, taken, bonus
                         in zip(self._alone_kept.split(), accepted, result.bonus.tolist()))
            self._heads_gain = moving_average(self._heads_gain, bought / self._misses)
        self._misses, self._alone_kept = 0.0, None


class LookupDrafter(MergedDrafter):
    """The lookup sources alone as a :class:`~.interface.Drafter`: a merged drafter without heads
    (``store``/``config``/``sources`` as :class:`~.lookup.LookupSources`)."""

    def __init__(self, store=None, config: LookupConfig = LookupConfig(), sources: Sequence[str] | None = None,
                 width: WidthChooser | None = None, lookup_nodes: int = 16):
        super().__init__(None, LookupSources(store, config, sources=sources), width or WidthChooser(LINEAR_COST),
                         lookup_nodes)
