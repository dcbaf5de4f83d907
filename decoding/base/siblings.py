"""Sibling projections (:data:`SIBLINGS`: q/k/v, gate/up) computed as one packed product of their
stacked weights, where the plan measured that faster and a probe finds it bit-identical."""
from __future__ import annotations

import functools

import torch
from torch import nn

from ...core.kept import kept
from ...core.content import FingerprintMemo, fingerprint_of
from .packed import PackedWeight, block_kind, packed_matmul, tensor_key
from .plan import PLAN, ROW_BUCKETS, packs, row_bucket, shape_key


#: Projections a module calls one after another on the same input tensor: attention's query,
#: key and value, a gated MLP's gate and up (the names of Llama, Mistral, Qwen, Gemma, ...).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
#: the dtypes whose siblings are stacked: 16-bit ones, where stacking pays; in float32 (twice the
#: bytes a weight moves) it does not
STACKED_DTYPES = (torch.bfloat16, torch.float16)


class _StackedCopies(PackedWeight):
    """The packed / blocked copies of the siblings' weights stacked along the output axis,
    remade when any sibling's weight changes; the stacked weight itself is not kept."""

    def __init__(self, members: tuple[nn.Linear, ...]):
        super().__init__()
        self.members = members

    def key(self, weight: torch.Tensor) -> tuple:
        return tuple(tensor_key(m.weight) for m in self.members)

    def fingerprint(self, weight: torch.Tensor, memo: FingerprintMemo | None = None) -> tuple[torch.Tensor, ...]:
        return tuple(fingerprint_of(m.weight, memo) for m in self.members)

    def source(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.cat([m.weight.detach() for m in self.members])


class SiblingProduct:
    """One packed product for sibling linears (:data:`SIBLINGS`) that their module calls on the
    same input: the first sibling called computes every sibling's output in one product and
    keeps the others' slices; a sibling called with that very tensor (same object, same
    version) takes its slice, once; any other input is computed afresh. Why: at the 1-16 rows
    of a verification step a small product costs mostly its call and the weight's trip through
    memory, so two products (q/k/v, gate/up) cost less than five; each output column is the same
    dot product, so the result is bit-identical in bfloat16. Taken only where the plan measured the stacked shape faster
    than the siblings one by one (:meth:`~.plan.PackingPlan.fusion_pays`)."""

    def __init__(self, members: tuple[nn.Linear, ...]):
        self.members = members
        self.widths = [m.out_features for m in members]
        first = members[0].weight
        #: a stand-in with the stacked weight's dtype, shape and device (no memory): what the plan
        #: and :func:`packed_matmul` read of a weight
        self.shape = torch.empty((), dtype=first.dtype, device=first.device).expand(sum(self.widths), first.shape[1])
        self.key = shape_key(first.dtype, sum(self.widths), first.shape[1])
        self.member_keys = tuple(shape_key(first.dtype, *m.weight.shape) for m in members)
        self.member_shapes = tuple(tuple(m.weight.shape) for m in members)
        self.copies = _StackedCopies(members)
        self._input: torch.Tensor | None = None
        self._version = -1
        self._outputs: list[torch.Tensor | None] = []

    def pays(self, rows: int) -> bool:
        kind = block_kind(self.copies, self.shape)  # every member's blocks, stacked (:mod:`.gguf_blocks`)
        return (PLAN.fusion_pays(self.key, self.member_keys, rows, kind)
                and stacking_exact(self.shape.dtype, self.member_shapes)[row_bucket(rows)])

    def bias(self) -> torch.Tensor | None:
        return None if self.members[0].bias is None else torch.cat([m.bias for m in self.members])

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling ``index``'s product with x (..., in)."""
        version = -2 if x.is_inference() else x._version  # inference tensors keep no version
        if x is not self._input or version != self._version or self._outputs[index] is None:
            stacked = packed_matmul(x, self.shape, self.copies, self.bias())
            self._outputs = list(stacked.split(self.widths, dim=-1))
            self._input, self._version = x, version
        out, self._outputs[index] = self._outputs[index], None
        if all(o is None for o in self._outputs):
            self._input = None  # every slice served: hold no tensor between forwards
        return out


@functools.lru_cache(maxsize=None)
@kept  # first asked inside the decoder's forwards, under inference mode
def stacking_exact(dtype: torch.dtype, shapes: tuple[tuple[int, int], ...]) -> tuple[bool, ...]:
    """Per row bucket: whether one product of random weights of ``shapes`` stacked equals, bit
    for bit, the products each weight takes alone here (the plan's path for its shape). Why a
    probe: in bfloat16 oneDNN accumulates every output column alike (equal: fusion changes no
    result), but float32 blocking depends on the output width, and a float32 answer must not
    change because a product was stacked. Call after the plan measured these shapes."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(*shape, generator=generator).to(dtype) for shape in shapes]
    stacked, copies = torch.cat(weights), _StackedCopies(())
    copies._copy = lambda kind, weight, make: make(stacked)  # the stacked weight is at hand here
    alone_copies = [PackedWeight() for _ in weights]
    exact = []
    with torch.no_grad():
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, shapes[0][1], generator=generator).to(dtype)
            alone = [packed_matmul(x, w, c) if packs(w, rows) else nn.functional.linear(x, w)
                     for w, c in zip(weights, alone_copies)]
            exact.append(torch.equal(packed_matmul(x, stacked, copies), torch.cat(alone, dim=-1)))
    return tuple(exact)


def sibling_groups(module: nn.Module, bound: dict | None = None) -> list[tuple[nn.Linear, ...]]:
    """Under ``module``, each set of :data:`SIBLINGS` present as plain ``nn.Linear`` children of
    one parent (bound ones, when ``bound`` — the bound layers by ``id`` — is given) with one input size, dtype (one of
    :data:`STACKED_DTYPES`) and device, all with a bias or none."""
    groups = []
    for parent in module.modules():
        for names in SIBLINGS:
            members = tuple(getattr(parent, n, None) for n in names)
            if not all(type(m) is nn.Linear and (bound is None or id(m) in bound) for m in members):
                continue
            w = members[0].weight
            if w.dtype in STACKED_DTYPES and all(m.weight.shape[1] == w.shape[1] and m.weight.dtype == w.dtype
                                                 and m.weight.device == w.device
                                                 and (m.bias is None) == (members[0].bias is None) for m in members):
                groups.append(members)
    return groups

