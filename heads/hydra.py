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

import torch
from torch import nn

from .medusa import ResBlock
from .protocol import DraftHeads, HeadConfig, TreeSpec, register


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
    sequential = True

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        self.heads = nn.ModuleList(HydraHead(config.hidden_size, k + 1, config.num_layers)
                                   for k in range(config.num_heads))

    def embed(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Input embeddings of base token ids from the frozen, shared table (never a copy)."""
        table = self.shared.embed_weight
        if table is None:
            raise RuntimeError("Hydra heads read the base's input embeddings: bind them with "
                               "heads.bind(lm_head_weight, embed_weight).")
        return nn.functional.embedding(tokens.clamp(min=0), table).to(dtype)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        """Teacher-forced training/eval: hidden (P, d), tokens (P, ≥K) = x_{t+1}.. → (P, K, V_draft)."""
        if tokens is None or tokens.shape[-1] < self.num_heads:
            raise ValueError(f"Hydra heads need the path tokens x_(t+1)..x_(t+{self.num_heads}) "
                             f"(tokens of shape (..., ≥{self.num_heads})).")
        embedded = self.embed(tokens[..., : self.num_heads], hidden.dtype)
        states = [head(hidden, embedded[..., : k + 1, :]) for k, head in enumerate(self.heads)]
        return self.readout(torch.stack(states, dim=-2))

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, tree: TreeSpec) -> torch.Tensor:
        batch, nodes = roots.shape[0], tree.num_nodes
        tokens = torch.empty(batch, nodes, dtype=torch.long, device=roots.device)
        tokens[:, 0] = roots
        # path_embeddings[b, slot] = embeddings root→slot (filled level by level)
        paths: dict[int, torch.Tensor] = {0: self.embed(roots, hidden.dtype)[:, None, :]}
        levels = _levels(tuple(tree.parent.tolist()), tuple(tree.depth.tolist()), tuple(tree.rank.tolist()))
        for d, (parents, children, parent_index, ranks) in enumerate(levels):
            context = torch.stack([paths[int(p)] for p in parents], dim=1)  # (B, P, d+1, dim)
            state = self.heads[d](hidden[:, None, :].expand(-1, parents.numel(), -1), context)
            top = self.readout(state).topk(int(ranks.max()) + 1, dim=-1).indices  # (B, P, k)
            chosen = self.to_vocab(top[:, parent_index, ranks])  # (B, nodes at depth d+1)
            tokens[:, children] = chosen
            embedded = self.embed(chosen, hidden.dtype)
            for i, slot in enumerate(children.tolist()):
                paths[slot] = torch.cat([context[:, int(parent_index[i])], embedded[:, i, None]], dim=1)
        return tokens
