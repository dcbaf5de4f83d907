"""The training framework: losses against hand-computed values, recipe validation, clear data
errors, exact resume after a real SIGKILL, and 2-process (gloo) == 1 process × doubled batch."""
from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import (RECIPES, REPO, final_weights, kill_then_resume, launch_two_processes, run_inprocess,
                     tiny_llama, tiny_recipe)
from draftheads.training.data.records import DataError, load_examples, shifted_rows
from draftheads.training.losses import (IGNORE, distill_loss, head_cross_entropy, head_targets, head_weights, input_noise,
                                        label_ranks, mask_labels, teacher_kl, topk_accuracy)
from draftheads.training.recipe import load_recipe
from draftheads.training.recipe_sections import RecipeError


# -- losses -----------------------------------------------------------------------------------------
def test_head_cross_entropy_weighted_and_normalized_by_given_counts():
    logits = torch.zeros(2, 2, 4)
    logits[0, 0, 1] = math.log(3.0)  # p(1) = 3/6
    labels = torch.tensor([[1, 2], [IGNORE, 3]])
    loss, per_head = head_cross_entropy(logits, labels, head_weights(2, 0.5))
    assert per_head.tolist() == pytest.approx([-math.log(0.5), math.log(4.0)])
    assert loss.item() == pytest.approx(-math.log(0.5) + 0.5 * math.log(4.0))
    # a global count (other processes' labels) divides the same sums
    _, per_head = head_cross_entropy(logits, labels, head_weights(2, 0.5), counts=torch.tensor([2.0, 4.0]))
    assert per_head.tolist() == pytest.approx([-math.log(0.5) / 2, 2 * math.log(4.0) / 4])
    # a head without any valid label adds 0, not NaN
    _, per_head = head_cross_entropy(logits, torch.full((2, 2), IGNORE), head_weights(2, 0.5))
    assert per_head.tolist() == [0.0, 0.0]


def test_teacher_kl_matches_hand_value_and_masks():
    student = torch.zeros(2, 1, 2)  # p = (1/2, 1/2)
    teacher = torch.tensor([[[math.log(3.0), 0.0]], [[5.0, -5.0]]])  # row 0: p = (3/4, 1/4)
    labels = torch.tensor([[0], [IGNORE]])  # row 1 has no valid position: ignored
    loss, per_head = teacher_kl(student, teacher, labels, head_weights(1, 0.8))
    expected = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert per_head.item() == pytest.approx(expected) and loss.item() == pytest.approx(expected)
    # T = 2 halves both logit vectors and scales by T²
    t2 = 0.5 * math.log(3.0)
    p = (math.exp(t2) / (math.exp(t2) + 1), 1 / (math.exp(t2) + 1))
    _, per_head = teacher_kl(student, teacher, labels, head_weights(1, 1.0), temperature=2.0)
    assert per_head.item() == pytest.approx(4 * (p[0] * math.log(p[0] / 0.5) + p[1] * math.log(p[1] / 0.5)))
    assert teacher_kl(teacher, teacher, labels, head_weights(1, 1.0))[0].item() == pytest.approx(0.0, abs=1e-7)


def _reference_distill(logits, teacher, labels, weights, counts, ce_weight, kl_weight, temperature):
    """The objective written the plain autograd way: what :func:`distill_loss` must equal."""
    valid = labels != IGNORE
    log_p = torch.log_softmax(logits, -1)
    ce = -log_p.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    log_q, log_t = torch.log_softmax(logits / temperature, -1), torch.log_softmax(teacher / temperature, -1)
    kl = (log_t.exp() * (log_t - log_q)).sum(-1) * temperature ** 2
    per = [torch.where(valid, x, torch.zeros_like(x)).sum(0) / counts.clamp(min=1) for x in (ce, kl)]
    return ce_weight * (per[0] * weights).sum() + kl_weight * (per[1] * weights).sum(), per


