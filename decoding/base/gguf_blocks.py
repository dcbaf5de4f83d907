"""A base's weights given their blocks from the GGUF it was converted from (:func:`attach_gguf_blocks`),
for the products of :mod:`.blocks`: float32 weights, and bfloat16 ones (the dequantized value
rounded to bf16) where the bf16 products run; Q4_1 and Q8_0 tensors (the embedded SmolLM2's body,
and its embeddings tied to the LM head).

Which weight a GGUF tensor is, is found by content, not by name: transformers renames the
tensors and permutes the rows of the query and key projections for its rotary layout, so each
GGUF row is matched to a weight row by its values (rows repeated in a weight — an embedding's
unused tokens — are matched in turn), and a tensor's blocks are kept only where every row of one
weight is matched once and the blocks, reordered, dequantize to that weight bit for bit (rounded
to the weight's dtype). Sibling layers stacked into one product
(:mod:`.siblings`) get the stacked blocks when every member has its own. Anything else — another
architecture's naming, a weight edited after loading, a GGUF that no longer reads — leaves the
weight without blocks: its products stream the weight, with the same result.
"""
from __future__ import annotations

import mmap
import warnings
from pathlib import Path

import numpy as np
import torch

from .architecture import decoder_body
from .binding import Binding, binding
from .blocks import GROUP, KINDS, blocks_available, dequantized, make_blocks
from .fingerprint import lm_head_weight
from .loading import converted_from
from .packed import PackedWeight
from .siblings import SiblingProduct

#: bytes of a GGUF block of each kind: Q4_1 d and m (fp16) then 16 bytes of 4-bit q; Q8_0 d then 32 int8
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
#: GGML's type ids of the kinds (ggml.h)
GGML_TYPES = {3: "q4_1", 8: "q8_0"}
#: a GGUF metadata value's size by type id, for the fixed-size ones (ggml's gguf.h); 8 string, 9 array
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _Reader:
    """Little-endian reads from a GGUF file's bytes, each checked against its end."""

    def __init__(self, data):
        self.data, self.at = data, 0

    def take(self, size: int) -> bytes:
        if size < 0 or self.at + size > len(self.data):
            raise ValueError("it ends inside its header")
        part, self.at = self.data[self.at: self.at + size], self.at + size
        return part

    def int(self, size: int) -> int:
        return int.from_bytes(self.take(size), "little")

    def skip_value(self, kind: int) -> None:
        if kind in _SCALAR_BYTES:
            self.take(_SCALAR_BYTES[kind])
        elif kind == 8:
            self.take(self.int(8))
        elif kind == 9:
            inner, count = self.int(4), self.int(8)
            if inner in _SCALAR_BYTES:
                self.take(_SCALAR_BYTES[inner] * count)
            else:
                for _ in range(count):
                    self.skip_value(inner)
        else:
            raise ValueError(f"a metadata value has unknown type {kind}")


