"""``draftheads bench``: plain HF greedy generate vs draftheads on a prompt file (bs 1: per
category tokens/s, speedup, τ and identity under the dtype's guarantee, with controls; with
``--batch-sizes``: batched HF generate vs every fixed tree vs the adaptive policy), JSON + PNG."""
from __future__ import annotations

import json
from pathlib import Path

from ..bench.summary import DEFAULT_SOURCES, SOURCES, with_sources
from ..core.errors import InputError
from ..prompts import cost_surfaces, round_robin
from ..arguments import add_sources_option, source_list
from .generate_command import check_review_option, load_model
from .parsing import count_argument, int_list, positive_list, read_prompts


def batches_per_size(batch_sizes: list[int], max_batches: list[int]) -> dict[int, int]:
    """``--max-batches`` as {batch size: batches}: one value for all sizes or one per size."""
    if len(max_batches) == 1:
        max_batches = max_batches * len(batch_sizes)
    if len(max_batches) != len(batch_sizes) or min(max_batches) < 1:
        raise InputError(f"--max-batches needs one positive number or one per batch size "
                         f"({len(batch_sizes)}), got {','.join(map(str, max_batches))}.")
    return dict(zip(batch_sizes, max_batches))


def cmd_bench(args) -> int:
    from ..bench import run_batch_bench, run_bench

    read_prompts(args.prompts, args.limit)  # a bad prompt file fails before the model loads
    check_review_option(args.review, args.sources)
    if args.twin and not args.parts:
        raise InputError("--twin is the control of --parts: add --parts.")
    if args.parts and (args.sources or args.batch_sizes):
        raise InputError("--parts compares the default with its parts in the bs-1 bench: drop --sources/--batch-sizes.")
    if args.peers and args.batch_sizes:
        raise InputError("--peers compares engines in the bs-1 bench: drop --batch-sizes.")
    model = load_model(args)
    peers, meta = None, vars(args)
    if args.peers:
        from ..bench.peers import load_peers, peer_builds
        from ..bench.runs import eos_ids

        peers = load_peers(args.peers, model.base, eos_ids(model.base))
        meta = {**meta, "peer_builds": peer_builds(peers)}
    if args.batch_sizes:
        if min(args.batch_sizes) < 1:
            raise InputError("--batch-sizes must be positive.")
        if args.repeats < 1:
            raise InputError(f"--repeats must be at least 1, got {args.repeats}.")
        if model.heads is None:
            raise InputError("--batch-sizes compares tree strategies and needs heads (--heads).")
        stored = sorted(int(b) for b in model.heads.config.trees)
        budgets = args.budgets if args.budgets is not None else [0] + [b for b in stored if b in (1, 2, 4, 8, 16)]
        unknown = [b for b in budgets if b and b not in stored]
        if unknown:
            raise InputError(f"no stored tree for budget(s) {unknown}; the checkpoint stores {stored}.")
        per_size = batches_per_size(args.batch_sizes, args.max_batches)
        prompts = round_robin(read_prompts(args.prompts, None))[: args.limit or max(bs * n for bs, n in per_size.items())]
        out = Path(args.out if args.out != "results/cpu_classes/latest" else "results/batch/latest")
        payload = run_batch_bench(model, prompts, args.batch_sizes, budgets, args.max_new_tokens, out,
                                  max_batches=per_size, compare_mask=not args.no_mask_compare,
                                  recalibrate=args.recalibrate, repeats=args.repeats, sources=args.sources, review=args.review,
                                  meta=vars(args), surfaces=cost_surfaces())
        summary = {bs: {name: {k: s[k] for k in ("tokens_per_second", "decode_tokens_per_second", "prefill_seconds",
                                                 "drafting_ms_per_step") if k in s}
                        for name, s in r["strategies"].items()} for bs, r in payload["results"].items()}
        print(json.dumps(summary, indent=1))
        return 0
    prompts = read_prompts(args.prompts, args.limit)
    results = run_bench(model, prompts, args.max_new_tokens, Path(args.out), meta=meta,
                        control=not args.no_control, sources=args.sources, turn2=args.turn2,
                        review=args.review, parts=args.parts, repeats=args.repeats, twin=args.twin, peers=peers)
    print(bench_table(results))
    return 0


