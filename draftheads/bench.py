"""Benchmark: plain transformers greedy ``generate`` vs draftheads on the same prompts, in one
run, interleaved per prompt so both see the same machine state. Writes ``results.json`` and
``results.png``; every mismatch is diagnosed (is the first divergence at a near-tie?)."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

NEAR_TIE = 1e-3


def timed(fn):
    """Run ``fn`` and return (its result, wall seconds)."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


@torch.no_grad()
def divergence(base, reference: torch.Tensor, ours: torch.Tensor, prompt_len: int) -> dict | None:
    """First differing generated position and the base's top-1/top-2 logit gap there."""
    ref, got = reference[0, prompt_len:].tolist(), ours[0, prompt_len:].tolist()
    if ref == got:
        return None
    index = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    prefix = reference[:, : prompt_len + index]
    logits = base(prefix, attention_mask=torch.ones_like(prefix)).logits[0, -1].float()
    top = logits.topk(2).values
    gap = float(top[0] - top[1])
    return {"position": index, "reference_token": ref[index] if index < len(ref) else None,
            "our_token": got[index] if index < len(got) else None, "top1_top2_gap": gap, "near_tie": gap < NEAR_TIE}


def run_bench(model, prompts: list[dict], max_new_tokens: int, out_dir: Path, meta: dict | None = None) -> dict:
    from .cli import chat_input

    tokenizer, base = model.tokenizer, model.base
    out_dir.mkdir(parents=True, exist_ok=True)
    warm = chat_input(tokenizer, "Hello!")
    base.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=8, do_sample=False)
    model.generate(warm, max_new_tokens=8)
    rows = []
    for index, item in enumerate(prompts):
        ids = chat_input(tokenizer, item["prompt"])
        plain, t_plain = timed(lambda: base.generate(ids, attention_mask=torch.ones_like(ids),
                                                      max_new_tokens=max_new_tokens, do_sample=False))
        ours, t_ours = timed(lambda: model.generate(ids, max_new_tokens=max_new_tokens))
        stats = model.last_stats
        n_plain, n_ours = plain.shape[1] - ids.shape[1], ours.shape[1] - ids.shape[1]
        row = {"id": item["id"], "category": item["category"], "prompt_tokens": ids.shape[1],
               "hf": {"new_tokens": n_plain, "seconds": round(t_plain, 4), "tokens_per_second": round(n_plain / t_plain, 3)},
               "draftheads": {"new_tokens": n_ours, "seconds": round(t_ours, 4),
                              "tokens_per_second": round(n_ours / t_ours, 3), "tau": round(stats.tau, 4),
                              "verify_steps": stats.steps},
               "speedup": round((n_ours / t_ours) / (n_plain / t_plain), 4),
               "mismatch": divergence(base, plain, ours, ids.shape[1])}
        rows.append(row)
        print(f"[{index + 1}/{len(prompts)}] id={item['id']} hf {row['hf']['tokens_per_second']:.1f} tok/s  "
              f"ours {row['draftheads']['tokens_per_second']:.1f} tok/s  τ={stats.tau:.2f}  "
              f"speedup {row['speedup']:.2f}x{'  MISMATCH' if row['mismatch'] else ''}", flush=True)
    overall = summarize(rows)
    results = {"meta": {**{k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                           for k, v in (meta or {}).items()},
                        "max_new_tokens": max_new_tokens, "prompts": len(rows), "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
                        "dtype": str(base.dtype), "tree_nodes": model.policy.choose(1, 0).num_nodes},
               "overall": overall, "per_prompt": rows}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(rows, overall, out_dir / "results.png")
    return results


def summarize(rows: list[dict]) -> dict:
    hf_tokens = sum(r["hf"]["new_tokens"] for r in rows)
    hf_seconds = sum(r["hf"]["seconds"] for r in rows)
    our_tokens = sum(r["draftheads"]["new_tokens"] for r in rows)
    our_seconds = sum(r["draftheads"]["seconds"] for r in rows)
    steps = sum(r["draftheads"]["verify_steps"] for r in rows)
    mismatches = [{"id": r["id"], **r["mismatch"]} for r in rows if r["mismatch"]]
    hf_tps, our_tps = hf_tokens / hf_seconds, our_tokens / our_seconds
    return {"prompts": len(rows), "hf_new_tokens": hf_tokens, "hf_seconds": round(hf_seconds, 2),
            "hf_tokens_per_second": round(hf_tps, 3), "draftheads_new_tokens": our_tokens,
            "draftheads_seconds": round(our_seconds, 2), "draftheads_tokens_per_second": round(our_tps, 3),
            "speedup": round(our_tps / hf_tps, 4),
            # τ over the whole run: tokens after the prefill token, per verification forward
            "tau": round((our_tokens - len(rows)) / max(1, steps), 4), "verify_steps": steps,
            "mismatching_prompts": len(mismatches), "mismatches_not_near_tie": sum(not m["near_tie"] for m in mismatches),
            "mismatches": mismatches}


def plot(rows: list[dict], overall: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = range(len(rows))
    left.plot(xs, [r["hf"]["tokens_per_second"] for r in rows], "o-", ms=3, label="HF generate (greedy)")
    left.plot(xs, [r["draftheads"]["tokens_per_second"] for r in rows], "o-", ms=3, label="draftheads")
    left.set_xlabel("prompt")
    left.set_ylabel("new tokens / s")
    left.set_title(f"throughput: {overall['hf_tokens_per_second']:.1f} → {overall['draftheads_tokens_per_second']:.1f}"
                   f" tok/s ({overall['speedup']:.2f}x)")
    left.legend()
    right.hist([r["draftheads"]["tau"] for r in rows], bins=20, color="tab:green")
    right.axvline(overall["tau"], color="k", ls="--", label=f"overall τ = {overall['tau']:.2f}")
    right.set_xlabel("τ (tokens per verification step)")
    right.set_ylabel("prompts")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