def gguf_tensors(path: Path) -> list[tuple[str, int, int, np.ndarray]]:
    """The 2-D tensors of :data:`GGML_TYPES` kinds in a GGUF file (v2/v3), as (kind, out, in, their
    bytes (out, in / 32 × block bytes), memory-mapped); only the header is parsed (the metadata is
    skipped, not decoded). A file that is not such a GGUF raises ``ValueError`` naming what is wrong."""
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    reader = _Reader(mapped)
    if reader.take(4) != b"GGUF" or reader.int(4) not in (2, 3):
        raise ValueError("not a GGUF file of version 2 or 3")
    tensors, fields = reader.int(8), reader.int(8)
    alignment = 32
    for _ in range(fields):
        key = reader.take(reader.int(8))
        kind = reader.int(4)
        if key == b"general.alignment" and kind == 4:
            alignment = reader.int(4) or 32
        else:
            reader.skip_value(kind)
    infos = []
    for _ in range(tensors):
        reader.take(reader.int(8))  # the name: matched by content instead
        dims = [reader.int(8) for _ in range(reader.int(4))]
        infos.append((dims, reader.int(4), reader.int(8)))
    start = -(-reader.at // alignment) * alignment
    found = []
    for dims, ggml_type, offset in infos:
        kind = GGML_TYPES.get(ggml_type)
        if kind is None or len(dims) != 2 or dims[0] % GROUP:
            continue
        inn, out = dims
        size = out * inn // GROUP * BLOCK_BYTES[kind]
        if start + offset + size > len(mapped):
            raise ValueError("a tensor runs past its end")
        found.append((kind, out, inn, np.frombuffer(mapped, np.uint8, size, start + offset).reshape(out, -1)))
    return found


def gguf_parts(kind: str, raw: np.ndarray, out: int, inn: int) -> tuple:
    """GGUF rows of ``kind`` (out, inn / 32 × block bytes) → q (out, inn), d and m (out, inn / 32)
    float16 (m None for Q8_0). Q4_1: in a block, element j is the low nibble of byte j, element
    j + 16 its high nibble."""
    blocks = raw.reshape(out, inn // GROUP, BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "q8_0":
        return blocks[..., 2:].copy().view(np.int8).reshape(out, inn), d, None
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:]
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(out, inn), d, m


def _row_keys(values: torch.Tensor, dtype: torch.dtype) -> list[int]:
    """Each row's hash as a ``dtype`` weight holds its values (rounded)."""
    return [hash(row.tobytes()) for row in values.to(dtype).float().contiguous().numpy()]


def _targets(model, found: Binding, head: PackedWeight | None) -> list[tuple[torch.Tensor, PackedWeight, int]]:
    """The weights that may get blocks, each with the copies it is multiplied through and the id the
    stacked products know it by: the linear layers of the body's binding (``found``) and the LM head
    (``head``: its copies)."""
    targets = [(b.module.weight.detach(), b.copies, id(b.module)) for b in found.linears.values()]
    if head is not None:
        targets.append((lm_head_weight(model).detach(), head, id(head)))
    return [t for t in targets if t[0].device.type == "cpu" and t[0].dim() == 2 and t[0].shape[1] % GROUP == 0
            and any(blocks_available(kind, t[0].dtype) for kind in KINDS) and t[1].blocks(t[0]) is None]


def attach_gguf_blocks(model, head: PackedWeight | None = None) -> int:
    """Give each weight of ``model`` (its bound body's linear layers, after
    :func:`~.binding.use_packed_linears`, and its LM head where ``head`` holds its copies) that is
    exactly a tensor of the GGUF the base was converted from (:func:`~.loading.converted_from`), of a
    kind and dtype with a block product here, its :class:`~.blocks.Blocks`; returns how many got them
    (0: not a converted base, or none such)."""
    found = binding(decoder_body(model))
    gguf = converted_from(getattr(model, "name_or_path", None) or "")
    if found is None or gguf is None or not Path(gguf).is_file():
        return 0
    targets = _targets(model, found, head)
    rows: dict[tuple[torch.dtype, int], list[tuple[int, int]]] = {}
    for index, (weight, _, _) in enumerate(targets):
        for row, key in enumerate(_row_keys(weight, weight.dtype)):
            rows.setdefault((weight.dtype, key), []).append((index, row))
    if not rows:
        return 0
    try:
        tensors = gguf_tensors(Path(gguf))
    except (OSError, ValueError) as err:
        warnings.warn(f"the blocks of {gguf} could not be read ({err}); products stream the weights instead "
                      "(same results, slower).", UserWarning, stacklevel=2)
        return 0
    parts_of: dict[int, list] = {}
    dtypes = sorted({dtype for dtype, _ in rows}, key=str)
    for kind, out, inn, raw in tensors:
        parts = gguf_parts(kind, np.asarray(raw), out, inn)
        match = _match(kind, parts, targets, rows, dtypes, out, inn)
        if match is not None:
            (weight, copies, key), ordered = match
            copies.set_blocks(weight, make_blocks(kind, *ordered, dtype=weight.dtype))
            parts_of[key] = [kind, *ordered]
    for product in found.products:
        _stack(product, parts_of)
    found.generation += bool(parts_of)
    return len(parts_of)


def _match(kind: str, parts: tuple, targets: list, rows: dict, dtypes: list, out: int, inn: int):
    """The target a GGUF tensor's parts are, bit for bit, with the parts in its row order; or None."""
    values = dequantized(kind, *(None if p is None else torch.from_numpy(np.ascontiguousarray(p)) for p in parts))
    for dtype in dtypes:
        hits, taken = [], {}
        for key in _row_keys(values, dtype):
            found, turn = rows.get((dtype, key), ()), taken.get(key, 0)
            if turn >= len(found):
                break
            taken[key] = turn + 1
            hits.append(found[turn])
        if len(hits) != out or len({index for index, _ in hits}) != 1:
            continue
        target = targets[hits[0][0]]
        if tuple(target[0].shape) != (out, inn):
            return None
        order = np.empty(out, dtype=np.int64)
        order[[row for _, row in hits]] = np.arange(out)  # weight row r is GGUF row order[r]
        if not torch.equal(values[torch.from_numpy(order)].to(dtype), target[0]):
            return None
        return target, [None if p is None else torch.from_numpy(np.ascontiguousarray(p[order])) for p in parts]
    return None


def _stack(product: SiblingProduct, parts_of: dict[int, list]) -> None:
    """The stacked blocks of sibling layers that all got their own, of one kind (rows stacked as their
    weights are)."""
    members = [parts_of.get(id(m)) for m in product.members]
    if all(p is not None for p in members) and len({p[0] for p in members}) == 1:
        stacked = [None if members[0][i] is None else torch.cat([p[i] for p in members]) for i in (1, 2, 3)]
        product.copies.set_blocks(product.shape, make_blocks(members[0][0], *stacked, dtype=product.shape.dtype))
