"""Every position trained, the base's distribution as target (issue 66, item 2): the job keeps the
base's own choice after every token (``predicted.npy``, the argmax of its LM head over the final
states its forward computed), prompt positions join the training rows labelled with it (never with
the user's text), answer rows keep their labels, a run with ``data.prompt_positions`` trains more
rows than one without, and the KL term may be restricted to the teacher's top-K (HASS), its
closed-form gradient checked numerically. Every refusal is one line."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from helpers import final_weights, run_inprocess, tiny_distill_setup, tiny_job_args, tiny_recipe
from draftheads.heads import HeadConfig, build_heads
from draftheads.training.data import distill_job
from draftheads.training.data.distill_shards import ShardError
from draftheads.training.data.job_data import answer_rows, job_table
from draftheads.training.features import MAX_TARGETS, shift_targets
from draftheads.training.losses import IGNORE, distill_loss, head_weights
from draftheads.training.objective import head_labels
from draftheads.training.preflight import preflight
from draftheads.training.recipe import load_recipe
from draftheads.training.recipe_sections import RecipeError

SEQUENCES = 24


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A job the decoder answered (``job/``), its ids exported (``ids/``), the same ids rebuilt
    (``rebuilt/``), and a copy of the rebuild as shards made before predictions were kept
    (``old/``: no predicted.npy, no manifest key)."""
    root = tmp_path_factory.mktemp("prompt-positions")
    model, _ = tiny_distill_setup(root, SEQUENCES, seed=3)
    args = tiny_job_args(root)
    assert distill_job.main(args) == 0
    assert distill_job.main(["--out", str(root / "job"), "--export", str(root / "ids")]) == 0
    assert distill_job.main(rebuild_args(root, "rebuilt")) == 0
    shutil.copytree(root / "rebuilt", root / "old")
    strip_predictions(root / "old")
    fp = distill_job.Job(distill_job.parse_args(args)).fingerprint
    return root, model, fp


def rebuild_args(root, out: str, *more: str) -> list[str]:
    return ["--from-tokens", str(root / "ids"), "--out", str(root / out), "--base", str(root / "base"),
            "--dtype", "float64", *more]


def strip_predictions(job_folder) -> None:
    for folder in sorted((job_folder / "shards").glob("shard-*")):
        (folder / "predicted.npy").unlink()
        manifest = json.loads((folder / "manifest.json").read_text())
        del manifest["predicted"]
        (folder / "manifest.json").write_text(json.dumps(manifest))


def base_argmax(model, sequence) -> np.ndarray:
    """The base's own choice after every token of one plain forward (no padding)."""
    with torch.no_grad():
        return model(torch.tensor([[int(t) for t in sequence]])).logits[0].argmax(-1).numpy()


def one_line(err) -> str:
    text = str(err.value) if hasattr(err, "value") else str(err)
    assert "\n" not in text.strip(), text
    return text


# -- the job keeps the base's predictions ----------------------------------------------------------------------
@pytest.mark.parametrize("folder", ["rebuilt", "job"])
def test_predicted_is_the_base_argmax_after_every_token(job, folder):
    root, model, fp = job
    shards = distill_job.open_job(root / folder, fp, "float64", predicted=True)
    compared = 0
    for number, shard in enumerate(shards):
        manifest = json.loads((root / folder / "shards" / f"shard-{number:05d}" / "manifest.json").read_text())
        assert manifest["predicted"] is True and shard.predicted.dtype == np.int32
        assert shard.predicted.shape == (manifest["tokens"],)
        for k in range(len(shard)):
            first, end = int(shard.offsets[k]), int(shard.offsets[k + 1])
            got, sequence = shard.predicted[first:end], shard.sequence(k)
            assert got[-1] == -1  # nothing follows the last token
            assert np.array_equal(got[:-1], base_argmax(model, sequence)[:-1])
            start = int(shard.answer_starts[k])  # on the base's own greedy answer, its choice is the answer
            assert np.array_equal(got[start - 1: -1], sequence[start:].astype(np.int32))
            compared += end - first - 1
    assert compared > 200


