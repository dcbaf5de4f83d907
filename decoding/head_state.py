"""What the heads read at each step: the base's hidden state at the last accepted token, or,
for contextual families (Hydra++), their own layer's output over the generated context.

A contextual family's layer keeps keys/values like one more base layer: each step it runs
over the same tree slots as the verifier, with the same ancestor mask, and the same accepted
slots are compacted into its cache (:class:`KVState`), so nothing is recomputed over the
context and every row keeps its own length.

A listener (:func:`listening`; training's feature capture) hears every verification's states
with the caller's row of each: what the decoder computes anyway, kept instead of recomputed.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Protocol

import torch

from ..heads import DraftHeads
from .accept import Acceptance
from .base.cache import KVState
from .drafters.step_trees import StepTrees


class StateListener(Protocol):
    def verified(self, rows: torch.Tensor, states: torch.Tensor, result: Acceptance) -> None:
        """rows (R,) the caller's row of each live row; states (R, N, d) every tree slot's final
        hidden state; ``result.path[:, :accepted + 1]`` the slots of the tokens each row kept."""


_LISTENER: ContextVar[StateListener | None] = ContextVar("draftheads_state_listener", default=None)


@contextmanager
def listening(listener: StateListener) -> Iterator[None]:
    """Decoding calls made inside the block tell ``listener`` every verification's states."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)


class HeadState:
    """Per-row head input (``hidden``, (B, d)) maintained across verification steps."""

    def __init__(self, heads: DraftHeads | None, last_hidden: torch.Tensor):
        self.heads = heads
        self.kv: KVState | None = None
        self.hidden = last_hidden
        self.listener = _LISTENER.get()
        # the caller's row of each live row, kept only for a listener (the loop has its own ``live``)
        self.rows = torch.arange(last_hidden.shape[0]) if self.listener is not None else None
        if heads is not None and heads.contextual:
            from transformers import DynamicCache

            batch, device = last_hidden.shape[0], last_hidden.device
            # The layer's context starts at the last prompt token (position 0), as in training.
            first = torch.ones(batch, 1, dtype=torch.bool, device=device)
            cache = DynamicCache()
            out = heads.contextualize(last_hidden[:, None], torch.zeros(batch, 1, dtype=torch.long, device=device),
                                      first[:, None, None, :], cache)
            self.kv = KVState.after_prefill(cache, first)
            self.hidden = out[:, 0]

    def step(self, states: torch.Tensor, drafts: StepTrees, result: Acceptance) -> None:
        """After a verification: ``states`` (B, N, d) of every tree slot; keep the accepted ones."""
        if self.listener is not None:
            self.listener.verified(self.rows, states, result)
        rows = torch.arange(states.shape[0], device=states.device)
        if self.kv is None:
            self.hidden = states[rows, result.best]
            return
        mask, positions, past = self.kv.tree_inputs(drafts.ancestor, drafts.depth)
        out = self.heads.contextualize(states, positions, mask, self.kv.cache)
        self.kv.commit(result.path + past, result.accepted + 1)
        self.hidden = out[rows, result.best]

    def select_rows(self, keep: torch.Tensor) -> None:
        """Finished rows leave the batch."""
        self.hidden = self.hidden[keep]
        if self.rows is not None:
            self.rows = self.rows[keep.cpu()]
        if self.kv is not None:
            self.kv.select_rows(keep)
