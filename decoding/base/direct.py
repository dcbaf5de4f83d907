"""The verification forward run directly over a Llama-form body's own modules: the same
operations in the same order as transformers' ``LlamaModel.forward``, without the call machinery
around them.

Why: at the few rows of a tree step a forward is ~13 ms of weight streaming and, on the eager
path, as much again of per-call overhead — module calls, keyword plumbing, deprecation wrappers,
the packed products' per-call path lookups (evidence: results/profile/step_breakdown). Here each
layer's products are resolved once per row count (:func:`~.binding.resolved_linears`: the plan's
path and copy for q/k/v stacked, o, gate/up stacked, down) and kept while the plan and the copies
stand; RMSNorm (with the residual add before it), the rotary embedding and the SiLU gate go
through the fused kernels of :mod:`.fused` where they are loaded and agreed with torch, else
through the modules' own code; a step's rotation, cache write and attention run as
:class:`StepAttention` (one kernel call a layer) where the cache and mask allow it, and where
every piece has a kernel the whole body runs as one library call (:mod:`.body_call`), bit for bit
the same layers.

It runs only where it computes what the base's own forward computes: a body whose every module
is one it knows (:data:`LAYERS`, checked by type), none carrying a forward hook (checked at every
forward: a hook registered at any time sends the forward back to transformers' path), not
training, attention through draftheads' grouped-query SDPA (:mod:`.attention`). Every other base,
or a base prepared with ``direct_body=False``, runs transformers' forward as before. The probe of
:func:`~.architecture.check_forwards` runs through it like every verification.
"""
from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .architecture import decoder_body
from .attention import (PACK_FLAG, additive_mask, current_ragged_rows, packed_gqa_sdpa, repeated_mask,
                        uses_packed_sdpa)
from .binding import PackedLinear, binding, callers_hook, global_hooks, resolved_linears
from .body_call import BodyTable, body_table, run_body
from .cache import reserved_layer_class
from .fused import FusedOps, KernelOps, attention_threads, fused_ops
from .key_blocks import key_runs
from .plan import PLAN

