"""Per-epoch evaluation: τ of a fixed tree on measured ranks, scores per named group, the rule
that picks the best epoch, evaluation at every epoch's end with the right step numbers, the
final checkpoint holding the best epoch's heads (also after a resume), curves.json/png and
the model card's per-epoch table."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import final_weights, run_inprocess, tiny_heads, tiny_recipe
from draftheads.heads.checkpoint.card import card_for_checkpoint
from draftheads.training import report as report_module
from draftheads.training import train as train_module
from draftheads.training.data.records import DataError
from draftheads.training.evaluation import (FIXED_TREE, FIXED_TREE_16, eval_tree, evaluate_heads, is_better,
                                            load_eval_table, rank_scores, rank_table, tree_tau)
from draftheads.training.features import Features
from draftheads.training.recipe import load_recipe
from draftheads.training.recipe_sections import RecipeError
from draftheads.training.report import epoch_ended
from draftheads.training.resume import Curves, Progress
from draftheads.training.run_state import load_run_state, save_run_state

STEPS_PER_EPOCH = 12  # tiny_recipe: 40 training examples × 20 positions // batch 64


# -- pure parts ----------------------------------------------------------------------------------------------
def test_tree_tau_counts_the_deepest_matching_path_within_the_heads():
    ranks = torch.tensor([[0, 0, 0], [1, 0, 5], [0, 1, 0], [3, 3, 3]])
    # deepest hits: [0,0,0] (3; [0,0,0,0] needs a 4th head), [1,0] (2), [0,1] (2), none (0)
    assert tree_tau(ranks, FIXED_TREE) == pytest.approx(1 + 7 / 4)
    assert tree_tau(ranks, [[0]]) == pytest.approx(1 + 2 / 4)
    # the 16-node tree adds [0, 1, 0] (row 3) and [3] (row 4) to the 8-node one's hits
    assert tree_tau(ranks, FIXED_TREE_16) == pytest.approx(1 + 9 / 4)


def test_the_fixed_16_node_tree_is_the_8_node_one_grown_to_16_nodes_of_depth_4():
    assert len({tuple(p) for p in FIXED_TREE_16}) == 16 and max(map(len, FIXED_TREE_16)) == 4
    assert FIXED_TREE_16[: len(FIXED_TREE)] == FIXED_TREE
    assert all(p[:-1] in FIXED_TREE_16 for p in FIXED_TREE_16 if len(p) > 1)  # every node's parent is in the tree


def test_eval_tree_takes_budget_8_else_the_nearest_below_else_the_fixed_tree():
    a, b, c = [[0]], [[0], [1], [0, 0]], [[0], [0, 0], [0, 0, 0]]
    assert eval_tree({"3": a, "6": b, "12": c}) == ("6", b)
    assert eval_tree({"6": b, "8": c, "12": a}) == ("8", c)
    assert eval_tree({"12": c}) == ("fixed-8", FIXED_TREE)
    assert eval_tree({}) == ("fixed-8", FIXED_TREE)


def test_is_better_ranks_by_tau_then_head_1_top1_and_keeps_the_earlier_on_a_tie():
    first = {"tau": 2.0, "top1": [0.5, 0.1]}
    assert is_better(first, None)
    assert is_better({"tau": 2.0, "top1": [0.6, 0.0]}, first)
    assert not is_better({"tau": 2.0, "top1": [0.4, 0.9]}, first)
    assert is_better({"tau": 2.1, "top1": [0.1, 0.0]}, first)
    assert not is_better({"tau": 1.9, "top1": [0.9, 0.9]}, first)
    assert not is_better(dict(first), first)


def test_epoch_ends_at_the_step_that_runs_its_last_micro_batch_and_at_the_last_step():
    assert [s for s in range(1, 31) if epoch_ended(s, 1, 12, 30)] == [12, 24, 30]
    # 5 micro-batches an epoch, 2 per step: epoch 1 ends in step 3 (micro 4), epoch 2 in step 5 (micro 9)
    assert [s for s in range(1, 8) if epoch_ended(s, 2, 5, 7)] == [3, 5, 7]


def test_evaluate_heads_scores_the_table_and_each_group():
    heads = tiny_heads()  # 2 heads, stored trees of budgets 1 and 3
    generator = torch.Generator().manual_seed(0)
    heads.bind(torch.randn(96, 32, generator=generator, dtype=torch.float64),
               torch.randn(96, 32, generator=generator, dtype=torch.float64))
    table = Features(torch.randn(30, 32, generator=generator, dtype=torch.float64),
                     torch.randint(0, 96, (30, 9), generator=generator), torch.randint(0, 96, (30, 9), generator=generator))
    groups = {"mt_bench": torch.arange(0, 10), "spec_bench_dev": torch.arange(10, 30)}
    scores = evaluate_heads(heads, table, groups, dtype=torch.float64)
    ranks = rank_table(heads, table, "teacher", torch.float64)
    paths = heads.config.trees["3"]
    assert scores["tree"] == "3" and scores["positions"] == 30 and len(scores["top1"]) == 2
    assert {k: scores[k] for k in ("positions", "top1", "top5", "tau", "tau_fixed16")} == rank_scores(ranks, paths)
    assert scores["tau_fixed16"] == tree_tau(ranks, FIXED_TREE_16)  # whatever trees the heads store
    assert scores["groups"]["mt_bench"] == rank_scores(ranks[:10], paths)
    assert scores["groups"]["spec_bench_dev"] == rank_scores(ranks[10:], paths)
    assert scores["tau_search"] >= scores["tau"] - 1e-9  # the searched tree is at least as good on these ranks
    capped = evaluate_heads(heads, table, groups, dtype=torch.float64, max_positions=20)
    assert capped["positions"] == 20 and capped["groups"]["spec_bench_dev"]["positions"] == 10


def test_keep_best_needs_the_per_epoch_evaluation_and_a_missing_dev_table_is_one_line(tmp_path):
    with pytest.raises(RecipeError, match="run.keep_best .*run.eval_each_epoch: false"):
        load_recipe(None, ["--run.eval_each_epoch", "false"])
    recipe = load_recipe(None, ["--run.eval_each_epoch", "false", "--run.keep_best", "false"])
    assert not recipe.run.keep_best and load_eval_table(recipe, None, {}, None, None) is None  # unset: no dev table
    recipe = load_recipe(None, ["--data.eval_path", str(tmp_path / "nope.jsonl")])
    with pytest.raises(DataError, match="data.eval_path: .*nope.jsonl does not exist"):
        load_eval_table(recipe, None, {}, None, None)


def test_a_checkpoint_from_before_the_curves_still_resumes(tmp_path):
    progress = Progress()
    progress.step = 7
    save_run_state(tmp_path, {"progress": progress})
    restored, curves = Progress(), Curves()
    load_run_state(tmp_path, {"progress": restored, "curves": curves}, optional=("curves",))
    assert restored.step == 7 and curves.epochs == [] and curves.best is None


# -- runs on the tiny base ---------------------------------------------------------------------------------------
def test_each_epoch_is_evaluated_at_its_end_into_curves_report_and_card(tiny_setup, monkeypatch):
    from accelerate import Accelerator

    logged = []
    monkeypatch.setattr(Accelerator, "log", lambda self, values, step=None, log_kwargs=None: logged.append((step, values)))
    report = run_inprocess(tiny_recipe(tiny_setup, "epochs", train__epochs=2.5, run__eval_every=1000))
    out = tiny_setup / "epochs"
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    evaluated = [line["epoch_eval"] for line in lines if "epoch_eval" in line]
    assert [(e["epoch"], e["step"]) for e in evaluated] == [(1.0, 12), (2.0, 24), (2.5, 30)]
    losses = {line["step"]: line["loss"] for line in lines if "loss" in line}
    for (first, last), record in zip([(1, 12), (13, 24), (25, 30)], evaluated):
        assert record["train_loss"] == pytest.approx(sum(losses[s] for s in range(first, last + 1)) / (last - first + 1))
    tracked = [(step, values) for step, values in logged if "epoch" in values]  # what wandb gets
    assert [(step, values["epoch"]) for step, values in tracked] == [(12, 1.0), (24, 2.0), (30, 2.5)]
    for (_, values), record in zip(tracked, evaluated):
        assert values["epoch/train_loss"] == record["train_loss"]
        assert values["epoch/held_out/tau8"] == record["eval"]["held_out"]["tau"]
        assert values["epoch/held_out/tau_fixed16"] == record["eval"]["held_out"]["tau_fixed16"]
        assert [values[f"epoch/held_out/top1/head{h}"] for h in range(3)] == record["eval"]["held_out"]["top1"]
    curves = json.loads((out / "curves.json").read_text())
    assert set(curves) == {"epochs", "selection"} and curves["epochs"] == evaluated == report["curves"]
    for record in curves["epochs"]:
        assert set(record) == {"epoch", "step", "train_loss", "eval"} and set(record["eval"]) == {"held_out"}
        scores = record["eval"]["held_out"]
        assert set(scores) == {"tree", "positions", "top1", "top5", "tau", "tau_fixed16", "tau_search"}
        assert scores["tree"] == "fixed-8" and len(scores["top1"]) == len(scores["top5"]) == 3
        assert scores["positions"] == 160 and 1.0 <= scores["tau"] <= scores["tau_fixed16"] <= 4.0  # 8 nodes of the 16
    assert curves["selection"] == report["selection"] and report["selection"]["on"] == "held_out"
    for folder in (out, out / "final"):
        assert (folder / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = card_for_checkpoint(out / "final")
    assert "## Per-epoch evaluation" in card and "](curves.png)" in card
    table = [row for row in card.splitlines() if row.startswith("| 1") or row.startswith("| 2")]
    assert [row.split(" | ")[1] for row in table if row.count("|") == 6] == ["12", "24", "30"]
    assert f"These heads are epoch {report['selection']['epoch']:g}'s" in card


FAKE_TAU = {1.0: 2.0, 2.0: 2.5, 3.0: 1.5}  # epoch 2 is the best; epoch 3 is worse


@pytest.fixture
def scripted_tau(monkeypatch):
    """Each epoch's held-out τ replaced by FAKE_TAU (the rest of its scores are real)."""
    at = {}
    record_epoch, evaluate = train_module.record_epoch, report_module.evaluate_heads

    def recording(run, eval_sets, log):
        at["epoch"] = run.progress.step / STEPS_PER_EPOCH
        record_epoch(run, eval_sets, log)

    monkeypatch.setattr(train_module, "record_epoch", recording)
    monkeypatch.setattr(report_module, "evaluate_heads", lambda *a, **k: {**evaluate(*a, **k), "tau": FAKE_TAU[at["epoch"]]})


