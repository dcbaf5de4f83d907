"""Training on the self-distillation job's shards (training/data/job_data.py): the rows are the
feature cache's rows (the base's states after each token, the text's next tokens), states stay
memory-mapped, whole sequences carry unlabelled prompt rows and their bounds, and a recipe
with ``data.kind: job`` trains from a job folder (a folder that is not one: one line)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import REPO, run_inprocess, save_tiny_base, subprocess_env, tiny_distill_setup, tiny_job_args, tiny_recipe
from draftheads.training.data import distill_job
from draftheads.training.batches import sequence_chunks
from draftheads.training.features import Example, hidden_states, shift_targets
from draftheads.training.data.job_data import MappedRows, job_table, split_sequences


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobdata")
    model, _ = tiny_distill_setup(root, 24, seed=1)
    args = tiny_job_args(root, 12)
    assert distill_job.main(args) == 0
    fp = distill_job.Job(distill_job.parse_args(args)).fingerprint
    return root, model, distill_job.open_job(root / "job", fp, "float64")


def test_answer_rows_are_the_feature_cache_rows(job):
    _, model, shards = job
    table = job_table(shards)
    assert isinstance(table.hidden, MappedRows) and table.sequences is None
    row = 0
    for shard in shards:
        for k in range(len(shard)):
            ids = [int(t) for t in shard.sequence(k)]
            example = Example(ids, int(shard.answer_starts[k]))
            [(states, _)] = hidden_states(model, [example])
            n = states.shape[0]  # rows response_start-1 .. L-2
            torch.testing.assert_close(table.hidden[torch.arange(row, row + n)].double(), states.double(),
                                       atol=2e-3, rtol=2e-3)  # stored as float16
            assert torch.equal(table.targets[row: row + n], shift_targets(torch.tensor(ids), example.response_start))
            row += n
    assert row == len(table)
    index = torch.tensor([[3, 0], [len(table) - 1, 5]])
    assert torch.equal(table.hidden[index][1, 0], table.hidden[torch.tensor([len(table) - 1])][0])
    assert table.hidden[2:5].shape == (3, table.hidden.shape[1])


def test_whole_sequences_carry_unlabelled_prompt_rows_and_their_bounds(job):
    _, _, shards = job
    answers, whole = job_table(shards), job_table(shards, with_prompt=True)
    lengths = [int(s.offsets[k + 1] - s.offsets[k]) for s in shards for k in range(len(s))]
    starts = [int(s.answer_starts[k]) for s in shards for k in range(len(s))]
    assert whole.sequences.tolist() == [[a, b] for a, b in zip(np.cumsum([0] + [n - 1 for n in lengths[:-1]]),
                                                                  np.cumsum([n - 1 for n in lengths]))]
    labelled = whole.targets[:, 0] >= 0
    assert int(labelled.sum()) == len(answers)  # the answer's rows, and only they, hold labels
    assert torch.equal(whole.targets[labelled], answers.targets)
    torch.testing.assert_close(whole.hidden[labelled.nonzero().squeeze(1)], answers.hidden[torch.arange(len(answers))])
    first, end = whole.sequences[0].tolist()
    assert (whole.targets[first: first + starts[0] - 1] < 0).all() and (whole.targets[first + starts[0] - 1:end, 0] >= 0).all()
    assert sequence_chunks(whole, 0) == [tuple(b) for b in whole.sequences.tolist()]  # never cut


def test_held_out_sequences_are_the_last_ones(job):
    _, _, shards = job
    train, held = split_sequences(shards, 5)
    assert len(held) == 5 and held[-1] == (len(shards) - 1, len(shards[-1]) - 1) and not set(train) & set(held)
    with pytest.raises(ValueError, match="data.eval_examples"):
        split_sequences(shards, 10_000)


def test_a_recipe_trains_on_a_job_folder(job):
    root, _, _ = job
    recipe = tiny_recipe(root, "run", data={"kind": "job", "path": str(root / "job"), "features_dir": None,
                                            "eval_examples": 4}, train__batch_size=16, train__epochs=2)
    report = run_inprocess(recipe)
    log = [json.loads(line) for line in (root / "run" / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert report["steps"] > 2 and losses[-1] < losses[0]
    assert (root / "run" / "final" / "model.safetensors").is_file()
    data = json.loads((root / "run" / "data.json").read_text())
    assert data["sequences"] + data["held_out_sequences"] == 24 and data["held_out_sequences"] == 4
    assert data["answer_positions"] == data["rows"]  # answers only: every row is labelled
    # the report and the card state the data's size, the epochs and the hardware
    assert report["data"] == data and report["epochs"] == 2
    card = (root / "run" / "final" / "README.md").read_text()
    assert f"- 2 epoch(s) of {data['sequences']:,} sequences ({data['answer_positions']:,} answer positions)" in card
    assert f"- Hardware: {report['hardware']}" in card and "logical cores" in report["hardware"]


def test_a_limit_is_a_seeded_sample_of_the_whole_job(job):
    root, _, _ = job
    picked = []
    for run in ("limited-a", "limited-b"):
        recipe = tiny_recipe(root, run, data={"kind": "job", "path": str(root / "job"), "features_dir": None,
                                              "eval_examples": 4, "limit": 6}, train__batch_size=8, train__max_steps=1)
        run_inprocess(recipe)
        picked.append(json.loads((root / run / "data.json").read_text()))
    assert picked[0] == {**picked[1], "jobs": picked[0]["jobs"]} and picked[0]["sequences"] == 6


def test_a_folder_that_is_not_a_job_is_one_line(job, tmp_path):
    root, _, _ = job
    recipe = tiny_recipe(root, "bad", data={"kind": "job", "path": str(tmp_path), "features_dir": None})
    done = subprocess.run([sys.executable, "-m", "draftheads.training.train", str(recipe)], capture_output=True,
                          text=True, env=subprocess_env(), cwd=REPO, timeout=300)
    assert done.returncode == 2
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and str(tmp_path) in err[0] and "distill_job" in err[0]


def test_an_evaluation_job_scores_each_epoch_by_source_on_labelled_rows(job):
    root, _, shards = job
    recipe = tiny_recipe(root, "dev", data={"kind": "job", "path": str(root / "job"), "features_dir": None,
                                            "eval_examples": 4, "eval_path": str(root / "job")},
                         train__batch_size=16, train__epochs=2, run__trees_from="dev")
    report = run_inprocess(recipe)
    records = [json.loads(line) for line in (root / "dev" / "log.jsonl").read_text().splitlines()]
    epochs = [r["epoch_eval"] for r in records if "epoch_eval" in r]
    assert len(epochs) == 2
    dev = epochs[-1]["eval"]["dev"]
    answers = sum(int(s.offsets[k + 1] - s.offsets[k] - s.answer_starts[k]) for s in shards for k in range(len(s)))
    assert set(dev["groups"]) == {"tiny"} and dev["positions"] == answers  # every answer row, no prompt row
    assert dev["groups"]["tiny"]["top1"] == dev["top1"]
    assert report["trees_from"] == "dev" and report["tree_positions"] == answers  # the trees fit the dev answers
    saved = json.loads((root / "dev" / "final" / "config.json").read_text())
    assert saved["expected_tau_on"] == "dev"  # decoding counts on all of its drafted part
    assert report["held_out_positions"] < answers


def test_hydrapp_reading_the_prompt_trains_on_whole_sequences_and_decodes_identically(job):
    from draftheads.decoding import DraftHeadsModel

    root, _, shards = job
    recipe = tiny_recipe(root, "whole", heads={"family": "hydra++", "num_heads": 3, "num_layers": 1,
                                               "draft_vocab_size": 0,
                                               "extra": {"prefix_heads": 2, "prefix_context": "sequence"}},
                         data={"kind": "job", "path": str(root / "job"), "features_dir": None, "eval_examples": 4,
                               "eval_path": str(root / "job")},
                         train__batch_size=4, train__chunk_length=0, train__epochs=2, train__lr=0.003)
    run_inprocess(recipe)
    data = json.loads((root / "whole" / "data.json").read_text())
    prompts = sum(int(s.answer_starts[k]) - 1 for s in shards for k in range(len(s)))
    assert data["rows"] - data["answer_positions"] > 0 and data["answer_positions"] < data["rows"] <= (
        data["answer_positions"] + prompts)  # the prompt's rows feed the layer, unlabelled
    model = save_tiny_base(root / "base-again")  # the same seed: the job's base
    drafter = DraftHeadsModel.from_pretrained(root / "whole" / "final", base=model, tree=3)
    assert drafter.heads.context_from_prompt
    for prompt in ([5, 9, 33, 4], [7]):
        ids = torch.tensor([prompt])
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        assert drafter.generate(ids, max_new_tokens=16).tolist() == reference.tolist()


def test_a_resume_onto_a_job_that_grew_is_one_line(job):
    root, _, _ = job
    recipe = tiny_recipe(root, "grow", data={"kind": "job", "path": str(root / "job"), "features_dir": None,
                                             "eval_examples": 4, "limit": 10}, train__batch_size=4, train__max_steps=2,
                         run__checkpoint_every=1)
    run_inprocess(recipe)
    summary = json.loads((root / "grow" / "data.json").read_text())
    (root / "grow" / "data.json").write_text(json.dumps({**summary, "sequences": 9}))  # as if it had started on less
    done = subprocess.run([sys.executable, "-m", "draftheads.training.train", str(recipe), "--train.max_steps", "2"],
                          capture_output=True, text=True, env=subprocess_env(), cwd=REPO, timeout=300)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and "data changed" in err[0] and "sequences 9 → 10" in err[0]
