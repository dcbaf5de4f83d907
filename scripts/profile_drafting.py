"""Where a batched step's time goes, per drafting configuration and batch size: the per-phase
milliseconds of ``decode_step`` (propose = all drafting: lookups, heads, merge, width choice)
under the adaptive tree policy, on the same left-padded batches of a category mix.

    python scripts/profile_drafting.py --batch-sizes 1,4,16 --out results/drafting_sources/drafting_phases/after

Prompts are cut to their last ``--prompt-tokens`` tokens so prefill stays short: the phases
of the decode steps are what this measures. Configurations run interleaved per batch size,
after a warm-up of each. Writes ``phases.json`` and ``phases.png`` (drafting ms per step).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from draftheads.bench.runs import config_model
from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.calibration import calibrate
from draftheads.decoding.policy import AdaptivePolicy
from draftheads.decoding.request import left_pad
from draftheads.decoding.step import PhaseTimer
from draftheads.prompts import BATCH_PROMPTS, chat_input, read_prompts, round_robin

CONFIGS = {"heads": ("heads",), "lookups": ("context", "store", "stats"),
           "heads+lookups": ("heads", "context", "store", "stats"),
           "heads+lookups:per-row": ("heads", "context", "store", "stats")}  # each row its own node count


def run_config(model, ids: torch.Tensor, mask: torch.Tensor, new: int) -> dict:
    """One generate with a phase timer: per-step phase means, steps, seconds, new tokens."""
    timer = PhaseTimer()
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, timer=timer)
    seconds = time.perf_counter() - started
    return {"phases_ms": {k: round(v, 3) for k, v in timer.per_step().items()}, "steps": timer.steps,
            "seconds": round(seconds, 3), "new_tokens": int(out.shape[0] * (out.shape[1] - ids.shape[1]))}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results)
    names = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        ax.bar([i + k * width for i in range(len(sizes))], [results[s][name]["phases_ms"]["propose"] for s in sizes],
               width, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(sizes))], [f"bs {s}" for s in sizes])
    ax.set_ylabel("drafting (propose) ms per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-hydra")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompts", nargs="+", default=list(BATCH_PROMPTS))
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--configs", default="heads,lookups,heads+lookups", help=f"comma-separated, of {list(CONFIGS)}")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--out", required=True, help="a folder for phases.json and phases.png")
    args = parser.parse_args(argv)
    model = DraftHeadsModel.from_pretrained(args.heads, dtype=args.dtype)
    adaptive = AdaptivePolicy.from_heads(model.heads, calibrate(model.base, model.heads))
    drafters = {name: config_model(model, CONFIGS[name], tree=adaptive, per_row_counts=name.endswith(":per-row"))
                for name in args.configs.split(",")}
    prompts = round_robin(read_prompts(args.prompts))
    rows = [chat_input(model.tokenizer, p["prompt"])[0].tolist()[-args.prompt_tokens:] for p in prompts]
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    results: dict = {}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        if bs > len(rows):
            print(f"bs {bs}: only {len(rows)} prompts, skipped", file=sys.stderr)
            continue
        ids, mask = left_pad(rows[:bs], pad)
        for variant in drafters.values():  # warm-up: kernels for this batch's shapes
            run_config(variant, ids[:, -32:], mask[:, -32:], 8)
        results[str(bs)] = {name: run_config(variant, ids, mask, args.max_new_tokens)
                            for name, variant in drafters.items()}
        for name, r in results[str(bs)].items():
            ph = r["phases_ms"]
            print(f"bs {bs:>2} {name:<14} propose {ph['propose']:6.2f}  forward {ph['forward']:6.2f}  "
                  f"total {ph['total']:6.2f} ms/step  {r['steps']} steps  {r['new_tokens'] / r['seconds']:.1f} tok/s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {**vars(args), "dtype": str(model.base.dtype), "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", "scripts/profile_drafting.py", *(argv or sys.argv[1:])])}
    (out / "phases.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    plot(results, out / "phases.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
