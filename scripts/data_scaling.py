"""The data-scaling table and the papers' orderings: head families trained on seeded samples of
the same self-distilled data, each scored on what predicts decoding.

    python scripts/data_scaling.py --recipe recipes/hydra-smollm2.yaml --sizes 400,1200,0 \\
        --eval-job data_cache/eval-clean-smollm2 --out results/data_scaling/hydra [--data.path JOB ...]
    python scripts/data_scaling.py --recipe recipes/{medusa,hydra,hydrapp,amphista,koala-hydra}-smollm2.yaml \\
        --sizes 1200 --eval-job data_cache/eval-clean-smollm2 --out results/data_scaling/orderings --train.epochs 2 ...

Per recipe and size (``data.limit`` sequences, a seeded sample of the job's mixture, the same for
every recipe with the same ``train.seed``; 0 = all of it):

* training: ``python -m draftheads.training.train RECIPE --data.limit N`` into
  ``RUNS/<recipe file's stem>/N`` (resumable: a cut run continues, a finished one is reused);
* MT-Bench head-1 accuracy: teacher-forced top-1/top-5 per head on the base's own answers to
  the evaluation job's prompts (MT-Bench, and all of Spec-Bench dev), not the training sources;
* τ at an 8-node tree on the dev prompts (MT-Bench@1 + Spec-Bench dev @8 of each other task),
  heads alone, batch size 1, 128 new tokens, greedy, in the base's dtype;
* wall time per stage: generation (the job's decoding of the answers this sample uses, scaled
  by the share of its sequences), features (the plain forwards over reused answers; decoded
  answers keep the decoder's states: none), training (the run's own report).

With several recipes, the papers' orderings at each size (Medusa < Hydra < Hydra++, Amphista >
Medusa, KOALA over a family > that family) are checked on the decoded τ and written beside the table;
each family's consecutive rows (more data, or another mixture: ``--data.path "[JOB, JOB]"``) are
compared the same way, and the decoded τ is broken down by Spec-Bench task.

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

# The papers' orderings at one tree size, same data: (lower, higher) by family label.
ORDERINGS = (("Medusa", "Hydra"), ("Hydra", "Hydra++"), ("Medusa", "Amphista"))


def size_order(limit: int) -> float:
    """Sizes in increasing order, 0 (all of the job) last."""
    return limit or float("inf")


def run_dir_of(runs: Path, recipe: str, limit: int) -> Path:
    return runs / Path(recipe).stem / str(limit or "all")


def family_label(recipe: dict) -> str:
    """"Medusa", "Hydra++", "KOALA-Hydra": what a run's recipe trains."""
    from draftheads.heads import display_name
    from draftheads.training.adversarial import koala_label

    family = recipe["heads"]["family"]
    return koala_label(family) if recipe.get("adversarial", {}).get("enabled") else display_name(family)


def orderings(rows: list[dict]) -> list[dict]:
    """Each published ordering that the rows can test, per size, on the decoded τ: the pairs in
    ``ORDERINGS``, and every KOALA-X above X."""
    checks = []
    for limit in sorted({r["limit"] for r in rows}, key=size_order):
        tau = {r["family"]: r["decoded"]["tau"] for r in rows if r["limit"] == limit}
        per_prompt = {r["family"]: r["decoded"]["per_prompt"] for r in rows
                      if r["limit"] == limit and "per_prompt" in r["decoded"]}
        pairs = list(ORDERINGS) + [(f.removeprefix("KOALA-"), f) for f in tau if f.startswith("KOALA-")]
        for low, high in pairs:
            if low in tau and high in tau:
                check = {"limit": limit, "claim": f"{low} < {high}", "low": tau[low], "high": tau[high],
                         "holds": tau[high] > tau[low]}
                if low in per_prompt and high in per_prompt:
                    check["ci95"] = tau_difference_ci(per_prompt[low], per_prompt[high])
                    check["clear"] = check["ci95"][0] > 0 or check["ci95"][1] < 0  # the interval excludes 0
                checks.append(check)
    return checks


