"""The trie operations of drafting — count continuations into a trie, merge sources, keep the
best nodes — written once over a :class:`~.candidates.CandidateBatch` (every row of a step at
once: a handful of array operations per step, however many rows), with one-row forms
(:func:`count_trie`, :func:`merge`, :func:`select`) that run the same code on a batch of one.

Why arrays and not a dict per node: a step's drafting must not grow with its rows in Python,
or at a large batch it eats what the lookups' extra τ saves. evidence: results/drafting_sources/drafting_phases
"""
from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from .candidates import BUCKET_STRIDE, CandidateBatch, Candidates
from .hitrate import default_q

def padded(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token lists → ((S, D) int64 block padded with -1, (S,) lengths)."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    block = np.full((len(seqs), int(lengths.max(initial=0))), -1, dtype=np.int64)
    for i, s in enumerate(seqs):
        block[i, : len(s)] = s
    return block, lengths


def count_rows(seqs: np.ndarray, lengths: np.ndarray, seq_row: np.ndarray, rows: int, source: int,
               bucket: np.ndarray, q: np.ndarray) -> CandidateBatch:
    """Tries of empirical continuations, every row at once.

    seqs (S, D) token ids, lengths (S,) ≥ 1 (entries past a length are ignored), seq_row (S,)
    the row each continuation belongs to; bucket (rows,) and q (rows,) per row. A node's share
    = count(node) / count(parent) (a root child's: over its row's continuations); its score =
    Π over its path of (q × share), ``q`` ≈ P(a top-share token is accepted | its parent was)
    for this source and match length (see :mod:`.hitrate`).

    One sort: with the continuations in (row, tokens) order, a continuation opens a new node at
    depth d exactly where its row or its first d tokens differ from the previous one's, and a
    node's count is the run of continuations that share that prefix."""
    seqs, lengths = np.asarray(seqs, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    seq_row = np.asarray(seq_row, dtype=np.int64)
    if lengths.size == 0 or seqs.ndim != 2 or seqs.shape[1] == 0:
        return CandidateBatch.empty(rows)
    live = np.arange(seqs.shape[1])[None, :] < lengths[:, None]  # (S, D)
    block = np.where(live, seqs, -1)
    order = np.lexsort(tuple(block[:, d] for d in range(block.shape[1] - 1, -1, -1)) + (seq_row,))
    block, live, row = block[order], live[order], seq_row[order]
    differs = np.ones(block.shape, dtype=bool)
    differs[1:] = (np.logical_or.accumulate(block[1:] != block[:-1], axis=1)
                   | (row[1:] != row[:-1])[:, None])
    opens = differs & live
    # node ids in (continuation, depth) order: grouped by row and parents-first (a node's parent
    # was opened by the same continuation one depth up, or by an earlier one)
    ids = np.cumsum(opens.ravel()).reshape(opens.shape) - 1
    node = np.maximum.accumulate(np.where(opens, ids, -1), axis=0)  # a shared prefix's node, down each column
    count = np.bincount(node[live], minlength=int(ids[-1, -1]) + 1)
    opener, at_depth = np.nonzero(opens)
    node_row = row[opener]
    parent = np.where(at_depth > 0, node[opener, np.maximum(at_depth - 1, 0)], -1)
    share = count / np.where(parent >= 0, count[np.maximum(parent, 0)], np.bincount(seq_row, minlength=rows)[node_row])
    q = np.asarray(q, dtype=np.float64)
    # each continuation's running product of (q × share) along its own path; a node's is its opener's
    score = np.cumprod(np.where(live, q[row][:, None] * share[np.maximum(node, 0)], 1.0), axis=1)[opener, at_depth]
    bucket = np.minimum(np.asarray(bucket, dtype=np.int64), BUCKET_STRIDE - 1)
    return CandidateBatch(rows, node_row, parent, block[opener, at_depth], (at_depth + 1).astype(np.int32), score,
                          np.full(node_row.size, source, dtype=np.int8), bucket[node_row].astype(np.int16), share)


def continuation_tries(found: Sequence[tuple[int, int, Sequence[Sequence[int]]]], rows: int, source: int,
                       budget: int, q: float | None = None) -> CandidateBatch:
    """A lookup source's tries for a step: ``found`` lists (row, match length, continuations)
    for the rows it matched in; each row's continuations counted into a trie (:func:`count_rows`,
    ``q`` = the prior for its match length unless given) and its ``budget`` best nodes kept."""
    seqs: list[Sequence[int]] = []
    seq_row: list[int] = []
    bucket = np.zeros(rows, dtype=np.int64)
    for row, length, conts in found:
        seqs.extend(conts)
        seq_row.extend([row] * len(conts))
        bucket[row] = length
    if not seqs or budget <= 0:
        return CandidateBatch.empty(rows)
    block, lengths = padded(seqs)
    return counted_tries(block, lengths, np.asarray(seq_row), rows, source, bucket, budget, q)


def counted_tries(seqs: np.ndarray, lengths: np.ndarray, seq_row: np.ndarray, rows: int, source: int,
                  bucket: np.ndarray, budget: int, q: float | None = None) -> CandidateBatch:
    """A lookup source's continuations (:func:`count_rows`'s arguments; bucket (rows,) each row's
    match length) counted into tries, ``q`` the prior for each row's match length unless given,
    cut to ``budget`` nodes a row (:func:`best_nodes`)."""
    qs = np.array([default_q(source, int(b)) if q is None else q for b in bucket.tolist()])
    return best_nodes(count_rows(seqs, lengths, seq_row, rows, source, bucket, qs), budget)


def best_nodes(batch: CandidateBatch, budget: int) -> CandidateBatch:
    """A source's tries before the merge: each row's ``budget`` best nodes by (score, then
    depth), in their own order (as they are when no row has more).

    The merge ranks every source's nodes together (:func:`merge_rows`), so which of several
    nodes tied at a source's cut it keeps does not need the best-first walk's tie-break
    (:func:`level_ranks`, most of this cut's time in a small step): the first in the source's
    own order (canonical: :func:`count_rows` sorts the continuations) is kept. The nodes kept
    are prefix-closed, because a parent scores at least its child and is shallower."""
    if int(batch.sizes().max(initial=0)) <= budget:
        return batch
    order = np.lexsort((batch.depth, -batch.score, batch.row))  # stable: ties in the source's own order
    position = np.arange(len(batch)) - batch.starts()[batch.row[order]]
    return batch.take(np.sort(order[position < budget]))


def count_trie(continuations: Sequence[Sequence[int]], source: int, bucket: int, q: float) -> Candidates:
    """One row's trie of empirical continuations (:func:`count_rows`)."""
    if not continuations:
        return Candidates.empty()
    seqs, lengths = padded(continuations)
    return count_rows(seqs, lengths, np.zeros(len(lengths), dtype=np.int64), 1, source, [bucket], [q]).split()[0]


def merge_rows(batches: Sequence[CandidateBatch], budget: np.ndarray | int) -> CandidateBatch:
    """Fuse candidates from several sources into one trie per row and keep each row's
    ``budget`` (scalar or (rows,)) best nodes.

    Shared prefixes appear once. A node proposed by several sources takes the **maximum** of
    their scores (and that source's id; on equal scores the lower source, then the first
    given): each score already estimates the same event (this path is accepted), and the
    sources are far from independent (the store and the bigram table come from the same
    answers, a context match often repeats a store match), so a noisy-OR would count the same
    evidence twice; the max is also still non-increasing along a path, which keeps best-first
    selection exact. Selection is :func:`select_rows`."""
    budget = np.asarray(budget, dtype=np.int64)
    if bool((budget < 0).any()):
        raise ValueError(f"merge: budget must be >= 0, got {budget.min()}.")
    rows = batches[0].rows
    every = CandidateBatch.concat(batches)
    parent = every.parent
    n = parent.size
    if n == 0:
        return CandidateBatch.empty(rows)
    # each node's path, root side first, padded with -1 (below every token): equal paths sort
    # together, a prefix before its extensions, so (row, path) order is parents-first by row
    path = np.full((n, int(every.depth.max())), -1, dtype=np.int64)
    idx, up, col = np.arange(n), np.arange(n), every.depth.astype(np.int64) - 1
    while idx.size:
        path[idx, col] = every.token[up]
        up = parent[up]
        going = up >= 0
        idx, up, col = idx[going], up[going], col[going] - 1
    # within a path: the highest score first, then the lower source, then the first given
    order = np.lexsort((np.arange(n), every.source, -every.score)
                       + tuple(path[:, d] for d in range(path.shape[1] - 1, -1, -1)) + (every.row,))
    keyed = np.column_stack([every.row, path])[order]
    lead = np.r_[True, (keyed[1:] != keyed[:-1]).any(axis=1)]
    union_of = np.empty(n, dtype=np.int64)
    union_of[order] = np.cumsum(lead) - 1
    rep = order[lead]
    union_parent = np.where(parent[rep] >= 0, union_of[np.maximum(parent[rep], 0)], -1)
    union = CandidateBatch(rows, every.row[rep], union_parent, every.token[rep], every.depth[rep],
                           every.score[rep], every.source[rep], every.bucket[rep], every.share[rep])
    return select_rows(union, budget)


def merge(tries: Sequence[Candidates], budget: int) -> Candidates:
    """One row's :func:`merge_rows`: the tries fused, its ``budget`` best nodes kept
    best-first (in selection order, parents first)."""
    if budget < 0:
        raise ValueError(f"merge: budget must be >= 0, got {budget}.")
    if not tries:
        return Candidates.empty()
    return merge_rows([CandidateBatch.from_rows([t]) for t in tries], budget).split()[0]


def select_rows(batch: CandidateBatch, budget: np.ndarray | int, ordered: bool = True) -> CandidateBatch:
    """Best-first, prefix-closed top-``budget`` of each row's trie: repeatedly keep the
    highest-scoring node whose parent is kept (Medusa's greedy tree search).

    Ties break by (depth, source, parent's rank, token) — shallower, more local, earlier parent,
    smaller id first — so the result is deterministic and independent of the input order.
    Scores never grow along a path (each is a product of conditional rates ≤ 1, or a max of
    such), and a child is deeper than its parent, so ordering every node by (row, score
    descending, depth, source, parent's rank, token) puts each parent before its children: each
    row's first ``budget`` nodes of that one sort are its best-first selection. A parent's rank
    matters only between two nodes of one row, score, depth and source, so their parents' ranks
    among the nodes of their depth decide (:func:`level_ranks`; one sort when nothing ties).
    Rows whose scores do grow somewhere (hand-made tries) take the heap walk.

    ``ordered=False``: only which nodes are kept matters, not their order (a source's nodes
    before the merge ranks them all): ties reorder nodes only within their block of equal
    (row, score, depth, source), so where no such block straddles a row's cut the parents'
    ranks are not needed."""
    budget = np.broadcast_to(np.asarray(budget, dtype=np.int64), (batch.rows,))
    if len(batch) == 0 or int(budget.max(initial=0)) <= 0:
        return batch.take(np.zeros(0, dtype=np.int64))
    has_parent = batch.parent >= 0
    parent = np.maximum(batch.parent, 0)
    grows = has_parent & (batch.score > batch.score[parent])
    if bool(grows.any()):
        grown = set(batch.row[grows].tolist())
        return CandidateBatch.from_rows([select_by_heap(t, int(b)) if r in grown else select(t, int(b))
                                         for r, (t, b) in enumerate(zip(batch.split(), budget))])
    neg_score = -batch.score
    order = np.lexsort((batch.token, batch.source, batch.depth, neg_score, batch.row))
    same = ((np.diff(batch.score[order]) == 0) & (np.diff(batch.depth[order]) == 0)
            & (np.diff(batch.source[order]) == 0) & (np.diff(batch.row[order]) == 0))
    row = batch.row[order]
    position = np.arange(len(batch)) - batch.starts()[row]  # the sort keeps rows in order
    if not ordered and bool(same.any()):
        cut = np.flatnonzero(position[:-1] == budget[row[:-1]] - 1)  # each row's last kept node
        same = same[cut]  # does it tie with the first one left out?
    if bool(same.any()):  # ties: the parent's rank decides, and it only compares parents of one depth
        parent_rank = np.where(has_parent, level_ranks(batch, neg_score)[parent], -1)
        order = np.lexsort((batch.token, parent_rank, batch.source, batch.depth, neg_score, batch.row))
    return batch.take(order[position < budget[batch.row[order]]])


def level_ranks(batch: CandidateBatch, neg_score: np.ndarray) -> np.ndarray:
    """(N,) each node's rank among the nodes of its depth in the best-first walk's order
    (row, score descending, source, parent's rank, token): two tied nodes are ordered by their
    parents' ranks, which are of one depth, so one sort per depth, shallowest first, settles them."""
    rank = np.zeros(len(batch), dtype=np.int64)
    by_depth = np.argsort(batch.depth, kind="stable")
    bounds = np.searchsorted(batch.depth[by_depth], np.arange(1, int(batch.depth.max()) + 2))
    for d, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        level = by_depth[lo:hi]
        parent_rank = rank[batch.parent[level]] if d else np.zeros(level.size, dtype=np.int64)
        ordered = level[np.lexsort((batch.token[level], parent_rank, batch.source[level], neg_score[level],
                                    batch.row[level]))]
        rank[ordered] = np.arange(level.size)
    return rank


def select(trie: Candidates, budget: int) -> Candidates:
    """One row's :func:`select_rows`."""
    if budget <= 0 or len(trie) == 0:
        return trie.subset([])
    has_parent = trie.parent >= 0
    if bool((has_parent & (trie.score > trie.score[np.maximum(trie.parent, 0)])).any()):
        return select_by_heap(trie, budget)
    return select_rows(CandidateBatch.from_rows([trie]), budget).split()[0]


def select_by_heap(trie: Candidates, budget: int) -> Candidates:
    """Best-first selection by a walk from the root: keep the best node whose parent is kept."""
    children: dict[int, list[int]] = {}
    for i in range(len(trie)):
        children.setdefault(int(trie.parent[i]), []).append(i)

    def entry(i: int, parent_rank: int) -> tuple:
        # (parent's selection rank, token) is unique in a trie and independent of input order
        return (-float(trie.score[i]), int(trie.depth[i]), int(trie.source[i]), parent_rank, int(trie.token[i]), i)

    frontier = [entry(i, -1) for i in children.get(-1, [])]
    heapq.heapify(frontier)
    kept: list[int] = []
    while frontier and len(kept) < budget:
        node = heapq.heappop(frontier)[-1]
        kept.append(node)
        for child in children.get(node, []):
            heapq.heappush(frontier, entry(child, len(kept) - 1))
    return trie.subset(kept)
