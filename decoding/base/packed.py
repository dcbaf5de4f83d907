"""A weight's packed copies, kept beside it: the oneDNN-packed copy and the few-row kernel's
blocked copy (:mod:`.fewrow`), each made on first use, and its GGUF blocks where they were given
(:mod:`.blocks`), each checked against the weight's content
(:func:`~draftheads.core.content.content_fingerprint`) before each decoding call; and the one
product through them (:func:`packed_matmul`) that the plan picks (:mod:`.plan`)."""
from __future__ import annotations

from typing import Callable

import torch

from ...core.content import FingerprintMemo, fingerprint_of
from .fewrow import block_weight, fewrow_product
from .plan import PLAN, fewrow_applies, packs
from .blocks import Blocks, blocks_product


def tensor_key(weight: torch.Tensor) -> tuple:
    """What identifies a weight's tensor cheaply (dtype, device, storage, autograd version, shape):
    a copy whose key differs is remade on its next use. An inference tensor (a model built under
    ``torch.inference_mode``) has no version: its content fingerprint, checked before each
    decoding call, is what sees it change."""
    version = 0 if weight.is_inference() else weight._version
    return weight.dtype, weight.device, weight.data_ptr(), version, tuple(weight.shape)


class PackedWeight:
    """A weight's oneDNN-packed copy and its few-row kernel copy, each made on first use and kept
    with the fingerprint of the content it was made from
    (:func:`~draftheads.core.content.content_fingerprint`). A copy is remade when the weight is
    another tensor or was changed through autograd (:func:`tensor_key`, checked on every use, for
    free), and dropped by :meth:`drop_stale` — called before each decoding call — when the
    content changed any other way."""

    def __init__(self) -> None:
        self._copies: dict[str, tuple[tuple, torch.Tensor | Blocks, tuple[torch.Tensor, ...]]] = {}

    def key(self, weight: torch.Tensor) -> tuple:
        return tensor_key(weight)

    def fingerprint(self, weight: torch.Tensor, memo: FingerprintMemo | None = None) -> tuple[torch.Tensor, ...]:
        return (fingerprint_of(weight, memo),)

    def source(self, weight: torch.Tensor) -> torch.Tensor:
        """The tensor a copy is made from."""
        return weight.detach().contiguous()

    def _copy(self, kind: str, weight: torch.Tensor, make) -> torch.Tensor:
        key = self.key(weight)
        cached = self._copies.get(kind)
        if cached is None or cached[0] != key:
            cached = self._copies[kind] = (key, make(self.source(weight)), self.fingerprint(weight))
        return cached[1]

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        return self._copy("packed", weight, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 8))

    def blocked(self, weight: torch.Tensor) -> torch.Tensor:
        return self._copy("fewrow", weight, block_weight)

    def set_blocks(self, weight: torch.Tensor, blocks: Blocks) -> None:
        """Keep ``blocks``, which dequantize to ``weight`` as it is now (:mod:`.gguf_blocks` checked)."""
        self._copies["blocks"] = (self.key(weight), blocks, self.fingerprint(weight))

    def blocks(self, weight: torch.Tensor) -> Blocks | None:
        """The weight's GGUF blocks where they were given for it as it is now, else None (never
        made here: blocks come only from a source checked against the weight)."""
        cached = self._copies.get("blocks")
        return cached[1] if cached is not None and cached[0] == self.key(weight) else None

    def drop_stale(self, weight: torch.Tensor, memo: FingerprintMemo | None = None) -> bool:
        """Drop every copy not made from ``weight`` as it is now (another tensor, or other content);
        returns whether one was dropped. Reads the weight once (none when no copy was made)."""
        if not self._copies:
            return False
        key = self.key(weight)
        current = None
        stale = []
        for kind, (made_key, _, made_from) in self._copies.items():
            if made_key == key:
                current = current if current is not None else self.fingerprint(weight, memo)
                if all(torch.equal(a, b) for a, b in zip(made_from, current)):
                    continue
            stale.append(kind)
        for kind in stale:
            del self._copies[kind]
        return bool(stale)

    def clear(self) -> None:
        self._copies.clear()


def block_kind(copies: PackedWeight, weight: torch.Tensor) -> str | None:
    """The kind of the GGUF blocks kept for ``weight`` as it is now (None: it has none)."""
    blocks = copies.blocks(weight)
    return blocks.kind if blocks is not None else None


def packed_matmul(x: torch.Tensor, weight: torch.Tensor, cache: PackedWeight,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) · weightᵀ (weight (out, in)) through the copy in ``cache`` that the plan picks
    for this row count (packed, or the few-row kernel); callers check :func:`packs` and that
    ``x`` has the weight's dtype."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    y = resolved_matmul(weight, cache, flat.shape[0], bias)(flat)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def resolved_matmul(weight: torch.Tensor, cache: PackedWeight, rows: int,
                    bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`packed_matmul` for ``rows`` rows resolved once: the path the plan picks and its copy,
    bound into a function of x (rows, in) contiguous (the decoder's direct body, :mod:`.direct`,
    keeps it while the plan and the copies stand)."""
    blocks = cache.blocks(weight)
    path = PLAN.path(weight, rows, kind=blocks.kind if blocks is not None else None)
    if blocks is not None and path == blocks.kind:
        return blocks_product(blocks, bias)
    if path == "fewrow" and fewrow_applies(weight):
        return fewrow_product(cache.blocked(weight), weight.shape[0], bias)
    packed = cache.get(weight)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedReadout(PackedWeight):
    """The packed copy of heads' draft readout rows, handed to the heads
    (:meth:`~draftheads.heads.protocol.DraftHeads.use_readout`): heads import nothing from
    ``decoding``, so they take the product as this object and call :meth:`product`."""

    def product(self, states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """states (..., d) · weightᵀ (weight (V, d)) in the weight's dtype through the packed copy,
        or None where the plan keeps ``F.linear`` for this shape and row count (the heads then
        multiply as they always do)."""
        if packs(weight, states.numel() // states.shape[-1]):
            return packed_matmul(states.to(weight.dtype), weight, self)
        return None
