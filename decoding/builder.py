"""The one builder of how a model decodes: the tree policy and the drafter, built whole from a
:class:`~.config.DecodingConfig`, the heads, the base and this machine's step costs
(:func:`build_decoding`). Nothing else makes or patches them: a model holds what this returns
(:class:`Decoding`), and another configuration over the same base and heads is another build
(:meth:`~.generate.DraftHeadsModel.with_decoding`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..heads import DraftHeads
from .base.forward import ragged_capable
from .base.loading import dtype_name
from .calibration import CalibrationConfig, calibrate
from .config import AUTO, DecodingConfig
from .cost import CostModel
from .drafters import Drafter, MergedDrafter, auto_sources, build_drafter, check_review, open_store
from .drafters import needing
from ..core.errors import InputError, InputTypeError
from .policy import (AdaptivePolicy, FixedTree, TreePolicy, as_policy, best_budget, default_tree, expected_tau_scale,
                     resolve_tree, tree_for_budget)
from .request import eos_token_ids
from .tree import Tree

#: the quick calibration behind the defaults (:func:`measure_step_costs`): batch size 1, the
#: stored trees' sizes and the merged drafter's widths, at a short context (where the default
#: tree is chosen) and a long one (so the width chooser prices the nodes of a long prompt by its
#: KV length, :meth:`~.cost.CostModel.per_token_table`)
QUICK_CONTEXT = 256
QUICK_CONTEXTS = (QUICK_CONTEXT, 1024)
QUICK_CALIBRATION = CalibrationConfig(batch_sizes=(1,), contexts=QUICK_CONTEXTS, reps=3,
                                      extra_nodes=(3, 5, 9, 17, 33))
#: the methods a drafter given to the builder must have (:class:`~.drafters.Drafter`)
DRAFTER_METHODS = ("start", "propose", "observe", "max_nodes")


@dataclass(frozen=True)
class StepCosts:
    """What this machine's quick calibration found (:func:`measure_step_costs`); empty: not measured."""

    #: bs-1 step times by node count and KV length, the merged drafter's width model
    table: CostModel | None = None
    #: the heads-alone node budget the calibration ranks best (None: the checkpoint's stored default)
    default_budget: int | None = None


@dataclass(frozen=True)
class Decoding:
    """How a model decodes, built whole by :func:`build_decoding`."""

    config: DecodingConfig
    policy: TreePolicy
    drafter: Drafter
    #: the sources the drafter merges, in registry order (("heads",) for the heads alone; () plain)
    sources: tuple[str, ...]

    def max_nodes(self, batch_size: int, context_length: int) -> int:
        """The most slots a row's step may verify, root included: what the memory check prices.
        A merged step may verify more than the policy's tree (its lookups' nodes join it)."""
        return self.drafter.max_nodes(self.policy.max_nodes(batch_size, context_length))

    def summary(self) -> dict:
        """What fills the trees, in words a report prints (:meth:`~.generate.DraftHeadsModel.drafting_summary`)."""
        drafter = self.drafter
        offer = drafter.heads_tree if isinstance(drafter, MergedDrafter) else None  # the heads' larger tree
        tree = self.policy.tree.num_nodes if isinstance(self.policy, FixedTree) else "adaptive"
        out = {"sources": list(self.sources), "tree_nodes": offer.num_nodes if offer is not None else tree,
               "max_nodes_per_row": self.max_nodes(1, QUICK_CONTEXT)}
        if isinstance(drafter, MergedDrafter) and drafter.heads is not None:
            out["heads_steps"] = drafter.heads_steps
            out["skipped_heads_steps"] = drafter.skipped_heads_steps
            if drafter.mode_steps:  # a batch's steps by the mode that drafted them (.drafters.modes)
                out["batch_modes"] = dict(drafter.mode_steps)
        return out


@dataclass
class Stores:
    """The lookup stores a model's builds have opened, one per file (read-only, memory-mapped),
    shared by every build over the same heads."""

    opened: dict = field(default_factory=dict)

    def get(self, path: str | Path | None, heads: DraftHeads | None, tokenizer, vocab: int):
        key = None if path is None else str(Path(path).resolve())
        if key not in self.opened:
            self.opened[key] = open_store(path, heads, tokenizer, vocab)
        return self.opened[key]


def measure_step_costs(base, heads: DraftHeads | None, config: CalibrationConfig | None = None) -> StepCosts:
    """Price this machine's step (a quick bs-1 calibration of the verify forward, the loop's
    overhead and the heads' drafting: seconds, once per machine/dtype/torch, cached) and the
    stored tree it ranks best (step time × the checkpoint's expected τ, its drafted part scaled by
    :func:`~.policy.expected_tau_scale`). Without heads, or with stored trees lacking an expected
    τ, no budget is chosen (the checkpoint's stored default stays)."""
    cost = calibrate(base, heads, config or QUICK_CALIBRATION)
    table = cost.per_token_table(sorted({int(r['ctx']) for r in cost.forward.rows()}))
    budget = None
    if heads is not None and heads.config.trees and heads.config.expected_tau:
        budget = best_budget(heads, cost, 1, QUICK_CONTEXT, expected_tau_scale(heads))[0].budget
    return StepCosts(table, budget)


