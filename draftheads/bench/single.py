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
import platform
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from .decoding.output import generated_counts
from .decoding.guarantee import first_divergence as divergence
from .plots import plot, plot_drafts, plot_surface, plot_throughput

#: transformers' prompt lookup: the control for identity and the one-line peer for speed
PROMPT_LOOKUP_TOKENS = 10


def timed(fn):
    """Run ``fn`` and return (its result, wall seconds)."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def hf_greedy(base, ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """The baseline every speedup is measured against: transformers' own greedy ``generate``
    (``kwargs``: e.g. ``prompt_lookup_num_tokens`` for its prompt-lookup mode)."""
    return base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         **kwargs)


def run_timing(new_tokens: int, seconds: float) -> dict:
    return {"new_tokens": new_tokens, "seconds": round(seconds, 4), "tokens_per_second": round(new_tokens / seconds, 3)}


def timed_hf(base, ids: torch.Tensor, max_new_tokens: int, **kwargs) -> tuple[torch.Tensor, dict]:
    """HF greedy on one prompt: (its output, new tokens / seconds / tokens per second)."""
    plain, seconds = timed(lambda: hf_greedy(base, ids, max_new_tokens, **kwargs))
    return plain, run_timing(plain.shape[1] - ids.shape[1], seconds)


def timed_draftheads(model, ids: torch.Tensor, plain: torch.Tensor, hf: dict, max_new_tokens: int) -> dict:
    """draftheads on the prompt HF just answered (``plain``, timed in ``hf``): its timing, τ, verify
    steps, speedup over HF and the first divergence from HF's tokens (None when identical)."""
    ours, seconds = timed(lambda: model.generate(ids, max_new_tokens=max_new_tokens))
    new = ours.shape[1] - ids.shape[1]
    return {**run_timing(new, seconds), "tau": round(model.last_stats.tau, 4), "verify_steps": model.last_stats.steps,
            "speedup": round((new / seconds) / (hf["new_tokens"] / hf["seconds"]), 4),
            "mismatch": divergence(model.base, plain, ours, ids.shape[1])}


def padded_pair(base, first: torch.Tensor, second: torch.Tensor, max_new_tokens: int, pad: int) -> list[torch.Tensor]:
    """transformers' greedy ``generate`` on two prompts (1, L) as one left-padded batch; each
    row back as (1, prompt + new tokens up to its first EOS): the same prompts computed in
    another batch shape, the control for "how often does transformers differ from itself"."""
    ids, mask = left_pad([first[0].tolist(), second[0].tolist()], pad)
    out = base.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    counts = generated_counts(out, ids.shape[1], set(eos_ids(base)))
    return [torch.cat([prompt, out[r:r + 1, ids.shape[1]: ids.shape[1] + counts[r]]], dim=1)
            for r, prompt in enumerate((first, second))]


def eos_ids(base) -> list[int]:
    from .decoding.generate import eos_token_ids

    return eos_token_ids(base.generation_config)


def draft_configs(model, sources: tuple[str, ...], review: bool = False) -> dict[str, object]:
    """The bench's drafting configurations for ``sources`` (``--drafts``): each source alone, the
    lookups together (the Hierarchy Drafting hierarchy), with ``review`` every source merged
    under the vertical cascade, and every source merged (last: the headline). name → a drafter
    for ``model.drafter`` (None: the heads alone)."""
    from .decoding.drafters import parse_drafts

    sources = parse_drafts(sources)
    lookups = tuple(s for s in sources if s != "heads")
    wanted = [(s,) for s in sources]
    if len(lookups) > 1:
        wanted.append(lookups)
    if len(sources) > 1:
        wanted.append(sources)
    if review:
        wanted.insert(len(wanted) - 1, sources + ("review",))
    with drafting(model, model.drafter):
        return {"+".join(combo): config_drafter(model, combo) for combo in wanted}


def config_drafter(model, combo: tuple[str, ...]):
    """The drafter of one bench configuration: source names, a trailing "review" for the
    vertical cascade. Sets ``model.drafter`` (callers restore theirs with :func:`drafting`)."""
    reviewed = combo[-1] == "review"
    model.use_drafts(combo[:-1] if reviewed else combo, review=reviewed)
    return model.drafter


@contextmanager
def drafting(model, drafter) -> Iterator[None]:
    """``model`` drafts with ``drafter`` inside the block; its own drafter is back afterwards."""
    own, model.drafter = model.drafter, drafter
    try:
        yield
    finally:
        model.drafter = own


