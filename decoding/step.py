"""One speculative decoding step, written once: the loop runs it, and the profiler
(``scripts/profile_step.py``) times exactly the same code phase by phase.

    propose (a tree per row) → tree inputs → verify (base forward over the trees) → LM head
            → accept → commit (keep the accepted cache slots) → head state (+ the drafter hears
            what each row accepted)

A step never emits tokens or decides stopping: that is the loop's business
(:mod:`.loop`). It returns what the loop needs to do so (:class:`StepResult`).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .base.binding import packed_forward
from .base.rows import computed_rows
from .accept import Acceptance
from .base.forward import final_states, lm_logits, verify
from .base.cache import KVState
from .drafters import Drafter, StepTrees, DraftState
from .head_state import HeadState
from .tree import Tree

#: the phases of a step, in order (the profiler's table rows; "context" is the heads' state step, a key
#: of saved phases_ms results, so the name stays)
PHASES = ("propose", "tree_inputs", "forward", "lm_head", "accept", "commit", "context")


@dataclass
class PhaseTimer:
    """Wall milliseconds per phase, summed over the steps it saw. Timing a phase needs its
    work to be finished, which on CPU it is when the Python call returns; on CUDA the timer
    synchronizes (so only use one when profiling)."""

    totals: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    steps: int = 0

    @contextmanager
    def phase(self, name: str, device: torch.device) -> Iterator[None]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.totals[name] = self.totals.get(name, 0.0) + (time.perf_counter() - start) * 1e3

    def per_step(self) -> dict[str, float]:
        """Mean milliseconds per step of each phase, plus their ``total``."""
        means = {name: ms / max(1, self.steps) for name, ms in self.totals.items()}
        return {**means, "total": sum(means.values())}


@contextmanager
def _untimed(name: str, device: torch.device) -> Iterator[None]:
    yield


@dataclass
class StepResult:
    trees: StepTrees  # the trees that were verified, one per live row
    logits: torch.Tensor  # (B, N, V) the base's logits at every tree slot
    acceptance: Acceptance  # per row: deepest accepted slot, accepted drafts, path, bonus token
    drafting_seconds: float = 0.0  # the drafter's proposal (lookups, heads, merge, width choice)

    @property
    def tokens(self) -> torch.Tensor:
        """(B, N) tree tokens, column 0 = the roots."""
        return self.trees.tokens


def decode_step(base, drafter: Drafter, acceptor, kv: KVState, heads_state: HeadState, state: DraftState,
                tree: Tree, timer: PhaseTimer | None = None) -> StepResult:
    """One verification step for the live batch.

    ``state``: each live row's root token, head input, caller row index and room (see
    :class:`~.drafters.DraftState`); ``tree``: the policy's choice (its size is the node budget;
    a 1-node tree is a plain decoding step). The drafter returns a tree per row; the base
    verifies them in one forward; the cache in ``kv`` and the heads' ``heads_state`` advance by each
    row's accepted slots; the drafter hears what each row accepted."""
    device = state.roots.device
    phase = timer.phase if timer is not None else _untimed
    started = time.perf_counter()
    with phase("propose", device):
        with packed_forward(heads_state.heads):  # packed heads' layers (if bound) draft faster
            trees = drafter.propose(state, tree)
    drafting = time.perf_counter() - started
    with phase("tree_inputs", device):
        mask, positions, past = kv.tree_inputs(trees.ancestor, trees.depth)
    ragged = trees.valid if trees.skips_padding() else None  # padding slots are not computed
    with computed_rows(ragged):
        with phase("forward", device):
            # (B, N, d), or with the layers multi-layer heads read: (B, N, d · (1 + n)), final state first
            features = verify(base, trees.tokens, positions, mask, kv.cache, ragged, heads_state.taps)
        with phase("lm_head", device):
            logits = lm_logits(base, final_states(features, heads_state.width))  # (B, N, V)
    with phase("accept", device):
        result = acceptor.accept(trees, logits, torch.tensor(state.rows))
    with phase("commit", device):
        kv.commit(result.path + past, result.accepted + 1)
    with phase("context", device):
        heads_state.step(features, trees, result)
        drafter.observe(trees, result, state.rows)
    if timer is not None:
        timer.steps += 1
    return StepResult(trees, logits, result, drafting)
