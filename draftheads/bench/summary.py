"""Totals of a bench run: tokens/s, speedups, τ and identity per configuration, for the
bs-1 bench (:func:`summarize`) and the batched one (:func:`strategy_table`)."""
from __future__ import annotations

from pathlib import Path

from ..decoding.loop import decode_rate, ms_per_step, tau
from .runs import DEFAULT_CONFIG, TWIN_CONFIG

#: the key a bs-1 bench writes its source configurations under: in each prompt's row and each
#: summary (name → timing), in ``meta`` (the names timed) and ``meta["default_sources"]`` (the
#: model's own sources). Runs written before the rename used ``drafts`` / ``default_drafts``:
#: every reader goes through :func:`with_sources`.
SOURCES, DEFAULT_SOURCES = "sources", "default_sources"
OLD_KEYS = {"drafts": SOURCES, "default_drafts": DEFAULT_SOURCES}


def renamed(entry: dict) -> dict:
    """``entry`` with its old keys under their new names. An old key wins over the new one beside
    it: in an old run's ``meta``, ``sources`` is the command's ``--sources`` and ``drafts`` the
    names timed, which the bench now writes as ``sources``."""
    if not OLD_KEYS.keys() & entry.keys():
        return entry
    return {**{k: v for k, v in entry.items() if k not in OLD_KEYS},
            **{OLD_KEYS[k]: v for k, v in entry.items() if k in OLD_KEYS}}


def with_sources(results: dict) -> dict:
    """A bench's ``results.json`` payload, old (``drafts``) or new (``sources``), with the source
    configurations under :data:`SOURCES` in ``meta``, ``overall``, ``by_category`` and
    ``per_prompt`` (a batched run's payload: in ``meta``). ``results`` is not changed."""
    out = dict(results)
    for key in ("meta", "overall"):
        if isinstance(out.get(key), dict):
            out[key] = renamed(out[key])
    if isinstance(out.get("by_category"), dict):
        out["by_category"] = {name: renamed(s) for name, s in out["by_category"].items()}
    if isinstance(out.get("per_prompt"), list):
        out["per_prompt"] = [renamed(row) for row in out["per_prompt"]]
    return out


def group(row: dict) -> str:
    from ..prompts import group_of

    return group_of(row["category"])


def _speed(rows: list[dict], key: str) -> tuple[int, float]:
    return sum(r[key]["new_tokens"] for r in rows), sum(r[key]["seconds"] for r in rows)


def run_tau(new_tokens: int, prompts: int, steps: int) -> float:
    """τ over a whole run from its output: the tokens after each prompt's prefill token, per
    verification forward (bs 1: :func:`~draftheads.decoding.loop.tau` but for a last step cut short)."""
    return round((new_tokens - prompts) / max(1, steps), 4)


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
               "tau": run_tau(our_tokens, len(rows), steps), "verify_steps": steps,
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
    if rows and all("peers" in r for r in rows):
        summary["peers"] = {name: peer_summary(rows, name, hf_tps, our_tps) for name in rows[0]["peers"]}
    if rows and all(SOURCES in r for r in rows):
        summary[SOURCES] = {name: source_summary(rows, name, hf_tps, summary.get("prompt_lookup"))
                            for name in rows[0][SOURCES]}
        speeds = {name: d["tokens_per_second"] for name, d in summary[SOURCES].items()}
        parts = [tps for name, tps in speeds.items() if name not in (DEFAULT_CONFIG, TWIN_CONFIG)]
        if DEFAULT_CONFIG in speeds and parts:
            summary["default_vs_best_part"] = round(speeds[DEFAULT_CONFIG] / max(parts), 4)
        if DEFAULT_CONFIG in speeds and TWIN_CONFIG in speeds:  # the A/A control: 1 but for noise
            summary["twin_vs_default"] = round(speeds[TWIN_CONFIG] / speeds[DEFAULT_CONFIG], 4)
    return summary


