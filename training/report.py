"""What a run leaves behind: the JSONL log, metric fields, and the finish — held-out accuracy,
trees per node budget with expected τ, ``save_pretrained`` + model card + training report.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..decoding.limits import DTYPES
from ..decoding.tree import tree_from_ranks
from ..heads import DraftHeads
from ..heads.checkpoint.card import model_card
from .evaluation import evaluate
from .features import Features
from .frozen import FrozenParts
from .recipe_sections import Recipe
from .resume import Progress


class JsonlLog:
    """Local metrics log (main process). On resume, lines past the resumed step (written by the
    killed run after its last checkpoint) are dropped so the log reads like one run."""

    def __init__(self, path: Path, resume_step: int | None, enabled: bool):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        lines = path.read_text().splitlines() if path.is_file() and resume_step is not None else []
        kept = [line for line in lines if json.loads(line).get("step", 0) <= resume_step] if lines else []
        path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")


def metric_fields(metrics: dict) -> dict:
    """Per-head metrics (K,) → ``name/head<h>``; scalars (e.g. adv_weight) keep their name."""
    out = {}
    for name, vals in metrics.items():
        if vals.dim() == 0:
            out[name] = float(vals)
        else:
            out.update({f"{name}/head{h}": float(v) for h, v in enumerate(vals)})
    return out


def finish(heads: DraftHeads, eval_table: Features, recipe: Recipe, parts: FrozenParts, progress: Progress,
           dtype: torch.dtype, accelerator, total: int) -> dict:
    """Held-out accuracy, trees for each node budget, ``save_pretrained`` + model card + report."""
    accuracy, ranks = evaluate(heads, eval_table, recipe, dtype, accelerator)
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
    out = Path(recipe.run.final_dir or Path(recipe.run.output_dir) / "final")
    seconds = progress.train_seconds
    report = {"recipe": recipe.to_dict(), "steps": progress.step, "planned_steps": total,
              "final_loss": progress.last_loss, "train_positions_seen": progress.positions,
              "train_tokens_per_second": round(progress.positions / seconds, 1) if seconds else None,
              "train_wall_seconds": round(seconds, 1), "processes": accelerator.num_processes,
              "distributed_type": str(accelerator.distributed_type).split(".")[-1],
              "mixed_precision": recipe.train.mixed_precision, "held_out_positions": int(ranks.shape[0]),
              "accuracy": accuracy, "trees": trees, "base_fingerprint": parts.fingerprint,
              "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])}
    heads.save_pretrained(out, dtype=DTYPES[recipe.run.save_dtype], card=model_card(config, report, name=str(out)),
                          files={"training_report.json": json.dumps(report, indent=2) + "\n"})
    return report
