"""The batched bench: transformers' batched greedy ``generate`` against every fixed tree and the
batch-size-adaptive policy (or, with draft sources, that policy with the heads alone against
it with lookups), on the same left-padded batches, strategies interleaved per batch."""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..decoding.guarantee import first_divergence as divergence
from ..decoding.loop import FirstTokenClock, decode_rate
from ..decoding.output import generated_counts
from ..decoding.request import left_pad
from ..plots import plot_surface, plot_throughput
from .runs import config_model, keep_fastest, rotated, run_meta, timed
from .summary import batch_size_result, new_tally, policy_on_surfaces, strategy_table, tally


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


#: the suffix of a drafting strategy whose rows take their own node counts (``WidthChooser.per_row``)
PER_ROW = ":per-row"


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
    """What the batched bench runs beside the heads-only policy for ``--sources``: the lookups
    together (the Hierarchy Drafting hierarchy, no heads), every source merged, and with
    ``review`` every source merged under the vertical cascade (a trailing "review")."""
    from ..decoding.drafters import parse_sources

    sources = parse_sources(sources)
    lookups = tuple(s for s in sources if s != "heads")
    combos = [lookups] if lookups else []
    if lookups and "heads" in sources:
        combos.append(sources)
        if review:
            combos.append(sources + ("review",))
    return combos



@dataclass
class BatchBench:
    """The strategies of one batched run and how to run each on a batch (see :func:`run_batch_bench`)."""

    model: object
    pad: int
    eos: set[int]
    cost: object  # the calibrated CostModel
    adaptive: object  # the AdaptivePolicy over the compared budgets
    models: dict  # strategy name → a light model decoding that way (``with_decoding``), "hf" aside
    names: list[str]

    @classmethod
    def prepare(cls, model, budgets: list[int], compare_mask: bool, sources: Sequence[str] | None, review: bool,
                log=print, recalibrate: bool = False) -> "BatchBench":
        """Calibrate, then build every strategy as a light model over ``model``'s base and heads
        (its policy, drafter and finished-row handling); ``model`` itself is not changed."""
        from ..decoding.calibration import calibrate
        from ..decoding.policy import AdaptivePolicy, FixedTree, tree_for_budget
        from ..decoding.request import eos_token_ids

        base, tokenizer = model.base, model.tokenizer
        eos = set(eos_token_ids(base.generation_config))
        pad = base.generation_config.pad_token_id
        pad = pad if pad is not None else (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos))
        cost = calibrate(base, model.heads, log=log, refresh=recalibrate)
        adaptive = AdaptivePolicy.from_heads(model.heads, cost, budgets=budgets)
        policies = {f"fixed:{b}": FixedTree(tree_for_budget(model.heads, b)) for b in budgets}
        policies["adaptive"] = policies["adaptive:mask"] = adaptive
        models = {name: model.with_decoding(tree=policy, sources="heads",
                                            finished_rows="mask" if name.endswith(":mask") else "shrink")
                  for name, policy in policies.items()}
        drafting = []  # configuration names with lookups; their drafters size trees with the adaptive policy's costs
        for combo in batch_draft_combos(sources, review) if sources else []:
            name = "+".join(combo)
            drafting.append(name)
            models["adaptive+" + name] = config_model(model, combo, tree=adaptive)
            if "heads" in combo and combo[-1] != "review":  # the same drafting, each row its own node count
                drafting.append(name + PER_ROW)
                models["adaptive+" + name + PER_ROW] = config_model(model, combo, tree=adaptive, per_row_counts=True)
        names = strategy_names(budgets, compare_mask and not sources, drafting)
        return cls(model, pad, eos, cost, adaptive, models, names)

    def run(self, name: str, ids: torch.Tensor, mask: torch.Tensor, new: int):
        """One strategy on one batch: (its output, its DecodingStats (None for HF), its prefill seconds)."""
        if name == "hf":
            clock, started = FirstTokenClock(), time.perf_counter()
            out = self.model.base.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                           pad_token_id=self.pad, logits_processor=[clock])
            return out, None, clock.since(started)
        model = self.models[name]
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=self.pad)
        return out, model.last_stats, model.last_stats.prefill_seconds

    def warm_up(self, rows: list[list[int]]) -> None:
        ids, mask = left_pad(rows, self.pad)
        for name in self.names:
            self.run(name, ids, mask, 4)
        self.adaptive.reset()  # the online τ scale starts from the checkpoint's τ, then learns through the run

    def fastest_runs(self, ids: torch.Tensor, mask: torch.Tensor, new: int, batch: int, repeats: int,
                     totals: dict[str, dict]) -> dict:
        """Every strategy ``repeats`` times on one batch in rotating order: name → its fastest
        ((output, stats), seconds); every run's time joins its ``seconds_all_runs``."""
        runs: dict = {}
        for rep in range(repeats):
            for name in rotated(self.names, batch * repeats + rep):
                result = timed(lambda: self.run(name, ids, mask, new))
                totals[name]["seconds_all_runs"] += result[1]
                keep_fastest(runs, name, result)
        return runs

    def batch_size(self, batches: list[list[list[int]]], max_new_tokens: int, repeats: int, log=print) -> dict:
        """Every strategy on every batch of one batch size: that size's result entry."""
        totals = {n: new_tally() for n in self.names}
        for bi, rows in enumerate(batches):
            ids, mask = left_pad(rows, self.pad)
            runs = self.fastest_runs(ids, mask, max_new_tokens, bi, repeats, totals)
            reference = runs["hf"][0][0]
            for name in self.names:
                (out, stats, prefill), seconds = runs[name]
                diverged = [] if stats is None else batch_divergences(self.model.base, reference, out, mask)
                tally(totals[name], sum(generated_counts(out, ids.shape[1], self.eos)), seconds, stats, diverged, bi,
                      prefill, len(rows))
            log(f"bs {len(rows)} batch {bi + 1}/{len(batches)}: " + "  ".join(
                f"{n} {totals[n]['new_tokens'] / max(totals[n]['seconds'], 1e-9):.1f}" for n in self.names)
                + " tok/s; decode phase " + "  ".join(
                f"{n} {decode_rate(t['new_tokens'], t['first_tokens'], t['seconds'], t['prefill_seconds']):.1f}"
                for n, t in totals.items()) + " tok/s")
        return batch_size_result(strategy_table(totals, repeats), batches, max_new_tokens, self.adaptive)


