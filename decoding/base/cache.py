"""Per-sequence KV bookkeeping over a transformers ``DynamicCache``.

Rows of a batch accept different numbers of tokens per step, so the dense cache tensor gets
*holes*: row b's real entries are marked in ``valid[b]``; the verifier's 4D mask hides the
rest. After each step the accepted tree slots are moved down to the end of the row's own real
region (one batched gather/scatter per layer, no re-prefill) and the tensor is cropped to the
longest row, so it never grows beyond ``max(prompt + accepted)`` + one tree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import current_ragged_rows


#: room a cache layer keeps past its length: at least this many slots, or this fraction of it
RESERVE_SLOTS, RESERVE_FRACTION = 256, 0.25


def _room(view: torch.Tensor | None, buffer: torch.Tensor | None, new_shape: tuple, like: torch.Tensor):
    """view (B, H, T, D) — the layer's tensor, a prefix of ``buffer`` or not — and the shape
    (B, H, q, D) of q new slots → (a buffer whose first T slots are the view's, with room for the
    q after them, T): ``buffer`` itself when the view is its prefix and it has room, else a new one
    (``like``'s dtype and device) with room to spare."""
    length = 0 if view is None or view.dim() != 4 else view.shape[-2]
    fits = (buffer is not None and length > 0 and view.data_ptr() == buffer.data_ptr()
            and view.stride() == buffer.stride() and view.shape[:2] == new_shape[:2]
            and buffer.shape[-2] >= length + new_shape[-2] and buffer.dtype == like.dtype)
    if not fits:
        needed = length + new_shape[-2]
        capacity = needed + max(RESERVE_SLOTS, int(needed * RESERVE_FRACTION))
        buffer = like.new_empty(new_shape[0], new_shape[1], capacity, new_shape[3])
        if length:
            buffer[:, :, :length].copy_(view)
    return buffer, length


def _append(view: torch.Tensor | None, buffer: torch.Tensor | None, new: torch.Tensor):
    """view (B, H, T, D) plus new (B, H, q, D) → (view (B, H, T+q, D), buffer): written in place
    into the buffer when the view is its prefix and it has room, else into a new buffer
    (:func:`_room`)."""
    buffer, length = _room(view, buffer, new.shape, new)
    buffer[:, :, length:length + new.shape[-2]].copy_(new)
    return buffer[:, :, :length + new.shape[-2]], buffer


def reserved_layer_class():
    """transformers' ``DynamicLayer`` with room reserved ahead (built on first use: transformers
    is imported lazily). Why: ``DynamicLayer.update`` concatenates, copying the whole layer at
    every step; here a step writes
    its q new slots into the reserve and the layer's tensors stay views of one buffer, which
    ``crop`` and the decoder's in-place commit keep. Anything that replaces the tensors
    (``batch_select_indices``) simply starts a new buffer at the next update."""
    global _RESERVED
    if _RESERVED is None:
        from transformers.cache_utils import DynamicLayer

        class ReservedLayer(DynamicLayer):
            _key_buffer = _value_buffer = None
            #: what a cache handed to the caller drops (:func:`~draftheads.decoding.output.released`):
            #: its next update starts a new buffer
            SCRATCH = ("_key_buffer", "_value_buffer")

            def update(self, key_states, value_states, *args, **kwargs):
                rows = current_ragged_rows()  # a packed forward's (1, H, K, D) → its rows' (B, H, N, D)
                if rows is not None and key_states.shape[0] == 1 and key_states.shape[-2] == rows.count:
                    key_states, value_states = rows.unpack(key_states), rows.unpack(value_states)
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                self.keys, self._key_buffer = _append(self.keys, self._key_buffer, key_states)
                self.values, self._value_buffer = _append(self.values, self._value_buffer, value_states)
                return self.keys, self.values

            def reserve(self, count: int) -> tuple[torch.Tensor, torch.Tensor, int]:
                """Room for ``count`` new slots after the layer's (initialized) keys and values:
                (key buffer, value buffer (B, H, capacity, D), the first new slot); the layer's
                tensors cover the new slots from here on and the caller writes them (what
                :meth:`update` does with given states, without the states)."""
                shape = (*self.keys.shape[:2], count, self.keys.shape[3])
                self._key_buffer, start = _room(self.keys, self._key_buffer, shape, self.keys)
                self._value_buffer, _ = _room(self.values, self._value_buffer, shape, self.values)
                self.keys = self._key_buffer[:, :, :start + count]
                self.values = self._value_buffer[:, :, :start + count]
                return self._key_buffer, self._value_buffer, start

            def reset(self) -> None:
                self._key_buffer = self._value_buffer = None
                super().reset()

        _RESERVED = ReservedLayer
    return _RESERVED


_RESERVED = None


def reserved_cache(config):
    """A ``DynamicCache`` for ``config`` whose attention layers reserve room ahead
    (:func:`reserved_layer_class`). Sliding-window layers keep their whole past too: a tree's
    mask cuts each layer's window (:func:`~.architecture.layer_masks`), and the accepted slots
    are moved down the same way in every layer. Other layers (recurrent, ...) stay
    transformers' own, and such a base is refused (:func:`~.architecture.check_forwards`)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = DynamicCache(config=config)
    reserved = reserved_layer_class()
    cache.layers = [reserved() if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:  # no config: layers made on first use
        cache.layer_class_to_replicate = reserved
    return cache


def tree_attention_mask(kv_valid: torch.Tensor, ancestor: torch.Tensor) -> torch.Tensor:
    """(B, T) real cache slots + (B or 1, N, N) tree ancestry → (B, 1, N, T+N) boolean mask
    (True = may attend): each tree slot sees the row's real past and its own ancestors."""
    batch, nodes = kv_valid.shape[0], ancestor.shape[-1]
    past = kv_valid[:, None, None, :].expand(batch, 1, nodes, kv_valid.shape[1])
    tree = ancestor.expand(batch, nodes, nodes)[:, None]
    return torch.cat([past, tree], dim=-1)


@dataclass
class KVState:
    cache: object  # transformers.DynamicCache
    valid: torch.Tensor  # (B, T) bool: which cache slots hold real tokens of the row
    end: torch.Tensor  # (B,) long: one past the row's last real slot
    next_pos: torch.Tensor  # (B,) long: RoPE position of the row's next token

    @classmethod
    def after_prefill(cls, cache, attention_mask: torch.Tensor) -> "KVState":
        valid = attention_mask.bool()
        length = valid.shape[1]
        return cls(cache, valid, torch.full((valid.shape[0],), length, dtype=torch.long, device=valid.device),
                   valid.long().sum(1))

    @property
    def length(self) -> int:
        return int(self.valid.shape[1])

    def layers(self):
        return self.cache.layers

    def commit(self, slots: torch.Tensor, count: torch.Tensor) -> None:
        """Keep, per row, the first ``count[b]`` of ``slots[b]`` (absolute cache indices of
        the accepted tree slots, root first) right after the row's real region; drop the rest
        of the step's tree."""
        batch, width = slots.shape
        rows = torch.arange(batch, device=slots.device)[:, None]
        columns = torch.arange(width, device=slots.device)[None, :]
        dest = self.end[:, None] + columns
        # Plain steps and root-only acceptances already sit where they belong: skip the copy.
        if bool(((slots != dest) & (columns < count[:, None])).any()):
            for layer in self.layers():
                for name in ("keys", "values"):
                    tensor = getattr(layer, name)
                    moved = tensor[rows, :, slots]  # (B, W, H, D): gather before writing
                    tensor[rows, :, dest] = moved
        new_end = self.end + count
        new_length = int(new_end.max())
        remove = self.length_with_tree() - new_length
        if remove > 0:
            self.cache.crop(-remove)
        keep = torch.arange(new_length, device=slots.device)[None, :]
        old = self.valid[:, :new_length] if self.valid.shape[1] >= new_length else torch.nn.functional.pad(
            self.valid, (0, new_length - self.valid.shape[1]))
        self.valid = old | ((keep >= self.end[:, None]) & (keep < new_end[:, None]))
        self.end = new_end
        self.next_pos = self.next_pos + count

    def tree_inputs(self, ancestor: torch.Tensor, depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For one step's tree (ancestor (N, N), depth (N,)): the 4D mask over this cache + the
        tree, each slot's position, and the cache length before the tree is appended (what
        :meth:`commit` adds to the accepted slots)."""
        device = self.valid.device
        mask = tree_attention_mask(self.valid, ancestor.to(device))
        positions = self.next_pos[:, None] + depth.to(device)  # depth (N,) or (B, N)
        return mask, positions, self.length_with_tree()

    def length_with_tree(self) -> int:
        return int(self.cache.get_seq_length())

    def select_rows(self, index: torch.Tensor) -> None:
        """Drop finished rows (and crop the columns no remaining row needs)."""
        self.cache.batch_select_indices(index)
        self.valid, self.end, self.next_pos = self.valid[index], self.end[index], self.next_pos[index]
        # left columns that no remaining row uses could be trimmed too; cheap enough to keep

    def crop_to(self, length: int) -> None:
        remove = self.length_with_tree() - length
        if remove > 0:
            self.cache.crop(-remove)
        self.valid = self.valid[:, :length]
        self.end = self.end.clamp(max=length)
