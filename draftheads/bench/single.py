"""Benchmark: plain transformers greedy ``generate`` vs draftheads on the same prompts, in one
run, interleaved per prompt so both see the same machine state. Writes ``results.json`` and
``results.png``.

Identity is judged per dtype (:mod:`draftheads.decoding.guarantee`): every first divergence
from HF's tokens is located, its top-1/top-2 logit gap measured in ulps of the dtype, and
checked against the dtype's band. The control is transformers against itself: its prompt
lookup mode (``prompt_lookup_num_tokens``) on the same prompt, which rounds in another order
just as a tree verification does; its divergence rate is what "no higher than transformers
itself" is measured against, and its speed is the one-argument peer draftheads must beat."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from ..decoding.guarantee import first_divergence as divergence
from ..decoding.output import generated_counts
from ..decoding.request import left_pad
from ..plots import plot, plot_sources
from .runs import (PROMPT_LOOKUP_TOKENS, draft_configs, draftheads_run, draftheads_timing, eos_ids, hf_greedy,
                   keep_fastest, part_configs, rotated, run_meta, run_timing, timed)
from .summary import SOURCES, group, summarize


def padded_pair(base, first: torch.Tensor, second: torch.Tensor, max_new_tokens: int, pad: int) -> list[torch.Tensor]:
    """transformers' greedy ``generate`` on two prompts (1, L) as one left-padded batch; each
    row back as (1, prompt + new tokens up to its first EOS): the same prompts computed in
    another batch shape, the control for "how often does transformers differ from itself"."""
    ids, mask = left_pad([first[0].tolist(), second[0].tolist()], pad)
    out = base.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    counts = generated_counts(out, ids.shape[1], set(eos_ids(base)))
    return [torch.cat([prompt, out[r:r + 1, ids.shape[1]: ids.shape[1] + counts[r]]], dim=1)
            for r, prompt in enumerate((first, second))]



#: the single bench's entries beside the drafting configurations: HF's plain greedy (the
#: reference) and its prompt lookup (the one-argument peer, with ``control``)
HF_ENTRY, PROMPT_LOOKUP_ENTRY = "hf", "prompt_lookup"


def bench_prompt(model, ids: torch.Tensor, max_new_tokens: int, control: bool = True,
                 configs: dict[str, object] | None = None, repeats: int = 1,
                 shift: int = 0, peers: dict | None = None) -> tuple[dict, torch.Tensor]:
    """One prompt, interleaved: HF plain, draftheads under each drafting configuration (default:
    the model itself; each configuration a light model over its base and heads) and (``control``) HF prompt lookup, the one-argument peer — each
    ``repeats`` times, in an order rotated by ``shift`` (the prompt's index: no entry always
    runs right after another, so a slow spell of a shared machine does not keep hitting the
    same one), keeping each entry's fastest run (greedy output does not depend on timing:
    repeating only filters slow spells). Returns the row and HF's plain output (the
    reference). The last configuration is the row's headline ``draftheads`` entry. ``peers``:
    the CPU engines' runs (:mod:`.peers`), interleaved with the others; each peer's tokens are
    compared with HF's greedy ones token for token (another engine rounds its own way)."""
    drafters = configs or {"draftheads": model}
    runs: dict[str, Callable[[], tuple]] = {HF_ENTRY: lambda: timed(lambda: hf_greedy(model.base, ids, max_new_tokens))}
    for name, variant in drafters.items():
        runs[name] = lambda variant=variant: draftheads_run(variant, ids, max_new_tokens)
    if control:
        runs[PROMPT_LOOKUP_ENTRY] = lambda: timed(lambda: hf_greedy(
            model.base, ids, max_new_tokens, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS))
    for name, peer in (peers or {}).items():
        runs[f"peer:{name}"] = lambda peer=peer: peer(ids, max_new_tokens)
    best: dict[str, tuple] = {}
    for rep in range(repeats):
        for name in rotated(list(runs), shift * repeats + rep):
            keep_fastest(best, name, runs[name]())
    plain, seconds = best[HF_ENTRY]
    hf = run_timing(plain.shape[1] - ids.shape[1], seconds)
    timings = {name: draftheads_timing(model.base, best[name], ids, plain, hf) for name in drafters}
    ours = timings[list(timings)[-1]]
    row = {"prompt_tokens": ids.shape[1], "hf": hf,
           "draftheads": {k: ours[k] for k in ("new_tokens", "seconds", "tokens_per_second", "tau", "verify_steps",
                                               "prefill_seconds")},
           "speedup": ours["speedup"], "mismatch": ours["mismatch"]}
    if configs:
        row[SOURCES] = timings
    if control:
        lookup, seconds = best[PROMPT_LOOKUP_ENTRY]
        timing = run_timing(lookup.shape[1] - ids.shape[1], seconds)
        row["prompt_lookup"] = {**timing, "speedup": round(timing["tokens_per_second"] / hf["tokens_per_second"], 4),
                                "mismatch": divergence(model.base, plain, lookup, ids.shape[1])}
    if peers:
        row["peers"] = {name: peer_timing(best[f"peer:{name}"], ids, plain, hf) for name in peers}
    return row, plain


