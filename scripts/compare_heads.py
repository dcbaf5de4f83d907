"""Compare head checkpoints in one run, on the same prompts, with the base loaded once.

    OMP_NUM_THREADS=1 python scripts/compare_heads.py                       # every checkpoints/*/
    OMP_NUM_THREADS=1 python scripts/compare_heads.py checkpoints/smollm2-135m-hydra \\
        checkpoints/smollm2-135m-medusa --per-category 1 --categories writing,translation

Per checkpoint:

* accuracy: per-head top-1/top-5, teacher-forced on the base's own greedy answers to held-out
  prompts (MT-Bench, via :mod:`draftheads.head_scoring`, the same scoring as eval_heads.py),
  next to the held-out accuracy its training_report.json records;
* speed: τ and wall-clock speedup at batch size 1, greedy, against HF ``generate`` in the same
  dtype, on MT-Bench and on each Spec-Bench category. The HF baseline runs once per prompt and
  every checkpoint right after it, so all see the same machine state; every output is checked
  token by token against HF (``bench.divergence`` flags near-ties);
* drafting latency: ms per step of ``heads.propose`` (+ the HeadState step for contextual
  families) on real hidden states along a real greedy decode, next to the verify forward;
* parameters (the heads' own, not the frozen base), family label, tree, train time/throughput.

Writes ``results.json`` (everything, per prompt and aggregated), ``table.md`` (README-ready)
and ``chart.png`` to ``--out``; prints progress, then the table.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from draftheads.bench import hf_greedy, summarize, timed_draftheads, timed_hf
from draftheads.prompts import chat_input, read_prompts
from draftheads.decoding import DraftHeadsModel, Tree, load_base
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.decoding.step import PhaseTimer
from draftheads.head_scoring import answer_features, answers_cache_path, base_answers, score_heads
from draftheads.heads import HeadConfig, display_name, load_heads, read_config
from draftheads.plots import plot_chart
from draftheads.training.adversarial import koala_label

REPO = Path(__file__).resolve().parents[1]
# Spec-Bench's first 80 records are MT-Bench (its "multi-turn conversation" task, first turns).
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GROUP_ORDER = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
DASH = "—"
Log = Callable[[str], None]


@dataclass
class Candidate:
    """One checkpoint under comparison, loaded on the shared base."""

    name: str
    path: Path
    model: DraftHeadsModel
    budget: int  # the stored tree budget in use (its number of draft nodes)


def log_stdout(message: str) -> None:
    print(message, flush=True)


# -- what each checkpoint is ---------------------------------------------------------------------------
def group_of(category: str) -> str:
    """Spec-Bench category group: MT-Bench's eight categories count as one task."""
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def family_label(config: HeadConfig) -> str:
    """Display name; KOALA variants (``config.koala``) keep their family's name behind a prefix."""
    return koala_label(config.family) if config.koala else display_name(config.family)


def head_parameters(heads: torch.nn.Module) -> int:
    """Trainable head parameters only: the frozen LM head/embeddings are bound, not owned."""
    return sum(p.numel() for p in heads.parameters())


def training_summary(directory: Path, config: HeadConfig) -> dict:
    """Train time, throughput and held-out accuracy from training_report.json (both the
    trainer's layout and the older Medusa script's ``stats``); None where it is not recorded."""
    path = directory / "training_report.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    stats = report.get("stats", {})
    return {"train_seconds": report.get("train_wall_seconds", stats.get("train_seconds")),
            "train_positions_per_second": report.get("train_tokens_per_second", stats.get("positions_per_second")),
            "held_out_positions": report.get("held_out_positions"),
            "held_out_accuracy": report.get("accuracy") or config.extra.get("held_out_accuracy")}


def load_candidates(base, tokenizer, paths: list[Path], tree: int | None) -> list[Candidate]:
    """Every checkpoint on the one base; ``tree`` overrides each checkpoint's default budget."""
    candidates, names = [], set()
    for path in paths:
        config = read_config(path)
        wanted = tree if tree is not None else int(config.default_budget)
        model = DraftHeadsModel.from_pretrained(path, base=base, tokenizer=tokenizer, tree=wanted)
        name = path.name if path.name not in names else str(path)
        names.add(name)
        candidates.append(Candidate(name, path, model, len(current_tree(model).paths)))
    return candidates


