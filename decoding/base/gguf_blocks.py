"""A base's weights given their Q4_1 blocks from the GGUF it was converted from
(:func:`attach_gguf_blocks`), for the products of :mod:`.q4`: float32 weights, and bfloat16 ones
(the dequantized value rounded to bf16) where the bf16 product runs.

Which weight a GGUF tensor is, is found by content, not by name: transformers renames the
tensors and permutes the rows of the query and key projections for its rotary layout, so each
GGUF row is matched to a weight row by its first values, and a tensor's blocks are kept only
where every row of one weight is matched once and the blocks, reordered, dequantize to that
weight bit for bit (rounded to the weight's dtype). Sibling layers stacked into one product
(:mod:`.siblings`) get the stacked blocks when every member has its own. Anything else — another architecture's naming, a weight edited after
loading, a GGUF that no longer reads — leaves the weight without blocks: its products stream
the float32 weight, with the same result.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from .architecture import decoder_body
from .binding import binding
from .loading import converted_from
from .q4 import Q4_GROUP, q4_available, q4_blocks, q4_dequantized
from .siblings import SiblingProduct

#: bytes of a GGUF Q4_1 block: d and m (fp16), then 16 bytes of 4-bit q
Q4_1_BYTES = 20
#: leading values of a row that identify it among a base's rows
KEY_VALUES = 16


def q4_1_parts(raw: np.ndarray, out: int, inn: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_1 rows (out, inn / 32 × 20 bytes) → q (out, inn) uint8, d and m (out, inn / 32) float16
    (in a block, element j is the low nibble of byte j, element j + 16 its high nibble)."""
    blocks = raw.reshape(out, inn // Q4_GROUP, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(out, inn)
    return q, d, m


def _row_keys(values: torch.Tensor, dtype: torch.dtype) -> list[bytes]:
    """Each row's first :data:`KEY_VALUES` values as a ``dtype`` weight holds them (rounded), as bytes."""
    head = values[:, :KEY_VALUES].to(dtype).float().contiguous().numpy()
    return [row.tobytes() for row in head]


def attach_gguf_blocks(model) -> int:
    """Give each linear layer of ``model``'s bound body (:func:`~.binding.use_packed_linears` first)
    whose weight is exactly a Q4_1 tensor of the GGUF the base was converted from
    (:func:`~.loading.converted_from`), in a dtype with a Q4_1 product here, its
    :class:`~.q4.Q4Blocks`; returns how many got them (0: not a converted base, or no such layer)."""
    found = binding(decoder_body(model))
    gguf = converted_from(getattr(model, "name_or_path", None) or "")
    if found is None or gguf is None or not Path(gguf).is_file():
        return 0
    wanted = [b for b in found.linears.values() if q4_available(b.module.weight.dtype)
              and b.module.weight.device.type == "cpu" and b.module.weight.shape[1] % Q4_GROUP == 0
              and b.copies.q4(b.module.weight) is None]
    rows: dict[tuple[torch.dtype, bytes], tuple[int, int]] = {}
    for index, bound in enumerate(wanted):
        dtype = bound.module.weight.dtype
        for row, key in enumerate(_row_keys(bound.module.weight.detach(), dtype)):
            rows[(dtype, key)] = (index, row)
    if not rows:
        return 0
    dtypes = sorted({dtype for dtype, _ in rows}, key=str)
    from gguf import GGUFReader

    try:
        tensors = [t for t in GGUFReader(str(gguf)).tensors if t.tensor_type.name == "Q4_1" and len(t.shape) == 2]
    except (OSError, ValueError, KeyError) as err:
        warnings.warn(f"the Q4_1 blocks of {gguf} could not be read ({err}); float32 products stream the weights "
                      "instead (same results, slower).", UserWarning, stacklevel=2)
        return 0
    parts_of: dict[int, list[torch.Tensor]] = {}
    for tensor in tensors:
        inn, out = int(tensor.shape[0]), int(tensor.shape[1])
        q, d, m = q4_1_parts(np.asarray(tensor.data), out, inn)
        head = q4_dequantized(*(torch.from_numpy(np.ascontiguousarray(p)) for p in (q[:, :Q4_GROUP], d[:, :1], m[:, :1])))
        for dtype in dtypes:
            hits = [rows.get((dtype, key)) for key in _row_keys(head, dtype)]
            bound = _matched(hits, wanted, out, inn)
            if bound is None:
                continue
            order = np.empty(out, dtype=np.int64)
            order[[row for _, row in hits]] = np.arange(out)  # weight row r is GGUF row order[r]
            parts = [torch.from_numpy(np.ascontiguousarray(p[order])) for p in (q, d, m)]
            weight = bound.module.weight.detach()
            if torch.equal(q4_dequantized(*parts).to(dtype), weight):
                bound.copies.set_q4(weight, q4_blocks(*parts, dtype))
                parts_of[id(bound.module)] = parts
            break
    for product in found.products:
        _stack(product, parts_of)
    found.generation += bool(parts_of)
    return len(parts_of)


def _stack(product: SiblingProduct, parts_of: dict[int, list[torch.Tensor]]) -> None:
    """The stacked blocks of sibling layers that all got their own (rows stacked as their weights are)."""
    members = [parts_of.get(id(m)) for m in product.members]
    if all(p is not None for p in members):
        stacked = [torch.cat([p[i] for p in members]) for i in range(3)]
        product.copies.set_q4(product.shape, q4_blocks(*stacked, product.shape.dtype))


def _matched(hits: list, wanted: list, out: int, inn: int):
    """The one bound layer every row of a GGUF tensor matched, each of its rows once, or None."""
    if not hits or None in hits or len({index for index, _ in hits}) != 1:
        return None
    bound = wanted[hits[0][0]]
    if tuple(bound.module.weight.shape) != (out, inn) or len({row for _, row in hits}) != out:
        return None
    return bound
