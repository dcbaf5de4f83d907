"""What a forward derives from its attention mask, computed once for all its layers.

transformers builds one mask per forward and hands the same tensor to every layer, so a value
derived from it (the mask repeated for grouped heads, the key-block plan) is kept for that tensor
— same object, same version — instead of redone per layer. A ragged step alternates two masks
layer by layer (:meth:`~.attention.RaggedRows.split_masks`), so each memo keeps a few. Everything
is let go when the forward ends (:func:`mask_memos`): a prefill's (B, 1, n_rep·T, T) repetition
would otherwise stay alive until the next one.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch


class MaskMemo:
    """Values derived from masks: ``get(mask, key, compute)`` returns the value kept for this mask
    tensor (same object and version) and ``key``, else ``compute()``'s, kept among the last
    ``kept``. The entries are swapped as one tuple, so a thread reads the old ones or the new
    ones, never half of each."""

    def __init__(self, kept: int = 4):
        self.kept = kept
        self._entries: tuple = ()  # (mask, its version, key, value), newest last

    def get(self, mask: torch.Tensor, key, compute: Callable[[], object]):
        version = -2 if mask.is_inference() else mask._version
        for seen, seen_version, seen_key, value in self._entries:
            if seen is mask and seen_version == version and seen_key == key:
                return value
        value = compute()
        self._entries = (*self._entries[-(self.kept - 1):], (mask, version, key, value))
        return value

    def clear(self) -> None:
        self._entries = ()


#: every memo made by :func:`mask_memo`, cleared when a forward ends
_MEMOS: list[MaskMemo] = []


def mask_memo(kept: int = 4) -> MaskMemo:
    """A module's memo, let go at the end of each of the decoder's forwards (:func:`mask_memos`)."""
    memo = MaskMemo(kept)
    _MEMOS.append(memo)
    return memo


@contextmanager
def mask_memos() -> Iterator[None]:
    """Around one forward: what was derived from its masks serves its layers and is let go when
    it ends."""
    try:
        yield
    finally:
        for memo in _MEMOS:
            memo.clear()
