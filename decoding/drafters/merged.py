"""The merged drafter: the heads' tree and the lookup sources (context, model store, bigram
statistics) in one trie per row, ranked by calibrated P(accepted) (:class:`~.hitrate.HitRate`);
each step keeps the width that maximizes expected tokens per millisecond under the cost model
(:class:`~.width.WidthChooser`). Without heads it is a pure lookup drafter
(:class:`~.lookup.LookupDrafter`; the Hierarchy Drafting order falls out of the ranking).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ...heads import DraftHeads
from ..cost import LINEAR_COST
from ..tree import Tree
from .candidates import CandidateBatch, step_trees
from ..step_trees import StepTrees
from .heads_drafter import heads_propose, heads_tries
from .lookup import LookupConfig, LookupSources
from .interface import DraftState, plain_step
from .modes import BatchModes
from .review import review
from .tries import merge_rows
from .width import WidthChooser, finish_weights, width_scores
from .worth import HeadsWorth

if TYPE_CHECKING:
    from ..accept import Acceptance


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
    calibrated hit rate (:func:`review`).

    ``worth``: whether the heads' proposal pays this step beside the lookups' tries, and what it
    has been worth (:class:`~.worth.HeadsWorth`); ``modes``: above the rows it weighs at, which of
    the merged tree, the lookups alone and the heads alone on the policy's tree drafts a batch's
    step, by their measured speeds (:class:`~.modes.BatchModes`)."""

    heads: DraftHeads | None
    lookup: LookupSources
    width: WidthChooser = field(default_factory=WidthChooser)
    lookup_nodes: int = 16
    review: bool = False
    worth: HeadsWorth = field(default_factory=HeadsWorth)
    modes: BatchModes = field(default_factory=BatchModes)
    #: the tree the heads fill in place of the policy's (None: the policy's). The default model
    #: sets a larger one than the heads-alone default (``MERGED_OFFER_SCALE`` in
    #: :mod:`draftheads.decoding.config`): the width chooser verifies only what pays of it
    heads_tree: Tree | None = None
    #: steps of the current request this drafter proposed with and without the heads (reports, tests)
    heads_steps: int = 0
    skipped_heads_steps: int = 0
    #: steps of the current request per batch mode (:mod:`.modes`; steps at weighed row counts are not counted)
    mode_steps: dict[str, int] = field(default_factory=dict)
    _seen: dict[int, int] = field(default_factory=dict)
    _proposed: CandidateBatch | None = None  # the last step's tries, every row
    _weights: np.ndarray | None = None  # (B,) this step's :func:`~.width.finish_weights` for per-row counts (None: all 1)
    _step: tuple[float, float] | None = None  # the weighed step under way: (its start, the ms priced for it)
    _heads_ms: float = 0.0  # this step's heads' proposal (ms; 0 when they sat out)
    _mode_started: float | None = None  # when the batch-mode step under way was proposed (perf_counter s)

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        self.lookup.reset()
        self._seen.clear()
        self.heads_steps = self.skipped_heads_steps = 0
        self.mode_steps = {}
        self.worth.restart()
        self.modes.abandon()
        self._step = None  # the time between requests is no step
        for row, prompt in enumerate(prompts):
            self.lookup.start(row, prompt)
            self._seen[row] = 0

    def max_nodes(self, tree_nodes: int) -> int:
        """The most slots a row's step verifies under a policy tree of ``tree_nodes``, root
        included: the heads' tree (their larger offer where set) and the lookups' nodes, cut at
        the width chooser's widest — more than the policy's tree (:meth:`propose`'s budget)."""
        offered = self.heads_tree.num_nodes if self.heads_tree is not None and tree_nodes > 1 else tree_nodes
        return min(self.width.max_nodes, offered + self.lookup_nodes)

    def propose(self, state: DraftState, tree: Tree) -> StepTrees:
        started = time.perf_counter()
        if self._step is not None:  # the last step ran from its proposal to this one
            self.worth.stepped((started - self._step[0]) * 1e3, self._step[1])
            self._step = None
        if self._mode_started is not None:
            self.modes.finished((started - self._mode_started) * 1e3)
            self._mode_started = None
        kv_len = state.context_length
        mode = self._mode(state, tree, kv_len, started)
        if mode == "heads":  # the heads alone fill the policy's tree, as the heads' own drafter does; the
            self._proposed = None  # lookups hear the rows' new tokens when they next draft (one call for all)
            tree = tree.fitting(min(state.room))
            if tree.num_nodes == 1:
                return plain_step(state.roots)
            return StepTrees.uniform(tree, heads_propose(self.heads, state, tree.spec))
        for row in state.rows:
            new = state.generated[row][self._seen[row]:]  # what the row emitted since it last drafted
            if new:
                self.lookup.extend(row, new)
                self._seen[row] += len(new)
        if self.heads_tree is not None and tree.num_nodes > 1:  # a plain step stays plain
            tree = self.heads_tree
        tree = tree.fitting(min(state.room))
        budget = tree.num_nodes - 1 + self.lookup_nodes
        self._weights = self._finish_weights(state)
        width = None
        self._heads_ms = 0.0  # the heads' proposal this step (0: they sat out)
        self.worth.new_step()
        heads_on = self.heads is not None and tree.num_nodes > 1 and mode != "lookups"
        parts = self.lookup.tries_rows(state.rows, self.lookup_nodes)
        if heads_on and not self.worth.weighs(len(state.rows)) and not self.review:
            # a batch's merged mode: every source is merged at once
            tries = merge_rows(parts + [self._heads_tries(state, tree)], budget).cap_depth(state.room)
            width, keep = self._cut(tries, kv_len)
            self._count_heads_step(proposed=True)
        else:
            if self.review and self.heads is not None:
                reviewed = review(self.heads, state, merge_rows(parts, self.lookup_nodes).split(), self.lookup.hitrate)
                parts = [CandidateBatch.from_rows(reviewed)]
            tries = merge_rows(parts, budget).cap_depth(state.room)
            if heads_on and self.worth.pays(tries, kv_len, self.width):
                alone = tries
                # the lookups' tries are merged already: the best ``budget`` of (their union + the
                # heads') are among (their best ``budget``) + the heads' (a node never outranks its parent)
                tries = merge_rows([tries, self._heads_tries(state, tree)], budget).cap_depth(state.room)
                width, keep = self._cut(tries, kv_len)
                if self.worth.weighs(tries.rows):
                    self.worth.learn(alone, tries, width, kv_len, self.width)
            if heads_on:
                self._count_heads_step(proposed=width is not None)
        if width is None:
            priced = self.worth.priced(tries, kv_len)  # the lookups' own step, when the worth check priced it
            width, keep = (priced[0], priced[0] - 1) if priced and not self.width.per_row else self._cut(tries, kv_len)
        if heads_on and self.worth.weighs(tries.rows) and self.width.cost is not LINEAR_COST:
            # the step's wall time beyond its priced forward and the heads' proposal is the overhead the worth
            # check weighs the heads against (measured at the next proposal)
            self._step = (started, self.width.cost.step_ms(tries.rows, width, kv_len) + self._heads_ms)
        # best-first order: each row's first nodes (width − 1, or its own count) are a prefix-closed tree
        self._proposed = tries.first(keep)
        return step_trees(state.roots, self._proposed)

    def _mode(self, state: DraftState, tree: Tree, kv_len: int, started: float) -> str | None:
        """The batch mode of this step (:class:`~.modes.BatchModes`), or None where none is chosen:
        no heads, rows the heads' worth is weighed at, the vertical cascade, or a cost model without
        milliseconds (LINEAR_COST). Where the policy's tree is plain the heads' mode is a plain step
        (what the heads alone do there) and the merged mode is the lookups'."""
        rows = len(state.rows)
        if self.heads is None or self.worth.weighs(rows) or self.review or self.width.cost is LINEAR_COST:
            return None
        mode = self.modes.choose(rows)
        self.modes.started(rows, mode, self.width.cost.step_ms(rows, 1, kv_len))
        self._mode_started = started
        self.mode_steps[mode] = self.mode_steps.get(mode, 0) + 1
        return mode

    def _count_heads_step(self, proposed: bool) -> None:
        """A step the heads could draft in: they proposed, or their worth check skipped them."""
        self.worth.count(proposed)
        if proposed:
            self.heads_steps += 1
        else:
            self.skipped_heads_steps += 1

    def _heads_tries(self, state: DraftState, tree: Tree) -> CandidateBatch:
        """The heads' proposal for every live row on ``tree``, rescored on the P(accepted) scale;
        its time joins the median the heads are priced at (:meth:`~.worth.HeadsWorth.timed`)."""
        started = time.perf_counter()
        heads = heads_tries(self.heads, state, tree, self.lookup.hitrate)
        self._heads_ms = (time.perf_counter() - started) * 1e3
        self.worth.timed(self._heads_ms)
        return heads

    def _finish_weights(self, state: DraftState) -> np.ndarray | None:
        """(B,) what a token of each live row is worth this step (:func:`~.width.finish_weights`),
        where rows take their own node counts (``width.per_row``); None at one row, with
        ``width.finish_power`` 0, or with one width for every row: there the weights moved
        nothing but the width and decoded no faster, while per-row counts gain from them.
        evidence: results/batch/batch_drafting_bf16_v4"""
        if len(state.rows) < 2 or not self.width.finish_power or not self.width.per_row:
            return None
        emitted = [len(state.generated[row]) for row in state.rows] if state.generated else [1] * len(state.rows)
        return finish_weights(np.asarray(state.room) + 1, np.asarray(emitted), self.width.finish_power)

    def _cut(self, tries: CandidateBatch, kv_len: int) -> tuple[float, int | np.ndarray]:
        """The step's width as the cost model prices it, and the nodes each row keeps: one width
        for every row (W, W − 1), or each row its own count (``width.per_row``: their mean slots
        per row, the (B,) counts)."""
        if not self.width.per_row:
            width = self.width.choose(width_scores(tries), kv_len)
            return width, width - 1
        counts = self.width.counts(tries, kv_len, self._weights)
        return 1.0 + float(counts.sum()) / max(tries.rows, 1), counts

    def observe(self, trees: StepTrees, result: Acceptance, rows: Sequence[int]) -> None:
        """Each row's accepted drafts calibrate the hit rates of the sources that proposed them."""
        if self._mode_started is not None:  # a batch-mode step: each row's accepted drafts and the base's token
            self.modes.emitted(int(result.accepted.sum()) + len(rows))
        if self._proposed is None:  # the heads alone drafted (a batch mode): nothing of the lookups' to calibrate
            return
        accepted = trees.accepted_tokens(result.path, result.accepted)
        self.lookup.observe_rows(rows, self._proposed, accepted)
        self.worth.observe(accepted, result.bonus)


class LookupDrafter(MergedDrafter):
    """The lookup sources alone as a :class:`~.interface.Drafter`: a merged drafter without heads
    (``store``/``config``/``sources`` as :class:`~.lookup.LookupSources`)."""

    def __init__(self, store=None, config: LookupConfig = LookupConfig(), sources: Sequence[str] | None = None,
                 width: WidthChooser | None = None, lookup_nodes: int = 16):
        super().__init__(None, LookupSources(store, config, sources=sources), width or WidthChooser(LINEAR_COST),
                         lookup_nodes)
