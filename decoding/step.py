"""One speculative decoding step, written once: the loop runs it, and the profiler
(``scripts/profile_step.py``) times exactly the same code phase by phase.

    propose → tree inputs → verify (base forward over the tree) → LM head → accept
            → commit (keep the accepted cache slots) → head context

A step never emits tokens or decides stopping: that is the loop's business
(:mod:`.generate`). It returns what the loop needs to do so (:class:`StepResult`).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..heads import DraftHeads
from ..heads.linear import packed_linears
from .accept import Acceptance
from .base import lm_logits, verify
from .cache import KVState
from .context import HeadContext
from .tree import Tree, chain_tree

#: the phases of a step, in order (the profiler's table rows)
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
    tree: Tree  # the tree that was verified (after truncation)
    tokens: torch.Tensor  # (B, N) tree tokens, column 0 = the roots
    logits: torch.Tensor  # (B, N, V) the base's logits at every tree slot
    acceptance: Acceptance  # per row: deepest accepted slot, accepted drafts, path, bonus token


def decode_step(base, heads: DraftHeads | None, acceptor, kv: KVState, context: HeadContext, roots: torch.Tensor,
                tree: Tree, rows: torch.Tensor, timer: PhaseTimer | None = None) -> StepResult:
    """One verification step for the live batch.

    roots (B,) the token each live row ends with (emitted, not yet in the cache); rows (B,) the
    original batch index of each live row (the acceptor reads their tokens so far); ``tree`` the
    shape to verify (a 1-node tree is a plain decoding step). The base cache in ``kv`` and the
    heads' ``context`` advance by each row's accepted slots."""
    device = roots.device
    phase = timer.phase if timer is not None else _untimed
    with phase("propose", device):
        if heads is None or tree.num_nodes == 1:
            tree = chain_tree(0)
            tokens = roots[:, None]
        else:
            with packed_linears():  # packed heads' layers (if the decoder packed them) draft faster
                tokens = heads.propose(context.hidden, roots, tree.spec)
    with phase("tree_inputs", device):
        mask, positions, past = kv.tree_inputs(tree.ancestor, tree.depth)
    with phase("forward", device):
        states = verify(base, tokens, positions, mask, kv.cache)  # (B, N, d)
    with phase("lm_head", device):
        logits = lm_logits(base, states)  # (B, N, V)
    with phase("accept", device):
        result = acceptor.accept(tokens, tree, logits, rows)
    with phase("commit", device):
        kv.commit(result.path + past, result.accepted + 1)
    with phase("context", device):
        context.step(states, tree, result)
    if timer is not None:
        timer.steps += 1
    return StepResult(tree, tokens, logits, result)