def build_decoding(config: DecodingConfig, base, heads: DraftHeads | None, tokenizer=None,
                   costs: StepCosts = StepCosts(), stores: Stores | None = None, auto: bool = True,
                   drafter: Drafter | None = None, policy: TreePolicy | None = None) -> Decoding:
    """The policy and the drafter for ``config`` over ``base`` and ``heads`` (bound already).

    ``config.tree`` None: the stored tree ``costs`` ranks best (else the checkpoint's default for
    this dtype); ``config.sources`` "auto": with ``auto``, every source there is data for
    (:func:`~.drafters.auto_sources`), else the heads alone; ``drafter``: a drafter of the
    caller's own (any :class:`~.drafters.Drafter`), used as given; ``policy``: the policy of a
    build of the same ``config.tree``, kept (an adaptive policy keeps what it learned)."""
    policy = policy if policy is not None else tree_policy(config, base, heads, costs)
    if drafter is not None:
        check_drafter(drafter)
        return Decoding(config, policy, drafter, drafter_sources(drafter))
    sources = config.sources
    if sources == AUTO:
        sources = auto_sources(heads, config.lookup_store) if auto else (("heads",) if heads is not None else ())
    check_review(config.review, sources)
    check_servable(config, heads, sources)
    store = None
    uses_store = bool(needing("store", sources))
    if uses_store or config.lookup_store is not None:  # a store named is checked even when these sources skip it
        opened = (stores or Stores()).get(config.lookup_store, heads, tokenizer,
                                          base.get_input_embeddings().num_embeddings)
        store = opened if uses_store else None
    heads_tree = None
    if config.tree is None and costs.default_budget is not None and heads is not None and "heads" in sources and len(sources) > 1:
        heads_tree = tree_for_budget(heads, costs.default_budget * config.merged_offer_scale)
    eos = eos_token_ids(base.generation_config)
    built = build_drafter(sources, heads, store, step_cost(policy, costs, heads, base), eos[0] if eos else None,
                          config.review, ragged_capable(base), heads_tree=heads_tree,
                          offer=heads_offer(heads, config), per_row=config.per_row_counts,
                          vocab=base.get_input_embeddings().num_embeddings)
    return Decoding(config, policy, built, tuple(sources))


def tree_policy(config: DecodingConfig, base, heads: DraftHeads | None, costs: StepCosts) -> TreePolicy:
    """``config.tree`` as a policy (:func:`~.policy.resolve_tree`); None: the stored tree of the
    calibrated budget, else the checkpoint's default tree for the base's dtype."""
    tree = resolve_tree(config.tree, base, heads, config.calibration)
    if tree is None:
        tree = (tree_for_budget(heads, costs.default_budget) if costs.default_budget is not None
                else default_tree(heads, base.dtype))
    return as_policy(tree)


def heads_offer(heads: DraftHeads | None, config: DecodingConfig) -> Callable[[Tree], Tree] | None:
    """What the heads alone fill for a tree of the policy (:data:`~.config.HEADS_OFFER_SCALE`):
    the stored tree of ``heads_offer_scale`` times its node budget. None (the policy's trees
    verified as they are): at scale 1, for heads that store no trees, or for a tree given as a
    Tree or a policy (its shape is the caller's choice)."""
    scale, given = config.heads_offer_scale, config.tree
    if heads is None or scale == 1 or not heads.config.trees or not (given is None or isinstance(given, (int, str))):
        return None
    offers: dict[int, Tree] = {}

    def offer(tree: Tree) -> Tree:
        budget = tree.num_nodes - 1
        if budget not in offers:
            offers[budget] = tree_for_budget(heads, budget * scale)
        return offers[budget]

    return offer


def step_cost(policy: TreePolicy, costs: StepCosts, heads: DraftHeads | None, base) -> CostModel | None:
    """The step-time model the merged drafter sizes trees with: the adaptive policy's
    calibration, else this machine's quick calibration, else the checkpoint's stored bs-1 table
    for this dtype (measured elsewhere), else None (a linear guess)."""
    if isinstance(policy, AdaptivePolicy):
        return policy.cost
    if costs.table is not None:
        return costs.table
    by_dtype = heads.config.default_budget_by_dtype if heads is not None else {}
    ranked = by_dtype.get(dtype_name(base.dtype), {}).get("ranked")
    return CostModel.from_ranked(ranked) if ranked else None


def check_servable(config: DecodingConfig, heads: DraftHeads | None, sources: tuple[str, ...]) -> None:
    """A configuration the heads cannot serve is one line naming the field and the fix: a tree
    deeper than the heads draft (checked here for a Tree; a node budget takes the stored tree
    that fits), the heads' sources without heads."""
    tree = config.tree
    depth = int(tree.depth.max()) if isinstance(tree, Tree) and tree.num_nodes > 1 else 0
    if heads is not None and "heads" in sources and depth > heads.num_heads:
        raise InputError(f"decoding.tree is {depth} deep but these heads draft {heads.num_heads} tokens ahead: "
                         f"pass a tree at most {heads.num_heads} deep, or a node budget (tree=N).")


def drafter_sources(drafter) -> tuple[str, ...]:
    """The sources a drafter merges: the heads (when it has them) and its lookups' names."""
    heads = ("heads",) if getattr(drafter, "heads", None) is not None else ()
    lookup = getattr(drafter, "lookup", None)
    return heads + tuple(getattr(lookup, "sources", ()) if lookup is not None else getattr(drafter, "sources", ()))


def check_drafter(drafter) -> None:
    missing = [name for name in DRAFTER_METHODS if not callable(getattr(drafter, name, None))]
    if missing:
        raise InputTypeError(f"drafter={type(drafter).__name__} lacks {', '.join(missing)}: a drafter implements "
                             "draftheads.decoding.drafters.Drafter (start, propose, observe, max_nodes).")
