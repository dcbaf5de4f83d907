"""Stored trees and expected τ for heads that arrive without them (imported Medusa checkpoints).

The batch-adaptive policy and ``tree=<budget>`` read ``config.trees`` and
``config.expected_tau``, which training writes from its held-out ranks. An imported
checkpoint has neither, so this runs the same tree search (:func:`tree_from_ranks`) on the
heads' ranks over the base's own greedy answers (:mod:`.evaluation`'s features).
"""
from __future__ import annotations

import torch

from .decoding.tree import tree_from_ranks
from .heads import DraftHeads
from .training.features import Features
from .training.evaluation import rank_table

DEFAULT_BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def fit_trees(heads: DraftHeads, base, features: Features, budgets: tuple[int, ...] = DEFAULT_BUDGETS,
              default_budget: int = 4, source: str = "") -> dict[str, float]:
    """Write trees for ``budgets`` and their expected τ into ``heads.config`` (in place; the heads
    are scored in float32 against float32 copies of the base's LM head); returns {budget: τ}.
    The τ is measured as training's per-epoch evaluation measures it (``expected_tau_on="dev"``),
    so decoding counts it in full (:data:`~.heads.head_config.EXPECTED_TAU_SCALE`)."""
    heads.float().bind(base.get_output_embeddings().weight.float(), base.get_input_embeddings().weight.float())
    ranks = rank_table(heads, features, "teacher", torch.float32, "cpu")
    trees, taus = {}, {}
    for budget in budgets:
        paths, tau = tree_from_ranks(ranks, budget)
        trees[str(budget)], taus[str(budget)] = [list(p) for p in paths], round(tau, 4)
    heads.config.trees = trees
    heads.config.expected_tau, heads.config.default_budget = taus, default_budget
    heads.config.expected_tau_on = "dev"
    heads.config.extra = {**heads.config.extra,
                          "trees_fitted_on": {"positions": int(ranks.shape[0]), "source": source}}
    return taus


def prompt_records(path: str, limit: int) -> list[dict]:
    """The first ``limit`` prompts of a prompt file or built-in set (MT-Bench-style ``turns``, or
    ``{"prompt": ...}``), as :func:`.evaluation.base_answers` takes them; the whole file checked
    as the benches check it (:func:`.prompts.read_prompt_file`)."""
    from .prompts import read_prompt_file

    return [{key: record[key] for key in ("id", "category", "prompt")} for record in read_prompt_file(path)[:limit]]
