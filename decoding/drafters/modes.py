"""Which parts draft a batch's step: the heads and the lookups merged, the lookups alone, or the
heads alone on the policy's tree (:class:`BatchModes`, asked by :class:`~.merged.MergedDrafter`
above :attr:`~.worth.HeadsWorth.weigh_up_to` live rows).

At one row the heads are weighed against the lookups each step (:class:`~.worth.HeadsWorth`).
In a batch the merged tree's width is one choice for every row, priced by calibrated hit rates
that the batch's rows do not share, and on the dev batch mix it decoded slower than either of
its parts (bf16, decode phase: 0.85× the heads alone at bs 16, 0.94× at bs 4; evidence:
results/batch/batch_modes). So in a batch the modes are measured, not predicted: each mode's
tokens per wall millisecond, relative to the calibrated cost of a plain step at the same live
rows (a speed over plain decoding, so steps at 16 and at 11 live rows compare), per live-row
bucket: the ratio of the steps' decayed sums (normalized tokens over milliseconds, each older
step weighing ``decay`` as much as the next), so a long step counts by its time, as in tokens/s.
The best mode runs; after a run of steps on it the mode tried least recently runs once, and the
run doubles while the best stays the best.
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: the modes, in the order a bucket tries them first
MODES = ("merged", "lookups", "heads")


def rows_bucket(rows: int) -> int:
    """Live rows → their bucket: 2-3, 4-7, 8-15, 16-31, ... (powers of two)."""
    return int(rows).bit_length()


def speed(tokens: int, rows: int, wall_ms: float, plain_ms: float) -> float:
    """A step's speed over plain decoding at its live rows: ``tokens`` emitted by ``rows`` rows in
    ``wall_ms``, where a plain step of those rows is priced at ``plain_ms`` (1.0: as fast as plain)."""
    return tokens * plain_ms / (max(rows, 1) * max(wall_ms, 1e-6))


@dataclass
class BatchModes:
    """Measured speeds of the modes per live-row bucket, and the choice they make (see the module
    docstring). ``first_steps``: the steps each mode runs in a bucket before the speeds are
    compared; ``recheck_every`` / ``recheck_most``: the run on the best mode before another is
    measured again, doubled (up to the most) while the best stays the best; ``decay``: an older
    step's weight in the sums against the next's. What is measured carries over requests, as the
    heads' worth does."""

    first_steps: int = 2
    recheck_every: int = 8
    recheck_most: int = 64
    decay: float = 0.7
    #: (bucket, mode) → the decayed sums of its steps: (speed × ms, ms)
    sums: dict[tuple[int, str], tuple[float, float]] = field(default_factory=dict)
    counts: dict[tuple[int, str], int] = field(default_factory=dict)  # (bucket, mode) → steps measured
    _last_used: dict[tuple[int, str], int] = field(default_factory=dict)  # (bucket, mode) → the step it last ran
    _run: dict[int, int] = field(default_factory=dict)  # bucket → steps on its best since the last recheck
    _wait: dict[int, int] = field(default_factory=dict)  # bucket → the current run before a recheck
    _best: dict[int, str] = field(default_factory=dict)  # bucket → the best at the last choice
    _clock: int = 0
    _pending: tuple[int, str, float, int] | None = None  # the step under way: (rows, mode, plain ms, tokens)

    @property
    def speeds(self) -> dict[tuple[int, str], float]:
        """(bucket, mode) → its measured speed over plain decoding (the ratio of its sums)."""
        return {key: worth / spent for key, (worth, spent) in self.sums.items()}

    def choose(self, rows: int) -> str:
        """The mode the next step of ``rows`` live rows drafts with."""
        bucket = rows_bucket(rows)
        self._clock += 1
        untried = [m for m in MODES if self.counts.get((bucket, m), 0) < self.first_steps]
        if untried:
            return self._use(bucket, untried[0])
        speeds = self.speeds
        best = max(MODES, key=lambda m: speeds[(bucket, m)])
        if best != self._best.get(bucket):  # another mode leads: measure the rest soon again
            self._best[bucket], self._wait[bucket], self._run[bucket] = best, self.recheck_every, 0
        if self._run.get(bucket, 0) >= self._wait.get(bucket, self.recheck_every):
            self._run[bucket] = 0
            self._wait[bucket] = min(2 * self._wait.get(bucket, self.recheck_every), self.recheck_most)
            others = [m for m in MODES if m != best]
            return self._use(bucket, min(others, key=lambda m: self._last_used.get((bucket, m), 0)))
        self._run[bucket] = self._run.get(bucket, 0) + 1
        return self._use(bucket, best)

    def _use(self, bucket: int, mode: str) -> str:
        self._last_used[(bucket, mode)] = self._clock
        return mode

    def started(self, rows: int, mode: str, plain_ms: float) -> None:
        """A step of ``rows`` live rows drafts with ``mode``; a plain step of them is priced ``plain_ms``."""
        self._pending = (rows, mode, plain_ms, 0)

    def emitted(self, tokens: int) -> None:
        """The step under way emitted ``tokens`` over its rows (accepted drafts and the base's own)."""
        if self._pending is not None:
            rows, mode, plain_ms, _ = self._pending
            self._pending = (rows, mode, plain_ms, tokens)

    def finished(self, wall_ms: float) -> None:
        """The step under way took ``wall_ms`` from its proposal to the next one: it joins its mode's
        sums. A step that emitted nothing (a request ended before it was verified) is dropped."""
        if self._pending is None:
            return
        rows, mode, plain_ms, tokens = self._pending
        self._pending = None
        if tokens <= 0:
            return
        key = (rows_bucket(rows), mode)
        wall_ms = max(wall_ms, 1e-6)
        worth, spent = self.sums.get(key, (0.0, 0.0))
        self.sums[key] = (self.decay * worth + speed(tokens, rows, wall_ms, plain_ms) * wall_ms,
                          self.decay * spent + wall_ms)
        self.counts[key] = self.counts.get(key, 0) + 1

    def abandon(self) -> None:
        """A new request: the step under way, if any, is no step (the time between requests is not its)."""
        self._pending = None