def peer_summary(rows: list[dict], name: str, hf_tps: float, our_tps: float) -> dict:
    """A CPU engine's totals over ``rows``: tokens/s, its speedup over HF, draftheads over it, its
    decoding ms a token apart from prefill (the tokens after the first over their time) beside
    draftheads' ms a verification step apart from prefill (the steps over the time after the first
    token), and how many prompts it answered with HF's greedy tokens."""
    runs = [r["peers"][name] for r in rows]
    tokens, seconds = sum(r["new_tokens"] for r in runs), sum(r["seconds"] for r in runs)
    tps = tokens / seconds
    later = sum(r["new_tokens"] - 1 for r in runs)
    decode_ms = 1e3 * sum(r["seconds"] - r["first_token_seconds"] for r in runs) / max(1, later)
    ours = [r["draftheads"] for r in rows]
    step_ms = 1e3 * sum(r["seconds"] - r["prefill_seconds"] for r in ours) / max(1, sum(r["verify_steps"] for r in ours))
    return {"tokens_per_second": round(tps, 3), "speedup": round(tps / hf_tps, 4),
            "draftheads_vs_peer": round(our_tps / tps, 4), "decode_ms_per_token": round(decode_ms, 3),
            "draftheads_ms_per_verify_step": round(step_ms, 3), "step_vs_peer_token": round(step_ms / decode_ms, 4),
            "same_as_hf_prompts": sum(r["same_as_hf"] for r in runs)}


def source_summary(rows: list[dict], name: str, hf_tps: float, lookup: dict | None) -> dict:
    """One source configuration over ``rows``: tokens/s, speedup over HF plain and over HF's
    prompt lookup, τ, and divergences (with those outside the dtype's band)."""
    runs = [r[SOURCES][name] for r in rows]
    tokens, seconds = sum(x["new_tokens"] for x in runs), sum(x["seconds"] for x in runs)
    steps = sum(x["verify_steps"] for x in runs)
    diverged = [x["mismatch"] for x in runs if x["mismatch"]]
    tps = tokens / seconds
    out = {"tokens_per_second": round(tps, 3), "speedup": round(tps / hf_tps, 4),
           "tau": run_tau(tokens, len(runs), steps), "mismatching_prompts": len(diverged),
           "divergences_outside_band": sum(not m["within_band"] for m in diverged)}
    if lookup:
        out["vs_prompt_lookup"] = round(tps / lookup["tokens_per_second"], 4)
    return out



def policy_on_surfaces(heads, paths: list[Path], batch_sizes=(1, 2, 4, 8, 16, 32, 64)) -> dict:
    """What the adaptive policy would choose on measured GPU forward costs (no drafting or loop
    overhead in those files, checkpoint τ): predicted speedups over plain decoding, not measured."""
    from ..decoding.cost import load_cost_surface
    from ..decoding.policy import AdaptivePolicy

    out = {}
    for path in paths:
        cost = load_cost_surface(path)
        policy = AdaptivePolicy.from_heads(heads, cost, learn=False)
        kv_len = int(cost.meta.get("ctx", 512))
        rows = {}
        for bs in batch_sizes:
            ranked = policy.rank(bs, kv_len)
            plain = next(c for c in ranked if c.budget == 0)
            rows[str(bs)] = {"budget": ranked[0].budget, "predicted_speedup_vs_plain":
                             round(ranked[0].tokens_per_second / plain.tokens_per_second, 3)}
        out[Path(path).name] = {"model": cost.meta.get("model"), "device": cost.meta.get("device"), "ctx": kv_len,
                                "choice": rows}
    return out


def asdict_choice(choice) -> dict:
    return {"budget": choice.budget, "nodes": choice.nodes, "tau": round(choice.tau, 4),
            "step_ms": round(choice.step_ms, 2), "tokens_per_second": round(choice.tokens_per_second, 2)}


def ratio(a: float, b: float) -> float | None:
    """a / b to 4 places; None where b is 0 (no decode phase to compare)."""
    return round(a / b, 4) if b else None


def new_tally() -> dict:
    """One strategy's running totals over a batch size's batches (see :func:`tally`)."""
    return {"new_tokens": 0, "seconds": 0.0, "accepted": 0, "steps_rows": 0, "steps": 0, "trees": {}, "mismatching_rows": 0,
            "mismatches": [], "delegated": 0, "seconds_all_runs": 0.0, "prefill_seconds": 0.0, "first_tokens": 0,
            "drafting_seconds": 0.0}


