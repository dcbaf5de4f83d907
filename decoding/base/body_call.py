"""A tree step's whole decoder body in one library call (``body.c``): what :func:`~.direct.direct_forward`
does layer by layer — the products, :class:`~.direct.StepAttention`'s one call, the fused norms, the
SiLU gate — run by one C function over the same kernels in the same order, so the states it returns
are the layer-by-layer path's bit for bit (tests/decoding/base/test_body_call.py).

Why: at a bs-1 step's 2-5 rows each of a layer's ~10 library calls costs its Python around it (a
closure, a tensor allocated, a dozen pointers read, ctypes' conversions): ~120 µs a layer, ~3.6 ms of
a 30-layer step on 2 AVX2 cores, a quarter of the verification (evidence:
results/profile/step_breakdown/avx2_native). Here a forward reserves the cache's room, writes each
layer's cache pointers into a table made once per row count, and makes one call.

It runs where every piece has its kernel: :class:`~.direct.StepAttention` with the one-call path, every
product of every layer through the compiled library (the few-row kernel's copy or GGUF blocks, no
bias), the SiLU gate, the norms' weights in the dtype with one epsilon, one attention scale.
Anything else runs layer by layer as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .fewrow import PARALLEL_WORK
from .fused import is_silu

#: the kind codes of ``body.c``'s products, by the name a product's ``kernel`` carries
KIND_CODES = {"fewrow": 0, "q4_1": 1, "q8_0": 2}
#: ``body.c``'s marker for a product computed by the stacked one before it (k and v after q; up after gate)
STACKED = -1
#: ``body.c``'s table: seven products (kind, data, scales), then these fields, per layer
PRODUCTS = 7
POST, NEXT, KEY, VALUE, CAP, START, TAP = range(3 * PRODUCTS, 3 * PRODUCTS + 7)
FIELDS = 3 * PRODUCTS + 7


@dataclass
class BodyTable:
    """What one row count's call reads that stays while the plans do: the table (layers, FIELDS)
    with products and norms filled in, the tensors it points into (kept alive), the dims and the
    shared epsilon and scale."""

    table: torch.Tensor
    keeps: list
    inter: int
    eps: float
    scale: float


def _product_fields(kernels: tuple, members: int) -> list[int] | None:
    """A group's ``kernels`` (:func:`~.binding.resolved_linears`: one stacked, or one per member) →
    ``members`` × (kind, data, scales) as ``body.c`` reads them, or None (a product off the kernels)."""
    if any(k is None for k in kernels) or len(kernels) not in (1, members):
        return None
    fields = []
    for kind, data, scales in kernels:
        fields += [KIND_CODES[kind], data.data_ptr(), 0 if scales is None else scales.data_ptr()]
    return fields + [STACKED, 0, 0] * (members - len(kernels))


def body_table(state, plans: list) -> BodyTable | None:
    """The table for ``plans`` (one row count's :class:`~.direct.LayerPlan`) of ``state``
    (:class:`~.direct.DirectBody`), or None where a piece has no kernel."""
    norms = [n for plan, following in zip(plans, state.next_norms) for n in (plan.post_norm, following)]
    dtype = norms[0].weight.dtype
    width = norms[0].weight.shape[0]
    if (state.ops.body_call(dtype) is None
            or len({n.variance_epsilon for n in norms}) != 1 or len({p.attn.scaling for p in plans}) != 1
            or not all(is_silu(p.mlp.act_fn) for p in plans)
            or any(n.weight.dtype != dtype or n.weight.shape != (width,) or not n.weight.is_contiguous()
                   for n in norms)):
        return None
    rows, keeps = [], []
    for plan, following in zip(plans, state.next_norms):
        groups = [_product_fields(getattr(f, "kernels", (None,)), members) for f, members in
                  ((plan.qkv, 3), (plan.o, 1), (plan.gate_up, 2), (plan.down, 1))]
        if any(g is None for g in groups):
            return None
        rows.append([v for g in groups for v in g] + [plan.post_norm.weight.data_ptr(), following.weight.data_ptr()]
                    + [0] * (FIELDS - 3 * PRODUCTS - 2))
        keeps += [k for f in (plan.qkv, plan.o, plan.gate_up, plan.down) for k in f.kernels]
        keeps += [plan.post_norm.weight, following.weight]
    return BodyTable(torch.tensor(rows, dtype=torch.int64), keeps, plans[0].mlp.down_proj.in_features,
                     float(norms[0].variance_epsilon), float(plans[0].attn.scaling))


def run_body(call, body: BodyTable, step, cache_layers: list, hidden: torch.Tensor, normed: torch.Tensor,
             taps: Sequence[int]) -> dict[int, torch.Tensor]:
    """Run every layer over ``hidden`` and ``normed`` (rows, d), updated in place (``normed`` ends as
    the final norm's output), the step's slots written into ``cache_layers`` (each reserved here);
    returns the residual stream after each tapped layer (taps ≥ 1)."""
    table = body.table.clone()  # this forward's: its cache slots and taps (another thread may run its own)
    batch, length, heads, kv_heads, dim, cos, sin, cos_rows = step.fixed
    slots = []
    for layer in cache_layers:
        key, value, start = layer.reserve(length)
        slots += [key.data_ptr(), value.data_ptr(), key.shape[2], start]
    table[:, KEY:START + 1] = torch.tensor(slots, dtype=torch.int64).view(-1, 4)
    tapped = {layer: torch.empty_like(hidden) for layer in taps if layer >= 1}
    for layer, into in tapped.items():
        table[layer - 1, TAP] = into.data_ptr()
    call(hidden.data_ptr(), normed.data_ptr(), table.data_ptr(), table.shape[0], batch, length, hidden.shape[1],
         heads, kv_heads, dim, body.inter, cos, sin, cos_rows, step.mask.data_ptr(), body.eps, body.scale,
         torch.get_num_threads(), step.threads, PARALLEL_WORK, None)  # no clock (scripts/step_breakdown.py gives one)
    return tapped
