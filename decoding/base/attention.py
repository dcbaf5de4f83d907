"""Tree verification's attention: SDPA with grouped-query heads packed instead of repeated.

Why: with grouped-query attention (SmolLM2: 9 query heads share 3 key/value heads)
transformers' SDPA path copies every key/value head ``n_rep`` times (``repeat_kv``) whenever
more than one query token comes with an attention mask — exactly the tree-verification case.
That copies the whole KV cache of every layer at every step. For a single query token
transformers already avoids the copy by folding the ``n_rep`` query heads of a group into the
query axis (``pack_gqa``); this does the same for ``q`` tokens: the group's ``n_rep × q`` query
rows attend to the group's one key/value head, under the row's mask repeated ``n_rep`` times.
Same math per query row (bit-identical in float32 on SmolLM2), no cache copy.
evidence: results/batch/adaptive_fp32

It is registered through transformers' public ``AttentionInterface`` under
:data:`PACKED_SDPA` and packs only when the forward was called with ``PACK_FLAG=True`` (the
decoder's prefill and verification do; transformers passes forward keywords down to the
attention function). Every other call — the base's own ``generate``, one query token, no
mask, per-head masks, position biases, paged caches — goes to transformers' own
``sdpa_attention_forward`` unchanged, exactly as with ``"sdpa"``.
"""
from __future__ import annotations

import contextvars
import functools
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .key_blocks import key_runs
from .mask_memo import mask_memo

PACKED_SDPA = "draftheads_packed_sdpa"
#: The forward keyword that asks for packing. Only the decoder's own forwards pass it, so any
#: other forward of the base — its own ``generate`` included — runs transformers' SDPA as is.
PACK_FLAG = "draftheads_pack_gqa"