def bench_prompt(model, ids: torch.Tensor, max_new_tokens: int, control: bool = True,
                 configs: dict[str, object] | None = None) -> tuple[dict, torch.Tensor]:
    """One prompt, interleaved: HF plain, draftheads under each drafting configuration (default:
    the model's own drafter), then (``control``) HF prompt lookup, the one-argument peer.
    Returns the row and HF's plain output (the reference). The last configuration is the
    row's headline ``draftheads`` entry."""
    plain, hf = timed_hf(model.base, ids, max_new_tokens)
    runs = {}
    for name, drafter in (configs or {"draftheads": model.drafter}).items():
        with drafting(model, drafter):
            runs[name] = timed_draftheads(model, ids, plain, hf, max_new_tokens)
    ours = runs[list(runs)[-1]]
    row = {"prompt_tokens": ids.shape[1], "hf": hf,
           "draftheads": {k: ours[k] for k in ("new_tokens", "seconds", "tokens_per_second", "tau", "verify_steps")},
           "speedup": ours["speedup"], "mismatch": ours["mismatch"]}
    if configs:
        row["drafts"] = runs
    if control:
        lookup, timing = timed_hf(model.base, ids, max_new_tokens, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
        row["prompt_lookup"] = {**timing, "speedup": round(timing["tokens_per_second"] / hf["tokens_per_second"], 4),
                                "mismatch": divergence(model.base, plain, lookup, ids.shape[1])}
    return row, plain


def second_turns(model, prompts: list[dict], max_new_tokens: int) -> list[dict]:
    """MT-Bench second turns: for each prompt with a later turn, the conversation (turn 1, the
    base's own greedy answer to it, turn 2) as one more bench item of category ``mt_bench_turn2``."""
    from .prompts import chat_input

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


def run_bench(model, prompts: list[dict], max_new_tokens: int, out_dir: Path, meta: dict | None = None,
              control: bool = True, log=print, drafts: tuple[str, ...] | None = None,
              turn2: bool = False, review: bool = False) -> dict:
    """Prompts in pairs: each prompt alone through HF plain, draftheads (under each ``drafts``
    configuration, see :func:`draft_configs`) and HF prompt lookup, then (``control``) the pair
    once more as one padded batch of 2 through HF plain. ``turn2``: MT-Bench second turns too."""
    from .prompts import chat_input, conversation_input

    tokenizer, base = model.tokenizer, model.base
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = draft_configs(model, drafts, review) if drafts else None
    warm = chat_input(tokenizer, "Hello!")
    hf_greedy(base, warm, 8)
    for drafter in (configs or {"own": model.drafter}).values():
        with drafting(model, drafter):
            model.generate(warm, max_new_tokens=8)
    if control:
        hf_greedy(base, warm, 8, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
    if turn2:
        prompts = prompts + second_turns(model, prompts, max_new_tokens)
    pad = base.generation_config.pad_token_id if base.generation_config.pad_token_id is not None else eos_ids(base)[0]
    rows: list[dict] = []
    for start in range(0, len(prompts), 2):
        pair = prompts[start: start + 2]
        encoded, references = [], []
        for offset, item in enumerate(pair):
            ids = conversation_input(tokenizer, *item["conversation"]) if "conversation" in item \
                else chat_input(tokenizer, item["prompt"])
            result, plain = bench_prompt(model, ids, max_new_tokens, control, configs)
            row = {"id": item["id"], "category": item["category"], **result}
            rows.append(row)
            encoded.append(ids)
            references.append(plain)
            lookup = f"  lookup {row['prompt_lookup']['speedup']:.2f}x" if control else ""
            each = "".join(f"  {name} {r['speedup']:.2f}x τ={r['tau']:.2f}" for name, r in row.get("drafts", {}).items())
            log(f"[{start + offset + 1}/{len(prompts)}] id={item['id']} {item['category']} "
                f"hf {row['hf']['tokens_per_second']:.1f} tok/s  ours {row['draftheads']['tokens_per_second']:.1f} "
                f"tok/s  τ={row['draftheads']['tau']:.2f}  speedup {row['speedup']:.2f}x{lookup}{each}"
                f"{'  DIVERGED' if row['mismatch'] else ''}", flush=True)
        if control and len(pair) == 2:
            batched = padded_pair(base, encoded[0], encoded[1], max_new_tokens, pad)
            for offset in range(2):
                rows[start + offset]["padded_batch"] = {
                    "mismatch": divergence(base, references[offset], batched[offset], encoded[offset].shape[1])}
    overall = summarize(rows)
    by_category = {c: summarize([r for r in rows if group(r) == c]) for c in dict.fromkeys(group(r) for r in rows)}
    results = {"meta": {**{k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                           for k, v in (meta or {}).items()},
                        "max_new_tokens": max_new_tokens, "prompts": len(rows), "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
                        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                        "dtype": str(base.dtype), "tree_nodes": model.policy.choose(1, 0).num_nodes,
                        "default_drafts": list(model.draft_sources),
                        "drafts": list(configs) if configs else None},
               "overall": overall, "by_category": by_category, "per_prompt": rows}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(rows, overall, out_dir / "results.png")
    if configs:
        plot_drafts(results, out_dir / "drafts.png")
    return results


def group(row: dict) -> str:
    from .prompts import group_of

    return group_of(row["category"])


def _speed(rows: list[dict], key: str) -> tuple[int, float]:
    return sum(r[key]["new_tokens"] for r in rows), sum(r[key]["seconds"] for r in rows)


def summarize(rows: list[dict]) -> dict:
    """Totals over ``rows``: tokens/s (all tokens over all seconds), speedups, τ, and identity
    under the dtype's guarantee — divergences, each one's gap in ulps, those outside the band
    (must be 0) — and the controls: transformers against itself, the same prompts in a padded
    batch of 2 and in prompt-lookup mode (their divergence rates and gaps)."""
    hf_tokens, hf_seconds = _speed(rows, "hf")
    our_tokens, our_seconds = _speed(rows, "draftheads")
    steps = sum(r["draftheads"]["verify_steps"] for r in rows)
    mismatches = [{"id": r["id"], **r["mismatch"]} for r in rows if r["mismatch"]]
    hf_tps, our_tps = hf_tokens / hf_seconds, our_tokens / our_seconds
    summary = {"prompts": len(rows), "hf_new_tokens": hf_tokens, "hf_seconds": round(hf_seconds, 2),
               "hf_tokens_per_second": round(hf_tps, 3), "draftheads_new_tokens": our_tokens,
               "draftheads_seconds": round(our_seconds, 2), "draftheads_tokens_per_second": round(our_tps, 3),
               "speedup": round(our_tps / hf_tps, 4),
               # τ over the whole run: tokens after the prefill token, per verification forward
               "tau": round((our_tokens - len(rows)) / max(1, steps), 4), "verify_steps": steps,
               "identical_prompts": len(rows) - len(mismatches), "mismatching_prompts": len(mismatches),
               "divergence_gaps_ulps": [m["gap_ulps"] for m in mismatches],
               "divergences_outside_band": sum(not m["within_band"] for m in mismatches), "mismatches": mismatches}
    paired = [r for r in rows if "padded_batch" in r]
    if paired:
        control = [r["padded_batch"]["mismatch"] for r in paired if r["padded_batch"]["mismatch"]]
        summary["control_padded_batch"] = {
            "prompts": len(paired), "mismatching_prompts": len(control),
            "divergence_gaps_ulps": [m["gap_ulps"] for m in control],
            "divergences_outside_band": sum(not m["within_band"] for m in control),
            "draftheads_mismatching_on_same_prompts": sum(bool(r["mismatch"]) for r in paired)}
    if rows and all("prompt_lookup" in r for r in rows):
        lookup_tokens, lookup_seconds = _speed(rows, "prompt_lookup")
        control = [r["prompt_lookup"]["mismatch"] for r in rows if r["prompt_lookup"]["mismatch"]]
        summary["prompt_lookup"] = {
            "tokens_per_second": round(lookup_tokens / lookup_seconds, 3),
            "speedup": round(lookup_tokens / lookup_seconds / hf_tps, 4),
            "draftheads_vs_prompt_lookup": round(our_tps / (lookup_tokens / lookup_seconds), 4),
            "mismatching_prompts": len(control), "divergence_gaps_ulps": [m["gap_ulps"] for m in control],
            "divergences_outside_band": sum(not m["within_band"] for m in control)}
    if rows and all("drafts" in r for r in rows):
        summary["drafts"] = {name: drafts_summary(rows, name, hf_tps, summary.get("prompt_lookup"))
                             for name in rows[0]["drafts"]}
    return summary


def drafts_summary(rows: list[dict], name: str, hf_tps: float, lookup: dict | None) -> dict:
    """One drafting configuration over ``rows``: tokens/s, speedup over HF plain and over HF's
    prompt lookup, τ, and divergences (with those outside the dtype's band)."""
    runs = [r["drafts"][name] for r in rows]
    tokens, seconds = sum(x["new_tokens"] for x in runs), sum(x["seconds"] for x in runs)
    steps = sum(x["verify_steps"] for x in runs)
    diverged = [x["mismatch"] for x in runs if x["mismatch"]]
    tps = tokens / seconds
    out = {"tokens_per_second": round(tps, 3), "speedup": round(tps / hf_tps, 4),
           "tau": round((tokens - len(runs)) / max(1, steps), 4), "mismatching_prompts": len(diverged),
           "divergences_outside_band": sum(not m["within_band"] for m in diverged)}
    if lookup:
        out["vs_prompt_lookup"] = round(tps / lookup["tokens_per_second"], 4)
    return out


# -- batched: HF batched greedy vs every fixed tree vs the adaptive policy --------------------
def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids + attention mask, as a tokenizer with ``padding_side='left'`` gives."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def batch_divergences(base, reference: torch.Tensor, ours: torch.Tensor, mask: torch.Tensor) -> list[dict]:
    """Per mismatching row: first differing position and the base's top-1/top-2 gap there."""
    out = []
    width = mask.shape[1]
    for r in range(reference.shape[0]):
        if reference[r].tolist() == ours[r].tolist():
            continue
        start = width - int(mask[r].sum())
        diag = divergence(base, reference[r:r + 1, start:], ours[r:r + 1, start:], width - start)
        out.append({"row": r, **(diag or {})})
    return out


def rotated(names: list[str], shift: int) -> list[str]:
    """The strategies in batch ``shift``'s order: each batch starts one strategy later, so a slow
    spell of a shared machine (measured here: 10-15 % for tens of seconds) does not always hit
    the same strategy."""
    k = shift % len(names)
    return names[k:] + names[:k]


def keep_fastest(best: dict, name: str, result: tuple) -> None:
    """Keep ``name``'s fastest (output, seconds) run. Greedy output does not depend on timing, so
    repeating a batch only filters the host's slow spells: the fastest run is the estimate least
    disturbed by other load (timeit's rule)."""
    if name not in best or result[1] < best[name][1]:
        best[name] = result


def strategy_names(budgets: list[int], compare_mask: bool, drafted: Sequence[str] = ()) -> list[str]:
    """The batched bench's strategies: HF, each fixed tree, the adaptive policy (heads alone),
    its masked variant; with draft sources (``drafted``) HF, the adaptive policy with the heads
    alone and with each drafting combination instead of the fixed trees."""
    if drafted:
        return ["hf", "adaptive"] + [f"adaptive+{name}" for name in drafted]
    names = ["hf"] + [f"fixed:{b}" for b in budgets] + ["adaptive"]
    return names + (["adaptive:mask"] if compare_mask else [])


def prompt_label(prompts: list[dict]) -> str:
    """E.g. "28 prompts, 13 categories": what a figure's title says it ran on."""
    categories = {p.get("category") for p in prompts}
    return f"{len(prompts)} prompts, {len(categories)} categories"


def batch_draft_combos(sources: Sequence[str], review: bool = False) -> list[tuple[str, ...]]:
    """What the batched bench runs beside the heads-only policy for ``--drafts``: the lookups
    together (the Hierarchy Drafting hierarchy, no heads), every source merged, and with
    ``review`` every source merged under the vertical cascade (a trailing "review")."""
    from .decoding.drafters import parse_drafts

    sources = parse_drafts(sources)
    lookups = tuple(s for s in sources if s != "heads")
    combos = [lookups] if lookups else []
    if lookups and "heads" in sources:
        combos.append(sources)
        if review:
            combos.append(sources + ("review",))
    return combos


def run_batch_bench(model, prompts: list[dict], batch_sizes: list[int], budgets: list[int], max_new_tokens: int,
                    out_dir: Path, max_batches: int | dict[int, int] = 4, compare_mask: bool = True, meta: dict | None = None,
                    surfaces: list[Path] = (), log=print, recalibrate: bool = False, repeats: int = 1,
                    drafts: Sequence[str] | None = None, review: bool = False) -> dict:
    """One run, the same batches for every strategy (the first ``bs × max_batches`` prompts
    in the order given — the CLI deals categories round-robin — chat template, left padding), strategies interleaved per batch (in a rotating
    order) so they share the machine's state. Throughput = new tokens (to EOS) over the batch /
    wall seconds; with ``repeats`` > 1 each strategy runs each batch that often and its fastest run
    counts (the mean over all runs is saved too). The adaptive policy chooses among exactly the
    compared budgets, so "best fixed tree" is the best of its own options. With ``drafts``
    (source names) the adaptive policy with the heads alone runs against the same policy with
    lookups (:func:`batch_draft_combos`), whose merged trees are sized by its cost model."""
    from .prompts import chat_input
    from .decoding.generate import FixedTree, eos_token_ids, tree_for_budget
    from .decoding.policy import AdaptivePolicy, calibrate

    base, tokenizer = model.base, model.tokenizer
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = set(eos_token_ids(base.generation_config))
    pad = base.generation_config.pad_token_id
    pad = pad if pad is not None else (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos))
    cost = calibrate(base, model.heads, log=log, refresh=recalibrate)
    adaptive = AdaptivePolicy.from_heads(model.heads, cost, budgets=budgets)
    policies = {f"fixed:{b}": FixedTree(tree_for_budget(model.heads, b)) for b in budgets}
    policies["adaptive"] = policies["adaptive:mask"] = adaptive
    model.policy = adaptive  # the drafters below size their trees with its cost model
    with drafting(model, model.drafter):  # configuration name → its drafter
        drafters = {"+".join(c): config_drafter(model, c) for c in (batch_draft_combos(drafts, review) if drafts else [])}
    names = strategy_names(budgets, compare_mask and not drafts, list(drafters))
    encoded = [chat_input(tokenizer, p["prompt"])[0].tolist() for p in prompts]

    def run(name: str, ids: torch.Tensor, mask: torch.Tensor, new: int):
        if name == "hf":
            return base.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=pad), None
        model.policy = policies.get(name, adaptive)
        model.finished_rows = "mask" if name.endswith(":mask") else "shrink"
        with drafting(model, drafters.get(name.removeprefix("adaptive+"))):  # None: the heads alone
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=pad)
        return out, model.last_stats

    warm_ids, warm_mask = left_pad(encoded[:2], pad)
    for name in names:
        run(name, warm_ids, warm_mask, 4)
    adaptive.reset()  # the online τ scale starts from the checkpoint's τ, then learns through the run

    results: dict = {}
    for bs in batch_sizes:
        count = max_batches[bs] if isinstance(max_batches, dict) else max_batches
        batches = [encoded[i: i + bs] for i in range(0, min(len(encoded), bs * count), bs)]
        batches = [b for b in batches if len(b) == bs]
        if not batches:
            log(f"bs {bs}: fewer than {bs} prompts, skipped (raise --limit)")
            continue
        acc = {n: {"new_tokens": 0, "seconds": 0.0, "accepted": 0, "steps_rows": 0, "steps": 0, "trees": {},
                   "mismatching_rows": 0, "mismatches": [], "delegated": 0, "seconds_all_runs": 0.0} for n in names}
        for bi, rows in enumerate(batches):
            ids, mask = left_pad(rows, pad)
            runs: dict = {}
            for rep in range(repeats):
                for name in rotated(names, bi * repeats + rep):
                    result = timed(lambda: run(name, ids, mask, max_new_tokens))
                    acc[name]["seconds_all_runs"] += result[1]
                    keep_fastest(runs, name, result)
            reference = runs["hf"][0][0]
            for name in names:
                (out, stats), seconds = runs[name]
                a = acc[name]
                a["new_tokens"] += sum(generated_counts(out, ids.shape[1], eos))
                a["seconds"] += seconds
                if name == "hf":
                    continue
                a["accepted"] += sum(stats.accepted)
                a["steps_rows"] += len(stats.accepted)
                a["steps"] += stats.steps
                a["delegated"] += int(stats.delegated)
                for live, nodes in stats.trees_by_batch_size().items():
                    for n, count in nodes.items():
                        key = f"{live}:{n}"
                        a["trees"][key] = a["trees"].get(key, 0) + count
                diverged = batch_divergences(base, reference, out, mask)
                a["mismatching_rows"] += len(diverged)
                a["mismatches"] += [{"batch": bi, **d} for d in diverged]
            log(f"bs {bs} batch {bi + 1}/{len(batches)}: " + "  ".join(
                f"{n} {acc[n]['new_tokens'] / max(acc[n]['seconds'], 1e-9):.1f}" for n in names) + " tok/s")
        table = {}
        for name, a in acc.items():
            entry = {"new_tokens": a["new_tokens"], "seconds": round(a["seconds"], 3),
                     "tokens_per_second": round(a["new_tokens"] / a["seconds"], 3),
                     "tokens_per_second_mean_of_runs": round(a["new_tokens"] * repeats / a["seconds_all_runs"], 3)}
            if name != "hf":
                entry.update({"tau": round((a["accepted"] + a["steps_rows"]) / max(1, a["steps_rows"]), 4),
                              "verify_steps": a["steps"],
                              "trees_live_rows_to_nodes": dict(sorted(a["trees"].items(),
                                                                      key=lambda kv: tuple(map(int, kv[0].split(":"))))),
                              "batches_run_by_base_generate": a["delegated"],
                              "mismatching_rows": a["mismatching_rows"],
                              "divergences_outside_band": sum(not m.get("within_band", False) for m in a["mismatches"]),
                              "mismatches": a["mismatches"]})
            table[name] = entry
        hf_tps = table["hf"]["tokens_per_second"]
        for entry in table.values():
            entry["speedup_vs_hf"] = round(entry["tokens_per_second"] / hf_tps, 4)
        best_fixed = max((n for n in table if n.startswith("fixed:") or n == "hf"),
                         key=lambda n: table[n]["tokens_per_second"])
        for name in table:
            if name.startswith("adaptive+"):
                table[name]["vs_adaptive_heads"] = round(table[name]["tokens_per_second"]
                                                         / table["adaptive"]["tokens_per_second"], 4)
        ctx = int(sum(len(r) for b in batches for r in b) / sum(len(b) for b in batches)) + max_new_tokens // 2
        predicted = adaptive.rank(bs, ctx)
        results[str(bs)] = {"batches": len(batches), "prompts": len(batches) * bs, "strategies": table,
                            "best_of_fixed_and_hf": best_fixed,
                            "adaptive_vs_best": round(table["adaptive"]["tokens_per_second"]
                                                      / table[best_fixed]["tokens_per_second"], 4),
                            "policy_prediction": {"context": ctx, "tau_scale": round(adaptive.scale, 4),
                                                  "ranked": [asdict_choice(c) for c in predicted]}}
    payload = {"meta": {**{k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                           for k, v in (meta or {}).items()},
                        "max_new_tokens": max_new_tokens, "batch_sizes": batch_sizes, "budgets": budgets,
                        "repeats": repeats,
                        "torch": torch.__version__, "threads": torch.get_num_threads(),
                        "machine": platform.processor() or platform.machine(), "dtype": str(base.dtype),
                        "calibration_seconds": cost.meta.get("seconds")},
               "results": results, "gpu_surfaces": policy_on_surfaces(model.heads, list(surfaces)),
               "calibration": cost.to_dict()}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    plot_throughput(results, out_dir / "throughput.png", max_new_tokens, prompts=prompt_label(prompts),
                    heads=model.heads.config.family.capitalize())
    plot_surface(cost, adaptive, out_dir / "latency_surface.png")
    return payload