def current_tree(model: DraftHeadsModel) -> Tree:
    return model.policy.choose(1, 0)


def describe(candidate: Candidate) -> dict:
    config = candidate.model.heads.config
    return {"path": str(candidate.path), "family": config.family, "label": family_label(config),
            "parameters": head_parameters(candidate.model.heads), "num_heads": config.num_heads,
            "num_layers": config.num_layers, "tree_budget": candidate.budget,
            "tree_nodes": current_tree(candidate.model).num_nodes,
            "training": training_summary(candidate.path, config)}


# -- teacher-forced accuracy ---------------------------------------------------------------------------
def accuracy_section(base, tokenizer, candidates: list[Candidate], prompts: list[dict], max_new_tokens: int,
                     cache: Path | None, log: Log) -> dict:
    """Every checkpoint scored on the same extracted positions (heads in float32)."""
    log(f"accuracy: base answers to {len(prompts)} held-out prompts ({max_new_tokens} tokens, cache {cache})")
    answers = base_answers(base, tokenizer, prompts, max_new_tokens, cache)
    tables = {}  # the answers' features per set of base layers the heads read, extracted once each
    fp = fingerprint(base).to_dict()
    out = {}
    for c in candidates:
        heads = load_heads(c.path, expected_fingerprint=fp)
        if heads.feature_layers not in tables:
            tables[heads.feature_layers] = answer_features(base, tokenizer, answers, heads.feature_layers)
        scored = score_heads(heads, base, tables[heads.feature_layers])
        scored["tree_tau_used"] = scored["tree_tau"].get(str(c.budget))
        out[c.name] = scored
        log(f"  {c.name}: top-1 {scored['accuracy']['top1']}  top-5 {scored['accuracy']['top5']}  "
            f"teacher-forced τ (tree {c.budget}) {scored['tree_tau_used']}")
    return out


# -- drafting latency ----------------------------------------------------------------------------------
@torch.no_grad()
def step_latency(model: DraftHeadsModel, ids: torch.Tensor, steps: int, warmup: int = 2) -> dict:
    """Per-step timings along a real greedy decode of ``ids`` (the heads read real hidden states
    and contextual families a real, growing context), from the loop's own ``decode_step`` phases
    (the step the cost model and the decoder run): drafting = propose + the heads' context step;
    verify = base forward over the tree + LM head. Means over ``steps`` steps after ``warmup``."""
    model.generate(ids, max_new_tokens=max(2, warmup))
    timer = PhaseTimer()
    model.generate(ids, max_new_tokens=steps, timer=timer)
    phases = timer.per_step()
    stats = model.last_stats
    return {"steps": timer.steps, "tree_nodes": current_tree(model).num_nodes,
            "drafting_ms": round(phases["propose"] + phases["context"], 3), "propose_ms": round(phases["propose"], 3),
            "context_step_ms": round(phases["context"], 3),
            "verify_ms_mean": round(phases["forward"] + phases["lm_head"], 3),
            "phases_ms": {k: round(v, 3) for k, v in phases.items()}, "tau_in_run": round(stats.tau, 3)}


def latency_section(candidates: list[Candidate], ids: torch.Tensor, steps: int, log: Log) -> dict:
    log(f"drafting latency: {steps} steps per checkpoint on a {ids.shape[1]}-token prompt")
    out = {}
    for c in candidates:
        out[c.name] = step_latency(c.model, ids, steps)
        log(f"  {c.name}: drafting {out[c.name]['drafting_ms']:.2f} ms/step "
            f"(propose {out[c.name]['propose_ms']:.2f} + context {out[c.name]['context_step_ms']:.2f}), "
            f"verify {out[c.name]['verify_ms_mean']:.2f} ms/step ({out[c.name]['tree_nodes']} nodes)")
    return out


# -- speed vs HF generate -----------------------------------------------------------------------------
def run_prompt(base, tokenizer, candidates: list[Candidate], item: dict, max_new_tokens: int) -> dict:
    """HF once, then every checkpoint right after it (same machine state for all)."""
    ids = chat_input(tokenizer, item["prompt"])
    plain, hf = timed_hf(base, ids, max_new_tokens)
    return {"id": item["id"], "category": item["category"], "group": group_of(item["category"]),
            "prompt_tokens": ids.shape[1], "hf": hf,
            "checkpoints": {c.name: timed_draftheads(c.model, ids, plain, hf, max_new_tokens) for c in candidates}}


