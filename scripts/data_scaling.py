"""The data-scaling table: one head family trained on growing samples of the same
self-distilled data, each scored on what predicts decoding.

    python scripts/data_scaling.py --recipe recipes/hydra-smollm2.yaml --sizes 400,1200,0 \\
        --eval-job data_cache/eval-smollm2 --out results/data_scaling/hydra [--data.path JOB ...]

Per size (``data.limit`` sequences, a seeded sample of the job's mixture; 0 = all of it):

* training: ``python -m draftheads.training.train RECIPE --data.limit N`` into ``OUT/runs/N``
  (resumable: a cut run continues, a finished one is reused);
* MT-Bench head-1 accuracy: teacher-forced top-1/top-5 per head on the base's own answers to
  the evaluation job's prompts (MT-Bench, and all of Spec-Bench dev), not the training sources;
* τ at an 8-node tree on the dev prompts (MT-Bench@1 + Spec-Bench dev @8 of each other task),
  heads alone, batch size 1, 128 new tokens, greedy, in the base's dtype;
* wall time per stage: generation (the job's decoding of the answers this sample uses, scaled
  by the share of its sequences), features (the plain forwards over reused answers; decoded
  answers keep the decoder's states: none), training (the run's own report).

Writes ``OUT/scaling.json``, ``OUT/table.md`` and ``OUT/scaling.png``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

DEV_PROMPTS = ["mt-bench@1", "spec-bench@8:translation,summarization,qa,math_reasoning,rag"]


def run_dir_of(runs: Path, limit: int) -> Path:
    return runs / str(limit or "all")


def train_size(recipe: str, limit: int, runs: Path, overrides: list[str]) -> dict:
    """Train (or resume, or reuse) the run for ``limit`` sequences; its training report."""
    run_dir = run_dir_of(runs, limit)
    report = run_dir / "final" / "training_report.json"
    if not report.is_file():
        command = [sys.executable, "-m", "draftheads.training.train", recipe, "--data.limit", str(limit),
                   "--run.output_dir", str(run_dir), *overrides]
        print(" ".join(command), file=sys.stderr, flush=True)
        subprocess.run(command, check=True)
    return json.loads(report.read_text())


def job_wall_times(job: Path, share: float) -> dict:
    """Generation and feature seconds of the job's shards (their manifests), times ``share`` (the
    run's sequences over the job's)."""
    generation = features = 0.0
    for manifest in sorted(job.glob("shards/shard-*/manifest.json")):
        m = json.loads(manifest.read_text())
        if m.get("decoded"):
            generation += float(m.get("seconds", 0.0))
        else:
            features += float(m.get("seconds", 0.0))
    return {"generation_seconds": round(generation * share, 1), "features_seconds": round(features * share, 1)}


def eval_table(eval_job: Path, base, with_prompt: bool):
    """The evaluation job (MT-Bench and Spec-Bench dev) as one table and its rows per prompt
    source, as a run's per-epoch evaluation reads it."""
    from draftheads.decoding.base.loading import dtype_name
    from draftheads.decoding.fingerprint import fingerprint
    from draftheads.training.job_data import job_eval_table

    return job_eval_table(eval_job, fingerprint(base).to_dict(), dtype_name(base.dtype), with_prompt)


def teacher_forced(heads_dir: Path, base, table_groups: tuple) -> dict:
    """Per-head top-1/top-5 and the τ of the heads' 8-node tree, teacher-forced, on the whole
    evaluation table (``dev``) and its MT-Bench rows: the per-epoch evaluation's scoring."""
    from draftheads.heads import load_heads
    from draftheads.training.evaluation import evaluate_heads

    table, groups = table_groups
    heads = load_heads(heads_dir, dtype=torch.float32)
    heads.bind(base.get_output_embeddings().weight.float(), base.get_input_embeddings().weight.float())
    scores = evaluate_heads(heads, table, {"mt_bench": groups["mt_bench"]}, chunk_length=0)

    def shaped(part: dict) -> dict:
        return {"positions": part["positions"], "accuracy": {"top1": part["top1"], "top5": part["top5"]},
                "tree_tau_8": part["tau"]}

    return {"dev": shaped(scores), "mt_bench": shaped(scores["groups"]["mt_bench"])}