def test_shards_without_predictions_serve_answers_and_a_rebuild_with_predicted_adds_them(job, tmp_path, capsys):
    root, _, fp = job
    old = distill_job.open_job(root / "old", fp, "float64")  # answer-only training reads them as before
    assert old[0].predicted is None
    assert torch.equal(job_table(old).targets, job_table(distill_job.open_job(root / "rebuilt", fp, "float64")).targets)
    with pytest.raises(ShardError) as err:
        distill_job.open_job(root / "old", fp, "float64", predicted=True)
    assert re.search(r"shard-00000: it holds no predicted\.npy \(the base's own prediction after every token.*\); "
                     r"rebuild it: `python -m draftheads\.training\.data\.distill_job --from-tokens .* --predicted`",
                     one_line(err))
    again = shutil.copytree(root / "old", tmp_path / "again")
    capsys.readouterr()
    assert distill_job.main(rebuild_args(root, str(again))) == 0  # without --predicted: good shards are kept
    assert "rebuilding" not in capsys.readouterr().out
    assert not (again / "shards" / "shard-00000" / "predicted.npy").exists()
    assert distill_job.main(rebuild_args(root, str(again), "--predicted")) == 0
    assert capsys.readouterr().out.count("it holds no predicted.npy") == 3
    rebuilt = distill_job.open_job(again, fp, "float64", predicted=True)
    for a, b in zip(rebuilt, distill_job.open_job(root / "rebuilt", fp, "float64", predicted=True)):
        assert np.array_equal(a.predicted, b.predicted)
    # a bad shard holding predicted.npy is the job's own files: replaced, not refused as someone else's
    hidden = again / "shards" / "shard-00001" / "hidden.npy"
    hidden.write_bytes(hidden.read_bytes()[:100])
    capsys.readouterr()
    assert distill_job.main(rebuild_args(root, str(again))) == 0
    assert "shard-00001: hidden.npy is truncated" in capsys.readouterr().out
    assert distill_job.open_job(again, fp, "float64", predicted=True)[1].predicted is not None
    # --predicted is for a rebuild from token ids: anything else is one line, before a file is written
    assert distill_job.main(["--out", str(tmp_path / "bad"), "--prompts", str(root / "prompts.jsonl"), "--base",
                             str(root / "base"), "--predicted"]) == 2
    assert "--predicted" in one_line(capsys.readouterr().err) and not (tmp_path / "bad").exists()


