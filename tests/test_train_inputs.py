"""Issue 22: ``draftheads train`` validates the whole recipe before any work, and data,
base and checkpoint problems end in one clear line, not a traceback."""
from __future__ import annotations

import json

import pytest

from helpers import tiny_recipe
from draftheads.training.recipe import RecipeError, load_recipe
from draftheads.training.train import main


@pytest.mark.parametrize("override,message", [
    (["--heads.family", "medussa"], r"heads\.family='medussa' is not a known head family; use one of \[.*'medusa'"),
    (["--heads.draft_vocab_size", "-1"], r"heads\.draft_vocab_size must be ≥ 0, got -1"),
    (["--data.eval_examples", "0"], r"data\.eval_examples must be ≥ 1, got 0"),
    (["--train.warmup_ratio", "1.5"], r"train\.warmup_ratio must be in \[0, 1\], got 1\.5"),
    (["--loss.temperature", "0"], r"loss\.temperature must be > 0, got 0"),
    (["--run.tree_budgets", "[0, 4]"], r"run\.tree_budgets must be a non-empty list of node budgets ≥ 1"),
    (["--run.keep_checkpoints", "0"], r"run\.keep_checkpoints must be ≥ 1, got 0"),
    (["--train.max_steps", "-5"], r"train\.max_steps must be ≥ 0, got -5"),
])
def test_recipe_values_are_checked_when_it_loads(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("recipes/medusa-smollm2.yaml", override)


def run_main(recipe, capsys, *overrides) -> str:
    assert main([str(recipe), *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_family_typo_fails_before_any_work(tiny_setup, capsys):  # noqa: F811
    err = run_main(tiny_recipe(tiny_setup, "typo"), capsys, "--heads.family", "hydra+")
    assert "heads.family='hydra+' is not a known head family" in err
    assert not (tiny_setup / "typo").exists()  # nothing was created, extracted or loaded


def test_missing_data_is_one_line_before_the_base_loads(tiny_setup, capsys):  # noqa: F811
    err = run_main(tiny_recipe(tiny_setup, "nodata"), capsys, "--data.path", str(tiny_setup / "missing.jsonl"))
    assert "data.path" in err and "missing.jsonl does not exist" in err


def test_missing_base_is_one_line(tiny_setup, capsys):  # noqa: F811
    err = run_main(tiny_recipe(tiny_setup, "nobase"), capsys, "--base", str(tiny_setup / "no-base"))
    assert "no-base' does not exist" in err


def test_data_error_is_one_line(tiny_setup, tmp_path, capsys):  # noqa: F811
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no input_ids"}) + "\n")
    err = run_main(tiny_recipe(tiny_setup, "baddata"), capsys, "--data.path", str(bad))
    assert "input_ids" in err


def test_checkpoint_error_is_one_line(tiny_setup, tmp_path, capsys):  # noqa: F811
    fake = tmp_path / "step-0000004"
    fake.mkdir()
    (fake / "recipe.json").write_text(json.dumps(load_recipe(tiny_recipe(tiny_setup, "fake")).identity()))
    (fake / "optimizer.bin").write_bytes(b"not a torch file")
    err = run_main(tiny_recipe(tiny_setup, "fake"), capsys, "--run.resume", str(fake))
    assert "Refusing to resume" in err and "optimizer.bin is not plain tensor data" in err
