"""Hydra heads (Ankner et al., arXiv 2402.05109): *sequentially dependent* draft heads.

Head k predicts token t+k+2 from the base's hidden state h_t **and** the input embeddings of
the tokens before it on its own candidate path, x_{t+1} (the root the base just produced)
.. x_{t+k+1}. Medusa heads must guess x_{t+k+2} without knowing what they drafted before;
a Hydra head conditions on it, which is what lifts the acceptance of the deeper heads.

Each head: ``z = h_t + W_in [h_t ; e(x_{t+1}) ; … ; e(x_{t+k+1})]`` (W_in zero at init, so a
fresh head starts as the base's own LM head on h_t), then ``num_layers`` ResBlocks, then the
frozen shared LM head. Drafting a tree is one batched head call per depth over every parent
node at that depth (a node's children are the top-k of its own path's distribution).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from .head_config import HeadConfig, register
from ..core.kept import kept
from .medusa import ResBlock
from .family_options import FamilyOptions, OptionError
from .protocol import DraftHeads, TreeSpec


@dataclass(frozen=True)
class HydraOptions(FamilyOptions):
    """Hydra has no options of its own (depth and width are ``num_heads`` / ``num_layers``)."""

    owner = "Hydra"


#: what Hydra++'s prefix layer attends over (:attr:`HydraPlusPlusOptions.prefix_context`)
PREFIX_CONTEXTS = ("answer", "sequence")


@dataclass(frozen=True)
class HydraPlusPlusOptions(FamilyOptions):
    """Hydra++'s prefix layer (:class:`PrefixLayer`)."""

    owner = "Hydra++"
    #: attention heads of the prefix layer; must split hidden_size into even head sizes
    #: (None: hidden_size // 64, at least 1)
    prefix_heads: int | None = None
    #: the prefix layer's MLP width (None: 4 · hidden_size)
    prefix_mlp_size: int | None = None
    #: what the prefix layer attends over: "answer" (its context starts at the last prompt token,
    #: positions from 0 there: what every checkpoint without the key was trained on) or
    #: "sequence" (the paper's: the whole prompt and answer, positions as the base's)
    prefix_context: str = "answer"
    #: dropout on what the heads read (the prefix layer's output) while training, as the Hydra++
    #: recipe's 0.2; decoding never drops (the heads run in eval mode)
    dropout: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefix_context not in PREFIX_CONTEXTS:
            raise OptionError(self.owner, "prefix_context", self.prefix_context, "'answer' or 'sequence'")
        if not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool) or not 0 <= self.dropout < 1:
            raise OptionError(self.owner, "dropout", self.dropout, "a number in [0, 1)")

    def to_extra(self) -> dict:
        """As :meth:`FamilyOptions.to_extra`, without ``prefix_context`` "answer" and ``dropout``
        0: a config written before the keys existed means those and writes back unchanged."""
        extra = super().to_extra()
        if extra.get("prefix_context") == "answer":
            del extra["prefix_context"]
        if not extra.get("dropout", 0):
            extra.pop("dropout", None)
        return extra

    def resolved(self, hidden_size: int) -> tuple[int, int]:
        """(prefix_heads, prefix_mlp_size) for heads of width ``hidden_size``."""
        heads = self.prefix_heads if self.prefix_heads is not None else max(1, hidden_size // 64)
        return heads, self.prefix_mlp_size if self.prefix_mlp_size is not None else 4 * hidden_size


class HydraHead(nn.Module):
    """One head reading h_t and the embeddings of ``num_tokens`` path tokens."""

    def __init__(self, hidden_size: int, num_tokens: int, num_layers: int):
        super().__init__()
        self.mix = nn.Linear(hidden_size * (num_tokens + 1), hidden_size)
        nn.init.zeros_(self.mix.weight)
        nn.init.zeros_(self.mix.bias)
        self.blocks = nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers)))

    def forward(self, hidden: torch.Tensor, path_embeddings: torch.Tensor) -> torch.Tensor:
        """hidden (..., d), path_embeddings (..., k, d) → head state (..., d)."""
        flat = torch.cat([hidden, path_embeddings.flatten(-2)], dim=-1)
        return self.blocks(hidden + self.mix(flat))


