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
    families read ``rows`` (P,) directly; contextual ones read padded chunks (B, T) as sequences."""
    safe = rows.clamp(min=0)
    hidden = input_noise(table.hidden[safe].to(device, dtype), noise_alpha)
    tokens = table.targets[safe, :num_heads].clamp(min=0).to(device)
    if rows.dim() == 1:
        return model(hidden, tokens=tokens), rows
    valid = rows >= 0
    logits = model(hidden, tokens=tokens, attention_mask=valid.to(device))
    return logits[valid.to(device)], rows[valid]
