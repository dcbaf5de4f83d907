"""Resuming never runs code from a checkpoint: a tampered file is refused before anything is
unpickled (the payload would create a file; the file stays absent), draftheads' own state is
safetensors + JSON, and ``run.resume: never`` refuses to delete what it did not write."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

from helpers import run_inprocess, tiny_recipe
from draftheads.heads import CheckpointError
from draftheads.training.recipe_sections import RecipeError
from draftheads.training.run_state import join_state, split_state


class Payload:
    """Unpickling this calls ``Path.touch`` on ``target``: proof that code ran."""

    def __init__(self, target: pathlib.Path):
        self.target = target

    def __reduce__(self):
        return pathlib.Path.touch, (self.target,)


@pytest.fixture(scope="module")
def checkpointed(tiny_setup):  # noqa: F811 - pytest fixture injection
    """A finished tiny run with its step-4 checkpoint (draftheads' own state files in it)."""
    run_inprocess(tiny_recipe(tiny_setup, "secure", run__checkpoint_every=4, run__keep_checkpoints=1),
                  "--max_steps", "6")
    checkpoint = tiny_setup / "secure" / "checkpoints" / "step-0000004"
    assert (checkpoint / "draftheads_state.json").is_file() and (checkpoint / "draftheads_state.safetensors").is_file()
    assert not list(checkpoint.glob("custom_checkpoint_*.pkl"))  # nothing of ours is pickled any more
    return checkpoint


def tampered_copy(checkpoint: pathlib.Path, tmp_path: pathlib.Path, name: str) -> tuple[pathlib.Path, pathlib.Path]:
    import shutil

    copy = tmp_path / "checkpoints" / "step-0000004"
    shutil.copytree(checkpoint, copy)
    marker = tmp_path / "PWNED"
    torch.save({"state": Payload(marker)}, copy / name)
    return copy, marker


@pytest.mark.parametrize("name", ["custom_checkpoint_0.pkl", "optimizer.bin", "random_states_0.pkl"])
def test_tampered_checkpoint_is_refused_without_running_anything(tiny_setup, checkpointed, tmp_path, name):  # noqa: F811
    copy, marker = tampered_copy(checkpointed, tmp_path, name)
    recipe = tiny_recipe(tiny_setup, "secure", run__checkpoint_every=4, run__resume=str(copy))
    with pytest.raises(CheckpointError, match=f"Refusing to resume.*{name} is not plain tensor data"):
        run_inprocess(recipe, "--max_steps", "6")
    assert not marker.exists()
    torch.load(copy / name, weights_only=False)  # the payload is live: plain unpickling runs it
    assert marker.exists()


def test_resume_from_own_state_files_continues(tiny_setup, checkpointed, tmp_path):  # noqa: F811
    recipe = tiny_recipe(tiny_setup, "secure", run__checkpoint_every=4, run__resume=str(checkpointed),
                         run__final_dir=str(tmp_path / "final"))
    report = run_inprocess(recipe, "--max_steps", "6")
    assert report["steps"] == 6
    whole = json.loads((tiny_setup / "secure" / "final" / "training_report.json").read_text())
    assert report["final_loss"] == pytest.approx(whole["final_loss"], abs=1e-9, rel=0)


def test_damaged_own_state_is_a_clear_error(tiny_setup, checkpointed, tmp_path):  # noqa: F811
    import shutil

    copy = tmp_path / "step-0000004"
    shutil.copytree(checkpointed, copy)
    (copy / "draftheads_state.json").write_text("{not json")
    recipe = tiny_recipe(tiny_setup, "secure", run__checkpoint_every=4, run__resume=str(copy))
    with pytest.raises(CheckpointError, match="draftheads_state.json.*damaged"):
        run_inprocess(recipe, "--max_steps", "6")


def test_resume_never_refuses_to_delete_foreign_files(tiny_setup, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    (out / "checkpoints" / "step-0000004").mkdir(parents=True)
    (out / "checkpoints" / "thesis.tex").write_text("years of work")
    recipe = tiny_recipe(tiny_setup, "never", run__output_dir=str(out), run__resume="never")
    with pytest.raises(RecipeError, match=r"resume=never deletes .*checkpoints.*did not write \(thesis\.tex\)"):
        run_inprocess(recipe, "--max_steps", "2")
    assert (out / "checkpoints" / "thesis.tex").is_file()


def test_state_round_trip_keeps_types():
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
             "param_groups": [{"lr": 0.1, "betas": (0.5, 0.999), "foreach": None, "params": [0]}]}
    tensors: dict = {}
    data = json.loads(json.dumps(split_state(state, tensors, "opt")))
    back = join_state(data, tensors)
    assert list(back["state"]) == [0] and torch.equal(back["state"][0]["exp_avg"], torch.ones(2))
    assert back["param_groups"][0]["betas"] == [0.5, 0.999] and back["param_groups"][0]["foreach"] is None
    with pytest.raises(TypeError, match="holds a object"):
        split_state({"x": object()}, {}, "bad")
