"""Token-tree shapes: built from Medusa-style rank paths, with every buffer the verifier needs
(parents, depths, ancestor mask, root→node paths) computed once per shape and cached; and the
greedy tree search from measured head ranks.

A path ``(r1, r2, ...)`` is the node reached by taking the r1-th candidate at depth 1, then the
r2-th candidate at depth 2, and so on. Slot 0 is the root: the token the base just produced.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..core.kept import kept
from ..heads.protocol import TreeSpec

#: a node named by its rank at each depth, root first: ``(r1, r2, ...)`` (Medusa's "path")
Ranks = tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Tree:
    """A prefix-closed set of rank paths plus its derived index buffers (CPU tensors)."""

    paths: tuple[Ranks, ...]  # sorted by (length, ranks); slot i+1 holds paths[i]
    parent: torch.Tensor  # (N,) long, -1 at the root
    depth: torch.Tensor  # (N,) long
    rank: torch.Tensor  # (N,) long
    ancestor: torch.Tensor  # (N, N) bool: ancestor[i, j] ⇔ slot j is slot i or one of its ancestors
    path_slots: torch.Tensor  # (N, D+1) long: slots root→node, padded with the node itself

    @property
    def num_nodes(self) -> int:
        """Slots including the root (what one verification forward processes)."""
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @property
    def spec(self) -> TreeSpec:
        return TreeSpec(self.parent, self.depth, self.rank)

    def fitting(self, max_depth: int) -> "Tree":
        """This tree, or its truncation when it is deeper than ``max_depth`` (a row near its
        token limit or the context limit)."""
        return self if self.max_depth <= max_depth else self.truncated(max_depth)

    def truncated(self, max_depth: int) -> "Tree":
        """The same tree without nodes deeper than ``max_depth`` (near the context limit)."""
        return tree_from_paths([p for p in self.paths if len(p) <= max_depth])

    def __repr__(self) -> str:
        return f"Tree(nodes={len(self.paths)}, depth={self.max_depth})"


def normalize_paths(paths: Iterable[Sequence[int]]) -> tuple[Ranks, ...]:
    """Validate and sort: every rank a non-negative int, no duplicates, every prefix present."""
    seen: set[Ranks] = set()
    for raw in paths:
        path = tuple(raw)
        if not path:
            raise ValueError("A tree path must not be empty (the root is implicit).")
        if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in path):
            raise ValueError(f"Tree path {list(raw)} must hold non-negative integer ranks.")
        if path in seen:
            raise ValueError(f"Tree path {list(path)} appears twice.")
        seen.add(path)
    for path in seen:
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"Tree path {list(path)} has no parent {list(path[:-1])}: a tree must be prefix-closed.")
    return tuple(sorted(seen, key=lambda p: (len(p), p)))


@functools.lru_cache(maxsize=256)
@kept
def _build(paths: tuple[Ranks, ...]) -> Tree:
    slot = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    n = len(paths) + 1
    depth_max = max((len(p) for p in paths), default=0)
    parent = torch.full((n,), -1, dtype=torch.long)
    depth = torch.zeros(n, dtype=torch.long)
    rank = torch.zeros(n, dtype=torch.long)
    ancestor = torch.eye(n, dtype=torch.bool)
    path_slots = torch.zeros(n, depth_max + 1, dtype=torch.long)
    for p, i in slot.items():
        if p:
            parent[i], depth[i], rank[i] = slot[p[:-1]], len(p), p[-1]
        chain = [slot[p[:k]] for k in range(len(p) + 1)]
        ancestor[i, chain] = True
        path_slots[i] = torch.tensor(chain + [i] * (depth_max + 1 - len(chain)))
    return Tree(paths, parent, depth, rank, ancestor, path_slots)


def tree_from_paths(paths: Iterable[Sequence[int]]) -> Tree:
    return _build(normalize_paths(paths))


def chain_tree(length: int) -> Tree:
    """A single path of top-1 drafts (``length`` = 0 is plain decoding)."""
    return tree_from_paths([(0,) * k for k in range(1, length + 1)])


def tree_from_ranks(ranks: torch.Tensor, budget: int, max_rank: int | None = None) -> tuple[list[Ranks], float]:
    """Medusa's greedy tree: repeatedly add the path with the highest *measured* acceptance
    probability whose parent is already in the tree, until ``budget`` nodes.

    ``ranks`` (P, K) holds, for held-out positions, the rank of the true token k+2 ahead in
    head k's draft distribution. A path is accepted at a position when every depth's rank
    matches, so its probability is an empirical joint frequency (no independence assumption).
    Returns the paths in insertion order and the expected τ = 1 + Σ P(path).
    """
    positions, depth_max = ranks.shape
    cap = int(ranks.max()) if max_rank is None else max_rank
    chosen: list[Ranks] = []
    # rows of positions still consistent with each chosen path (for cheap child evaluation)
    support: dict[Ranks, torch.Tensor] = {(): torch.ones(positions, dtype=torch.bool)}
    frontier: dict[Ranks, float] = {}

    def expand(path: Ranks) -> None:
        if len(path) >= depth_max:
            return
        rows = support[path]
        column = ranks[:, len(path)]
        counts = torch.bincount(column[rows], minlength=cap + 1)[:cap]
        for r in range(cap):
            frontier[path + (r,)] = float(counts[r]) / positions

    expand(())
    tau = 1.0
    while len(chosen) < budget and frontier:
        best = max(frontier, key=lambda p: (frontier[p], -len(p)))
        prob = frontier.pop(best)
        if prob <= 0 and chosen:
            break
        chosen.append(best)
        tau += prob
        support[best] = support[best[:-1]] & (ranks[:, len(best) - 1] == best[-1])
        expand(best)
    return chosen, tau
