"""What one decoding step costs: the one cost model the adaptive policy and the merged
drafter's width chooser both read.

Why a cost model: verifying N tree nodes is almost free while a forward is memory-bound (small
batch, one token per row), but once batch·N tokens make it compute-bound every extra node costs
time for every row, so the best tree shrinks as the batch grows, down to plain decoding
(Su, Giannoula, Pekhimenko, arXiv 2310.18813). Where the cross-over lies depends on the
hardware, the dtype and the base, so it is measured (:mod:`.calibration`), not guessed:

    step_ms(bs, nodes, kv_len, budget) = forward_ms(bs, nodes, kv_len) + overhead_ms(bs, nodes) + draft_ms(bs, budget)

A :class:`CostModel` prices a step from a calibrated surface (bs × query tokens × context), or
from a batch-size-1 table priced by query tokens (``per_token``: bs rows of n nodes cost what
bs·n nodes cost one row; a CPU forward is bound by its query tokens) — the checkpoint's stored
table, this machine's quick calibration, or :data:`LINEAR_COST` when nothing was measured.
"""
from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..core.errors import DraftheadsError

Row = dict  # {"bs", "q", "ctx", "ms"}: one measured point
#: the most interpolated curves a :class:`LatencyTable` keeps (:meth:`LatencyTable._curve`)
CURVE_CACHE = 512