@functools.lru_cache(maxsize=128)
@kept
def _levels(parent: tuple[int, ...], depth: tuple[int, ...], rank: tuple[int, ...]):
    """Per depth d ≥ 1: (the distinct parent slots of depth-d nodes, the depth-d node slots,
    each node's index into that parent list, each node's rank). Cached per tree shape."""
    levels = []
    for d in range(1, max(depth) + 1):
        nodes = [n for n in range(len(depth)) if depth[n] == d]
        parents = sorted({parent[n] for n in nodes})
        where = {p: i for i, p in enumerate(parents)}
        levels.append((torch.tensor(parents), torch.tensor(nodes), torch.tensor([where[parent[n]] for n in nodes]),
                       torch.tensor([rank[n] for n in nodes])))
    return levels


@register
class HydraHeads(DraftHeads):
    family = "hydra"
    display_name = "Hydra"
    sequential = True
    options_class = HydraOptions

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        self.heads = nn.ModuleList(HydraHead(config.hidden_size, k + 1, config.num_layers)
                                   for k in range(config.num_heads))

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        """Teacher-forced training/eval: hidden (P, d), tokens (P, ≥K) = x_{t+1}.. → (P, K, V_draft)."""
        if tokens is None or tokens.shape[-1] < self.num_heads:
            raise ValueError(f"Hydra heads need the path tokens x_(t+1)..x_(t+{self.num_heads}) "
                             f"(tokens of shape (..., ≥{self.num_heads})).")
        hidden = self.read(hidden)
        embedded = self.embed(tokens[..., : self.num_heads], hidden.dtype)
        states = [head(hidden, embedded[..., : k + 1, :]) for k, head in enumerate(self.heads)]
        return self.readout(torch.stack(states, dim=-2))

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, tree: TreeSpec, with_probs: bool = False):
        batch, nodes = roots.shape[0], tree.num_nodes
        tokens = torch.empty(batch, nodes, dtype=torch.long, device=roots.device)
        tokens[:, 0] = roots
        probs = torch.ones(batch, nodes, dtype=torch.float32, device=roots.device) if with_probs else None
        # paths[slot] = (B, depth+1, dim): the embeddings of the tokens root→slot, filled level by level
        paths: dict[int, torch.Tensor] = {0: self.embed(roots, hidden.dtype)[:, None, :]}
        levels = _levels(tuple(tree.parent.tolist()), tuple(tree.depth.tolist()), tuple(tree.rank.tolist()))
        for d, (parents, children, parent_index, ranks) in enumerate(levels):
            context = torch.stack([paths[int(p)] for p in parents], dim=1)  # (B, P, d+1, dim)
            state = self.heads[d](hidden[:, None, :].expand(-1, parents.numel(), -1), context)
            logits = self.readout(state)  # (B, P, V_draft)
            if probs is None:
                top = self.to_vocab(logits.topk(int(ranks.max()) + 1, dim=-1).indices)  # (B, P, k)
            else:
                top, top_probs = self.top_candidates(logits, int(ranks.max()) + 1)
                probs[:, children] = top_probs[:, parent_index, ranks]
            chosen = top[:, parent_index, ranks]  # (B, nodes at depth d+1)
            tokens[:, children] = chosen
            embedded = self.embed(chosen, hidden.dtype)
            for i, slot in enumerate(children.tolist()):
                paths[slot] = torch.cat([context[:, int(parent_index[i])], embedded[:, i, None]], dim=1)
        return (tokens, probs) if probs is not None else tokens


