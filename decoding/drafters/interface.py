"""The drafting contract (transformers' ``CandidateGenerator`` idea, batch-first).

A :class:`Drafter` sees each live row's state (:class:`DraftState`) and the policy's tree (its
node budget, and the shape the heads fill) and returns one tree per row
(:class:`~..step_trees.StepTrees`); after the verification it hears what each row accepted. A
:class:`LookupSource` is one row's lookup source (context, store, statistics, or any other
registered in :mod:`.registry`): it hears the row's new tokens and proposes a scored candidate
trie.

Every draft node is a fixed token given the row's history (a point mass), whoever proposed
it, so the acceptance rules and their proof in :mod:`..accept` hold for every drafter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from ..tree import Tree, chain_tree
from .candidates import Candidates
from ..step_trees import StepTrees

if TYPE_CHECKING:  # the result a drafter observes: a type only
    from ..accept import Acceptance


@dataclass
class DraftState:
    """What a drafter may read about the live rows before a step."""

    roots: torch.Tensor  # (B,) the token each row ends with (emitted, not yet in the cache)
    hidden: torch.Tensor  # (B, d) what the heads read (HeadState.hidden)
    rows: list[int]  # (B,) each live row's index in the caller's batch
    room: list[int]  # (B,) the deepest draft each row may still use (tokens left - 1)
    context_length: int  # cache columns (the cost model's kv_len)
    generated: Sequence[Sequence[int]] = ()  # per caller row: its tokens emitted so far (root last)
    #: what heads that draft in their own context attend over (HeadState.draft_context; None: other heads)
    context: object | None = None


class Drafter(Protocol):
    """``start`` with the prompts, then per step ``propose`` → verify → ``observe``."""

    def start(self, prompts: Sequence[Sequence[int]]) -> None: ...

    def propose(self, state: DraftState, tree: Tree) -> StepTrees: ...

    def max_nodes(self, tree_nodes: int) -> int:
        """The most slots (root included) a row's step may verify when the policy's trees have at
        most ``tree_nodes``: the memory check prices this, not the policy's tree."""
        ...

    def observe(self, trees: StepTrees, result: Acceptance, rows: Sequence[int]) -> None: ...


def plain_step(roots: torch.Tensor) -> StepTrees:
    """No drafts: a 1-node tree per row (a plain decoding step)."""
    return StepTrees.uniform(chain_tree(0), roots[:, None])


class LookupSource(Protocol):
    """One row's lookup source: seeded with the row's prompt, told every token the row emits
    (``extend``), asked for a candidate trie of up to ``budget`` nodes (``propose``)."""

    def extend(self, tokens: Sequence[int]) -> None: ...

    def propose(self, budget: int, q: float | None = None) -> Candidates: ...
