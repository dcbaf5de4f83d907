"""Draft candidates as flat tries: one row's (:class:`Candidates`) and every row's of a step
at once (:class:`CandidateBatch`). The operations on them — counting continuations into a
trie, rescoring, merging sources, best-first selection — are in :mod:`.tries`.

Every source (heads, context suffix matches, the model-generated store, the bigram table)
speaks this format, so the verifier sees one tree whatever proposed it. A node's ``score`` is
the source's estimate of P(the node is accepted) = the probability that its whole root→node
path matches the base; it never grows along a path, so keeping the ``budget`` best nodes
best-first is the same as Medusa's greedy tree search over expected accepted length
(τ − 1 = Σ scores of the kept nodes).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np
import torch

from ..step_trees import StepTrees
from ..tree import Tree
from .registry import source_id


#: a source's own buckets (match lengths) stay below this; the heads' review adds multiples of it
#: (:func:`.hitrate.reviewed_bucket`)
BUCKET_STRIDE = 64


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
    source: np.ndarray  # (N,) int8, who proposed the node: its source's id (:func:`.registry.source_id`)
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
        trie = cls.from_lists(parent, token, score, [source_id("heads")] * len(token), [0] * len(token), prob)
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


def path_products(c: np.ndarray, parent: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """(N,) the product of ``c`` (N,) along each root→node path, nodes parents-first (``parent``
    (N,), -1 = child of the root; ``depth`` (N,)). One array step per depth level, the same
    multiplications in the same order as a walk from the root (score = c × parent's score)."""
    score = np.array(c, dtype=np.float64)
    if score.size == 0 or int(depth.max()) <= 1:
        return score
    order = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(2, int(depth.max()) + 2))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        level = order[lo:hi]
        score[level] = score[level] * score[parent[level]]
    return score


@dataclass(frozen=True, eq=False)
class CandidateBatch:
    """Every row's candidates of one step as one set of flat arrays, so a step's drafting costs
    a few array operations however many rows it has (issue: per-row Python drafting ate the
    steps a large batch's extra τ saved). Nodes are grouped by row (``row`` non-decreasing) and
    parents-first within a row; ``parent`` indexes this batch. The fields mean what they mean in
    :class:`Candidates`."""

    rows: int
    row: np.ndarray  # (N,) int64, non-decreasing
    parent: np.ndarray  # (N,) int64, index in this batch (same row, earlier), -1 = child of the root
    token: np.ndarray  # (N,) int64
    depth: np.ndarray  # (N,) int32
    score: np.ndarray  # (N,) float64
    source: np.ndarray  # (N,) int8
    bucket: np.ndarray  # (N,) int16
    share: np.ndarray  # (N,) float64

    def __len__(self) -> int:
        return int(self.token.shape[0])

    @classmethod
    def empty(cls, rows: int) -> "CandidateBatch":
        none = np.zeros(0, dtype=np.int64)
        return cls(rows, none, none, none, none.astype(np.int32), none.astype(np.float64), none.astype(np.int8),
                   none.astype(np.int16), none.astype(np.float64))

    @classmethod
    def from_rows(cls, tries: Sequence[Candidates]) -> "CandidateBatch":
        """One batch from per-row tries (row b = ``tries[b]``)."""
        sizes = np.array([len(t) for t in tries], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        row = np.repeat(np.arange(len(tries), dtype=np.int64), sizes)

        def cat(name, dtype):
            parts = [getattr(t, name) for t in tries]
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)

        local = cat("parent", np.int64)
        parent = np.where(local >= 0, local + offsets[row], -1)
        return cls(len(tries), row, parent, cat("token", np.int64), cat("depth", np.int32), cat("score", np.float64),
                   cat("source", np.int8), cat("bucket", np.int16), cat("share", np.float64))

    @classmethod
    def concat(cls, batches: Sequence["CandidateBatch"]) -> "CandidateBatch":
        """Several sources' batches (same rows) as one, each one's nodes after the last's, parents
        re-indexed. Rows are not grouped (``row`` is not non-decreasing): for what reads nodes
        one by one or parents-first — rescoring (:meth:`.hitrate.HitRate.rescore_all`) and the
        merge (:func:`.tries.merge_rows`) — not for :meth:`split` or :meth:`take`."""
        sizes = [len(b) for b in batches]
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        parent = np.concatenate([np.where(b.parent >= 0, b.parent + o, -1) for b, o in zip(batches, offsets)])
        cat = {name: np.concatenate([getattr(b, name) for b in batches])
               for name in ("row", "token", "depth", "score", "source", "bucket", "share")}
        return cls(batches[0].rows, cat["row"], parent, cat["token"], cat["depth"], cat["score"], cat["source"],
                   cat["bucket"], cat["share"])

    def starts(self) -> np.ndarray:
        """(rows,) index of each row's first node."""
        return self._layout[0]

    def sizes(self) -> np.ndarray:
        """(rows,) nodes per row."""
        return self._layout[1]

    @cached_property
    def _layout(self) -> tuple[np.ndarray, np.ndarray]:
        sizes = np.bincount(self.row, minlength=self.rows).astype(np.int64)
        return np.cumsum(sizes) - sizes, sizes

    def split(self) -> list[Candidates]:
        """The per-row tries (views of these arrays, parents renumbered within the row)."""
        starts, sizes = self.starts(), self.sizes()
        local = np.where(self.parent >= 0, self.parent - starts[self.row], -1).astype(np.int32)
        out = []
        for s, n in zip(starts.tolist(), sizes.tolist()):
            cut = slice(s, s + n)
            out.append(Candidates(local[cut], self.token[cut], self.depth[cut], self.score[cut], self.source[cut],
                                  self.bucket[cut], self.share[cut]))
        return out

    def with_scores(self, score: np.ndarray) -> "CandidateBatch":
        return CandidateBatch(self.rows, self.row, self.parent, self.token, self.depth,
                              np.asarray(score, dtype=np.float64), self.source, self.bucket, self.share)

    def take(self, kept: np.ndarray) -> "CandidateBatch":
        """The nodes ``kept`` (indices grouped by row, each node's parent kept before it), in that
        order, parents renumbered (:meth:`Candidates.subset` for every row at once)."""
        kept = np.asarray(kept, dtype=np.int64).reshape(-1)
        renumber = np.full(len(self), -1, dtype=np.int64)
        renumber[kept] = np.arange(kept.size)
        old_parent = self.parent[kept]
        parent = np.where(old_parent < 0, -1, renumber[np.maximum(old_parent, 0)])
        if bool(((old_parent >= 0) & ((parent < 0) | (parent >= np.arange(kept.size)))).any()):
            raise ValueError("CandidateBatch.take: every kept node's parent must be kept before it.")
        return CandidateBatch(self.rows, self.row[kept], parent, self.token[kept], self.depth[kept], self.score[kept],
                              self.source[kept], self.bucket[kept], self.share[kept])

    def rank_in_row(self) -> np.ndarray:
        """(N,) each node's position within its row."""
        return np.arange(len(self), dtype=np.int64) - self.starts()[self.row]

    def first(self, count: np.ndarray | int) -> "CandidateBatch":
        """Each row's first ``count`` (scalar or (rows,)) nodes: in best-first order, the best."""
        count = np.broadcast_to(np.asarray(count, dtype=np.int64), (self.rows,))
        return self.take(np.flatnonzero(self.rank_in_row() < count[self.row]))

    def cap_depth(self, room: Sequence[int]) -> "CandidateBatch":
        """Without the nodes deeper than their row's ``room`` (rows near their token limit)."""
        room = np.asarray(room, dtype=np.int64)
        if len(self) == 0 or bool((self.depth <= room[self.row]).all()):
            return self
        return self.take(np.flatnonzero(self.depth <= room[self.row]))

    def first_scores(self) -> np.ndarray:
        """(rows,) each row's best depth-1 score (0 where a row has none)."""
        best = np.zeros(self.rows)
        top = self.depth == 1
        np.maximum.at(best, self.row[top], self.score[top])
        return best

    def score_block(self, width: int) -> np.ndarray:
        """(rows, width) each row's first ``width`` scores, zero-padded (what the width chooser reads)."""
        block = np.zeros((self.rows, width))
        rank = self.rank_in_row()
        keep = rank < width
        block[self.row[keep], rank[keep]] = self.score[keep]
        return block