# -- prompt rows join the table, labelled with the base's predictions ------------------------------------------
def test_prompt_rows_are_labelled_with_the_base_predictions_not_the_text(job):
    root, model, fp = job
    shards = distill_job.open_job(root / "rebuilt", fp, "float64", predicted=True)
    answers, every = job_table(shards), job_table(shards, prompt_labels=True)
    mask = answer_rows(shards, [(s, k) for s, shard in enumerate(shards) for k in range(len(shard))])
    assert len(mask) == len(every) and int(mask.sum()) == len(answers) < len(every)
    # the answers' rows are today's rows, labels and states
    assert torch.equal(every.targets[mask], answers.targets) and torch.equal(every.teacher[mask], answers.teacher)
    assert torch.equal(every.hidden[mask.nonzero().squeeze(1)], answers.hidden[torch.arange(len(answers))])
    row, differs = 0, 0
    for shard in shards:
        for k in range(len(shard)):
            sequence, start = shard.sequence(k), int(shard.answer_starts[k])
            tokens = torch.tensor(sequence.astype(np.int64))
            n = len(sequence) - 1  # rows t = 0 .. L-2
            assert torch.equal(every.targets[row: row + n], shift_targets(tokens, 1))  # what the heads read
            choice = base_argmax(model, sequence)  # the base's choice after each token, from the text before it
            for t in range(start - 1):  # the prompt's rows
                for c in range(MAX_TARGETS):
                    p = t + c  # column c: the base's choice for token t+c+1 after the text up to t+c
                    want = -1 if p > n - 1 else int(choice[p]) if p < start - 1 else int(sequence[p + 1])
                    assert int(every.teacher[row + t, c]) == want
                differs += int(every.teacher[row + t, 1] != every.targets[row + t, 1])
            row += n
    assert row == len(every)
    assert differs > 10  # the user's text is not what the base predicts: the labels are not the text
    # what the loss reads with labels: teacher (head k: column k+1), the text only where labels: text
    heads = build_heads(HeadConfig(family="medusa", num_heads=3, hidden_size=32, vocab_size=96))
    rows = torch.arange(len(every))
    inside = every.targets[:, 1:4] >= 0
    assert torch.equal(head_labels(every, rows, heads, "teacher"), torch.where(inside, every.teacher[:, 1:4], IGNORE))
    assert torch.equal(head_labels(every, rows, heads, "text"), torch.where(inside, every.targets[:, 1:4], IGNORE))
    # whole sequences for a context layer that reads the prompt: the same rows and bounds, now labelled
    whole, labelled = job_table(shards, with_prompt=True), job_table(shards, with_prompt=True, prompt_labels=True)
    assert torch.equal(whole.sequences, labelled.sequences) and torch.equal(labelled.teacher, every.teacher)
    assert int((whole.targets[:, 0] >= 0).sum()) == len(answers) and bool((labelled.targets[:, 0] >= 0).all())


# -- training --------------------------------------------------------------------------------------------------
def job_recipe(root, run: str, path: str = "rebuilt", **over):
    data = {"kind": "job", "path": str(root / path), "features_dir": None, "eval_examples": 4}
    options = {"train__batch_size": 16, "train__epochs": 1, "heads__draft_vocab_size": 24, **over}
    return tiny_recipe(root, run, data={**data, **options.pop("data", {})}, **options)


def test_a_run_with_prompt_positions_trains_more_rows(job):
    root, _, _ = job
    reports, data = {}, {}
    for run, every in (("answers", False), ("every", True)):
        reports[run] = run_inprocess(job_recipe(root, run, data={"prompt_positions": every},
                                                loss__kl_topk=5 if every else 0))
        data[run] = json.loads((root / run / "data.json").read_text())
    answers, every = data["answers"], data["every"]
    print(f"\nrows trained: answers only {answers['rows']} (answer positions {answers['answer_positions']}), "
          f"every position {every['rows']} (answer {every['answer_positions']} + prompt {every['prompt_positions']}); "
          f"positions seen in one epoch: {reports['answers']['train_positions_seen']} vs "
          f"{reports['every']['train_positions_seen']}")
    assert "prompt_positions" not in answers and answers["rows"] == answers["answer_positions"]
    assert every["answer_positions"] == answers["answer_positions"] and every["prompt_positions"] > 50
    assert every["rows"] == every["answer_positions"] + every["prompt_positions"]
    assert reports["every"]["train_positions_seen"] > reports["answers"]["train_positions_seen"]
    assert reports["every"]["steps"] > reports["answers"]["steps"] and np.isfinite(reports["every"]["final_loss"])
    # the draft vocabulary is counted on the answers' labels either way; the held-out table stays the answers'
    assert torch.equal(final_weights(root / "answers")["vocab_ids"], final_weights(root / "every")["vocab_ids"])
    card = (root / "every" / "final" / "README.md").read_text()
    assert f"+ {every['prompt_positions']:,} prompt positions labelled with the base's own predictions" in card
    assert "over its top-5 tokens (renormalized)" in card
    # Hydra++ reading the prompt (prefix_context: sequence): its prompt rows, unlabelled before, now train
    report = run_inprocess(job_recipe(root, "hydrapp", data={"prompt_positions": True},
                                      heads={"family": "hydra++", "num_heads": 3, "num_layers": 1,
                                             "draft_vocab_size": 0, "extra": {"prefix_context": "sequence"}},
                                      train__chunk_length=8))
    summary = json.loads((root / "hydrapp" / "data.json").read_text())
    assert summary["prompt_positions"] == every["prompt_positions"] and np.isfinite(report["final_loss"])


