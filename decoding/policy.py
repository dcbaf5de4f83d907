"""How much to speculate: the tree policies — a pinned tree (:class:`FixedTree`) and the
batch-size-adaptive policy that picks, every step, the tree that maximizes expected tokens/s for
the live batch under the cost model (:mod:`.cost`) — and which policy a model starts with:

    goodput(tree | bs, kv_len) = bs · τ(tree) / step_ms(bs, nodes, kv_len, budget)

τ(tree) comes from the checkpoint (expected tokens per step for each stored node budget, measured
on held-out text) and is rescaled online by what the decoder actually accepts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

import torch

from ..heads import CheckpointError, DraftHeads
from ..heads.head_config import EXPECTED_TAU_SCALE
from .base.loading import dtype_name
from .calibration import CalibrationConfig, calibrate
from .cost import CostModel
from ..core.errors import InputError
from .tree import Tree, chain_tree, tree_from_paths


class TreePolicy(Protocol):
    """Chooses each step's tree; the batch-adaptive policy and a pinned tree share this whole
    contract: ``choose`` the tree for the live batch (its size is the step's node budget; the
    drafter fills it), ``observe`` what the step accepted (the shape every row ran, None when
    rows ran different trees, and each live row's accepted drafts), and ``max_nodes`` the largest tree it may
    ask for (what the memory check prices)."""

    def choose(self, batch_size: int, context_length: int) -> Tree: ...

    def observe(self, tree: Tree | None, accepted: torch.Tensor) -> None: ...

    def max_nodes(self, batch_size: int, context_length: int) -> int: ...

    def prefers_plain(self, batch_size: int, context_length: int) -> bool: ...


@dataclass
class FixedTree:
    """The pinned strategy: the same tree whatever the batch."""

    tree: Tree

    def choose(self, batch_size: int, context_length: int) -> Tree:
        return self.tree

    def observe(self, tree: Tree | None, accepted: torch.Tensor) -> None:
        """A pinned tree learns nothing."""

    def max_nodes(self, batch_size: int, context_length: int) -> int:
        return self.tree.num_nodes

    def prefers_plain(self, batch_size: int, context_length: int) -> bool:
        return self.tree.num_nodes == 1


def as_policy(tree: Tree | TreePolicy) -> TreePolicy:
    """A Tree → :class:`FixedTree`; a policy must implement the whole :class:`TreePolicy`."""
    if isinstance(tree, Tree):
        return FixedTree(tree)
    missing = [name for name in ("choose", "observe", "max_nodes", "prefers_plain")
               if not callable(getattr(tree, name, None))]
    if missing:
        raise TypeError(f"tree={tree!r} is neither a Tree nor a TreePolicy: it lacks {', '.join(missing)} "
                        "(see draftheads.decoding.policy.TreePolicy).")
    return tree



def expected_tau_scale(heads: DraftHeads) -> float:
    """The share of the checkpoint's expected drafted tokens that decoding counts on: less than
    all of it where the expected τ was measured on the training data's own held-out answers."""
    return EXPECTED_TAU_SCALE[heads.config.expected_tau_on]


def best_budget(heads, cost: CostModel, batch_size: int = 1, context_length: int = 256,
                tau_scale: float = 1.0, budgets: Iterable[int] | None = None) -> list["Choice"]:
    """The cost model's ranking of the stored trees (and plain decoding) for a fixed tree:
    expected τ (the checkpoint's, its drafted part scaled by ``tau_scale``) over the calibrated
    step time at this batch size and context; best first. The default tree a checkpoint ships
    for each dtype is the first of these at batch size 1."""
    policy = AdaptivePolicy.from_heads(heads, cost, budgets, learn=False, prior_scale=tau_scale)
    return policy.rank(batch_size, context_length)


# -- the policy ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One tree the policy may pick: its node budget (0 = plain decoding), the tree, and the
    prior expected tokens per step τ (1 for plain decoding)."""

    budget: int
    tree: Tree
    tau: float


def candidates_from_heads(heads, budgets: Iterable[int] | None = None) -> list[Candidate]:
    """Plain decoding plus every stored tree whose budget has an expected τ in the checkpoint."""
    plain = Candidate(0, chain_tree(0), 1.0)
    if heads is None:
        return [plain]
    taus = {int(k): float(v) for k, v in heads.config.expected_tau.items()}
    trees = {int(k): v for k, v in heads.config.trees.items()}
    if not taus or not trees:
        raise CheckpointError("The adaptive policy needs the checkpoint's stored trees and their expected τ "
                         "(config.trees and config.expected_tau, written by training's tree search); "
                         "this checkpoint lacks them: pin a tree instead (tree=<node budget>).")
    wanted = sorted(set(trees) & set(taus) if budgets is None else set(budgets) - {0})
    missing = [b for b in wanted if b not in trees or b not in taus]
    if missing:
        raise InputError(f"No stored tree with an expected τ for budget(s) {missing}; stored: {sorted(set(trees) & set(taus))}.")
    out = [plain]
    for budget in wanted:
        tree = tree_from_paths(trees[budget])
        heads.check_tree(tree.spec)
        out.append(Candidate(budget, tree, taus[budget]))
    return out


@dataclass
class Choice:
    budget: int
    nodes: int
    tau: float
    step_ms: float
    tokens_per_second: float


class AdaptivePolicy:
    """Each step, the candidate tree with the highest expected tokens/s for the live batch.

    Online τ: the checkpoint's τ comes from held-out training text and overestimates other
    text (MT-Bench halves head accuracy). One scale s on the *drafted* part, τ = 1 + s·(τ₀ − 1),
    is fitted as an exponentially decayed ratio of accepted to expected-accepted tokens. One
    scale rather than one average per budget: every step informs every budget, including
    budgets the policy is not currently choosing. It depends only on accepted counts, never on
    timings, so greedy runs are deterministic (and the output tokens never depend on it)."""

    def __init__(self, candidates: Sequence[Candidate], cost: CostModel, learn: bool = True, decay: float = 0.98,
                 prior_weight: float = 16.0, prior_scale: float = 1.0):
        if not candidates:
            raise ValueError("AdaptivePolicy needs at least one candidate tree.")
        self.candidates = sorted(candidates, key=lambda c: c.budget)
        self.cost = cost
        self.learn = learn
        self.decay = decay
        self.prior_weight = prior_weight
        self.prior_scale = prior_scale  # the scale before any observation (fades as steps are seen)
        self._accepted = 0.0  # decayed sums behind the scale
        self._expected = 0.0
        self._last: Candidate | None = None

    @classmethod
    def from_heads(cls, heads, cost: CostModel, budgets: Iterable[int] | None = None, **kwargs) -> "AdaptivePolicy":
        return cls(candidates_from_heads(heads, budgets), cost, **kwargs)

    @property
    def scale(self) -> float:
        return (self._accepted + self.prior_weight * self.prior_scale) / (self._expected + self.prior_weight)

    def tau(self, candidate: Candidate, learned: bool = True) -> float:
        """The expected tokens per step of ``candidate``: scaled by what was learned, or (not
        ``learned``) by the prior scale alone."""
        return 1.0 + (self.scale if learned else self.prior_scale) * (candidate.tau - 1.0)

    def rank(self, batch_size: int, context_length: int, learned: bool = True) -> list[Choice]:
        """Every candidate's predicted step time and goodput, best first (ties: smaller tree);
        ``learned=False``: on the prior τ, whatever earlier steps accepted."""
        choices = []
        for c in self.candidates:
            ms = self.cost.step_ms(batch_size, c.tree.num_nodes, context_length, c.budget)
            tau = self.tau(c, learned)
            choices.append(Choice(c.budget, c.tree.num_nodes, tau, ms, batch_size * tau * 1000.0 / ms))
        return sorted(choices, key=lambda ch: (-ch.tokens_per_second, ch.nodes))

    def prefers_plain(self, batch_size: int, context_length: int) -> bool:
        """Whether plain decoding has the best expected goodput for this batch. With the
        decoder's ``decoding.delegate_plain`` on, the whole call then goes to the base's own ``generate``
        (as vLLM's ``speculative_disable_by_batch_size`` does); off (the default), the loop runs
        plain steps itself, drops finished rows, and may return to trees as the batch shrinks.
        Decided on the prior τ, never on what earlier calls accepted: the same call takes the same
        path every time (a seeded sampling call gives the same tokens)."""
        return self.rank(batch_size, context_length, learned=False)[0].budget == 0

    def max_nodes(self, batch_size: int, context_length: int) -> int:
        """The largest tree this policy may choose (what the memory check prices)."""
        return max(c.tree.num_nodes for c in self.candidates)

    def choose(self, batch_size: int, context_length: int) -> Tree:
        best = self.rank(batch_size, context_length)[0]
        self._last = next(c for c in self.candidates if c.budget == best.budget)
        return self._last.tree

    def observe(self, tree: Tree, accepted: torch.Tensor) -> None:
        """Called by the loop after each verification with the rows' accepted draft counts.
        Steps whose tree was cut short (near ``max_new_tokens``) or plain steps say nothing
        about the heads and are skipped."""
        last = self._last
        if not self.learn or last is None or last.budget == 0 or tree is not last.tree:
            return
        self._accepted = self.decay * self._accepted + float(accepted.sum())
        self._expected = self.decay * self._expected + accepted.numel() * (last.tau - 1.0)

    def reset(self) -> None:
        self._accepted = self._expected = 0.0
        self._last = None

    def __repr__(self) -> str:
        return f"AdaptivePolicy(budgets={[c.budget for c in self.candidates]}, scale={self.scale:.3f})"


# -- which tree a model starts with -------------------------------------------------------------
def resolve_tree(tree, base, heads: DraftHeads | None, calibration: CalibrationConfig | None = None):
    """``from_pretrained``'s ``tree``: None (the checkpoint's default budget), an int node
    budget, ``"adaptive"`` (the batch-size-adaptive policy on this machine's calibrated cost
    model: measured once, ~1-2 min on 2 CPU cores, then cached), a Tree or any TreePolicy."""
    if isinstance(tree, str):
        if tree.strip().lower() != "adaptive":
            try:
                tree = int(tree)
            except ValueError:
                raise InputError(f"tree={tree!r}: expected 'adaptive' or a node budget (an integer).") from None
        elif heads is None:
            return chain_tree(0)
        else:
            cost = calibrate(base, heads, calibration or CalibrationConfig())
            return AdaptivePolicy.from_heads(heads, cost)
    if isinstance(tree, int) and not isinstance(tree, bool):
        return tree_for_budget(heads, tree)
    return tree


def default_budget(heads: DraftHeads, dtype: torch.dtype | None = None) -> int:
    """The checkpoint's default node budget for a base in ``dtype``: the one the cost model chose
    for that dtype (``default_budget_by_dtype``, written by ``scripts/default_trees.py`` from a
    calibration × the heads' expected τ), else its dtype-independent ``default_budget``."""
    by_dtype = heads.config.default_budget_by_dtype
    if dtype is not None and dtype_name(dtype) in by_dtype:
        return int(by_dtype[dtype_name(dtype)]["budget"])
    return int(heads.config.default_budget)


def default_tree(heads: DraftHeads | None, dtype: torch.dtype | None = None) -> Tree:
    """The checkpoint's tree for the default budget in ``dtype``, or plain decoding without heads."""
    if heads is None:
        return chain_tree(0)
    return tree_for_budget(heads, default_budget(heads, dtype))


def tree_for_budget(heads: DraftHeads | None, budget: int) -> Tree:
    if heads is None or budget <= 0:
        return chain_tree(0)
    trees = heads.config.trees
    if trees:
        fitting = [int(k) for k in trees if int(k) <= budget]
        if not fitting:
            raise InputError(f"No stored tree fits a budget of {budget} nodes; stored budgets: {sorted(map(int, trees))}.")
        tree = tree_from_paths(trees[str(max(fitting))])
    else:
        tree = chain_tree(min(budget, heads.num_heads))
    heads.check_tree(tree.spec)
    return tree
