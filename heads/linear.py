"""Prepacked linear layers for CPU inference (oneDNN), used by the decoder's own forwards only.

Why: on a CPU, ``F.linear`` re-lays out the weight for oneDNN (bfloat16) or runs MKL's sgemm
(float32, slow for 2-8 rows) on every call. Packing each weight once into oneDNN's blocked
layout and calling its linear primitive directly measured 1.5-2× faster for bfloat16 at every
row count (the 49,152 × 576 LM head: 8.4 vs 17.5 ms for 1 row, one thread) and 1.7-3× for
float32 at 4-9 rows. bfloat16 results are bit-identical to ``F.linear`` (same accumulation);
float32 results differ by float32 rounding (~1e-5 on SmolLM2's logits), which the float32
guarantee (identical, or a first divergence at a near-tie) allows.

The packed path is only taken inside :func:`packed_linears` (the decoder's prefill and verify
forwards): the same module, called by the base's own ``generate``, computes exactly the
original ``F.linear``. This is the peft pattern: a wrapper module holding the original
parameter (same name, same tensor, same state dict), never a change to the modeling code.
"""
from __future__ import annotations

import contextvars
import functools
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("draftheads_packed_linears", default=False)
PACKED_DTYPES = (torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=1)
def packing_available() -> bool:
    """Whether this torch build has oneDNN's packed linear for both dtypes, checked for exact
    agreement with ``F.linear`` in bfloat16 (otherwise nothing is packed)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.randn(24, 16).to(torch.bfloat16)
        x = torch.randn(3, 16).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        return torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                           nn.functional.linear(x, weight))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and weight.dim() == 2 and packing_available()


class PackedWeight:
    """A weight's oneDNN-packed copy, made on first use and remade if the weight changes
    (another dtype, device or in-place update)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.dtype, weight.device, weight.data_ptr(), weight._version, tuple(weight.shape))
        if key != self._key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 8)
            self._key = key
        return self._packed


def packed_matmul(x: torch.Tensor, weight: torch.Tensor, cache: PackedWeight,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) · weightᵀ (weight (out, in)) through the packed copy in ``cache``; callers
    check :func:`can_pack` and that ``x`` has the weight's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, cache.get(weight), bias, "none", [], "")


class PackedLinear(nn.Module):
    """Wraps an ``nn.Linear``: its parameters under the same names; ``F.linear`` outside
    :func:`packed_linears`, the packed oneDNN primitive inside it."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _ACTIVE.get() and x.dtype == self.weight.dtype and can_pack(self.weight):
            return packed_matmul(x, self.weight, self._packed, self.bias)
        return nn.functional.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_packed_linears(module: nn.Module) -> int:
    """Wrap every ``nn.Linear`` below ``module`` in a :class:`PackedLinear` (idempotent; the
    state dict keeps its keys). Returns how many were wrapped."""
    if not packing_available():
        return 0
    targets = [name for name, child in module.named_modules() if type(child) is nn.Linear]
    for name in targets:
        module.set_submodule(name, PackedLinear(module.get_submodule(name)))
    return len(targets)


@contextmanager
def packed_linears(active: bool = True) -> Iterator[None]:
    """Within this block, wrapped linears (and the decoder's LM head) take the packed path."""
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def packing_active() -> bool:
    return _ACTIVE.get()
