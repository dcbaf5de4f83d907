"""The heads' forward in training: draft logits for rows of a feature table, the recipe's input
noise on the hidden states, per position or, for contextual families, over sequence chunks
(the loss and the evaluation both run it)."""
from __future__ import annotations

import torch

from .features import Features
from .losses import input_noise


def head_logits(model, table: Features, rows: torch.Tensor, num_heads: int, device, dtype,
                noise_alpha: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits (P, K, V) for ``rows`` and the rows they belong to, flattened: per-position
    families read ``rows`` (P,) directly; contextual ones read padded chunks (B, T) as sequences.
    The heads read :meth:`Features.inputs` (the final state, then the named layers' states when
    the table holds them); the input noise is each state's, as the final state alone gets it."""
    safe = rows.clamp(min=0)
    hidden = state_noise(table.inputs(safe, dtype).to(device), table.hidden.shape[-1], noise_alpha)
    tokens = table.targets[safe, :num_heads].clamp(min=0)
    if table.next_tokens is not None:  # rows without targets (a prompt's) still pair with the token after them
        tokens[..., 0] = table.next_tokens[safe]
    tokens = tokens.to(device)
    if rows.dim() == 1:
        return model(hidden, tokens=tokens), rows
    valid = rows >= 0
    logits = model(hidden, tokens=tokens, attention_mask=valid.to(device))
    return logits[valid.to(device)], rows[valid]


def state_noise(inputs: torch.Tensor, hidden_size: int, alpha: float) -> torch.Tensor:
    """:func:`~.losses.input_noise` on the heads' input (..., d · (1 + n)), scaled for each state of
    width d (U(-1, 1) · alpha / sqrt(d) per element, the final state's noise whatever n): for the
    final state alone, the very draws of ``input_noise(hidden, alpha)``."""
    if alpha <= 0 or inputs.shape[-1] == hidden_size:
        return input_noise(inputs, alpha)
    return input_noise(inputs.unflatten(-1, (-1, hidden_size)), alpha).flatten(-2)