#: the module types of a body the direct forward computes exactly as transformers does, by the
#: body's class name: (decoder layer, attention, MLP, norm)
LAYERS = {"LlamaModel": ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm")}


@dataclass
class LayerPlan:
    """One decoder layer's modules and its products resolved for a row count (each product a
    function of x (rows, in))."""

    attn: nn.Module
    mlp: nn.Module
    post_norm: nn.Module
    head_dim: int
    layer_idx: int
    qkv: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    o: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    gate_up: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    down: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


class DirectBody:
    """What the direct forward keeps for one base: its layers as they were when it was made (a
    module replaced anywhere in the body since is seen by :meth:`intact`), the hook tables it
    checks at each forward, the rotary function of its modeling module, the fused ops, and the
    layer plans per row count with the stamp (the plan's and the binding's generations) they
    were made under."""

    def __init__(self, model, ops: FusedOps, attention: str = "kernel", one_call: bool = True):
        body = decoder_body(model)
        #: how a step attends (:data:`ATTENTION_WAYS`)
        self.attention = attention
        #: whether a step whose pieces all have kernels runs its body in one call (:mod:`.body_call`)
        self.one_call = one_call
        self.body = body
        self.layers = list(body.layers[: model.config.num_hidden_layers])
        #: the norm each layer's output meets next: the following layer's input norm, the final norm last
        self.next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [body.norm]
        modules = list(body.modules())
        self._children = [(m._modules, tuple(m._modules.values())) for m in modules if m._modules]
        self._hooks = [table for m in modules for table in (m._forward_hooks, m._forward_pre_hooks)]
        self._modules = modules
        self.rotary = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.ops = ops
        self.plans: dict[int, list[LayerPlan]] = {}
        self.tables: dict[int, BodyTable | None] = {}
        self.stamp: tuple = ()

    def plan(self, rows: int) -> list[LayerPlan]:
        found = binding(self.body)
        stamp = (PLAN.generation, found.generation if found is not None else -1)
        if stamp != self.stamp:
            self.plans, self.tables, self.stamp = {}, {}, stamp
        plans = self.plans.get(rows)
        if plans is None:
            plans = self.plans[rows] = [_layer_plan(layer, rows) for layer in self.layers]
        return plans

    def table(self, rows: int) -> BodyTable | None:
        """The one call's table for ``rows`` (:func:`~.body_call.body_table`), or None: layer by layer."""
        plans = self.plan(rows)
        if rows not in self.tables:
            self.tables[rows] = body_table(self, plans) if self.one_call else None
        return self.tables[rows]

    def intact(self) -> bool:
        """Whether every module of the body is still the one it was made with."""
        return all(tuple(children.values()) == kept for children, kept in self._children)

    def hooked(self) -> bool:
        """Whether any module of the body, or the process, carries a caller's forward hook now
        (transformers' own output-capturing hooks, installed on first ``output_hidden_states``, are
        not: the direct forward never runs those modules' forwards)."""
        if global_hooks():
            return True
        if not any(self._hooks):  # no hook table holds anything: the common case, one C-level pass
            return False
        return any((m._forward_hooks or m._forward_pre_hooks) and callers_hook(m) for m in self._modules)


def _layer_plan(layer: nn.Module, rows: int) -> LayerPlan:
    attn, mlp = layer.self_attn, layer.mlp
    return LayerPlan(attn, mlp, layer.post_attention_layernorm, attn.head_dim, attn.layer_idx,
                     resolved_linears((attn.q_proj, attn.k_proj, attn.v_proj), rows),
                     resolved_linears((attn.o_proj,), rows), resolved_linears((mlp.gate_proj, mlp.up_proj), rows),
                     resolved_linears((mlp.down_proj,), rows))


_BODIES: "weakref.WeakKeyDictionary[nn.Module, DirectBody]" = weakref.WeakKeyDictionary()


def direct_body_reason(model) -> str | None:
    """Why the direct forward cannot run ``model`` (None: it can)."""
    body = decoder_body(model)
    kinds = LAYERS.get(type(body).__name__)
    if kinds is None:
        return f"its body ({type(body).__name__}) is not one the direct forward knows ({', '.join(LAYERS)})"
    if not uses_packed_sdpa(model):
        return "it does not attend through draftheads' grouped-query SDPA"
    if not getattr(model.config, "is_causal", True) or getattr(model, "use_kernels", False):
        return "it is not causal, or runs hub kernels"
    layer_kind, attention_kind, mlp_kind, norm_kind = kinds
    dtype = next(body.parameters()).dtype
    for layer in body.layers[: model.config.num_hidden_layers]:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (type(layer).__name__ != layer_kind or type(attn).__name__ != attention_kind
                or type(mlp).__name__ != mlp_kind
                or any(type(n).__name__ != norm_kind for n in (layer.input_layernorm, layer.post_attention_layernorm))):
            return f"a layer is not the {layer_kind} it knows"
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(m) not in (nn.Linear, PackedLinear) or m.weight.dtype != dtype for m in linears):
            return "a projection is not a plain nn.Linear of the body's dtype (an adapter or quantized layer)"
    if type(body.norm).__name__ != norm_kind:
        return "its final norm is not the one it knows"
    return None


#: how the direct forward attends: ``kernel`` — :class:`StepAttention` with the attention kernel
#: where the ops have one (the default); ``sdpa`` — :class:`StepAttention` with SDPA; ``general`` —
#: the cache's update and :func:`~.attention.packed_gqa_sdpa` (the last two for comparisons)
ATTENTION_WAYS = ("kernel", "sdpa", "general")