@pytest.mark.parametrize("ce_weight,kl_weight,temperature", [(1.0, 0.0, 1.0), (0.0, 1.0, 2.0), (1.0, 0.5, 1.0)])
def test_distill_loss_value_and_gradient_equal_autograd(ce_weight, kl_weight, temperature, monkeypatch):
    """The blockwise closed-form loss (values, per-head means, gradient) equals autograd through
    the same formulas, across several row blocks and with IGNORE labels and a global count."""
    import draftheads.training.losses as losses

    monkeypatch.setattr(losses, "LOSS_BLOCK_ROWS", 3)  # 7 rows: blocks of 3, 3, 1
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 2, 11, generator=g, dtype=torch.float64) * 3
    teacher = torch.randn(7, 2, 11, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, 11, (7, 2), generator=g)
    labels[[1, 4, 6], [0, 1, 1]] = IGNORE
    weights, counts = head_weights(2, 0.8).double(), torch.tensor([9.0, 5.0])
    mine = logits.clone().requires_grad_()
    loss, per_head = distill_loss(mine, labels, weights, counts, ce_weight, kl_weight, teacher, temperature)
    ref_logits = logits.clone().requires_grad_()
    ref, ref_per = _reference_distill(ref_logits, teacher, labels, weights, counts.double(), ce_weight, kl_weight,
                                      temperature)
    (3.0 * loss).backward()
    (3.0 * ref).backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    for name, weight, expected in (("ce", ce_weight, ref_per[0]), ("kl", kl_weight, ref_per[1])):
        # a term with weight 0 is not computed: its means read 0
        assert per_head[name].tolist() == pytest.approx((expected if weight else 0 * expected).tolist(), rel=1e-12)
    assert torch.allclose(mine.grad, ref_logits.grad, rtol=1e-10, atol=1e-12)
    assert mine.grad[6, 1].abs().max() == 0  # an IGNORE label adds nothing
    with pytest.raises(ValueError, match="needs teacher_logits"):
        distill_loss(logits, labels, weights, counts, 1.0, 1.0)


def test_weights_targets_masks_noise_ranks():
    assert head_weights(3, 0.8).tolist() == pytest.approx([1.0, 0.8, 0.64])
    targets = torch.tensor([[5, 7, -1], [9, 5, 5]])
    assert head_targets(targets, torch.tensor([5, 9]), 10, 3).tolist() == [[0, IGNORE, IGNORE], [1, 0, 0]]
    assert mask_labels(torch.tensor([[1, 2]]), torch.tensor([[True, False]])).tolist() == [[1, IGNORE]]
    hidden = torch.zeros(1000, 16)
    assert input_noise(hidden, 0.0) is hidden
    noisy = input_noise(hidden, 2.0, torch.Generator().manual_seed(0))
    assert noisy.abs().max() <= 2.0 / 4 and noisy.abs().max() > 0.45  # U(-1,1)·α/√d, d = 16
    logits = torch.tensor([[[0.1, 0.9, 0.5]], [[0.3, 0.2, 0.1]]])
    ranks = label_ranks(logits, torch.tensor([[2], [IGNORE]]), cap=2)
    assert ranks.tolist() == [[1], [2]]
    assert topk_accuracy(ranks, (1, 2)) == {"top1": [0.0], "top2": [0.5]}


def test_shifted_rows_point_at_the_teacher_position_of_the_same_sequence():
    # two sequences: rows 0..2 then 3..4; targets column 0 = x_{t+1}, -1 past the end
    targets = torch.tensor([[4, 5, 6, -1], [5, 6, -1, -1], [6, -1, -1, -1], [8, 9, -1, -1], [9, -1, -1, -1]])
    assert shifted_rows(targets, 2).tolist() == [[1, 2], [2, -1], [-1, -1], [4, -1], [-1, -1]]


# -- recipes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(p.stem for p in RECIPES.glob("*.yaml")))
def test_shipped_recipes_validate(name):
    recipe = load_recipe(RECIPES / f"{name}.yaml")
    assert recipe.name == name