def test_a_job_without_predictions_is_refused_in_one_line_before_the_base_loads(job, monkeypatch):
    root, _, _ = job
    from draftheads.training import train as train_module

    def loaded(*args, **kwargs):
        raise AssertionError("the base was loaded before the job's predictions were checked")

    monkeypatch.setattr(train_module, "load_frozen_base", loaded)
    with pytest.raises(ShardError) as err:
        run_inprocess(job_recipe(root, "refused", path="old", data={"prompt_positions": True}))
    assert re.search(r"shard-00000: it holds no predicted\.npy .*data\.prompt_positions\); rebuild it: `python -m "
                     r"draftheads\.training\.data\.distill_job --from-tokens .* --predicted` .*or set "
                     r"data\.prompt_positions: false\.", one_line(err))
    assert not (root / "refused").exists()
    preflight(load_recipe(job_recipe(root, "fine", path="old"), []))  # answers only: the same job is fine


@pytest.mark.parametrize("over, message", [
    ({"loss__labels": "text"}, r"data\.prompt_positions: true and loss\.labels: text do not go together: on "
                               r"prompt positions the text is the user's, not the base's distribution; set "
                               r"loss\.labels: teacher"),
    ({"data": {"kind": "tokens"}}, r"data\.prompt_positions: true labels prompt positions with the base's own "
                                   r"predictions, which a self-distillation job folder keeps"),
    ({"heads": {"family": "hydra++", "num_heads": 3, "num_layers": 1, "draft_vocab_size": 0}},
     r"data\.prompt_positions: hydra\+\+ heads whose context layer reads the answer only"),
    ({"loss__kl_topk": 4, "loss__kl_weight": 0.0, "data": {"prompt_positions": False}},
     r"loss\.kl_topk=4 restricts the KL term, which loss\.kl_weight: 0 switches off"),
    ({"loss__kl_topk": 25, "data": {"prompt_positions": False}},
     r"loss\.kl_topk=25 is larger than the draft vocabulary \(heads\.draft_vocab_size=24\)"),
    ({"loss__kl_topk": -1, "data": {"prompt_positions": False}}, r"loss\.kl_topk must be ≥ 0, got -1"),
])
def test_a_recipe_that_cannot_train_every_position_is_one_line(job, over, message):
    root, _, _ = job
    data = {"prompt_positions": True, **over.pop("data", {})}
    with pytest.raises(RecipeError) as err:
        load_recipe(job_recipe(root, "bad", data=data, **over), [])
    assert re.search(message, one_line(err)), str(err.value)


def test_a_top_k_larger_than_the_whole_vocabulary_is_refused_before_the_base_loads(job):
    root, _, _ = job
    recipe = load_recipe(job_recipe(root, "wide", loss__kl_topk=97, heads__draft_vocab_size=0), [])
    with pytest.raises(RecipeError) as err:
        preflight(recipe)
    assert "loss.kl_topk=97 is larger than the draft vocabulary (the base's 96 tokens" in one_line(err)


def test_defaults_leave_the_recipe_and_its_identity_as_they_were(job):
    root, _, _ = job
    recipe = load_recipe(job_recipe(root, "plain"), [])
    assert recipe.data.prompt_positions is False and recipe.loss.kl_topk == 0
    identity = recipe.identity()
    assert "prompt_positions" not in identity["data"] and "kl_topk" not in identity["loss"]  # old runs still resume
    on = load_recipe(job_recipe(root, "plain"), ["--data.prompt_positions", "true", "--loss.kl_topk", "8"]).identity()
    assert on["data"]["prompt_positions"] is True and on["loss"]["kl_topk"] == 8


