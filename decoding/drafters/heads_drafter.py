"""The heads as a drafter: they fill the policy's tree, the same shape for every row."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from ...heads import DraftHeads
from ..tree import Tree
from .candidates import Candidates
from .drafts import Drafts
from .interface import DraftState, plain_drafts

if TYPE_CHECKING:
    from ..accept import Acceptance


@dataclass
class HeadsDrafter:
    """The heads fill the policy's tree (cut to the shallowest row's room); no state."""

    heads: DraftHeads | None

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        """Heads read hidden states, not token histories."""

    def propose(self, state: DraftState, tree: Tree) -> Drafts:
        tree = tree.fitting(min(state.room))
        if self.heads is None or tree.num_nodes == 1:
            return plain_drafts(state.roots)
        return Drafts.uniform(tree, self.heads.propose(state.hidden, state.roots, tree.spec))

    def observe(self, drafts: Drafts, result: Acceptance, rows: Sequence[int]) -> None:
        """Nothing to learn: the policy observes acceptance itself."""


def head_trie(tree: Tree, tokens: Sequence[int], probs: Sequence[float]) -> Candidates:
    """One row of the heads' tree (slots 1..N−1) as candidates scored by draft probability."""
    parent = (tree.parent[1:] - 1).tolist()  # slot → index among the drafts (root = -1)
    return Candidates.from_heads(parent, list(tokens)[1:], list(probs)[1:])