def policy_on_surfaces(heads, paths: list[Path], batch_sizes=(1, 2, 4, 8, 16, 32, 64)) -> dict:
    """What the adaptive policy would choose on measured GPU forward costs (no drafting or loop
    overhead in those files, checkpoint τ): predicted speedups over plain decoding, not measured."""
    from .decoding.policy import AdaptivePolicy, load_cost_surface

    out = {}
    for path in paths:
        cost = load_cost_surface(path)
        policy = AdaptivePolicy.from_heads(heads, cost, learn=False)
        ctx = int(cost.meta.get("ctx", 512))
        rows = {}
        for bs in batch_sizes:
            ranked = policy.rank(bs, ctx)
            plain = next(c for c in ranked if c.budget == 0)
            rows[str(bs)] = {"budget": ranked[0].budget, "predicted_speedup_vs_plain":
                             round(ranked[0].tokens_per_second / plain.tokens_per_second, 3)}
        out[Path(path).name] = {"model": cost.meta.get("model"), "device": cost.meta.get("device"), "ctx": ctx,
                                "choice": rows}
    return out


def asdict_choice(choice) -> dict:
    return {"budget": choice.budget, "nodes": choice.nodes, "tau": round(choice.tau, 4),
            "step_ms": round(choice.step_ms, 2), "tokens_per_second": round(choice.tokens_per_second, 2)}
