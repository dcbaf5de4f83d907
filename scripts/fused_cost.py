"""What reading several base layers costs a decode, everything else equal (issue 66's "decoding
cost of the fused features"): A = the shipped heads as they are (the base's final state only), B =
the same heads reading the layers of the default rule beside it (heads/fusion.py
``default_feature_layers``, SmolLM2: 8 and 22) through a fusion at its start, the identity on the
final state. B therefore drafts exactly as A: the same trees, the same τ, the same tokens (checked
per prompt and per batch), and any difference in time is the features' own cost — the taps the
verification forward keeps (decoding/base/forward.py ``with_taps``) and the fusion's Linear over
the accepted slots (decoding/head_state.py).

    python scripts/fused_cost.py --dtype bfloat16 --prompts 16 --max-new-tokens 128 --reps 3 \\
        --out results/heads/fused_cost

Two regimes, the heads alone (``sources="heads"``) at a fixed tree so both sides verify the same:

* bs 1: the dev prompts (:data:`~draftheads.prompts.DEV_PROMPTS`, categories dealt round-robin,
  the first ``--prompts``), chat template, the checkpoint's ``--tree``-node tree (default 8);
* batched: :data:`~draftheads.prompts.BATCH_PROMPTS` in batches of ``--batch-size`` (default 16,
  left-padded as the batched bench pads, at most ``--max-batches``), at ``--batch-tree`` (default
  1: the 2-node tree the adaptive policy chose for most bs-16 steps, results/batch/batch_drafting_bf16_v4),
  the decode phase timed (the call less its prefill, as the batched bench's decode rate).

A and B run back to back on each prompt (batch), ``--reps`` times in rotating order; per unit the
median over reps. Per side: milliseconds per verification step of the verify phases (forward + LM
head, :class:`~draftheads.decoding.step.PhaseTimer`), of every timed phase (``step``), and of the
decode phase's wall time (``decode``); decode-phase tokens/s; τ. B/A with a 95 % bootstrap interval
(prompts at bs 1; the interleaved (batch, rep) pairs when batched: batches are few). Writes
``OUT/fused_cost.json`` and ``OUT/fused_cost.png``; exits 1 if B's tokens ever differ from A's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from draftheads.arguments import find_heads
from draftheads.bench.ab import ab_meta
from draftheads.bench.runs import WARM_UP_PROMPT, rotated
from draftheads.decoding import DraftHeadsModel, fingerprint, load_base
from draftheads.decoding.head_state import taps_of
from draftheads.decoding.output import generated_counts
from draftheads.decoding.request import eos_token_ids, left_pad
from draftheads.decoding.step import PhaseTimer
from draftheads.heads import DraftHeads, build_heads, load_heads
from draftheads.heads.fusion import default_feature_layers, feature_width
from draftheads.prompts import BATCH_PROMPTS, DEV_PROMPTS, chat_input, read_prompts, round_robin

SIDES = ("A", "B")
#: the phases of a verification (the base's forward, its LM head) in the step timer
VERIFY_PHASES = ("forward", "lm_head")
#: per-step times compared between A and B: verify phases, every timed phase, the decode phase's wall time
TIMES = ("verify", "step", "decode")


def fused_twin(heads: DraftHeads, layers: list[int]) -> DraftHeads:
    """``heads`` reading ``layers`` beside the final state, through a fresh fusion (the identity on
    the final state): their weights and draft vocabulary, so they draft exactly as ``heads`` do (as
    training/head_init.py ``start_weights`` starts multi-layer heads from a last-layer checkpoint)."""
    if heads.feature_layers:
        raise SystemExit(f"fused_cost: the heads already read the layers {list(heads.feature_layers)}; "
                         "pass heads that read the final state only (A), B is made from them.")
    twin = build_heads(dataclasses.replace(heads.config, feature_layers=list(layers)))
    twin.to(next(heads.parameters()).dtype)
    weights = {name: tensor.detach().clone() for name, tensor in heads.state_dict().items()}
    weights.update({name: tensor.detach().clone() for name, tensor in twin.state_dict().items()
                    if name.startswith("fusion.")})
    twin.load_state_dict(weights)
    twin.checkpoint_dir = getattr(heads, "checkpoint_dir", None)
    return twin.eval().requires_grad_(False)


def feature_widths(model: DraftHeadsModel, ids: torch.Tensor, mask: torch.Tensor | None, new: int) -> list[int]:
    """The widths of the features the heads read (``heads.read``) in one call: the base's width for
    the final state only, ``d · (1 + n)`` when the forward kept the taps."""
    heads, seen = model.heads, set()
    original = heads.read

    def spy(features: torch.Tensor) -> torch.Tensor:
        seen.add(int(features.shape[-1]))
        return original(features)

    heads.read = spy
    try:
        model.generate(ids, attention_mask=mask, max_new_tokens=new)
    finally:
        del heads.read
    return sorted(seen)


def one_run(model: DraftHeadsModel, ids: torch.Tensor, mask: torch.Tensor | None, new: int,
            eos: set[int], pad: int) -> tuple[torch.Tensor, dict]:
    """One timed call (``mask``: a left-padded batch's, padded with ``pad``): (its output, its
    steps, tokens, accepted drafts, wall/prefill seconds and phases)."""
    timer, padding = PhaseTimer(), {} if mask is None else {"pad_token_id": pad}
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, timer=timer, **padding)
    seconds = time.perf_counter() - start
    stats = model.last_stats
    if stats.delegated:
        raise SystemExit("fused_cost: the base's own generate ran (plain decoding): nothing of the heads was timed.")
    phases = {name: ms for name, ms in timer.totals.items()}
    return out, {"steps": stats.steps, "new_tokens": sum(generated_counts(out, ids.shape[1], eos)),
                 "first_tokens": stats.first_tokens, "accepted": sum(stats.accepted), "row_steps": len(stats.accepted),
                 "seconds": seconds, "prefill_seconds": stats.prefill_seconds,
                 "ms": {"verify": sum(phases.get(p, 0.0) for p in VERIFY_PHASES), "step": sum(phases.values()),
                        "decode": 1e3 * (seconds - stats.prefill_seconds)}, "phases_ms": phases}


def run_unit(models: dict[str, DraftHeadsModel], ids: torch.Tensor, mask: torch.Tensor | None, new: int,
             eos: set[int], pad: int, reps: int, shift: int) -> dict:
    """A and B on one prompt (batch), ``reps`` times in rotating order: every run, whether each
    rep's outputs agree, and per side the median over reps of each time."""
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    same = []
    for rep in range(reps):
        outs = {}
        for side in rotated(list(SIDES), shift * reps + rep):
            outs[side], record = one_run(models[side], ids, mask, new, eos, pad)
            runs[side].append(record)
        same.append(torch.equal(outs["A"], outs["B"]))
    unit: dict = {"rows": int(ids.shape[0]), "same_tokens": all(same), "runs": runs}
    for side in SIDES:
        first = runs[side][0]
        unit[side] = {key: first[key] for key in ("steps", "new_tokens", "first_tokens", "accepted", "row_steps")}
        unit[side]["ms"] = {t: statistics.median(r["ms"][t] for r in runs[side]) for t in TIMES}
        unit[side]["phases_ms"] = {p: statistics.median(r["phases_ms"][p] for r in runs[side])
                                   for p in first["phases_ms"]}
    return unit