def data_steps(rows: list[dict]) -> list[dict]:
    """Each family's consecutive rows (more data, or another mixture of the same size) compared on
    the decoded τ over the same prompts: what a change of data is worth beyond noise."""
    steps = []
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family and "per_prompt" in r["decoded"]]
        for low, high in zip(mine, mine[1:]):
            ci = tau_difference_ci(low["decoded"]["per_prompt"], high["decoded"]["per_prompt"])
            steps.append({"family": family, "from": data_label(low), "to": data_label(high), "low": low["decoded"]["tau"],
                          "high": high["decoded"]["tau"], "ci95": ci, "clear": ci[0] > 0 or ci[1] < 0})
    return steps


def data_label(row: dict) -> str:
    """"2,944 of pool-50 + self-open": the run's sequences and the job folders they came from."""
    return f"{row['sequences']:,} of " + " + ".join(row.get("data", ["?"]))


def train_size(recipe: str, limit: int, runs: Path, overrides: list[str]) -> dict:
    """Train (or resume, or reuse) the run of ``recipe`` on ``limit`` sequences; its training report."""
    run_dir = run_dir_of(runs, recipe, limit)
    report = run_dir / "final" / "training_report.json"
    if not report.is_file():
        command = [sys.executable, "-m", "draftheads.training.train", recipe, "--data.limit", str(limit),
                   "--run.output_dir", str(run_dir), *overrides]
        print(" ".join(command), file=sys.stderr, flush=True)
        subprocess.run(command, check=True)
    return json.loads(report.read_text())


def job_wall_times(jobs: list[Path], share: float) -> dict:
    """Generation and feature seconds of the jobs' shards (their manifests), times ``share`` (the
    run's sequences over the jobs')."""
    generation = features = 0.0
    for manifest in sorted(m for job in jobs for m in job.glob("shards/shard-*/manifest.json")):
        m = json.loads(manifest.read_text())
        if m.get("decoded"):
            generation += float(m.get("seconds", 0.0))
        else:
            features += float(m.get("seconds", 0.0))
    return {"generation_seconds": round(generation * share, 1), "features_seconds": round(features * share, 1)}


def eval_table(eval_job: Path, base, with_prompt: bool, layers: tuple[int, ...] = ()):
    """The evaluation job (MT-Bench and Spec-Bench dev) as one table and its rows per prompt
    source, as a run's per-epoch evaluation reads it (with the states of the base ``layers``
    multi-layer heads read)."""
    from draftheads.decoding.base.loading import dtype_name
    from draftheads.decoding.base.fingerprint import fingerprint
    from draftheads.training.data.job_data import job_eval_table

    return job_eval_table(eval_job, fingerprint(base).to_dict(), dtype_name(base.dtype), with_prompt, layers)


def table_for(report: dict, tables: dict, base, eval_job: str, heads_dir: Path) -> tuple:
    """The evaluation table laid out as this run's heads read it (with the prompt's rows or not,
    with the base layers its checkpoint names)."""
    from draftheads.heads import read_config
    from draftheads.training.data.job_data import reads_prompt
    from draftheads.training.recipe import Recipe, build

    key = (reads_prompt(build(Recipe, report["recipe"])), tuple(read_config(heads_dir).feature_layers))
    if key not in tables:
        tables[key] = eval_table(Path(eval_job), base, *key)
    return tables[key]


def teacher_forced(heads_dir: Path, base, table_groups: tuple) -> dict:
    """Per-head top-1/top-5 and the τ of the heads' 8-node tree and of the fixed 16-node one,
    teacher-forced, on the whole evaluation table (``dev``) and its MT-Bench rows (the evaluation
    job's ``mt_bench`` source): the per-epoch evaluation's scoring."""
    from draftheads.heads import load_heads
    from draftheads.training.evaluation import evaluate_heads

    table, groups = table_groups
    heads = load_heads(heads_dir, dtype=torch.float32)
    heads.bind(base.get_output_embeddings().weight.float(), base.get_input_embeddings().weight.float())
    scores = evaluate_heads(heads, table, {"mt_bench": groups["mt_bench"]}, chunk_length=0)

    def shaped(part: dict) -> dict:
        return {"positions": part["positions"], "accuracy": {"top1": part["top1"], "top5": part["top5"]},
                "tree_tau_8": part["tau"], "tree_tau_fixed16": part["tau_fixed16"]}

    return {"dev": shaped(scores), "mt_bench": shaped(scores["groups"]["mt_bench"])}


