"""The draft length a fixed-length engine should run at each batch size.

An engine's chain proposer (vLLM's EAGLE-3 and Medusa) drafts ``k`` tokens a row every step; vLLM
0.32 takes a batch-size → ``k`` table as ``speculative_config["num_speculative_tokens_per_batch_size"]``
(``[[lo, hi, k], ...]``, batch sizes lo..hi inclusive). draftheads' own policy chooses a tree per
step; for an engine the same rule is written once per batch size: the ``k`` with the highest
expected tokens a row-step over the calibrated step time (:class:`CostModel`, this machine, this
dtype), the chain's expected tokens measured by decoding with the heads themselves.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..core.errors import InputError
from .cost import CostModel


def chain_taus(accepted: Sequence[int], k: int) -> list[float]:
    """τ(j) for chains of j = 0..k drafts, from the drafts accepted on row-steps that drafted a
    chain of ``k`` (greedy: the first j drafts of a chain do not depend on its length, so a step
    that accepted ``a`` of k would have accepted ``min(a, j)`` of j). τ(0) = 1: plain decoding."""
    if k < 1 or not accepted:
        raise InputError(f"chain_taus needs the accepted counts of steps that drafted a chain of k ≥ 1 "
                         f"(got k={k}, {len(accepted)} steps): decode with chain_tree(k) first.")
    if any(a < 0 or a > k for a in accepted):
        raise InputError(f"chain_taus: accepted counts must lie in 0..{k} for a chain of {k}.")
    steps = len(accepted)
    return [1.0 + sum(min(a, j) for a in accepted) / steps for j in range(k + 1)]


def best_length(cost: CostModel, taus: Sequence[float], batch_size: int, context: int) -> int:
    """The ``k`` (0..len(taus)-1) with the most expected tokens a second at ``batch_size`` rows:
    τ(k) · bs over one step of bs rows × (k + 1) slots, its drafting priced at a k-node budget;
    ties to the shorter chain."""
    rates = [taus[k] * batch_size / cost.step_ms(batch_size, k + 1, context, budget=k) for k in range(len(taus))]
    return max(range(len(rates)), key=lambda k: (rates[k], -k))


def draft_length_schedule(cost: CostModel, taus: Sequence[float], batch_sizes: Iterable[int] = range(1, 65),
                          context: int = 256) -> list[list[int]]:
    """``[[lo, hi, k], ...]``: :func:`best_length` at every batch size of ``batch_sizes``,
    consecutive sizes with the same ``k`` joined (vLLM's ``num_speculative_tokens_per_batch_size``)."""
    sizes = sorted(set(int(b) for b in batch_sizes))
    if not sizes or sizes[0] < 1:
        raise InputError(f"draft_length_schedule: batch sizes must be whole numbers ≥ 1 (got {sizes[:3]}…).")
    schedule: list[list[int]] = []
    for bs in sizes:
        k = best_length(cost, taus, bs, context)
        if schedule and schedule[-1][2] == k and schedule[-1][1] == bs - 1:
            schedule[-1][1] = bs
        else:
            schedule.append([bs, bs, k])
    return schedule
