"""What products over the GGUF's own Q4_1 blocks would cost a float32 verification step (issue 65, AVX2).

The embedded SmolLM2 base is its GGUF dequantized: every body weight is d·q + m of a Q4_1 block (d, m
fp16, q 4 bits), which float32 holds exactly (d·q is exact, one rounding in + m, as ``fma`` rounds).
So a few-row product that reads the blocks (0.625 bytes a weight in this layout against float32's 4)
and dequantizes them in registers computes the float32 base's own products — bit for bit the same
sums as the few-row float32 kernel (``decoding/base/fewrow.c``: one FMA chain per output in input
order), with 6.4× fewer bytes to stream. This script measures that lever before it is built: it reads
the 210 body tensors of the embedded GGUF, checks each dequantizes to the loaded float32 base's weight
(rows matched by content: transformers permutes q/k rows for the rotary layout), lays them out in
16-output × 32-input groups, and times one pass over all of them at 1-8 rows against the float32
kernel, interleaved, best of ``--reps``; it checks the two kernels' outputs are bit-equal. The kernel
below is a prototype (up to 4 rows a pass); the LM head (Q8_0) stays float32 here. JSON + PNG.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
      python scripts/q4_products.py --out results/profile/q4_products
"""
from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#define QROW(r) { __m256 xb = _mm256_broadcast_ss(x + (r) * in + k); \
    acc[r][0] = _mm256_fmadd_ps(w0, xb, acc[r][0]); acc[r][1] = _mm256_fmadd_ps(w1, xb, acc[r][1]); }
#define QLOOP(BODY) for (long g = 0; g < groups; g++) { \
    const uint16_t *s = dm + (b * groups + g) * 32; \
    __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s)), d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 8))); \
    __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16))), m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 24))); \
    const uint8_t *nb = nib + (b * groups + g) * 256; \
    for (long kk = 0; kk < 32; kk++) { long k = g * 32 + kk; \
        __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(nb + kk * 8))); \
        __m256 w0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_and_si256(q, mask)), m0); \
        __m256 w1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), m1); \
        BODY } }
