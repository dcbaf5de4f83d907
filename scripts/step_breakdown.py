"""Where a verification step's time goes, against the memory floor: per step of real decoding at
each batch size, the milliseconds in (a) the products that stream the base's weights, (b)
attention, (c) everything else of the verification forward (elementwise, copies, Python), and the
step's drafting and bookkeeping — beside the floor measured here (one pass over the base's
weights; the products of one plain token through the decoder's own paths). Each way of running
the body (``direct``: decoding/base/direct.py; ``eager``: transformers' forward) decodes the same
prompts, interleaved prompt by prompt.

    python scripts/step_breakdown.py --dtype bfloat16 --batch-sizes 1,16 \\
        --out results/profile/step_breakdown

How: the products' and attention's calls are timed where they happen (the few-row kernel's
library functions, oneDNN's packed linear, ``F.linear``, ``F.scaled_dot_product_attention``; a
whole-body call by its own clock), each attributed to the step phase it ran in
(:data:`~draftheads.decoding.step.PHASES`); the rest of a phase is its wall time less those. The
timers cost ~1 µs a call (~0.2 ms a step).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from draftheads.arguments import find_heads
from draftheads.bench.ab import ab_meta
from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.base import fewrow
from draftheads.decoding.base.architecture import decoder_body
from draftheads.decoding.base.direct import direct_body, release_direct_body, use_direct_body
from draftheads.decoding.base.fingerprint import lm_head_weight
from draftheads.decoding.base.forward import lm_logits
from draftheads.decoding.base.packing import forward_context
from draftheads.decoding.request import left_pad
from draftheads.decoding.step import PhaseTimer
from draftheads.prompts import BATCH_PROMPTS, DEV_PROMPTS, chat_input, read_prompts

KINDS = ("products", "attention")
VERIFY_PHASES = ("forward", "lm_head")


class BreakdownTimer(PhaseTimer):
    """A phase timer that also knows the phase now running, so the timed calls inside it
    (:func:`install_call_timers`) are attributed to it."""

    current: str | None = None
    calls: dict

    def __init__(self):
        super().__init__()
        self.calls = {}

    @contextmanager
    def phase(self, name: str, device: torch.device):
        self.current = name
        try:
            with super().phase(name, device):
                yield
        finally:
            self.current = None

    def add(self, kind: str, seconds: float) -> None:
        key = (self.current or "outside", kind)
        self.calls[key] = self.calls.get(key, 0.0) + seconds * 1e3


_ACTIVE: list[BreakdownTimer] = []


def _timed(kind: str, call):
    def wrapper(*args, **kwargs):
        if not _ACTIVE:
            return call(*args, **kwargs)
        start = time.perf_counter()
        out = call(*args, **kwargs)
        _ACTIVE[-1].add(kind, time.perf_counter() - start)
        return out
    return wrapper


def _clocked(call):
    """A whole-body call (decoding/base/body_call.py) given a clock of its own: the seconds it spent
    in products and in attention added as the calls timed one by one are."""
    def wrapper(*args):
        if not _ACTIVE:
            return call(*args)
        clock = (ctypes.c_double * 3)()
        call(*args[:-1], ctypes.addressof(clock))
        _ACTIVE[-1].add("products", clock[0])
        _ACTIVE[-1].add("attention", clock[1])
    return wrapper


def install_call_timers() -> None:
    """Time every product and attention call (before any model resolves its products)."""
    lib = fewrow.kernel()
    if lib is not None:
        for name in ("draftheads_fewrow", "draftheads_fewrow_bf16", "draftheads_fewrow_q4", "draftheads_fewrow_q4_bf16",
                     "draftheads_fewrow_q8", "draftheads_fewrow_q8_bf16"):
            setattr(lib, name, _timed("products", getattr(lib, name)))
        for name in ("draftheads_tree_attention", "draftheads_tree_attention_bf16", "draftheads_step_attention",
                     "draftheads_step_attention_bf16"):  # the last two with the rotation and cache write before it
            setattr(lib, name, _timed("attention", getattr(lib, name)))
        for name in ("draftheads_body", "draftheads_body_bf16"):
            setattr(lib, name, _clocked(getattr(lib, name)))
    torch.ops.mkldnn._linear_pointwise = _timed("products", torch.ops.mkldnn._linear_pointwise)
    torch.nn.functional.linear = _timed("products", torch.nn.functional.linear)
    torch.nn.functional.scaled_dot_product_attention = _timed("attention",
                                                              torch.nn.functional.scaled_dot_product_attention)


def floor_ms(model, reps: int = 7) -> dict:
    """The floor of one forward here: the best time to read every weight the base streams
    (``stream``) and to multiply one row through each of them on the decoder's own paths
    (``one_row_products``): the LM head and the layers' matrices (the input embedding is only
    gathered from)."""
    body = decoder_body(model.base)
    weights = [lm_head_weight(model.base)] + [p for layer in body.layers for p in layer.parameters() if p.dim() == 2]
    best_stream = min(_seconds(lambda: [w.sum() for w in weights]) for _ in range(reps))
    state = direct_body(model.base)
    if state is None:
        raise SystemExit("step_breakdown: the floor is measured through the direct forward, which this base does "
                         "not run (see `draftheads env --base`).")
    with forward_context(model.base):
        plans = state.plan(1)  # the products a one-row step takes, as the decoder resolved them
        x = torch.randn(1, body.config.hidden_size).to(model.base.dtype)
        wide = torch.randn(1, body.config.intermediate_size).to(model.base.dtype)

        def token():
            for plan in plans:
                plan.qkv(x), plan.o(x), plan.gate_up(x), plan.down(wide)
            lm_logits(model.base, x[None])
        best_rows = min(_seconds(token) for _ in range(reps))
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6
    return {"weights_mb": round(megabytes, 1), "stream_ms": round(best_stream * 1e3, 3),
            "stream_gb_per_s": round(megabytes / 1e3 / best_stream, 2), "one_row_products_ms": round(best_rows * 1e3, 3)}


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@contextmanager
def body_way(model, way: str):
    """``direct``: the direct forward (where the base allows it; a step's body in one call where
    every piece has a kernel); ``layers``: the direct forward layer by layer; ``sdpa``, ``general``:
    layer by layer, attending another way (:data:`~draftheads.decoding.base.direct.ATTENTION_WAYS`);
    ``eager``: transformers' forward."""
    if way == "eager":
        release_direct_body(model.base)
    elif way == "layers":
        use_direct_body(model.base, one_call=False)
    elif way in ("sdpa", "general"):
        use_direct_body(model.base, attention=way, one_call=False)
    try:
        yield
    finally:
        if way != "direct":
            use_direct_body(model.base)


