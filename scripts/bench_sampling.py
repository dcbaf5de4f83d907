"""Sampling benchmark: HF sampling ``generate`` vs draftheads lossless and typical acceptance
(and draftheads greedy, for the τ ratio) on the same prompts, interleaved per prompt so every
mode sees the same machine state. Writes JSON.

    python scripts/bench_sampling.py --prompts mt-bench --limit 10 \
        --heads checkpoints/smollm2-135m-medusa --temperature 0.7 --max-new-tokens 128 \
        --out results/sampling/results.json

τ = tokens emitted per base verification forward. Speedup = draftheads tok/s ÷ HF sampling
tok/s, summed over prompts (sampled answers differ in length, so tokens/s is the fair unit).
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from draftheads.prompts import chat_input, read_prompts
from draftheads.decoding import DraftHeadsModel

MODES = ("hf_sample", "greedy", "lossless", "typical")


def run(model: DraftHeadsModel, ids: torch.Tensor, mode: str, max_new: int, temperature: float, seed: int) -> dict:
    """One generation in ``mode``; returns new tokens, seconds and (draftheads) τ / steps."""
    sampling = dict(do_sample=True, temperature=temperature)
    start = time.perf_counter()
    if mode == "hf_sample":
        torch.manual_seed(seed)
        out = model.base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, **sampling)
    elif mode == "greedy":
        out = model.generate(ids, max_new_tokens=max_new)
    else:
        out = model.generate(ids, max_new_tokens=max_new, acceptance=mode,
                             generator=torch.Generator().manual_seed(seed), **sampling)
    seconds = time.perf_counter() - start
    row = {"new_tokens": int(out.shape[1] - ids.shape[1]), "seconds": round(seconds, 4)}
    if mode != "hf_sample":
        stats = model.last_stats
        row |= {"tau": round(stats.tau, 4), "steps": stats.steps}
    return row


def summarize(rows: list[dict], mode: str) -> dict:
    tokens = sum(r[mode]["new_tokens"] for r in rows)
    seconds = sum(r[mode]["seconds"] for r in rows)
    out = {"new_tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 3)}
    if mode != "hf_sample":
        steps = sum(r[mode]["steps"] for r in rows)
        # τ over the run: tokens per verify step (the first token comes from the prefill)
        out["tau"] = round(sum(r[mode]["tau"] * r[mode]["steps"] for r in rows) / max(1, steps), 4)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="mt-bench", help="a built-in prompt set or a JSON-lines file")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-medusa")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", type=int, default=None, help="node budget (default: the checkpoint's)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default="results/sampling/results.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"error: unknown modes {sorted(unknown)}; choose from {MODES}.")

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = DraftHeadsModel.from_pretrained(args.heads, dtype=dtype, tree=args.tree)
    prompts = read_prompts(args.prompts, args.limit)
    warm = chat_input(model.tokenizer, "Hello!")
    for mode in modes:
        run(model, warm, mode, 8, args.temperature, args.seed)
    rows = []
    for index, item in enumerate(prompts):
        ids = chat_input(model.tokenizer, item["prompt"])
        row = {"id": item["id"], "category": item["category"], "prompt_tokens": int(ids.shape[1])}
        for mode in modes:
            row[mode] = run(model, ids, mode, args.max_new_tokens, args.temperature, args.seed + index)
        rows.append(row)
        print(f"[{index + 1}/{len(prompts)}] id={item['id']} " + "  ".join(
            f"{m} {row[m]['new_tokens'] / row[m]['seconds']:.1f} tok/s" + (f" τ={row[m]['tau']:.2f}" if "tau" in row[m] else "")
            for m in modes), flush=True)
    overall = {m: summarize(rows, m) for m in modes}
    if "hf_sample" in modes:
        for m in modes:
            if m != "hf_sample":
                overall[m]["speedup_vs_hf_sample"] = round(
                    overall[m]["tokens_per_second"] / overall["hf_sample"]["tokens_per_second"], 4)
    if "greedy" in modes and "lossless" in modes:
        overall["tau_lossless_over_greedy"] = round(overall["lossless"]["tau"] / overall["greedy"]["tau"], 4)
    results = {"meta": {"heads": args.heads, "prompts_file": args.prompts, "prompts": len(rows),
                        "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                        "tree_nodes": model.policy.choose(1, 0).num_nodes, "seed": args.seed,
                        "threads": torch.get_num_threads(), "torch": torch.__version__,
                        "machine": platform.processor() or platform.machine(),
                        "typical": {"epsilon": 0.09, "delta": 0.3}},
               "overall": overall, "per_prompt": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(overall, indent=2))
    return results


if __name__ == "__main__":
    main()
