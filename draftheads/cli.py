"""The ``draftheads`` command: ``generate`` (stream an answer, report tokens/s, τ, speedup),
``bench`` (plain HF greedy generate vs draftheads on a prompt file, one run, JSON + PNG; with
``--batch-sizes``: batched HF generate vs every fixed tree vs the adaptive policy) and
``train`` (train heads from a recipe)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

DEFAULT_HEADS = "checkpoints/smollm2-135m-hydra"


def find_heads(path: str | None) -> str | None:
    """``none`` → plain decoding; a relative path is tried from the working directory, then
    from the source checkout the package was installed from."""
    if path is None or path.lower() == "none":
        return None
    candidate = Path(path)
    if candidate.is_dir() or candidate.is_absolute():
        return str(candidate)
    source_root = Path(__file__).resolve().parents[1]
    if (source_root / path).is_dir():
        return str(source_root / path)
    return path  # maybe a Hub id in the local cache; DraftHeadsModel explains if not


def chat_input(tokenizer, prompt: str) -> torch.Tensor:
    from .training.features import chat_prompt_ids

    if not prompt.strip():
        raise SystemExit("error: the prompt is empty; pass --prompt \"...\"")
    return torch.tensor([chat_prompt_ids(tokenizer, prompt)])


def read_prompts(path: str, limit: int | None) -> list[dict]:
    """MT-Bench / Spec-Bench (``turns``: first turn) or ``{"prompt": ...}`` JSON lines; every
    problem is one line naming the file and the line."""
    if limit is not None:
        count_option("--limit", limit)
    prompts = []
    try:
        handle = open(path, encoding="utf-8")
    except OSError as err:
        raise SystemExit(f"error: cannot read the prompt file {path}: {err.strerror}.") from None
    with handle:
        for line_no, line in enumerate(handle, 1):
            if line.strip():
                prompts.append(prompt_record(line, f"{path}:{line_no}", line_no))
    if not prompts:
        raise SystemExit(f"error: {path} holds no prompts; write one JSON object per line with 'turns' or 'prompt'.")
    return prompts[:limit] if limit else prompts


def prompt_record(line: str, where: str, line_no: int) -> dict:
    """One prompt-file line → {id, category, prompt}, or a one-line error naming ``where``."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise SystemExit(f"error: {where} is not valid JSON ({err.msg} at column {err.colno}).") from None
    if not isinstance(record, dict):
        raise SystemExit(f"error: {where} is a JSON {type(record).__name__}, expected an object with 'turns' or 'prompt'.")
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise SystemExit(f"error: {where} has 'turns' {turns!r}; it must be a non-empty list of strings.")
        text = turns[0]
    elif "prompt" in record:
        text = record["prompt"]
    else:
        raise SystemExit(f"error: {where} has neither 'turns' nor 'prompt'.")
    if not isinstance(text, str) or not text.strip():
        raise SystemExit(f"error: {where}: the prompt {text!r} must be a non-empty string.")
    return {"id": record.get("question_id", record.get("id", line_no)),
            "category": record.get("category", record.get("source", "")), "prompt": text}


def count_option(name: str, value, minimum: int = 1) -> int:
    """A numeric option, checked exactly as the Python API checks it (decoding/limits.py)."""
    from .decoding.limits import InputError, check_count

    try:
        return check_count(name, value, minimum)
    except InputError as err:
        raise SystemExit(f"error: {err}") from None


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

    return DraftHeadsModel.from_pretrained(find_heads(args.heads), base_name_or_path=args.base, dtype=args.dtype,
                                           tree=args.tree)


def cmd_generate(args) -> int:
    from transformers import TextStreamer

    from .bench import timed

    model = load_model(args)
    ids = chat_input(model.tokenizer, args.prompt)
    streamer = TextStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True)
    ours, seconds = timed(lambda: model.generate(ids, max_new_tokens=args.max_new_tokens, streamer=streamer))
    stats = model.last_stats
    new = ours.shape[1] - ids.shape[1]
    print(f"\n[draftheads] {new} tokens in {seconds:.2f}s = {new / seconds:.1f} tok/s, "
          f"τ = {stats.tau:.2f} tokens/step over {stats.steps} verify steps", file=sys.stderr)
    if not args.no_baseline:
        plain, base_seconds = timed(lambda: model.base.generate(ids, attention_mask=torch.ones_like(ids),
                                                                max_new_tokens=args.max_new_tokens, do_sample=False))
        base_new = plain.shape[1] - ids.shape[1]
        same = plain.tolist() == ours.tolist()
        print(f"[plain HF generate] {base_new} tokens in {base_seconds:.2f}s = {base_new / base_seconds:.1f} tok/s; "
              f"speedup {(new / seconds) / (base_new / base_seconds):.2f}x; identical tokens: {same}", file=sys.stderr)
    return 0


