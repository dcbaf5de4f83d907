"""What of a base's architecture the verify path must honour, read from the model itself.

The decoder runs the base's own decoder body (``model.base_model``: ``model`` for Llama,
``transformer`` for GPT-2, ``gpt_neox`` for Pythia, ...) and its own LM head, but it builds the
attention masks of a tree step itself and computes the logits from the body's hidden states. So
three things a model's own ``forward`` does are done here, through the model's own config:

- **sliding-window layers** (Mistral, Qwen2, Gemma 2/3 local layers): the tree's mask also cuts
  what lies outside each layer's window (transformers' rule, ``sliding_window_overlay``: a query
  at position p sees keys at positions > p - window), one mask per layer type where the layers
  differ (the ``{layer type: mask}`` mapping transformers' hybrid models take);
- **what the causal LM applies after its LM head** (:data:`LOGIT_TRANSFORMS`: Gemma 2/3's final
  soft-capping, Cohere's logit scale, Granite's logit scaling);
- **which cache layers can hold a tree** (full and sliding-window attention; recurrent or
  chunked layers cannot).

And because an architecture can apply something none of these rules knows of, every base is
checked once when it is bound (:func:`check_forwards`): the decoder's logits, through its own
prefill and tree verification, must match the model's own forward on a short probe. A base that
fails is refused with one line naming the architecture — never decoded to a different answer.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from ...core.errors import DraftheadsError

#: the layer types a tree can be verified through, and whether the type has a window
FULL, SLIDING = "full_attention", "sliding_attention"


class UnsupportedBaseError(DraftheadsError, ValueError):
    """A base whose architecture the decoder cannot verify a tree on; the message names it."""


def architecture_name(model) -> str:
    config = model.config
    return (getattr(config, "architectures", None) or [type(model).__name__])[0]


def decoder_body(model):
    """The base's decoder body, which maps token ids to the last hidden states (before the LM
    head): transformers names it by ``base_model_prefix`` (``model``, ``transformer``,
    ``gpt_neox``, ...) and exposes it as ``base_model``."""
    body = getattr(model, "base_model", None)
    if body is None or body is model:
        raise UnsupportedBaseError(f"{architecture_name(model)}: no decoder body under base_model (a causal LM with "
                                   "its LM head on top of a decoder is needed); load it with AutoModelForCausalLM.")
    return body


# -- attention windows ------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionLayout:
    """The windows a base's layers attend within: layer type → window (None: the whole past).
    ``per_type``: the layers differ, so the forward takes one mask per layer type (transformers'
    hybrid models read ``attention_mask`` as a ``{layer type: mask}`` mapping)."""

    windows: tuple[tuple[str, int | None], ...]

    @property
    def per_type(self) -> bool:
        return len({window for _, window in self.windows}) > 1

    @property
    def windowed(self) -> bool:
        return any(window is not None for _, window in self.windows)

    @property
    def smallest_window(self) -> int | None:
        sizes = [window for _, window in self.windows if window is not None]
        return min(sizes) if sizes else None


def attention_layout(config) -> AttentionLayout:
    """From the config, as transformers' models read it: ``layer_types`` where the config lists
    them (each ``sliding_attention`` layer within ``sliding_window``), else every layer within
    ``sliding_window`` when it is set (Mistral, Mixtral, Phi-3, Starcoder2 apply it to all layers;
    Qwen2 clears it unless ``use_sliding_window``). Any other layer type is refused."""
    window = getattr(config, "sliding_window", None)
    window = int(window) if window else None
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return AttentionLayout(((FULL, window),))
    unknown = sorted(set(layer_types) - {FULL, SLIDING})
    if unknown:
        raise UnsupportedBaseError(f"{getattr(config, 'model_type', 'this base')}: layers of type {', '.join(unknown)} "
                                   "cannot verify a token tree (only full and sliding-window attention can); use "
                                   "the model's own generate().")
    return AttentionLayout(tuple((kind, window if kind == SLIDING else None) for kind in sorted(set(layer_types))))


def windowed_mask(mask: torch.Tensor, window: int | None, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
    """mask (B, 1, N, S) bool, q_pos (B or 1, N), kv_pos (B, S) → the mask cut to ``window``
    (transformers' ``sliding_window_overlay``: a key is seen when kv_pos > q_pos - window)."""
    if window is None:
        return mask
    return mask & (kv_pos[:, None, None, :] > (q_pos[:, None, :, None] - window))


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: may attend) as eager attention reads it: eager adds the mask to its
    scores, so it takes 0 / the dtype's lowest value (as transformers' ``eager_mask`` makes it)."""
    return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def layer_masks(layout: AttentionLayout, mask: torch.Tensor, position_ids: torch.Tensor):
    """A tree step's mask (B, 1, N, T+N) over the cache's T slots and the N tree slots → what the
    base's forward takes: the mask itself (no window), the one windowed mask (every layer alike),
    or ``{layer type: mask}``. Positions: the past's real slots are contiguous and numbered in
    order (the decoder's cache keeps them so), so a slot's position counts the real slots before
    it; a tree slot's position is its node's (``position_ids`` (B or 1, N))."""
    if not layout.windowed:
        return mask
    nodes = mask.shape[-2]
    past = mask[:, 0, 0, :-nodes]  # (B, T): every node sees the whole real past; row 0 is the root
    past_pos = past.long().cumsum(-1) - 1
    kv_pos = torch.cat([past_pos, position_ids.expand(mask.shape[0], nodes)], dim=-1)
    masks = {kind: windowed_mask(mask, window, position_ids, kv_pos) for kind, window in layout.windows}
    return masks if layout.per_type else next(iter(masks.values()))


# -- logits after the LM head -----------------------------------------------------------------
def _softcap(cap: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda logits: torch.tanh(logits / cap) * cap


#: config attribute → the transform the causal LM applies to its LM head's output, in the model's
#: own arithmetic (Gemma 2/3: ``final_logit_softcapping``; Cohere: ``logits * logit_scale``;
#: Granite: ``logits / logits_scaling``)
LOGIT_TRANSFORMS: dict[str, Callable[[float], Callable[[torch.Tensor], torch.Tensor]]] = {
    "final_logit_softcapping": _softcap,
    "logit_scale": lambda scale: (lambda logits: logits * scale),
    "logits_scaling": lambda scale: (lambda logits: logits / scale),
}


def logit_settings(config) -> dict[str, float]:
    """The settings of :data:`LOGIT_TRANSFORMS` this config makes (a scaling of 1 changes nothing)."""
    found = {}
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not (name == "logits_scaling" and value == 1):
            found[name] = float(value)
    return found


def logit_transforms(config) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
    """The transforms the config sets, in the order :data:`LOGIT_TRANSFORMS` lists them."""
    return tuple(LOGIT_TRANSFORMS[name](value) for name, value in logit_settings(config).items())


def apply_logit_transforms(config, logits: torch.Tensor) -> torch.Tensor:
    for transform in logit_transforms(config):
        logits = transform(logits)
    return logits


# -- the check at binding -------------------------------------------------------------------
#: bases already checked (the check runs once per model object)
_CHECKED: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()

#: how far the decoder's logits may lie from the model's own, as a share of the probe's largest
#: logit: a forward over other token counts rounds differently (some models norm in float32
#: whatever their dtype: Gemma's RMSNorm), and what the check is for moves logits by far more
PROBE_TOLERANCE = {torch.float64: 1e-4, torch.float32: 2e-3, torch.bfloat16: 0.08, torch.float16: 0.04}
#: the LM head's own check compares one forward's states through two heads: a few roundings
HEAD_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 0.02, torch.float16: 0.005}
PROBE_LENGTH, PROBE_MAX = 16, 96


def check_forwards(model, lm_logits: Callable, verify_tree: Callable) -> None:
    """Refuse, with one line, a base the decoder would decode differently from its own forward.
    ``lm_logits(model, states)``: the decoder's LM head; ``verify_tree(model, prompt, tokens,
    parents)`` → the decoder's logits at a tree's nodes (its prefill, :func:`~.forward.verify`, LM head). The probe: ``split`` tokens of
    prefill, then a tree of the rest as a chain with a wrong sibling inserted after its root (a
    base whose attention ignores the tree's mask lets the chain see it), long enough to cross the
    smallest attention window when that is short."""
    if model in _CHECKED:
        return
    name = architecture_name(model)
    layout = check_structure(model)
    window = layout.smallest_window
    length = window + 6 if window is not None and PROBE_LENGTH < window + 6 <= PROBE_MAX else PROBE_LENGTH
    vocab = int(model.get_output_embeddings().weight.shape[0])
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, max(vocab, 4), (1, length), generator=generator).to(device)  # (1, L)
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.float()  # (1, L, V)
        body = decoder_body(model)(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        head = lm_logits(model, body.last_hidden_state).float()
        _compare(model, name, own, head, HEAD_TOLERANCE, "its LM head's output (a logit transform draftheads does "
                 "not apply)")
        split = max(1, length // 2 - 2)
        chain = ids[0, split:]
        wrong = (chain[1:2] + 1) % vocab if chain.numel() > 1 else chain[:1]
        tokens = torch.cat([chain[:1], wrong, chain[1:]])  # (N,)
        parents = [-1, 0] + [0] + list(range(2, len(tokens) - 1))
        ours = verify_tree(model, ids[:, :split], tokens, parents).float()  # (1, N, V)
        keep = [0] + list(range(2, len(tokens)))
        _compare(model, name, own[:, split:], ours[:, keep], PROBE_TOLERANCE,
                 "its attention over a token tree (masks, windows or positions)")
    _CHECKED[model] = True


def checked(model) -> bool:
    """Whether :func:`check_forwards` passed for this model object."""
    return model in _CHECKED


def check_structure(model) -> AttentionLayout:
    """What needs no forward: a decoder body, attention layers a tree can be verified through,
    cache layers that can hold one. Run before anything else touches the base."""
    decoder_body(model)
    layout = attention_layout(model.config)
    _check_cache_layers(model, architecture_name(model))
    return layout


def _check_cache_layers(model, name: str) -> None:
    from .cache import reserved_cache, reserved_layer_class

    layers = getattr(reserved_cache(model.config), "layers", [])
    other = sorted({type(layer).__name__ for layer in layers if type(layer) is not reserved_layer_class()})
    if other:
        raise UnsupportedBaseError(f"{name}: its cache layers ({', '.join(other)}) cannot hold a token tree (only "
                                   "attention layers can); use the model's own generate().")


def _compare(model, name: str, own: torch.Tensor, ours: torch.Tensor, tolerance: dict, what: str) -> None:
    dtype = next(model.parameters()).dtype
    scale = float(own.abs().max()) or 1.0
    error = float((own - ours).abs().max())
    if not error <= tolerance.get(dtype, 0.05) * scale:
        raise UnsupportedBaseError(f"{name}: draftheads' logits differ from the model's own forward by {error:.3g} "
                                   f"(largest logit {scale:.3g}) through {what}; this architecture is not supported "
                                   "yet: use the model's own generate().")
