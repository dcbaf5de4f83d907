"""Products streamed from a weight's GGUF blocks (``fewrow.c``), where the weight is exactly its GGUF
quantization dequantized: float32 (AVX2), or rounded to bfloat16 (AVX512-BF16).

Why: a base converted from a GGUF (the embedded SmolLM2: Q4_1 body, Q8_0 embeddings and tied LM
head) holds in every such weight d·q + m per group of 32 inputs (Q4_1: d, m fp16, q 4 bits) or
d·q (Q8_0: q int8), which float32 represents exactly. A product that streams the blocks (0.625 and
1.0625 bytes a weight) and dequantizes them in registers reads 6.4× and 3.8× fewer bytes than one
over the float32 weight, and computes the same sums: each column's weights are made in registers
and multiplied with the float32 kernel's own FMA chain, so the outputs equal the float32 kernel's
over the weight bit for bit (checked before first use, :func:`blocks_available`). A bfloat16 base
converted from the same GGUF holds each weight rounded to bf16 (to nearest even, as torch rounds):
the bf16 product rebuilds exactly that and runs the bf16 kernel's VDPBF16PS chain, its outputs bit
for bit the bf16 kernel's (which stay within one bf16 rounding of ``F.linear``'s). Nothing is
approximated: a weight gets blocks only where they give its exact content (:mod:`.gguf_blocks`),
and a weight changed since is multiplied as it is (its blocks dropped with its other copies).
evidence: results/profile/q4_products
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .fewrow import BLOCK, PARALLEL_WORK, _blocked, _run, kernel, kernel_dtypes

#: inputs per block (one d, and for Q4_1 one m, each)
GROUP = 32
#: the GGUF block kinds multiplied here, by the name the plan's path and timings carry
KINDS = ("q4_1", "q8_0")
#: the weights' dtypes a block product exists for (bfloat16 where the few-row kernel multiplies it)
DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, eq=False)
class Blocks:
    """A weight (out, in) of ``dtype`` (float32, or bfloat16: the dequantized value rounded) as its
    GGUF blocks of ``kind`` in the kernel's layout (``fewrow.c``; bf16: the paired layout): ``data``
    the q (Q4_1: two outputs' 4 bits a byte; Q8_0: a byte each), ``scales`` the fp16 d (and m).
    Made by :func:`make_blocks`."""

    kind: str
    data: torch.Tensor  # uint8 (Q4_1) or int8 (Q8_0), flat
    scales: torch.Tensor  # int16: fp16 bits, flat
    out_features: int
    in_features: int
    dtype: torch.dtype = torch.float32

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 2 * self.scales.numel()


def dequantized(kind: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight (out, in) the parts stand for: Q4_1 d·q + m (q 0-15), Q8_0 d·q (q int8); d and
    m (out, in / 32) float16. d·q is exact in float32: Q4_1 rounds once, in + m, as the kernel's fma."""
    w = d.float().repeat_interleave(GROUP, 1) * q.float()
    return w + m.float().repeat_interleave(GROUP, 1) if kind == "q4_1" else w


def make_blocks(kind: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32) -> Blocks:
    """Parts as :func:`dequantized` takes them (in a multiple of 32) → the kernel's :class:`Blocks`
    for a weight of ``dtype`` (needs the loaded kernel)."""
    out, inn = q.shape
    blocks, groups, paired = (out + BLOCK - 1) // BLOCK, inn // GROUP, int(dtype == torch.bfloat16)
    d16 = d.to(torch.float16).contiguous().view(torch.int16)
    if kind == "q4_1":
        q8, m16 = q.to(torch.uint8).contiguous(), m.to(torch.float16).contiguous().view(torch.int16)
        data = torch.empty(blocks * BLOCK * inn // 2, dtype=torch.uint8)
        scales = torch.empty(blocks * groups * 2 * BLOCK, dtype=torch.int16)
        kernel().draftheads_q4_layout(q8.data_ptr(), d16.data_ptr(), m16.data_ptr(), data.data_ptr(),
                                      scales.data_ptr(), out, inn, paired)
    else:
        q8 = q.to(torch.int8).contiguous()
        data = torch.empty(blocks * BLOCK * inn, dtype=torch.int8)
        scales = torch.empty(blocks * groups * BLOCK, dtype=torch.int16)
        kernel().draftheads_q8_layout(q8.data_ptr(), d16.data_ptr(), data.data_ptr(), scales.data_ptr(), out, inn,
                                      paired)
    return Blocks(kind, data, scales, out, inn, dtype)


def blocks_product(blocks: Blocks, bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x (rows, in) contiguous, in the blocks' dtype → x · Wᵀ (+ bias) through W's blocks: bit for
    bit what the few-row kernel of that dtype computes over the weight."""
    name = "draftheads_fewrow_" + blocks.kind[:2] + ("_bf16" if blocks.dtype == torch.bfloat16 else "")
    run, out, inn, dtype = getattr(kernel(), name), blocks.out_features, blocks.in_features, blocks.dtype
    data, scales = blocks.data.data_ptr(), blocks.scales.data_ptr()

    def product(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        y = torch.empty(rows, out, dtype=dtype)
        threads = torch.get_num_threads() if rows * inn * out >= PARALLEL_WORK else 1
        run(x.data_ptr(), data, scales, y.data_ptr(), rows, inn, out, threads)
        if bias is not None:
            y += bias
        return y
    product.keeps = blocks  # the blocks live as long as the product
    if bias is None:  # what it multiplies through (:mod:`.body_call` reads it)
        product.kernel = (blocks.kind, blocks.data, blocks.scales)
    return product


def random_parts(kind: str, out: int, inn: int, generator: torch.Generator) -> tuple:
    """Random parts (q, d, m) of a weight (out, in) at a weight's usual scale (d ~ 0.005; Q4_1 m ~ −8d,
    Q8_0 no m)."""
    d = (torch.rand(out, inn // GROUP, generator=generator) * 0.01 + 1e-4).half()
    if kind == "q8_0":
        return torch.randint(-127, 128, (out, inn), generator=generator), d, None
    m = (-8 * d.float() * (0.5 + torch.rand(d.shape, generator=generator))).half()
    return torch.randint(0, 16, (out, inn), generator=generator), d, m


#: per (loaded kernel library by id, kind, dtype): whether its block product agreed with the few-row kernel
_AGREED: dict[tuple[int, str, torch.dtype], bool] = {}


def blocks_available(kind: str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the loaded kernel multiplies ``dtype`` weights through blocks of ``kind`` here: the
    few-row kernel runs that dtype (:func:`~.fewrow.kernel_dtypes`) and the block product agreed with
    it, bit for bit, over the (rounded) dequantized weight (a partial block, 1-13 rows; checked once
    per loaded library, kind and dtype)."""
    lib = kernel()
    if lib is None or kind not in KINDS or dtype not in DTYPES or dtype not in kernel_dtypes():
        return False
    if (id(lib), kind, dtype) not in _AGREED:
        _AGREED[(id(lib), kind, dtype)] = _agrees(lib, kind, dtype)
    return _AGREED[(id(lib), kind, dtype)]


def _agrees(lib, kind: str, dtype: torch.dtype) -> bool:
    generator = torch.Generator().manual_seed(0)
    parts = random_parts(kind, 37, 64, generator)
    try:
        product = blocks_product(make_blocks(kind, *parts, dtype=dtype))
        blocked = _blocked(lib, dequantized(kind, *parts).to(dtype))
        for rows in (1, 5, 6, 7, 13):
            x = torch.randn(rows, 64, generator=generator).to(dtype)
            if not torch.equal(product(x), _run(lib, x, blocked, 37)):
                return False
        return True
    except AttributeError:
        return False
