"""Drafters: who fills each step's token trees (transformers' ``CandidateGenerator`` idea, batch-first).

A :class:`Drafter` sees each live row's state and the policy's tree (its node budget, and the
shape the heads fill) and returns one tree per row (:class:`~.drafts.Drafts`); after the
verification it hears what each row accepted and emitted. Two implementations:

* :class:`HeadsDrafter` — the heads fill the policy's tree; every row has the same shape.
* :class:`MergedDrafter` — the heads' tree and the lookup sources (context, model store, bigram
  statistics: :mod:`.drafters`) merge into one trie per row, ranked by calibrated P(accepted)
  (:class:`~.drafters.HitRate`), and each step keeps the width that maximizes expected tokens
  per millisecond under the cost model (:class:`WidthChooser`). Without heads it is a pure
  lookup drafter (the Hierarchy Drafting order falls out of the ranking).

Every draft node is a fixed token given the row's history (a point mass), whoever proposed
it, so the acceptance rules and their proof in :mod:`.accept` hold for merged trees as they are.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np
import torch

from ...heads import DraftHeads
from ..limits import InputError, InputTypeError
from ..tree import Tree, chain_tree
from .candidates import Candidates, merge
from .drafts import Drafts
from .hitrate import HitRate, reviewed_bucket
from .lookup import LookupDrafter

if TYPE_CHECKING:  # the acceptance rules read drafts (accept → drafters.drafts): no runtime import back
    from ..accept import Acceptance


@dataclass
class DraftState:
    """What a drafter may read about the live rows before a step."""

    roots: torch.Tensor  # (B,) the token each row ends with (emitted, not yet in the cache)
    hidden: torch.Tensor  # (B, d) what the heads read (HeadContext.hidden)
    rows: list[int]  # (B,) each live row's index in the caller's batch
    room: list[int]  # (B,) the deepest draft each row may still use (tokens left - 1)
    context_length: int  # cache columns (the cost model's ctx)
    generated: Sequence[Sequence[int]] = ()  # per caller row: its tokens emitted so far (root last)


class Drafter(Protocol):
    """``start`` with the prompts, then per step ``propose`` → verify → ``observe``."""

    def start(self, prompts: Sequence[Sequence[int]]) -> None: ...

    def propose(self, state: DraftState, tree: Tree) -> Drafts: ...

    def observe(self, drafts: Drafts, result: Acceptance, rows: Sequence[int]) -> None: ...


def plain_drafts(roots: torch.Tensor) -> Drafts:
    """No drafts: a 1-node tree per row (a plain decoding step)."""
    return Drafts.uniform(chain_tree(0), roots[:, None])


@dataclass
class HeadsDrafter:
    """The heads fill the policy's tree (cut to the shallowest row's room); no state."""

    heads: DraftHeads | None

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        """Heads read hidden states, not token histories."""

    def propose(self, state: DraftState, tree: Tree) -> Drafts:
        tree = tree.fitting(min(state.room))
        if self.heads is None or tree.num_nodes == 1:
            return plain_drafts(state.roots)
        return Drafts.uniform(tree, self.heads.propose(state.hidden, state.roots, tree.spec))

    def observe(self, drafts: Drafts, result: Acceptance, rows: Sequence[int]) -> None:
        """Nothing to learn: the policy observes acceptance itself."""


class StepCost(Protocol):
    def step_ms(self, bs: int, nodes: int, ctx: int, budget: int = 0) -> float: ...


@dataclass(frozen=True)
class TableCost:
    """A bs-1 step-time table {nodes: ms} (``HeadConfig.default_budget_by_dtype[...]["ranked"]``)
    used for any batch as a function of query tokens: bs × nodes rows cost what bs·nodes nodes
    cost one row (a CPU forward is bound by its query tokens). Monotone: a larger tree never
    counts as cheaper than a smaller one."""

    nodes: tuple[int, ...]
    ms: tuple[float, ...]

    @classmethod
    def from_ranked(cls, ranked: Sequence[dict]) -> "TableCost":
        points = sorted((int(r["nodes"]), float(r["step_ms"])) for r in ranked)
        nodes, ms, best = [], [], float("inf")
        for n, t in reversed(points):  # lower every point to the cheapest larger tree
            best = min(best, t)
            nodes.append(n)
            ms.append(best)
        return cls(tuple(reversed(nodes)), tuple(reversed(ms)))

    @classmethod
    def from_cost_model(cls, cost, ctx: int) -> "TableCost":
        """A calibrated cost model's bs-1 step times at ``ctx`` at every node count it measured
        (forward + the loop's overhead), as a table priced by query tokens."""
        nodes = sorted({int(r["q"]) for r in cost.forward.rows() if int(r["bs"]) == 1})
        return cls.from_ranked([{"nodes": n, "step_ms": cost.step_ms(1, n, ctx)} for n in nodes])

    def step_ms(self, bs: int, nodes: int, ctx: int, budget: int = 0) -> float:
        from ..policy import interp1

        return interp1(self.nodes, self.ms, bs * nodes) if len(self.nodes) > 1 else self.ms[0] * bs * nodes


#: without a measured table: a step of n nodes costs 1 + 3 % per extra node, relative (this
#: CPU's bs-1 bf16 table grows about 3 % per node between 1 and 33 nodes)
LINEAR_COST = TableCost((1, 33), (1.0, 1.96))


@dataclass
class WidthChooser:
    """The step's node count: best-first trees are prefix-closed at every width, so keeping the
    first W−1 drafts of each row's ranked trie is always a valid tree; choose the W that
    maximizes Σ_rows E[tokens] / step time = Σ_b (1 + Σ_{i<W−1} s_b,i) / cost(B, W)."""

    cost: StepCost = LINEAR_COST
    max_nodes: int = 33

    def choose(self, scores: Sequence[np.ndarray], ctx: int) -> int:
        batch = len(scores)
        widest = min(self.max_nodes, 1 + max((len(s) for s in scores), default=0))
        gain = np.zeros(widest)  # gain[w-1] = Σ_b Σ_{i<w-1} s_b,i
        for s in scores:
            cum = np.concatenate([[0.0], np.cumsum(s[: widest - 1])])
            gain += np.pad(cum, (0, widest - len(cum)), mode="edge")
        rate = [(batch + gain[w - 1]) / self.cost.step_ms(batch, w, ctx) for w in range(1, widest + 1)]
        return 1 + int(np.argmax(rate))


def moving_average(previous: float | None, value: float, weight: float = 0.2) -> float:
    """An exponential moving average (the first value starts it)."""
    return value if previous is None else (1.0 - weight) * previous + weight * value


def head_trie(tree: Tree, tokens: Sequence[int], probs: Sequence[float]) -> Candidates:
    """One row of the heads' tree (slots 1..N−1) as candidates scored by draft probability."""
    parent = (tree.parent[1:] - 1).tolist()  # slot → index among the drafts (root = -1)
    return Candidates.from_heads(parent, list(tokens)[1:], list(probs)[1:])


def cap_depth(trie: Candidates, max_depth: int) -> Candidates:
    """The trie without nodes deeper than ``max_depth`` (a row near its token limit); still
    prefix-closed and in order, since depth grows along every path."""
    if len(trie) == 0 or int(trie.depth.max()) <= max_depth:
        return trie
    return trie.subset(np.flatnonzero(trie.depth <= max_depth))


def review(heads: DraftHeads, state: DraftState, tries: Sequence[Candidates], hitrate: HitRate) -> list[Candidates]:
    """The vertical cascade: the heads rescore each row's lookup trie before it takes slots.

    The heads read every root→node path once (one batched call over all rows' paths, cut at
    the heads' depth: a path to each node at depth K or to a shallower leaf covers its
    ancestors) and give each node within that depth the probability they would draft its
    token with; that probability's bin joins the node's hit-rate bucket
    (:func:`~.drafters.hitrate.reviewed_bucket`) and the trie is rescored. Deeper nodes keep
    their bucket (their path's product still carries the reviewed ancestors). Same nodes,
    same order: only the scores move."""
    depth_cap = heads.num_heads
    owners, chains, paths = [], [], []
    for b, trie in enumerate(tries):
        has_child = np.zeros(len(trie), dtype=bool)
        has_child[trie.parent[trie.parent >= 0]] = True
        for i in np.flatnonzero((trie.depth == depth_cap) | ((trie.depth < depth_cap) & ~has_child)):
            chain, node = [], int(i)
            while node >= 0:
                chain.append(node)
                node = int(trie.parent[node])
            owners.append(b)
            chains.append(chain[::-1])
            paths.append(trie.token[chain[::-1]].tolist())
    if not paths:
        return list(tries)
    tokens = torch.zeros(len(paths), 1 + max(map(len, paths)), dtype=torch.long, device=state.roots.device)
    for p, (b, path) in enumerate(zip(owners, paths)):
        tokens[p, 0] = state.roots[b]
        tokens[p, 1: 1 + len(path)] = torch.tensor(path)
    index = torch.tensor(owners, device=state.hidden.device)
    probs = heads.path_probs(state.hidden.index_select(0, index), tokens).cpu().numpy()  # (P, longest)
    reviewed = [np.full(len(trie), np.nan) for trie in tries]
    for p, (b, chain) in enumerate(zip(owners, chains)):
        reviewed[b][chain] = probs[p, : len(chain)]
    out = []
    for trie, prob in zip(tries, reviewed):
        seen = ~np.isnan(prob)
        bucket = trie.bucket.copy()
        bucket[seen] = reviewed_bucket(trie.bucket[seen], prob[seen])
        out.append(hitrate.rescore(Candidates(trie.parent, trie.token, trie.depth, trie.score, trie.source, bucket,
                                              trie.share)))
    return out


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
    lookup: LookupDrafter
    width: WidthChooser = field(default_factory=WidthChooser)
    lookup_nodes: int = 16
    review: bool = False
    _seen: dict[int, int] = field(default_factory=dict)
    _proposed: list[Candidates] = field(default_factory=list)
    #: what the heads' proposal has been worth: ms per call and expected accepted drafts of
    #: their own trie (Σ of its node scores), both moving averages (see :meth:`_heads_pay`)
    _heads_ms: float | None = None
    _heads_gain: float | None = None
    #: steps this drafter proposed with and without the heads (reports and tests)
    heads_steps: int = 0
    skipped_heads_steps: int = 0
    #: after this many skipped steps in a row the heads propose again, so their cost and worth
    #: are measured afresh (a slow first call, or text that changed, never rules them out for good)
    recheck_heads_every: int = 8
    _skipped_in_a_row: int = 0

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        self.lookup.reset()
        self._seen.clear()
        for row, prompt in enumerate(prompts):
            self.lookup.start(row, prompt)
            self._seen[row] = 0

    def propose(self, state: DraftState, tree: Tree) -> Drafts:
        tree = tree.fitting(min(state.room))
        budget = tree.num_nodes - 1 + self.lookup_nodes
        lookups = []
        for row in state.rows:
            new = state.generated[row][self._seen[row]:]  # what the row emitted since it last drafted
            if new:
                self.lookup.extend(row, new)
                self._seen[row] += len(new)
            lookups.append(self.lookup.tries(row, self.lookup_nodes))
        if self.review and self.heads is not None:
            lookups = [[trie] for trie in review(self.heads, state, [merge(parts, self.lookup_nodes) for parts in lookups],
                                                 self.lookup.hitrate)]
        tries = [cap_depth(merge(parts, budget), room) for parts, room in zip(lookups, state.room)]
        if self.heads is not None and tree.num_nodes > 1 and self._heads_pay(tries, state.context_length):
            started = time.perf_counter()
            tokens, probs = self.heads.propose(state.hidden, state.roots, tree.spec, with_probs=True)
            head_tokens, head_probs = tokens.tolist(), probs.tolist()
            heads = [self.lookup.hitrate.rescore(head_trie(tree, head_tokens[b], head_probs[b]))
                     for b in range(len(tries))]
            self._heads_ms = moving_average(self._heads_ms, (time.perf_counter() - started) * 1e3)
            self._heads_gain = moving_average(self._heads_gain, float(np.mean([h.score.sum() for h in heads])))
            tries = [cap_depth(merge(list(parts) + [h], budget), room)
                     for parts, h, room in zip(lookups, heads, state.room)]
            self.heads_steps += 1
            self._skipped_in_a_row = 0
        elif self.heads is not None and tree.num_nodes > 1:
            self.skipped_heads_steps += 1
            self._skipped_in_a_row += 1
        width = self.width.choose([t.score for t in tries], state.context_length)
        # best-first order: the first width−1 nodes of each trie are a prefix-closed tree
        self._proposed = [t if len(t) < width else t.subset(range(width - 1)) for t in tries]
        return Drafts.from_rows(state.roots, [t.parent.tolist() for t in self._proposed],
                                [t.token.tolist() for t in self._proposed])

    def _heads_pay(self, tries: Sequence[Candidates], ctx: int) -> bool:
        """Whether the heads' proposal is worth its time this step, given the lookups' tries.

        The heads draft below the root only, so where a lookup's first token is accepted with
        probability s₁ their tree adds accepted tokens only in the other 1 − s₁ of cases: at most
        G = Σ_rows (1 − s₁) · g, g the heads' own expected accepted drafts (their trie's Σ score,
        averaged). Proposing costs p ms on a step of t ms that yields T expected tokens from the
        lookups (the width chooser's step), so it pays when (T + G) / (t + p) > T / t, i.e.
        G / T > p / t. Until both are measured (the first proposals), and again after
        ``recheck_heads_every`` skipped steps, the heads propose."""
        if (self._heads_ms is None or self._heads_gain is None or self.width.cost is LINEAR_COST
                or self._skipped_in_a_row >= self.recheck_heads_every):
            return True  # LINEAR_COST is relative, not ms: no step time to weigh the heads' ms against
        first = [float(t.score[t.depth == 1].max()) if len(t) else 0.0 for t in tries]
        width = self.width.choose([t.score for t in tries], ctx)
        expected = sum(1.0 + float(t.score[: width - 1].sum()) for t in tries)
        gain = sum(1.0 - s for s in first) * self._heads_gain
        return gain * self.width.cost.step_ms(len(tries), width, ctx) > self._heads_ms * expected

    def observe(self, drafts: Drafts, result: Acceptance, rows: Sequence[int]) -> None:
        """Each row's accepted drafts calibrate the hit rates of the sources that proposed them."""
        accepted = drafts.accepted_tokens(result.path, result.accepted)
        for b, row in enumerate(rows):
            self.lookup.observe(row, self._proposed[b], accepted[b])


#: every draft source ``generate`` can merge: the heads, then the lookups most local first
DRAFT_SOURCES = ("heads", "context", "store", "stats")
#: the store file a head checkpoint ships beside its weights (``scripts/build_store.py``)
STORE_NAME = "lookup_store.safetensors"


def parse_drafts(drafts: str | Sequence[str]) -> tuple[str, ...]:
    """``"heads,context"`` / ``["heads", "context"]`` / ``"all"`` → the source names, checked."""
    if not isinstance(drafts, (str, list, tuple)) or any(not isinstance(n, str) for n in
                                                          ([] if isinstance(drafts, str) else drafts)):
        raise InputTypeError(f"drafts must be a str such as 'heads,context' (or 'all') or a list/tuple of such names, "
                             f"got {type(drafts).__name__} {drafts!r}; the sources are {', '.join(DRAFT_SOURCES)}.")
    names = drafts.split(",") if isinstance(drafts, str) else list(drafts)
    names = [n.strip().lower() for n in names if n.strip()]
    if names == ["all"]:
        return DRAFT_SOURCES
    unknown = [n for n in names if n not in DRAFT_SOURCES]
    if unknown or not names:
        raise InputError(f"drafts={drafts!r}: expected a comma-separated subset of {', '.join(DRAFT_SOURCES)} "
                         "(or 'all').")
    return tuple(n for n in DRAFT_SOURCES if n in names)


def check_review(review: bool, sources: Sequence[str]) -> None:
    """The vertical cascade needs the heads (the reviewers) and a lookup source (the reviewed)."""
    if not isinstance(review, bool):
        raise InputError(f"review={review!r}: expected True (the heads rescore lookup drafts) or False.")
    if review and ("heads" not in sources or not [s for s in sources if s != "heads"]):
        raise InputError(f"review=True: the heads review lookup drafts, so drafts must include 'heads' and at "
                         f"least one of context, store, stats (got {','.join(sources)}).")


def build_drafter(sources: Sequence[str], heads: DraftHeads | None, store=None, cost: StepCost | None = None,
                  eos_token_id: int | None = None, review: bool = False) -> Drafter:
    """The drafter for ``sources`` (:func:`parse_drafts`): the heads alone → :class:`HeadsDrafter`;
    any lookup → :class:`MergedDrafter` (with the heads when "heads" is among them)."""
    from .context_source import ContextConfig
    from .lookup import LookupConfig
    from .stats import StatsConfig
    from .store import StoreConfig

    if "heads" in sources and heads is None:
        raise InputError("drafts include 'heads' but no head checkpoint was loaded: pass heads_path, or draft "
                         "with lookups only (drafts='context,store,stats').")
    check_review(review, sources)
    lookups = [s for s in sources if s != "heads"]
    if not lookups:
        return HeadsDrafter(heads)
    config = LookupConfig(ContextConfig(eos_token_id=eos_token_id), StoreConfig(eos_token_id=eos_token_id),
                          StatsConfig(eos_token_id=eos_token_id))
    return MergedDrafter(heads if "heads" in sources else None, LookupDrafter(store, config, sources=lookups),
                         WidthChooser(cost if cost is not None else LINEAR_COST),
                         review=review)