def decoded_tau(heads_dir: Path, base, tokenizer, prompts: list[dict], max_new_tokens: int) -> dict:
    """τ of the heads alone at an 8-node tree, bs 1, greedy, over the dev prompts."""
    from draftheads.bench.summary import run_tau
    from draftheads.decoding import DraftHeadsModel
    from draftheads.prompts import chat_input

    model = DraftHeadsModel.from_pretrained(str(heads_dir), base=base, tokenizer=tokenizer, tree=8, sources="heads")
    per_prompt = []  # [new tokens, verification steps] per prompt: what a paired comparison resamples
    started = time.perf_counter()
    for item in prompts:
        ids = chat_input(tokenizer, item["prompt"])
        out = model.generate(ids, max_new_tokens=max_new_tokens)
        per_prompt.append([out.shape[1] - ids.shape[1], model.last_stats.steps])
    tokens, steps = (sum(column) for column in zip(*per_prompt))
    return {"tau": run_tau(tokens, len(prompts), steps), "prompts": len(prompts), "new_tokens": tokens,
            "verify_steps": steps, "seconds": round(time.perf_counter() - started, 1), "per_prompt": per_prompt,
            "per_group": tau_per_group(prompts, per_prompt)}


def tau_per_group(prompts: list[dict], per_prompt: list[list[int]]) -> dict[str, float]:
    """Decoded τ per Spec-Bench task (MT-Bench's categories as one): where a mixture gains or loses."""
    from draftheads.bench.summary import run_tau
    from draftheads.prompts import group_of

    groups: dict[str, list[list[int]]] = {}
    for item, counts in zip(prompts, per_prompt):
        groups.setdefault(group_of(item.get("category", "?")), []).append(counts)
    return {g: round(run_tau(sum(c[0] for c in rows), len(rows), sum(c[1] for c in rows)), 3)
            for g, rows in groups.items()}


