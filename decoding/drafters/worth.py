"""Whether an optional part of drafting is worth its time this step, and when to measure it
again after it was skipped: the heads beside a lookup match at one row
(:meth:`~.merged.MergedDrafter._heads_pay`).

A step that verifies T expected tokens in t ms without the part gains
G tokens with it and costs p ms more to draft and v ms more to verify, so the part pays when
(T + G) / (t + p + v) > T / t — with G, p and v measured on the steps it took part in.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def moving_average(previous: float | None, value: float, weight: float = 0.2) -> float:
    """An exponential moving average (the first value starts it)."""
    return value if previous is None else (1.0 - weight) * previous + weight * value


def pays(expected: float, step_ms: float, gain: float, extra_ms: float) -> bool:
    """(T + G) / (t + p + v) > T / t: ``expected`` T tokens in ``step_ms`` t without the part,
    ``gain`` G more tokens with it for ``extra_ms`` p + v more."""
    return (expected + gain) * step_ms > expected * (step_ms + extra_ms)


@dataclass
class Recheck:
    """When a part that does not pay is measured again: after ``every`` skipped steps in a row
    it takes part once (a slow first call, or text that changed, never rules it out for good);
    each recheck after which it still does not pay doubles the wait, up to ``most``, and one
    after which it pays sets the wait back."""

    every: int = 8
    most: int = 64
    wait: int = field(init=False)  # the current wait; ``every`` at the start of a request
    rechecked: bool = False  # the last step was a recheck: the next verdict sets the wait
    skipped_in_a_row: int = 0

    def __post_init__(self) -> None:
        self.wait = self.every

    def restart(self) -> None:
        """A new request: new text, rechecked at the usual pace."""
        self.wait, self.rechecked = self.every, False

    def decide(self, worth_it: bool) -> bool:
        """Whether the part takes part this step, given whether it pays."""
        if self.rechecked:  # the verdict right after a recheck sets the wait before the next one
            self.wait = self.every if worth_it else min(2 * self.wait, self.most)
            self.rechecked = False
        if not worth_it and self.skipped_in_a_row >= self.wait:
            self.rechecked = True
            return True
        return worth_it

    def count(self, took_part: bool) -> None:
        """A step the part took part in (the run of skipped steps ends) or was skipped in."""
        self.skipped_in_a_row = 0 if took_part else self.skipped_in_a_row + 1
