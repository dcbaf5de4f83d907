"""The self-distillation job (training/data/distill_job.py): the features it keeps from the decoder's
own forwards equal a plain forward's final hidden states, its answers are transformers' greedy
ones, a stopped run redoes only the missing shard, a bad shard (truncated, another base, another
dtype) is named in one line and rebuilt, and committed token ids rebuild the same shards."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import OracleHeads, left_pad, tiny_distill_setup, tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.training.data import distill_job, distill_shards
from draftheads.training.data.distill_capture import answer_with_states, forward_states
from draftheads.training.data.distill_job import main
from draftheads.training.data.distill_prompts import Prompt, interleave
from draftheads.training.data.distill_shards import ShardError, open_shard

PAD = 0
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [20, 21, 22, 23], [30, 31]]


def hf_greedy(model, prompts, max_new):
    ids, mask = left_pad(prompts)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=PAD)
    return [row[ids.shape[1]:] for row in out.tolist()]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_captured_states_equal_a_plain_forward_and_answers_equal_hf_greedy(dtype, tol):
    """Prompt states from the prefill, every kept token's from the verification that accepted it
    (the oracle heads get several drafts a step accepted), at the same positions as one plain
    forward over prompt + answer; rows stop at EOS at different steps. (bfloat16 would differ by
    its rounding: a tree forward sums in another order than a sequence forward.)"""
    model = tiny_llama(0, dtype=dtype)
    free = hf_greedy(model, PROMPTS, 24)
    model.generation_config.eos_token_id = free[1][9]  # row 1 (and any row that draws it) stops early
    reference = hf_greedy(model, PROMPTS, 24)
    heads = OracleHeads(free, vocab=96, error=0.3, seed=0)
    decoder = DraftHeadsModel(model, heads, tree=tree_from_paths([(0,), (1,), (0, 0), (0, 0, 0)]))
    answered = answer_with_states(decoder, PROMPTS, 24, PAD)
    eos = model.generation_config.eos_token_id
    accepted = decoder.last_stats.accepted
    assert max(accepted) >= 2 and sum(accepted) >= 10  # kept states came from several path slots a step
    for prompt, done, ref in zip(PROMPTS, answered, reference):
        expected = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert done.answer == expected
        sequence = torch.tensor([prompt + done.answer])
        plain = model.model(input_ids=sequence).last_hidden_state[0]  # (L, d)
        assert done.states.shape == plain.shape
        torch.testing.assert_close(done.states[:-1], plain[:-1], atol=tol, rtol=tol)
        assert not done.states[-1].any()
    assert any(len(d.answer) < 24 for d in answered) and any(len(d.answer) == 24 for d in answered)


def test_plain_forward_states_are_the_same_positions():
    model = tiny_llama(1)
    sequences = [[3, 4, 5, 6], [7], [8, 9, 10, 11, 12, 13, 14]]
    for sequence, states in zip(sequences, forward_states(model, sequences, max_tokens=10)):
        plain = model.model(input_ids=torch.tensor([sequence])).last_hidden_state[0]
        torch.testing.assert_close(states[:-1], plain[:-1], atol=1e-10, rtol=1e-10)


def test_prefixes_of_the_interleaved_prompts_are_proportional_and_a_repeat_is_answered_once():
    a = [Prompt(f"a{i}", "a", f"question {i}") for i in range(30)]
    b = [Prompt(f"b{i}", "b", f"other {i}") for i in range(10)] + [Prompt("dup", "b", "QUESTION  3")]
    merged = interleave([a, b])
    assert len(merged) == 40 and "dup" not in [p.id for p in merged]
    for size in (4, 8, 20):
        share = sum(p.source == "b" for p in merged[:size]) / size
        assert abs(share - 0.25) <= 1 / size


# -- the job end to end on a tiny base -----------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    _, texts = tiny_distill_setup(root, 10, seed=0)
    with open(root / "conversations.jsonl", "w") as handle:  # one new user turn, one already asked
        for i, text in [(10, "w50 w51 w52"), (11, texts[2])]:
            handle.write(json.dumps({"id": f"c{i}", "source": "chat", "messages": [
                {"role": "user", "content": text}, {"role": "assistant", "content": "w9"}]}) + "\n")
    with open(root / "answers.jsonl", "w") as handle:  # answers made elsewhere for two prompts
        for i in (0, 5):
            handle.write(json.dumps({"id": f"p{i}", "prompt": texts[i], "response_ids": [11, 12, 13, 2]}) + "\n")
    return root


def job_args(root: Path, out: str, *more: str) -> list[str]:
    return ["--out", str(root / out), "--prompts", str(root / "prompts.jsonl"), str(root / "conversations.jsonl"),
            "--answers", str(root / "answers.jsonl"), "--base", str(root / "base"), "--heads", str(root / "heads"),
            "--dtype", "float64", "--tree", "3", "--sources", "heads", "--max-new-tokens", "10",
            "--shard-size", "4", "--batch-size", "3", *more]


def shard_dirs(out: Path) -> list[Path]:
    return sorted((out / "shards").glob("shard-*"))


def run_counting(monkeypatch, args) -> list[int]:
    """Run the job, returning the prompt count of every shard it built."""
    built = []
    original = distill_job.Job.build

    def counting(self, prompts):
        built.append(len(prompts))
        return original(self, prompts)

    monkeypatch.setattr(distill_job.Job, "build", counting)
    assert main(args) == 0
    monkeypatch.setattr(distill_job.Job, "build", original)
    return built


def test_a_stopped_run_redoes_only_the_missing_shard(setup, monkeypatch, tmp_path):
    args = job_args(setup, "stopped")
    out = setup / "stopped"
    writes = []
    original = distill_shards.write_shard

    def dies_on_the_second(folder, shard, manifest):
        writes.append(folder)
        if len(writes) == 2:
            with distill_shards.atomic_directory(folder, ours=distill_shards.is_shard_folder) as tmp:
                np.save(tmp / "tokens.npy", shard.tokens)  # half written when the kill comes
                raise KeyboardInterrupt
        original(folder, shard, manifest)

    monkeypatch.setattr(distill_job, "write_shard", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        main(args)
    monkeypatch.setattr(distill_job, "write_shard", original)
    assert [d.name for d in shard_dirs(out)] == ["shard-00000"]  # no trace of the half-written one
    assert not [p for p in (out / "shards").iterdir() if p.name.startswith(".")]
    (out / "shards" / ".shard-00001.tmp-x1").mkdir()  # what a SIGKILL during a write leaves
    first = os.stat(out / "shards" / "shard-00000" / "hidden.npy").st_ino
    assert run_counting(monkeypatch, args) == [4, 3]  # 11 prompts: shards 1 and 2 only
    assert not [p for p in (out / "shards").iterdir() if p.name.startswith(".")]
    assert os.stat(out / "shards" / "shard-00000" / "hidden.npy").st_ino == first
    assert run_counting(monkeypatch, args) == []  # all there: nothing redone
    plan = json.loads((out / "plan.json").read_text())
    assert plan["prompts"] == 11 and plan["reused_answers"] == 2 and plan["shards"] == 3
    shards = [open_shard(d, {}, "") for d in shard_dirs(out)]
    ids = [i for s in shards for i in s.ids]
    assert len(ids) == 11 and "c10" in ids and "c11" not in ids  # the repeated user turn answered once
    given = shards[0].ids.index("p0")
    assert shards[0].sequence(given)[shards[0].answer_starts[given]:].tolist() == [11, 12, 13, 2]


def test_start_at_builds_the_later_shards_first_then_the_earlier(setup, monkeypatch):
    """``--start-at``: the shards the decoder must answer can come before those whose answers
    are given, so a short run spends its time where the data is new."""
    order = []
    original = distill_job.write_shard

    def recording(folder, shard, manifest):
        order.append(folder.name)
        original(folder, shard, manifest)

    monkeypatch.setattr(distill_job, "write_shard", recording)
    assert main(job_args(setup, "started", "--batch-size", "4", "--start-at", "1")) == 0
    assert order == ["shard-00001", "shard-00002", "shard-00000"]


@pytest.mark.parametrize("damage", ["truncated", "fingerprint", "dtype"])
def test_a_bad_shard_is_named_in_one_line_and_rebuilt(setup, monkeypatch, capsys, damage):
    out = setup / f"bad-{damage}"
    args = job_args(setup, f"bad-{damage}")
    assert main(args) == 0
    folder = out / "shards" / "shard-00001"
    before = np.load(folder / "tokens.npy").tolist()
    if damage == "truncated":
        data = (folder / "hidden.npy").read_bytes()
        (folder / "hidden.npy").write_bytes(data[: len(data) // 2])
    else:
        manifest = json.loads((folder / "manifest.json").read_text())
        if damage == "fingerprint":
            manifest["base_fingerprint"]["lm_head_sha256"] = "0" * 64
        else:
            manifest["dtype"] = "bfloat16"
        (folder / "manifest.json").write_text(json.dumps(manifest))
    job = distill_job.Job(distill_job.parse_args(args))
    expected = job.expected(json.loads((out / "plan.json").read_text())["plan_key"], json.loads(
        (folder / "manifest.json").read_text())["ids"])
    with pytest.raises(ShardError) as caught:
        open_shard(folder, expected, "python -m draftheads.training.data.distill_job --out " + str(out))
    message = str(caught.value)
    assert "\n" not in message and str(folder) in message and "rebuild it" in message
    assert {"truncated": "truncated", "fingerprint": "another base", "dtype": "another dtype"}[damage] in message
    capsys.readouterr()
    assert run_counting(monkeypatch, args) == [4]
    printed = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"{folder}: ") and line.endswith("rebuilding it.") for line in printed)
    rebuilt = open_shard(folder, expected, "")
    assert rebuilt.tokens.tolist() == before


def test_a_resume_with_another_plan_is_refused_in_one_line(setup, capsys):
    assert main(job_args(setup, "plan", "--shards", "1")) == 0
    capsys.readouterr()
    assert main(job_args(setup, "plan", "--max-new-tokens", "12")) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "plan.json" in error and "another --out" in error


def test_committed_token_ids_rebuild_the_same_shards(setup, tmp_path):
    assert main(job_args(setup, "full")) == 0
    committed = tmp_path / "committed"
    assert main(job_args(setup, "full", "--export", str(committed))) == 0
    assert sorted(p.name for p in committed.iterdir()) == ["index.json", "shard-00000.npz", "shard-00001.npz",
                                                             "shard-00002.npz"]
    rebuilt = tmp_path / "rebuilt"
    assert main(["--from-tokens", str(committed), "--out", str(rebuilt), "--base", str(setup / "base"),
                 "--dtype", "float64"]) == 0
    for made, again in zip(shard_dirs(setup / "full"), shard_dirs(rebuilt)):
        a, b = open_shard(made, {}, ""), open_shard(again, {}, "")
        assert a.ids == b.ids and a.tokens.tolist() == b.tokens.tolist()
        assert a.answer_starts.tolist() == b.answer_starts.tolist() and a.finished.tolist() == b.finished.tolist()
        np.testing.assert_allclose(a.hidden.astype(np.float32), b.hidden.astype(np.float32), rtol=1e-3, atol=1e-3)
        manifest = json.loads((again / "manifest.json").read_text())  # the features' wall time, for scaling tables
        assert manifest["decoded"] == 0 and isinstance(manifest["seconds"], float) and manifest["seconds"] >= 0


def test_an_export_keeps_committed_shards_the_clone_did_not_rebuild(setup, tmp_path, capsys):
    """A clone resumes the job without rebuilding the earlier shards' features: its export adds
    its new shard beside the committed ones, it does not drop them; a damaged committed shard,
    another plan's index and a malformed one (export or rebuild) are each one line naming the file."""
    assert main(job_args(setup, "full")) == 0
    whole = tmp_path / "whole"
    assert main(["--out", str(setup / "full"), "--export", str(whole)]) == 0
    committed = tmp_path / "committed"  # what the repository held: shards 0-1
    committed.mkdir()
    index = json.loads((whole / "index.json").read_text())
    for name in ("shard-00000.npz", "shard-00001.npz"):
        shutil.copy(whole / name, committed / name)
    (committed / "index.json").write_text(json.dumps({"plan": index["plan"], "shards": index["shards"][:2]}))
    clone = tmp_path / "clone"  # the clone's job folder: only the shard it decoded
    shutil.copytree(setup / "full", clone)
    for folder in shard_dirs(clone)[:-1]:
        shutil.rmtree(folder)
    assert main(["--out", str(clone), "--export", str(committed)]) == 0
    assert json.loads((committed / "index.json").read_text()) == index
    assert sorted(p.name for p in committed.glob("*.npz")) == sorted(p.name for p in whole.glob("*.npz"))
    capsys.readouterr()

    (committed / "shard-00001.npz").write_bytes(b"not a shard")
    assert main(["--out", str(clone), "--export", str(committed)]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "shard-00001.npz" in error and "git checkout" in error

    assert main(job_args(setup, "other-plan", "--max-new-tokens", "12", "--shards", "1")) == 0
    capsys.readouterr()
    assert main(["--out", str(setup / "other-plan"), "--export", str(whole)]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "another plan" in error and str(whole / "index.json") in error

    (committed / "index.json").write_text('{"plan": {}}')  # a malformed index: for the export and the rebuild
    for args in (["--out", str(clone), "--export", str(committed)],
                 ["--from-tokens", str(committed), "--out", str(tmp_path / "rebuilt"), "--base", str(setup / "base")]):
        assert main(args) == 2
        error = capsys.readouterr().err.strip()
        assert "\n" not in error and str(committed / "index.json") in error and "git checkout" in error


def test_training_reads_a_job_only_for_its_base_and_dtype(setup):
    out = setup / "reads"
    assert main(job_args(setup, "reads")) == 0
    job = distill_job.Job(distill_job.parse_args(job_args(setup, "reads")))
    shards = distill_job.open_job(out, job.fingerprint, "float64")
    assert sum(len(s) for s in shards) == 11 and all(isinstance(s.hidden, np.memmap) for s in shards)
    with pytest.raises(ShardError, match="another dtype") as caught:
        distill_job.open_job(out, job.fingerprint, "bfloat16")
    assert "shard-00000" in str(caught.value) and "--out" in str(caught.value)


def test_a_run_without_prompts_is_one_line_naming_the_option(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "job")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--prompts" in err and "README.md" in err
    assert not (tmp_path / "job").exists()


# -- someone else's files and bad inputs: refused in one line before any work, nothing written --------------
def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(args, capsys, *named: str) -> str:
    capsys.readouterr()
    assert main(args) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip() and not line.startswith("Loading weights")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in captured.err, captured.err
    err = lines[0]
    assert all(n in err for n in named), err
    return err


def committed_ids(setup: Path) -> Path:
    """A one-shard job (``setup/plan``) and its committed token ids."""
    committed = setup / "committed-for-checks"
    if not committed.exists():
        assert main(job_args(setup, "plan", "--shards", "1")) == 0
        assert main(job_args(setup, "plan", "--shards", "1", "--export", str(committed))) == 0
    return committed


@pytest.mark.parametrize("where", ["foreign folder", "foreign shard in a job"])
def test_a_folder_holding_someone_elses_files_keeps_every_file(setup, tmp_path, capsys, where):
    out = tmp_path / "theirs"
    notes = out / "shards" / "shard-00000" / "notes.txt"
    notes.parent.mkdir(parents=True)
    notes.write_text("my notes")
    if where == "foreign shard in a job":  # the job's own folder, a shard folder the job did not write
        shutil.copy(committed_ids(setup).parent / "plan" / "plan.json", out / "plan.json")
    before = snapshot(out)
    for args in (job_args(setup, "x")[2:], ["--from-tokens", str(committed_ids(setup)), "--base",
                                            str(setup / "base"), "--dtype", "float64"]):
        refused(["--out", str(out), *args], capsys, str(out), "left as it is")
        assert snapshot(out) == before


def test_a_bad_shard_holding_someone_elses_file_is_not_removed(setup, tmp_path, capsys):
    out = tmp_path / "job"
    shutil.copytree(committed_ids(setup).parent / "plan", out)
    folder = out / "shards" / "shard-00000"
    (folder / "hidden.npy").write_bytes((folder / "hidden.npy").read_bytes()[:100])  # bad: it would be rebuilt
    (folder / "notes.txt").write_text("mine")
    before = snapshot(out)
    refused(["--out", str(out), *job_args(setup, "x", "--shards", "1")[2:]], capsys, str(folder), "notes.txt")
    assert snapshot(out) == before


def test_export_refuses_a_folder_without_a_job_and_a_target_of_someone_elses(setup, tmp_path, capsys):
    empty = tmp_path / "nojob"
    empty.mkdir()
    refused(["--out", str(empty), "--export", str(tmp_path / "t")], capsys, "--out", str(empty), "plan.json")
    committed_ids(setup)
    target = tmp_path / "theirs"
    target.mkdir()
    (target / "shard-00000.npz").write_bytes(b"their own")
    refused(["--out", str(setup / "plan"), "--export", str(target)], capsys, "--export", str(target))
    assert snapshot(target) == {"shard-00000.npz": b"their own"}


OPTIONS = {"shard size 0": (["--shard-size", "0"], "--shard-size"),
           "batch size 0": (["--batch-size", "0"], "--batch-size"),
           "max new tokens 0": (["--max-new-tokens", "0"], "--max-new-tokens"),
           "forward tokens 0": (["--forward-tokens", "0"], "--forward-tokens"),
           "dtype bogus": (["--dtype", "bogus"], "bogus"),
           "missing base": (["--base", "/nonexistent/base"], "/nonexistent/base"),
           "missing prompts": (["--prompts", "/nonexistent/prompts.jsonl"], "--prompts"),
           "device bogus": (["--device", "toaster"], "--device")}
if not torch.cuda.is_available():
    OPTIONS["cuda without cuda"] = (["--device", "cuda"], "--device cuda")


@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_a_bad_option_is_one_line_naming_it_before_any_work(setup, tmp_path, capsys, monkeypatch, case):
    more, named = OPTIONS[case]
    monkeypatch.setattr(distill_job, "Job", None)  # loading the base would be work: it must not be reached
    out = tmp_path / "job"
    refused(["--out", str(out), *job_args(setup, "x")[2:], *more], capsys, named)
    assert not out.exists()


def damaged_token_ids(committed: Path, damage: str) -> None:
    index = json.loads((committed / "index.json").read_text())
    path = committed / "shard-00000.npz"
    with np.load(path) as data:
        arrays = {k: np.asarray(data[k]) for k in data.files}
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
        return
    if damage == "no ids":
        del index["shards"][0]["ids"]
    elif damage == "string shard":
        index["shards"][0]["shard"] = "0"
    elif damage == "decreasing offsets":
        arrays["offsets"][1], arrays["offsets"][2] = arrays["offsets"][2], arrays["offsets"][1]
    elif damage == "past the vocabulary":
        arrays["tokens"] = arrays["tokens"].astype(np.int64)
        arrays["tokens"][3] = 60000
    elif damage == "negative":
        arrays["tokens"] = arrays["tokens"].astype(np.int64)
        arrays["tokens"][3] = -1
    elif damage == "past uint16":
        arrays["tokens"] = arrays["tokens"].astype(np.int64)
        arrays["tokens"][3] = 65536 + 7  # would wrap to 7, a valid id
    elif damage == "answer past its sequence":
        arrays["answer_starts"][0] = int(arrays["offsets"][1] - arrays["offsets"][0]) + 1
    (committed / "index.json").write_text(json.dumps(index))
    np.savez_compressed(path, **arrays)


DAMAGES = {"truncated": "shard-00000.npz", "no ids": "'ids'", "string shard": "shard '0'",
           "decreasing offsets": "offsets", "past the vocabulary": "60000", "negative": "-1",
           "past uint16": "65543", "answer past its sequence": "answer_starts"}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_committed_token_ids_that_cannot_be_trusted_are_one_line_and_nothing_is_written(setup, tmp_path, capsys,
                                                                                          damage):
    committed = tmp_path / "committed"
    shutil.copytree(committed_ids(setup), committed)
    damaged_token_ids(committed, damage)
    out = tmp_path / "rebuilt"
    refused(["--from-tokens", str(committed), "--out", str(out), "--base", str(setup / "base"), "--dtype", "float64"],
            capsys, DAMAGES[damage])
    assert not out.exists()