# -- top-K distillation ------------------------------------------------------------------------------------------
def loss_inputs(seed: int = 0, positions: int = 5, heads: int = 3, vocab: int = 11):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(positions, heads, vocab, dtype=torch.float64, generator=generator)
    teacher = 2 * torch.randn(positions, heads, vocab, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, vocab, (positions, heads), generator=generator)
    labels[0, -1] = labels[-2, 0] = IGNORE
    return logits, teacher, labels, head_weights(heads, 0.8).double()


def top_k_reference(logits, teacher, labels, weights, k: int, temperature: float):
    """The top-K KL written plainly: the teacher renormalized over its top-K, the heads' log-probabilities
    over the whole vocabulary, per head the mean over valid labels, scaled by T²."""
    t = teacher / temperature
    top = t.topk(k, dim=-1).indices
    p = torch.zeros_like(t).scatter_(-1, top, torch.softmax(t.gather(-1, top), -1))
    log_q = torch.log_softmax(logits / temperature, -1)
    per_token = torch.where(p > 0, p * (p.clamp(min=1e-300).log() - log_q), torch.zeros_like(p)).sum(-1)
    valid = (labels != IGNORE).double()
    per_head = (per_token * valid).sum(0) / valid.sum(0) * temperature ** 2
    return (per_head * weights).sum(), per_head


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_top_k_kl_is_the_full_kl_at_k_equal_the_vocabulary_and_the_plain_formula_below(temperature):
    logits, teacher, labels, weights = loss_inputs()
    vocab = logits.shape[-1]
    results = {}
    for k in (0, vocab, 4):
        mine = logits.clone().requires_grad_(True)
        loss, per_head = distill_loss(mine, labels, weights, None, 0.0, 1.0, teacher, temperature, kl_topk=k)
        loss.backward()
        results[k] = (loss.detach(), per_head["kl"], mine.grad)
    for full, top in zip(results[0], results[vocab]):
        torch.testing.assert_close(top, full, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(results[4][1], results[0][1])  # fewer tokens: another loss
    ref_logits = logits.clone().requires_grad_(True)
    ref, ref_per_head = top_k_reference(ref_logits, teacher, labels, weights, 4, temperature)
    torch.testing.assert_close(results[4][0], ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(results[4][1], ref_per_head.detach(), rtol=1e-10, atol=1e-12)
    ref.backward()  # autograd through the plain formula: the closed-form gradient's reference
    torch.testing.assert_close(results[4][2], ref_logits.grad, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="kl_topk=12 must be in 0..11"):
        distill_loss(logits, labels, weights, None, 0.0, 1.0, teacher, kl_topk=12)


@pytest.mark.parametrize("k, temperature, ce_weight", [(3, 1.0, 0.0), (3, 1.7, 0.5), (1, 1.0, 1.0), (0, 1.3, 0.5)])
def test_top_k_distillation_gradient_check(k, temperature, ce_weight):
    """The custom Function's saved closed-form gradient against finite differences (float64)."""
    logits, teacher, labels, weights = loss_inputs(seed=1, positions=4, heads=2, vocab=7)
    counts = torch.tensor([5.0, 4.0], dtype=torch.float64)  # global label counts (another process's too)

    def loss(x):
        return distill_loss(x, labels, weights, counts, ce_weight, 0.7, teacher, temperature, kl_topk=k)[0]

    assert torch.autograd.gradcheck(loss, (logits.clone().requires_grad_(True),), eps=1e-6, atol=1e-7)


# -- EAGLE-3: a layer that pairs each position with the token after it ------------------------------------------
def test_whole_sequence_tables_carry_each_rows_next_token(job):
    """Prompt rows hold no targets (nothing to learn there without prompt positions), yet EAGLE-3's
    layer pairs them with the token after them: the table keeps it for every row."""
    root, _, fp = job
    shards = distill_job.open_job(root / "rebuilt", fp, "float64", predicted=True)
    whole = job_table(shards, with_prompt=True)
    row = 0
    for shard in shards:
        for k in range(len(shard)):
            sequence = torch.tensor(shard.sequence(k).astype(np.int64))
            assert torch.equal(whole.next_tokens[row: row + len(sequence) - 1], sequence[1:])
            row += len(sequence) - 1
    assert row == len(whole) and job_table(shards).next_tokens is None
    assert torch.equal(whole.select(torch.tensor([0, 2])).next_tokens, whole.next_tokens[[0, 2]])


@pytest.fixture(scope="module")
def layered(job):
    """The job rebuilt with the base's layer 1 and its predictions (what EAGLE-3 heads train on)."""
    root, _, _ = job
    assert distill_job.main(rebuild_args(root, "layered", "--layers", "1", "--predicted")) == 0
    return job


@pytest.mark.parametrize("every", [False, True])
def test_eagle3_heads_train_on_whole_sequences_and_decode_as_the_base(layered, every):
    from draftheads.decoding import DraftHeadsModel
    from draftheads.heads import load_heads

    root, model, fp = layered
    run = f"eagle3-{every}"
    report = run_inprocess(job_recipe(root, run, path="layered", data={"prompt_positions": every}, train__chunk_length=8,
                                      heads={"family": "eagle3", "num_heads": 3, "num_layers": 1,
                                             "draft_vocab_size": 24, "feature_layers": [1]}))
    assert np.isfinite(report["final_loss"]) and report["steps"] > 0
    summary = json.loads((root / run / "data.json").read_text())
    assert summary["rows"] > summary["answer_positions"]  # the prompt's rows feed the layer either way
    heads = load_heads(root / run / "final", expected_fingerprint=fp, dtype=model.dtype)
    assert heads.family == "eagle3" and heads.feature_layers == (1,)
    ids = torch.tensor([[5, 9, 33, 4, 17, 8]])
    reference = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert DraftHeadsModel(model, heads).generate(ids, max_new_tokens=16).tolist() == reference.tolist()


@pytest.mark.parametrize("over, message", [
    ({"heads": {"family": "eagle3", "num_heads": 3, "num_layers": 1, "draft_vocab_size": 0}},
     r"heads\.feature_layers: eagle3 heads read base layers, not the final state alone"),
    ({"heads": {"family": "eagle3", "num_heads": 3, "num_layers": 1, "draft_vocab_size": 0, "feature_layers": [1]},
      "data": {"kind": "tokens"}}, r"data\.kind='tokens': eagle3 heads read whole sequences"),
])
def test_an_eagle3_recipe_it_cannot_train_is_one_line(job, over, message):
    root, _, _ = job
    with pytest.raises(RecipeError) as err:
        load_recipe(job_recipe(root, "bad-eagle3", data=over.pop("data", {}), **over), [])
    assert re.search(message, one_line(err))


def test_the_heads_read_each_rows_next_token_where_it_has_no_target(job):
    from draftheads.training.head_forward import head_logits

    root, _, fp = job
    shards = distill_job.open_job(root / "rebuilt", fp, "float64", predicted=True)
    whole = job_table(shards, with_prompt=True)
    seen = {}

    def model(hidden, tokens, attention_mask=None):
        seen["tokens"] = tokens
        return torch.zeros(*tokens.shape, 5)

    rows = torch.tensor([[0, 1, 2, 3, -1]])  # a chunk: the first sequence's prompt rows, then padding
    head_logits(model, whole, rows, 3, "cpu", torch.float64)
    assert bool((whole.targets[:4, 0] < 0).all())  # prompt rows: no target
    assert torch.equal(seen["tokens"][0, :4, 0], whole.next_tokens[:4])  # yet the token after each is read
