"""One row's draft candidates as a flat trie, and the merge of several sources into one trie
under a node budget.

Every source (heads, context suffix matches, the model-generated store, the bigram table)
speaks this format, so the verifier sees one tree whatever proposed it. A node's ``score`` is
the source's estimate of P(the node is accepted) = the probability that its whole root→node
path matches the base; it never grows along a path, so keeping the ``budget`` best nodes
best-first is the same as Medusa's greedy tree search over expected accepted length
(τ − 1 = Σ scores of the kept nodes).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

import numpy as np


#: a source's own buckets (match lengths) stay below this; the heads' review adds multiples of it
#: (:func:`.hitrate.reviewed_bucket`)
BUCKET_STRIDE = 64


class Source(IntEnum):
    """Who proposed a node; lower value wins exact score ties (most local first, as in HD)."""

    HEADS = 0
    CONTEXT = 1
    STORE = 2
    STATS = 3


@dataclass(frozen=True, eq=False)
class Candidates:
    """A prefix-closed trie hanging below the root (the base's last token), as flat arrays.

    Nodes are stored parents-first (``parent[i] < i``); ``parent == -1`` marks a child of the
    root. ``bucket`` is the feature the hit-rate estimator conditions on (match length for
    lookups, a confidence bucket for heads); ``share`` is the node's empirical conditional
    frequency among its siblings (count(node) / count(parent)), so the estimator can rescale.
    """

    parent: np.ndarray  # (N,) int32, -1 = child of the root
    token: np.ndarray  # (N,) int64
    depth: np.ndarray  # (N,) int32, 1 = child of the root
    score: np.ndarray  # (N,) float64, ≈ P(root→node path accepted), non-increasing along a path
    source: np.ndarray  # (N,) int8, a Source value
    bucket: np.ndarray  # (N,) int16, match length (lookups) / confidence bucket (heads)
    share: np.ndarray  # (N,) float64, count(node) / count(parent) in the source's own data

    def __len__(self) -> int:
        return int(self.token.shape[0])

    @classmethod
    def empty(cls) -> "Candidates":
        return cls.from_lists([], [], [], [], [], [])

    @classmethod
    def from_lists(cls, parent: Sequence[int], token: Sequence[int], score: Sequence[float],
                   source: Sequence[int], bucket: Sequence[int], share: Sequence[float]) -> "Candidates":
        """Build from Python lists (parents-first), deriving depths; validates the invariants."""
        n = len(token)
        if not (len(parent) == len(score) == len(source) == len(bucket) == len(share) == n):
            raise ValueError("Candidates: parent, token, score, source, bucket and share must have one entry per node.")
        depth = np.zeros(n, dtype=np.int32)
        for i, p in enumerate(parent):
            if not -1 <= p < i:
                raise ValueError(f"Candidates: node {i} has parent {p}; parents must come first (-1 = root).")
            depth[i] = 1 if p < 0 else depth[p] + 1
        return cls(np.asarray(parent, dtype=np.int32).reshape(n), np.asarray(token, dtype=np.int64).reshape(n), depth,
                   np.asarray(score, dtype=np.float64).reshape(n), np.asarray(source, dtype=np.int8).reshape(n),
                   np.asarray(bucket, dtype=np.int16).reshape(n), np.asarray(share, dtype=np.float64).reshape(n))

    @classmethod
    def from_heads(cls, parent: Sequence[int], token: Sequence[int], prob: Sequence[float]) -> "Candidates":
        """Head drafts in the same format: ``prob`` (N,) = the head's softmax probability of the
        node's token; bucket = depth, so :class:`HitRate` learns one calibration per head depth
        and head nodes compete with lookup nodes on the P(accepted) scale. Scores start as the
        product of probabilities along the path (rescore with a HitRate to calibrate)."""
        score: list[float] = []
        for p, q in zip(parent, prob):
            score.append((1.0 if p < 0 else score[p]) * float(q))
        trie = cls.from_lists(parent, token, score, [Source.HEADS] * len(token), [0] * len(token), prob)
        return Candidates(trie.parent, trie.token, trie.depth, trie.score, trie.source, trie.depth.astype(np.int16),
                          trie.share)

    def path(self, node: int) -> tuple[int, ...]:
        """Tokens root→node."""
        tokens = []
        while node >= 0:
            tokens.append(int(self.token[node]))
            node = int(self.parent[node])
        return tuple(reversed(tokens))

    def paths(self) -> dict[tuple[int, ...], int]:
        """Path → node index (for tests and for the verifier's accepted-path lookup)."""
        return {self.path(i): i for i in range(len(self))}

    def with_scores(self, score: np.ndarray) -> "Candidates":
        return Candidates(self.parent, self.token, self.depth, np.asarray(score, dtype=np.float64), self.source,
                          self.bucket, self.share)

    def subset(self, kept: Sequence[int]) -> "Candidates":
        """The nodes ``kept`` (indices, each node's parent kept before it), in that order, parents
        renumbered: what selection, depth caps and width cuts keep of a trie. Array operations
        only: it runs for every row of every step."""
        kept = np.asarray(kept, dtype=np.int64).reshape(-1)
        renumber = np.full(len(self), -1, dtype=np.int64)
        renumber[kept] = np.arange(kept.size)
        old_parent = self.parent[kept].astype(np.int64)
        parent = np.where(old_parent < 0, -1, renumber[np.maximum(old_parent, 0)])
        if bool(((old_parent >= 0) & ((parent < 0) | (parent >= np.arange(kept.size)))).any()):
            raise ValueError("Candidates.subset: every kept node's parent must be kept before it.")
        return Candidates(parent.astype(np.int32), self.token[kept], self.depth[kept], self.score[kept],
                          self.source[kept], self.bucket[kept], self.share[kept])


class TrieBuilder:
    """Accumulates nodes keyed by (parent, token); used by every source and by :func:`merge`."""

    def __init__(self) -> None:
        self.index: dict[tuple[int, int], int] = {}
        self.parent: list[int] = []
        self.token: list[int] = []
        self.score: list[float] = []
        self.source: list[int] = []
        self.bucket: list[int] = []
        self.share: list[float] = []

    def add(self, parent: int, token: int, score: float, source: int, bucket: int, share: float) -> int:
        """Insert or update a node; an existing node keeps the higher score (ties: lower source)."""
        key = (parent, token)
        node = self.index.get(key)
        if node is None:
            node = len(self.token)
            self.index[key] = node
            self.parent.append(parent)
            self.token.append(token)
            self.score.append(score)
            self.source.append(source)
            self.bucket.append(bucket)
            self.share.append(share)
        elif (score, -source) > (self.score[node], -self.source[node]):
            self.score[node], self.source[node] = score, source
            self.bucket[node], self.share[node] = bucket, share
        return node

    def build(self) -> Candidates:
        return Candidates.from_lists(self.parent, self.token, self.score, self.source, self.bucket, self.share)


def merge(tries: Sequence[Candidates], budget: int) -> Candidates:
    """Fuse candidates from several sources into one trie and keep the ``budget`` best nodes.

    Shared prefixes appear once. A node proposed by several sources takes the **maximum** of
    their scores (and that source's id): each score already estimates the same event (this
    path is accepted), and the sources are far from independent (the store and the bigram
    table come from the same answers, a context match often repeats a store match), so a
    noisy-OR would count the same evidence twice; the max is also still non-increasing along
    a path, which keeps best-first selection exact.

    Selection is best-first from the root (Medusa's greedy tree search): repeatedly keep the
    highest-scoring node whose parent is kept, so the result is prefix-closed. Ties break by
    (depth, source, parent's rank, token) — shallower, more local, earlier parent, smaller id
    first — so the output is deterministic and independent of the order of ``tries``.
    The kept nodes come out in selection order (parents first).
    """
    if budget < 0:
        raise ValueError(f"merge: budget must be >= 0, got {budget}.")
    union = TrieBuilder()
    for trie in tries:
        remap = np.empty(len(trie), dtype=np.int64)
        for i in range(len(trie)):
            p = int(trie.parent[i])
            remap[i] = union.add(-1 if p < 0 else int(remap[p]), int(trie.token[i]), float(trie.score[i]),
                                 int(trie.source[i]), int(trie.bucket[i]), float(trie.share[i]))
    return select(union.build(), budget)


def select(trie: Candidates, budget: int) -> Candidates:
    """Best-first, prefix-closed top-``budget`` of one trie (see :func:`merge`).

    Scores never grow along a path (each is a product of conditional rates ≤ 1, or a max of
    such), and a child is deeper than its parent, so ordering every node by (score descending,
    depth, source, parent's rank, token) puts each parent before its children: the first
    ``budget`` nodes of that one sort are the best-first selection, without a heap walk per
    node. A trie whose scores do grow somewhere (hand-made) takes the heap walk."""
    if budget <= 0 or len(trie) == 0:
        return trie.subset([])
    has_parent = trie.parent >= 0
    parent = np.maximum(trie.parent, 0)
    if bool((has_parent & (trie.score > trie.score[parent])).any()):
        return select_by_heap(trie, budget)
    # the heap walk's key (score, depth, source, parent's rank, token) is unique and independent
    # of input order; a parent's rank depends only on shallower nodes, so re-sorting with the
    # ranks of the previous sort reaches it within depth + 1 sorts (one when no two nodes tie on score, depth and source)
    parent_rank = np.full(len(trie), -1, dtype=np.int64)
    order = np.lexsort((trie.token, trie.source, trie.depth, -trie.score))
    same = ((np.diff(trie.score[order]) == 0) & (np.diff(trie.depth[order]) == 0)
            & (np.diff(trie.source[order]) == 0))
    if not bool(same.any()):  # no two nodes tie before the parent's rank: this order is the walk's
        return trie.subset(order[:budget])
    for _ in range(int(trie.depth.max()) + 1):
        order = np.lexsort((trie.token, parent_rank, trie.source, trie.depth, -trie.score))
        rank = np.empty(len(trie), dtype=np.int64)
        rank[order] = np.arange(len(trie))
        ranked = np.where(has_parent, rank[parent], -1)
        if np.array_equal(ranked, parent_rank):
            break
        parent_rank = ranked
    return trie.subset(order[:budget])


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


def count_trie(continuations: Sequence[Sequence[int]], source: int, bucket: int, q: float) -> Candidates:
    """A trie of empirical continuations. A node's share = count(node) / count(parent); its
    score = Π over its path of (q × share), ``q`` ≈ P(a top-share token is accepted | its parent
    was) for this source and match length (see :mod:`.hitrate`). One dict probe per token:
    O(Σ lengths), nodes in first-seen order (deterministic for a given input order)."""
    index: dict[tuple[int, int], int] = {}
    parent: list[int] = []
    token: list[int] = []
    count: list[int] = []
    for seq in continuations:
        node = -1
        for t in seq:
            child = index.get((node, t))
            if child is None:
                child = index[(node, t)] = len(token)
                parent.append(node)
                token.append(t)
                count.append(0)
            count[child] += 1
            node = child
    total = len(continuations)
    share = [c / (total if p < 0 else count[p]) for p, c in zip(parent, count)]
    score: list[float] = []
    for p, s in zip(parent, share):
        score.append((1.0 if p < 0 else score[p]) * q * s)
    n = len(token)
    return Candidates.from_lists(parent, token, score, [source] * n, [min(bucket, BUCKET_STRIDE - 1)] * n, share)