def batches_of(encoded: list[list[int]], bs: int, max_batches: int | dict[int, int]) -> list[list[list[int]]]:
    """The first ``bs × max_batches`` prompts as full batches of ``bs`` (in the order given)."""
    count = max_batches[bs] if isinstance(max_batches, dict) else max_batches
    batches = [encoded[i: i + bs] for i in range(0, min(len(encoded), bs * count), bs)]
    return [b for b in batches if len(b) == bs]


def run_batch_bench(model, prompts: list[dict], batch_sizes: list[int], budgets: list[int], max_new_tokens: int,
                    out_dir: Path, max_batches: int | dict[int, int] = 4, compare_mask: bool = True, meta: dict | None = None,
                    surfaces: list[Path] = (), log=print, recalibrate: bool = False, repeats: int = 1,
                    sources: Sequence[str] | None = None, review: bool = False) -> dict:
    """One run, the same batches for every strategy (the first ``bs × max_batches`` prompts
    in the order given — the CLI deals categories round-robin — chat template, left padding),
    strategies interleaved per batch (in a rotating order) so they share the machine's state.
    Throughput = new tokens (to EOS) over the batch / wall seconds; with ``repeats`` > 1 each
    strategy runs each batch that often and its fastest run counts (the mean over all runs is
    saved too). The adaptive policy chooses among exactly the compared budgets, so "best fixed
    tree" is the best of its own options. With ``sources`` (source names) the adaptive policy
    with the heads alone runs against the same policy with lookups (:func:`batch_draft_combos`),
    whose merged trees are sized by its cost model. The model is not changed (each strategy is a
    light model over its base and heads)."""
    from ..prompts import chat_input

    out_dir.mkdir(parents=True, exist_ok=True)
    bench = BatchBench.prepare(model, budgets, compare_mask, sources, review, log, recalibrate)
    encoded = [chat_input(model.tokenizer, p["prompt"])[0].tolist() for p in prompts]
    bench.warm_up(encoded[:2])
    results: dict = {}
    for bs in batch_sizes:
        batches = batches_of(encoded, bs, max_batches)
        if not batches:
            log(f"bs {bs}: fewer than {bs} prompts, skipped (raise --limit)")
            continue
        results[str(bs)] = bench.batch_size(batches, max_new_tokens, repeats, log)
    cost = bench.cost
    payload = {"meta": run_meta(meta, model.base, max_new_tokens=max_new_tokens, batch_sizes=batch_sizes,
                                budgets=budgets, repeats=repeats, calibration_seconds=cost.meta.get("seconds")),
               "results": results, "gpu_surfaces": policy_on_surfaces(model.heads, list(surfaces)),
               "calibration": cost.to_dict()}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    plot_throughput(results, out_dir / "throughput.png", max_new_tokens, prompts=prompt_label(prompts),
                    heads=model.heads.config.family.capitalize())
    plot_surface(cost, bench.adaptive, out_dir / "latency_surface.png")
    return payload