def step_trees(roots: torch.Tensor, kept: CandidateBatch, chosen: Tree | None = None) -> StepTrees:
    """:meth:`~..step_trees.StepTrees.from_rows` for every row of a :class:`CandidateBatch` at once
    (row b's nodes parents-first, in the order its slots take): a few array operations per
    depth level instead of a Python walk per node, which was most of this step's cost at
    one row (roots (B,)). ``chosen``: see :attr:`~..step_trees.StepTrees.chosen`."""
    batch, device = roots.shape[0], roots.device
    sizes = kept.sizes()
    nodes = 1 + int(sizes.max(initial=0))
    slot = kept.rank_in_row() + 1  # the root is slot 0
    row = kept.row
    has_parent = kept.parent >= 0
    parent = np.full((batch, nodes), -1, dtype=np.int64)
    parent[row, slot] = np.where(has_parent, slot[np.maximum(kept.parent, 0)], 0)
    depth = np.zeros((batch, nodes), dtype=np.int64)
    depth[row, slot] = kept.depth
    token = np.zeros((batch, nodes), dtype=np.int64)
    token[row, slot] = kept.token
    valid = np.arange(nodes)[None, :] < 1 + sizes[:, None]
    max_depth = int(kept.depth.max(initial=0))
    path_slots = np.repeat(np.arange(nodes)[None, :, None], max_depth + 1, axis=2).repeat(batch, 0)
    path_slots[row, slot, 0] = 0
    # walk every node up to the root at once: at step k each node writes its ancestor k levels up
    node, level, live = np.arange(len(kept)), kept.depth.astype(np.int64), np.ones(len(kept), dtype=bool)
    while live.any():
        path_slots[row[live], slot[live], level[live]] = slot[node[live]]
        live = live & has_parent[node]
        node = np.where(live, np.maximum(kept.parent[node], 0), node)
        level = level - 1
    out = torch.from_numpy(token).to(device)
    out[:, 0] = roots
    return StepTrees(out, torch.from_numpy(parent).to(device), torch.from_numpy(depth).to(device),
               torch.from_numpy(path_slots).to(device), torch.from_numpy(valid).to(device), chosen=chosen)
