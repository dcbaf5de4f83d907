"""Online hit-rate estimator: turns a source's raw proposal into P(accepted) on one scale.

Every node carries ``(source, bucket, share)``: who proposed it, the feature its reliability
depends on (match length for lookups; for heads, the head depth) and its empirical
conditional frequency (count(node)/count(parent) for lookups; the head's softmax probability
for heads). The conditional acceptance of a node whose parent was accepted is modelled as
``c = min(1, q[source, bucket] × share)``: ``q`` is a calibration factor learned online as
Σ accepted / Σ share over the nodes that were *eligible* (parent accepted), with a Beta-like
prior of ``strength`` pseudo-observations at a per-source default. A node's score is the
product of ``c`` along its path. Because heads and lookups are calibrated against the same
event (the base accepts the token), their scores are directly comparable in :func:`merge`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .candidates import BUCKET_STRIDE, CandidateBatch, Candidates, path_products
from .registry import source_count, spec_of


def default_q(source: int, bucket: int) -> float:
    """Prior calibration before any observation: the source's registered prior
    (:attr:`.registry.SourceSpec.prior`) for this bucket."""
    return spec_of(source).prior(bucket)


#: The vertical cascade: the heads' probability of a reviewed lookup node, binned at these
#: edges (bin 1 = below the first … bin 5 = above the last; bin 0 = not reviewed), becomes part
#: of the node's bucket (:func:`reviewed_bucket`), so the hit rates learn how much the heads'
#: opinion says about acceptance (P(accepted | source, match length, review bin)) instead of
#: assuming it: where the heads know nothing the bins' rates come out alike and the ranking is
#: unchanged.
REVIEW_EDGES = (1e-3, 1e-2, 0.1, 0.5)


def reviewed_bucket(bucket: np.ndarray, prob: np.ndarray) -> np.ndarray:
    """(N,) buckets, (N,) the heads' probabilities → the buckets with the review bin folded in."""
    bins = 1 + np.searchsorted(np.asarray(REVIEW_EDGES), np.asarray(prob, dtype=np.float64), side="right")
    return (np.asarray(bucket) % BUCKET_STRIDE + BUCKET_STRIDE * bins).astype(np.int16)


@dataclass(frozen=True)
class HitRateConfig:
    strength: float = 8.0  # prior pseudo-observations (in units of share)
    max_bucket: int = 32  # larger buckets are clipped


class HitRate:
    """Per (source, bucket, review bin) accepted / Σ share counts, shared by all rows of a
    decoder. The prior does not depend on the review bin: what the heads' opinion is worth is
    learned."""

    def __init__(self, config: HitRateConfig = HitRateConfig()):
        self.config = config
        width = config.max_bucket + 1
        shape = (source_count(), width * (len(REVIEW_EDGES) + 2))  # every source registered now
        self.accepted = np.zeros(shape)
        self.proposed = np.zeros(shape)  # Σ share of eligible nodes
        self.prior = np.array([[default_q(s, b % width) for b in range(shape[1])] for s in range(shape[0])])
        self.row_steps: dict[int, int] = {}
        self.row_accepted: dict[int, int] = {}

    def key(self, bucket):
        """A node's bucket (match length + BUCKET_STRIDE × review bin) → its column."""
        bucket = np.asarray(bucket, dtype=np.int64)
        return (bucket // BUCKET_STRIDE) * (self.config.max_bucket + 1) + np.minimum(bucket % BUCKET_STRIDE,
                                                                                       self.config.max_bucket)

    def q(self, source: int, bucket: int) -> float:
        b = int(self.key(bucket))
        k = self.config.strength
        return float((self.accepted[source, b] + k * self.prior[source, b]) / (self.proposed[source, b] + k))

    def conditional(self, trie: Candidates | CandidateBatch) -> np.ndarray:
        """(N,) c per node = min(1, q × share)."""
        b = self.key(trie.bucket)
        s = trie.source.astype(np.int64)
        k = self.config.strength
        q = (self.accepted[s, b] + k * self.prior[s, b]) / (self.proposed[s, b] + k)
        return np.minimum(1.0, q * trie.share)

    def rescore(self, trie: Candidates | CandidateBatch) -> Candidates | CandidateBatch:
        """The same trie (or every row's) with score = Π c along each path."""
        return trie.with_scores(path_products(self.conditional(trie), trie.parent, trie.depth))

    def rescore_all(self, batches: Sequence[CandidateBatch]) -> list[CandidateBatch]:
        """:meth:`rescore` of each batch (every source of a step), in one pass over their nodes."""
        every = CandidateBatch.concat(batches)
        score = path_products(self.conditional(every), every.parent, every.depth)
        bounds = np.cumsum([len(b) for b in batches])[:-1]
        return [b.with_scores(part) for b, part in zip(batches, np.split(score, bounds))]

    def observe(self, row: int, proposed: Candidates, accepted_tokens: Sequence[int]) -> int:
        """One row's :meth:`observe_rows`."""
        return int(self.observe_rows([row], CandidateBatch.from_rows([proposed]), [accepted_tokens])[0])

    def observe_rows(self, rows: Sequence[int], proposed: CandidateBatch,
                     accepted_tokens: Sequence[Sequence[int]]) -> np.ndarray:
        """Update from one verification of every row: ``accepted_tokens[b]`` are the draft tokens
        the base accepted in row b (the caller's ``rows[b]``), root-side first (the bonus token
        excluded). A node counts when it was *eligible* (its parent accepted): Σ share proposed,
        and 1 accepted when its token is the accepted one at its depth. Returns (B,) how many of
        each row's proposed nodes lie on the accepted path."""
        longest = max((len(a) for a in accepted_tokens), default=0)
        taken = np.full((proposed.rows, longest + 1), -1, dtype=np.int64)  # a last column of -1: past the path
        for b, tokens in enumerate(accepted_tokens):
            taken[b, : len(tokens)] = tokens
        depth = np.minimum(proposed.depth.astype(np.int64), longest + 1) - 1
        match = (proposed.token == taken[proposed.row, depth]) & (proposed.depth <= longest)
        on_path = path_products(match.astype(np.float64), proposed.parent, proposed.depth) > 0
        has_parent = proposed.parent >= 0
        eligible = ~has_parent | on_path[np.maximum(proposed.parent, 0)]
        source = proposed.source.astype(np.int64)
        keys = self.key(proposed.bucket)
        np.add.at(self.proposed, (source[eligible], keys[eligible]), proposed.share[eligible])
        np.add.at(self.accepted, (source[on_path], keys[on_path]), 1.0)
        hits = np.bincount(proposed.row[on_path], minlength=proposed.rows)
        for row, n in zip(rows, hits.tolist()):
            self.row_steps[row] = self.row_steps.get(row, 0) + 1
            self.row_accepted[row] = self.row_accepted.get(row, 0) + n
        return hits
