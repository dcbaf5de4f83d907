"""The ``draftheads`` command: ``generate`` (stream an answer, report tokens/s, τ, speedup),
``bench`` (plain HF greedy generate vs draftheads on a prompt file, one run, JSON + PNG; with
``--batch-sizes``: batched HF generate vs every fixed tree vs the adaptive policy) and
``train`` (train heads from a recipe), ``demo`` (a local Gradio page, draftheads/demo.py)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .decoding.limits import DTYPE_CHOICES, InputError, check_count
from .heads.errors import DraftheadsError, one_line
from .options import add_sources_option, find_heads, renamed_sources_option, source_list, tree_argument
from .prompts import chat_input, cost_surfaces, round_robin
from .prompts import read_prompts as _read_prompts

DEFAULT_HEADS = "checkpoints/smollm2-135m-hydra"


def read_prompts(paths, limit: int | None) -> list[dict]:
    """:func:`draftheads.prompts.read_prompts` for the command line: ``--limit`` checked as the
    API checks it (a prompt-file problem names file and line; :func:`main` prints it)."""
    if limit is not None:
        check_count("--limit", limit)
    return _read_prompts(paths, limit)


def count_argument(minimum: int = 1):
    """argparse ``type=`` for an integer option ≥ ``minimum``."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer ≥ {minimum}, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be ≥ {minimum}, got {number}")
        return number
    return parse


def load_model(args):
    from .decoding import DraftHeadsModel
    from .decoding.config import DecodingConfig

    generate = args.command == "generate"  # the bench compares sources (and review) with and without
    sources = (args.sources if generate else None) or "auto"
    decoding = DecodingConfig(tree=args.tree, sources=sources, review=args.review and generate)
    return DraftHeadsModel.from_pretrained(find_heads(args.heads), base_name_or_path=args.base, dtype=args.dtype,
                                           decoding=decoding)


def check_review_option(review: bool, sources) -> None:
    """``--review`` needs ``--sources`` mixing heads and lookups: one error line, before any model loads."""
    from .decoding.drafters import check_review

    try:
        check_review(review, sources or ("heads",))
    except InputError as err:
        raise InputError(f"--review: {err}") from None


def identity_status(diff: dict | None, dtype: torch.dtype) -> str:
    """One line on whether the answer is the base's own, under the dtype's guarantee."""
    name = str(dtype).removeprefix("torch.")
    if diff is None:
        return f"identical to plain generate ({name})"
    where = (f"first divergence at token {diff['position']}, where the base's top-1/top-2 logit gap is "
             f"{diff['top1_top2_gap']:.4g} ({diff['gap_ulps']:g} ulps of {name})")
    if diff["within_band"]:
        return f"{where}: within {name} rounding, as the guarantee allows"
    return f"{where}: OUTSIDE {name} rounding — please report this as a bug"


def cmd_generate(args) -> int:
    from .bench import hf_greedy, timed, warm_up_paths
    from .decoding.guarantee import first_divergence
    from .streamer import DraftColourStreamer

    check_review_option(args.review, args.sources)
    model = load_model(args)
    ids = chat_input(model.tokenizer, args.prompt)
    warm_up_paths(model, baseline=not args.no_baseline)
    streamer = DraftColourStreamer(model.tokenizer)
    ours, seconds = timed(lambda: model.generate(ids, max_new_tokens=args.max_new_tokens, streamer=streamer))
    stats, drafting = model.last_stats, drafting_line(model)
    new = ours.shape[1] - ids.shape[1]
    rate = new / seconds
    if not args.no_baseline:  # each side timed twice, interleaved, and its faster run counted (as the bench's
        # --repeats): one run each of a short answer read ±10 % on a shared machine with the same drafts
        plain, base_seconds = timed(lambda: hf_greedy(model.base, ids, args.max_new_tokens))
        again, again_seconds = timed(lambda: model.generate(ids, max_new_tokens=args.max_new_tokens))
        rate = max(rate, (again.shape[1] - ids.shape[1]) / again_seconds)
        base_seconds = min(base_seconds, timed(lambda: hf_greedy(model.base, ids, args.max_new_tokens))[1])
    dtype = model.base.dtype
    legend = " (green: accepted drafts)" if streamer.colour else ""
    runs = "one run" if args.no_baseline else "the faster of two runs"
    print(f"[draftheads] {str(dtype).removeprefix('torch.')}: {new} tokens, {rate:.1f} tok/s ({runs}), "
          f"τ = {stats.tau:.2f} tokens/step over {stats.steps} verify steps, "
          f"{streamer.drafted_tokens} drafted tokens accepted{legend}", file=sys.stderr)
    if not args.no_baseline:
        base_new = plain.shape[1] - ids.shape[1]
        status = identity_status(first_divergence(model.base, plain, ours, ids.shape[1]), dtype)
        print(f"[plain HF generate, same dtype] {base_new} tokens, {base_new / base_seconds:.1f} tok/s ({runs}); "
              f"speedup {rate / (base_new / base_seconds):.2f}x; {status}", file=sys.stderr)
    print(f"[drafting] {drafting}", file=sys.stderr)
    return 0


