"""Benchmarks against transformers' own ``generate``, by job: what every bench shares
(:mod:`.runs`), the batch-size-1 bench (:mod:`.single`), the batched bench (:mod:`.batched`)
and their totals (:mod:`.summary`); figures in :mod:`draftheads.plots`. No bench changes the
model it is given: each configuration is a light model over its base and heads
(:meth:`~draftheads.decoding.DraftHeadsModel.with_decoding`)."""
from ..decoding.request import left_pad
from ..plots import plot, plot_sources, plot_surface, plot_throughput
from .batched import BatchBench, batch_divergences, batch_draft_combos, prompt_label, run_batch_bench, strategy_names
from .runs import (PROMPT_LOOKUP_TOKENS, config_model, draft_configs, eos_ids, hf_greedy, keep_fastest, rotated, run_timing, timed, timed_draftheads, timed_hf, warm_up_paths)
from .single import bench_prompt, padded_pair, run_bench, second_turns
from .summary import asdict_choice, source_summary, group, policy_on_surfaces, summarize

__all__ = ["PROMPT_LOOKUP_TOKENS", "BatchBench", "asdict_choice", "batch_divergences", "batch_draft_combos",
           "bench_prompt", "config_model", "draft_configs", "source_summary", "eos_ids", "group",
           "hf_greedy", "keep_fastest", "left_pad", "padded_pair", "plot", "plot_sources",
           "plot_surface", "plot_throughput", "policy_on_surfaces", "prompt_label", "rotated", "run_batch_bench",
           "run_bench", "run_timing", "second_turns", "strategy_names", "summarize", "timed", "timed_draftheads",
           "timed_hf", "warm_up_paths"]