def warm_up(base, tokenizer, candidates: list[Candidate], prompt: str) -> None:
    """First calls pay one-off costs (allocations, lazy init): keep them out of the timings."""
    ids = chat_input(tokenizer, prompt)
    hf_greedy(base, ids, 4)
    for c in candidates:
        c.model.generate(ids, max_new_tokens=4)


def speed_section(base, tokenizer, candidates: list[Candidate], prompts: list[dict], max_new_tokens: int,
                  log: Log) -> list[dict]:
    log(f"speed: {len(prompts)} prompts x (HF + {len(candidates)} checkpoints), {max_new_tokens} new tokens, bs 1")
    warm_up(base, tokenizer, candidates, prompts[0]["prompt"])
    rows = []
    for index, item in enumerate(prompts):
        row = run_prompt(base, tokenizer, candidates, item, max_new_tokens)
        rows.append(row)
        parts = [f"{name} τ {e['tau']:.2f} {e['speedup']:.2f}x{' MISMATCH' if e['mismatch'] else ''}"
                 for name, e in row["checkpoints"].items()]
        log(f"[{index + 1}/{len(prompts)}] {item['category']} id={item['id']}  HF {row['hf']['tokens_per_second']:.1f}"
            f" tok/s | " + " | ".join(parts))
    return rows


def bench_rows(rows: list[dict], name: str, keep: Callable[[dict], bool] = lambda r: True) -> list[dict]:
    """One checkpoint's view of the interleaved rows, in the layout ``bench.summarize`` reads."""
    return [{"id": r["id"], "category": r["category"], "hf": r["hf"], "draftheads": r["checkpoints"][name],
             "mismatch": r["checkpoints"][name]["mismatch"]} for r in rows if keep(r)]


def aggregate(rows: list[dict], name: str) -> dict:
    """τ/speedup/mismatches over all prompts (Spec-Bench overall), per group, per category."""
    groups = [g for g in GROUP_ORDER if any(r["group"] == g for r in rows)]
    groups += sorted({r["group"] for r in rows} - set(groups))
    categories = list(dict.fromkeys(r["category"] for r in rows))
    return {"overall": summarize(bench_rows(rows, name)),
            "groups": {g: summarize(bench_rows(rows, name, lambda r, g=g: r["group"] == g)) for g in groups},
            "categories": {c: summarize(bench_rows(rows, name, lambda r, c=c: r["category"] == c))
                           for c in categories}}