def peer_timing(run: tuple, ids: torch.Tensor, plain: torch.Tensor, hf: dict) -> dict:
    """A peer's tokens/s, speedup over HF, its seconds to the first token and whether its new
    tokens are HF's greedy ones (the first differing position where not)."""
    out, seconds, first = run
    timing = run_timing(out.shape[1] - ids.shape[1], seconds)
    ours, theirs = out[0, ids.shape[1]:].tolist(), plain[0, ids.shape[1]:].tolist()
    differs = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                   None if len(ours) == len(theirs) else min(len(ours), len(theirs)))
    return {**timing, "speedup": round(timing["tokens_per_second"] / hf["tokens_per_second"], 4),
            "first_token_seconds": round(first, 4), "same_as_hf": differs is None, "first_difference": differs}


def second_turns(model, prompts: list[dict], max_new_tokens: int) -> list[dict]:
    """MT-Bench second turns: for each prompt with a later turn, the conversation (turn 1, the
    base's own greedy answer to it, turn 2) as one more bench item of category ``mt_bench_turn2``."""
    from ..prompts import chat_input

    items = []
    for item in prompts:
        if not item.get("later_turns"):
            continue
        ids = chat_input(model.tokenizer, item["prompt"])
        answer = hf_greedy(model.base, ids, max_new_tokens)[0, ids.shape[1]:]
        text = model.tokenizer.decode(answer, skip_special_tokens=True)
        items.append({"id": f"{item['id']}-turn2", "category": "mt_bench_turn2", "prompt": item["prompt"],
                      "conversation": ([item["prompt"], item["later_turns"][0]], [text])})
    return items



def warm_up(model, configs: dict[str, object] | None, control: bool) -> None:
    """One short answer through every configuration the run times (first calls pay for allocation)."""
    from ..prompts import chat_input

    warm = chat_input(model.tokenizer, "Hello!")
    hf_greedy(model.base, warm, 8)
    for variant in (configs or {"own": model}).values():
        variant.generate(warm, max_new_tokens=8)
    if control:
        hf_greedy(model.base, warm, 8, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)


def chat_ids(model) -> torch.Tensor:
    from ..prompts import chat_input

    return chat_input(model.tokenizer, "Hello!")


def prompt_ids(tokenizer, item: dict) -> torch.Tensor:
    """A bench item's input ids: its conversation (a second turn) or its one prompt, chat-formatted."""
    from ..prompts import chat_input, conversation_input

    return conversation_input(tokenizer, *item["conversation"]) if "conversation" in item \
        else chat_input(tokenizer, item["prompt"])


