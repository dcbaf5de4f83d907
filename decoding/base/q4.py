"""Products streamed from a weight's Q4_1 blocks (``fewrow.c``), where the weight is exactly its Q4_1
quantization dequantized: float32 (AVX2), or rounded to bfloat16 (AVX512-BF16).

Why: a base converted from a Q4_1 GGUF (the embedded SmolLM2) holds in every body weight
d·q + m per group of 32 inputs (d, m fp16, q 4 bits), which float32 represents exactly. A
product that streams the blocks (0.625 bytes a weight) and dequantizes them in registers reads
6.4× fewer bytes than one over the float32 weight, and computes the same sums: each 16-output
block is dequantized into scratch and multiplied by the float32 kernel's own loop, so the
outputs equal the float32 kernel's over the weight bit for bit (checked before first use,
:func:`q4_available`). A bfloat16 base converted from the same GGUF holds each weight rounded to
bf16 (to nearest even, as torch rounds): the bf16 product rebuilds exactly that in registers and
runs the bf16 kernel's VDPBF16PS chain, its outputs bit for bit the bf16 kernel's (which stay
within one bf16 rounding of ``F.linear``'s). Nothing is approximated: a weight gets blocks only where they
dequantize to its exact content (:mod:`.gguf_blocks`), and a weight changed since is
multiplied as it is (its blocks dropped with its other copies).
evidence: results/profile/q4_products
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .fewrow import BLOCK, PARALLEL_WORK, _blocked, _run, kernel, kernel_dtypes

#: inputs per Q4_1 block (one d and one m each)
Q4_GROUP = 32


@dataclass(frozen=True, eq=False)
class Q4Blocks:
    """A weight (out, in) of ``dtype`` (float32, or bfloat16: the dequantized value rounded) as its
    Q4_1 blocks in the kernel's layout (``fewrow.c``): ``nib`` the 4-bit q, two outputs a byte;
    ``dm`` the fp16 d and m. Made by :func:`q4_blocks`."""

    nib: torch.Tensor  # (blocks · 16 · in / 2,) uint8
    dm: torch.Tensor  # (blocks · in / 32 · 32,) int16: fp16 bits
    out_features: int
    in_features: int
    dtype: torch.dtype = torch.float32

    @property
    def nbytes(self) -> int:
        return self.nib.numel() + 2 * self.dm.numel()


def q4_dequantized(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q (out, in) integers 0-15, d and m (out, in / 32) float16 → the float32 weight d·q + m (d·q
    is exact in float32: one rounding, in + m, as the kernel's fma rounds)."""
    return d.float().repeat_interleave(Q4_GROUP, 1) * q.float() + m.float().repeat_interleave(Q4_GROUP, 1)


def q4_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype = torch.float32) -> Q4Blocks:
    """q (out, in) integers 0-15 (in a multiple of 32), d and m (out, in / 32) float16 → the
    kernel's :class:`Q4Blocks` for a weight of ``dtype`` (needs the loaded kernel)."""
    out, inn = q.shape
    blocks, groups = (out + BLOCK - 1) // BLOCK, inn // Q4_GROUP
    q8 = q.to(torch.uint8).contiguous()
    d16, m16 = (p.to(torch.float16).contiguous().view(torch.int16) for p in (d, m))
    nib = torch.empty(blocks * BLOCK * inn // 2, dtype=torch.uint8)
    dm = torch.empty(blocks * groups * 2 * BLOCK, dtype=torch.int16)
    kernel().draftheads_q4_layout(q8.data_ptr(), d16.data_ptr(), m16.data_ptr(), nib.data_ptr(), dm.data_ptr(), out,
                                  inn, int(dtype == torch.bfloat16))  # bf16: the paired layout (fewrow.c)
    return Q4Blocks(nib, dm, out, inn, dtype)


def q4_product(blocks: Q4Blocks, bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x (rows, in) contiguous, in the blocks' dtype → x · Wᵀ (+ bias) through W's Q4_1 blocks: bit
    for bit what the few-row kernel of that dtype computes over the weight."""
    bf16 = blocks.dtype == torch.bfloat16
    run = kernel().draftheads_fewrow_q4_bf16 if bf16 else kernel().draftheads_fewrow_q4
    out, inn, dtype = blocks.out_features, blocks.in_features, blocks.dtype
    nib, dm = blocks.nib.data_ptr(), blocks.dm.data_ptr()

    def product(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        y = torch.empty(rows, out, dtype=dtype)
        threads = torch.get_num_threads() if rows * inn * out >= PARALLEL_WORK else 1
        run(x.data_ptr(), nib, dm, y.data_ptr(), rows, inn, out, threads)
        if bias is not None:
            y += bias
        return y
    product.keeps = blocks  # the blocks live as long as the product
    return product


def random_q4(out: int, inn: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random Q4_1 parts (q, d, m) of a weight (out, in) at a weight's usual scale (d ~ 0.005, m ~ −8d)."""
    q = torch.randint(0, 16, (out, inn), generator=generator)
    d = (torch.rand(out, inn // Q4_GROUP, generator=generator) * 0.01 + 1e-4).half()
    m = (-8 * d.float() * (0.5 + torch.rand(d.shape, generator=generator))).half()
    return q, d, m


#: the dtypes a Q4_1 product exists for (bfloat16 where the loaded kernel multiplies it: AVX512-BF16)
Q4_DTYPES = (torch.float32, torch.bfloat16)
#: per (loaded kernel library by id, dtype): whether its Q4_1 product agreed with the few-row kernel
_AGREED: dict[tuple[int, torch.dtype], bool] = {}


def q4_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the loaded kernel multiplies ``dtype`` weights through their Q4_1 blocks here: the
    few-row kernel runs that dtype (:func:`~.fewrow.kernel_dtypes`) and the Q4_1 product agreed
    with it, bit for bit, over the (rounded) dequantized weight (a partial block, 1-13 rows;
    checked once per loaded library and dtype)."""
    lib = kernel()
    if lib is None or dtype not in Q4_DTYPES or dtype not in kernel_dtypes():
        return False
    if (id(lib), dtype) not in _AGREED:
        _AGREED[(id(lib), dtype)] = _agrees(lib, dtype)
    return _AGREED[(id(lib), dtype)]


def _agrees(lib, dtype: torch.dtype) -> bool:
    generator = torch.Generator().manual_seed(0)
    q, d, m = random_q4(37, 64, generator)
    try:
        product = q4_product(q4_blocks(q, d, m, dtype))
        blocked = _blocked(lib, q4_dequantized(q, d, m).to(dtype))
        for rows in (1, 5, 6, 7, 13):
            x = torch.randn(rows, 64, generator=generator).to(dtype)
            if not torch.equal(product(x), _run(lib, x, blocked, 37)):
                return False
        return True
    except AttributeError:
        return False