def ratio_ci(a: list[float], b: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """95 % bootstrap interval of sum(b) / sum(a) over the units (resampled together: paired)."""
    rng, n = random.Random(seed), len(a)
    ratios = []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        ratios.append(sum(b[i] for i in pick) / max(sum(a[i] for i in pick), 1e-12))
    ratios.sort()
    return [round(ratios[int(0.025 * resamples)], 4), round(ratios[int(0.975 * resamples) - 1], 4)]


def summarize(units: list[dict], ci_over: str) -> dict:
    """Per side: ms a verification step (verify phases, every phase, the decode phase), each phase's
    ms a step, decode tokens/s, τ; B/A of each time — the sum over what the interval resamples: the
    units' medians, or with ``ci_over="pairs"`` every interleaved pair of runs (A and B take the same
    steps, so a ratio of times is a ratio of ms a step)."""
    out: dict = {"units": len(units), "same_tokens": sum(u["same_tokens"] for u in units)}
    for side in SIDES:
        steps = sum(u[side]["steps"] for u in units)
        tokens = sum(u[side]["new_tokens"] for u in units)
        first = sum(u[side]["first_tokens"] for u in units)
        decode_s = sum(u[side]["ms"]["decode"] for u in units) / 1e3
        phases = {p: round(sum(u[side]["phases_ms"][p] for u in units) / max(steps, 1), 3)
                  for p in units[0][side]["phases_ms"]}
        out[side] = {"steps": steps, "new_tokens": tokens,
                     "tau": round((sum(u[side]["accepted"] for u in units) + sum(u[side]["row_steps"] for u in units))
                                  / max(1, sum(u[side]["row_steps"] for u in units)), 4),
                     **{f"{t}_ms_per_step": round(sum(u[side]["ms"][t] for u in units) / max(steps, 1), 3) for t in TIMES},
                     "decode_tokens_per_second": round((tokens - first) / decode_s, 2) if decode_s > 0 else 0.0,
                     "phases_ms_per_step": phases}
    ratio: dict = {"ci_over": ci_over}
    for t in TIMES:
        if ci_over == "pairs":
            a = [r["ms"][t] for u in units for r in u["runs"]["A"]]
            b = [r["ms"][t] for u in units for r in u["runs"]["B"]]
        else:
            a, b = [u["A"]["ms"][t] for u in units], [u["B"]["ms"][t] for u in units]
        ratio[t] = {"b_over_a": round(sum(b) / max(sum(a), 1e-12), 4), "ci95": ratio_ci(a, b)}
    out["b_over_a"] = ratio
    return out


def regime(models: dict[str, DraftHeadsModel], inputs: list[tuple[torch.Tensor, torch.Tensor | None]], new: int,
           eos: set[int], pad: int, reps: int, ci_over: str, label: str, log=print) -> dict:
    """Every unit (a prompt, or a left-padded batch) through A and B; its per-unit records and summary."""
    units = []
    for i, (ids, mask) in enumerate(inputs):
        unit = run_unit(models, ids, mask, new, eos, pad, reps, i)
        units.append(unit)
        log(f"{label} {i + 1}/{len(inputs)}: {unit['A']['steps']} steps, same tokens: {unit['same_tokens']}; "
            + ", ".join(f"{s} {unit[s]['ms']['verify'] / max(unit[s]['steps'], 1):.2f} ms verify/step" for s in SIDES))
    for unit in units:  # the per-run records stay, the phases of each run go (the medians keep them)
        for side in SIDES:
            unit["runs"][side] = [{"ms": {t: round(v, 3) for t, v in r["ms"].items()}, "seconds": round(r["seconds"], 4),
                                   "prefill_seconds": round(r["prefill_seconds"], 4)} for r in unit["runs"][side]]
    return {"summary": summarize(units, ci_over), "units": units}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = [name for name in ("bs1", "batched") if name in result]
    fig, axes = plt.subplots(1, len(regimes), figsize=(5.5 * len(regimes), 3.8), squeeze=False)
    for ax, name in zip(axes[0], regimes):
        summary = result[name]["summary"]
        for j, side in enumerate(SIDES):
            values = [summary[side][f"{t}_ms_per_step"] for t in TIMES]
            ax.bar([x + 0.4 * j for x in range(len(TIMES))], values, 0.4, color=f"C{j}",
                   label=f"{side}: {result['meta']['layers'][side] or 'final state'}")
        ax.set_xticks([x + 0.2 for x in range(len(TIMES))],
                      [f"{t}\nB/A {summary['b_over_a'][t]['b_over_a']:.3f}\n[{summary['b_over_a'][t]['ci95'][0]:.3f}, "
                       f"{summary['b_over_a'][t]['ci95'][1]:.3f}]" for t in TIMES], fontsize=7)
        ax.set_ylabel("ms a verification step")
        rows = result[name]["batch_size"]
        ax.set_title(f"bs {rows}, {summary['units']} {'prompts' if rows == 1 else 'batches'}, τ {summary['A']['tau']:.2f} "
                     f"({summary['same_tokens']}/{summary['units']} same tokens)", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(f"Fused features' cost, heads alone, {result['meta']['dtype']}, {result['meta']['threads']} threads",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-hydra", help="A: heads reading the final state only")
    parser.add_argument("--base", default=None, help="the base (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", default=None,
                        help="B's layers, comma-separated (default: heads/fusion.py's rule for the base)")
    parser.add_argument("--prompts", type=int, default=16, help="bs 1: the first N dev prompts (categories round-robin)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tree", type=int, default=8, help="bs 1: the checkpoint's tree of this node budget")
    parser.add_argument("--batch-size", type=int, default=16, help="0: no batched regime")
    parser.add_argument("--batch-tree", type=int, default=1, help="batched: the tree of this node budget")
    parser.add_argument("--max-batches", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("results/heads/fused_cost"))
    args = parser.parse_args(argv)
    if args.reps < 1 or args.prompts < 1 or args.max_new_tokens < 1 or args.tree < 1 or args.batch_tree < 1:
        parser.error("--reps, --prompts, --max-new-tokens, --tree and --batch-tree must be ≥ 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    base, tokenizer = load_base(args.base, dtype=args.dtype)
    heads_a = load_heads(find_heads(args.heads), expected_fingerprint=fingerprint(base).with_sketch(base),
                         base_name=getattr(base, "name_or_path", None) or None, dtype=base.dtype)
    num_layers = base.config.get_text_config().num_hidden_layers
    layers = ([int(x) for x in args.layers.split(",")] if args.layers else default_feature_layers(num_layers))
    if not layers:
        raise SystemExit(f"fused_cost: the rule names no layer for a base of {num_layers} layers; pass --layers.")
    heads_b = fused_twin(heads_a, layers)
    models = {side: DraftHeadsModel(base, heads, tokenizer, tree=args.tree, sources="heads")
              for side, heads in zip(SIDES, (heads_a, heads_b))}
    eos = set(eos_token_ids(base.generation_config))
    pad = base.generation_config.pad_token_id
    pad = pad if pad is not None else (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos))

    warm = chat_input(tokenizer, WARM_UP_PROMPT)
    width = base.config.get_text_config().hidden_size
    reads = {side: {"taps": list(taps_of(m.heads)), "feature_widths": feature_widths(m, warm, None, 16)}
             for side, m in models.items()}
    print(f"features read: {reads}", file=sys.stderr)
    if reads["B"]["feature_widths"] != [feature_width(width, layers)] or reads["A"]["feature_widths"] != [width]:
        raise SystemExit(f"fused_cost: the heads did not read what they should (A: the final state, {width} wide; "
                         f"B: {feature_width(width, layers)} wide): {reads}")
    for m in models.values():
        m.generate(warm, max_new_tokens=32)

    meta = ab_meta("fused_cost.py", argv, models["A"], args, list(DEV_PROMPTS))
    meta.update({"torch": torch.__version__, "base": args.base or "embedded SmolLM2", "reps": args.reps,
                 "layers": {"A": [], "B": layers}, "reads": reads, "tree": args.tree, "batch_tree": args.batch_tree,
                 "timer": "PhaseTimer (perf_counter around each step phase); decode = the call less its prefill"})
    result: dict = {"meta": meta}
    prompts = round_robin(read_prompts(list(DEV_PROMPTS)))[: args.prompts]
    meta["bs1_prompts"] = [f"{p['category']}:{p.get('id', '?')}" for p in prompts]
    inputs = [(chat_input(tokenizer, p["prompt"]), None) for p in prompts]
    result["bs1"] = {"batch_size": 1, "tree_nodes": models["A"].drafting_summary().get("tree_nodes"),
                     **regime(models, inputs, args.max_new_tokens, eos, pad, args.reps, "prompts", "prompt")}
    if args.batch_size > 0:
        batched = {side: m.with_decoding(tree=args.batch_tree) for side, m in models.items()}
        rows = [r[0].tolist() for r in (chat_input(tokenizer, p["prompt"]) for p in round_robin(read_prompts(list(BATCH_PROMPTS))))]
        batches = [rows[i: i + args.batch_size] for i in range(0, len(rows), args.batch_size)]
        batches = [b for b in batches if len(b) == args.batch_size][: args.max_batches]
        if not batches:
            raise SystemExit(f"fused_cost: fewer than {args.batch_size} batch prompts; lower --batch-size.")
        for m in batched.values():  # first calls at these row counts build their kernels
            m.generate(*left_pad([warm[0].tolist()] * args.batch_size, pad), max_new_tokens=8, pad_token_id=pad)
        padded = [left_pad(b, pad) for b in batches]
        result["batched"] = {"batch_size": args.batch_size, "batches": len(batches),
                             "tree_nodes": batched["A"].drafting_summary().get("tree_nodes"),
                             **regime(batched, padded, args.max_new_tokens, eos, pad, args.reps, "pairs", "batch")}
        meta["batch_prompts"] = list(BATCH_PROMPTS)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fused_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "fused_cost.png")
    summaries = {name: result[name]["summary"] for name in ("bs1", "batched") if name in result}
    print(json.dumps({n: {k: v for k, v in s.items() if k in ("same_tokens", "units", "b_over_a")}
                      | {side: {k: v for k, v in s[side].items() if k != "phases_ms_per_step"} for side in SIDES}
                      for n, s in summaries.items()}, indent=1))
    print(f"wrote {args.out / 'fused_cost.json'} and .png")
    differing = {n: s["units"] - s["same_tokens"] for n, s in summaries.items() if s["same_tokens"] != s["units"]}
    if differing:
        print(f"fused_cost: B's tokens differ from A's in {differing} units: the comparison is not like for like.",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