def log_row(log, row: dict, index: int, total: int, control: bool) -> None:
    lookup = f"  lookup {row['prompt_lookup']['speedup']:.2f}x" if control else ""
    each = "".join(f"  {name} {r['speedup']:.2f}x τ={r['tau']:.2f}" for name, r in row.get(SOURCES, {}).items())
    log(f"[{index}/{total}] id={row['id']} {row['category']} "
        f"hf {row['hf']['tokens_per_second']:.1f} tok/s  ours {row['draftheads']['tokens_per_second']:.1f} "
        f"tok/s  τ={row['draftheads']['tau']:.2f}  speedup {row['speedup']:.2f}x{lookup}{each}"
        f"{'  DIVERGED' if row['mismatch'] else ''}", flush=True)


def bench_pair(model, pair: list[dict], max_new_tokens: int, control: bool, configs, pad: int, log, first: int,
               total: int, repeats: int = 1, peers: dict | None = None) -> list[dict]:
    """Each prompt of ``pair`` alone (:func:`bench_prompt`), then (``control``, two prompts) the
    pair once more as one padded batch of 2 through HF plain."""
    rows, encoded, references = [], [], []
    for offset, item in enumerate(pair):
        ids = prompt_ids(model.tokenizer, item)
        result, plain = bench_prompt(model, ids, max_new_tokens, control, configs, repeats, first + offset, peers)
        row = {"id": item["id"], "category": item["category"], **result}
        rows.append(row)
        encoded.append(ids)
        references.append(plain)
        log_row(log, row, first + offset + 1, total, control)
    if control and len(pair) == 2:
        batched = padded_pair(model.base, encoded[0], encoded[1], max_new_tokens, pad)
        for offset in range(2):
            rows[offset]["padded_batch"] = {
                "mismatch": divergence(model.base, references[offset], batched[offset], encoded[offset].shape[1])}
    return rows


def run_bench(model, prompts: list[dict], max_new_tokens: int, out_dir: Path, meta: dict | None = None,
              control: bool = True, log=print, sources: tuple[str, ...] | None = None,
              turn2: bool = False, review: bool = False, parts: bool = False, repeats: int = 1,
              twin: bool = False, peers: dict | None = None) -> dict:
    """Prompts in pairs: each prompt alone through HF plain, draftheads (under each ``sources``
    configuration, see :func:`~.runs.draft_configs`) and HF prompt lookup, then (``control``) the
    pair once more as one padded batch of 2 through HF plain. ``turn2``: MT-Bench second turns
    too. ``parts``: the model's own drafting beside its parts, the heads alone and the lookups
    alone (:func:`~.runs.part_configs`; ``twin``: and a second default drafter, the A/A control).
    ``repeats``: each prompt's entries run that many times,
    the fastest counted (:func:`bench_prompt`). ``peers``: the CPU engines' runs (:mod:`.peers`),
    columns beside HF and draftheads. The model is not changed (each configuration is a light model)."""
    base = model.base
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = draft_configs(model, sources, review) if sources else (part_configs(model, twin) if parts else None)
    warm_up(model, configs, control)
    for peer in (peers or {}).values():
        peer(chat_ids(model), 8)
    if turn2:
        prompts = prompts + second_turns(model, prompts, max_new_tokens)
    pad = base.generation_config.pad_token_id if base.generation_config.pad_token_id is not None else eos_ids(base)[0]
    rows: list[dict] = []
    for start in range(0, len(prompts), 2):
        rows += bench_pair(model, prompts[start: start + 2], max_new_tokens, control, configs, pad, log, start,
                           len(prompts), repeats, peers)
    tree_nodes = model.policy.choose(1, 0).num_nodes
    overall = summarize(rows)
    by_category = {c: summarize([r for r in rows if group(r) == c]) for c in dict.fromkeys(group(r) for r in rows)}
    results = {"meta": run_meta(meta, base, max_new_tokens=max_new_tokens, prompts=len(rows),
                                cpu_capability=torch.backends.cpu.get_cpu_capability(), tree_nodes=tree_nodes,
                                default_sources=list(model.sources), sources=list(configs) if configs else None),
               "overall": overall, "by_category": by_category, "per_prompt": rows}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(rows, overall, out_dir / "results.png")
    if configs:
        plot_sources(results, out_dir / "sources.png")
    return results
