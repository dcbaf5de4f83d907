"""The forwards the decoder runs on the base: the prompt (:func:`prefill`, :func:`forward_all`),
a tree step over every row's slots (:func:`verify`) and the LM head (:func:`lm_logits`), each
inside the base's packed context (:func:`~.packing.forward_context`).

Everything goes through transformers' public API (4D attention masks, ``position_ids``,
``Cache``); no modeling file is copied or patched.
"""
from __future__ import annotations

import functools
import inspect
from typing import Sequence

import torch

from .architecture import additive_mask, apply_logit_transforms, attention_layout, decoder_body, layer_masks
from .attention import PACK_FLAG, RaggedRows, ragged_rows, uses_packed_sdpa
from .binding import callers_hook, global_hooks, stands_in
from .cache import reserved_cache, reserved_layer_class
from .direct import direct_body, direct_forward
from .mask_memo import mask_memos
from .packed import block_kind, packed_matmul
from .packing import forward_context, packed_lm_head
from .plan import packs
from .rows import subset_product


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, all_states: bool = False,
            taps: Sequence[int] = ()):
    """Run the prompt; returns (cache, last hidden state per row (B, d)), or with ``all_states``
    every prompt position's (B, T, d) (for heads whose layer reads the prompt); with ``taps`` the
    states are features (:func:`with_taps`). Positions follow transformers' ``generate``
    (cumulative sum of the mask), so left padding matches it."""
    cache, hidden = forward_all(model, input_ids, attention_mask, taps)
    return cache, hidden if all_states else hidden[:, -1]


def with_taps(final: torch.Tensor, layers: Sequence[torch.Tensor] | None, taps: Sequence[int]) -> torch.Tensor:
    """The base's final states (..., d) and, for ``taps`` (layers numbered as transformers'
    ``output_hidden_states``: the residual stream after that many decoder layers), those layers'
    states → the features draft heads read (..., d · (1 + len(taps))), the final state first
    (:mod:`draftheads.heads.fusion`); no taps: the final states themselves."""
    return final if not taps else torch.cat([final, tapped_layers(layers, taps)], dim=-1)


def tapped_layers(layers: Sequence[torch.Tensor], taps: Sequence[int]) -> torch.Tensor | None:
    """The states of ``taps`` out of a body's ``output_hidden_states`` (index i: the residual stream
    after i decoder layers, 0 the embeddings), side by side (..., n · d) in the order named; None for none."""
    return torch.cat([layers[layer] for layer in taps], dim=-1) if taps else None


