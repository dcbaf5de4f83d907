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

from .base import tree_attention_mask


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