# -- the whole comparison -----------------------------------------------------------------------------
def compare(base, tokenizer, checkpoints: list[Path], prompts: list[dict], accuracy_prompts: list[dict],
            out_dir: Path, *, max_new_tokens: int = 96, accuracy_max_new_tokens: int = 128,
            answers_cache: Path | None = None, tree: int | None = None, latency_steps: int = 16,
            meta: dict | None = None, log: Log = log_stdout) -> dict:
    """Run every section on an already-loaded base; write results.json, table.md, chart.png."""
    if not prompts:
        raise SystemExit("error: no prompts selected (check --categories / --per-category).")
    candidates = load_candidates(base, tokenizer, checkpoints, tree)
    log(f"{len(candidates)} checkpoints: " + ", ".join(f"{c.name} ({family_label(c.model.heads.config)}, tree "
                                                         f"{c.budget})" for c in candidates))
    accuracy = accuracy_section(base, tokenizer, candidates, accuracy_prompts, accuracy_max_new_tokens,
                                answers_cache, log)
    latency = latency_section(candidates, chat_input(tokenizer, prompts[0]["prompt"]), latency_steps, log)
    rows = speed_section(base, tokenizer, candidates, prompts, max_new_tokens, log)
    results = {"meta": {**(meta or {}), "dtype": str(base.dtype).replace("torch.", ""),
                        "max_new_tokens": max_new_tokens, "prompts": len(prompts),
                        "accuracy_prompts": len(accuracy_prompts), "accuracy_max_new_tokens": accuracy_max_new_tokens,
                        "latency_steps": latency_steps, "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine()},
               "checkpoints": {c.name: {**describe(c), "accuracy": accuracy[c.name], "latency": latency[c.name],
                                        "speed": aggregate(rows, c.name)} for c in candidates},
               "per_prompt": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "table.md").write_text(render_tables(results))
    plot_chart(results, out_dir / "chart.png")
    log(f"wrote {out_dir / 'results.json'}, {out_dir / 'table.md'}, {out_dir / 'chart.png'}")
    return results


# -- rendering ------------------------------------------------------------------------------------------
def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return DASH if value is None else f"{value:{spec}}{suffix}"


def fmt_params(count: int) -> str:
    return f"{count / 1e6:.2f}M" if count >= 1e6 else f"{count / 1e3:.1f}K" if count >= 1e3 else str(count)


def fmt_train(training: dict) -> str:
    seconds, rate = training.get("train_seconds"), training.get("train_positions_per_second")
    if seconds is None:
        return DASH
    span = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
    return span + (f" @ {rate:.0f} pos/s" if rate is not None else "")


def fmt_heads(values: list[float] | None) -> str:
    return DASH if not values else " / ".join(f"{v:.2f}" for v in values)


def group_cell(speed: dict, group: str, key: str, spec: str, suffix: str = "") -> str:
    summary = speed["groups"].get(group) if group != "overall" else speed["overall"]
    return DASH if summary is None else fmt(summary[key], spec, suffix)


def render_tables(results: dict) -> str:
    """Markdown for the README: the main table, accuracy detail, τ per Spec-Bench category."""
    meta, entries = results["meta"], results["checkpoints"]
    lines = [f"Batch size 1, greedy, {meta['dtype']}, {meta['max_new_tokens']} new tokens, {meta['prompts']} prompts, "
             f"{meta['threads']} thread(s) on {meta['machine']}; speedup = tokens/s vs HF `generate` on the same prompts. "
             f"Top-1 per head: held-out split of the training data (training_report.json).", "",
             "| Checkpoint | Family | Params | Train time | Tree (nodes) | Held-out top-1 per head | MT-Bench τ | "
             "MT-Bench speedup | Spec-Bench τ | Spec-Bench speedup | Drafting ms/step | Verify ms/step | Mismatches |",
             "|---|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, e in entries.items():
        speed, held = e["speed"], e["training"]["held_out_accuracy"]
        mism = speed["overall"]["mismatching_prompts"]
        lines.append(" | ".join([
            f"| {name}", e["label"], fmt_params(e["parameters"]), fmt_train(e["training"]),
            f"{e['tree_budget']} ({e['tree_nodes']})", fmt_heads(held["top1"] if held else None),
            group_cell(speed, "mt_bench", "tau", ".2f"), group_cell(speed, "mt_bench", "speedup", ".2f", "x"),
            group_cell(speed, "overall", "tau", ".2f"), group_cell(speed, "overall", "speedup", ".2f", "x"),
            fmt(e["latency"]["drafting_ms"]), fmt(e["latency"]["verify_ms_mean"], ".1f"),
            f"{mism}/{speed['overall']['prompts']}" + (f" ({speed['overall']['divergences_outside_band']} outside the dtype's band)"
                                                      if mism else "") + " |"]))
    source = f" ({Path(meta['accuracy_prompts_file']).name})" if meta.get("accuracy_prompts_file") else ""
    lines += ["", f"Per-head accuracy, teacher-forced on the base's own greedy answers to {meta['accuracy_prompts']} "
              f"held-out prompts{source}, {meta['accuracy_max_new_tokens']} tokens each, vs the training report:", "",
              "| Checkpoint | Top-1 per head | Top-5 per head | Held-out top-5 (report) | Teacher-forced τ of the tree |",
              "|---|---|---|---|---:|"]
    for name, e in entries.items():
        acc, held = e["accuracy"]["accuracy"], e["training"]["held_out_accuracy"]
        lines.append(f"| {name} | {fmt_heads(acc['top1'])} | {fmt_heads(acc['top5'])} | "
                     f"{fmt_heads(held['top5'] if held else None)} | {fmt(e['accuracy']['tree_tau_used'])} |")
    groups = list(next(iter(entries.values()))["speed"]["groups"]) if entries else []
    lines += ["", "τ (speedup) per Spec-Bench category (mt_bench = MT-Bench's 8 categories):", "",
              "| Checkpoint | " + " | ".join(groups + ["overall"]) + " |", "|---|" + "---:|" * (len(groups) + 1)]
    for name, e in entries.items():
        cells = [f"{group_cell(e['speed'], g, 'tau', '.2f')} ({group_cell(e['speed'], g, 'speedup', '.2f', 'x')})"
                 for g in groups + ["overall"]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- command line -----------------------------------------------------------------------------------------
def select_prompts(records: list[dict], per_category: int, categories: list[str] | None) -> list[dict]:
    """The first ``per_category`` prompts of each category, in file order; ``categories`` may
    name categories or groups (``mt_bench``)."""
    counts: dict[str, int] = {}
    chosen = []
    for item in records:
        category = item["category"]
        if categories and category not in categories and group_of(category) not in categories:
            continue
        if counts.get(category, 0) < per_category:
            counts[category] = counts.get(category, 0) + 1
            chosen.append(item)
    return chosen


def default_checkpoints() -> list[Path]:
    return sorted(p for p in (REPO / "checkpoints").glob("*/") if (p / "config.json").is_file())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="*", type=Path, help="head checkpoint dirs (default: checkpoints/*/)")
    parser.add_argument("--prompts", default="spec-bench", help="a built-in prompt set or a Spec-Bench-style JSONL")
    parser.add_argument("--per-category", type=int, default=2, help="prompts per category (default 2)")
    parser.add_argument("--categories", default=None,
                        help="comma-separated categories or groups to keep, e.g. writing,translation or mt_bench")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--tree", type=int, default=None, help="tree node budget (default: each checkpoint's)")
    parser.add_argument("--accuracy-prompts", default="mt-bench", help="a built-in prompt set or a JSON-lines file")
    parser.add_argument("--accuracy-limit", type=int, default=20)
    parser.add_argument("--accuracy-max-new-tokens", type=int, default=128)
    parser.add_argument("--latency-steps", type=int, default=16)
    parser.add_argument("--base", default=None, help="base model (default: the embedded SmolLM2)")
    parser.add_argument("--out", type=Path, default=Path("results/heads/compare_heads"))
    args = parser.parse_args(argv)
    if args.per_category < 1 or args.max_new_tokens < 1 or args.latency_steps < 1:
        parser.error("--per-category, --max-new-tokens and --latency-steps must be positive")
    if args.tree is not None and args.tree < 0:
        parser.error("--tree must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    checkpoints = args.checkpoints or default_checkpoints()
    if not checkpoints:
        raise SystemExit("error: no checkpoint directories given or found under checkpoints/.")
    categories = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    prompts = select_prompts(read_prompts(args.prompts, None), args.per_category, categories)
    accuracy_prompts = read_prompts(args.accuracy_prompts, args.accuracy_limit)
    log_stdout(f"loading the base ({args.dtype}); {len(prompts)} speed prompts, {len(accuracy_prompts)} accuracy prompts")
    base, tokenizer = load_base(args.base, dtype=args.dtype)
    cache = answers_cache_path(args.accuracy_prompts, args.accuracy_limit, args.accuracy_max_new_tokens, args.dtype)
    meta = {"checkpoints": [str(p) for p in checkpoints], "prompts_file": args.prompts,
            "per_category": args.per_category, "categories": categories, "tree": args.tree,
            "accuracy_prompts_file": args.accuracy_prompts, "base": args.base or "embedded"}
    results = compare(base, tokenizer, checkpoints, prompts, accuracy_prompts, args.out,
                      max_new_tokens=args.max_new_tokens, accuracy_max_new_tokens=args.accuracy_max_new_tokens,
                      answers_cache=cache, tree=args.tree, latency_steps=args.latency_steps, meta=meta)
    print()
    print((args.out / "table.md").read_text())
    for name, e in results["checkpoints"].items():
        if e["speed"]["overall"]["divergences_outside_band"]:
            print(f"warning: {name} differs from HF generate away from a near-tie; see results.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