static void q4_block(const float *x, const uint8_t *nib, const uint16_t *dm, float *y, long rows, long in, long out, long b) {
    long groups = in / 32;
    __m256 acc[4][2];
    const __m256i mask = _mm256_set1_epi32(15);
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    switch (rows) {
    case 1: QLOOP(QROW(0)) break;
    case 2: QLOOP(QROW(0) QROW(1)) break;
    case 3: QLOOP(QROW(0) QROW(1) QROW(2)) break;
    default: QLOOP(QROW(0) QROW(1) QROW(2) QROW(3)) break;
    }
    long width = out - b * 16 < 16 ? out - b * 16 : 16;
    for (long r = 0; r < rows; r++) {
        float tmp[16];
        _mm256_storeu_ps(tmp, acc[r][0]); _mm256_storeu_ps(tmp + 8, acc[r][1]);
        memcpy(y + r * out + b * 16, tmp, sizeof(float) * width);
    }
}
void q4_product(const float *x, const uint8_t *nib, const uint16_t *dm, float *y, long rows, long in, long out, int threads) {
    long blocks = (out + 15) / 16;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++)
        for (long r = 0; r < rows; r += 4)
            q4_block(x + r * in, nib, dm, y + r * out, rows - r < 4 ? rows - r : 4, in, out, b);
}
"""

#: GGUF tensor → the HF module it becomes
NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}


def compile_kernel(folder: Path):
    """The prototype built as the few-row kernel is (its compiler and flags), plus F16C for the fp16 scales."""
    from draftheads.decoding.base import fewrow

    path = folder / "q4.so"
    src = folder / "q4.c"
    src.write_text(SOURCE)
    subprocess.run([*(fewrow._compiler() or ["cc"]), *fewrow.FLAGS, "-mf16c", str(src), "-o", str(path)], check=True)
    return ctypes.CDLL(str(path))


def q4_1_parts(raw: np.ndarray, out: int, inn: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_1 rows (out, inn/32 × 20 bytes) → q (out, inn) uint8, d and m (out, inn/32) fp16."""
    blocks = raw.reshape(out, inn // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(out, inn)  # element j low nibble, j + 16 high
    return q, d, m


def dequantized(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    return d.astype(np.float32).repeat(32, 1) * q.astype(np.float32) + m.astype(np.float32).repeat(32, 1)


def layout(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """16-output × 32-input groups: 8 bytes a column (outputs j and j + 8 in one byte), then 16 d and 16 m."""
    out, inn = q.shape
    blocks, groups = (out + 15) // 16, inn // 32
    qp = np.zeros((blocks * 16, inn), np.uint8)
    qp[:out] = q
    qp = qp.reshape(blocks, 16, groups, 32).transpose(0, 2, 3, 1)
    nib = (qp[..., :8] | (qp[..., 8:] << 4)).astype(np.uint8)
    scales = []
    for part in (d, m):
        padded = np.zeros((blocks * 16, groups), np.float16)
        padded[:out] = part
        scales.append(padded.reshape(blocks, 16, groups).transpose(0, 2, 1))
    dm = np.stack(scales, axis=2)  # (blocks, groups, 2, 16)
    return torch.from_numpy(np.ascontiguousarray(nib).reshape(-1)), torch.from_numpy(np.ascontiguousarray(dm).view(np.uint16).reshape(-1))


def body_tensors(base) -> list[dict]:
    """Every Q4_1 body tensor of the embedded GGUF with the base's float32 weight it must equal."""
    from gguf import GGUFReader

    from draftheads.decoding.base.loading import embedded_gguf_path

    modules = dict(base.named_modules())
    found = []
    for tensor in GGUFReader(str(embedded_gguf_path())).tensors:
        parts = tensor.name.split(".")
        if tensor.tensor_type.name != "Q4_1" or parts[0] != "blk":
            continue
        weight = modules[f"model.layers.{parts[1]}.{NAMES[parts[2]]}"].weight.detach()
        out, inn = weight.shape
        q, d, m = q4_1_parts(np.asarray(tensor.data), out, inn)
        rows = dequantized(q, d, m)
        where = {row.tobytes(): i for i, row in enumerate(rows)}
        order = [where.get(w.tobytes()) for w in weight.numpy()]  # transformers' row order (q/k permuted)
        exact = None not in order
        if exact:
            q, d, m = q[order], d[order], m[order]
        found.append({"name": tensor.name, "weight": weight, "exact": exact, "layout": layout(q, d, m) if exact else None})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,5,8")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="results/profile/q4_products")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from draftheads.decoding.base import fewrow
    from draftheads.decoding.base.hardware import isa_limits, machine_summary
    from draftheads.decoding.base.loading import load_base

    base, _ = load_base(dtype=torch.float32)
    tensors = body_tensors(base)
    exact = [t for t in tensors if t["exact"]]
    kernels = Path(tempfile.mkdtemp(prefix="q4-products-"))
    fewrow.load_kernel(kernels)
    lib = compile_kernel(kernels)
    fp32 = [fewrow.fewrow_product(fewrow.block_weight(t["weight"]), t["weight"].shape[0]) for t in exact]

    def q4(x: torch.Tensor, t: dict) -> torch.Tensor:
        out, inn = t["weight"].shape
        y = torch.empty(x.shape[0], out)
        nib, dm = t["layout"]
        lib.q4_product(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(nib.data_ptr()), ctypes.c_void_p(dm.data_ptr()),
                       ctypes.c_void_p(y.data_ptr()), ctypes.c_long(x.shape[0]), ctypes.c_long(inn), ctypes.c_long(out),
                       ctypes.c_int(args.threads))
        return y

    generator = torch.Generator().manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    inputs = {r: {n: torch.randn(r, n, generator=generator) for n in {t["weight"].shape[1] for t in exact}} for r in rows}
    bit_equal = all(torch.equal(f(inputs[r][t["weight"].shape[1]]), q4(inputs[r][t["weight"].shape[1]], t))
                    for r in rows for t, f in zip(exact, fp32))
    times: dict[str, dict[int, list[float]]] = {"float32": {r: [] for r in rows}, "q4_1": {r: [] for r in rows}}
    for _ in range(args.reps):
        for r in rows:
            for name in ("float32", "q4_1"):
                started = time.perf_counter()
                for t, f in zip(exact, fp32):
                    x = inputs[r][t["weight"].shape[1]]
                    f(x) if name == "float32" else q4(x, t)
                times[name][r].append((time.perf_counter() - started) * 1e3)
    best = {name: {r: round(min(v), 2) for r, v in by_rows.items()} for name, by_rows in times.items()}
    result = {"meta": {"machine": machine_summary(), "isa_limits": isa_limits(), "threads": args.threads, "reps": args.reps,
                       "tensors": len(tensors), "exact": len(exact), "outputs_bit_equal": bit_equal,
                       "bytes": {"float32": int(sum(t["weight"].numel() * 4 for t in exact)),
                                 "q4_1_layout": int(sum(sum(p.numel() * p.element_size() for p in t["layout"]) for t in exact))}},
              "best_ms": best, "ratio": {r: round(best["float32"][r] / best["q4_1"][r], 2) for r in rows}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "q4_products.json").write_text(json.dumps(result, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_rows in best.items():
        ax.plot(rows, [by_rows[r] for r in rows], marker="o", label=name)
    ax.set_xlabel("rows (tree nodes)")
    ax.set_ylabel("ms, one pass over the 210 body products")
    ax.set_title("float32 few-row kernel vs Q4_1 blocks (same sums)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "q4_products.png", dpi=120)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
