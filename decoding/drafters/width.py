"""How many slots a merged step keeps: the width with the most expected tokens per
millisecond under the cost model (:mod:`..cost`)."""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from ..cost import LINEAR_COST, CostModel
from .candidates import CandidateBatch
from ..step_trees import SKIP_PADDING_SLOTS


#: how steeply a row's worth falls as its projected finish moves ahead of the batch's last
#: (:func:`finish_weights`): at 0.9 of the last row's projected steps a row's tokens count 0.43,
#: at 0.8 0.17, at 0.7 0.06
FINISH_POWER = 8


#: what a padding slot left out of the linear layers still costs, as a share of a computed one
#: (attention, norms, the gather and scatter): the share at which whole per-row runs' steps that
#: skip padding take what they are priced at, as one-width steps do. evidence: results/attention/ragged_verify
PADDED_SLOT_SHARE = 0.55
#: what a padding slot of a ragged step costs when the base verifies the rows packed
#: (:class:`~..attention.RaggedRows`: only attention sees the padding), priced against the
#: one-width steps of the same run. evidence: results/attention/ragged_verify
PACKED_PADDING_SHARE = 0.2


@dataclass
class WidthChooser:
    """The step's node count: best-first trees are prefix-closed at every width, so keeping the
    first W−1 drafts of each row's ranked trie is always a valid tree; choose the W that
    maximizes Σ_rows E[tokens] / step time = Σ_b (1 + Σ_{i<W−1} s_b,i) / cost(B, W)."""

    cost: CostModel = field(default_factory=lambda: LINEAR_COST)
    max_nodes: int = 33
    #: each row its own node count under one batch budget (:meth:`counts`) instead of one width
    per_row: bool = False
    #: the power of :func:`finish_weights` for per-row counts (0: every row's tokens worth the same)
    finish_power: float = FINISH_POWER
    #: what a padding slot of a ragged step costs as a share of a real one: the base verifies
    #: ragged rows packed (:data:`PACKED_PADDING_SHARE`) or with the padding left out of its
    #: linear layers only (:data:`PADDED_SLOT_SHARE`); the decoder sets it for its base
    padding_share: float = PADDED_SLOT_SHARE

    def choose(self, scores: np.ndarray, kv_len: int) -> int:
        """scores (B, K): each row's best-first scores, zero-padded (:meth:`~.candidates.CandidateBatch.score_block`)."""
        block = np.atleast_2d(np.asarray(scores, dtype=np.float64))
        batch = block.shape[0]
        widest = min(self.max_nodes, 1 + block.shape[1])
        # gain[w-1] = Σ_b Σ_{i<w-1} s_b,i
        gain = np.concatenate([[0.0], np.cumsum(block[:, : widest - 1].sum(0))])
        rate = (batch + gain) / self.cost.step_ms_many(batch, np.arange(1, widest + 1), kv_len)
        return 1 + int(np.argmax(rate))

    def counts(self, tries: CandidateBatch, kv_len: int, weights: np.ndarray | None = None) -> np.ndarray:
        """(B,) draft nodes per row under one batch budget: every row's ranked nodes in one queue
        by score (a node never outranks its parent, so a row's share is a best-first prefix of
        its own trie), cut at the total Q that maximizes Σ_b E[tokens] / step time — a row
        whose lookup match is long takes many nodes, a row with nothing likely none (a plain
        step for it): vLLM's adaptive verification budget, for trees.

        The step is priced at the slots it computes plus what its padding still costs: rows
        are padded to the widest, and where the padding is left out of the linear layers
        (:meth:`~..step_trees.StepTrees.skips_padding`) a padding slot still costs about
        :data:`PADDED_SLOT_SHARE` of a real one (attention, norms, the gather and scatter).

        ``weights`` (B,): what a token of each row is worth (:func:`finish_weights`; None: 1
        each); a node's value is its score × its row's weight, so the queue still never puts a
        node before its parent."""
        batch = tries.rows
        w = np.ones(batch) if weights is None else np.asarray(weights, dtype=np.float64)
        rank = tries.rank_in_row()
        keep = np.flatnonzero(rank < self.max_nodes - 1)
        value = tries.score * w[tries.row]
        order = keep[np.lexsort((rank[keep], tries.row[keep], tries.depth[keep], -value[keep]))]
        r = rank[order]
        # a search over the widest row too: a cap c keeps each row's first c nodes at most, so the
        # queue may pass over a row's next node where it would widen every row's padded slots;
        # c = the widest rank is the plain queue, and taking every node under a cap is one width
        # for every row (so the choice is never worse, under the cost model, than either)
        caps = np.arange(int(r.max(initial=-1)) + 2)[:, None]
        allowed = r[None, :] < caps  # (C, Q)
        zero = np.zeros((caps.shape[0], 1))
        gain = np.concatenate([zero, np.cumsum(np.where(allowed, value[order], 0.0), axis=1)], axis=1)
        computed = batch + np.concatenate([zero, np.cumsum(allowed, axis=1)], axis=1)  # roots + drafts kept
        widest = 1 + np.concatenate([zero, np.maximum.accumulate(np.where(allowed, r + 1, 0), axis=1)], axis=1)
        padding = batch * widest - computed
        slots = np.where(padding >= SKIP_PADDING_SLOTS, (computed + self.padding_share * padding) / batch, widest)
        rate = (w.sum() + gain) / self.cost.step_ms_many(batch, slots.ravel(), kv_len).reshape(slots.shape)
        c, q = np.unravel_index(int(np.argmax(rate)), rate.shape)
        return np.bincount(tries.row[order[:q][allowed[c, :q]]], minlength=batch)


def width_scores(tries: CandidateBatch) -> np.ndarray:
    """(B, K) the rows' best-first scores as :meth:`WidthChooser.choose` reads them."""
    return tries.score_block(int(tries.sizes().max(initial=0)))


def finish_weights(remaining: np.ndarray, emitted: np.ndarray, power: float = FINISH_POWER) -> np.ndarray:
    """(B,) what one more accepted token of each row is worth to a batch that ends with its last row.

    A batch of ``generate`` runs until its slowest row is done, so a draft accepted in a row
    that will finish well before the others saves nothing but that row's slots in the steps it
    leaves early; one accepted in the row that finishes last saves a whole step. Each row's
    finish is projected from its pace so far: f_b = remaining_b / (emitted_b / steps) steps, and
    every live row has run the same steps, so f_b / max f = (remaining_b / emitted_b) / max(…);
    a row's worth is (f_b / max f)^power — 1 for the row projected last, about 1 for rows close
    behind it (projections are noisy), near 0 for rows far ahead. remaining (B,): tokens each
    row may still emit; emitted (B,): tokens it emitted so far (the prefill's included). At one
    row, or at the first step (every pace equal), all are 1."""
    remaining = np.asarray(remaining, dtype=np.float64)
    finish = np.maximum(remaining, 0.0) / np.maximum(np.asarray(emitted, dtype=np.float64), 1.0)
    last = finish.max(initial=0.0)
    return np.ones_like(finish) if last <= 0 else (finish / last) ** power
