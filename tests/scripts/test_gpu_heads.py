"""scripts/gpu_heads.py, the timed generate-then-train run for a GPU machine, end to end on this
CPU on a tiny random base: a run killed while it decodes keeps its shards and the next run
resumes them, the heads it trains load and decode as transformers' greedy does, a training run
stopped at the budget's end leaves its last checkpoint's heads, and a missing CUDA device or
prompt file is one line naming the fix."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO, left_pad, subprocess_env, tiny_distill_setup, tiny_recipe
from draftheads.decoding import DraftHeadsModel
from draftheads.training.data import distill_job

SCRIPT = str(REPO / "scripts" / "gpu_heads.py")
SHARDS = 12  # 24 prompts, 2 a shard


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_heads")
    model, _ = tiny_distill_setup(root, 24, seed=2)
    with open(root / "eval.jsonl", "w") as handle:  # benchmark questions: their first turn is asked
        for i in range(3):
            handle.write(json.dumps({"question_id": i, "turns": [f"w{60 + i} w{70 + i} w8", "w9"]}) + "\n")
    recipe = tiny_recipe(root, "unused", data={"kind": "job", "path": "set-by-the-script", "features_dir": None,
                                               "eval_examples": 4}, train__batch_size=16)
    return root, model, recipe


def command(root: Path, recipe: Path, out: Path, minutes: float, *more: str) -> list[str]:
    return [sys.executable, SCRIPT, "--device", "cpu", "--minutes", str(minutes), "--out", str(out),
            "--prompts", str(root / "prompts.jsonl"), "--answers", "--base", str(root / "base"), "--dtype", "float64",
            "--heads", str(root / "heads"), "--batch-size", "2", "--job-args",
            "--tree 3 --sources heads --max-new-tokens 16 --shard-size 2", "--recipe", str(recipe), *more]


def shard_inodes(out: Path) -> dict[str, int]:
    return {p.parent.name: os.stat(p).st_ino for p in (out / "job" / "shards").glob("shard-*/hidden.npy")}


def decodes_as_hf(heads: str, model) -> bool:
    """The trained heads drafting for the base, float64: the same tokens as the base's greedy."""
    decoder = DraftHeadsModel.from_pretrained(heads, base=model, sources="heads")
    prompt = [[3, 17, 40, 41, 4]]
    ids, mask = left_pad(prompt)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    ours = decoder.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    return ours.tolist() == reference.tolist() and decoder.last_stats.steps > 0


def test_a_killed_run_keeps_its_shards_and_the_next_run_resumes_then_trains(setup):
    root, model, recipe = setup
    out = root / "run"
    args = command(root, recipe, out, 1.5, "--generate-share", "0.5", "--probe-steps", "4", "--max-steps", "8",
                   "--checkpoint-every", "4", "--eval-prompts", str(root / "eval.jsonl"), "--eval-max-new-tokens", "8",
                   "--", "--train.lr", "0.01", "--run.trees_from", "dev")
    first = subprocess.Popen(args, cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    waited = time.monotonic()
    while not shard_inodes(out) and first.poll() is None and time.monotonic() - waited < 120:
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)  # the script and the job it started
    first.wait()
    kept = shard_inodes(out)
    assert 1 <= len(kept) < SHARDS, kept

    done = subprocess.run(args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    again = shard_inodes(out)
    assert len(again) == SHARDS and all(again[name] == inode for name, inode in kept.items())  # none redone
    summary = json.loads((out / "summary.json").read_text())
    generated, trained = summary["stages"]["generate"], summary["stages"]["train"]
    assert summary["device"] == "cpu" and summary["budget_seconds"] == 90
    assert generated["shards_before"] == len(kept) and generated["shards_built"] == SHARDS - len(kept)
    assert generated["complete"] and generated["sequences"] == 24 and generated["answer_positions"] > 24
    assert generated["eval"]["shards"] == generated["eval"]["plan_shards"] == 2 and generated["eval"]["sequences"] == 3
    run_dir = Path(summary["heads"]).parent  # train/, or probe/ where no longer run fitted
    assert json.loads((run_dir / "recipe.json").read_text())["data"]["eval_path"] == str(out / "eval")
    assert json.loads((run_dir / "final" / "training_report.json").read_text())["trees_from"] == "dev"
    assert trained["probe"]["steps"] == 4 and trained["probe"]["seconds_per_step"] > 0
    assert trained["steps"] == trained["planned_steps"] and 4 <= trained["steps"] <= 8 and not trained["cut"]
    assert trained["positions_seen"] == 16 * trained["steps"] and generated["seconds"] > 0 and trained["seconds"] > 0
    assert summary["heads"] == trained["heads"] and Path(summary["heads"], "model.safetensors").is_file()
    assert decodes_as_hf(summary["heads"], model)


def test_training_stopped_at_the_budgets_end_leaves_its_last_checkpoints_heads(setup, tmp_path):
    """More steps than the time allows: the trainer is stopped, its last checkpoint finished as
    the heads; generation has no time left and is skipped, the shards there are used as they are."""
    root, model, recipe = setup
    out = tmp_path / "cut"
    assert distill_job.main(["--out", str(out / "job"), "--prompts", str(root / "prompts.jsonl"), "--base",
                             str(root / "base"), "--dtype", "float64", "--heads", str(root / "heads"), "--tree", "3",
                             "--sources", "heads", "--max-new-tokens", "16", "--shard-size", "2", "--batch-size", "8"]) == 0
    args = command(root, recipe, out, 0.35, "--generate-share", "0", "--steps", "100000", "--checkpoint-every", "2",
                   "--grace", "0")
    done = subprocess.run(args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    trained = summary["stages"]["train"]
    assert summary["stages"]["generate"]["shards_built"] == 0 and summary["stages"]["generate"]["shards"] == SHARDS
    assert trained["cut"] and trained["planned_steps"] == 100000 and trained["probe"] is None
    assert 2 <= trained["steps"] < 100000 and trained["steps"] % 2 == 0  # a checkpoint's step
    report = json.loads((Path(summary["heads"]) / "training_report.json").read_text())
    assert report["steps"] == trained["steps"] and report["planned_steps"] == 100000
    assert decodes_as_hf(summary["heads"], model)


@pytest.mark.parametrize("case", ["cuda", "prompts"])
def test_a_missing_device_or_prompt_file_is_one_line_naming_the_fix(setup, tmp_path, case):
    root, _, recipe = setup
    if case == "cuda":
        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA device")
        args = command(root, recipe, tmp_path / "out", 1) + ["--device", "cuda"]
        fix = "--device cpu"
    else:
        args = command(root, recipe, tmp_path / "out", 1) + ["--prompts", str(tmp_path / "none.jsonl")]
        fix = "--prompts FILE"
    done = subprocess.run(args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and fix in err[0]
    assert not (tmp_path / "out").exists()