def packed_gqa_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs):
    """``AttentionInterface`` function: query (B, H, q, D), key/value (B, H_kv, T, D), a mask
    shared by all heads (B or 1, 1, q, T); returns (B, q, H, D) like transformers' SDPA. Inside
    :func:`ragged_rows`, query is the packed (1, H, K, D) and so is the output (1, K, H, D)."""
    rows = _RAGGED.get()
    if rows is not None and query.shape[0] == 1 and query.shape[2] == rows.count and key.shape[0] == rows.batch:
        return _attend_ragged(module, rows, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    return _attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def _attend_ragged(module, rows: "RaggedRows", query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   mask: torch.Tensor, dropout: float, scaling: float | None, is_causal: bool | None, **kwargs):
    """A packed forward's attention: query (1, H, K, D) → (1, K, H, D). Every row attends to its
    own cache under the step's mask (B, 1, N, T). Why in two calls: the attention kernel costs
    each row its padded query slots, so one row with nine nodes among rows with one would make
    all of them pay nine; the first
    ``s`` slots of every row go in one call over the cache as it is, the slots past ``s`` of
    the few longer rows in a second over their gathered cache rows (:attr:`RaggedRows.split`).
    A query row's softmax never mixes with another's, so the split changes no result.
    evidence: results/attention/ragged_verify"""
    unpacked = rows.unpack(query)  # (B, H, N, D)
    short, long = rows.split
    if long is None:
        out, _ = _attend(module, unpacked, key, value, mask, dropout, scaling, is_causal, **kwargs)
        return rows.pack(out), None
    head, tail = rows.split_masks(mask)
    first, _ = _attend(module, unpacked[:, :, :short], key, value, head, dropout, scaling, is_causal, **kwargs)
    rest, _ = _attend(module, unpacked.index_select(0, long)[:, :, short:], key.index_select(0, long),
                      value.index_select(0, long), tail, dropout, scaling, is_causal, **kwargs)
    out = first.new_zeros(rows.batch, rows.width, *first.shape[2:])  # (B, N, H, D)
    out[:, :short] = first
    out[long, short:] = rest
    return rows.pack(out), None


def _attend(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
            dropout: float, scaling: float | None, is_causal: bool | None, **kwargs):
    """The decoder's own forwards (:data:`PACK_FLAG`) attend in runs of rows that leave out their
    leading wholly hidden key blocks (:mod:`.key_blocks`: the same math, less cache read); then
    :func:`_attend_rows` per run, or once over every row and key."""
    packed_requested = bool(kwargs.pop(PACK_FLAG, False))
    runs = None
    if packed_requested and attention_mask is not None and attention_mask.dim() == 4 \
            and attention_mask.shape[0] == query.shape[0] == key.shape[0] and attention_mask.shape[-1] == key.shape[-2]:
        runs = key_runs(attention_mask)
    if runs is None:
        return _attend_rows(module, query, key, value, attention_mask, packed_requested, dropout, scaling, is_causal,
                            **kwargs)
    n_rep = getattr(module, "num_key_value_groups", 1)
    repeated = repeated_mask(attention_mask, n_rep) if _packs(module, query, key, attention_mask, True, kwargs) else None
    outs = [_attend_rows(module, query[a:b], key[a:b, :, s:], value[a:b, :, s:], attention_mask[a:b, :, :, s:],
                         packed_requested, dropout, scaling, is_causal,
                         repeated=None if repeated is None else repeated[a:b, :, :, s:], **kwargs)[0]
            for a, b, s in runs]
    return torch.cat(outs), None  # (B, q, H, D)


def _packs(module, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, packed_requested: bool,
           kwargs: dict) -> bool:
    """Whether :func:`_attend_rows` folds grouped query heads into rows (else transformers' SDPA runs)."""
    n_rep = getattr(module, "num_key_value_groups", 1)
    return not (not packed_requested or n_rep == 1 or query.shape[2] == 1 or attention_mask is None
                or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or key.shape[1] * n_rep != query.shape[1]
                or any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap", "s_aux")))


def _attend_rows(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, packed_requested: bool, dropout: float, scaling: float | None,
                 is_causal: bool | None, repeated: torch.Tensor | None = None, **kwargs):
    """Grouped-query packing where it applies (see the module docstring), else transformers' SDPA.
    ``repeated``: the mask already repeated for the groups (a run's slice of the forward's one)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not _packs(module, query, key, attention_mask, packed_requested, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    n_rep = module.num_key_value_groups
    batch, heads, q_len, dim = query.shape
    # query heads k·n_rep … k·n_rep+n_rep-1 use key/value head k (repeat_kv's order): fold them into rows
    packed = query.reshape(batch, key.shape[1], n_rep * q_len, dim)
    mask = repeated if repeated is not None else repeated_mask(attention_mask, n_rep)  # row r·q + i is query token i
    mask = additive_mask(mask, query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(out.shape[0], heads, q_len, dim).transpose(1, 2).contiguous(), None


@dataclass(frozen=True, eq=False)
class RaggedRows:
    """A verification forward whose rows carry different numbers of tree slots, run *packed*:
    the base sees only the K real slots of the (B, N) block, as one sequence (1, K), so every
    linear layer, norm and activation computes K rows instead of B × N. Only attention needs the
    rows apart — each slot attends to its own row's cache — so the cache layer
    (:func:`~.cache.reserved_layer_class`) unpacks the new keys and values into the row's N tree
    slots, and :func:`packed_gqa_sdpa` unpacks the queries, attends per row under the step's 4D
    mask and packs the output back. vLLM flattens a batch's tokens the same way; here it only
    runs inside :func:`ragged_rows` (the decoder's :func:`~.forward.verify` and, for a padded
    batch of prompts, :func:`~.forward.forward_all`)."""

    index: torch.Tensor  # (K,) long, ascending: flat position b·N + j of each real slot
    batch: int  # B
    width: int  # N, the widest row's slots
    sizes: tuple[int, ...]  # each row's real slots (a prefix of its N when ``prefix``)
    prefix: bool = True  # every row's real slots come first (a tree step); else anywhere (padded prompts)
    _masks: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_valid(cls, valid: torch.Tensor) -> "RaggedRows":
        """valid (B, N) bool, each row's real slots a prefix."""
        return cls(valid.reshape(-1).nonzero().flatten(), int(valid.shape[0]), int(valid.shape[1]),
                   tuple(valid.sum(1).tolist()))

    @classmethod
    def from_slots(cls, valid: torch.Tensor) -> "RaggedRows":
        """valid (B, N) bool, the real slots anywhere in a row (left-padded prompts): attention
        runs in one call over every row's N slots (no :attr:`split`)."""
        return cls(valid.reshape(-1).nonzero().flatten(), int(valid.shape[0]), int(valid.shape[1]),
                   tuple(valid.sum(1).tolist()), prefix=False)

    @property
    def count(self) -> int:
        return int(self.index.numel())

    @functools.cached_property
    def split(self) -> tuple[int, torch.Tensor | None]:
        """(s, the rows with more than s slots): attention runs every row's first s slots in one
        call and the longer rows' other slots in a second (None: one call over all N). s
        minimizes the kernel's work in row-slots, B·(s + c) + L·(N − s + c + g), where c is a
        row's pass over its cache and g the gathering of a long row's cache
        (:data:`ATTENTION_ROW_PASS`, :data:`ATTENTION_ROW_GATHER`)."""
        if not self.prefix:
            return self.width, None
        sizes = torch.tensor(self.sizes)
        best, best_cost = self.width, self.batch * (self.width + ATTENTION_ROW_PASS)
        for s in range(1, self.width):
            longer = int((sizes > s).sum())
            cost = (self.batch * (s + ATTENTION_ROW_PASS)
                    + longer * (self.width - s + ATTENTION_ROW_PASS + ATTENTION_ROW_GATHER) + ATTENTION_CALL)
            if cost < best_cost:
                best, best_cost = s, cost
        if best == self.width:
            return best, None
        return best, (sizes > best).nonzero().flatten().to(self.index.device)

    def split_masks(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """mask (B, 1, N, T) → the two calls' masks, made once per forward (every layer gets the
        same mask tensor)."""
        entry = self._masks.get("split")
        if entry is None or entry[0] is not mask:
            short, long = self.split
            entry = (mask, mask[:, :, :short].contiguous(), mask.index_select(0, long)[:, :, short:].contiguous())
            self._masks["split"] = entry
        return entry[1], entry[2]

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """flat (K, ...) → (B, N, ...): each real slot in its row's place, zeros at the padding."""
        out = flat.new_zeros(self.batch * self.width, *flat.shape[1:])
        out.index_copy_(0, self.index, flat)
        return out.view(self.batch, self.width, *flat.shape[1:])

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """x (1, H, K, D) → (B, H, N, D), zeros at the padding slots."""
        return self.scatter(x[0].transpose(0, 1)).transpose(1, 2)

    def pack(self, y: torch.Tensor) -> torch.Tensor:
        """y (B, N, ...) → (1, K, ...): the real slots, in order."""
        return y.reshape(self.batch * self.width, *y.shape[2:]).index_select(0, self.index)[None]


#: the attention kernel's cost in query row-slots: a row's pass over its cache, gathering a
#: row's cache for the second call, a call's overhead (evidence: results/attention/ragged_verify)
ATTENTION_ROW_PASS, ATTENTION_ROW_GATHER, ATTENTION_CALL = 4.0, 2.5, 2.0


_RAGGED: contextvars.ContextVar[RaggedRows | None] = contextvars.ContextVar("draftheads_ragged_rows", default=None)


@contextmanager
def ragged_rows(rows: RaggedRows | None) -> Iterator[None]:
    """Inside: the base's forward runs packed as ``rows`` describes (None: as usual)."""
    token = _RAGGED.set(rows)
    try:
        yield
    finally:
        _RAGGED.reset(token)


def current_ragged_rows() -> RaggedRows | None:
    return _RAGGED.get()


#: each forward's mask repeated for the grouped heads, made once for all its layers
_REPEATED = mask_memo()


def repeated_mask(mask: torch.Tensor, n_rep: int) -> torch.Tensor:
    """mask (B, 1, q, T) → (B, 1, n_rep·q, T), row r·q + i = row i; kept for the mask tensor
    (:mod:`.mask_memo`) instead of redone per layer."""
    return _REPEATED.get(mask, n_rep, lambda: mask.repeat(1, 1, n_rep, 1))


#: each forward's boolean mask as SDPA adds it, made once for all its layers
_ADDITIVE = mask_memo()
#: the largest mask kept as an additive one (elements): a tree step's, not a long prefill's
ADDITIVE_MAX = 1 << 20


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) as the additive one SDPA turns it into at every call
    (0 / −inf in the query's dtype: the same values, so the same result), made once per forward
    for all its layers; a float mask, or one past :data:`ADDITIVE_MAX` elements, is returned as it is."""
    if mask.dtype != torch.bool or mask.numel() > ADDITIVE_MAX:
        return mask
    return _ADDITIVE.get(mask, dtype, lambda: torch.zeros(mask.shape, dtype=dtype, device=mask.device)
                         .masked_fill_(~mask, float("-inf")))


def register_packed_sdpa() -> None:
    """Make :data:`PACKED_SDPA` known to transformers (attention + its SDPA-style masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_gqa_sdpa)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)


#: the bases whose decoder forwards attend through :data:`PACKED_SDPA` (their config is switched
#: only for the length of each such forward, :func:`packed_attention`)
_PACKED_ATTENTION: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def use_packed_sdpa(model) -> bool:
    """Let the decoder's own forwards of a grouped-query base that runs transformers' ``"sdpa"``
    attend through :data:`PACKED_SDPA` (other implementations — eager, flash-attention — and
    models without grouped heads are left alone). The model's config is not changed: its own
    ``generate``, a pickle or a copy of it still say ``"sdpa"`` (:func:`packed_attention` switches
    it inside those forwards only). Returns whether the decoder's forwards now use it."""
    if model in _PACKED_ATTENTION:
        return True
    config = model.config
    groups = config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    if getattr(config, "_attn_implementation", None) != "sdpa" or groups <= 1:
        return False
    register_packed_sdpa()
    _PACKED_ATTENTION.add(model)
    return True


def uses_packed_sdpa(model) -> bool:
    return model in _PACKED_ATTENTION


def release_packed_sdpa(model) -> None:
    """The decoder's forwards of ``model`` attend as the model itself does again."""
    _PACKED_ATTENTION.discard(model)


@contextmanager
def packed_attention(model) -> Iterator[None]:
    """Inside: ``model`` attends through :data:`PACKED_SDPA` where :func:`use_packed_sdpa` said so
    (transformers reads the implementation from the config at every forward), then through what
    it had again, however the block ends."""
    if model not in _PACKED_ATTENTION:
        yield
        return
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = PACKED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = before
