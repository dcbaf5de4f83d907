"""``draftheads generate``: answer one prompt, streaming (accepted drafts coloured), then tokens/s,
τ, the speedup over plain HF generate on the same prompt, whether the answers are the same under
the dtype's guarantee, and the drafting it used. :func:`load_model` and :func:`check_review_option`
serve ``bench`` too."""
from __future__ import annotations

import sys

import torch

from ..core.errors import InputError
from ..prompts import chat_input
from ..arguments import add_sources_option, find_heads, source_list


def load_model(args):
    from ..decoding import DraftHeadsModel
    from ..decoding.config import DecodingConfig

    generate = args.command == "generate"  # the bench compares sources (and review) with and without
    sources = (args.sources if generate else None) or "auto"
    decoding = DecodingConfig(tree=args.tree, sources=sources, review=args.review and generate)
    return DraftHeadsModel.from_pretrained(find_heads(args.heads), base_name_or_path=args.base, dtype=args.dtype,
                                           decoding=decoding)


def check_review_option(review: bool, sources) -> None:
    """``--review`` needs ``--sources`` mixing heads and lookups: one error line, before any model loads."""
    from ..decoding.drafters import check_review

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
    from ..bench import hf_greedy, timed, warm_up_paths
    from ..decoding.guarantee import first_divergence
    from ..streamer import DraftColourStreamer

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
    summary = model.drafting_summary()
    sources = " + ".join(summary["sources"]) or "none (plain decoding)"
    line = f"{sources}; heads' tree {summary['tree_nodes']} nodes"
    if "heads_steps" in summary:
        proposed, skipped = summary["heads_steps"], summary["skipped_heads_steps"]
        line += (f"; the heads proposed on {proposed} of {proposed + skipped} steps "
                 "(skipped where a lookup match carried the step)")
    if summary.get("batch_modes"):
        line += "; batch steps by mode: " + ", ".join(f"{mode} {n}" for mode, n in summary["batch_modes"].items())
    return line + " (--sources heads: the heads alone)"


def add_command(sub, common) -> None:
    """Register ``generate`` (``common``: --heads, --base, --dtype, ...: :func:`.parsing.common_parser`)."""
    gen = sub.add_parser("generate", parents=[common], help="answer one prompt, streaming")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--no-baseline", action="store_true", help="skip the plain-generate comparison")
    add_sources_option(gen, help=f"who fills the trees: a comma-separated subset of {source_list()} (or 'all'; "
                                 "default: the heads and every lookup source there is data for): the heads and lookups "
                                 "merge into one tree per step")
    gen.set_defaults(func=cmd_generate)