def bench_table(results: dict) -> str:
    """The bench's summary as a Markdown table: per category and overall, tokens/s, speedups
    over HF plain generate (draftheads and HF prompt lookup), τ, and identity under the dtype's
    guarantee with the controls."""
    results = with_sources(results)  # a run written before the key was "sources" reads the same
    dtype = results["meta"]["dtype"].removeprefix("torch.")
    drafting = " + ".join(results["meta"].get(DEFAULT_SOURCES) or ["heads"])
    lines = [f"draftheads bench, {dtype}, drafting {drafting}, {results['meta']['tree_nodes']}-node heads' tree, "
             f"{results['meta']['max_new_tokens']} new tokens, bs 1",
             "| category | prompts | HF tok/s | draftheads tok/s | speedup | τ | prompt lookup | diverged "
             "(outside band) | control: padded batch of 2 | control: prompt lookup |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in [*results["by_category"].items(), ("overall", results["overall"])]:
        lookup = s.get("prompt_lookup", {})
        padded = s.get("control_padded_batch", {})
        lines.append(
            f"| {name} | {s['prompts']} | {s['hf_tokens_per_second']:.1f} | {s['draftheads_tokens_per_second']:.1f} | "
            f"{s['speedup']:.2f}x | {s['tau']:.2f} | {times(lookup.get('speedup'))} | "
            f"{s['mismatching_prompts']} ({s['divergences_outside_band']}) | "
            f"{padded.get('mismatching_prompts', '-')}/{padded.get('prompts', '-')} | "
            f"{lookup.get('mismatching_prompts', '-')} |")
    names = results["meta"].get(SOURCES) or []
    if names:
        parts = "default_vs_best_part" in results["overall"]
        twin = "twin_vs_default" in results["overall"]
        lines += ["", "speedup over HF generate (τ) per drafting configuration; then HF prompt lookup"
                  + ("; then the default over the better of its parts" if parts else "")
                  + ("; last: the twin over the default (the A/A control: 1 but for noise)" if twin else ""),
                  "| category | " + " | ".join(names) + " | prompt lookup |" + (" default / best part |" if parts else "")
                  + (" twin / default |" if twin else ""),
                  "|---" * (len(names) + 2 + parts + twin) + "|"]
        for name, s in [*results["by_category"].items(), ("overall", results["overall"])]:
            cells = [f"{s[SOURCES][n]['speedup']:.2f}x ({s[SOURCES][n]['tau']:.2f})" for n in names]
            lookup = s.get("prompt_lookup", {}).get("speedup")
            versus = f" {s['default_vs_best_part']:.2f}× |" if "default_vs_best_part" in s else ""
            versus += f" {s['twin_vs_default']:.2f}× |" if twin else ""
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {times(lookup)} |" + versus)
    peers = results["overall"].get("peers") or {}
    if peers:
        lines += ["", "CPU engines on the same token ids (greedy; openvino-lookup: its prompt lookup), same run, interleaved",
                  "| engine | tok/s | vs HF generate | draftheads over it | prompts with HF's greedy tokens |",
                  "|---|---|---|---|---|"]
        lines += [f"| {name} | {p['tokens_per_second']:.1f} | {p['speedup']:.2f}x | {p['draftheads_vs_peer']:.2f}x | "
                  f"{p['same_as_hf_prompts']}/{results['overall']['prompts']} |" for name, p in peers.items()]
    return "\n".join(lines)


def times(speedup: float | None) -> str:
    """A speedup cell: "1.23x", or "-" for a run that did not happen (``--no-control``)."""
    return "-" if speedup is None else f"{speedup:.2f}x"


def peer_list(value: str) -> tuple[str, ...]:
    """``--peers``: checked against the known engines (:data:`~draftheads.bench.peers.PEERS`)."""
    import argparse

    from ..bench.peers import parse_peers

    try:
        return parse_peers(value)
    except InputError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_command(sub, common) -> None:
    """Register ``bench`` (``common``: --heads, --base, --dtype, ...: :func:`.parsing.common_parser`)."""
    bench = sub.add_parser("bench", parents=[common], help="HF generate vs draftheads on a prompt file")
    bench.add_argument("--prompts", required=True, nargs="+",
                       help="built-in prompt set(s) (mt-bench, spec-bench) or JSON-lines file(s); NAME@N takes the "
                            "first N prompts of each category (NAME@N:cat,cat those categories only), and a prompt "
                            "already read from an earlier set is skipped (e.g. mt-bench spec-bench@8)")
    bench.add_argument("--limit", type=count_argument(1), default=None,
                       help="use the first N prompts (batched default: max batch size x --max-batches)")
    bench.add_argument("--batch-sizes", type=positive_list, default=None,
                       help="e.g. 1,2,4,8,16,32: batched HF generate vs each fixed tree vs adaptive, JSON + PNGs")
    bench.add_argument("--budgets", type=int_list, default=None,
                       help="fixed tree budgets to compare (default: 0 and the stored ones among 1,2,4,8,16)")
    bench.add_argument("--max-batches", type=positive_list, default=[2],
                       help="batches per batch size (batched bench): one number for every size, or one per "
                            "--batch-sizes entry (e.g. 6,4,4,3,2,1: more batches where they are cheap)")
    bench.add_argument("--repeats", type=count_argument(1), default=1,
                       help="run each prompt (or batch, batched bench) this many times per configuration, in "
                            "rotating order, and count the fastest (greedy output is identical each time; filters "
                            "a shared machine's slow spells)")
    bench.add_argument("--peers", type=peer_list, default=None,
                       help="CPU engines as columns of the bs-1 bench: llama.cpp (pip install -e \".[peers]\"), openvino "
                            "(made in a venv of its own on first use), or both, comma-separated; "
                            "a peer not installed is one line saying how to install it")
    bench.add_argument("--no-mask-compare", action="store_true",
                       help="skip the 'adaptive:mask' strategy (finished rows masked instead of dropped)")
    bench.add_argument("--recalibrate", action="store_true",
                       help="measure the cost model again even if this machine has a cached one (batched bench; "
                            "do it on a quiet machine: a calibration taken while other jobs ran misleads the policy)")
    bench.add_argument("--no-control", action="store_true",
                       help="skip the controls (HF prompt lookup on each prompt, HF on each pair of prompts as a "
                            "padded batch of 2): faster, but no peer speed and no identity control")
    add_sources_option(bench, help=f"compare draft sources: a comma-separated subset of {source_list()} (or "
                                   "'all'); runs each alone, the lookups together and all merged, beside HF prompt lookup; "
                                   "with --batch-sizes: the adaptive policy with the heads alone vs with the lookups")
    bench.add_argument("--parts", action="store_true",
                       help="time the default drafting beside its parts, the heads alone and the lookups alone, "
                            "and report the default against the better of them per category")
    bench.add_argument("--twin", action="store_true",
                       help="with --parts: also time a second, separately built drafter of the default's sources "
                            "(an A/A control: how far two identical configurations read apart in this run)")
    bench.add_argument("--turn2", action="store_true",
                       help="also bench MT-Bench second turns (turn 1 and the base's own answer in context)")
    bench.add_argument("--out", default="results/cpu_classes/latest")
    bench.set_defaults(func=cmd_bench)
