"""Attention over a left-padded batch without the keys no query of a row may see.

Why: in a batch the cache is as long as the longest row, and rows with short prompts carry
left padding their mask hides. The attention kernel still reads every hidden key, and at
batch 16 attention is most of a verification step (bf16, 16 prompts of 40 to 769 tokens: 62 %
of the decode phase's operator time). CPU's flash-attention kernel walks
the keys in blocks of :data:`KV_BLOCK` from position 0, and a block that every query of a row
masks adds nothing to that row's output; so a row's leading whole hidden blocks can be left out
of its call. The math is the same and the blocks still read are the ones read before: the output
is bit-identical on random caches in every dtype, and on a real bf16 cache a row of one layer in
a few hundred differed in the last bit of the kernel's float32 sums (the zeros the hidden block
added). Rows are cut in contiguous runs, each one kernel call over the keys from the run's first
wholly visible block on (views, no copies); the loop groups rows with equal cuts
(:func:`grouped_order`).
evidence: results/attention/key_blocks
"""
from __future__ import annotations

import torch

from .mask_memo import mask_memo

#: keys per block of CPU's flash-attention kernel (it starts its blocks at key 0): only whole
#: blocks are skipped, so the blocks the kernel still reads are the ones it read before
KV_BLOCK = 512
#: one more kernel call costs about as much as reading this many (row, key) pairs
#: (bf16 and float32, 2 threads, a run of the decoder's attention: 50-100 µs against ~100 ns a (row, key);
#: evidence: results/attention/key_blocks)
ATTENTION_CALL_KEYS = 768

Runs = tuple[tuple[int, int, int], ...]  # (first row, one past the last row, first key read)


def hidden_blocks(visible: torch.Tensor, block: int = KV_BLOCK) -> torch.Tensor:
    """visible (B, T) bool → (B,) per row, the whole blocks before its first visible key (0 for
    a row that sees nothing)."""
    first = torch.where(visible.any(dim=1), visible.int().argmax(dim=1), 0)  # (B,)
    return first // block


def leading_hidden_blocks(mask: torch.Tensor, block: int = KV_BLOCK) -> list[int]:
    """mask (B, 1, q, T) bool, True = may attend → per row, the keys before its first key any
    of its queries may see, rounded down to a whole number of blocks (what may be skipped)."""
    return (hidden_blocks(mask[:, 0].any(dim=1), block) * block).tolist()


def row_runs(skips: list[int], length: int, call_keys: int = ATTENTION_CALL_KEYS) -> Runs:
    """Contiguous runs of rows, each read from the least of its rows' ``skips``, that minimize
    the (row, key) pairs read plus ``call_keys`` per call (an exact partition, O(B²))."""
    rows = len(skips)
    best = [0.0] + [float("inf")] * rows  # best[b]: cost of rows [0, b)
    start = [0] * (rows + 1)
    for end in range(1, rows + 1):
        least = length
        for begin in range(end - 1, -1, -1):
            least = min(least, skips[begin])
            cost = best[begin] + (end - begin) * (length - least) + call_keys
            if cost < best[end]:
                best[end], start[end] = cost, begin
    runs, end = [], rows
    while end > 0:
        begin = start[end]
        runs.append((begin, end, min(skips[begin:end])))
        end = begin
    return tuple(reversed(runs))


#: the plan of each forward's mask, made once for all its layers
_PLANS = mask_memo()


def key_runs(mask: torch.Tensor | None) -> Runs | None:
    """The runs for ``mask`` (B, 1, q, T) when cutting saves reading: None for one call over
    every key (no mask, a non-boolean one, a device whose kernel blocks differ, nothing hidden
    in whole blocks). Kept for the mask tensor, so each forward plans once."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.device.type != "cpu" \
            or mask.shape[-1] <= KV_BLOCK:
        return None
    return _PLANS.get(mask, None, lambda: _plan(mask))


def _plan(mask: torch.Tensor) -> Runs | None:
    skips = leading_hidden_blocks(mask)
    runs = row_runs(skips, mask.shape[-1]) if any(skips) else None
    return None if runs == ((0, mask.shape[0], 0),) else runs


def grouped_order(valid: torch.Tensor, block: int = KV_BLOCK) -> torch.Tensor | None:
    """valid (B, T), each row's real cache slots → a row order that puts the rows hiding the
    same number of leading key blocks side by side (the longest prompts first, otherwise as they
    were), so :func:`row_runs` cuts them in a few runs; None when they already are, or when no
    whole block is hidden. Why: callers order a batch as they like, and a long prompt among short
    ones would split their run in two."""
    if valid.device.type != "cpu" or valid.shape[1] <= block:
        return None
    skips = hidden_blocks(valid, block)
    if not bool(skips.any()):
        return None
    changes = int((skips[1:] != skips[:-1]).sum())
    if changes == skips.unique().numel() - 1:
        return None
    return torch.sort(skips, stable=True).indices