def tree_argument(value: str) -> str | int:
    """``--tree``: ``adaptive`` or a node budget, parsed as ``from_pretrained(tree=...)`` parses it."""
    from .decoding.limits import InputError, parse_tree_option

    try:
        return parse_tree_option(value)
    except InputError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


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
        raise SystemExit(f"error: --max-batches needs one positive number or one per batch size "
                         f"({len(batch_sizes)}), got {','.join(map(str, max_batches))}.")
    return dict(zip(batch_sizes, max_batches))


def cmd_bench(args) -> int:
    from .bench import run_batch_bench, run_bench

    read_prompts(args.prompts, args.limit)  # a bad prompt file fails before the model loads
    model = load_model(args)
    if args.batch_sizes:
        if min(args.batch_sizes) < 1:
            raise SystemExit("error: --batch-sizes must be positive.")
        if args.repeats < 1:
            raise SystemExit(f"error: --repeats must be at least 1, got {args.repeats}.")
        if model.heads is None:
            raise SystemExit("error: --batch-sizes compares tree strategies and needs heads (--heads).")
        stored = sorted(int(b) for b in model.heads.config.trees)
        budgets = args.budgets if args.budgets is not None else [0] + [b for b in stored if b in (1, 2, 4, 8, 16)]
        unknown = [b for b in budgets if b and b not in stored]
        if unknown:
            raise SystemExit(f"error: no stored tree for budget(s) {unknown}; the checkpoint stores {stored}.")
        per_size = batches_per_size(args.batch_sizes, args.max_batches)
        prompts = read_prompts(args.prompts, args.limit or max(bs * n for bs, n in per_size.items()))
        out = Path(args.out if args.out != "results/bench" else "results/batch")
        payload = run_batch_bench(model, prompts, args.batch_sizes, budgets, args.max_new_tokens, out,
                                  max_batches=per_size, compare_mask=not args.no_mask_compare,
                                  recalibrate=args.recalibrate, repeats=args.repeats,
                                  meta=vars(args), surfaces=sorted(Path(args.prompts).parent.glob("cost_surfaces/cost_*.json")))
        summary = {bs: {name: s["tokens_per_second"] for name, s in r["strategies"].items()}
                   for bs, r in payload["results"].items()}
        print(json.dumps(summary, indent=1))
        return 0
    prompts = read_prompts(args.prompts, args.limit)
    results = run_bench(model, prompts, args.max_new_tokens, Path(args.out), meta=vars(args))
    print(json.dumps(results["overall"], indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftheads", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--heads", default=DEFAULT_HEADS, help="head checkpoint directory, or 'none' for plain decoding")
    common.add_argument("--base", default=None, help="base model dir / Hub id / .gguf (default: embedded SmolLM2)")
    common.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    common.add_argument("--tree", type=tree_argument, default=None,
                        help="'adaptive' (choose per live batch size from this machine's calibrated cost model; "
                             "first use calibrates for ~1-2 min, then cached) or a tree node budget "
                             "(default: the checkpoint's)")
    common.add_argument("--max-new-tokens", type=count_argument(1), default=None,
                        help="default 128 (32 for the batched bench, which runs ~9 strategies x 6 batch sizes)")
    gen = sub.add_parser("generate", parents=[common], help="answer one prompt, streaming")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--no-baseline", action="store_true", help="skip the plain-generate comparison")
    gen.set_defaults(func=cmd_generate)
    bench = sub.add_parser("bench", parents=[common], help="HF generate vs draftheads on a prompt file")
    bench.add_argument("--prompts", required=True)
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
                       help="batched bench: run each batch this many times per strategy and count the fastest "
                            "(greedy output is identical each time; filters a shared machine's slow spells)")
    bench.add_argument("--no-mask-compare", action="store_true",
                       help="skip the 'adaptive:mask' strategy (finished rows masked instead of dropped)")
    bench.add_argument("--recalibrate", action="store_true",
                       help="measure the cost model again even if this machine has a cached one (batched bench; "
                            "do it on a quiet machine: a calibration taken while other jobs ran misleads the policy)")
    bench.add_argument("--out", default="results/bench")
    bench.set_defaults(func=cmd_bench)
    train = sub.add_parser("train", help="train draft heads from a recipe (same as python -m draftheads.training.train)")
    train.add_argument("recipe", help="recipes/<name>.yaml")
    train.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value recipe overrides, e.g. --train.lr 5e-4")
    train.set_defaults(func=cmd_train)
    return parser


def cmd_train(args) -> int:
    """Single process here; for several, use ``accelerate launch ... -m draftheads.training.train``."""
    from .training.train import main as train_main

    return train_main([args.recipe, *args.overrides])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "max_new_tokens", 1) is None:
        args.max_new_tokens = 32 if getattr(args, "batch_sizes", None) else 128
    if getattr(args, "max_new_tokens", 1) <= 0:
        raise SystemExit("error: --max-new-tokens must be positive.")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
