"""Medusa heads (Cai et al., arXiv 2401.10774): K independent residual MLPs on the base's
last hidden state, read out through the shared frozen LM head. Head k predicts the token
k+2 positions ahead (head 0 = the token after the one the base is about to emit)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .head_config import HeadConfig, register
from .family_options import FamilyOptions
from .protocol import DraftHeads, TreeSpec, cartesian_probs, cartesian_tokens


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` with W = 0 at init, so a fresh head starts as the identity
    (i.e. predicts what the base LM head predicts) instead of noise."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


@dataclass(frozen=True)
class MedusaOptions(FamilyOptions):
    """Medusa has no options of its own (depth and width are ``num_heads`` / ``num_layers``)."""

    owner = "Medusa"


def resblock_stacks(hidden_size: int, num_layers: int, count: int) -> nn.ModuleList:
    """``count`` stacks of ``num_layers`` ResBlocks, every block its own module:
    ``[ResBlock(d)] * n`` would tie their weights (Medusa PR #133)."""
    return nn.ModuleList(nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers))) for _ in range(count))


@register
class MedusaHeads(DraftHeads):
    """With ``config.owns_lm_head`` every head ends in its own ``Linear(d, V_draft)`` (Medusa-1's
    published layout, see :mod:`.checkpoint.medusa_import`) instead of the shared frozen LM head."""

    family = "medusa"
    display_name = "Medusa"
    supports_owned_lm_head = True
    options_class = MedusaOptions

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        self.heads = resblock_stacks(config.hidden_size, config.num_layers, config.num_heads)
        if config.owns_lm_head:
            vocab = config.draft_vocab_size or config.vocab_size
            self.lm_heads = nn.ModuleList(nn.Linear(config.hidden_size, vocab, bias=False)
                                          for _ in range(config.num_heads))

    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., d) → (..., K, d): each head's transformed hidden state."""
        return torch.stack([head(hidden) for head in self.heads], dim=-2)

    def forward(self, hidden: torch.Tensor, **_: object) -> torch.Tensor:
        states = self.head_states(self.read(hidden))
        return self.owned_readout(states) if self.config.owns_lm_head else self.readout(states)

    def owned_readout(self, states: torch.Tensor) -> torch.Tensor:
        """(..., K, d) → (..., K, V_draft) through each head's own projection, in its own dtype
        (``draft_dtype`` is not applied: it would copy K vocabulary matrices per call)."""
        return torch.stack([lm(states[..., k, :].to(lm.weight.dtype)) for k, lm in enumerate(self.lm_heads)], dim=-2)

    @torch.no_grad()
    def topk(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """(B, d) → (B, K, k) base token ids, best first."""
        logits = self(hidden)
        return self.to_vocab(logits.topk(k, dim=-1).indices)

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, tree: TreeSpec, with_probs: bool = False):
        k = int(tree.rank.max()) + 1
        if not with_probs:
            return cartesian_tokens(self.topk(hidden, k), roots, tree)
        ids, probs = self.top_candidates(self(hidden), k)
        return cartesian_tokens(ids, roots, tree), cartesian_probs(probs, tree)
