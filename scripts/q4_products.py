"""What the products of a verification step cost through the base's Q4_1 blocks (issue 65).

The embedded SmolLM2 base is its GGUF dequantized: every body weight is d·q + m of a Q4_1 block (d, m
fp16, q 4 bits), which float32 holds exactly, and a bfloat16 base holds rounded to bf16. The decoder
gives such weights their blocks at load (``decoding/base/gguf_blocks.py``: rows matched by content,
kept only where they give the weight bit for bit) and multiplies through them
(``decoding/base/blocks.py``: 0.625 bytes a weight against float32's 4 and bf16's 2, the few-row
kernel's sums bit for bit). This script loads the base in ``--dtype`` as the decoder prepares it and
times one pass over every body product with blocks at 1-8 rows, through the blocks and through the
few-row kernel of that dtype, interleaved, best of ``--reps``; it checks the two give bit-equal
outputs. The LM head (Q8_0 in the GGUF) is not covered. JSON + PNG.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
      python scripts/q4_products.py --dtype float32     # → results/profile/q4_products/float32
    python scripts/q4_products.py --dtype bfloat16      # AVX512-BF16 → results/profile/q4_products/bfloat16
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def blocked_layers(base) -> list:
    """The bound body layers of the float32 base that got Q4_1 blocks at preparation."""
    from draftheads.decoding.base.architecture import decoder_body
    from draftheads.decoding.base.binding import binding
    from draftheads.decoding.base.packing import use_packed_linears

    use_packed_linears(base)
    found = binding(decoder_body(base))
    return [b for b in found.linears.values() if b.copies.blocks(b.module.weight) is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,5,8")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the base's dtype (bfloat16: the AVX512-BF16 kernels)")
    parser.add_argument("--out", default=None, help="default: results/profile/q4_products/<dtype>")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from draftheads.decoding.base import fewrow
    from draftheads.decoding.base.hardware import isa_limits, machine_summary
    from draftheads.decoding.base.loading import load_base
    from draftheads.decoding.base.blocks import blocks_product

    dtype = getattr(torch, args.dtype)
    base, _ = load_base(dtype=dtype)
    layers = blocked_layers(base)
    if not layers:
        raise SystemExit("no body weight got Q4_1 blocks here: " + fewrow.kernel_status())
    weights = [b.module.weight.detach() for b in layers]
    fp32 = [fewrow.fewrow_product(fewrow.block_weight(w), w.shape[0]) for w in weights]
    q4s = [blocks_product(b.copies.blocks(b.module.weight)) for b in layers]
    generator = torch.Generator().manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    inputs = {r: {n: torch.randn(r, n, generator=generator).to(dtype) for n in {w.shape[1] for w in weights}} for r in rows}
    bit_equal = all(torch.equal(f(inputs[r][w.shape[1]]), g(inputs[r][w.shape[1]]))
                    for r in rows for w, f, g in zip(weights, fp32, q4s))
    times: dict[str, dict[int, list[float]]] = {"kernel": {r: [] for r in rows}, "q4_1": {r: [] for r in rows}}
    for _ in range(args.reps):
        for r in rows:
            for name in ("kernel", "q4_1"):
                started = time.perf_counter()
                for w, f, g in zip(weights, fp32, q4s):
                    x = inputs[r][w.shape[1]]
                    f(x) if name == "kernel" else g(x)
                times[name][r].append((time.perf_counter() - started) * 1e3)
    best = {name: {r: round(min(v), 2) for r, v in by_rows.items()} for name, by_rows in times.items()}
    result = {"meta": {"machine": machine_summary(), "isa_limits": isa_limits(), "threads": args.threads, "reps": args.reps, "dtype": args.dtype,
                       "layers_with_blocks": len(layers), "outputs_bit_equal": bit_equal,
                       "bytes": {"kernel": int(sum(w.numel() * w.element_size() for w in weights)),
                                 "q4_1_layout": int(sum(b.copies.blocks(b.module.weight).nbytes for b in layers))}},
              "best_ms": best, "ratio": {r: round(best["kernel"][r] / best["q4_1"][r], 2) for r in rows}}
    out = Path(args.out or f"results/profile/q4_products/{args.dtype}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "q4_products.json").write_text(json.dumps(result, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_rows in best.items():
        ax.plot(rows, [by_rows[r] for r in rows], marker="o", label=name)
    ax.set_xlabel("rows (tree nodes)")
    ax.set_ylabel("ms, one pass over the body products")
    ax.set_title(f"{args.dtype}: few-row kernel vs Q4_1 blocks (same sums)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "q4_products.png", dpi=120)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