def rotate(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of x (B, H, T, D) at integer positions (B, T)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / base ** (torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions[:, None, :, None].float() * inv_freq  # (B, 1, T, half)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class PrefixLayer(nn.Module):
    """Hydra++'s extra decoder layer over the base's last hidden states (pre-norm causal
    self-attention with RoPE, then a SiLU MLP), so the heads read a context summary trained
    for drafting rather than the base's own next-token state. Output projections start at
    zero: a fresh layer is the identity and a fresh Hydra++ equals Hydra.

    Attention goes through a transformers ``Cache`` (``update(k, v, 0)``) when given one, so
    the decoder keeps this layer's keys/values exactly like the base's: one tree per step,
    accepted slots compacted, no recomputation over the context."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_size: int):
        super().__init__()
        if hidden_size % num_heads or (hidden_size // num_heads) % 2:
            raise ValueError(f"prefix_heads={num_heads} must divide hidden_size={hidden_size} into even head sizes.")
        self.num_heads = num_heads
        self.attn_norm = nn.RMSNorm(hidden_size, eps=1e-5)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.attn_out = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=1e-5)
        self.up = nn.Linear(hidden_size, 2 * mlp_size, bias=False)
        self.down = nn.Linear(mlp_size, hidden_size, bias=False)
        nn.init.zeros_(self.attn_out.weight)
        nn.init.zeros_(self.down.weight)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache=None) -> torch.Tensor:
        """x (B, T, d), positions (B, T), mask (B, 1, T, T_past+T) bool (True = may attend)."""
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, positions), rotate(k, positions)
        if cache is not None:
            k, v = cache.update(k, v, 0)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.attn_out(attended.transpose(1, 2).reshape(batch, length, dim))
        gate, value = self.up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * value)


@register
class HydraPlusPlusHeads(HydraHeads):
    """Hydra++: Hydra heads (deeper MLPs: ``num_layers``) reading the output of a trained
    :class:`PrefixLayer` over the context instead of the raw hidden state.

    What the prefix layer attends over is ``prefix_context`` (:class:`HydraPlusPlusOptions`):

    - "answer": the context from the last prompt token on, positions counted from 0 there.
      Training feeds :meth:`forward` the answer's positions only; the decoder starts the
      layer's cache at the last prompt token. Every checkpoint without the key is this.
    - "sequence" (the paper's): the whole sequence, prompt included, positions as the base's.
      Training feeds :meth:`forward` prompt + answer; the decoder runs the layer over every
      prompt state at the prefill and keeps its cache over prompt + answer
      (:attr:`context_from_prompt`)."""

    family = "hydra++"
    display_name = "Hydra++"
    contextual = True
    options_class = HydraPlusPlusOptions

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        self.prefix = PrefixLayer(config.hidden_size, *self.family_options.resolved(config.hidden_size))
        self.dropout = nn.Dropout(self.family_options.dropout)

    @property
    def context_from_prompt(self) -> bool:
        """Whether ``prefix_context`` is "sequence" (the decoder then runs the layer over the prompt)."""
        return self.family_options.prefix_context == "sequence"

    def contextualize(self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                      cache=None) -> torch.Tensor:
        """Base hidden states (B, T, d) → what the heads read at each position."""
        return self.prefix(hidden, positions, mask, cache)

    def path_logits(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """While decoding the heads read the prefix layer's output (``hidden`` here), one position per path."""
        return HydraHeads.forward(self, hidden, tokens=tokens)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        """Training/eval on whole sequences: hidden (B, T, d), tokens (B, T, ≥K), attention_mask
        (B, T) (1 = real position, left-aligned) → draft logits (B, T, K, V_draft). Positions
        count from 0 at each row's first position: the last prompt token for "answer" heads,
        the first prompt token for "sequence" heads (then they equal the base's, as decoding
        has them)."""
        if hidden.dim() != 3:
            raise ValueError("Hydra++ heads read sequences: hidden must be (batch, positions, hidden_size).")
        batch, length, _ = hidden.shape
        valid = torch.ones(batch, length, dtype=torch.bool, device=hidden.device) if attention_mask is None \
            else attention_mask.bool()
        causal = torch.ones(length, length, dtype=torch.bool, device=hidden.device).tril()
        mask = (causal[None] & valid[:, None, :])[:, None]
        mask = mask | torch.eye(length, dtype=torch.bool, device=hidden.device)  # padded rows stay finite
        positions = torch.arange(length, device=hidden.device).expand(batch, length)
        return super().forward(self.dropout(self.contextualize(self.read(hidden), positions, mask)), tokens=tokens)
