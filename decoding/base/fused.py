"""The elementwise steps of a Llama-form layer as the direct forward (:mod:`.direct`) runs them:
the residual add with the RMSNorm after it, the rotary embedding, the SiLU gate — and a tree
step's rotation with its cache write (:meth:`FusedOps.rope_store`) and its attention
(:meth:`FusedOps.tree_attention`, a kernel only: float32 sums, checked against float64 attention
within :data:`ATTENTION_AGREEMENT`, as close as SDPA's own result lands).

Why fused: on the eager path RMSNorm is 8 tensor operations and the rotary embedding 10, and at a
tree step's 5–20 rows an operation costs its call, not its arithmetic (RMSNorm ~80 µs of a 2-core
step, 61 of them a forward; evidence: results/profile/step_breakdown). :class:`KernelOps` runs each
as one call of the compiled library (``fewrow.c``; its rows shared among torch's threads when there
are many), computing what transformers' modules compute step by step in the same dtype (every
intermediate torch rounds to bf16 rounded alike). Only RMSNorm's sum of squares may land one
rounding away (another summation order) — the few-row kernel's products already differ that much
from ``F.linear``, which the guarantee allows (bfloat16: a first divergence within the dtype's
rounding; float32: identical or a first divergence at a near-tie). The SiLU gate (silu(g)·u, one
call) computes exp with its own polynomial, as torch's vectorized one has its own: it lands within
a rounding of torch's two operations. Each kernel is checked against the modules' own code on
random rows before first use (:func:`kernel_ops`): the rotary embedding and the residual add bit
for bit, the norm and the gate within one rounding of the dtype; one that disagrees, a missing
library or another dtype leaves :class:`FusedOps` — the modules' own code, bit-identical to the
base's forward — in its place.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from .fewrow import PARALLEL_WORK, kernel

#: the dtypes the kernels compute
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
#: the longest head the rotary kernel takes (its scratch row)
MAX_HEAD_DIM = 1024


class FusedOps:
    """Each step through the base's own modules and functions (bit-identical to its forward)."""

    def rms_norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """x (rows, d) → norm(x)."""
        return norm.forward(x)

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add then the next norm: (hidden + delta, norm(hidden + delta)); ``hidden``
        may be updated in place (the direct forward's own tensor)."""
        hidden = hidden + delta
        return hidden, norm.forward(hidden)

    def rotary(self, rotary: Callable, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """q (rows, H·D), k (rows, H_kv·D), the positions' cos/sin (B or 1, N, D), shape (B, N, D)
        → q (B, H, N, D), k (B, H_kv, N, D) rotated as the modeling module's ``rotary``."""
        return rotary(_heads(q, shape), _heads(k, shape), cos, sin)

    def gated(self, mlp: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) · up, the gated MLP's input to its down projection."""
        return mlp.act_fn(gate) * up

    def body_call(self, dtype: torch.dtype):
        """The library function that runs a step's whole body for ``dtype`` (:mod:`.body_call`), or None."""
        return None

    def step_call(self, cos: torch.Tensor, sin: torch.Tensor, shape: tuple[int, int, int], dtype: torch.dtype):
        """:meth:`rope_store` then :meth:`tree_attention` as one library function for a forward's
        cos/sin (B or 1, N, D), shape (B, N, D) and dtype, or None (the two methods then)."""
        return None

    def attends(self, dtype: torch.dtype, dim: int) -> bool:
        """Whether :meth:`tree_attention` computes a step's attention for this dtype and head size
        (else the caller runs SDPA)."""
        return False

    def tree_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, length: int,
                       mask: torch.Tensor, scale: float) -> torch.Tensor:
        """query (B, H, N, D), the cache's buffers key/value (B, H_kv, capacity, D) read up to
        ``length``, mask (B, N, length) bool → softmax(q·kᵀ·scale)·v per query row (B·N, H·D), query
        head h reading kv head h // (H / H_kv); only where :meth:`attends`."""
        raise NotImplementedError("FusedOps has no attention kernel: check attends() first")

    def rope_store(self, rotary: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, shape: tuple[int, int, int], q_out: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, start: int) -> None:
        """:meth:`rotary` and the cache's update in one: q (rows, H·D), k and v (rows, H_kv·D) →
        q rotated into q_out (B, H, N, D), k rotated and v into the cache's buffers key/value
        (B, H_kv, capacity, D) at slots start … start + N − 1 (shape (B, N, D)); q, k and v are left
        as they were."""
        q, k = self.rotary(rotary, q.clone(), k.clone(), cos, sin, shape)
        length = shape[1]
        q_out.copy_(q)
        key[:, :, start:start + length].copy_(k)
        value[:, :, start:start + length].copy_(_heads(v, shape))


def _heads(x: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """(rows, H·D) → (B, H, N, D), the view transformers' attention takes."""
    batch, length, dim = shape
    return x.reshape(batch, length, -1, dim).transpose(1, 2)


class KernelOps(FusedOps):
    """The steps through the compiled library's kernels (checked by :func:`kernel_ops`), for
    tensors of :data:`KERNEL_DTYPES`; anything else goes to :class:`FusedOps`."""

    def __init__(self, lib):
        self.lib = lib

    def _call(self, name: str, dtype: torch.dtype):
        return getattr(self.lib, f"draftheads_{name}{'_bf16' if dtype == torch.bfloat16 else ''}")

    def rms_norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        if not _fits(x, norm.weight):
            return super().rms_norm(x, norm)
        return self._norm(x, None, norm)

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        if not (_fits(hidden, norm.weight) and delta.dtype == hidden.dtype and delta.is_contiguous()
                and delta.shape == hidden.shape):
            return super().add_rms_norm(hidden, delta, norm)
        return hidden, self._norm(hidden, delta, norm)

    def _norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module) -> torch.Tensor:
        """The kernel: ``hidden`` += ``delta`` in place (when given), the norm of it returned."""
        out = torch.empty_like(hidden)
        self._call("add_rms_norm", hidden.dtype)(hidden.data_ptr(), None if delta is None else delta.data_ptr(),
                                                 norm.weight.data_ptr(), out.data_ptr(), hidden.shape[0],
                                                 hidden.shape[1], norm.variance_epsilon)
        return out

    def rotary(self, rotary: Callable, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, dim = shape
        if not _rotates(q, k, cos, sin, shape):
            return super().rotary(rotary, q, k, cos, sin, shape)
        call = self._call("rope", q.dtype)
        for x in (q, k):
            call(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1] // dim, dim, cos.data_ptr(), sin.data_ptr(),
                 cos.shape[0] * cos.shape[1])
        return _heads(q, shape), _heads(k, shape)

    def rope_store(self, rotary: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, shape: tuple[int, int, int], q_out: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, start: int) -> None:
        batch, length, dim = shape
        if not (_rotates(q, k, cos, sin, shape) and v.dtype == q.dtype and v.stride(-1) == 1
                and k.stride(0) == v.stride(0) and k.shape == v.shape and q_out.is_contiguous()
                and q_out.shape == (batch, q.shape[1] // dim, length, dim) and q_out.dtype == q.dtype
                and key.is_contiguous() and value.is_contiguous() and key.shape == value.shape
                and key.shape[:2] == (batch, k.shape[1] // dim) and key.shape[3] == dim
                and key.dtype == value.dtype == q.dtype and 0 <= start <= key.shape[2] - length):
            return super().rope_store(rotary, q, k, v, cos, sin, shape, q_out, key, value, start)
        self._call("rope_store", q.dtype)(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), batch,
                                          length, q.shape[1] // dim, k.shape[1] // dim, dim, cos.data_ptr(),
                                          sin.data_ptr(), cos.shape[0] * cos.shape[1], q_out.data_ptr(),
                                          key.data_ptr(), value.data_ptr(), key.shape[2], start)

    def gated(self, mlp: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not (is_silu(mlp.act_fn) and gate.dtype in KERNEL_DTYPES and up.dtype == gate.dtype
                and gate.dim() == 2 and gate.shape == up.shape and gate.stride(-1) == up.stride(-1) == 1
                and gate.stride(0) == up.stride(0)):
            return super().gated(mlp, gate, up)
        out = gate.new_empty(gate.shape)
        self._call("silu_mul", gate.dtype)(gate.data_ptr(), up.data_ptr(), gate.stride(0), out.data_ptr(),
                                           gate.shape[0], gate.shape[1])
        return out

    def body_call(self, dtype: torch.dtype):
        return self._call("body", dtype) if dtype in KERNEL_DTYPES else None

    def attends(self, dtype: torch.dtype, dim: int) -> bool:
        return dtype in KERNEL_DTYPES and dim % 8 == 0 and dim <= MAX_HEAD_DIM

    def step_call(self, cos: torch.Tensor, sin: torch.Tensor, shape: tuple[int, int, int], dtype: torch.dtype):
        if not (self.attends(dtype, shape[2]) and _rotary_rows(cos, sin, shape, dtype)):
            return None
        return self._call("step_attention", dtype)

    def tree_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, length: int,
                       mask: torch.Tensor, scale: float) -> torch.Tensor:
        batch, heads, count, dim = query.shape
        if not (self.attends(query.dtype, dim) and query.is_contiguous() and key.is_contiguous()
                and value.is_contiguous() and key.shape == value.shape and key.dtype == value.dtype == query.dtype
                and key.shape[0] == batch and heads % key.shape[1] == 0 and key.shape[3] == dim
                and length <= key.shape[2] and mask.dtype == torch.bool and mask.is_contiguous()
                and mask.shape == (batch, count, length)):
            raise ValueError("tree_attention: shapes, dtypes or layouts it does not take")
        out = query.new_empty(batch * count, heads * dim)
        self._call("tree_attention", query.dtype)(query.data_ptr(), key.data_ptr(), value.data_ptr(), mask.data_ptr(),
                                                  out.data_ptr(), batch, count, heads, key.shape[1], dim, key.shape[2],
                                                  length, scale, attention_threads(batch, heads, count, length, dim))
        return out


def is_silu(act: nn.Module) -> bool:
    """Whether a gated MLP's activation is exactly ``F.silu`` (torch's module or transformers' own,
    whose forward is ``F.silu``; a subclass may compute anything): what the gate kernel computes."""
    return type(act) is nn.SiLU or (type(act).__name__ == "SiLUActivation"
                                    and type(act).__module__ == "transformers.activations")


def attention_threads(batch: int, heads: int, count: int, length: int, dim: int) -> int:
    """The threads the attention kernel shares (batch · heads) pairs among: torch's count once the
    step's query rows × keys × head size pay for waking the others, else one."""
    return torch.get_num_threads() if batch * heads * count * length * dim >= PARALLEL_WORK else 1


def _rotates(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             shape: tuple[int, int, int]) -> bool:
    """Whether the rotary kernels take these q (rows, H·D), k (rows, H_kv·D) and cos/sin."""
    batch, length, dim = shape
    return (q.dtype in KERNEL_DTYPES and k.dtype == q.dtype and dim <= MAX_HEAD_DIM
            and _rotary_rows(cos, sin, shape, q.dtype)
            and all(t.stride(-1) == 1 for t in (q, k)) and q.shape[0] == k.shape[0] == batch * length)


def _rotary_rows(cos: torch.Tensor, sin: torch.Tensor, shape: tuple[int, int, int], dtype: torch.dtype) -> bool:
    """Whether the kernels read cos/sin (B or 1, N, D) of ``dtype`` as rows (cos_rows, D) for shape (B, N, D)."""
    batch, length, dim = shape
    return (cos.dtype == sin.dtype == dtype and cos.is_contiguous() and sin.is_contiguous() and cos.shape[-1] == dim
            and cos.shape[0] in (1, batch) and cos.shape[1] == length and sin.shape == cos.shape)


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype and x.dim() == 2 and x.is_contiguous()
            and weight.is_contiguous() and weight.shape == x.shape[1:])


def fused_ops() -> FusedOps:
    """The kernels where the library is loaded and each agrees with the modules' own code here
    (:func:`kernel_ops`), else the modules' own code."""
    return kernel_ops() or FusedOps()


@functools.lru_cache(maxsize=None)
def _agreeing_kernels(lib) -> bool:
    return all(_agrees(KernelOps(lib), dtype) for dtype in KERNEL_DTYPES)


def kernel_ops() -> KernelOps | None:
    """:class:`KernelOps` over the loaded library when its kernels agree with the modules' own
    code on random rows in every dtype (None: not loaded, or one disagreed)."""
    lib = kernel()
    if lib is None or not _agreeing_kernels(lib):
        return None
    return KernelOps(lib)


def _agrees(ops: KernelOps, dtype: torch.dtype) -> bool:
    """Each kernel against :class:`FusedOps` on a small random Llama-form layer's shapes."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(0)
    reference = FusedOps()
    rows, width, dim, heads, kv_heads = 7, 64, 16, 4, 2

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    norm = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(rand(width))
    hidden, delta = rand(rows, width), rand(rows, width)
    ours_h, ours = ops.add_rms_norm(hidden.clone(), delta, norm)
    theirs_h, theirs = reference.add_rms_norm(hidden.clone(), delta, norm)
    one_rounding = {"rtol": 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5, "atol": 1e-5}
    if not (torch.equal(ours_h, theirs_h) and torch.allclose(ours.float(), theirs.float(), **one_rounding)):
        return False
    if not torch.allclose(ops.rms_norm(hidden, norm).float(), reference.rms_norm(hidden, norm).float(), **one_rounding):
        return False
    qkv = rand(rows, (heads + 2 * kv_heads) * dim)
    cos, sin = rand(1, rows, dim), rand(1, rows, dim)
    shape = (1, rows, dim)
    theirs = reference.rotary(apply_rotary_pos_emb, qkv[:, :heads * dim].clone(),
                              qkv[:, heads * dim:(heads + kv_heads) * dim].clone(), cos, sin, shape)
    stacked = qkv.clone()
    ours = ops.rotary(apply_rotary_pos_emb, *stacked.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)[:2],
                      cos, sin, shape)
    if not all(torch.equal(a, b) for a, b in zip(ours, theirs)):
        return False
    mlp = nn.Module()
    mlp.act_fn = nn.SiLU()
    gate_up = rand(rows + 3, 2 * width + 5) * 4  # a row of 2·width + 5: gate and up strided, a partial 8
    gate, up = gate_up[:, :width + 2], gate_up[:, width + 2:-1]
    if not torch.allclose(ops.gated(mlp, gate, up).float(), reference.gated(mlp, gate, up).float(), **one_rounding):
        return False
    return (_stores_alike(ops, reference, qkv, cos, sin, (heads, kv_heads, dim), dtype)
            and _attends_alike(ops, dtype, generator))


def sdpa_tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, length: int,
                        mask: torch.Tensor, scale: float) -> torch.Tensor:
    """What :meth:`KernelOps.tree_attention` computes, through SDPA with the keys repeated for the
    grouped heads: (B·N, H·D)."""
    batch, heads, count, dim = query.shape
    group = heads // key.shape[1]
    keys = key[:, :, :length].repeat_interleave(group, dim=1)
    values = value[:, :, :length].repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2).reshape(batch * count, heads * dim)


#: how far the attention kernel may land from the float64 attention of the same inputs: float32
#: sums (in another order than SDPA's, with another exp); for bfloat16 the output's rounding and
#: more (SDPA's own bf16 result lands as far: it rounds the probabilities to bf16 before their
#: product with the values)
ATTENTION_AGREEMENT = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
                       torch.bfloat16: {"rtol": 2.0 ** -7, "atol": 2.0 ** -6}}


def _attends_alike(ops: KernelOps, dtype: torch.dtype, generator: torch.Generator) -> bool:
    """:meth:`KernelOps.tree_attention` against :func:`sdpa_tree_attention` in float64 on random
    grouped heads, a cache with room past its length and a tree's mask (every row sees itself)."""
    batch, heads, kv_heads, count, dim, length = 2, 4, 2, 5, 16, 21
    query = torch.randn(batch, heads, count, dim, generator=generator).to(dtype)
    key, value = (torch.randn(batch, kv_heads, length + 3, dim, generator=generator).to(dtype) for _ in range(2))
    mask = torch.rand(batch, count, length, generator=generator) > 0.4
    mask[:, :, -count:] |= torch.eye(count, dtype=torch.bool)
    ours = ops.tree_attention(query, key, value, length, mask, 0.25).double()
    theirs = sdpa_tree_attention(query.double(), key.double(), value.double(), length, mask, 0.25)
    return torch.allclose(ours, theirs, **ATTENTION_AGREEMENT[dtype])


def _stores_alike(ops: KernelOps, reference: FusedOps, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  heads: tuple[int, int, int], dtype: torch.dtype) -> bool:
    """:meth:`KernelOps.rope_store` against :class:`FusedOps`' over one stacked product's columns
    (rows = 1 × N) into a cache with two slots taken: bit for bit, the slots around untouched."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    query_heads, kv_heads, dim = heads
    rows = qkv.shape[0]
    q, k, v = qkv.split([query_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    outs = []
    for fused in (ops, reference):
        q_out = torch.zeros(1, query_heads, rows, dim, dtype=dtype)
        key, value = torch.zeros(2, 1, kv_heads, rows + 5, dim, dtype=dtype).unbind(0)
        fused.rope_store(apply_rotary_pos_emb, q, k, v, cos, sin, (1, rows, dim), q_out, key, value, 2)
        outs.append((q_out, key, value))
    return all(torch.equal(a, b) for a, b in zip(*outs))