def decode(model, batch: list[torch.Tensor], max_new_tokens: int, timer: BreakdownTimer) -> tuple[int, float]:
    """One call over ``batch`` (one prompt, or several left-padded); returns (new tokens, seconds)."""
    if len(batch) == 1:
        ids, mask = batch[0], None
    else:
        ids, mask = left_pad([b[0].tolist() for b in batch], model.tokenizer.pad_token_id or 0)
    _ACTIVE.append(timer)
    try:
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, timer=timer)
        seconds = time.perf_counter() - start
    finally:
        _ACTIVE.pop()
    new = out[:, ids.shape[1]:]
    pad = model.tokenizer.pad_token_id
    return int(new.numel() if pad is None or len(batch) == 1 else (new != pad).sum()), seconds


def breakdown(timer: BreakdownTimer, tokens: int, seconds: float) -> dict:
    """Milliseconds a step: the verification forward split into products / attention / rest, the
    drafting, the rest of the step; tokens/s and steps."""
    steps = max(1, timer.steps)
    per = {name: ms / steps for name, ms in timer.totals.items()}
    calls = {key: ms / steps for key, ms in timer.calls.items()}
    verify = sum(per.get(p, 0.0) for p in VERIFY_PHASES)
    split = {kind: sum(calls.get((p, kind), 0.0) for p in VERIFY_PHASES) for kind in KINDS}
    result = {"steps": timer.steps, "tokens_per_second": round(tokens / seconds, 2),
              "ms_per_step": round(1e3 * seconds / steps, 3), "verify_ms": round(verify, 3),
              **{f"{k}_ms": round(v, 3) for k, v in split.items()},
              "rest_of_verify_ms": round(verify - sum(split.values()), 3),
              "drafting_ms": round(per.get("propose", 0.0), 3),
              "bookkeeping_ms": round(sum(v for k, v in per.items() if k not in (*VERIFY_PHASES, "propose")), 3)}
    return result


