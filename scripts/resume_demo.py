"""Exact resume on the real base: train a recipe for N steps twice — once straight through, once
SIGKILLed from outside mid-run and relaunched — and compare the final loss and head weights.

    python scripts/resume_demo.py recipes/medusa-smollm2.yaml --steps 60 --every 20 --kill-after 47

The killed run is stopped by the operating system (``kill -9`` from this script, as an OOM killer
or a pre-empted node would), not by a hook inside the trainer; the relaunch is the same command.
Writes ``<out>/resume_demo.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch


def train_command(recipe: str, run_dir: Path, steps: int, every: int) -> list[str]:
    return [sys.executable, "-m", "draftheads.training.train", recipe, "--train.max_steps", str(steps),
            "--run.checkpoint_every", str(every), "--run.eval_every", str(10 * steps), "--run.wandb", "false",
            "--run.output_dir", str(run_dir), "--run.final_dir", str(run_dir / "final"), "--run.log_every", "1"]


def logged_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "log.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def run_and_kill(command: list[str], run_dir: Path, kill_after: int, env: dict) -> int:
    """Start training and SIGKILL it once the log shows step ``kill_after``."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while process.poll() is None:
        if any(r["step"] >= kill_after for r in logged_steps(run_dir)):
            os.kill(process.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    return process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20, help="checkpoint every N optimizer steps")
    parser.add_argument("--kill-after", type=int, default=47)
    parser.add_argument("--out", default="runs/resume-demo")
    args = parser.parse_args(argv)
    out = Path(args.out)
    env = dict(os.environ, TQDM_DISABLE="1")
    whole, killed = out / "whole", out / "killed"
    for d in (whole, killed):
        if d.exists():
            raise SystemExit(f"{d} exists: remove {out} first (the demo needs fresh runs).")

    started = time.perf_counter()
    subprocess.run(train_command(args.recipe, whole, args.steps, args.every), env=env, check=True,
                   stdout=subprocess.DEVNULL)
    whole_seconds = time.perf_counter() - started
    code = run_and_kill(train_command(args.recipe, killed, args.steps, args.every), killed, args.kill_after, env)
    checkpoints = sorted(p.name for p in (killed / "checkpoints").iterdir())
    last_logged = max((r["step"] for r in logged_steps(killed)), default=0)
    resumed = subprocess.run(train_command(args.recipe, killed, args.steps, args.every), env=env, check=True,
                             capture_output=True, text=True)
    note = [line for line in (resumed.stdout + resumed.stderr).splitlines() if "resumed from" in line]

    from safetensors.torch import load_file

    a, b = load_file(str(whole / "final" / "model.safetensors")), load_file(str(killed / "final" / "model.safetensors"))
    ra = json.loads((whole / "final" / "training_report.json").read_text())
    rb = json.loads((killed / "final" / "training_report.json").read_text())
    result = {
        "recipe": args.recipe, "steps": args.steps, "checkpoint_every": args.every,
        "last_logged_step_when_killed": last_logged if code == -9 else None,
        "kill_exit_code": code, "checkpoints_when_killed": checkpoints, "resume_message": note,
        "final_loss_uninterrupted": ra["final_loss"], "final_loss_resumed": rb["final_loss"],
        "final_loss_abs_diff": abs(ra["final_loss"] - rb["final_loss"]),
        "max_abs_weight_diff": max((a[k].float() - b[k].float()).abs().max().item() for k in a),
        "eval_uninterrupted": ra["accuracy"], "eval_resumed": rb["accuracy"],
        "uninterrupted_seconds": round(whole_seconds, 1), "torch_threads": torch.get_num_threads(),
    }
    (out / "resume_demo.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if result["final_loss_abs_diff"] < 1e-6 and result["max_abs_weight_diff"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
