"""Probe first (issue 66, item 4): do draft heads that read several layers of the base (EAGLE-3's
fused low/middle/high features) predict the base's future tokens better than heads that read
only the last layer's post-norm state (what every shipped head reads)?

    python scripts/probe_layers.py --limit-train 1200 --select 64 --steps 400 --batch-size 512 --threads 1 \
        --out results/heads/probe_layers                  # add --resume to continue a stopped run

What it does, once, with the embedded base (SmolLM2-135M-Instruct, L = 30 layers, d = 576) in bf16:

* **Training data**: the first ``--limit-train`` sequences of the committed self-distilled token ids
  (``recipes/data/selfdistill-smollm2/shard-*.npz``, shards in order: every prefix is a
  proportional sample of the sources); the next ``--select`` sequences are a selection split
  (the "best fused set" that the Hydra-style and raw-feature probes reuse is picked there, never
  on the evaluation split).
* **Evaluation ("the clean split")**: the base's greedy answers (bf16, chat template, 128 new
  tokens) to the Spec-Bench dev prompts the benches never decode: records of the built-in
  ``spec-bench`` set whose prompt is in neither ``read_prompts(DEV_PROMPTS)`` nor
  ``read_prompts(BATCH_PROMPTS)`` (``draftheads.prompts.CLEAN_EVAL_PROMPTS`` when that exists,
  checked to be the same set). Answers come from a finished job at ``data_cache/eval-clean-smollm2``
  if one exists, else this script runs ``python -m draftheads.training.data.distill_job`` (the
  project's batched greedy decoder, lossless) into ``data_cache/probe_layers/eval-clean`` once.
* **Capture**: one bf16 forward of the base per sequence (no padding) over prompt + answer with
  ``output_hidden_states=True``; the candidate layers' states at the answer positions are kept in
  float16. **Layer convention**: index i is HF's ``hidden_states[i]``: 0 = the token embeddings,
  i (1 ≤ i < L) = the output of decoder layer i (1-based; the residual stream, before any norm),
  and L = 30 is ``last_hidden_state`` (after the final RMSNorm: what the LM head and every
  shipped head read). EAGLE-3's rule captures the *input* of zero-based layers 2, L//2, L-3
  (SafeAILab/EAGLE ``modeling_llama_kv.py``: ``if idx in (2, L//2, L-3): all_hidden_states +=
  (hidden_states,)`` before ``decoder_layer`` runs; vLLM's ``aux_hidden_state_layers`` the same),
  which is HF index {2, 15, 27} for L = 30: that is the set called ``eagle3`` here.
* **Positions**: answer positions only (the prompt's are never trained on nor scored): the state
  at t, for t from the prompt length − 1 to the sequence length − 3; the base's own next token
  x_{t+1} is the root, head k (1..4) predicts x_{t+k+1} (absent past the end: that head is not
  trained or scored there).
* **Probes**, one per feature set, trained identically (same init rule, steps, batch, lr
  schedule, seed and position order; AdamW, bf16 autocast, teacher-forced cross-entropy summed
  over heads with equal weights): the set's states, each non-final layer through its own RMSNorm
  (gain initialised to the base's final-norm gain; ``raw`` variant: divided by a fixed scalar, the
  layer's mean RMS on the training positions, instead), concatenated and projected by
  ``fc = Linear(n·d → d, no bias)`` (EAGLE-3's ``fc``; also for n = 1, so every probe has the same
  shape), initialised to pick the set's top layer (identity there, zero elsewhere: every probe
  starts as the base's own LM head on its top layer). Then per head a Medusa ``ResBlock``
  (x + SiLU(W x + b), zero init) or, ``hydra``, the shipped Hydra head (``heads/hydra.py``: it
  also reads the base's input embeddings of x_{t+1}..x_{t+k}, zero-init mix, one ResBlock), read
  out through the base's frozen LM head restricted to the 8,192 most frequent training answer
  tokens (``training.losses.draft_vocab``, the shipped heads' rule); a label outside those counts
  as a miss in every score.
* **Scores** on the clean split: per-head top-1/top-5; τ of the top-1 chain and of the repo's fixed
  8-node tree (``training.evaluation.FIXED_TREE``) on positions where all four labels exist; a
  bootstrap over evaluation sequences (``--bootstrap`` resamples) of each probe's top-1 minus the
  last-only probe's of the same family, per head and averaged over heads 1–4.

Writes ``OUT/probe.json``, ``OUT/probe.png`` and ``OUT/README.md``; caches under
``data_cache/probe_layers/``.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its parts, beside it
from probe_layers_setup import *  # noqa: E402,F401,F403
from probe_layers_capture import *  # noqa: E402,F401,F403
from probe_layers_train import *  # noqa: E402,F401,F403


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit-train", type=int, default=1200, help="training sequences (the first of the shards)")
    parser.add_argument("--select", type=int, default=64, help="held-out training sequences the best fused set is picked on")
    parser.add_argument("--limit-eval", type=int, default=0, help="evaluation sequences (the job's first; 0 = all)")
    parser.add_argument("--steps", type=int, default=400, help="training steps of every probe (400 x 512: 0.8 epochs of 1,200 sequences)")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bootstrap", type=int, default=2000)
    parser.add_argument("--sets", default=",".join(FEATURE_SETS), help="feature sets (names of FEATURE_SETS)")
    parser.add_argument("--extras", default="raw,hydra", help="raw: the best fused set (with layer 30) on raw states; "
                        "hydra: Hydra-style heads on last-only and the best fused set; '' for none")
    parser.add_argument("--eval-job", default=None, help="read the clean split's answers from this job folder as it "
                        "lies (default: data_cache/eval-clean-smollm2 when finished, else one built under data_cache/probe_layers)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); 1 keeps a run "
                        "steady beside other jobs on a 2-core machine (two threads sharing one core stall each other)")
    parser.add_argument("--resume", action="store_true", help="keep the probes OUT/probe.json already holds for the "
                        "same settings and run the rest (each probe's per-sequence scores are kept under data_cache/)")
    parser.add_argument("--out", default="results/heads/probe_layers")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # AdamW's second moments of near-zero gradients: denormals are slow on CPU

    from draftheads.decoding.base.loading import load_base
    from draftheads.training.losses import draft_vocab

    names = [s for s in args.sets.split(",") if s]
    if "last" not in names:
        names.insert(0, "last")
    sets = {n: FEATURE_SETS[n] for n in names}
    layers = tuple(sorted({i for s in sets.values() for i in s}))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    prompts = clean_prompts()
    job = Path(args.eval_job).resolve() if args.eval_job else eval_job(prompts)
    eval_seqs, eval_ids, plan = read_job_sequences(job, args.limit_eval)
    train_seqs = read_train_sequences(TRAIN_DATA, args.limit_train + args.select)
    select_seqs, train_seqs = train_seqs[args.limit_train:], train_seqs[: args.limit_train]

    base, _ = load_base(dtype="bfloat16")
    L = base.config.num_hidden_layers
    train = cached_split(base, train_seqs, layers, "train", check_every=8)
    select = cached_split(base, select_seqs, layers, "select")
    evals = cached_split(base, eval_seqs, layers, "eval")

    answer_tokens = torch.from_numpy(train.future[:, 0])  # every answer token of the training sequences, once
    prompt_tokens = torch.from_numpy(np.concatenate([s[:a] for s, a in train_seqs]))
    vocab_ids = draft_vocab(answer_tokens, DRAFT_VOCAB, base.config.vocab_size, prompt_tokens)
    lookup = torch.full((base.config.vocab_size,), -2, dtype=torch.long)
    lookup[vocab_ids] = torch.arange(len(vocab_ids))
    readout = base.lm_head.weight.detach().float()[vocab_ids]
    embed = base.model.embed_tokens.weight.detach().float()
    final_norm = base.model.norm.weight.detach().float()
    eps = base.config.rms_norm_eps
    scales = {i: float(np.sqrt((train.states[i][:: 16].astype(np.float32) ** 2).mean())) for i in layers if i != L}

    eval_labels = evals.future[:, 1:]
    coverage = float((lookup[torch.from_numpy(eval_labels[eval_labels >= 0])] >= 0).double().mean())

    runs, kept = [], {}
    settings = {"limit_train": args.limit_train, "select": args.select, "limit_eval": args.limit_eval,
                "steps": args.steps, "batch": args.batch_size, "lr": args.lr, "seed": args.seed,
                "sets": {n: list(s) for n, s in sets.items()}, "eval_job": str(job), "train_positions": len(train.seq)}
    scores_dir = CACHE / ("scores-" + __import__("hashlib").sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12])
    scores_dir.mkdir(parents=True, exist_ok=True)
    earlier: dict = {}
    if args.resume and (out / "probe.json").is_file():
        old = json.loads((out / "probe.json").read_text())
        if old["meta"].get("settings", settings) != settings:
            raise SystemExit(f"{out / 'probe.json'} was made with other settings; drop --resume or use another --out.")
        earlier = {"commands": old["meta"].get("commands", [old["meta"]["command"]]),
                   "wall_minutes": old["meta"].get("wall_minutes", 0.0)}
        for r in old["runs"]:
            key = f"{r['family']}/{r['set']}/{r['variant']}"
            runs.append(r)
            if (scores_dir / f"{key.replace('/', '_')}.npz").is_file():
                kept[key] = dict(np.load(scores_dir / f"{key.replace('/', '_')}.npz"))
        print(json.dumps({"resumed": [f"{r['family']}/{r['set']}/{r['variant']}" for r in runs]}), flush=True)

    def done(family: str, name: str, variant: str) -> bool:
        return any((r["family"], r["set"], r["variant"]) == (family, name, variant) for r in runs)

    def trained_scores(family: str, name: str, variant: str) -> tuple[Probe, dict, dict, dict]:
        key = f"{family}/{name}/{variant}"
        probe = Probe(sets[name], L, readout, embed, final_norm, eps, scales if variant == "raw" else None,
                      hydra=family == "Hydra")
        trained = train_probe(probe, train, lookup, args.steps, args.batch_size, args.lr, args.seed, key)
        sel = summarize(score_probe(probe, select, lookup), select.seq, select.sequences)
        ev = summarize(score_probe(probe, evals, lookup), evals.seq, evals.sequences)
        kept[key] = ev.pop("_seq")
        np.savez(scores_dir / f"{key.replace('/', '_')}.npz", **kept[key])
        sel.pop("_seq")
        return probe, trained, sel, ev

    def reference(family: str) -> dict | None:
        """The last-only probe's per-sequence scores; a resumed run whose earlier process kept none
        trains it again (same settings, so the same probe) and checks it scores as recorded."""
        key = f"{family}/last/norm"
        if key not in kept and done(family, "last", "norm"):
            recorded = next(r for r in runs if (r["family"], r["set"], r["variant"]) == (family, "last", "norm"))
            _, _, _, ev = trained_scores(family, "last", "norm")
            drift = max(abs(a - b) for a, b in zip(ev["top1"], recorded["eval"]["top1"]))
            recorded["retrained_for_scores"] = {"top1": ev["top1"], "max_top1_drift": round(drift, 4),
                                                "threads": torch.get_num_threads()}
            print(json.dumps({"reference": key, "retrained": ev["top1"], "recorded": recorded["eval"]["top1"]}), flush=True)
        return kept.get(key)

    def run(family: str, name: str, variant: str) -> None:
        key = f"{family}/{name}/{variant}"
        if done(family, name, variant):
            return
        probe, trained, sel, ev = trained_scores(family, name, variant)
        r = {"family": family, "set": name, "layers": list(sets[name]), "variant": variant, **trained,
             "threads": torch.get_num_threads(),
             "params": sum(p.numel() for p in probe.parameters()), "eval": ev, "select": sel,
             "select_top1_mean": round(float(np.mean(sel["top1"])), 4)}
        ref = reference(family) if key != f"{family}/last/norm" else None
        if ref is not None:
            r["vs_last"] = bootstrap_diff(kept[key], ref, args.bootstrap, args.seed)
        print(json.dumps({k: v for k, v in r.items() if k not in ("select",)}), flush=True)
        runs.append(r)
        write()

    picked: dict = {}

    def write() -> None:
        """probe.json, the chart and the README as they stand (after every probe: a stopped run keeps
        what it finished)."""
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": cpu_model(), "torch": torch.__version__,
                "transformers": __import__("transformers").__version__, "python": platform.python_version(),
                "command": "python " + " ".join([command_path(sys.argv[0])] + sys.argv[1:]),
                "commands": earlier.get("commands", []) + ["python " + " ".join([command_path(sys.argv[0])] + sys.argv[1:])],
                "settings": settings,
                "seed": args.seed, "steps": args.steps, "batch": args.batch_size, "lr": args.lr,
                "train_epochs": round(args.steps * args.batch_size / len(train.seq), 2), "bootstrap": args.bootstrap,
                "draft_vocab": DRAFT_VOCAB, "num_heads": NUM_HEADS, "layers_captured": list(layers),
                "positions": "answer only (prompt positions neither trained on nor scored)",
                "feature_sets": {n: list(s) for n, s in sets.items()},
                "raw_scales": {str(i): round(v, 4) for i, v in scales.items()},
                "best_fused": picked.get("best"), "best_fused_with_final": picked.get("best_final"),
                "train": {"source": str(TRAIN_DATA.relative_to(REPO)), "sequences": train.sequences, "tokens": train.tokens,
                          "positions": len(train.seq), "capture_seconds": round(train.seconds, 1), **train.meta},
                "select": {"sequences": select.sequences, "positions": len(select.seq), **select.meta},
                "eval": {"job": str(job.relative_to(REPO)) if job.is_relative_to(REPO) else str(job), "plan": plan,
                         "prompts_in_split": len(prompts), "sequences": evals.sequences, "tokens": evals.tokens,
                         "positions": len(evals.seq), "label_coverage": round(coverage, 4),
                         "capture_seconds": round(evals.seconds, 1), **evals.meta, "ids": eval_ids},
                "complete": len(runs) == planned[0], "wall_minutes": round(earlier.get("wall_minutes", 0.0) + (time.perf_counter() - began) / 60, 1)}
        result = {"meta": meta, "runs": runs}
        (out / "probe.json").write_text(json.dumps(result, indent=1) + "\n")
        plot(runs, out / "probe.png")
        (out / "README.md").write_text(readme(result))

    extras = [e for e in args.extras.split(",") if e]
    planned = [len(sets) + ("hydra" in extras) * 2 + ("raw" in extras)]
    for name in sets:
        run("Medusa", name, "norm")
    fused = [r for r in runs if r["set"] != "last"]
    picked["best"] = best = max(fused, key=lambda r: r["select_top1_mean"])["set"] if fused else "last"
    with_final = [r for r in fused if L in r["layers"]]
    picked["best_final"] = best_final = max(with_final, key=lambda r: r["select_top1_mean"])["set"] if with_final else None
    planned[0] = len(sets) + ("hydra" in extras) * (1 + (best != "last")) + ("raw" in extras and best_final is not None)
    if "hydra" in extras:
        run("Hydra", "last", "norm")
        if best != "last":
            run("Hydra", best, "norm")
    if "raw" in extras and best_final:
        run("Medusa", best_final, "raw")
    write()
    print(markdown_table(runs))
    print(per_head_table(runs))
    return 0


def command_path(arg0: str) -> str:
    path = Path(arg0)
    return str(path.relative_to(REPO)) if path.is_absolute() and path.is_relative_to(REPO) else arg0


if __name__ == "__main__":
    raise SystemExit(main())
