"""Amphista heads (Li et al., arXiv 2406.13170): non-autoregressive drafting in which the K
heads *see each other*.

Medusa's heads guess their tokens independently; Hydra's condition on the drafted path, but
that costs one head call per depth. Amphista keeps one call for all K depths and lets the
heads exchange information bidirectionally instead:

1. **Staged adaptation layers** move the base's last hidden state h_t (fused with the input
   embedding of the root x_{t+1}, the token the base just produced) towards a space suited to
   drafting *several* tokens ahead. Stage 1 feeds the first ⌈K/2⌉ heads; stage 2, stacked on
   stage 1, feeds the later heads, whose targets lie further from what h_t encodes.
2. The **auto-embedding block** treats the K head slots as a short sequence (slot k = its
   stage's feature; a learned head-index embedding tells the slots apart) and runs one
   pre-norm self-attention layer *without* a causal mask + an MLP over it, so every head reads
   every other head's feature.
3. Per head, ``num_layers`` Medusa ResBlocks, then the frozen shared LM head (draft vocab).

Unlike the paper's variant, nothing here attends over the generated context: the heads are
position-wise (not ``contextual``), so training runs on cached features as cheaply as Hydra's.

Every output projection (fusion, MLP down, attention out, ResBlocks) starts at zero, and the
head-index embedding only enters the attention branch, never the residual stream: a fresh
Amphista drafts exactly what the base's LM head predicts from h_t, like fresh Medusa/Hydra.

Options: :class:`AmphistaOptions` (``config.options``; a recipe's ``heads.extra`` keys).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .head_config import HeadConfig, register
from .medusa import resblock_stacks
from .family_options import FamilyOptions
from .protocol import DraftHeads, TreeSpec, cartesian_probs, cartesian_tokens

#: Seed of the head-index embedding's init: construction stays independent of the global RNG
#: state for it (other modules are zeroed after their default init anyway).
POSITION_INIT_SEED = 0
POSITION_INIT_STD = 0.1


@dataclass(frozen=True)
class AmphistaOptions(FamilyOptions):
    """The auto-embedding block's and the MLPs' shape."""

    owner = "Amphista"
    #: attention heads of the auto-embedding block; must divide hidden_size (None: hidden_size // 64, at least 1)
    attn_heads: int | None = None
    #: inner width of every MLP (None: hidden_size)
    mlp_size: int | None = None
    #: SiLU-gated MLPs (``down(silu(gate) * value)``); False: a plain SiLU MLP
    gated: bool = True

    def resolved(self, hidden_size: int) -> tuple[int, int, bool]:
        """(attn_heads, mlp_size, gated) for heads of width ``hidden_size``, refusing an
        ``attn_heads`` that does not divide it."""
        attn_heads = self.attn_heads if self.attn_heads is not None else max(1, hidden_size // 64)
        if hidden_size % attn_heads:
            raise ValueError(f"Amphista option extra.attn_heads={attn_heads} must divide hidden_size={hidden_size}.")
        return attn_heads, self.mlp_size if self.mlp_size is not None else hidden_size, self.gated


class MLP(nn.Module):
    """SiLU MLP (gated: ``down(silu(gate) * value)``) whose down projection starts at zero, so
    a residual block built on it starts as the identity."""

    def __init__(self, hidden_size: int, mlp_size: int, gated: bool):
        super().__init__()
        self.gated = gated
        self.up = nn.Linear(hidden_size, (2 if gated else 1) * mlp_size, bias=False)
        self.down = nn.Linear(mlp_size, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, value = self.up(x).chunk(2, dim=-1)
            return self.down(nn.functional.silu(gate) * value)
        return self.down(nn.functional.silu(self.up(x)))


class AdaptationStage(nn.Module):
    """One staged adaptation layer: ``x + MLP(RMSNorm(x))``; the first stage first fuses the
    root's embedding in with ``x = h + W [h ; e(x_{t+1})]`` (W zero at init)."""

    def __init__(self, hidden_size: int, mlp_size: int, gated: bool, fuse_root: bool):
        super().__init__()
        self.fuse = nn.Linear(2 * hidden_size, hidden_size, bias=False) if fuse_root else None
        if self.fuse is not None:
            nn.init.zeros_(self.fuse.weight)
        self.norm = nn.RMSNorm(hidden_size, eps=1e-5)
        self.mlp = MLP(hidden_size, mlp_size, gated)

    def forward(self, x: torch.Tensor, root_embedding: torch.Tensor | None = None) -> torch.Tensor:
        if self.fuse is not None:
            if root_embedding is None:
                raise ValueError("The first Amphista stage fuses the root token's embedding: pass root_embedding.")
            x = x + self.fuse(torch.cat([x, root_embedding], dim=-1))
        return x + self.mlp(self.norm(x))


