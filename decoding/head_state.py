"""What the heads read at each step: the base's hidden state at the last accepted token, or,
for contextual families (Hydra++), their own layer's output over the generated context.

A contextual family's layer keeps keys/values like one more base layer: each step it runs
over the same tree slots as the verifier, with the same ancestor mask, and the same accepted
slots are compacted into its cache (:class:`KVState`), so nothing is recomputed over the
context and every row keeps its own length. Its cache starts at the last prompt token, or, for
heads that read the prompt (``context_from_prompt``), holds the whole prompt laid out as the
base's cache (:func:`over_prompt`).

A listener (:func:`listening`; training's feature capture) hears the prefill's states and every
verification's with the caller's row of each: what the decoder computes anyway, kept instead of
recomputed.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Protocol

import torch

from ..heads import DraftHeads
from ..heads.eagle3 import DraftContext
from .accept import Acceptance
from .base.cache import KVState, reserved_cache
from .base.forward import final_states
from .step_trees import StepTrees


class StateListener(Protocol):
    def prefilled(self, states: torch.Tensor) -> None:
        """states (B, T, d): every prompt position's final hidden state from the prefill, laid out
        as the prompt (left padding; zeros at the padding when the prefill ran packed)."""

    def verified(self, rows: torch.Tensor, states: torch.Tensor, result: Acceptance) -> None:
        """rows (R,) the caller's row of each live row; states (R, N, d) every tree slot's final
        hidden state; ``result.path[:, :accepted + 1]`` the slots of the tokens each row kept."""


_LISTENER: ContextVar[StateListener | None] = ContextVar("draftheads_state_listener", default=None)


@contextmanager
def listening(listener: StateListener) -> Iterator[None]:
    """Decoding calls made inside the block tell ``listener`` the prefill's states and every
    verification's."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)


def taps_of(heads: DraftHeads | None) -> tuple[int, ...]:
    """The base layers a step's forward keeps for ``heads`` beside the final state (:mod:`draftheads.heads.fusion`)."""
    return heads.feature_layers if heads is not None else ()


class HeadState:
    """Per-row head input (``hidden``, (B, d)) maintained across verification steps.

    ``last_hidden`` (B, F): the base's features at each row's last prompt token — its final state
    (F = d), or for heads that read more layers the features of
    :func:`~draftheads.decoding.base.forward.with_taps` for :attr:`taps` (F = d · (1 + n)), which the
    heads fuse (:meth:`~draftheads.heads.DraftHeads.read`) into ``hidden``. Heads whose layer
    reads the prompt (:attr:`~draftheads.heads.DraftHeads.context_from_prompt`) also take
    ``prompt_states`` (B, T, F), every prompt position's, and the prompt's ``attention_mask``
    (B, T) (left padding 0); they are read once here (and told to a listener, :func:`listening`,
    final states only) and not kept."""

    def __init__(self, heads: DraftHeads | None, last_hidden: torch.Tensor, prompt_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                 roots: torch.Tensor | None = None):
        self.heads = heads
        self.taps = taps_of(heads)
        #: the base's width: the final state's share of the features
        self.width = last_hidden.shape[-1] // (1 + len(self.taps))
        self.kv: KVState | None = None
        self.hidden = heads.read(last_hidden) if heads is not None else last_hidden
        self.listener = _LISTENER.get()
        # the caller's row of each live row, kept only for a listener (the loop has its own ``live``)
        self.rows = torch.arange(last_hidden.shape[0]) if self.listener is not None else None
        if self.listener is not None and prompt_states is not None:
            self.listener.prefilled(final_states(prompt_states, self.width))
        if heads is None or not heads.contextual:
            return
        if heads.context_from_prompt:
            if prompt_states is None or attention_mask is None:
                raise ValueError(f"{type(heads).__name__} read the whole prompt: pass HeadState the prefill's "
                                 "prompt_states (B, T, d) and attention_mask (prefill(..., all_states=True)).")
            tokens = None
            if heads.reads_next_tokens:  # each prompt position's next token: the prompt's, the root last
                if input_ids is None or roots is None:
                    raise ValueError(f"{type(heads).__name__} pair each state with the token after it: pass HeadState "
                                     "the prompt's input_ids and the first tokens (roots).")
                tokens = torch.cat([input_ids[:, 1:], roots[:, None].to(input_ids.device)], dim=1)
            self.kv, self.hidden = over_prompt(heads, heads.read(prompt_states), attention_mask, tokens)
            return
        from transformers import DynamicCache

        batch, device = last_hidden.shape[0], last_hidden.device
        # The layer's context starts at the last prompt token (position 0), as in training.
        first = torch.ones(batch, 1, dtype=torch.bool, device=device)
        cache = DynamicCache()
        out = heads.contextualize(self.hidden[:, None], torch.zeros(batch, 1, dtype=torch.long, device=device),
                                  first[:, None, None, :], cache)
        self.kv = KVState.after_prefill(cache, first)
        self.hidden = out[:, 0]

    def step(self, states: torch.Tensor, trees: StepTrees, result: Acceptance) -> None:
        """After a verification: ``states`` (B, N, F) of every tree slot (features, as
        ``last_hidden``); keep the accepted ones."""
        if self.listener is not None:
            self.listener.verified(self.rows, final_states(states, self.width), result)
        rows = torch.arange(states.shape[0], device=states.device)
        if self.kv is None:
            chosen = states[rows, result.best]
            self.hidden = self.heads.read(chosen) if self.heads is not None else chosen
            return
        mask, positions, past = self.kv.tree_inputs(trees.ancestor, trees.depth)
        extra = {"tokens": next_tokens(trees.tokens, result)} if self.heads.reads_next_tokens else {}
        out = self.heads.contextualize(self.heads.read(states), positions, mask, self.kv.cache, **extra)
        self.kv.commit(result.path + past, result.accepted + 1)
        self.hidden = out[rows, result.best]

    def draft_context(self):
        """What heads that draft in their context (``drafts_in_context``: EAGLE-3) attend over at the
        next step: their layer's keys, values, real slots and each row's next position; else None."""
        if self.heads is None or not self.heads.drafts_in_context or self.kv is None:
            return None
        layer = self.kv.cache.layers[0]
        return DraftContext(layer.keys, layer.values, self.kv.valid, self.kv.next_pos)

    def select_rows(self, keep: torch.Tensor) -> None:
        """Finished rows leave the batch."""
        self.hidden = self.hidden[keep]
        if self.rows is not None:
            self.rows = self.rows[keep.cpu()]
        if self.kv is not None:
            self.kv.select_rows(keep)