def tau_difference_ci(low: list, high: list, draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of τ(high) − τ(low) over the same prompts, by a paired bootstrap of the prompts
    (each draw resamples prompt indices and recomputes both runs' τ on them): what a difference of
    a few hundredths on 48 prompts is worth."""
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.tensor(low, dtype=torch.float64), torch.tensor(high, dtype=torch.float64)  # [prompts, 2]
    picks = torch.randint(0, len(a), (draws, len(a)), generator=gen)  # [draws, prompts]

    def tau(pp: torch.Tensor) -> torch.Tensor:  # run_tau per draw: (tokens − prompts) / steps
        return (pp[picks, 0].sum(1) - len(a)) / pp[picks, 1].sum(1).clamp(min=1)

    diff = tau(b) - tau(a)
    return round(float(diff.quantile(0.025)), 4), round(float(diff.quantile(0.975)), 4)


def markdown(rows: list[dict]) -> str:
    lines = ["| Heads | Sequences | Answer positions | MT-Bench top-1 per head | τ@8 teacher-forced (MT-Bench) | "
             "τ@8 decoded (dev) | Generation | Features | Training |", "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        mt = r["teacher_forced"]["mt_bench"]
        lines.append(f"| {r['family']} | {r['sequences']:,} | {r['positions']:,} | "
                     f"{' / '.join(f'{a:.2f}' for a in mt['accuracy']['top1'])}"
                     f" | {mt['tree_tau_8']:.2f} | {r['decoded']['tau']:.2f} | {r['generation_seconds'] / 60:.0f} min"
                     f" | {r['features_seconds'] / 60:.0f} min | {r['training_seconds'] / 60:.0f} min |")
    checks = orderings(rows)
    if checks:
        lines += ["", "| Sequences | Ordering (decoded τ@8) | τ | Difference, 95 % CI (paired bootstrap of prompts) "
                  "| Holds |", "|---:|---|---|---|---|"]
        lines += [f"| {c['limit'] or 'all'} | {c['claim']} | {c['low']:.2f} vs {c['high']:.2f} | "
                  + (f"{c['high'] - c['low']:+.3f} [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}] | " if "ci95" in c else "— | ")
                  + ("yes" if c["holds"] else "no") + ("" if c.get("clear", True) else " (within noise)") + " |"
                  for c in checks]
    groups = list(dict.fromkeys(g for r in rows for g in r["decoded"].get("per_group", {})))
    if groups:
        lines += ["", "| Heads | Data | " + " | ".join(groups) + " |", "|---|---|" + "---:|" * len(groups)]
        lines += [f"| {r['family']} | {data_label(r)} | " + " | ".join(f"{r['decoded']['per_group'].get(g, 0):.2f}"
                                                                   for g in groups) + " |"
                  for r in rows if "per_group" in r["decoded"]]
    steps = data_steps(rows)
    if steps:
        lines += ["", "| Heads | Data | vs | τ | Difference, 95 % CI (paired bootstrap of prompts) |", "|---|---|---|---|---|"]
        lines += [f"| {c['family']} | {c['to']} | {c['from']} | {c['high']:.2f} vs {c['low']:.2f} | "
                  f"{c['high'] - c['low']:+.3f} [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]"
                  + ("" if c["clear"] else " (within noise)") + " |" for c in steps]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family]
        x = [r["positions"] for r in mine]
        left.plot(x, [r["teacher_forced"]["mt_bench"]["accuracy"]["top1"][0] for r in mine], "o-", label=family)
        right.plot(x, [r["decoded"]["tau"] for r in mine], "o-", label=f"{family}, decoded, dev prompts")
        right.plot(x, [r["teacher_forced"]["mt_bench"]["tree_tau_8"] for r in mine], "s--",
                   label=f"{family}, teacher-forced, MT-Bench")
    left.set(xscale="log", xlabel="training answer positions", ylabel="MT-Bench head-1 top-1 (teacher-forced)")
    left.legend()
    right.set(xscale="log", xlabel="training answer positions", ylabel="τ at an 8-node tree (heads alone)")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, nargs="+", help="one or more recipes, trained on the same samples")
    parser.add_argument("--sizes", default="400,1200,0", help="training sequences per size (0: all)")
    parser.add_argument("--eval-job", required=True, help="the evaluation job's folder (MT-Bench + Spec-Bench dev)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", required=True, help="the table, JSON and chart")
    parser.add_argument("--runs", default="runs/data_scaling", help="the training runs (checkpoints: not for git)")
    args, overrides = parser.parse_known_args(argv)  # the rest: recipe overrides for every size (--train.epochs 2)

    from draftheads.decoding.base.loading import load_base
    from draftheads.prompts import DEV_PROMPTS, read_prompts
    from draftheads.training.data.job_data import DATA_SUMMARY, read_data_summary

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(args.runs)
    reports = {(recipe, int(n)): train_size(recipe, int(n), runs, overrides)
               for recipe in args.recipe for n in args.sizes.split(",")}
    base, tokenizer = load_base(dtype="bfloat16")
    prompts = read_prompts(DEV_PROMPTS)
    tables = {}  # with the prompt's rows or not (training/job_data.reads_prompt): each built once
    rows = []
    for (recipe, limit), report in sorted(reports.items(), key=lambda item: size_order(item[0][1])):
        run_dir = run_dir_of(runs, recipe, limit)
        data = read_data_summary(run_dir)  # what the run trained on
        if data is None:
            raise SystemExit(f"{run_dir / DATA_SUMMARY} is missing or unreadable: train {recipe} there again "
                             "(delete its final/ folder and rerun this command).")
        jobs = [Path(j) for j in data["jobs"]]
        row = {"recipe": recipe, "family": family_label(report["recipe"]), "limit": limit,
               "data": [j.name for j in jobs], "sequences": data["sequences"], "positions": data["answer_positions"],
               "epochs": report["recipe"]["train"]["epochs"], **job_wall_times(jobs, data["share"]),
               "training_seconds": report["train_wall_seconds"],
               "teacher_forced": teacher_forced(run_dir / "final", base,
                                                table_for(report, tables, base, args.eval_job, run_dir / "final")),
               "decoded": decoded_tau(run_dir / "final", base, tokenizer, prompts, args.max_new_tokens)}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    (out / "scaling.json").write_text(json.dumps({"recipes": args.recipe, "sizes": args.sizes, "overrides": overrides,
                                                  "rows": rows, "orderings": orderings(rows),
                                                  "data_steps": data_steps(rows),
                                                  "command": " ".join(sys.argv)}, indent=1) + "\n")
    (out / "table.md").write_text(markdown(rows))
    plot(rows, out / "scaling.png")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