def decoded_tau(heads_dir: Path, base, tokenizer, prompts: list[dict], max_new_tokens: int) -> dict:
    """τ of the heads alone at an 8-node tree, bs 1, greedy, over the dev prompts."""
    from draftheads.bench.summary import run_tau
    from draftheads.decoding import DraftHeadsModel
    from draftheads.prompts import chat_input

    model = DraftHeadsModel.from_pretrained(str(heads_dir), base=base, tokenizer=tokenizer, tree=8, sources="heads")
    tokens = steps = 0
    started = time.perf_counter()
    for item in prompts:
        ids = chat_input(tokenizer, item["prompt"])
        out = model.generate(ids, max_new_tokens=max_new_tokens)
        tokens += out.shape[1] - ids.shape[1]
        steps += model.last_stats.steps
    return {"tau": run_tau(tokens, len(prompts), steps), "prompts": len(prompts), "new_tokens": tokens,
            "verify_steps": steps, "seconds": round(time.perf_counter() - started, 1)}


def markdown(rows: list[dict]) -> str:
    lines = ["| Sequences | Answer positions | MT-Bench top-1 per head | τ@8 teacher-forced (MT-Bench) | "
             "τ@8 decoded (dev) | Generation | Features | Training |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        mt = r["teacher_forced"]["mt_bench"]
        lines.append(f"| {r['sequences']:,} | {r['positions']:,} | {' / '.join(f'{a:.2f}' for a in mt['accuracy']['top1'])}"
                     f" | {mt['tree_tau_8']:.2f} | {r['decoded']['tau']:.2f} | {r['generation_seconds'] / 60:.0f} min"
                     f" | {r['features_seconds'] / 60:.0f} min | {r['training_seconds'] / 60:.0f} min |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["positions"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for head in range(len(rows[0]["teacher_forced"]["mt_bench"]["accuracy"]["top1"])):
        left.plot(x, [r["teacher_forced"]["mt_bench"]["accuracy"]["top1"][head] for r in rows], "o-",
                  label=f"head {head + 1}")
    left.set(xscale="log", xlabel="training answer positions", ylabel="MT-Bench top-1 (teacher-forced)")
    left.legend()
    right.plot(x, [r["decoded"]["tau"] for r in rows], "o-", label="decoded, dev prompts")
    right.plot(x, [r["teacher_forced"]["mt_bench"]["tree_tau_8"] for r in rows], "s--", label="teacher-forced, MT-Bench")
    right.set(xscale="log", xlabel="training answer positions", ylabel="τ at an 8-node tree (heads alone)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--sizes", default="400,1200,0", help="training sequences per size (0: all)")
    parser.add_argument("--eval-job", required=True, help="the evaluation job's folder (MT-Bench + Spec-Bench dev)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", required=True, help="the table, JSON and chart")
    parser.add_argument("--runs", default="runs/data_scaling", help="the training runs (checkpoints: not for git)")
    args, overrides = parser.parse_known_args(argv)  # the rest: recipe overrides for every size (--train.epochs 2)

    from draftheads.decoding.base.loading import load_base
    from draftheads.prompts import read_prompts

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.runs)
    reports = {int(n): train_size(args.recipe, int(n), runs, overrides) for n in args.sizes.split(",")}
    base, tokenizer = load_base(dtype="bfloat16")
    prompts = read_prompts(DEV_PROMPTS)
    contextual = any(r["recipe"]["heads"].get("extra", {}).get("prefix_context") == "sequence" for r in reports.values())
    tables = eval_table(Path(args.eval_job), base, contextual)
    rows = []
    for limit, report in sorted(reports.items(), key=lambda item: item[0] or float("inf")):
        run_dir = run_dir_of(runs, limit)
        job = Path(report["recipe"]["data"]["path"] if isinstance(report["recipe"]["data"]["path"], str)
                   else report["recipe"]["data"]["path"][0])
        data = json.loads((run_dir / "data.json").read_text())  # what the run trained on (training/job_data.py)
        row = {"limit": limit, "sequences": data["sequences"], "positions": data["answer_positions"],
               "epochs": report["recipe"]["train"]["epochs"], **job_wall_times(job, data["share"]),
               "training_seconds": report["train_wall_seconds"],
               "teacher_forced": teacher_forced(run_dir / "final", base, tables),
               "decoded": decoded_tau(run_dir / "final", base, tokenizer, prompts, args.max_new_tokens)}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    (out / "scaling.json").write_text(json.dumps({"recipe": args.recipe, "sizes": args.sizes, "overrides": overrides,
                                                  "rows": rows,
                                                  "command": " ".join(sys.argv)}, indent=1) + "\n")
    (out / "table.md").write_text(markdown(rows))
    plot(rows, out / "scaling.png")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