# -- interpolation ---------------------------------------------------------------------------
def interp1(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs sorted, distinct); linear extrapolation from the two
    end points outside, because latency keeps growing linearly once compute-bound. One point:
    constant. (The rule is :func:`bracket`'s; :func:`interp_many` is its vectorized form.)"""
    return float(sum(w * ys[i] for i, w in bracket(np.asarray(xs, dtype=np.float64), x)))


def interp_many(xs: np.ndarray, ys: np.ndarray, x: np.ndarray) -> np.ndarray:
    """:func:`interp1` at every point of ``x`` (vectorized; same end-point extrapolation)."""
    if len(xs) == 1:
        return np.full(x.shape, float(ys[0]))
    i = np.clip(np.searchsorted(xs, x, side="left"), 1, len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def bracket(xs: np.ndarray, x: float) -> list[tuple[int, float]]:
    """The measured points around ``x`` and their weights, as :func:`interp1` combines them
    (linear extrapolation past the ends; one point: itself)."""
    if len(xs) == 1:
        return [(0, 1.0)]
    i = int(min(max(np.searchsorted(xs, x, side="left"), 1), len(xs) - 1))
    w = float((x - xs[i - 1]) / (xs[i] - xs[i - 1]))
    return [(i - 1, 1.0 - w), (i, w)]


@dataclass(frozen=True)
class LatencyTable:
    """Milliseconds measured at (bs, q, kv_len) points, interpolated piecewise-linearly in q, then
    bs, then kv_len. Each (kv_len, bs) keeps its own q list, so coarse or capped grids (large bs × large
    q left out of the calibration, the GPU files' sparse ctx-2048 grid) need no filling."""

    points: dict[int, dict[int, tuple[tuple[int, float], ...]]]  # kv_len -> bs -> ((q, ms), ...)

    @classmethod
    def from_rows(cls, rows: Iterable[Row]) -> "LatencyTable":
        grid: dict[int, dict[int, dict[int, float]]] = {}
        for row in rows:
            grid.setdefault(int(row["ctx"]), {}).setdefault(int(row["bs"]), {})[int(row["q"])] = float(row["ms"])
        if not grid:
            raise ValueError("A latency table needs at least one measured point.")
        return cls({c: {b: tuple(sorted(qs.items())) for b, qs in sorted(bss.items())} for c, bss in sorted(grid.items())})

    def __post_init__(self):
        # the interpolation grids as arrays, built once: the width chooser prices every width of
        # every step (a few thousand calls a second at bs 16), so nothing is rebuilt per call
        grids = {c: (np.array(list(bss), dtype=np.float64),
                     [(np.array([p[0] for p in qs], dtype=np.float64), np.array([p[1] for p in qs], dtype=np.float64))
                      for qs in bss.values()]) for c, bss in self.points.items()}
        object.__setattr__(self, "_grids", grids)
        object.__setattr__(self, "_contexts", np.array(list(self.points), dtype=np.float64))
        object.__setattr__(self, "_curves", {})  # (context, batch, qs) → interp_many's (Q,) answer

    def _curve(self, ci: int, bi: int, qs: np.ndarray) -> np.ndarray:
        """(Q,) one measured (context, batch size)'s curve at ``qs``, memoized: the width chooser
        asks for the same widths every step while only the context moves, and the interpolation
        is most of a bs-1 step's width choice. Bounded (per-row counts ask at fractional slots)."""
        key = (ci, bi, qs.tobytes())
        curve = self._curves.get(key)
        if curve is None:
            if len(self._curves) >= CURVE_CACHE:
                self._curves.clear()
            contexts = list(self._grids)
            curve = self._curves[key] = interp_many(*self._grids[contexts[ci]][1][bi], qs)
        return curve

    def ms(self, bs: int, q: int, kv_len: int) -> float:
        return float(self.ms_many(bs, np.array([q], dtype=np.float64), kv_len)[0])

    def ms_many(self, bs: int, qs: np.ndarray, kv_len: int) -> np.ndarray:
        """:meth:`ms` at several query counts ``qs`` (Q,) at once → (Q,). Only the two measured
        contexts and batch sizes around (kv_len, bs) are interpolated (the others carry no weight)."""
        contexts = list(self._grids)
        qs = np.asarray(qs, dtype=np.float64)
        total = np.zeros(len(qs))
        for ci, cw in bracket(self._contexts, kv_len):
            for bi, bw in bracket(self._grids[contexts[ci]][0], bs):
                total += (cw * bw) * self._curve(ci, bi, qs)
        return np.maximum(total, 1e-6)

    def rows(self) -> list[Row]:
        return [{"bs": b, "q": q, "ctx": c, "ms": round(ms, 4)}
                for c, bss in self.points.items() for b, qs in bss.items() for q, ms in qs]


# -- the cost model --------------------------------------------------------------------------
@dataclass
class CostModel:
    """Time of one decoding step. ``forward``: base forward over bs × nodes query tokens at
    context kv_len, LM head and argmax included; ``overhead``: the loop's own work per step (greedy
    acceptance, KV compaction, emitting tokens), by (bs, nodes); ``draft``: ``heads.propose``
    by (bs, budget). Surfaces measured elsewhere (the GPU files) have no overhead/draft table:
    those terms count as zero, which favours speculation, so say so when quoting them."""

    forward: LatencyTable
    overhead: LatencyTable | None = None
    draft: LatencyTable | None = None
    meta: dict = field(default_factory=dict)
    #: ``forward`` is a batch-size-1 table priced by query tokens: bs × nodes rows cost what
    #: bs·nodes nodes cost one row (:meth:`from_table`)
    per_token: bool = False

    @classmethod
    def from_table(cls, nodes: Sequence[int], ms: Sequence[float]) -> "CostModel":
        """A bs-1 step-time table {nodes: ms} (forward and overhead together) priced by query
        tokens, for any batch. One point is a cost per node (a line through the origin)."""
        points = tuple(zip((int(n) for n in nodes), (float(t) for t in ms)))
        if len(points) == 1:
            points = ((0, 0.0), (points[0][0], points[0][1] * points[0][0]))
        return cls(LatencyTable({0: {1: points}}), per_token=True)

    @classmethod
    def from_ranked(cls, ranked: Sequence[dict]) -> "CostModel":
        """The table of ``HeadConfig.default_budget_by_dtype[...]["ranked"]`` ({"nodes", "step_ms"}
        per stored tree), made monotone: a larger tree never counts as cheaper than a smaller one."""
        points = sorted((int(r["nodes"]), float(r["step_ms"])) for r in ranked)
        nodes, ms, best = [], [], float("inf")
        for n, t in reversed(points):  # lower every point to the cheapest larger tree
            best = min(best, t)
            nodes.append(n)
            ms.append(best)
        return cls.from_table(nodes[::-1], ms[::-1])

    def per_token_table(self, contexts: Sequence[int]) -> "CostModel":
        """This model's bs-1 step times at each of ``contexts`` at every node count it measured
        (forward + the loop's overhead), as a table priced by query tokens, monotone in nodes at
        each context (:meth:`from_ranked`) and interpolated between contexts. Why more than one
        context: a tree node's attention grows with the KV length, so a table measured at a short context under-prices the nodes
        of a long prompt (RAG, summarization) and the width chooser verifies too many."""
        nodes = sorted({int(r["q"]) for r in self.forward.rows() if int(r["bs"]) == 1})
        points = {int(kv_len): CostModel.from_ranked([{"nodes": n, "step_ms": self.step_ms(1, n, kv_len)} for n in nodes])
                  .forward.points[0] for kv_len in contexts}
        return CostModel(LatencyTable(points), per_token=True)

    def step_ms_many(self, bs: int, widths: np.ndarray, kv_len: int) -> np.ndarray:
        """:meth:`step_ms` (no drafting cost) at every node count of ``widths`` (W,) → (W,)."""
        widths = np.asarray(widths, dtype=np.float64)
        if self.per_token:
            return self.forward.ms_many(1, bs * widths, kv_len)
        ms = self.forward.ms_many(bs, widths, kv_len)
        if self.overhead is not None:
            ms = ms + self.overhead.ms_many(bs, widths, 0)
        return ms

    def step_ms(self, bs: int, nodes: int, kv_len: int, budget: int = 0) -> float:
        """One step of ``bs`` rows × ``nodes`` tree slots at context ``kv_len``, drafting a
        ``budget``-node tree (0: no drafting cost counted)."""
        if self.per_token:
            return self.forward.ms(1, bs * nodes, kv_len)
        ms = self.forward.ms(bs, nodes, kv_len)
        if self.overhead is not None:
            ms += self.overhead.ms(bs, nodes, 0)
        if budget > 0 and self.draft is not None:
            ms += self.draft.ms(bs, budget, 0)
        return ms

    def to_dict(self) -> dict:
        return {"meta": self.meta, "rows": self.forward.rows(),
                "overhead_rows": self.overhead.rows() if self.overhead else [],
                "draft_rows": [{"bs": r["bs"], "budget": r["q"], "ms": r["ms"]} for r in self.draft.rows()]
                if self.draft else []}

    @classmethod
    def from_dict(cls, data: dict, mode: str = "tree") -> "CostModel":
        """Reads both the calibration JSON and the GPU files the package ships (``draftheads/data/cost_surfaces``)
        (rows with ``ms_median`` and a ``mode``: only ``mode`` rows are used, since the decoder
        verifies with a 4D tree mask), after :func:`check_cost_surface`."""
        check_cost_surface(data)
        rows = [{"bs": r["bs"], "q": r["q"], "ctx": r.get("ctx", data.get("meta", {}).get("ctx", 0)),
                 "ms": r["ms"] if "ms" in r else r["ms_median"]}
                for r in data.get("rows", []) if r.get("mode", mode) == mode]
        if not rows:
            raise ValueError(f"No latency rows with mode={mode!r} in this cost surface.")
        overhead = data.get("overhead_rows") or []
        draft = [{"bs": r["bs"], "q": r["budget"], "ctx": 0, "ms": r["ms"]} for r in data.get("draft_rows") or []]
        return cls(LatencyTable.from_rows(rows), LatencyTable.from_rows(overhead) if overhead else None,
                   LatencyTable.from_rows(draft) if draft else None, dict(data.get("meta", {})))


class CostSurfaceError(DraftheadsError, ValueError):
    """A cost surface (a cached calibration, a GPU surface file) that cannot be used."""


#: the largest batch size, token count, tree budget or context a measured point may name
MAX_COUNT = 1 << 24
#: the longest step a measured point may take, ms
MAX_STEP_MS = 1e7


def plausible_count(value) -> bool:
    """An integer (not a bool) in 0 .. :data:`MAX_COUNT`: a JSON file carries integers of any
    size, and a huge one overflows the float conversion of the interpolation."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def plausible_step_ms(value) -> bool:
    """A number (not a bool) above 0 and below :data:`MAX_STEP_MS`, compared, never converted
    (NaN, infinities and huge integers all fail)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < MAX_STEP_MS


def _plausible_rows(rows, size_keys: tuple[str, ...], where: str, optional: tuple[str, ...] = ()) -> None:
    """Each row an object whose sizes (``size_keys``, and ``optional`` ones where present) are
    counts (:func:`plausible_count`) and whose time is plausible (:func:`plausible_step_ms`)."""
    if not isinstance(rows, list):
        raise CostSurfaceError(f"'{where}' is a {type(rows).__name__}, not a list of measured points")
    for row in rows:
        if not isinstance(row, dict):
            raise CostSurfaceError(f"'{where}' holds a {type(row).__name__}, not a measured point")
        ms = row.get("ms", row.get("ms_median"))
        for key in size_keys + tuple(k for k in optional if k in row):
            if not plausible_count(row.get(key)):
                raise CostSurfaceError(f"a point of '{where}' has {key}={reprlib.repr(row.get(key))}, not a count "
                                       f"(0 to {MAX_COUNT})")
        if not plausible_step_ms(ms):
            raise CostSurfaceError(f"a point of '{where}' has time {reprlib.repr(ms)} ms, not a positive number below "
                                   f"{MAX_STEP_MS:g}")


def check_cost_surface(data) -> None:
    """Everything :meth:`CostModel.from_dict` reads, checked: an object with a non-empty list of
    forward points and optional overhead/draft lists, every size a count and every time a
    plausible number (a NaN or negative time would make the policy's choice garbage); a forward
    point without its own ``ctx`` takes the meta's, which must then be a count too."""
    if not isinstance(data, dict):
        raise CostSurfaceError(f"it is a JSON {type(data).__name__}, not an object with 'rows'")
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise CostSurfaceError("its 'meta' is not an object")
    rows = data.get("rows")
    if not rows:
        raise CostSurfaceError("it holds no measured points ('rows' is missing or empty)")
    _plausible_rows(rows, ("bs", "q"), "rows", optional=("ctx",))
    if "ctx" in meta and not plausible_count(meta["ctx"]) and any("ctx" not in r for r in rows):
        raise CostSurfaceError(f"its meta has ctx={reprlib.repr(meta['ctx'])}, not a count (0 to {MAX_COUNT})")
    _plausible_rows(data.get("overhead_rows") or [], ("bs", "q", "ctx"), "overhead_rows")
    _plausible_rows(data.get("draft_rows") or [], ("bs", "budget"), "draft_rows")


def load_cost_surface(path: str | Path, mode: str = "tree") -> CostModel:
    """A cost surface JSON file: a cached calibration or one of the measured GPU surfaces;
    anything unreadable or implausible is a :class:`CostSurfaceError` naming the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        return CostModel.from_dict(data, mode=mode)
    except OSError as err:
        raise CostSurfaceError(f"{path} cannot be read ({err.strerror or err})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CostSurfaceError(f"{path} is not valid JSON ({type(err).__name__})") from None
    except CostSurfaceError as err:
        raise CostSurfaceError(f"{path} is not a usable cost surface: {err}") from None
    except ValueError as err:  # no rows of this mode
        raise CostSurfaceError(f"{path}: {err}") from None


#: without a measured table: a step of n nodes costs 1 + 3 % per extra node, relative (this
#: CPU's bs-1 bf16 table grows about 3 % per node between 1 and 33 nodes)
LINEAR_COST = CostModel.from_table((1, 33), (1.0, 1.96))