def next_tokens(tokens: torch.Tensor, result: Acceptance) -> torch.Tensor:
    """Each tree slot's next token (B, N) for heads that pair a state with the token after it: on
    each row's accepted path the next accepted token, the bonus after the last; 0 elsewhere (those
    slots are dropped from the heads' cache)."""
    batch, nodes = tokens.shape
    path = result.path  # (B, D+1) slots root→best, padded with best
    rows = torch.arange(batch, device=tokens.device)
    steps = torch.arange(path.shape[1], device=tokens.device)[None]
    following = torch.cat([tokens.gather(1, path[:, 1:]), path.new_zeros(batch, 1)], dim=1)  # (B, D+1)
    following[rows, result.accepted] = result.bonus.to(following.dtype)
    on_path = steps <= result.accepted[:, None]
    out = tokens.new_zeros(batch, nodes + 1)  # column N takes the slots off the path
    out.scatter_(1, torch.where(on_path, path, nodes), torch.where(on_path, following, 0))
    return out[:, :nodes]


def over_prompt(heads: DraftHeads, states: torch.Tensor, attention_mask: torch.Tensor,
                tokens: torch.Tensor | None = None) -> tuple[KVState, torch.Tensor]:
    """The heads' layer over every prompt state (B, T, d) into its own cache, laid out as the
    base's (:meth:`KVState.after_prefill`: same slots, same positions, left padding masked out)
    → (its KVState, its output at the last prompt token (B, d)). The cache reserves room ahead,
    as the base's does: it spans the whole prompt, so a step writes its slots instead of copying it."""
    valid = attention_mask.bool()  # (B, T)
    length = valid.shape[1]
    positions = (valid.long().cumsum(-1) - 1).masked_fill(~valid, 1)  # as the base's prefill numbers them
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=valid.device)
    mask = ((causal[None] & valid[:, None, :]) | eye)[:, None]  # (B, 1, T, T); padding rows see themselves: finite
    # padding states are zeroed: masked keys still enter the product (0 · NaN would be NaN)
    hidden = states.masked_fill(~valid[..., None], 0)
    cache = reserved_cache(None)  # one layer, made on first use
    extra = {} if tokens is None else {"tokens": tokens}  # each position's next token (heads that pair them)
    out = heads.contextualize(hidden, positions, mask, cache, **extra)  # (B, T, d)
    return KVState.after_prefill(cache, attention_mask), out[:, -1].clone()
