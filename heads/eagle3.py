"""EAGLE-3 (Li et al., arXiv 2503.01840): one decoder layer drafting autoregressively over the
base's fused low, middle and high layers — the head layout serving engines load (vLLM, SGLang).

The layer reads *pairs*: at position t, the state g_t and the embedding of the token after it,
x_{t+1}; its output o_t predicts x_{t+2} through the shared LM head (after the layer's own
``norm``). At the first draft step g_t is the fusion ``fc`` of the base's named layers at t
(``feature_layers``, EAGLE-3's low/middle/high: 2, 15, 27 of SmolLM2's 30; the base's final state
is not read); at every later step it is the layer's own previous output, paired with the token
drafted there. The layer attends over the pairs of the context (its own keys and values, kept
like one more base layer) and, inside a draft, over its ancestors' pairs.

Training runs that loop as decoding does (*training-time test*): step k (= head k, predicting
x_{t+k+2}) feeds each position the layer's step-(k-1) output with x_{t+k+1}, at position t+k, and
attends over the context's step-0 pairs up to t plus the position's own pairs of steps 1..k.

Decoding (:mod:`draftheads.decoding.head_state`): the layer runs over the prompt at the prefill and
over each step's tree slots after verification (each slot paired with the token accepted after it;
the accepted slots are kept), so its output at the last accepted slot gives the first draft depth;
:meth:`Eagle3Heads.propose` runs the layer once per deeper depth over that depth's nodes.

Names follow SpecForge's ``LlamaForCausalLMEagle3`` (``fc``, ``midlayer.*``, ``norm``), which the
engines' exports rename from; the draft vocabulary is the heads' ``vocab_ids`` (engines' ``d2t``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .family_options import FamilyOptions, OptionError
from .head_config import HeadConfig, register
from .hydra import _levels, rotate
from .protocol import DraftHeads, TreeSpec


@dataclass(frozen=True)
class Eagle3Options(FamilyOptions):
    """The draft layer's shape, as the base's own layers (engines build the layer from these)."""

    owner = "EAGLE-3"
    num_attention_heads: int | None = None  # None: hidden_size // 64
    num_key_value_heads: int | None = None  # None: num_attention_heads
    intermediate_size: int | None = None  # None: 4 · hidden_size
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def resolved(self, hidden_size: int) -> tuple[int, int, int]:
        """(attention heads, key/value heads, MLP width) for a layer of width ``hidden_size``."""
        heads = self.num_attention_heads or max(1, hidden_size // 64)
        kv = self.num_key_value_heads or heads
        if hidden_size % heads or heads % kv:
            raise OptionError(self.owner, "num_attention_heads", heads,
                              f"a divisor of hidden_size {hidden_size} and a multiple of num_key_value_heads {kv}")
        return heads, kv, self.intermediate_size or 4 * hidden_size


def eagle3_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layer of a base of ``num_hidden_layers`` layers, as vLLM and
    SpecForge choose them (2, L // 2, L − 3: SmolLM2's 30 → [2, 15, 27]); fewer on shallow bases."""
    wanted = (2, num_hidden_layers // 2, num_hidden_layers - 3)
    return sorted({min(max(layer, 1), num_hidden_layers - 1) for layer in wanted}) if num_hidden_layers > 1 else [0]


@dataclass
class DraftContext:
    """What a draft attends over besides itself: the layer's keys and values over each row's
    context, which slots are real, and the position of the row's next token (the first draft
    depth's pairs sit there)."""

    keys: torch.Tensor  # (B, H_kv, T, D)
    values: torch.Tensor  # (B, H_kv, T, D)
    valid: torch.Tensor  # (B, T) bool
    next_pos: torch.Tensor  # (B,) long

    def select(self, index: torch.Tensor) -> "DraftContext":
        """The context of rows ``index`` (one per path a caller reviews)."""
        return DraftContext(self.keys.index_select(0, index), self.values.index_select(0, index),
                            self.valid.index_select(0, index), self.next_pos.index_select(0, index))


class Eagle3Layer(nn.Module):
    """The draft decoder layer: q/k/v read [input_layernorm(embedding) ; hidden_norm(g)] (2d wide),
    the residual stream is g; then the base's gated MLP."""

    def __init__(self, hidden_size: int, heads: int, kv_heads: int, mlp: int, eps: float, theta: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, hidden_size // heads, theta
        self.input_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hidden_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * hidden_size, heads * self.head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * hidden_size, kv_heads * self.head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * hidden_size, kv_heads * self.head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(heads * self.head_dim, hidden_size, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden_size, mlp, bias=False)
        self.mlp.up_proj = nn.Linear(hidden_size, mlp, bias=False)
        self.mlp.down_proj = nn.Linear(mlp, hidden_size, bias=False)

    def qkv(self, g: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor):
        """g, embedded (B, T, d), positions (B, T) → q (B, H, T, D), k, v (B, H_kv, T, D), k and q rotated."""
        batch, length, _ = g.shape
        x = torch.cat([self.input_layernorm(embedded), self.hidden_norm(g)], dim=-1)
        attn = self.self_attn
        q = attn.q_proj(x).view(batch, length, self.heads, -1).transpose(1, 2)
        k = attn.k_proj(x).view(batch, length, self.kv_heads, -1).transpose(1, 2)
        v = attn.v_proj(x).view(batch, length, self.kv_heads, -1).transpose(1, 2)
        return rotate(q, positions, self.theta), rotate(k, positions, self.theta), v

    def finish(self, g: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream g (B, T, d) and attention's output (B, H, T, D) → the layer's output (B, T, d)."""
        batch, _, length, _ = attended.shape
        h = g + self.self_attn.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))
        mlp = self.mlp
        x = self.post_attention_layernorm(h)
        return h + mlp.down_proj(nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q (B, H, T, D) over k, v (B, H_kv, S, D) under mask (B, 1, T, S) bool → (B, H, T, D)."""
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def forward(self, g: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache=None) -> torch.Tensor:
        """Pairs (g, embedded) (B, T, d) at ``positions`` (B, T) over the cache's past (when given:
        a transformers ``Cache``, ``update(k, v, 0)``) and themselves, mask (B, 1, T, past + T)."""
        q, k, v = self.qkv(g, embedded, positions)
        if cache is not None:
            k, v = cache.update(k, v, 0)
        return self.finish(g, self.attend(q, k, v, mask))


@register
class Eagle3Heads(DraftHeads):
    """``num_heads`` = the draft steps trained (training-time test) and the deepest tree drafted."""

    family = "eagle3"
    display_name = "EAGLE-3"
    sequential = True
    contextual = True
    #: its layer pairs each position's state with the token after it (:meth:`contextualize`'s ``tokens``)
    reads_next_tokens = True
    #: :meth:`propose` attends over the layer's context (:class:`DraftContext`)
    drafts_in_context = True
    #: the fc reads named base layers (``feature_layers``), never the final state alone
    requires_feature_layers = True
    options_class = Eagle3Options

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        if not config.feature_layers:
            raise ValueError("EAGLE-3 heads read base layers: set feature_layers (EAGLE-3's low, middle and high "
                             "layer, e.g. [2, 15, 27] for a 30-layer base).")
        options = self.family_options
        d = config.hidden_size
        self.fusion = None  # EAGLE-3's fc reads the named layers alone, raw (no per-layer norm)
        self.fc = nn.Linear(len(config.feature_layers) * d, d, bias=False)
        self.midlayer = Eagle3Layer(d, *options.resolved(d), options.rms_norm_eps, options.rope_theta)
        self.norm = nn.RMSNorm(d, eps=options.rms_norm_eps)

    @property
    def context_from_prompt(self) -> bool:
        """The layer reads the whole sequence, prompt included, at the base's positions."""
        return True

    def read(self, features: torch.Tensor) -> torch.Tensor:
        """Features (..., d · (1 + n)) — the final state, then the named layers' — → fc over the
        named layers (..., d); a state of width d (the layer's own output) is read as it is."""
        d = self.config.hidden_size
        if features.shape[-1] == d:
            return features
        if features.shape[-1] != d * (1 + len(self.feature_layers)):
            return super().read(features)  # names the widths it takes
        return self.fc(features[..., d:])

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output (..., d) → draft logits (..., V_draft)."""
        return self.readout(self.norm(out))

    def contextualize(self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache=None,
                      tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The layer over pairs: fused states (B, T, d) and ``tokens`` (B, T), each position's next
        token, into ``cache`` → its outputs (B, T, d)."""
        if tokens is None:
            raise ValueError("EAGLE-3's layer pairs each state with the token after it: pass tokens (B, T).")
        return self.midlayer(hidden, self.embed(tokens, hidden.dtype), positions, mask, cache)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        """Training-time test over whole sequences: hidden (B, T, F) features, tokens (B, T, ≥K)
        (x_{t+1}, …), attention_mask (B, T) (1 = real, left-aligned) → draft logits (B, T, K, V_draft)."""
        if hidden.dim() != 3 or tokens is None or tokens.shape[-1] < self.num_heads:
            raise ValueError(f"EAGLE-3 heads read sequences: hidden (batch, positions, features) and tokens "
                             f"(batch, positions, ≥{self.num_heads}).")
        batch, length, _ = hidden.shape
        device = hidden.device
        valid = torch.ones(batch, length, dtype=torch.bool, device=device) if attention_mask is None \
            else attention_mask.bool()
        eye = torch.eye(length, dtype=torch.bool, device=device)
        causal = (torch.ones(length, length, dtype=torch.bool, device=device).tril()[None] & valid[:, None, :]) | eye
        positions = torch.arange(length, device=device).expand(batch, length)
        layer = self.midlayer
        g = self.read(hidden)
        keys, values, logits = [], [], []
        for step in range(self.num_heads):
            q, k, v = layer.qkv(g, self.embed(tokens[..., step], g.dtype), positions + step)
            keys.append(k)
            values.append(v)
            g = layer.finish(g, _ttt_attention(q, keys, values, causal[:, None]))
            logits.append(self.logits(g))
        return torch.stack(logits, dim=-2)

    def path_logits(self, hidden: torch.Tensor, tokens: torch.Tensor, context: DraftContext | None = None) -> torch.Tensor:
        """hidden (P, d) as :meth:`propose` reads it, tokens (P, K) = the root then the path's first
        K−1 drafts → (P, K, V_draft): each draft's distribution given the path before it, the layer
        run once per draft over ``context`` and the path's own pairs (as :meth:`propose` drafts)."""
        paths, device = tokens.shape[0], tokens.device
        past_k, past_v, past_valid, next_pos = _context_parts(context, paths, device)
        out, keys, values, logits = hidden[:, None], [], [], [self.logits(hidden)]
        for step in range(1, tokens.shape[1]):
            q, k, v = self.midlayer.qkv(out, self.embed(tokens[:, step, None], out.dtype), (next_pos + step - 1)[:, None])
            keys.append(k)
            values.append(v)
            mask = torch.cat([past_valid, past_valid.new_ones(paths, len(keys))], dim=1)[:, None, None]
            attended = self.midlayer.attend(q, _joined(past_k, keys, q.dtype), _joined(past_v, values, q.dtype), mask)
            out = self.midlayer.finish(out, attended)
            logits.append(self.logits(out[:, 0]))
        return torch.stack(logits, dim=1)

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, tree: TreeSpec, with_probs: bool = False,
                context: DraftContext | None = None):
        """``hidden`` (B, d): the layer's output at each row's last context pair (the root its next
        token); depth 1 is its top-k, each deeper depth one layer call over the nodes above it,
        attending over ``context`` (None: the draft's own pairs only, as calibration times it)."""
        batch, nodes = roots.shape[0], tree.num_nodes
        device = roots.device
        tokens = torch.empty(batch, nodes, dtype=torch.long, device=device)
        tokens[:, 0] = roots
        probs = torch.ones(batch, nodes, dtype=torch.float32, device=device) if with_probs else None
        outs = {0: hidden}  # slot → the layer output its children are read from
        past_k, past_v, past_valid, next_pos = _context_parts(context, batch, device)
        drafted: list[int] = []  # slots whose pairs are in (tree_k, tree_v), in order
        tree_k = tree_v = None
        parent = tree.parent.tolist()
        levels = _levels(tuple(parent), tuple(tree.depth.tolist()), tuple(tree.rank.tolist()))
        for d, (parents, children, parent_index, ranks) in enumerate(levels):
            if d > 0:  # the layer over the parents (depth d nodes) → their outputs
                slots = parents.tolist()
                g = torch.stack([outs[parent[s]] for s in slots], dim=1)  # (B, P, d)
                pos = (next_pos + d - 1)[:, None].expand(batch, len(slots))
                q, k, v = self.midlayer.qkv(g, self.embed(tokens[:, slots], g.dtype), pos)
                tree_k = k if tree_k is None else torch.cat([tree_k, k], dim=2)
                tree_v = v if tree_v is None else torch.cat([tree_v, v], dim=2)
                drafted += slots
                mask = _draft_mask(past_valid, drafted, slots, parent)
                keys = tree_k if past_k is None else torch.cat([past_k, tree_k], dim=2)
                values = tree_v if past_v is None else torch.cat([past_v, tree_v], dim=2)
                out = self.midlayer.finish(g, self.midlayer.attend(q, keys.to(q.dtype), values.to(q.dtype), mask))
                outs.update({s: out[:, i] for i, s in enumerate(slots)})
            state = torch.stack([outs[int(p)] for p in parents], dim=1)  # (B, P, d)
            logits = self.logits(state)  # (B, P, V_draft)
            if probs is None:
                top = self.to_vocab(logits.topk(int(ranks.max()) + 1, dim=-1).indices)
            else:
                top, top_probs = self.top_candidates(logits, int(ranks.max()) + 1)
                probs[:, children] = top_probs[:, parent_index, ranks]
            tokens[:, children] = top[:, parent_index, ranks]
        return (tokens, probs) if probs is not None else tokens


def _context_parts(context: DraftContext | None, batch: int, device) -> tuple:
    """(keys, values, valid (B, T), next positions (B,)) of ``context``; none: an empty context at position 0."""
    if context is None:
        return None, None, torch.zeros(batch, 0, dtype=torch.bool, device=device), torch.zeros(
            batch, dtype=torch.long, device=device)
    return context.keys, context.values, context.valid, context.next_pos


def _joined(past: torch.Tensor | None, own: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The context's keys (or values) then the path's own, along the sequence."""
    return torch.cat(([] if past is None else [past.to(dtype)]) + own, dim=2)


def _ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                   causal: torch.Tensor) -> torch.Tensor:
    """Training-time test's attention at step k = len(keys) - 1: each position over step 0's keys
    up to itself (``causal`` (B, 1, T, T)) and its own keys of steps 1..k → (B, H, T, D)."""
    groups = q.shape[1] // keys[0].shape[1]
    scale = q.shape[-1] ** -0.5
    k0 = keys[0].repeat_interleave(groups, dim=1)
    v0 = values[0].repeat_interleave(groups, dim=1)
    scores = (q @ k0.transpose(-1, -2)) * scale  # (B, H, T, T)
    scores = scores.masked_fill(~causal, float("-inf"))
    own = [(q * k.repeat_interleave(groups, dim=1)).sum(-1, keepdim=True) * scale for k in keys[1:]]  # (B, H, T, 1)
    weights = torch.softmax(torch.cat([scores, *own], dim=-1).float(), dim=-1).to(q.dtype)
    length = scores.shape[-1]
    out = weights[..., :length] @ v0
    for j, v in enumerate(values[1:]):
        out = out + weights[..., length + j, None] * v.repeat_interleave(groups, dim=1)
    return out


def _draft_mask(past_valid: torch.Tensor, drafted: list[int], slots: list[int], parent: list[int]) -> torch.Tensor:
    """The mask of one depth's pairs (``slots``) over the context (``past_valid`` (B, T)) and the
    drafted pairs so far (``drafted``, in cache order): each sees the real context, its ancestors'
    pairs and its own → (B, 1, P, T + len(drafted)) bool."""
    where = {s: i for i, s in enumerate(drafted)}
    tree = torch.zeros(len(slots), len(drafted), dtype=torch.bool)
    for row, slot in enumerate(slots):
        node = slot
        while node > 0:  # the root's pair is the context's last one
            tree[row, where[node]] = True
            node = parent[node]
    batch = past_valid.shape[0]
    tree = tree.to(past_valid.device)[None].expand(batch, -1, -1)
    past = past_valid[:, None, :].expand(batch, len(slots), past_valid.shape[1])
    return torch.cat([past, tree], dim=-1)[:, None]