def tally(totals: dict, new_tokens: int, seconds: float, stats=None, diverged: list[dict] = (), batch: int = 0,
          prefill_seconds: float = 0.0, rows: int = 0) -> None:
    """Add one batch's fastest run: its new tokens and seconds, its prefill seconds and the
    ``rows`` first tokens that phase produced, and for draftheads (``stats``, a ``DecodingStats``)
    the accepted drafts, steps, trees by live rows and the rows that diverged from transformers'
    (``diverged``, see ``batch_divergences``)."""
    totals["new_tokens"] += new_tokens
    totals["seconds"] += seconds
    totals["prefill_seconds"] += prefill_seconds
    totals["first_tokens"] += rows
    if stats is None:
        return
    totals["accepted"] += sum(stats.accepted)
    totals["steps_rows"] += len(stats.accepted)
    totals["steps"] += stats.steps
    totals["drafting_seconds"] += stats.drafting_seconds
    totals["delegated"] += int(stats.delegated)
    for live, nodes in stats.trees_by_batch_size().items():
        for n, count in nodes.items():
            key = f"{live}:{n}"
            totals["trees"][key] = totals["trees"].get(key, 0) + count
    totals["mismatching_rows"] += len(diverged)
    totals["mismatches"] += [{"batch": batch, **d} for d in diverged]


def strategy_table(totals: dict[str, dict], repeats: int) -> dict[str, dict]:
    """Per strategy: tokens/s (fastest runs, and the mean of all runs), speedup over HF; for
    draftheads τ, steps, trees by live rows, divergences; and each lookup configuration's gain
    over the adaptive policy with the heads alone."""
    table = {}
    for name, a in totals.items():
        entry = {"new_tokens": a["new_tokens"], "seconds": round(a["seconds"], 3),
                 "tokens_per_second": round(a["new_tokens"] / a["seconds"], 3),
                 "tokens_per_second_mean_of_runs": round(a["new_tokens"] * repeats / a["seconds_all_runs"], 3),
                 "prefill_seconds": round(a["prefill_seconds"], 4),
                 "decode_tokens_per_second": round(decode_rate(a["new_tokens"], a["first_tokens"], a["seconds"],
                                                               a["prefill_seconds"]), 3)}
        if name != "hf":
            entry.update({"tau": round(tau(a["accepted"], a["steps_rows"]), 4), "verify_steps": a["steps"],
                          "drafting_ms_per_step": round(ms_per_step(a["drafting_seconds"], a["steps"]), 3),
                          "trees_live_rows_to_nodes": dict(sorted(a["trees"].items(),
                                                                  key=lambda kv: tuple(map(int, kv[0].split(":"))))),
                          "batches_run_by_base_generate": a["delegated"],
                          "mismatching_rows": a["mismatching_rows"],
                          "divergences_outside_band": sum(not m.get("within_band", False) for m in a["mismatches"]),
                          "mismatches": a["mismatches"]})
        table[name] = entry
    hf = table["hf"]
    for entry in table.values():
        entry["speedup_vs_hf"] = round(entry["tokens_per_second"] / hf["tokens_per_second"], 4)
        entry["decode_speedup_vs_hf"] = ratio(entry["decode_tokens_per_second"], hf["decode_tokens_per_second"])
    for name in table:
        if name.startswith("adaptive+"):
            heads = table["adaptive"]
            table[name]["vs_adaptive_heads"] = round(table[name]["tokens_per_second"] / heads["tokens_per_second"], 4)
            table[name]["decode_vs_adaptive_heads"] = ratio(table[name]["decode_tokens_per_second"],
                                                            heads["decode_tokens_per_second"])
    return table


def batch_size_result(table: dict[str, dict], batches: list[list[list[int]]], max_new_tokens: int, adaptive) -> dict:
    """One batch size's entry: the strategy table, the best of HF and the fixed trees, the
    adaptive policy against it, and what the policy predicted at the batches' mean context."""
    bs = len(batches[0])
    best_fixed = max((n for n in table if n.startswith("fixed:") or n == "hf"), key=lambda n: table[n]["tokens_per_second"])
    kv_len = int(sum(len(r) for b in batches for r in b) / sum(len(b) for b in batches)) + max_new_tokens // 2
    return {"batches": len(batches), "prompts": len(batches) * bs, "strategies": table,
            "best_of_fixed_and_hf": best_fixed,
            "adaptive_vs_best": round(table["adaptive"]["tokens_per_second"] / table[best_fixed]["tokens_per_second"], 4),
            "policy_prediction": {"context": kv_len, "tau_scale": round(adaptive.scale, 4),
                                  "ranked": [asdict_choice(c) for c in adaptive.rank(bs, kv_len)]}}