def drafting_line(model) -> str:
    """What filled the trees, in words: the sources, the tree, and how often the heads proposed."""
    sources = " + ".join(model.sources) or "none (plain decoding)"
    drafter = model.drafter
    offer = getattr(drafter, "heads_tree", None)  # the merged drafter's larger offer (MERGED_OFFER_SCALE)
    tree = offer.num_nodes if offer is not None else (model.policy.tree.num_nodes if hasattr(model.policy, "tree")
                                                      else "adaptive")
    line = f"{sources}; heads' tree {tree} nodes"
    if getattr(drafter, "heads", None) is not None and hasattr(drafter, "skipped_heads_steps"):
        line += (f"; the heads proposed on {drafter.heads_steps} of "
                 f"{drafter.heads_steps + drafter.skipped_heads_steps} steps (skipped where a lookup match carried the step)")
    return line + " (--sources heads: the heads alone)"


def int_list(value: str, minimum: int = 0) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not items or min(items) < minimum:
        raise argparse.ArgumentTypeError(f"expected integers ≥ {minimum}, got {value!r}")
    return items


def positive_list(value: str) -> list[int]:
    return int_list(value, 1)


def batches_per_size(batch_sizes: list[int], max_batches: list[int]) -> dict[int, int]:
    """``--max-batches`` as {batch size: batches}: one value for all sizes or one per size."""
    if len(max_batches) == 1:
        max_batches = max_batches * len(batch_sizes)
    if len(max_batches) != len(batch_sizes) or min(max_batches) < 1:
        raise InputError(f"--max-batches needs one positive number or one per batch size "
                         f"({len(batch_sizes)}), got {','.join(map(str, max_batches))}.")
    return dict(zip(batch_sizes, max_batches))


def cmd_bench(args) -> int:
    from .bench import run_batch_bench, run_bench

    read_prompts(args.prompts, args.limit)  # a bad prompt file fails before the model loads
    check_review_option(args.review, args.sources)
    if args.twin and not args.parts:
        raise InputError("--twin is the control of --parts: add --parts.")
    if args.parts and (args.sources or args.batch_sizes):
        raise InputError("--parts compares the default with its parts in the bs-1 bench: drop --sources/--batch-sizes.")
    model = load_model(args)
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
        out = Path(args.out if args.out != "results/bench" else "results/batch")
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
    results = run_bench(model, prompts, args.max_new_tokens, Path(args.out), meta=vars(args),
                        control=not args.no_control, sources=args.sources, turn2=args.turn2,
                        review=args.review, parts=args.parts, repeats=args.repeats, twin=args.twin)
    print(bench_table(results))
    return 0


def bench_table(results: dict) -> str:
    """The bench's summary as a Markdown table: per category and overall, tokens/s, speedups
    over HF plain generate (draftheads and HF prompt lookup), τ, and identity under the dtype's
    guarantee with the controls."""
    dtype = results["meta"]["dtype"].removeprefix("torch.")
    drafting = " + ".join(results["meta"].get("default_drafts") or ["heads"])
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
    names = results["meta"].get("drafts") or []
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
            cells = [f"{s['drafts'][n]['speedup']:.2f}x ({s['drafts'][n]['tau']:.2f})" for n in names]
            lookup = s.get("prompt_lookup", {}).get("speedup")
            versus = f" {s['default_vs_best_part']:.2f}× |" if "default_vs_best_part" in s else ""
            versus += f" {s['twin_vs_default']:.2f}× |" if twin else ""
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {times(lookup)} |" + versus)
    return "\n".join(lines)


def times(speedup: float | None) -> str:
    """A speedup cell: "1.23x", or "-" for a run that did not happen (``--no-control``)."""
    return "-" if speedup is None else f"{speedup:.2f}x"


class Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line errors: a usage error is one ``error:`` line naming the
    option and where the usage is (``--help``), exit status 2, like every other error."""

    def error(self, message: str):
        fail(f"{self.prog}: {message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="draftheads", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    common = Parser(add_help=False)
    common.add_argument("--heads", default=DEFAULT_HEADS, help="head checkpoint directory, or 'none' for plain decoding")
    common.add_argument("--base", default=None, help="base model dir / Hub id / .gguf (default: embedded SmolLM2)")
    common.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="'auto' (default): the base's native dtype where this hardware computes it natively "
                             "(bfloat16 for SmolLM2 on CPUs with AVX512-BF16/AMX and on GPUs), else float32")
    common.add_argument("--tree", type=tree_argument, default=None,
                        help="'adaptive' (choose per live batch size from this machine's calibrated cost model; "
                             "first use calibrates for ~1-2 min, then cached) or a tree node budget "
                             "(default: the checkpoint's)")
    common.add_argument("--review", action="store_true",
                        help="vertical cascade: the heads rescore lookup drafts before they take verification "
                             "slots (with --sources mixing heads and lookups; the bench then also runs the reviewed mix)")
    common.add_argument("--max-new-tokens", type=count_argument(1), default=None,
                        help="default 128 (32 for the batched bench, which runs ~9 strategies x 6 batch sizes)")
    gen = sub.add_parser("generate", parents=[common], help="answer one prompt, streaming")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--no-baseline", action="store_true", help="skip the plain-generate comparison")
    add_sources_option(gen, help=f"who fills the trees: a comma-separated subset of {source_list()} (or 'all'; "
                                 "default: the heads and every lookup source there is data for): the heads and lookups "
                                 "merge into one tree per step")
    gen.set_defaults(func=cmd_generate)
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
    bench.add_argument("--out", default="results/bench")
    bench.set_defaults(func=cmd_bench)
    train = sub.add_parser("train", help="train draft heads from a recipe (same as python -m draftheads.training.train)")
    train.add_argument("recipe", help="recipes/<name>.yaml")
    train.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value recipe overrides, e.g. --train.lr 5e-4")
    train.set_defaults(func=cmd_train)
    env = sub.add_parser("env", help="what to paste into a bug report: versions, CPU capability, dtypes, packing, caches")
    env.add_argument("--json", action="store_true", help="print JSON")
    env.add_argument("--base", default=None, help="also load this base (dir / Hub id / .gguf / gemma3-270m) and report "
                     "what of its architecture the decoder honours and which fast paths it runs for it")
    env.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="with --base: the dtype to load it in")
    env.set_defaults(func=cmd_env)
    from .checkpoint_cli import add_commands  # export, import-medusa, card, push
    from .demo import add_command as add_demo  # gradio itself is imported only when the demo runs

    add_commands(sub)
    add_demo(sub, common)
    return parser


def cmd_env(args) -> int:
    from .environment import main as env_main

    return env_main(as_json=args.json, base=args.base, dtype=args.dtype)


def cmd_train(args) -> int:
    """Single process here; for several, use ``accelerate launch ... -m draftheads.training.train``."""
    from .training.train import main as train_main

    return train_main([args.recipe, *args.overrides])


def main(argv: list[str] | None = None) -> int:
    """Every subcommand runs under one catch: a :class:`DraftheadsError` (whatever its kind:
    checkpoint, store, recipe, data, prompt, input...) or an OS error on a path the user gave
    ends the command with one ``error:`` line on stderr and exit status 2, never a traceback."""
    args = parse_args(argv)
    if getattr(args, "max_new_tokens", 1) is None:
        args.max_new_tokens = 32 if getattr(args, "batch_sizes", None) else 128
    try:
        return args.func(args)
    except DraftheadsError as err:
        fail(str(err))
    except OSError as err:
        if err.filename is None:  # not about a path: a bug or the machine, keep the traceback
            raise
        fail(f"{err.filename}: {err.strerror or err}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, old option names (``--drafts``) read as the new ones (with a FutureWarning)."""
    args = build_parser().parse_args(argv)
    try:
        return renamed_sources_option(args)
    except DraftheadsError as err:
        fail(str(err))


def fail(message: str) -> None:
    """End the command: one ``error:`` line on stderr, exit status 2 (argparse's for usage errors)."""
    print(f"error: {one_line(message)}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    raise SystemExit(main())
