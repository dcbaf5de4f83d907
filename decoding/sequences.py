"""The generated sequences of one ``generate`` call, owned in one place.

Each row is its prompt (left-padded ``input_ids`` with the attention mask) followed by the
tokens emitted after it. The loop creates the :class:`Sequences` and hands it to the emitter
(the only writer: :meth:`Sequences.append`, one token at a time, where transformers would
emit it, and :meth:`Sequences.truncate` where a stopping criterion ends a row behind its tokens), to acceptance (the logits processors' tokens so far, :meth:`Sequences.history`), to the
drafters (each row's tokens so far) and to the output (:meth:`Sequences.assembled`).
"""
from __future__ import annotations

import torch


class Sequences:
    """input_ids (B, L) the left-padded prompts, attention_mask (B, L); ``generated[b]`` row b's
    emitted tokens (read-only outside :meth:`append`)."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.generated: list[list[int]] = [[] for _ in range(input_ids.shape[0])]

    @property
    def batch(self) -> int:
        return len(self.generated)

    @property
    def prompt_len(self) -> int:
        """The padded prompt width (every row's generated tokens start there)."""
        return int(self.input_ids.shape[1])

    def append(self, row: int, token: int) -> None:
        self.generated[row].append(token)

    def truncate(self, row: int, length: int) -> None:
        """Row ``row`` keeps its first ``length`` generated tokens."""
        del self.generated[row][length:]

    def count(self, row: int) -> int:
        """Tokens row ``row`` has emitted."""
        return len(self.generated[row])

    @property
    def new_tokens(self) -> int:
        return sum(len(g) for g in self.generated)

    def prompts(self) -> list[list[int]]:
        """Each row's prompt tokens without its padding."""
        return [ids[mask].tolist() for ids, mask in zip(self.input_ids.cpu(), self.attention_mask.cpu().bool())]

    def so_far(self, row: int) -> torch.Tensor:
        """(1, L + n) row ``row``'s padded prompt then its tokens."""
        tail = torch.tensor(self.generated[row], dtype=self.input_ids.dtype, device=self.input_ids.device)
        return torch.cat([self.input_ids[row], tail])[None]

    def history(self, rows: torch.Tensor, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens so far of the given rows, as transformers' logits processors see them: the
        padded prompt (pads and all) then the generated tokens, right-filled with ``fill`` to a
        common width → ((R, L + T) ids, (R,) each row's own length)."""
        rows_list = rows.tolist()
        prompt = self.input_ids[rows.to(self.input_ids.device)]
        width = max((len(self.generated[r]) for r in rows_list), default=0)
        tail = torch.full((len(rows_list), width), fill, dtype=prompt.dtype)
        for i, r in enumerate(rows_list):
            tail[i, : len(self.generated[r])] = torch.tensor(self.generated[r], dtype=prompt.dtype)
        ends = torch.tensor([self.prompt_len + len(self.generated[r]) for r in rows_list])
        return torch.cat([prompt, tail.to(prompt.device)], dim=1), ends

    def assembled(self, pad: int) -> torch.Tensor:
        """(B, L + T) prompts then each row's tokens, right-filled with ``pad`` (transformers' shape)."""
        width = max(len(g) for g in self.generated)
        out = torch.full((self.batch, width), pad, dtype=self.input_ids.dtype)
        for row, tokens in enumerate(self.generated):
            out[row, : len(tokens)] = torch.tensor(tokens, dtype=self.input_ids.dtype)
        return torch.cat([self.input_ids, out.to(self.input_ids.device)], dim=1)
