"""Head checkpoints against a reference, in one process, on the same prompts: what a change of the
heads (more base layers read, another objective) is worth beyond noise.

    python scripts/paired_heads.py checkpoints/smollm2-135m-hydra runs/layers/last/final \\
        runs/layers/fused/final --eval-job data_cache/eval-clean-smollm2-layers --out results/heads/layers

Per checkpoint (the first is the reference every other one is compared with):

* decoded: heads alone (``sources="heads"``), bs 1, greedy, ``--max-new-tokens``, in ``--dtype``, on the
  dev prompts the bench decodes (:data:`~draftheads.prompts.DEV_PROMPTS`), at the checkpoint's own
  8-node tree (chosen by its training on its evaluation split) and at the fixed 16-node depth-4 tree
  (:data:`~draftheads.training.evaluation.FIXED_TREE_16`, the same for every checkpoint, so every head
  counts); τ per run and, against the reference, the 95 % paired bootstrap interval of the difference
  (``scripts/data_scaling.py`` :func:`tau_difference_ci`);
* teacher-forced on the evaluation job (``--eval-job``, the base's answers to the clean split,
  :data:`~draftheads.prompts.CLEAN_EVAL_PROMPTS`): per-head top-1/top-5, τ at the 8-node tree and at
  the fixed 16-node one, as a run's per-epoch evaluation scores them.

Writes ``OUT/paired.json``, ``OUT/table.md`` and ``OUT/paired.png``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent


def data_scaling():
    """``scripts/data_scaling.py`` (scripts are not a package): its decoded τ and paired interval."""
    spec = importlib.util.spec_from_file_location("data_scaling", SCRIPTS / "data_scaling.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def decoded(heads_dir: Path, base, tokenizer, prompts: list[dict], tree, max_new_tokens: int) -> dict:
    """τ of the heads alone at ``tree`` (a node budget: the checkpoint's stored tree; or a Tree) over ``prompts``."""
    from draftheads.bench.summary import run_tau
    from draftheads.decoding import DraftHeadsModel
    from draftheads.prompts import chat_input

    model = DraftHeadsModel.from_pretrained(str(heads_dir), base=base, tokenizer=tokenizer, tree=tree, sources="heads")
    per_prompt, started = [], time.perf_counter()
    for item in prompts:
        ids = chat_input(tokenizer, item["prompt"])
        out = model.generate(ids, max_new_tokens=max_new_tokens)
        per_prompt.append([out.shape[1] - ids.shape[1], model.last_stats.steps])
    tokens, steps = (sum(column) for column in zip(*per_prompt))
    return {"tau": run_tau(tokens, len(prompts), steps), "new_tokens": tokens, "verify_steps": steps,
            "seconds": round(time.perf_counter() - started, 1), "per_prompt": per_prompt}


def teacher_forced(heads_dir: Path, base, eval_job: Path) -> dict:
    """Per-head top-1/top-5 and τ (the checkpoint's 8-node tree, the fixed 16-node one) on the job's answers."""
    from draftheads.decoding.base.fingerprint import fingerprint
    from draftheads.decoding.base.loading import dtype_name
    from draftheads.heads import load_heads
    from draftheads.training.data.job_data import job_eval_table
    from draftheads.training.evaluation import evaluate_heads

    heads = load_heads(heads_dir, dtype=torch.float32)
    heads.bind(base.get_output_embeddings().weight.float(), base.get_input_embeddings().weight.float())
    # heads whose layer reads the prompt (EAGLE-3, Hydra++ "sequence") read each answer after its prompt's rows
    table, _ = job_eval_table(eval_job, fingerprint(base).to_dict(), dtype_name(base.dtype), heads.context_from_prompt,
                              heads.feature_layers)
    scores = evaluate_heads(heads, table, None, chunk_length=0)
    return {"positions": scores["positions"], "top1": scores["top1"], "top5": scores["top5"],
            "tau_8": scores["tau"], "tau_fixed16": scores["tau_fixed16"]}


def markdown(rows: list[dict], trees: list[str]) -> str:
    head = ("| checkpoint | layers read | teacher-forced top-1 (heads 1–4) | τ@8 / τ@16 teacher-forced | "
            + " | ".join(f"decoded τ ({t}) [Δ vs ref, 95 %]" for t in trees) + " |")
    lines = [head, "|" + "---|" * (4 + len(trees))]
    for row in rows:
        tf = row["teacher_forced"]
        cells = []
        for t in trees:
            d = row["decoded"][t]
            cells.append(f"{d['tau']:.3f}" + (f" [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]" if "ci95" in d else " (ref)"))
        lines.append(f"| {row['name']} | {row['layers'] or 'final state'} | "
                     f"{' / '.join(f'{a:.3f}' for a in tf['top1'])} | {tf['tau_8']:.3f} / {tf['tau_fixed16']:.3f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], trees: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        taus = [row["decoded"][t]["tau"] for t in trees]
        ax.bar([x + i * width for x in range(len(trees))], taus, width, label=row["name"])
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(trees))], trees)
    ax.set_ylabel("decoded τ (heads alone, dev prompts)")
    ax.set_ylim(1.0, None)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", type=Path, help="head checkpoints; the first is the reference")
    parser.add_argument("--eval-job", type=Path, required=True, help="the clean split's evaluation job (with the layers read)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="the first N dev prompts only")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from draftheads.decoding import load_base
    from draftheads.decoding.tree import tree_from_paths
    from draftheads.heads import read_config
    from draftheads.prompts import DEV_PROMPTS, read_prompts
    from draftheads.training.evaluation import FIXED_TREE_16

    scaling = data_scaling()
    base, tokenizer = load_base(dtype=args.dtype)
    prompts = read_prompts(list(DEV_PROMPTS), args.limit)
    trees = {"own 8-node": 8, "fixed 16-node depth 4": tree_from_paths([tuple(p) for p in FIXED_TREE_16])}
    rows = []
    for path in args.checkpoints:
        row = {"name": str(path), "layers": read_config(path).feature_layers,
               "teacher_forced": teacher_forced(path, base, args.eval_job), "decoded": {}}
        for name, tree in trees.items():
            row["decoded"][name] = decoded(path, base, tokenizer, prompts, tree, args.max_new_tokens)
            if rows:
                reference = rows[0]["decoded"][name]["per_prompt"]
                row["decoded"][name]["ci95"] = scaling.tau_difference_ci(reference, row["decoded"][name]["per_prompt"])
        print(json.dumps({k: v for k, v in row.items() if k != "decoded"} | {
            "decoded": {t: {k: v for k, v in d.items() if k != "per_prompt"} for t, d in row["decoded"].items()}}),
            file=sys.stderr, flush=True)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype,
            "prompts": list(DEV_PROMPTS), "limit": args.limit, "max_new_tokens": args.max_new_tokens,
            "eval_job": str(args.eval_job), "command": " ".join(["python", "scripts/paired_heads.py", *sys.argv[1:]])}
    (args.out / "paired.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (args.out / "table.md").write_text(markdown(rows, list(trees)))
    plot(rows, list(trees), args.out / "paired.png")
    print(markdown(rows, list(trees)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
