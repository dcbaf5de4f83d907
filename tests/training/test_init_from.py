"""heads.init_from: a run that starts from a checkpoint's weights (the shipped heads, an imported
Medusa) trains those weights, draft vocabulary included; other heads, another base or a missing
folder is one line naming the key."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import final_weights, run_inprocess, tiny_recipe
from draftheads.core.errors import CheckpointError
from draftheads.training.preflight import preflight
from draftheads.training.recipe import load_recipe
from draftheads.training.recipe_sections import RecipeError


def first_losses(run_dir, steps: int = 3) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r][:steps]


def test_a_run_started_from_a_checkpoint_trains_its_weights(tiny_setup):
    fresh = tiny_setup / "fresh"
    run_inprocess(tiny_recipe(tiny_setup, "fresh", heads__draft_vocab_size=64))
    start = fresh / "final"
    # lr 1e-12: the weights stay within 1e-6 of the checkpoint's (fresh heads differ by ~0.1): the run started from them
    run_inprocess(tiny_recipe(tiny_setup, "kept", heads__draft_vocab_size=64, heads__init_from=str(start),
                              train__lr=1e-12, run__keep_best=False))
    before, after = final_weights(fresh), final_weights(tiny_setup / "kept")
    assert before.keys() == after.keys()
    assert torch.equal(before["vocab_ids"], after["vocab_ids"])  # the checkpoint's draft vocabulary, not a recount
    assert max((before[k].double() - after[k].double()).abs().max().item() for k in before) < 1e-6
    # at the recipe's lr the continued run starts where the trained heads are: below a fresh run's first losses;
    # it is saved over the folder it started from (run.final_dir), as a user continuing shipped heads in place does
    import hashlib
    import shutil

    from draftheads.heads.checkpoint.card import card_for_checkpoint

    in_place = shutil.copytree(start, tiny_setup / "in-place")
    digest = hashlib.sha256((start / "model.safetensors").read_bytes()).hexdigest()
    run_inprocess(tiny_recipe(tiny_setup, "continued", heads__draft_vocab_size=64, heads__init_from=str(in_place),
                              run__final_dir=str(in_place)))
    assert max(first_losses(tiny_setup / "continued")) < min(first_losses(fresh))
    # the report pins the starting weights (sha256, taken when they were loaded, not the overwritten folder's)
    # and what they had been trained on; the card says so
    report = json.loads((in_place / "training_report.json").read_text())
    assert hashlib.sha256((in_place / "model.safetensors").read_bytes()).hexdigest() != digest
    assert report["start"]["path"] == str(in_place) and report["start"]["weights_sha256"] == digest
    assert report["start"]["trained"]["epochs"] == 2 and report["start"]["trained"]["steps"] > 0
    card = card_for_checkpoint(in_place)
    assert f"Started from the weights of `{in_place}` (`heads.init_from`; model.safetensors sha256 {digest[:12]}…), " \
           "themselves trained 2 epoch(s)" in card
    assert "Started from" not in card_for_checkpoint(start)
    # resumed after the folder was overwritten, the run still names the weights it started from (run state)
    checkpoint = sorted((tiny_setup / "continued" / "checkpoints").glob("step-*"))[-1]
    run_inprocess(tiny_recipe(tiny_setup, "continued", heads__draft_vocab_size=64, heads__init_from=str(in_place),
                              run__final_dir=str(tiny_setup / "resumed"), run__resume=str(checkpoint)))
    resumed = json.loads((tiny_setup / "resumed" / "training_report.json").read_text())
    assert resumed["start"]["weights_sha256"] == digest and resumed["steps"] == report["steps"]


def test_init_from_refuses_other_heads_and_a_missing_folder(tiny_setup):
    start = tiny_setup / "start"
    run_inprocess(tiny_recipe(tiny_setup, "start", train__epochs=1))
    with pytest.raises(RecipeError, match=r"heads\.init_from .* holds other heads than the recipe trains: "
                                          r"num_heads 3 \(recipe: 2\)"):
        run_inprocess(tiny_recipe(tiny_setup, "two", heads__num_heads=2, heads__init_from=str(start / "final")))
    with pytest.raises(RecipeError, match=r"family 'medusa' \(recipe: 'hydra'\)"):
        run_inprocess(tiny_recipe(tiny_setup, "hydra", heads__family="hydra", heads__init_from=str(start / "final")))
    missing = tiny_recipe(tiny_setup, "missing", heads__init_from=str(tiny_setup / "no-such-run" / "final"))
    with pytest.raises(RecipeError, match=r"Recipe key heads\.init_from: .*no-such-run/final does not exist"):
        preflight(load_recipe(missing, []))
    (tiny_setup / "empty").mkdir(exist_ok=True)
    not_heads = tiny_recipe(tiny_setup, "not-heads", heads__init_from=str(tiny_setup / "empty"))
    with pytest.raises(RecipeError, match=r"empty holds no config\.json"):
        preflight(load_recipe(not_heads, []))


def test_init_from_refuses_heads_of_another_base(tiny_setup):
    start = tiny_setup / "start-other"
    run_inprocess(tiny_recipe(tiny_setup, "start-other", train__epochs=1))
    config_path = start / "final" / "config.json"
    config = json.loads(config_path.read_text())
    config["base_fingerprint"]["hidden_size"] += 1
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="trained for another base model"):
        run_inprocess(tiny_recipe(tiny_setup, "other-base", heads__init_from=str(start / "final")))