def final_states(features: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """The base's final states (..., d) out of :func:`with_taps`' features (contiguous, for its LM head)."""
    return features if features.shape[-1] == hidden_size else features[..., :hidden_size].contiguous()


def hook_site(model) -> str | None:
    """Where a caller's forward hook or pre-hook would see other calls in draftheads' forwards
    than in the model's own token-by-token loop (None: nowhere), as a phrase naming it: one
    registered for every module of the process, one on the model object itself (whose forward
    draftheads never runs) or on any module of it — body, LM head, embeddings — by its qualified
    name (``model.layers.3.mlp``). transformers' own output-capturing hooks are not a caller's.
    Read at every call: one walk over the modules' hook tables (~0.1 ms for a 30-layer model)."""
    if global_hooks():
        return "a forward hook or pre-hook registered for every module (register_module_forward_hook / _pre_hook)"
    if not _any_callers_hook(model):
        return None
    if callers_hook(model):
        return f"a forward hook or pre-hook on the model itself ({type(model).__name__})"
    name = next(name for name, module in model.named_modules() if callers_hook(module))
    return f"a forward hook or pre-hook on {name}"


def _any_callers_hook(model) -> bool:
    """Whether any module under ``model`` (itself included) carries a caller's hook: a plain walk
    over ``_modules`` (``modules()`` costs four times more: its prefixes and memo)."""
    stack = [model]
    while stack:
        module = stack.pop()
        if module is None:  # a child registered as None
            continue
        if (module._forward_hooks or module._forward_pre_hooks) and callers_hook(module):
            return True
        stack.extend(module._modules.values())
    return False


@torch.no_grad()
def forward_all(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, taps: Sequence[int] = ()):
    """The base over whole sequences into a fresh cache: (cache, hidden states (B, T, d), or with
    ``taps`` the features of :func:`with_taps`), positions as transformers' ``generate`` numbers
    them (cumulative sum of the mask)."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    cache = reserved_cache(model.config)
    if packs_prompts(model, attention_mask):
        return cache, _forward_packed(model, input_ids, attention_mask.bool(), position_ids, cache, taps)
    with forward_context(model), mask_memos():
        out = decoder_body(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=True, **cache_kwargs(model, cache), **_pack_kwargs(model),
                                  **_tap_kwargs(taps))
    return cache, with_taps(out.last_hidden_state, out.hidden_states, taps)


def packs_prompts(model, attention_mask: torch.Tensor) -> bool:
    """Whether :func:`forward_all` runs only the batch's real tokens (:func:`_forward_packed`):
    padding in a batch the base attends to through :mod:`.attention` (attention windows
    included: the masks are cut to them before the positions are packed)."""
    return attention_mask.shape[0] > 1 and not bool(attention_mask.bool().all()) and ragged_capable(model)


def _forward_packed(model, input_ids: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor,
                    cache, taps: Sequence[int] = ()) -> torch.Tensor:
    """A padded batch of sequences with only its real tokens through the base, packed into one
    sequence as a ragged tree step is (:class:`~.attention.RaggedRows`): the linear layers, norms
    and activations compute the K real tokens, not B × T; attention unpacks them per row under
    the causal mask over each row's real tokens, and the cache gets them in their padded places
    (zeros at the padding, which no mask lets anything see). Why: in a batch of one long prompt
    and short ones most of B × T is padding, and the prefill is most of a batched call.
    Returns hidden states (B, T, d), zeros at the padding. evidence: results/attention/packed_prefill"""
    rows = RaggedRows.from_slots(valid)
    length = valid.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    mask = causal[None, None] & valid[:, None, None, :]  # (B, 1, T, T); a padding query sees nothing
    masks = model_masks(model, mask, position_ids)  # windows by the padded (B, T) positions, before packing
    tokens = input_ids.reshape(-1).index_select(0, rows.index)[None]  # (1, K)
    positions = position_ids.reshape(-1).index_select(0, rows.index)[None]
    with forward_context(model), ragged_rows(rows), mask_memos():
        out = decoder_body(model)(input_ids=tokens, attention_mask=masks,
                                  position_ids=positions, use_cache=True, **cache_kwargs(model, cache),
                                  **_pack_kwargs(model), **_tap_kwargs(taps))
    return rows.scatter(with_taps(out.last_hidden_state, out.hidden_states, taps)[0])


@torch.no_grad()
def verify(model, tokens: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache,
           valid: torch.Tensor | None = None, taps: Sequence[int] = ()) -> torch.Tensor:
    """One base forward over every tree slot of every row; returns hidden states (B, N, d), or
    with ``taps`` the features of :func:`with_taps` (B, N, d · (1 + len(taps))).
    The cache grows by N slots per row (the caller keeps the accepted ones).

    ``valid`` (B, N): which slots are real, when rows carry different node counts. Where the
    base can (:func:`verifies_ragged`), the forward then runs only the real slots, packed into
    one sequence (:class:`~.attention.RaggedRows`): a step costs what its real slots cost, not
    the widest row's times B. The padding slots' states come out zero (nobody reads them).
    A Llama-form base runs the step directly over its modules (:mod:`.direct`)."""
    mask = model_masks(model, mask, position_ids)  # windows, before positions are packed
    rows = None
    if valid is not None and not bool(valid.all()) and verifies_ragged(model, cache):
        rows = RaggedRows.from_valid(valid)
        tokens = tokens.reshape(-1).index_select(0, rows.index)[None]
        position_ids = position_ids.expand(valid.shape).reshape(-1).index_select(0, rows.index)[None]
    with forward_context(model), ragged_rows(rows), mask_memos():
        direct = direct_body(model)
        if direct is not None:
            states = direct_forward(direct, tokens, mask, position_ids, cache, taps)
        else:
            out = decoder_body(model)(input_ids=tokens, attention_mask=mask, position_ids=position_ids,
                                      use_cache=True, **cache_kwargs(model, cache), **_pack_kwargs(model),
                                      **_tap_kwargs(taps))
            states = with_taps(out.last_hidden_state, out.hidden_states, taps)
    return states if rows is None else rows.scatter(states[0])


def model_masks(model, mask: torch.Tensor, position_ids: torch.Tensor):
    """A tree step's boolean mask (B, 1, N, T+N) → what the base's forward takes: cut to each
    layer type's attention window, in the form its attention implementation reads
    (:mod:`.architecture`)."""
    masks = layer_masks(attention_layout(model.config), mask, position_ids)
    if getattr(model.config, "_attn_implementation", None) != "eager":
        return masks  # SDPA and the others read the boolean mask
    dtype = next(model.parameters()).dtype
    if isinstance(masks, dict):
        return {kind: additive_mask(m, dtype) for kind, m in masks.items()}
    return additive_mask(masks, dtype)


def verifies_ragged(model, cache) -> bool:
    """Whether :func:`verify` can run a ragged step packed into ``cache``: the base is
    :func:`ragged_capable` and every layer of the cache is the decoder's reserved layer (it
    unpacks the rows' new keys and values)."""
    return ragged_capable(model) and all(type(layer) is reserved_layer_class() for layer in getattr(cache, "layers", ()))


def ragged_capable(model) -> bool:
    """Whether the base attends through :mod:`.attention`'s function (which unpacks a packed
    forward's rows); other attention implementations verify ragged steps as the padded block."""
    return uses_packed_sdpa(model)


def cache_kwargs(model, cache) -> dict:
    """The cache under the keyword the installed transformers wants: ``LlamaModel.forward``
    renamed ``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40)."""
    return {_cache_keyword(type(decoder_body(model))): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def lm_logits(model, states: torch.Tensor) -> torch.Tensor:
    """states (B, N, d) → the base's logits (B, N, V) through its own LM head weight (through
    the packed copy when the base was prepared by :func:`~.packing.use_packed_linears`), then
    whatever its causal LM applies after the head (:data:`~.architecture.LOGIT_TRANSFORMS`)."""
    logits = subset_product(states, states.shape[-1], functools.partial(_lm_head, model))
    return apply_logit_transforms(model.config, logits)


def _lm_head(model, states: torch.Tensor) -> torch.Tensor:
    """The LM head's product through its packed copy where that computes what calling the head
    computes (:func:`~.binding.stands_in`: no hook, parametrization, weight norm or adapter on it,
    checked at each call), else the head module called as the model calls it."""
    packed = packed_lm_head(model)
    head = model.get_output_embeddings()
    if (packed is not None and stands_in(head) and head.bias is None and states.dtype == head.weight.dtype
            and packs(head.weight, states.numel() // states.shape[-1], block_kind(packed, head.weight))):
        return packed_matmul(states, head.weight, packed)
    return head(states)


def _tap_kwargs(taps: Sequence[int]) -> dict:
    """Ask the body for every layer's states only when heads read some (transformers' public
    ``output_hidden_states``; the states exist during the forward anyway, only references are kept)."""
    return {"output_hidden_states": True} if taps else {}


def _pack_kwargs(model) -> dict:
    """Ask for grouped-query packing when the base runs :mod:`.attention`'s SDPA (the keyword
    means nothing to other attention implementations, so it is only passed to that one)."""
    return {PACK_FLAG: True} if uses_packed_sdpa(model) else {}

