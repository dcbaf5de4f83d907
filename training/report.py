"""What a run reports as it goes: the JSONL log, metric fields, the per-epoch evaluations (curves
and the best epoch's heads), the best epoch's selection and the data summary the final checkpoint's
report carries (:mod:`.final_checkpoint` writes it).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..decoding.base.dtypes import DTYPES
from ..core.atomic import atomic_file
from .evaluation import DEV, EVAL_BUDGET, HELD_OUT, evaluate_heads, is_better
from .features import Features
from .figures import plot_curves
from .recipe_sections import Recipe
from .resume import Curves

CURVES_JSON, CURVES_PNG, BEST_DIR = "curves.json", "curves.png", "best"


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


def epoch_ended(step: int, grad_accum: int, micro_per_epoch: int, total: int) -> bool:
    """Whether optimizer step ``step`` (counted from 1) ran the last micro-batch of an epoch, or
    is the run's last step (``total``: a run may stop inside an epoch)."""
    return step == total or step * grad_accum // micro_per_epoch > (step - 1) * grad_accum // micro_per_epoch


def record_epoch(run, eval_sets: dict[str, tuple[Features, dict]], log: JsonlLog) -> None:
    """The end of an epoch (or of a run that stops inside one): its mean train loss and each
    evaluation table's scores (:func:`.evaluation.evaluate_heads`) join the curves, its heads
    are kept (in the run state, and saved to ``<output_dir>/best``) when they beat the best
    epoch so far (``run.keep_best``), and the numbers go to log.jsonl, the trackers and
    curves.json/png. ``run`` is the trainer's :class:`~.train.Run`."""
    recipe, accelerator, progress, curves = run.recipe, run.accelerator, run.progress, run.curves
    record = {"epoch": round(progress.step * recipe.train.grad_accum / run.epoch_micros, 4), "step": progress.step,
              "train_loss": curves.end_epoch(), "eval": {}}
    if accelerator.is_main_process:
        for name, (table, groups) in eval_sets.items():
            cap = recipe.run.eval_positions if name == HELD_OUT else 0  # the dev table is scored whole
            record["eval"][name] = evaluate_heads(run.heads, table, groups, EVAL_BUDGET, recipe.loss.labels, run.dtype,
                                                  accelerator.device, cap, recipe.train.chunk_length,
                                                  accelerator.autocast)
        curves.epochs.append(record)
        on = DEV if DEV in eval_sets else HELD_OUT
        if recipe.run.keep_best and is_better(record["eval"][on], curves.best):
            scores = record["eval"][on]
            curves.keep({"epoch": record["epoch"], "step": progress.step, "on": on, "tree": scores["tree"],
                         "tau": scores["tau"], "top1": scores["top1"]}, run.heads.state_dict())
            run.heads.save_pretrained(run.output_dir / BEST_DIR, dtype=DTYPES[recipe.run.save_dtype],
                                      files={"selection.json": json.dumps(curves.best, indent=1) + "\n"})
        write_curves(run.output_dir, curves_json(curves, recipe))
        log.write({"step": progress.step, "epoch_eval": record})
        accelerator.log(epoch_fields(record), step=progress.step)
    accelerator.wait_for_everyone()


def epoch_fields(record: dict) -> dict:
    """An epoch record as flat tracker fields: ``epoch/<table>[/<group>]/top1/head<h>``, ``…/tau8``,
    ``…/tau_fixed16``."""
    fields = {"epoch": record["epoch"]}
    if record["train_loss"] is not None:
        fields["epoch/train_loss"] = record["train_loss"]
    for name, scores in record["eval"].items():
        for prefix, part in [(name, scores)] + [(f"{name}/{g}", s) for g, s in scores.get("groups", {}).items()]:
            if part["tau"] is None:
                continue
            fields[f"epoch/{prefix}/tau{EVAL_BUDGET}"] = part["tau"]
            fields[f"epoch/{prefix}/tau_fixed16"] = part["tau_fixed16"]
            fields.update({f"epoch/{prefix}/{m}/head{h}": v for m in ("top1", "top5") for h, v in enumerate(part[m])})
    return fields


def selection(curves: Curves, recipe: Recipe) -> dict:
    """Which epoch's heads the final checkpoint holds, and by what rule."""
    if not recipe.run.keep_best or curves.best is None:
        why = "run.keep_best is false" if not recipe.run.keep_best else "no epoch was evaluated"
        return {"epoch": None, "rule": f"the heads of the last step ({why})"}
    best = curves.best
    return {**best, "rule": f"highest τ at the {best['tree']} tree on the {best['on']} table over the evaluated "
                            "epochs, ties to the higher head-1 top-1, then the earlier epoch"}


def curves_json(curves: Curves, recipe: Recipe) -> dict:
    return {"epochs": curves.epochs, "selection": selection(curves, recipe)}


def write_curves(directory: Path, curves: dict) -> None:
    """curves.json and curves.png into ``directory``, each replaced in one rename."""
    with atomic_file(directory / CURVES_JSON) as tmp:
        tmp.write_text(json.dumps(curves, indent=1) + "\n")
    if curves["epochs"]:
        with atomic_file(directory / CURVES_PNG) as tmp, open(tmp, "wb") as handle:
            plot_curves(curves, handle)  # a file object: matplotlib writes PNG (its default format)


def data_summary(recipe: Recipe) -> dict | None:
    """What the run trained on, as it wrote it (job data: ``data.json``: sequences, answer
    positions), or None where it wrote none or it is unreadable."""
    from .data.job_data import read_data_summary

    return read_data_summary(Path(recipe.run.output_dir)) if recipe.data.kind == "job" else None


def start_summary(path: str) -> dict:
    """What a run started from (``heads.init_from``): the name given, its weights' sha256 (which
    pins the version when the folder is later overwritten) and what its own training report says
    it was trained on, its own start included (a chain of continued runs reads back whole). Taken
    when the run starts and kept in its checkpoints (``Progress.start``), so a resumed run names
    the weights it started from even after the folder changed."""
    import hashlib

    from ..heads.checkpoint.hub import resolve_checkpoint
    from ..heads.checkpoint.io import WEIGHTS_NAME

    directory = resolve_checkpoint(path)
    summary = {"path": path, "weights_sha256": hashlib.sha256((directory / WEIGHTS_NAME).read_bytes()).hexdigest()}
    try:
        before = json.loads((directory / "training_report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return summary  # an imported or hand-made checkpoint: no report to cite
    if isinstance(before, dict):
        data = before.get("data") if isinstance(before.get("data"), dict) else {}
        summary["trained"] = {"epochs": before.get("epochs"), "steps": before.get("steps"),
                              "sequences": data.get("sequences"), "answer_positions": data.get("answer_positions"),
                              "train_wall_seconds": before.get("train_wall_seconds"), "start": before.get("start")}
    return summary