def run(model, ways: list[str], batches: list[list[torch.Tensor]], max_new_tokens: int, log=print) -> dict:
    timers = {w: BreakdownTimer() for w in ways}
    tally = {w: [0, 0.0] for w in ways}
    for i, batch in enumerate(batches):
        for way in (ways if i % 2 == 0 else ways[::-1]):
            with body_way(model, way):
                tokens, seconds = decode(model, batch, max_new_tokens, timers[way])
            tally[way][0] += tokens
            tally[way][1] += seconds
        log(f"  batch {i + 1}/{len(batches)}: " + ", ".join(f"{w} {tally[w][0] / tally[w][1]:.1f} tok/s" for w in ways))
    return {w: breakdown(timers[w], *tally[w]) for w in ways}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-hydra")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--ways", default="direct,eager",
                        help="direct, layers, sdpa, general, eager: one or more (compared interleaved)")
    parser.add_argument("--limit", type=int, default=8, help="bs-1 prompts (the dev prompts, first N)")
    parser.add_argument("--repeats", type=int, default=2, help="batches a batch size above 1 runs (each way)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results/profile/step_breakdown"))
    args = parser.parse_args(argv)
    fewrow.load_kernel(_kernel_folder())
    install_call_timers()
    model = DraftHeadsModel.from_pretrained(find_heads(args.heads), dtype=args.dtype)
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    floor = floor_ms(model)
    print(f"floor: {floor}")
    warm = [chat_input(model.tokenizer, "Hello!")]
    for way in ways:
        with body_way(model, way):
            decode(model, warm, 8, BreakdownTimer())
    results = {}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        print(f"batch size {bs}:")
        prompts = read_prompts(list(DEV_PROMPTS), args.limit) if bs == 1 else read_prompts(list(BATCH_PROMPTS), bs)
        encoded = [chat_input(model.tokenizer, p["prompt"]) for p in prompts]
        batches = [[e] for e in encoded] if bs == 1 else [encoded] * args.repeats
        results[str(bs)] = run(model, ways, batches, args.max_new_tokens)
        print_table(results[str(bs)], floor)
    meta = ab_meta("step_breakdown.py", argv, model, args, list(DEV_PROMPTS))
    meta["tree_nodes"] = model.drafting_summary()["tree_nodes"]
    result = {"meta": meta, "floor": floor, "batch_sizes": results}
    meta["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    write(args.out, f"{meta['cpu_capability'].lower()}_{meta['dtype']}", result)
    return 0


def _kernel_folder() -> Path:
    from draftheads.decoding.base.loading import cache_root

    return cache_root() / "kernels"


ROWS = ("verify_ms", "products_ms", "attention_ms", "rest_of_verify_ms", "drafting_ms", "bookkeeping_ms",
        "ms_per_step", "tokens_per_second")


def print_table(by_way: dict, floor: dict) -> None:
    ways = list(by_way)
    print(f"    {'ms a step':<20}" + "".join(f"{w:>10}" for w in ways) + f"{'floor':>10}")
    for row in ROWS:
        ref = {"verify_ms": floor["stream_ms"], "products_ms": floor["one_row_products_ms"]}.get(row)
        print(f"    {row:<20}" + "".join(f"{by_way[w][row]:>10.2f}" for w in ways)
              + (f"{ref:>10.2f}" if ref is not None else ""))


def write(out: Path, stem: str, result: dict) -> None:
    """``OUT/STEM.json`` and ``OUT/STEM.png``: per batch size and way, the verification step's
    products / attention / rest stacked, the drafting and bookkeeping above, the floor as a line."""
    from draftheads.training.figures import figure

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    sizes = list(result["batch_sizes"])
    with figure(out / f"{stem}.png", 1, len(sizes), figsize=(4.5 * len(sizes), 4)) as (fig, axes):
        for ax, bs in zip(axes if len(sizes) > 1 else [axes], sizes):
            by_way = result["batch_sizes"][bs]
            ways = list(by_way)
            bottom = [0.0] * len(ways)
            for i, part in enumerate(("products_ms", "attention_ms", "rest_of_verify_ms", "drafting_ms",
                                      "bookkeeping_ms")):
                values = [by_way[w][part] for w in ways]
                ax.bar(range(len(ways)), values, bottom=bottom, color=f"C{i}", label=part.removesuffix("_ms"))
                bottom = [b + v for b, v in zip(bottom, values)]
            ax.axhline(result["floor"]["stream_ms"], color="k", ls="--", lw=1, label="floor (one pass)")
            ax.set_xticks(range(len(ways)), [f"{w}\n{by_way[w]['tokens_per_second']:.0f} tok/s" for w in ways])
            ax.set_ylabel("ms a step")
            ax.set_title(f"bs {bs}")
        (axes[0] if len(sizes) > 1 else axes).legend(fontsize=7)
        fig.suptitle(f"Step breakdown, {result['meta']['dtype']}, {result['meta']['date']}")


if __name__ == "__main__":
    sys.exit(main())
