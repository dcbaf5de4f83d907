"""scripts/q4_products.py: its reading of Q4_1 blocks is the gguf package's (the dequantized values
the embedded base is made of), and its kernel layout holds each weight's nibble, d and m where the
kernel reads them."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from helpers import load_script

q4 = load_script("q4_products")


def blocks(out: int = 24, inn: int = 64, seed: int = 0) -> np.ndarray:
    values = np.random.default_rng(seed).normal(size=(out, inn)).astype(np.float32)
    return quantize(values, GGMLQuantizationType.Q4_1)  # (out, inn/32 × 20) uint8


def test_parts_dequantize_as_the_gguf_package_does():
    raw = blocks()
    q, d, m = q4.q4_1_parts(raw, 24, 64)
    assert q.max() <= 15 and q.shape == (24, 64) and d.shape == m.shape == (24, 2)
    expected = dequantize(raw, GGMLQuantizationType.Q4_1).reshape(24, 64)
    assert np.array_equal(q4.dequantized(q, d, m), expected)  # bit for bit


def test_layout_places_each_weight_where_the_kernel_reads_it():
    q, d, m = q4.q4_1_parts(blocks(out=20), 20, 64)  # 20 outputs: the second 16-output block is padded
    nib, dm = (t.numpy() for t in q4.layout(q, d, m))
    groups = 64 // 32
    dm = dm.view(np.float16).reshape(2, groups, 2, 16)
    nib = nib.reshape(2, groups, 32, 8)
    for o in range(20):
        b, j = divmod(o, 16)
        for k in range(64):
            g, kk = divmod(k, 32)
            byte = int(nib[b, g, kk, j % 8])
            assert (byte >> 4 if j >= 8 else byte & 0xF) == q[o, k]
            assert dm[b, g, 0, j] == d[o, g] and dm[b, g, 1, j] == m[o, g]