class AutoEmbeddingBlock(nn.Module):
    """Bidirectional (unmasked) pre-norm self-attention + MLP over the K head slots.

    The head-index embedding is added to the attention's *input* only (DETR-style), not to
    the residual stream: slots stay distinguishable to attention while a fresh block (zero
    output projections) is exactly the identity."""

    def __init__(self, hidden_size: int, num_slots: int, attn_heads: int, mlp_size: int, gated: bool):
        super().__init__()
        self.attn_heads = attn_heads
        generator = torch.Generator().manual_seed(POSITION_INIT_SEED)
        self.position = nn.Parameter(torch.randn(num_slots, hidden_size, generator=generator) * POSITION_INIT_STD)
        self.attn_norm = nn.RMSNorm(hidden_size, eps=1e-5)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.attn_out = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.attn_out.weight)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=1e-5)
        self.mlp = MLP(hidden_size, mlp_size, gated)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, K, d) → attention output (N, K, d); every slot attends to every slot."""
        n, k, d = x.shape
        q, key, v = self.qkv(self.attn_norm(x) + self.position.to(x.dtype)).view(
            n, k, 3, self.attn_heads, d // self.attn_heads).permute(2, 0, 3, 1, 4)
        mixed = nn.functional.scaled_dot_product_attention(q, key, v)  # no mask: bidirectional
        return self.attn_out(mixed.transpose(1, 2).reshape(n, k, d))

    def forward(self, slots: torch.Tensor) -> torch.Tensor:
        """slots (..., K, d) → (..., K, d)."""
        lead = slots.shape[:-2]
        x = slots.reshape(-1, *slots.shape[-2:])
        x = x + self.attend(x)
        x = x + self.mlp(self.mlp_norm(x))
        return x.reshape(*lead, *x.shape[-2:])


@register
class AmphistaHeads(DraftHeads):
    family = "amphista"
    display_name = "Amphista"
    options_class = AmphistaOptions

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        attn_heads, mlp_size, gated = self.family_options.resolved(config.hidden_size)
        d, k = config.hidden_size, config.num_heads
        #: stage index feeding each head: the first ⌈K/2⌉ heads read stage 1, the rest stage 2
        self.stage_of = [0 if head < math.ceil(k / 2) else 1 for head in range(k)]
        # A single head needs no second stage (an unused stage would only idle in DDP).
        self.stages = nn.ModuleList(AdaptationStage(d, mlp_size, gated, fuse_root=(s == 0))
                                    for s in range(max(self.stage_of) + 1))
        self.auto_embedding = AutoEmbeddingBlock(d, k, attn_heads, mlp_size, gated)
        self.heads = resblock_stacks(d, config.num_layers, k)

    def slots(self, hidden: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
        """Staged adaptation: hidden (..., d), roots (...) → each head's slot feature (..., K, d)."""
        features = []
        x = hidden
        for index, stage in enumerate(self.stages):
            x = stage(x, self.embed(roots, hidden.dtype) if index == 0 else None)
            features.append(x)
        return torch.stack([features[s] for s in self.stage_of], dim=-2)

    def head_states(self, slots: torch.Tensor) -> torch.Tensor:
        """Slot features (..., K, d) → the heads' final states (..., K, d), before the readout."""
        mixed = self.auto_embedding(slots)
        return torch.stack([head(mixed[..., i, :]) for i, head in enumerate(self.heads)], dim=-2)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        """hidden (..., d), tokens (..., ≥1) with tokens[..., 0] = x_{t+1} (the root; later
        columns, the teacher-forced path, are ignored) → draft logits (..., K, V_draft)."""
        if tokens is None or tokens.dim() != hidden.dim() or tokens.shape[-1] < 1 \
                or tokens.shape[:-1] != hidden.shape[:-1]:
            got = None if tokens is None else tuple(tokens.shape)
            raise ValueError(f"Amphista heads need the root token x_(t+1): tokens of shape "
                             f"{tuple(hidden.shape[:-1]) + (1,)} or wider (..., ≥1), got {got}.")
        return self.readout(self.head_states(self.slots(self.read(hidden), tokens[..., 0])))

    @torch.no_grad()
    def topk(self, hidden: torch.Tensor, roots: torch.Tensor, k: int) -> torch.Tensor:
        """(B, d), roots (B,) → (B, K, k) base token ids, best first."""
        logits = self(hidden, tokens=roots[..., None])
        return self.to_vocab(logits.topk(k, dim=-1).indices)

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, tree: TreeSpec, with_probs: bool = False):
        # Cartesian, as Medusa: the heads condition on the root, not on the drafted path.
        k = int(tree.rank.max()) + 1
        if not with_probs:
            return cartesian_tokens(self.topk(hidden, roots, k), roots, tree)
        ids, probs = self.top_candidates(self(hidden, tokens=roots[..., None]), k)
        return cartesian_tokens(ids, roots, tree), cartesian_probs(probs, tree)
