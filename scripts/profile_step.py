"""Where a decoding step's time goes: per-phase milliseconds of draftheads' step (the same
``decode_step`` the loop runs) against transformers' greedy ``generate`` time per token, on the
same prompts, interleaved per prompt, for any heads, tree and dtype.

    python scripts/profile_step.py --heads checkpoints/smollm2-135m-hydra --dtype bfloat16 --tree 8 \
        --prompts mt-bench --limit 10 --out results/profile/bf16.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftheads.bench import hf_greedy, timed
from draftheads.bench.summary import run_tau
from draftheads.arguments import find_heads, tree_argument
from draftheads.prompts import chat_input, read_prompts
from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.step import PHASES, PhaseTimer


def profile(model, prompts: list[dict], max_new_tokens: int) -> dict:
    """Interleaved per prompt: HF greedy, then draftheads with a phase timer. Returns the
    per-step phase means, HF's ms per token (whole ``generate``, prefill included, as a user
    sees it), draftheads' ms per token, and the ratios."""
    warm = chat_input(model.tokenizer, "Hello!")
    hf_greedy(model.base, warm, 8)
    model.generate(warm, max_new_tokens=8)
    timer = PhaseTimer()
    hf_ms, hf_tokens, ours_ms, ours_tokens = 0.0, 0, 0.0, 0
    for item in prompts:
        ids = chat_input(model.tokenizer, item["prompt"])
        plain, seconds = timed(lambda: hf_greedy(model.base, ids, max_new_tokens))
        hf_ms += seconds * 1e3
        hf_tokens += plain.shape[1] - ids.shape[1]
        out, seconds = timed(lambda: model.generate(ids, max_new_tokens=max_new_tokens, timer=timer))
        ours_ms += seconds * 1e3
        ours_tokens += out.shape[1] - ids.shape[1]
    phases = timer.per_step()
    hf_per_token = hf_ms / hf_tokens
    return {"steps": timer.steps, "phases_ms": {k: round(v, 3) for k, v in phases.items()},
            "hf_ms_per_token": round(hf_per_token, 3), "step_vs_hf_token": round(phases["total"] / hf_per_token, 3),
            "draftheads_ms_per_token": round(ours_ms / ours_tokens, 3),
            "tau": run_tau(ours_tokens, len(prompts), timer.steps),
            "speedup": round((ours_tokens / ours_ms) / (hf_tokens / hf_ms), 4),
            "hf_tokens": hf_tokens, "draftheads_tokens": ours_tokens}


def print_table(result: dict, label: str) -> None:
    hf = result["hf_ms_per_token"]
    print(f"\n{label}: {result['steps']} steps, τ {result['tau']:.2f}, speedup {result['speedup']:.2f}x")
    print(f"{'phase':<14}{'ms/step':>10}{'x HF token':>12}")
    print(f"{'HF per token':<14}{hf:>10.2f}{1.0:>12.2f}")
    for name in (*PHASES, "total"):
        ms = result["phases_ms"][name]
        print(f"{name:<14}{ms:>10.2f}{ms / hf:>12.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-hydra")
    parser.add_argument("--base", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tree", type=tree_argument, default=None)
    parser.add_argument("--prompts", default="mt-bench", help="a built-in prompt set or a JSON-lines file")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--no-packed-linears", action="store_true",
                        help="run the decoder's forwards with plain F.linear (the 'before' of the packing)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = DraftHeadsModel.from_pretrained(find_heads(args.heads), base_name_or_path=args.base, dtype=args.dtype,
                                            tree=args.tree, packed_linears=not args.no_packed_linears)
    prompts = read_prompts(args.prompts, args.limit)
    result = profile(model, prompts, args.max_new_tokens)
    result["meta"] = {**vars(args), "dtype": str(model.base.dtype), "threads": torch.get_num_threads(),
                      "tree_nodes": model.policy.choose(1, 0).num_nodes}
    print_table(result, f"{model.base.dtype}, {result['meta']['tree_nodes']}-node tree")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
