#!/usr/bin/env python3
"""Memory over a long ``generate`` loop: RSS must stay flat while the drafting configuration
and the batch size alternate, call after call. Growth beyond noise would mean something (a KV
cache, a drafter's per-row state, a re-opened store, stats, scores) is kept between calls.

Each call takes the next (drafting configuration, batch size) pair in turn — by default
``use_sources("heads")`` / ``use_sources("all")`` × batch size 1 / 4, so the drafter is rebuilt
on every call — with 8 new tokens. RSS is read after a gc every ``--every`` calls; the report
gives the RSS at the start, after ``--warmup`` calls and at the end, and the largest drift
from the warm-up value over the rest of the loop, which must stay within ``--tolerance-mib``.

``--heads tiny`` (default) runs a random float32 Llama (vocabulary 96) with random Medusa
heads and a lookup store built from the model's own answers (a minute or two on 2 cores);
``--heads <checkpoint>`` runs that checkpoint on its base (the embedded SmolLM2 by default) with
MT-Bench prompts (about 20 minutes on one core). This script was ``scripts/rss_loop.py``;
``results/loop/rss_loop/rss.json`` is its earlier run with the heads alone (``--sources heads``).

    python scripts/memory_loop.py --out results/loop/memory_loop/memory.json
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftheads.bench import left_pad
from draftheads.decoding import DraftHeadsModel, tree_for_budget
from draftheads.decoding.base.hardware import proc_kib
from draftheads.prompts import read_prompts


def rss_mib() -> float:
    """Resident set size of this process (Linux /proc), MiB."""
    rss = proc_kib("/proc/self/status", "VmRSS")
    if rss is None:
        raise RuntimeError("no VmRSS in /proc/self/status")
    return rss / 2**20


def tiny_model(store_dir: Path) -> tuple[DraftHeadsModel, list[list[int]], Path, int]:
    """A random float32 Llama, random Medusa heads with stored trees, prompts with repeated
    motifs (so the context and store lookups find matches), and a lookup store of the model's
    own greedy answers; returns (model, prompts, store path, pad id)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftheads.decoding.drafters import StoreHeader, build_arrays, save_store
    from draftheads.decoding.drafters.store import FORMAT_VERSION, key_bits
    from draftheads.heads import HeadConfig, MedusaHeads

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         initializer_range=0.3, attn_implementation="sdpa")
    base = LlamaForCausalLM(config).float().eval().requires_grad_(False)
    base.generation_config.pad_token_id = 0
    heads = MedusaHeads(HeadConfig(num_heads=3, hidden_size=64, vocab_size=96,
                                   trees={"3": [[0], [1], [0, 0]], "6": [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]},
                                   expected_tau={"3": 1.6, "6": 1.9}))
    generator = torch.Generator().manual_seed(0)
    motifs = [torch.randint(3, 96, (int(n),), generator=generator).tolist() for n in torch.randint(2, 5, (16,))]
    prompts = [(m * 6)[: 6 + i % 10] for i, m in enumerate(motifs)]
    answers = [base.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
               for p in prompts]
    bits = key_bits(96)
    store = store_dir / "lookup_store.safetensors"
    save_store(store, build_arrays(answers, 96), StoreHeader(FORMAT_VERSION, 96, "0" * 64, 64 // bits, bits,
                                                             "memory_loop", "tiny model answers", len(answers),
                                                             sum(map(len, answers))))
    return DraftHeadsModel(base, heads, tree=tree_for_budget(heads, 6)), prompts, store, 0


def checkpoint_model(heads: str, base: str | None, prompts_file: str) -> tuple[DraftHeadsModel, list[list[int]], None, int]:
    """A shipped checkpoint on its base, short MT-Bench prompts (the first 80 characters of 16
    questions, no chat template), the store shipped beside the heads."""
    model = DraftHeadsModel.from_pretrained(heads, base_name_or_path=base)
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    prompts = [model.tokenizer(p["prompt"][:80])["input_ids"] for p in read_prompts(prompts_file, 16)]
    return model, prompts, None, pad


def batches(prompts: list[list[int]], size: int, pad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The prompts as left-padded batches of ``size`` rows (cycling, so every batch is full)."""
    ring = itertools.cycle(prompts)
    return [left_pad([next(ring) for _ in range(size)], pad) for _ in range(len(prompts))]


def run_loop(model: DraftHeadsModel, plan: list[tuple[str, int]], inputs: dict[int, list], store: Path | None,
             calls: int, every: int, max_new_tokens: int, pad: int) -> dict:
    """``calls`` generate calls, each with the next (sources, batch size) of ``plan``; RSS after a
    gc at call 1 and every ``every`` calls."""
    rss, started = {}, time.perf_counter()
    for call in range(1, calls + 1):
        sources, size = plan[(call - 1) % len(plan)]
        model.use_sources(sources, lookup_store=store)
        ids, mask = inputs[size][(call - 1) // len(plan) % len(inputs[size])]
        model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad)
        if call == 1 or call % every == 0:
            gc.collect()
            rss[call] = round(rss_mib(), 2)
            print(f"call {call} ({sources}, bs {size}): RSS {rss[call]} MiB, {time.perf_counter() - started:.0f} s",
                  flush=True)
    return {"rss_mib_after_call": rss, "seconds": round(time.perf_counter() - started, 1)}


def drift(rss: dict[int, float], warmup: int) -> dict:
    """Start, warm-up and end RSS and the largest drift from the warm-up value after it."""
    marks = sorted(rss)
    after = [c for c in marks if c >= warmup] or marks[-1:]
    reference = rss[after[0]]
    return {"start_mib": rss[marks[0]], "after_warmup_mib": reference, "warmup_call": after[0],
            "end_mib": rss[marks[-1]], "max_drift_after_warmup_mib": round(max(abs(rss[c] - reference) for c in after), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="tiny", help="'tiny' (random model, default) or a head checkpoint")
    parser.add_argument("--base", default=None, help="with a checkpoint: its base (default: embedded SmolLM2)")
    parser.add_argument("--prompts", default="mt-bench", help="with a checkpoint: a built-in prompt set or a JSON-lines file")
    parser.add_argument("--sources", default="heads;all", help="drafting configurations to alternate, ';'-separated")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--tolerance-mib", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one: a tiny model's forward is "
                                                                 "latency-bound, and the machine may be shared)")
    parser.add_argument("--out", default="results/loop/memory_loop/memory.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = [d.strip() for d in args.sources.split(";") if d.strip()]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="memory-loop-") as tmp:
        if args.heads == "tiny":
            model, prompts, store, pad = tiny_model(Path(tmp))
        else:
            model, prompts, store, pad = checkpoint_model(args.heads, args.base, args.prompts)
        loaded = round(rss_mib(), 2)
        plan = [(d, b) for b in sizes for d in configs]  # (heads, 1), (all, 1), (heads, 4), (all, 4), ...
        inputs = {b: batches(prompts, b, pad) for b in sizes}
        loop = run_loop(model, plan, inputs, store, args.calls, args.every, args.max_new_tokens, pad)
    summary = drift(loop["rss_mib_after_call"], args.warmup)
    summary["flat"] = summary["max_drift_after_warmup_mib"] <= args.tolerance_mib
    result = {"command": " ".join(["python", "scripts/memory_loop.py", *sys.argv[1:]]), "settings": vars(args),
              "heads": args.heads, "plan": plan, "calls": args.calls, "max_new_tokens": args.max_new_tokens,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
              "rss_mib_after_load": loaded, "summary": summary, "loop": loop}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary))
    return 0 if summary["flat"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
