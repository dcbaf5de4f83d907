"""What a product of a few rows costs on this machine, per path: ``F.linear``, oneDNN's packed
product and the few-row kernel (decoding/base/fewrow.py: float32, and bfloat16 where native), for the weight shapes of the embedded
base (SmolLM2-135M) and the shipped heads' draft vocabulary, at the row counts a verification
step uses. The decoder's measurement at load (``decoding.base.plan.measure_shape``: interleaved,
best of ``--reps``) with each weight warm in cache — the decoder itself times over streamed copies
(``STREAM_BYTES``; ``scripts/bench_packing_regime.py`` compares the two) — saved as JSON + PNG.

    python scripts/bench_linear_paths.py --out results/cpu_classes/linear_paths_avx512
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from draftheads.decoding.base.loading import cache_root
from draftheads.core.atomic import write_text_atomic
from draftheads.decoding.base.fewrow import kernel_status, load_kernel
from draftheads.decoding.base.hardware import cpu_key
from draftheads.decoding.base.plan import ROW_BUCKETS, fastest_paths, measure_shape

#: SmolLM2-135M: q/o 576×576, k/v 192×576, gate/up 1536×576, down 576×1536, LM head 49152×576;
#: the shipped heads read out through 8192 rows of it
SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (8192, 576), (49152, 576))
LABELS = {"linear_ms": "F.linear", "packed_ms": "oneDNN packed", "fewrow_ms": "few-row kernel"}


def run(dtype: torch.dtype, reps: int) -> dict:
    results = {}
    for out_features, in_features in SHAPES:
        entry = measure_shape(dtype, out_features, in_features, reps=reps)
        results[f"{out_features}x{in_features}"] = {**entry, "chosen": list(fastest_paths(entry))}
        print(f"{out_features}x{in_features}: " + "  ".join(
            f"{LABELS[k]} " + "/".join(f"{v * 1e3:.0f}" for v in entry[k]) for k in LABELS if k in entry) + " µs")
    return results


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3.2))
    for ax, (shape, entry) in zip(axes, results.items()):
        for key, label in LABELS.items():
            if key in entry:
                ax.plot(ROW_BUCKETS, [v * 1e3 for v in entry[key]], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(shape, fontsize=9)
        ax.set_xlabel("rows")
    axes[0].set_ylabel("µs per call")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/cpu_classes/linear_paths"))
    args = parser.parse_args()
    load_kernel(cache_root() / "kernels")
    results = run(getattr(torch, args.dtype), args.reps)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"dtype": args.dtype, "reps": args.reps, "rows": list(ROW_BUCKETS), "machine": cpu_key(),
            "kernel": kernel_status(), "python": platform.python_version()}
    write_text_atomic(args.out / "linear_paths.json", json.dumps({"meta": meta, "shapes": results}, indent=1))
    plot(results, args.out / "linear_paths.png",
         f"{args.dtype}, {meta['machine']['cpu']} ({meta['machine']['capability']}), {meta['machine']['threads']} threads")
    print(f"wrote {args.out}/linear_paths.json and .png")


if __name__ == "__main__":
    main()
