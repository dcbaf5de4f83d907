"""Where a run stands and how it continues: progress, its checkpoints on disk, the checkpoint
to resume from (same recipe only), and writing a checkpoint (draftheads' own state through
:mod:`.run_state`, never pickled).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..core.errors import CheckpointError
from ..heads.head_config import read_json_object
from .recipe_sections import Recipe, RecipeError
from .run_state import foreign_entries, save_run_state


CHECKPOINTS = "checkpoints"
RECIPE_FILE = "recipe.json"


class Progress:
    """Where the run is; saved in every checkpoint next to model/optimizer/scheduler/RNG."""

    def __init__(self):
        self.step = 0  # optimizer steps done
        self.positions = 0  # training positions seen (all processes)
        self.train_seconds = 0.0
        self.last_loss = float("nan")
        self.start: dict | None = None  # heads.init_from's summary, taken as the run starts (train.prepare_run)

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)


class Curves:
    """The per-epoch records (train loss, evaluations), the running sum of the current epoch's
    train loss, and the best epoch so far with a copy of its heads' weights. Saved in every
    checkpoint with the run's own state (:mod:`.run_state`), so a resumed run keeps the epochs
    it evaluated before it stopped and picks the same best epoch as an uninterrupted one."""

    def __init__(self):
        self.epochs: list[dict] = []  # one record per evaluated epoch, in order
        self.loss_sum = 0.0  # train loss summed over the current epoch's optimizer steps
        self.loss_steps = 0
        self.best: dict | None = None  # {"epoch", "step", "on", "tree", "tau", "top1"} of the best epoch so far
        self.best_weights: dict = {}  # that epoch's heads state dict (CPU copies)

    def add_step(self, loss: float) -> None:
        self.loss_sum, self.loss_steps = self.loss_sum + loss, self.loss_steps + 1

    def end_epoch(self) -> float | None:
        """The ended epoch's mean train loss; starts the next epoch's sum."""
        mean = self.loss_sum / self.loss_steps if self.loss_steps else None
        self.loss_sum, self.loss_steps = 0.0, 0
        return mean

    def keep(self, best: dict, weights: dict) -> None:
        self.best, self.best_weights = best, {k: v.detach().cpu().clone() for k, v in weights.items()}

    def state_dict(self) -> dict:
        return {"epochs": self.epochs, "loss_sum": self.loss_sum, "loss_steps": self.loss_steps, "best": self.best,
                "best_weights": self.best_weights}

    def load_state_dict(self, state: dict) -> None:
        self.epochs, self.loss_sum, self.loss_steps = state["epochs"], state["loss_sum"], state["loss_steps"]
        self.best, self.best_weights = state["best"], state["best_weights"]


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    return sorted(p for p in (output_dir / CHECKPOINTS).glob("step-*") if p.is_dir() and not p.name.endswith(".partial"))


def check_same_recipe(directory: Path, recipe: Recipe) -> None:
    """Refuse to resume a run made with another recipe, naming the keys that differ."""
    path = directory / RECIPE_FILE
    if not path.is_file():
        raise RecipeError(f"{directory} has no {RECIPE_FILE}: it is not a draftheads training run/checkpoint.")
    try:
        saved = read_json_object(path, "the recipe the run was made with",
                                 "the checkpoint is damaged: resume from another one (run.resume=<step dir>) or "
                                 "start over (run.resume=never).")
    except CheckpointError as err:
        raise RecipeError(str(err)) from None

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, prefix + k + ".") if isinstance(v, dict) and k != "extra" else {prefix + k: v})
        return out

    old, new = flat(saved), flat(recipe.identity())
    diffs = [f"{k}: {old.get(k)!r} → {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if diffs:
        raise RecipeError(f"Cannot resume {directory}: it was made with a different recipe ({'; '.join(diffs)}). "
                          "Use another run.output_dir, or run.resume=never to start over there.")


def resume_point(recipe: Recipe, output_dir: Path) -> Path | None:
    """The checkpoint to resume from (None = fresh start), after checking it fits the recipe."""
    mode = recipe.run.resume
    if mode == "never":
        foreign = foreign_entries(output_dir / CHECKPOINTS)
        if foreign:
            raise RecipeError(f"run.resume=never deletes {output_dir / CHECKPOINTS}, but it holds entries draftheads "
                              f"did not write ({', '.join(foreign[:5])}): move them away or use another "
                              "run.output_dir.")
        shutil.rmtree(output_dir / CHECKPOINTS, ignore_errors=True)
        return None
    if mode == "auto":
        found = checkpoint_dirs(output_dir)
        if (output_dir / RECIPE_FILE).is_file():
            check_same_recipe(output_dir, recipe)
        if not found:
            return None
        chosen = found[-1]
    else:
        chosen = Path(mode)
        if not chosen.is_dir():
            raise RecipeError(f"run.resume={mode!r}: no such checkpoint directory (use auto, never or a "
                              f"{output_dir / CHECKPOINTS}/step-* directory).")
    check_same_recipe(chosen, recipe)
    return chosen


def save_checkpoint(accelerator, output_dir: Path, step: int, recipe: Recipe, keep: int,
                    own_state: dict | None = None) -> None:
    """save_state into step-N.partial (plus draftheads' own state, never pickled), renamed when
    every process has written its part: a checkpoint directory without the suffix is always complete."""
    final = output_dir / CHECKPOINTS / f"step-{step:07d}"
    tmp = final.with_name(final.name + ".partial")
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / RECIPE_FILE).write_text(json.dumps(recipe.identity(), indent=1) + "\n")
        save_run_state(tmp, own_state or {})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoint_dirs(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