def test_recipe_errors_name_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lrr: 0.1\n")
    with pytest.raises(RecipeError, match=r"Unknown recipe key train\.lrr"):
        load_recipe(bad)
    bad.write_text("train:\n  batch_size: many\n")
    with pytest.raises(RecipeError, match=r"train\.batch_size must be int"):
        load_recipe(bad)
    bad.write_text("loss:\n  labels: gold\n")
    with pytest.raises(RecipeError, match=r"loss\.labels must be one of"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="Unknown recipe key nope"):
        load_recipe(None, ["--nope", "1"])
    with pytest.raises(RecipeError, match=r"train\.epochs must be float"):
        load_recipe(None, ["--epochs", "three"])
    recipe = load_recipe(None, ["--train.lr", "5e-4", "--num_heads=3", "--mixed_precision", "no"])
    assert recipe.train.lr == 5e-4 and recipe.heads.num_heads == 3 and recipe.train.mixed_precision == "no"


# -- the trainer on a tiny model -----------------------------------------------------------------------


def test_sigkill_mid_epoch_then_resume_matches_uninterrupted_run(tiny_setup):
    """A run SIGKILLed between checkpoints and resumed ends with the same loss and weights (float64)."""
    reference = run_inprocess(tiny_recipe(tiny_setup, "whole"))
    recipe = tiny_recipe(tiny_setup, "killed")
    steps_per_epoch = reference["steps"] // 2
    kill_at = steps_per_epoch + 3  # mid-epoch 2, after the checkpoint of a multiple of 4 steps
    assert kill_at % 4 != 0 and kill_at < reference["steps"]
    run_dir = tiny_setup / "killed"
    report = kill_then_resume(tiny_setup, recipe, run_dir, kill_at)
    assert report["steps"] == reference["steps"]
    assert report["final_loss"] == pytest.approx(reference["final_loss"], abs=1e-6, rel=0)
    ours, theirs = final_weights(run_dir), final_weights(tiny_setup / "whole")
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-6
    steps = [r["step"] for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == list(range(1, reference["steps"] + 1))  # the killed run's extra lines were dropped
    # the heads load like any checkpoint, for the base they were trained on
    from draftheads.decoding import DraftHeadsModel

    model = DraftHeadsModel.from_pretrained(run_dir / "final", base=tiny_llama(0, dtype=torch.float64))
    assert model.heads.family == "medusa" and set(model.heads.config.trees) == {"1", "3"}


def test_resume_refuses_another_recipe_and_data_errors_are_clear(tiny_setup, tmp_path):
    run = tiny_recipe(tiny_setup, "other")
    (tiny_setup / "other").mkdir(exist_ok=True)
    (tiny_setup / "other" / "recipe.json").write_text(json.dumps(load_recipe(run, ["--lr", "0.5"]).identity()))
    with pytest.raises(RecipeError, match=r"different recipe \(train\.lr: 0\.5 → 0\.01\)"):
        run_inprocess(run)
    no_column = tmp_path / "prompts.jsonl"
    no_column.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(DataError, match="no column 'messages' needed for data kind 'conversations'"):
        load_examples("conversations", no_column)
    with pytest.raises(DataError, match="no column 'response_ids'"):
        load_examples("selfdistill", no_column)


def test_two_gloo_processes_equal_one_process_with_double_batch(tiny_setup):
    """accelerate launch (2 CPU processes, gloo) × batch 32 == 1 process × batch 64."""
    single = run_inprocess(tiny_recipe(tiny_setup, "one", run__checkpoint_every=1000))
    recipe = tiny_recipe(tiny_setup, "two", train__batch_size=32, run__checkpoint_every=1000)
    report = launch_two_processes(tiny_setup, recipe, tiny_setup / "two", port=29517)
    assert report["processes"] == 2 and report["steps"] == single["steps"]
    assert report["final_loss"] == pytest.approx(single["final_loss"], abs=1e-9, rel=0)
    ours, theirs = final_weights(tiny_setup / "two"), final_weights(tiny_setup / "one")
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-9


def test_cli_train_subcommand_passes_recipe_and_overrides(monkeypatch):
    import draftheads.training.train as train_module
    from draftheads.cli import main

    seen = {}
    monkeypatch.setattr(train_module, "train", lambda recipe: seen.setdefault("recipe", recipe) and {})
    assert main(["train", str(RECIPES / "hydra-smollm2.yaml"), "--train.lr", "2e-4", "--num_heads=3"]) == 0
    assert seen["recipe"].heads.family == "hydra" and seen["recipe"].train.lr == 2e-4
    assert seen["recipe"].heads.num_heads == 3
    assert main(["train", str(RECIPES / "hydra-smollm2.yaml"), "--train.lrr", "1"]) == 2  # named error, no run


@pytest.mark.parametrize("name", ["cpu", "single_gpu", "multi_gpu", "multi_cpu", "deepspeed_zero2", "deepspeed_zero3"])
def test_accelerate_configs_are_valid(name):
    """Every accelerate config parses as accelerate's own config class; DeepSpeed ones point at
    a DeepSpeed JSON with the ZeRO stage their name promises and batch sizes left to the trainer."""
    from accelerate.commands.config.config_args import ClusterConfig

    path = RECIPES / "accelerate" / f"{name}.yaml"
    config = ClusterConfig.from_yaml_file(str(path))
    if name.startswith("deepspeed"):
        ds_file = REPO / config.deepspeed_config["deepspeed_config_file"]
        ds = json.loads(ds_file.read_text())
        assert ds["zero_optimization"]["stage"] == int(name[-1])
        assert ds["train_micro_batch_size_per_gpu"] == "auto" and ds["gradient_accumulation_steps"] == "auto"


def test_contextual_family_trains_on_sequence_chunks_and_decodes_identically(tiny_setup):
    """Hydra++ (prefix layer over the context): the framework feeds it whole sequence chunks
    (batch_size counts chunks), KL + CE fall, and the saved heads decode token-identically."""
    from draftheads.decoding import DraftHeadsModel
    from draftheads.training.batches import chunk_rows, sequence_chunks
    from draftheads.training.features import Features

    report = run_inprocess(tiny_recipe(
        tiny_setup, "hydrapp", heads__family="hydra++", heads__extra={"prefix_heads": 2}, train__batch_size=4,
        train__chunk_length=8, train__epochs=3, run__checkpoint_every=1000))
    log = [json.loads(line) for line in (tiny_setup / "hydrapp" / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert losses[-1] < 0.9 * losses[0]
    assert report["steps"] > 0 and report["train_positions_seen"] > 0
    targets = torch.full((7, 2), 5)
    targets[[2, 6], 1] = -1  # two examples: rows 0-2 and 3-6
    table = Features(torch.zeros(7, 4), targets, targets)
    assert sequence_chunks(table, 2) == [(0, 2), (2, 3), (3, 5), (5, 7)]
    assert sequence_chunks(table, 0) == [(0, 3), (3, 7)]  # 0: whole sequences, never truncated
    bounded = Features(torch.zeros(7, 4), torch.full((7, 2), -1), torch.full((7, 2), -1), torch.tensor([[0, 4], [4, 7]]))
    assert sequence_chunks(bounded, 3) == [(0, 3), (3, 4), (4, 7)]  # unlabelled rows: the bounds decide
    assert chunk_rows([(0, 2), (2, 3)]).tolist() == [[0, 1], [2, -1]]
    model = tiny_llama(0, dtype=torch.float64)
    drafter = DraftHeadsModel.from_pretrained(tiny_setup / "hydrapp" / "final", base=model, tree=3)
    assert drafter.heads.family == "hydra++"
    prompt = torch.tensor([[5, 9, 33, 4]])
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False)
    assert drafter.generate(prompt, max_new_tokens=24).tolist() == reference.tolist()
    assert drafter.last_stats.tau > 1.0  # the trained heads get drafts accepted on their own data


def test_source_selection_caps_and_filters():
    from draftheads.training.data.records import select_sources

    sources = ["gsm8k-train", "t0:a", "gsm8k-train", "roleplay", "t0:b", "gsm8k-train", "code"]
    assert select_sources(sources) == list(range(7))
    assert select_sources(sources, caps={"gsm8k": 2, "t0": 1}) == [0, 1, 2, 3, 6]
    assert select_sources(sources, keep=["t0", "code"]) == [1, 4, 6]
    assert select_sources(sources, keep=["gsm8k"], caps={"gsm8k": 0}) == []
