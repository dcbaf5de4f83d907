"""KOALA (arXiv 2408.08146) on top of Medusa and Hydra: the adversarial losses against
hand-computed values, a discriminator that learns against fixed heads and heads that learn
against a fixed discriminator, short joint runs that stay finite, λ = 0 ≡ the plain run bit
for bit (float64), and exact resume after a SIGKILL with the discriminator in the checkpoint."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from helpers import REPO, final_weights, kill_then_resume, launch_two_processes, run_inprocess, tiny_llama, tiny_recipe
from draftheads.heads import HeadConfig, build_heads
from draftheads.training.adversarial import (Adversary, Discriminator, adversarial_weight, expected_embedding,
                                             koala_label)
from draftheads.training.data.records import example_features, shifted_rows
from draftheads.training.features import Example
from draftheads.training.losses import (IGNORE, discriminator_bce, generator_adversarial, generator_objective,
                                        head_weights, r1_penalty, teacher_logits)
from draftheads.training.recipe import load_recipe
from draftheads.training.recipe_sections import AdversarialSection, RecipeError
from draftheads.training.objective import head_labels
from draftheads.training.head_forward import head_logits

LOG2 = math.log(2.0)


# -- pure functions ------------------------------------------------------------------------------------
def test_discriminator_bce_matches_hand_values():
    real = torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), 5.0]])
    fake = torch.tensor([[0.0, -math.log(3.0)], [0.0, 1.0]])
    labels = torch.tensor([[1, 4], [2, IGNORE]])  # (1, 1) is ignored
    loss, per_head = discriminator_bce(real, fake, labels, head_weights(2, 0.5))
    # BCE(x, 1) = log(1 + e^-x), BCE(x, 0) = log(1 + e^x)
    head0 = (2 * LOG2 + (math.log(4 / 3) + LOG2)) / 2
    head1 = math.log(4 / 3) + math.log(4 / 3)
    assert per_head.tolist() == pytest.approx([head0, head1])
    assert loss.item() == pytest.approx(head0 + 0.5 * head1)
    # global counts divide the same sums; one-sided smoothing s: REAL target 1 − s
    _, per_head = discriminator_bce(real, fake, labels, head_weights(2, 1.0), counts=torch.tensor([4.0, 2.0]))
    assert per_head.tolist() == pytest.approx([head0 / 2, head1 / 2])
    s = 0.1
    _, per_head = discriminator_bce(real[:1, 1:], fake[:1, 1:], labels[:1, 1:], head_weights(1, 1.0), smoothing=s)
    expected = -(1 - s) * math.log(0.75) - s * math.log(0.25) + math.log(4 / 3)  # σ(log 3) = 3/4
    assert per_head.item() == pytest.approx(expected)
    # chance level is 2·log 2, a head with no valid label adds 0
    assert discriminator_bce(torch.zeros(3, 1), torch.zeros(3, 1), torch.zeros(3, 1, dtype=torch.long),
                             head_weights(1, 1.0))[0].item() == pytest.approx(2 * LOG2)
    assert discriminator_bce(real, fake, torch.full((2, 2), IGNORE), head_weights(2, 1.0))[1].tolist() == [0.0, 0.0]


def test_generator_losses_match_hand_values():
    fake = torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), -2.0]])
    labels = torch.tensor([[0, 0], [0, IGNORE]])
    loss, per_head = generator_adversarial(fake, labels, head_weights(2, 0.5))
    head0 = (LOG2 - math.log(0.75)) / 2  # −log σ(0) = log 2, −log σ(log 3) = −log 3/4
    head1 = -math.log(0.75)
    assert per_head.tolist() == pytest.approx([head0, head1])
    assert loss.item() == pytest.approx(head0 + 0.5 * head1)
    supervised = torch.tensor(1.25, requires_grad=True)
    assert generator_objective(supervised, loss, 0.0) is supervised  # λ = 0: the very same graph
    assert generator_objective(supervised, None, 0.3) is supervised
    assert generator_objective(supervised, loss, 0.5).item() == pytest.approx(1.25 + 0.5 * loss.item())


def test_r1_penalty_matches_hand_values():
    x = torch.tensor([[[1.0, 2.0]], [[3.0, -1.0]]], requires_grad=True)  # (P=2, K=1, d=2)
    labels = torch.tensor([[0], [IGNORE]])
    scores = (x ** 2).sum(-1)  # ∂/∂x = 2x → ½‖2x‖² = 2‖x‖²
    loss, per_head = r1_penalty(scores, x, labels, head_weights(1, 1.0))
    assert per_head.item() == pytest.approx(2 * (1 + 4))
    loss.backward()  # the penalty keeps its graph (it trains the discriminator): d/dx 2‖x‖² = 4x on valid rows
    assert x.grad.flatten().tolist() == pytest.approx([4.0, 8.0, 0.0, 0.0])


def test_schedule_and_expected_embedding():
    assert [adversarial_weight(s, 0.2, warmup_steps=2) for s in range(4)] == [0.0, 0.0, 0.2, 0.2]
    ramp = [adversarial_weight(s, 0.2, 1, "linear", 4) for s in range(7)]
    assert ramp == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2, 0.2, 0.2])
    assert adversarial_weight(10, 0.0) == 0.0
    logits = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)  # p = (1/4, 3/4)
    weight = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    assert expected_embedding(logits, weight)[0].tolist() == pytest.approx([0.25, 1.5])
    assert koala_label("medusa") == "KOALA-Medusa" and koala_label("hydra") == "KOALA-Hydra"


def test_discriminator_init_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = Discriminator(8, 3, width=16, embedding_scale=0.5, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b, c = Discriminator(8, 3, width=16, seed=7), Discriminator(8, 3, width=16, seed=8)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.net[0].weight, c.net[0].weight)
    assert a(torch.zeros(5, 3, 8), torch.randn(5, 8)).shape == (5, 3)


# -- recipes -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["medusa", "hydra"])
def test_shipped_koala_recipes_validate(family):
    recipe = load_recipe(REPO / "recipes" / f"koala-{family}-smollm2.yaml")
    plain = load_recipe(REPO / "recipes" / f"{family}-smollm2.yaml")
    assert recipe.heads.family == family and recipe.heads.num_layers == 2
    assert recipe.adversarial.enabled and 0 < recipe.adversarial.weight and recipe.adversarial.warmup_steps > 0
    # KOALA over a family trains on that family's data with its loss: the comparison isolates KOALA's changes
    assert recipe.data == plain.data and recipe.data.kind == "job" and recipe.loss == plain.loss
    assert recipe.run.output_dir == f"runs/koala-{family}-smollm2"
    assert "adversarial" in recipe.identity() and "adversarial" not in plain.identity()  # old runs still resume


@pytest.mark.parametrize("override, message", [
    (["--adversarial.label_smoothing", "0.6"], r"adversarial\.label_smoothing must be in \[0, 0\.5\)"),
    (["--adversarial.schedule", "linear"], r"adversarial\.schedule=linear needs adversarial\.ramp_steps ≥ 1"),
    (["--adversarial.schedule", "cosine"], r"adversarial\.schedule must be one of"),
    (["--adversarial.disc_lr", "0"], r"adversarial\.disc_lr must be > 0"),
    (["--adversarial.disc_steps", "0"], r"adversarial\.disc_steps must be ≥ 1"),
    (["--adversarial.weight", "-0.1"], r"adversarial\.weight must be ≥ 0"),
    (["--adversarial.ramp_steps", "5"], r"ramp_steps=5 only applies to schedule: linear"),
    (["--adversarial.enabled", "maybe"], r"adversarial\.enabled must be bool"),
])
def test_adversarial_section_errors_name_the_key(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(None, override)


# -- the adversarial game on a tiny model -------------------------------------------------------------------
def tiny_game(family: str):
    """Fixed positions of a tiny float64 Llama, fresh heads and the REAL/FAKE inputs of the discriminator."""
    base = tiny_llama(0, dtype=torch.float64)
    generator = torch.Generator().manual_seed(3)
    examples = [Example(torch.randint(3, 96, (24,), generator=generator).tolist(), 4) for _ in range(12)]
    table = example_features(base, examples)
    table.hidden = table.hidden.double()
    torch.manual_seed(0)
    heads = build_heads(HeadConfig(family=family, num_heads=3, num_layers=2, hidden_size=32, vocab_size=96))
    heads = heads.double().bind(base.get_output_embeddings().weight, base.get_input_embeddings().weight)
    rows = torch.arange(len(table))
    next_rows = shifted_rows(table.targets, 3)
    labels = head_labels(table, rows, heads, "teacher")
    weight = heads.draft_weight()
    real = expected_embedding(teacher_logits(table.hidden[next_rows.clamp(min=0)], weight), weight)
    return heads, table, rows, labels, real, weight


@pytest.mark.parametrize("family", ["medusa", "hydra"])
def test_discriminator_learns_against_fixed_heads_and_heads_learn_against_fixed_discriminator(family):
    heads, table, rows, labels, real, weight = tiny_game(family)
    section = AdversarialSection(enabled=True, disc_lr=3e-3, disc_hidden=64)
    adversary = Adversary(section, 32, 3, weight, seed=0, device="cpu", dtype=torch.float64)
    context = table.hidden[rows]
    with torch.no_grad():
        fake = expected_embedding(head_logits(heads, table, rows, 3, "cpu", torch.float64)[0], weight)
    d_losses = [float(adversary.train_discriminator(real, fake, context, labels)["d_loss"].mean())
                for _ in range(150)]
    assert d_losses[0] == pytest.approx(2 * LOG2, abs=0.3)  # about chance at init
    assert d_losses[-1] < 0.5 * d_losses[0]
    # now the discriminator is fixed and the heads train on −log D(fake) alone
    optimizer = torch.optim.Adam(heads.parameters(), lr=1e-2)
    weights = head_weights(3, 1.0)
    frozen = {k: v.clone() for k, v in adversary.discriminator.state_dict().items()}
    adversary.optimizer.zero_grad(set_to_none=True)
    g_losses = []
    for _ in range(60):
        fake = expected_embedding(head_logits(heads, table, rows, 3, "cpu", torch.float64)[0], weight)
        loss, _ = adversary.generator_loss(fake, context, labels, weights)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        g_losses.append(loss.item())
    assert g_losses[-1] < 0.5 * g_losses[0]
    assert all(p.grad is None for p in adversary.discriminator.parameters())  # nothing leaked into D
    assert all(torch.equal(v, frozen[k]) for k, v in adversary.discriminator.state_dict().items())


# -- through the trainer ----------------------------------------------------------------------------------
def koala_recipe(root: Path, run: str, adversarial: dict | None, **over) -> Path:
    """tiny_recipe (float64, CPU) plus an adversarial section."""
    path = tiny_recipe(root, run, **over)
    if adversarial is not None:
        recipe = yaml.safe_load(path.read_text())
        recipe["adversarial"] = adversarial
        path.write_text(yaml.safe_dump(recipe))
    return path


def log_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", ["medusa", "hydra"])
def test_weight_zero_reproduces_the_plain_run_exactly(tiny_setup, family):
    """The discriminator is built and trained (2 steps per batch, R1), the heads see none of it:
    weights bitwise equal to the plain run, with input noise drawing from the global RNG, and
    (hydra) kl_weight 0 so the teacher is computed for the discriminator only."""
    over = dict(heads__family=family, heads__num_layers=2, loss__noise_alpha=0.5, run__checkpoint_every=1000)
    if family == "hydra":
        over["loss__kl_weight"] = 0.0
    plain = run_inprocess(koala_recipe(tiny_setup, f"plain-{family}", None, **over))
    zero = run_inprocess(koala_recipe(tiny_setup, f"zero-{family}", {
        "enabled": True, "weight": 0.0, "disc_steps": 2, "grad_penalty": 1.0, "label_smoothing": 0.1,
        "disc_lr": 1e-3}, **over))
    assert zero["steps"] == plain["steps"] and zero["final_loss"] == plain["final_loss"]
    ours, theirs = final_weights(tiny_setup / f"zero-{family}"), final_weights(tiny_setup / f"plain-{family}")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    records = [r for r in log_records(tiny_setup / f"zero-{family}") if "loss" in r]
    d_losses = [r["d_loss/head0"] for r in records]
    assert d_losses[-1] < d_losses[0]  # the discriminator did train
    assert all(r["adv_weight"] == 0.0 for r in records) and "adv/head2" in records[-1]


@pytest.mark.parametrize("family", ["medusa", "hydra"])
def test_joint_run_stays_finite_and_labels_the_checkpoint(tiny_setup, family):
    run = f"joint-{family}"
    report = run_inprocess(koala_recipe(tiny_setup, run, {
        "enabled": True, "weight": 0.5, "schedule": "linear", "warmup_steps": 3, "ramp_steps": 5, "disc_lr": 1e-3,
        "disc_hidden": 32, "grad_penalty": 0.5}, heads__family=family, heads__num_layers=2, train__epochs=3,
        run__checkpoint_every=1000))
    records = [r for r in log_records(tiny_setup / run) if "loss" in r]
    assert len(records) == report["steps"] > 20
    values = [v for r in records for k, v in r.items() if k != "step"]
    assert all(math.isfinite(v) for v in values)
    assert [r["adv_weight"] for r in records[:4]] == pytest.approx([0.0, 0.0, 0.0, 0.1])
    assert records[-1]["adv_weight"] == 0.5
    assert records[-1]["loss"] < records[0]["loss"]  # supervised + λ·adv still goes down
    assert all(0.0 <= r["d_acc/head0"] <= 1.0 for r in records)
    config = json.loads((tiny_setup / run / "final" / "config.json").read_text())
    koala = config["extra"]["koala"]
    assert koala["label"] == koala_label(family) and koala["layers"] == 2 and koala["adversarial_weight"] == 0.5
    assert not any("discriminator" in k or k.startswith("net.") for k in final_weights(tiny_setup / run))
    card = (tiny_setup / run / "final" / "README.md").read_text()
    assert f"# {koala_label(family)} heads" in card and "KOALA (arXiv 2408.08146): K = 2-layer heads" in card
    from draftheads.decoding import DraftHeadsModel

    model = DraftHeadsModel.from_pretrained(tiny_setup / run / "final", base=tiny_llama(0, dtype=torch.float64))
    assert model.heads.family == family and model.heads.config.koala.label == koala_label(family)


def test_sigkill_then_resume_with_adversarial_matches_uninterrupted_run(tiny_setup):
    """Discriminator weights and its Adam state are in every checkpoint: a KOALA-Hydra run killed
    between checkpoints and resumed ends with the same weights (float64) as an uninterrupted one."""
    adversarial = {"enabled": True, "weight": 0.3, "warmup_steps": 2, "disc_lr": 1e-3, "disc_steps": 2,
                   "grad_penalty": 0.5, "label_smoothing": 0.1}
    over = dict(heads__family="hydra", heads__num_layers=2, loss__noise_alpha=0.3)
    reference = run_inprocess(koala_recipe(tiny_setup, "koala-whole", adversarial, **over))
    recipe = koala_recipe(tiny_setup, "koala-killed", adversarial, **over)
    kill_at = reference["steps"] // 2 + 3
    assert kill_at % 4 != 0 and kill_at < reference["steps"]
    run_dir = tiny_setup / "koala-killed"

    def discriminator_saved(checkpoint: Path) -> None:
        # in draftheads' own state files (safetensors + JSON, never pickled), not custom_checkpoint_<i>.pkl
        state = json.loads((checkpoint / "draftheads_state.json").read_text())
        assert {"discriminator", "discriminator_optimizer"} <= set(state)
        assert (checkpoint / "draftheads_state.safetensors").is_file()

    report = kill_then_resume(tiny_setup, recipe, run_dir, kill_at, discriminator_saved)
    assert report["steps"] == reference["steps"]
    assert report["final_loss"] == pytest.approx(reference["final_loss"], abs=1e-9, rel=0)
    ours, theirs = final_weights(run_dir), final_weights(tiny_setup / "koala-whole")
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-9
    # the logged discriminator loss of the resumed steps matches too (its state was restored)
    whole = {r["step"]: r for r in log_records(tiny_setup / "koala-whole") if "loss" in r}
    again = {r["step"]: r for r in log_records(run_dir) if "loss" in r}
    assert again.keys() == whole.keys()
    assert max(abs(again[s]["d_loss/head1"] - whole[s]["d_loss/head1"]) for s in whole) < 1e-9


def test_contextual_family_with_bf16_autocast_and_accumulation_stays_finite(tiny_setup):
    """KOALA-Hydra++ (heads read sequence chunks), float32 heads under bf16 autocast, 2 micro-steps
    per optimizer step: the discriminator path runs and every logged value stays finite."""
    run = "koala-hydrapp-bf16"
    report = run_inprocess(koala_recipe(tiny_setup, run, {
        "enabled": True, "weight": 0.2, "disc_hidden": 32, "disc_lr": 1e-3, "grad_penalty": 1.0},
        heads__family="hydra++", heads__extra={"prefix_heads": 2}, train__batch_size=4, train__chunk_length=8,
        train__grad_accum=2, train__mixed_precision="bf16", train__dtype="float32", run__checkpoint_every=1000,
        run__save_dtype="float32"))
    records = [r for r in log_records(tiny_setup / run) if "loss" in r]
    assert len(records) == report["steps"] > 0
    assert all(math.isfinite(v) for r in records for v in r.values())
    assert records[-1]["adv_weight"] == pytest.approx(0.2)
    assert json.loads((tiny_setup / run / "final" / "config.json").read_text())["extra"]["koala"]["label"] == \
        "KOALA-Hydra++"


def test_two_gloo_processes_equal_one_process_with_double_batch_adversarial(tiny_setup):
    """The discriminator's losses are normalized by the global label count and its gradients
    summed over processes, so 2 processes × batch 32 == 1 process × batch 64 with KOALA too."""
    adversarial = {"enabled": True, "weight": 0.3, "disc_lr": 1e-3, "grad_penalty": 0.5, "label_smoothing": 0.1}
    over = dict(heads__family="medusa", heads__num_layers=2, run__checkpoint_every=1000)
    single = run_inprocess(koala_recipe(tiny_setup, "koala-one", adversarial, **over))
    recipe = koala_recipe(tiny_setup, "koala-two", adversarial, train__batch_size=32, **over)
    report = launch_two_processes(tiny_setup, recipe, tiny_setup / "koala-two", port=29519)
    assert report["processes"] == 2 and report["steps"] == single["steps"]
    assert report["final_loss"] == pytest.approx(single["final_loss"], abs=1e-9, rel=0)
    ours, theirs = final_weights(tiny_setup / "koala-two"), final_weights(tiny_setup / "koala-one")
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-9
    one = {r["step"]: r for r in log_records(tiny_setup / "koala-one") if "loss" in r}
    two = {r["step"]: r for r in log_records(tiny_setup / "koala-two") if "loss" in r}
    assert max(abs(one[s][m] - two[s][m]) for s in one for m in ("d_loss/head0", "d_acc/head1", "adv/head2")) < 1e-9