def use_direct_body(model, ops: FusedOps | None = None, attention: str = "kernel", one_call: bool = True) -> bool:
    """Let :func:`~.forward.verify` run ``model``'s tree steps through the direct forward where
    :func:`direct_body_reason` finds nothing against it; returns whether it will. ``ops``: the
    elementwise steps (default :func:`~.fused.fused_ops`: the kernels where they agree here);
    ``attention``: one of :data:`ATTENTION_WAYS`; ``one_call``: a step whose pieces all have kernels
    runs its whole body in one library call (:mod:`.body_call`; False: layer by layer, for comparisons)."""
    if attention not in ATTENTION_WAYS:
        raise ValueError(f"attention={attention!r}: one of {', '.join(ATTENTION_WAYS)}")
    found = _BODIES.get(model)
    if found is not None and ops is None and (found.attention, found.one_call) == (attention, one_call):
        return True
    if direct_body_reason(model) is not None:
        return False
    _BODIES[model] = DirectBody(model, ops if ops is not None else fused_ops(), attention, one_call)
    return True


def direct_body_report(model) -> str:
    """``draftheads env --base``: whether tree steps run directly, with which elementwise steps, or why not."""
    found = _BODIES.get(model)
    if found is not None:
        return "on, elementwise steps " + ("fused (compiled kernels)" if isinstance(found.ops, KernelOps)
                                           else "through the modules' own code")
    reason = direct_body_reason(model)
    return f"off ({reason})" if reason else "off (direct_body=False)"


def uses_direct_body(model) -> bool:
    """Whether ``model`` was prepared for the direct forward (what a step's measured cost depends on)."""
    return model in _BODIES


def release_direct_body(model) -> None:
    _BODIES.pop(model, None)


def direct_body(model) -> DirectBody | None:
    """The direct forward's state for ``model`` when it may run now (prepared, no hook, not
    training, every module one it knows: a module replaced since — an adapter injected, a layer
    swapped — is checked again, and the forward made anew or left to transformers), else None."""
    found = _BODIES.get(model)
    if found is None or found.body.training or found.hooked() or not uses_packed_sdpa(model):
        return None
    if not found.intact():
        if direct_body_reason(model) is not None:
            return None
        found = _BODIES[model] = DirectBody(model, found.ops, found.attention, found.one_call)
    return found


