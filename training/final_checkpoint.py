"""The run's final checkpoint: the selected heads (the best epoch's), their held-out accuracy,
trees per node budget with expected τ, written with ``save_pretrained`` beside the model card,
the training report and the curves.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..decoding.base.hardware import machine_summary
from ..decoding.base.dtypes import DTYPES
from ..decoding.tree import tree_from_ranks
from ..heads import DraftHeads
from ..heads.checkpoint.card import model_card
from .evaluation import evaluate, rank_table
from .features import Features
from .frozen import FrozenParts
from .recipe_sections import Recipe
from .report import curves_json, data_summary, selection, write_curves
from .resume import Curves, Progress


def write_final_checkpoint(heads: DraftHeads, eval_table: Features, recipe: Recipe, parts: FrozenParts,
                           progress: Progress, dtype: torch.dtype, accelerator, total: int,
                           curves: Curves | None = None, tree_table: Features | None = None) -> dict:
    """The selected heads (the best epoch's, :func:`selection`), their held-out accuracy, trees
    for each node budget (fitted on ``tree_table``'s ranks when given: ``run.trees_from``),
    ``save_pretrained`` + model card + report + curves."""
    curves = curves or Curves()
    chosen = selection(curves, recipe)
    if chosen["epoch"] is not None and chosen["step"] != progress.step:
        heads.load_state_dict(curves.best_weights)
    accuracy, ranks = evaluate(heads, eval_table, recipe, dtype, accelerator)
    held_out_positions = int(ranks.shape[0])
    if tree_table is not None:
        with accelerator.autocast():
            ranks = rank_table(heads.eval(), tree_table, recipe.loss.labels, dtype, accelerator.device, 0,
                               recipe.train.chunk_length)
    trees = {}
    for budget in recipe.run.tree_budgets:
        paths, tau = tree_from_ranks(ranks, budget)
        trees[str(budget)] = {"paths": [list(p) for p in paths], "expected_tau": round(tau, 4)}
    config = heads.config
    config.trees = {b: t["paths"] for b, t in trees.items()}
    config.base_fingerprint = parts.checkpoint_fingerprint or parts.fingerprint
    config.base_name = "embedded:smollm2-135m-instruct" if recipe.base == "embedded" else recipe.base
    config.base_revision = parts.revision
    config.extra = {**config.extra, "recipe": recipe.to_dict(), "held_out_accuracy": accuracy}
    config.default_budget = recipe.run.default_budget
    config.expected_tau = {b: t["expected_tau"] for b, t in trees.items()}
    config.expected_tau_on = recipe.run.trees_from
    out = Path(recipe.run.final_dir or Path(recipe.run.output_dir) / "final")
    seconds = progress.train_seconds
    report = {"recipe": recipe.to_dict(), "steps": progress.step, "planned_steps": total,
              "final_loss": progress.last_loss, "train_positions_seen": progress.positions,
              "train_tokens_per_second": round(progress.positions / seconds, 1) if seconds else None,
              "train_wall_seconds": round(seconds, 1), "processes": accelerator.num_processes,
              "hardware": machine_summary(), "epochs": recipe.train.epochs, "data": data_summary(recipe),
              "distributed_type": str(accelerator.distributed_type).split(".")[-1],
              "mixed_precision": recipe.train.mixed_precision, "held_out_positions": held_out_positions,
              "trees_from": recipe.run.trees_from, "tree_positions": int(ranks.shape[0]),
              "accuracy": accuracy, "trees": trees, "base_fingerprint": parts.fingerprint,
              "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
              "selection": chosen, "curves": curves.epochs}
    if progress.start is not None:  # taken when the run started (a resumed run keeps its first start's)
        report["start"] = progress.start
    heads.save_pretrained(out, dtype=DTYPES[recipe.run.save_dtype], card=model_card(config, report, name=str(out)),
                          files={"training_report.json": json.dumps(report, indent=2) + "\n"})
    for directory in (Path(recipe.run.output_dir), out):
        write_curves(directory, curves_json(curves, recipe))
    return report
