"""The heads alone two ways on the dev prompts (MT-Bench + Spec-Bench dev, bs 1, greedy): every
step the stored tree of the budget as it is (``heads_offer_scale=1``, Medusa's and Hydra's static
tree, the default), or each step's best nodes of the stored tree of ``--scale`` times the budget by
calibrated confidence (the dynamic tree). Per prompt both ways run back to back, the order
alternating; τ (tokens after the first per verification), tok/s and the drafting time per step.

    python scripts/bench_dynamic_trees.py --budgets 8,default --out results/trees/dynamic_trees

Writes ``dynamic_trees.json`` and ``dynamic_trees.png``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from draftheads.decoding.calibration import device_name
from draftheads.prompts import DEV_PROMPTS
from draftheads.training.figures import figure

WAYS = ("static", "dynamic")


def run_budget(base, tokenizer, heads_path: str, budget: int | None, scale: int, prompts: list[dict],
               max_new_tokens: int, log=print) -> list[dict]:
    """One record per prompt: each way's new tokens, verification steps, seconds and drafting seconds."""
    from draftheads.decoding import DraftHeadsModel
    from draftheads.prompts import chat_input

    models = {way: DraftHeadsModel.from_pretrained(heads_path, base=base, tokenizer=tokenizer, tree=budget,
                                                   sources="heads", heads_offer_scale=1 if way == "static" else scale)
              for way in WAYS}
    warm = chat_input(tokenizer, prompts[0]["prompt"])
    for model in models.values():
        model.generate(warm, max_new_tokens=8)
    records = []
    for i, item in enumerate(prompts):
        ids = chat_input(tokenizer, item["prompt"])
        record = {"category": item.get("category", "?"), "prompt_tokens": int(ids.shape[1])}
        for way in (WAYS if i % 2 == 0 else WAYS[::-1]):
            model = models[way]
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=max_new_tokens)
            stats = model.last_stats
            record[way] = {"new_tokens": int(out.shape[1] - ids.shape[1]), "steps": stats.steps,
                           "seconds": round(time.perf_counter() - start, 4),
                           "drafting_seconds": round(stats.drafting_seconds, 4)}
        records.append(record)
        log(f"budget {budget or 'default'} prompt {i}: " + ", ".join(
            f"{w} {record[w]['new_tokens']} tokens in {record[w]['steps']} steps" for w in WAYS))
    return records


def totals(records: list[dict]) -> dict:
    """Per way: τ, tok/s and drafting ms a step over all prompts; dynamic over static."""
    out = {}
    for way in WAYS:
        tokens = sum(r[way]["new_tokens"] for r in records)
        steps = sum(r[way]["steps"] for r in records)
        seconds = sum(r[way]["seconds"] for r in records)
        out[way] = {"tau": round((tokens - len(records)) / max(1, steps), 4),
                    "tokens_per_second": round(tokens / seconds, 2),
                    "drafting_ms_per_step": round(1e3 * sum(r[way]["drafting_seconds"] for r in records) / steps, 3)}
    out["dynamic_over_static"] = {"tau": round(out["dynamic"]["tau"] / out["static"]["tau"], 4),
                                  "tokens_per_second": round(out["dynamic"]["tokens_per_second"]
                                                             / out["static"]["tokens_per_second"], 4)}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="checkpoints/smollm2-135m-hydra")
    ap.add_argument("--budgets", default="8,default", help="node budgets; 'default': this machine's default tree")
    ap.add_argument("--scale", type=int, default=4, help="the dynamic way's heads_offer_scale")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("results/trees/dynamic_trees"))
    args = ap.parse_args(argv)
    from draftheads.decoding.base.loading import load_base
    from draftheads.prompts import read_prompts

    torch.set_num_threads(min(2, torch.get_num_threads()))
    base, tokenizer = load_base(dtype=args.dtype)
    prompts = read_prompts(DEV_PROMPTS)
    budgets = [None if b == "default" else int(b) for b in args.budgets.split(",")]
    runs = {str(b or "default"): run_budget(base, tokenizer, args.heads, b, args.scale, prompts, args.max_new_tokens)
            for b in budgets}
    summary = {budget: totals(records) for budget, records in runs.items()}
    result = {"meta": {"command": "python scripts/bench_dynamic_trees.py " + " ".join(argv or sys.argv[1:]),
                       "device": device_name(torch.device("cpu")), "threads": torch.get_num_threads(),
                       "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype, "heads": args.heads,
                       "scale": args.scale, "prompts": list(DEV_PROMPTS), "max_new_tokens": args.max_new_tokens},
              "summary": summary, "prompts": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dynamic_trees.json").write_text(json.dumps(result, indent=1))
    with figure(args.out / "dynamic_trees.png", 1, 2, figsize=(9, 3.6)) as (fig, axes):
        for ax, key, label in zip(axes, ("tau", "tokens_per_second"), ("τ (tokens a verification)", "tokens/s")):
            for k, way in enumerate(WAYS):
                ax.bar([x + (k - 0.5) * 0.4 for x in range(len(summary))], [s[way][key] for s in summary.values()],
                       width=0.4, color=f"C{k}", label=way)
            ax.set_xticks(range(len(summary)), [f"budget {b}" for b in summary])
            ax.set_ylabel(label)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"Heads alone, static vs dynamic trees, {len(prompts)} dev prompts, {args.dtype}, bs 1")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out / 'dynamic_trees.json'} and .png")


if __name__ == "__main__":
    main()