class StepAttention:
    """A step's attention as the direct forward runs it where it can (:func:`plan_step_attention`):
    per layer one library call (:meth:`~.fused.FusedOps.step_call`, else two) rotates q and k,
    writes k and v into the cache's reserved buffers (:meth:`~.fused.KernelOps.rope_store`:
    bit-identical to the rotary kernel and the cache's update) and attends every query row to the
    keys its mask lets it see (:meth:`~.fused.KernelOps.tree_attention`: float32 sums, as close to
    float64 attention as SDPA's own result in the dtype); where the ops have no attention kernel
    for the dtype and head size, SDPA attends over the grouped query heads folded into rows as
    :func:`~.attention.packed_gqa_sdpa` runs it (the mask's repetition, additive form and key runs
    made once per forward: bit-identical to it).
    Why: at a few query rows the general path's cache update, rotation and attention dispatch
    and SDPA's own per-call cost are most of a layer's non-product time: a bs-1 step's rest of the
    verification read 8.3 ms and its attention 1.5 ms that way, 5.1 ms and 1.1 ms (rotation and
    cache write included) this way (AVX2 float32; evidence: results/profile/step_breakdown/avx2_native)."""

    def __init__(self, layers: list, mask: torch.Tensor, shape: tuple[int, int, int], heads: tuple[int, int],
                 kernel: bool, call=None, rotary_rows: tuple = ()):
        self.layers, self.shape, self.heads, self.kernel = layers, shape, heads, kernel
        self.call = None
        if kernel:
            self.mask = mask[:, 0].contiguous()  # (B, N, T + N)
            batch, length, dim = shape
            if call is not None:  # the library function and the arguments every layer shares
                self.call = call
                self.fixed = (batch, length, heads[0], heads[1], dim, *rotary_rows)
                self.threads = attention_threads(batch, heads[0], length, mask.shape[-1], dim)
            return
        dtype = layers[0].keys.dtype
        repeated = repeated_mask(mask, heads[0] // heads[1])
        runs = key_runs(mask)
        self.runs = (((0, shape[0], 0, additive_mask(repeated, dtype)),) if runs is None else
                     tuple((a, b, s, additive_mask(repeated[a:b, :, :, s:], dtype)) for a, b, s in runs))

    def attend(self, ops: FusedOps, rotary: Callable, plan: LayerPlan, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q (rows, H·D), k and v (rows, H_kv·D) → the attention's output (rows, H·D), the layer's
        cache grown by the step's slots."""
        batch, length, dim = self.shape
        heads, kv_heads = self.heads
        layer = self.layers[plan.layer_idx]
        key, value, start = layer.reserve(length)
        if self.call is not None and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k.stride(0) == v.stride(0):
            out = q.new_empty(batch * length, heads * dim)
            self.call(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), *self.fixed, key.data_ptr(),
                      value.data_ptr(), key.shape[2], start, self.mask.data_ptr(), out.data_ptr(), plan.attn.scaling,
                      self.threads)
            return out
        query = q.new_empty(batch, heads, length, dim)
        ops.rope_store(rotary, q, k, v, cos, sin, self.shape, query, key, value, start)
        if self.kernel:
            return ops.tree_attention(query, key, value, start + length, self.mask, plan.attn.scaling)
        packed = query.view(batch, kv_heads, heads // kv_heads * length, dim)  # query heads of a group as rows
        keys, values = layer.keys, layer.values
        outs = [F.scaled_dot_product_attention(packed[a:b], keys[a:b, :, s:], values[a:b, :, s:], attn_mask=mask,
                                               dropout_p=0.0, scale=plan.attn.scaling)
                for a, b, s, mask in self.runs]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.view(batch, heads, length, dim).transpose(1, 2).reshape(batch * length, heads * dim)


def plan_step_attention(state: DirectBody, cache, mask, shape: tuple[int, int, int], dtype: torch.dtype,
                        cos: torch.Tensor, sin: torch.Tensor) -> StepAttention | None:
    """:class:`StepAttention` for this forward where it computes what the general path does: the
    kernels loaded and agreeing (:class:`~.fused.KernelOps`), not a packed ragged step, more than
    one slot a row unless the attention kernel runs it, grouped heads, one boolean mask (B, 1, N,
    T + N), and every cache layer the decoder's reserved one, already holding keys of the dtype for
    these rows; else None."""
    from transformers.cache_utils import Cache

    attn = state.layers[0].self_attn
    kv_heads = attn.config.num_key_value_heads
    heads = attn.config.num_attention_heads
    batch, length, _ = shape
    layers = getattr(cache, "layers", None)
    kernel = state.attention == "kernel" and isinstance(state.ops, KernelOps) and state.ops.attends(dtype, shape[2])
    if (state.attention == "general" or not isinstance(state.ops, KernelOps) or current_ragged_rows() is not None
            or (length < 2 and not kernel)  # one slot a row: SDPA's general path (the kernel takes any)
            or heads == kv_heads or getattr(attn, "num_key_value_groups", 1) != heads // kv_heads
            or not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4
            or mask.shape[:3] != (batch, 1, length) or getattr(cache, "offloading", False)
            or type(cache).update is not Cache.update or layers is None or len(layers) < len(state.layers)):
        return None
    reserved = reserved_layer_class()
    for layer in layers[: len(state.layers)]:
        keys = getattr(layer, "keys", None)
        if (type(layer) is not reserved or not layer.is_initialized or not isinstance(keys, torch.Tensor)
                or keys.dim() != 4 or keys.shape[0] != batch or keys.dtype != dtype
                or keys.shape[-2] + length != mask.shape[-1]):
            return None
    call = state.ops.step_call(cos, sin, shape, dtype) if kernel else None
    return StepAttention(layers, mask, shape, (heads, kv_heads), kernel, call,
                         (cos.data_ptr(), sin.data_ptr(), cos.shape[0] * cos.shape[1]))


def direct_forward(state: DirectBody, input_ids: torch.Tensor, mask, position_ids: torch.Tensor,
                   cache, taps: Sequence[int] = ()) -> torch.Tensor:
    """input_ids (B, N) → the body's last hidden states (B, N, d), as ``LlamaModel.forward``
    computes them with ``mask`` (4D, as given) and ``cache``; inside the decoder's forward context
    (packed linears and attention, ragged rows where the step is packed). With ``taps``: the
    features of :func:`~.forward.with_taps` (B, N, d · (1 + len(taps))), each tapped layer's
    residual stream copied as it passes (the kernels update it in place)."""
    body, ops = state.body, state.ops
    hidden = body.embed_tokens(input_ids)  # (B, N, d)
    batch, length, width = hidden.shape
    rows = batch * length
    cos, sin = body.rotary_emb(hidden, position_ids)  # (B or 1, N, head_dim)
    hidden = hidden.reshape(rows, width)
    attention_kwargs = {"position_ids": position_ids, "use_cache": True, PACK_FLAG: True}
    tapped = {0: hidden.clone()} if 0 in taps else {}
    normed = ops.rms_norm(hidden, state.layers[0].input_layernorm)
    shape = (batch, length, state.layers[0].self_attn.head_dim)
    step = plan_step_attention(state, cache, mask, shape, hidden.dtype, cos, sin)
    table = state.table(rows) if step is not None and step.call is not None else None
    if table is not None and normed.is_contiguous() and normed.dtype == hidden.dtype:
        tapped |= run_body(ops.body_call(hidden.dtype), table, step, step.layers[:len(state.layers)], hidden, normed,
                           taps)
        return _states(normed, tapped, taps, (batch, length, width))
    for plan, following in zip(state.plan(rows), state.next_norms):
        attn = plan.attn
        q, k, v = plan.qkv(normed)  # (rows, H·D), (rows, H_kv·D) ×2
        if step is not None:
            out = step.attend(ops, state.rotary, plan, q, k, v, cos, sin)
        else:
            q, k = ops.rotary(state.rotary, q, k, cos, sin, shape)  # (B, H, N, D), (B, H_kv, N, D)
            v = v.reshape(batch, length, -1, plan.head_dim).transpose(1, 2)
            k, v = cache.update(k, v, plan.layer_idx)
            out, _ = packed_gqa_sdpa(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, **attention_kwargs)
            out = out.reshape(rows, -1).contiguous()
        (out,) = plan.o(out)
        hidden, normed = ops.add_rms_norm(hidden, out, plan.post_norm)
        gate, up = plan.gate_up(normed)
        (out,) = plan.down(ops.gated(plan.mlp, gate, up))
        hidden, normed = ops.add_rms_norm(hidden, out, following)
        if plan.layer_idx + 1 in taps:  # the residual stream after layer_idx + 1 layers
            tapped[plan.layer_idx + 1] = hidden.clone()
    return _states(normed, tapped, taps, (batch, length, width))


def _states(normed: torch.Tensor, tapped: dict[int, torch.Tensor], taps: Sequence[int],
            shape: tuple[int, int, int]) -> torch.Tensor:
    """The final norm's output (rows, d) with the tapped layers' residual streams after it → (B, N,
    d · (1 + len(taps)))."""
    batch, length, width = shape
    if not taps:
        return normed.reshape(batch, length, width)
    return torch.cat([normed, *(tapped[layer] for layer in taps)], dim=-1).reshape(batch, length, -1)