def selection_recipe(tiny_setup, name: str):
    return tiny_recipe(tiny_setup, name, train__epochs=3, run__checkpoint_every=12, run__keep_checkpoints=3,
                       run__eval_every=1000)


def test_the_final_checkpoint_holds_the_best_epochs_heads_also_after_a_resume(tiny_setup, scripted_tau, monkeypatch):
    whole = run_inprocess(selection_recipe(tiny_setup, "select"))
    out = tiny_setup / "select"
    assert [e["eval"]["held_out"]["tau"] for e in whole["curves"]] == [2.0, 2.5, 1.5]
    assert (whole["selection"]["epoch"], whole["selection"]["step"], whole["selection"]["tau"]) == (2.0, 24, 2.5)
    final = final_weights(out)
    at_epoch = {s: load_file(str(out / "checkpoints" / f"step-{s:07d}" / "model.safetensors")) for s in (12, 24)}
    assert all(torch.equal(final[k], at_epoch[24][k]) for k in final)
    assert not all(torch.equal(final[k], at_epoch[12][k]) for k in final)
    best = load_file(str(out / "best" / "model.safetensors"))
    assert all(torch.equal(final[k], best[k]) for k in final)
    assert json.loads((out / "best" / "selection.json").read_text())["epoch"] == 2.0

    # cut inside epoch 3 (after the step-24 checkpoint), then resumed: the same epochs, choice and heads
    after_step = train_module.after_step

    def cut(run, *args):
        paused = after_step(run, *args)
        if run.progress.step == 30:
            raise RuntimeError("cut")
        return paused

    recipe = selection_recipe(tiny_setup, "select-cut")
    monkeypatch.setattr(train_module, "after_step", cut)
    with pytest.raises(RuntimeError, match="cut"):
        run_inprocess(recipe)
    monkeypatch.setattr(train_module, "after_step", after_step)
    resumed = run_inprocess(recipe)
    assert resumed["curves"] == whole["curves"] and resumed["selection"] == whole["selection"]
    ours = final_weights(tiny_setup / "select-cut")
    assert all(torch.equal(ours[k], final[k]) for k in final)


def test_a_dev_table_with_groups_is_scored_every_epoch_and_chooses(tiny_setup):
    records = [json.loads(line) for line in (tiny_setup / "tokens.jsonl").read_text().splitlines()]
    dev = tiny_setup / "dev.jsonl"
    dev.write_text("".join(json.dumps({**r, "group": "mt_bench" if i < 4 else "spec_bench_dev"}) + "\n"
                           for i, r in enumerate(records[:10])))
    report = run_inprocess(tiny_recipe(tiny_setup, "dev", data__eval_path=str(dev), train__grad_accum=2,
                                       run__eval_every=1000))
    assert [e["step"] for e in report["curves"]] == [6, 12]  # 12 micro-batches an epoch, 2 a step
    for record in report["curves"]:
        scores = record["eval"]["dev"]
        assert set(record["eval"]) == {"held_out", "dev"} and scores["positions"] == 200
        assert {g: s["positions"] for g, s in scores["groups"].items()} == {"mt_bench": 80, "spec_bench_dev": 120}
    assert report["selection"]["on"] == "dev"
    assert list((tiny_setup / "features" / "dev").glob("*.safetensors"))  # cached beside the training features
