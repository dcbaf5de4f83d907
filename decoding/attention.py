"""Tree verification's attention: SDPA with grouped-query heads packed instead of repeated.

Why: with grouped-query attention (SmolLM2: 9 query heads share 3 key/value heads)
transformers' SDPA path copies every key/value head ``n_rep`` times (``repeat_kv``) whenever
more than one query token comes with an attention mask — exactly the tree-verification case.
That copies the whole KV cache of every layer at every step. For a single query token
transformers already avoids the copy by folding the ``n_rep`` query heads of a group into the
query axis (``pack_gqa``); this does the same for ``q`` tokens: the group's ``n_rep × q`` query
rows attend to the group's one key/value head, under the row's mask repeated ``n_rep`` times.
Same math per query row (SmolLM2, fp32: bit-identical in the measured cases), no cache copy:
7 % off a bs-4 five-node verification step and 35 % off a bs-16 two-node step on the 2-core CPU
(README, "Batched decoding").

It is registered through transformers' public ``AttentionInterface`` under
:data:`PACKED_SDPA` and packs only when the forward was called with ``PACK_FLAG=True`` (the
decoder's prefill and verification do; transformers passes forward keywords down to the
attention function). Every other call — the base's own ``generate``, one query token, no
mask, per-head masks, position biases, paged caches — goes to transformers' own
``sdpa_attention_forward`` unchanged, exactly as with ``"sdpa"``.
"""
from __future__ import annotations

import torch

PACKED_SDPA = "draftheads_packed_sdpa"
#: The forward keyword that asks for packing. Only the decoder's own forwards pass it, so any
#: other forward of the base — its own ``generate`` included — runs transformers' SDPA as is.
PACK_FLAG = "draftheads_pack_gqa"


def packed_gqa_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs):
    """``AttentionInterface`` function: query (B, H, q, D), key/value (B, H_kv, T, D), a mask
    shared by all heads (B or 1, 1, q, T); returns (B, q, H, D) like transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    n_rep = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, dim = query.shape
    packed_requested = bool(kwargs.pop(PACK_FLAG, False))
    plain = (not packed_requested or n_rep == 1 or q_len == 1 or attention_mask is None or attention_mask.dim() != 4
             or attention_mask.shape[1] != 1 or key.shape[1] * n_rep != heads
             or any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap", "s_aux")))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # query heads k·n_rep … k·n_rep+n_rep-1 use key/value head k (repeat_kv's order): fold them into rows
    packed = query.reshape(batch, key.shape[1], n_rep * q_len, dim)
    mask = repeated_mask(attention_mask, n_rep)  # row r·q + i of a group is query token i
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(out.shape[0], heads, q_len, dim).transpose(1, 2).contiguous(), None


#: the last mask repeated and its repetition: (mask, its version, n_rep, repeated), swapped
#: as one tuple (a thread reads either the old entry or the new one, never half of each)
_REPEATED: tuple = (None, -1, 0, None)


def repeated_mask(mask: torch.Tensor, n_rep: int) -> torch.Tensor:
    """mask (B, 1, q, T) → (B, 1, n_rep·q, T), row r·q + i = row i. transformers builds one
    mask per forward and hands the same tensor to every layer, so the repetition is kept for
    that tensor (same object, same version) instead of redone per layer (~10 µs × 30 layers a
    SmolLM2 step, more at long contexts)."""
    global _REPEATED
    version = -2 if mask.is_inference() else mask._version
    last, last_version, last_rep, repeated = _REPEATED
    if mask is not last or version != last_version or n_rep != last_rep:
        repeated = mask.repeat(1, 1, n_rep, 1)
        _REPEATED = (mask, version, n_rep, repeated)
    return repeated


def register_packed_sdpa() -> None:
    """Make :data:`PACKED_SDPA` known to transformers (attention + its SDPA-style masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_gqa_sdpa)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)


def use_packed_sdpa(model) -> bool:
    """Switch a grouped-query base that runs transformers' ``"sdpa"`` to :data:`PACKED_SDPA`
    (other implementations — eager, flash-attention — and models without grouped heads are left
    alone). Returns whether the base now uses it."""
    config = model.config
    current = getattr(config, "_attn_implementation", None)
    if current == PACKED_SDPA:
        return True
    groups = config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    if current != "sdpa" or groups <= 1:
        return False
    register_packed_sdpa()
    model.set_attn_implementation(PACKED_SDPA)
    return True
