"""How much to speculate for the live batch: a profiled cost model of one decoding step and the
policy that picks, every step, the tree that maximizes expected tokens/s for the whole batch.

Why a cost model: verifying N tree nodes is almost free while a forward is memory-bound (small
batch, one token per row), but once batch·N tokens make it compute-bound every extra node costs
time for every row, so the best tree shrinks as the batch grows, down to plain decoding
(Su, Giannoula, Pekhimenko, arXiv 2310.18813). Where the cross-over lies depends on the
hardware, the dtype and the base, so it is measured (a short calibration, cached), not guessed:

    goodput(tree | bs, ctx) = bs · τ(tree) / (forward_ms(bs, nodes, ctx) + overhead_ms(bs, nodes)
                                               + draft_ms(bs, budget))

τ(tree) comes from the checkpoint (expected tokens per step for each stored node budget, measured
on held-out text) and is rescaled online by what the decoder actually accepts.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import platform
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

from ..heads import CheckpointError
from ..heads.errors import DraftheadsError, UnwritablePathError
from ..heads.hardware import cpu_model, isa_limits
from ..heads.protocol import write_text_atomic
from .accept import greedy_tokens
from .limits import InputError
from .base import cache_root, fingerprint, lm_logits, tree_attention_mask, verify
from .tree import Tree, chain_tree, tree_from_paths

Row = dict  # {"bs", "q", "ctx", "ms"}: one measured point


# -- interpolation ---------------------------------------------------------------------------
def interp1(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs sorted, distinct); linear extrapolation from the two
    end points outside, because latency keeps growing linearly once compute-bound. One point:
    constant."""
    if len(xs) == 1:
        return float(ys[0])
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class LatencyTable:
    """Milliseconds measured at (bs, q, ctx) points, interpolated piecewise-linearly in q, then
    bs, then ctx. Each (ctx, bs) keeps its own q list, so coarse or capped grids (large bs × large
    q left out of the calibration, the GPU files' sparse ctx-2048 grid) need no filling."""

    points: dict[int, dict[int, tuple[tuple[int, float], ...]]]  # ctx -> bs -> ((q, ms), ...)

    @classmethod
    def from_rows(cls, rows: Iterable[Row]) -> "LatencyTable":
        grid: dict[int, dict[int, dict[int, float]]] = {}
        for row in rows:
            grid.setdefault(int(row["ctx"]), {}).setdefault(int(row["bs"]), {})[int(row["q"])] = float(row["ms"])
        if not grid:
            raise ValueError("A latency table needs at least one measured point.")
        return cls({c: {b: tuple(sorted(qs.items())) for b, qs in sorted(bss.items())} for c, bss in sorted(grid.items())})

    def ms(self, bs: int, q: int, ctx: int) -> float:
        contexts = list(self.points)
        per_ctx = []
        for c in contexts:
            batches = list(self.points[c])
            per_bs = [interp1([p[0] for p in self.points[c][b]], [p[1] for p in self.points[c][b]], q) for b in batches]
            per_ctx.append(interp1(batches, per_bs, bs))
        return max(interp1(contexts, per_ctx, ctx), 1e-6)

    def rows(self) -> list[Row]:
        return [{"bs": b, "q": q, "ctx": c, "ms": round(ms, 4)}
                for c, bss in self.points.items() for b, qs in bss.items() for q, ms in qs]


# -- the cost model --------------------------------------------------------------------------
@dataclass
class CostModel:
    """Time of one decoding step. ``forward``: base forward over bs × nodes query tokens at
    context ctx, LM head and argmax included; ``overhead``: the loop's own work per step (greedy
    acceptance, KV compaction, emitting tokens), by (bs, nodes); ``draft``: ``heads.propose``
    by (bs, budget). Surfaces measured elsewhere (the GPU files) have no overhead/draft table:
    those terms count as zero, which favours speculation, so say so when quoting them."""

    forward: LatencyTable
    overhead: LatencyTable | None = None
    draft: LatencyTable | None = None
    meta: dict = field(default_factory=dict)

    def step_ms(self, bs: int, nodes: int, ctx: int, budget: int = 0) -> float:
        ms = self.forward.ms(bs, nodes, ctx)
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


def _plausible_rows(rows, size_keys: tuple[str, ...], where: str) -> None:
    """Each row an object whose sizes are integers ≥ 0 and whose time is a finite number > 0."""
    if not isinstance(rows, list):
        raise CostSurfaceError(f"'{where}' is a {type(rows).__name__}, not a list of measured points")
    for row in rows:
        if not isinstance(row, dict):
            raise CostSurfaceError(f"'{where}' holds a {type(row).__name__}, not a measured point")
        ms = row.get("ms", row.get("ms_median"))
        for key in size_keys:
            value = row.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CostSurfaceError(f"a point of '{where}' has {key}={value!r}, not a count")
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
            raise CostSurfaceError(f"a point of '{where}' has time {ms!r} ms, not a finite positive number")


def check_cost_surface(data) -> None:
    """Everything :meth:`CostModel.from_dict` reads, checked: an object with a non-empty list of
    forward points and optional overhead/draft lists, every size a count and every time a
    finite positive number (a NaN or negative time would make the policy's choice garbage)."""
    if not isinstance(data, dict):
        raise CostSurfaceError(f"it is a JSON {type(data).__name__}, not an object with 'rows'")
    if not isinstance(data.get("meta", {}), dict):
        raise CostSurfaceError("its 'meta' is not an object")
    rows = data.get("rows")
    if not rows:
        raise CostSurfaceError("it holds no measured points ('rows' is missing or empty)")
    _plausible_rows(rows, ("bs", "q"), "rows")
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


# -- calibration -----------------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationConfig:
    """The grid of the calibration run. Points with bs·q > ``max_tokens`` are skipped: there
    the forward is compute-bound and linear in q, which the interpolation extrapolates; this
    keeps the run at two or three minutes on 2 CPU cores.

    ``tree_nodes``: with heads, measure exactly the node counts of their stored trees (plus
    plain decoding) instead of ``nodes``, so the trees the policy compares are priced by
    measurement, not interpolation: a CPU's GEMM cost is not smooth in the row count (MKL
    switches kernels with it; in a cache-hot micro-benchmark here 3 rows cost more than 8).
    ``batch_sizes`` include 3, 6, 12, 24 for the same reason: the live batch passes through
    every size as rows finish."""

    batch_sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    nodes: tuple[int, ...] = (1, 2, 3, 5, 9, 17, 33, 65)
    contexts: tuple[int, ...] = (128, 512)
    max_tokens: int = 160
    reps: int = 4
    tree_nodes: bool = True
    #: node counts measured besides the stored trees' (the merged drafter's wider trees)
    extra_nodes: tuple[int, ...] = ()

    def grid_nodes(self, heads=None) -> list[int]:
        """The query-token counts to measure for these heads."""
        stored = getattr(getattr(heads, "config", None), "trees", None)
        if self.tree_nodes and stored:
            return sorted({1, 2} | {int(b) + 1 for b in stored} | set(self.extra_nodes))
        return sorted(set(self.nodes) | set(self.extra_nodes))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    limits = ", ".join(f"{k}={v}" for k, v in isa_limits().items())
    return (f"{platform.machine()} {cpu_model()} ({torch.backends.cpu.get_cpu_capability()}"
            f"{', ' + limits if limits else ''}, {torch.get_num_threads()} threads)").strip()


def calibration_key(model, heads=None) -> dict:
    """What the measured costs depend on: the base (fingerprint + the sizes that set its cost),
    the device, the dtype, torch, the thread count, and the heads (their drafting cost)."""
    param = next(model.parameters())
    cfg = model.config
    key = {"base": fingerprint(model).to_dict(), "layers": int(cfg.num_hidden_layers),
           "intermediate_size": int(getattr(cfg, "intermediate_size", 0)),
           "device": device_name(param.device), "dtype": str(param.dtype), "torch": torch.__version__,
           "attention": str(getattr(cfg, "_attn_implementation", None))}
    if heads is not None:
        hc = heads.config
        key["heads"] = {"family": hc.family, "num_heads": hc.num_heads, "num_layers": hc.num_layers,
                        "draft_vocab_size": hc.draft_vocab_size, "budgets": sorted(int(b) for b in hc.trees)}
    return key


def calibration_path(key: dict, config: CalibrationConfig) -> Path:
    digest = hashlib.sha256(json.dumps([key, asdict(config)], sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "calibration" / f"{digest}.json"


def _synthetic_cache(model, bs: int, ctx: int):
    """A cache of ``ctx`` random keys/values per row: costs are independent of the values, and
    this skips a prefill of bs × ctx tokens (the slowest part of a naive calibration)."""
    from transformers import DynamicCache

    cfg = model.config
    param = next(model.parameters())
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        kv = torch.randn(bs, heads, ctx, dim, dtype=param.dtype, device=param.device)
        cache.update(kv, kv.clone(), layer)
    return cache


def _best_of(fn, reps: int) -> float:
    """Minimum of ``reps`` timed calls after one warm-up, in ms: the minimum is the least
    disturbed by other jobs sharing the machine."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - start) * 1000)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_forward(model, bs: int, q: int, ctx: int, reps: int = 2) -> float:
    """ms of one verification forward exactly as the loop runs it (4D tree mask over the cache,
    LM head over every node, argmax); the cache is cropped back after each call."""
    device = next(model.parameters()).device
    cache = _synthetic_cache(model, bs, ctx)
    valid = torch.ones(bs, ctx, dtype=torch.bool, device=device)
    mask = tree_attention_mask(valid, torch.tril(torch.ones(q, q, dtype=torch.bool, device=device)))
    positions = (ctx + torch.arange(q, device=device))[None].expand(bs, q)
    tokens = torch.randint(3, model.config.vocab_size, (bs, q), device=device)

    def step():
        states = verify(model, tokens, positions, mask, cache)
        greedy_tokens(lm_logits(model, states))
        _sync(device)
        cache.crop(-q)

    return _best_of(step, reps)


@torch.no_grad()
def measure_overhead(model, bs: int, q: int, ctx: int = 64, reps: int = 3) -> float:
    """ms of the loop's work around the forward: greedy acceptance, KV compaction of the
    accepted path, and the per-row Python bookkeeping of emitting tokens."""
    from .accept import greedy_accept
    from .cache import KVState

    device = next(model.parameters()).device
    tree = chain_tree(q - 1)
    vocab = model.config.vocab_size
    tokens = torch.randint(3, vocab, (bs, q), device=device)
    predicted = tokens.roll(-1, 1)  # every draft accepted: the longest path to compact

    def step():
        cache = _synthetic_cache(model, bs, ctx + q)
        kv = KVState(cache, torch.ones(bs, ctx, dtype=torch.bool, device=device),
                     torch.full((bs,), ctx, device=device), torch.full((bs,), ctx, device=device))
        start = time.perf_counter()
        result = greedy_accept(tokens, tree.parent.to(device), tree.depth.to(device), tree.path_slots.to(device),
                               predicted)
        kv.commit(result.path + ctx, result.accepted + 1)
        for i in range(bs):
            a = int(result.accepted[i])
            tokens[i, result.path[i, 1: a + 1]].tolist()
        _sync(device)
        return (time.perf_counter() - start) * 1000

    step()
    return min(step() for _ in range(reps))


@torch.no_grad()
def measure_draft(model, heads, bs: int, tree: Tree, reps: int = 3) -> float:
    """ms of ``heads.propose`` for a batch of bs rows and one stored tree."""
    device = next(model.parameters()).device
    hidden = torch.randn(bs, model.config.hidden_size, dtype=next(model.parameters()).dtype, device=device)
    roots = torch.randint(3, model.config.vocab_size, (bs,), device=device)
    spec = tree.spec

    def step():
        heads.propose(hidden, roots, spec)
        _sync(device)

    return _best_of(step, reps)


def monotone_envelope(rows: list[Row]) -> list[Row]:
    """Each point lowered to the cheapest point with at least as many query tokens and rows
    (same ctx). For the loop's overhead and the drafting cost more work never takes less time,
    so a point above that is noise, and on a shared machine noise only adds time: a job that ran
    meanwhile, never one that helped. (Not for the forward: see :func:`run_calibration`.)"""
    out = []
    for row in rows:
        bigger = [r["ms"] for r in rows if r["ctx"] == row["ctx"] and r["bs"] >= row["bs"] and r["q"] >= row["q"]]
        out.append({**row, "ms": min(bigger)})
    return out


def run_calibration(model, heads=None, config: CalibrationConfig = CalibrationConfig(), log=None) -> CostModel:
    """Measure the three tables on ``config``'s grid (no caching; see :func:`calibrate`)."""
    started = time.perf_counter()
    forward, overhead, draft = [], [], []
    nodes = config.grid_nodes(heads)
    # Warm-up: the first forwards of a fresh process page in the (memory-mapped) weights and size
    # the allocator; measured here, they made the first grid point (bs 1, q 1) read 80-83 ms
    # against 58-61 ms later in the same run.
    for q in (1, max(nodes)):
        measure_forward(model, 1, q, config.contexts[0], reps=3)
    for ctx in config.contexts:
        for bs in config.batch_sizes:
            # q = 1 and 2 always, so every batch size has a slope to extrapolate along
            for q in [q for q in nodes if q <= 2 or bs * q <= config.max_tokens]:
                forward.append({"bs": bs, "q": q, "ctx": ctx, "ms": measure_forward(model, bs, q, ctx, config.reps)})
            if log:
                log(f"calibration ctx={ctx} bs={bs}: " + " ".join(f"q{r['q']}={r['ms']:.0f}ms"
                                                                for r in forward if r['bs'] == bs and r['ctx'] == ctx))
    for bs in config.batch_sizes:
        for q in (1, 5):
            overhead.append({"bs": bs, "q": q, "ctx": 0, "ms": measure_overhead(model, bs, q)})
        if heads is not None:
            for budget, paths in sorted((int(b), p) for b, p in heads.config.trees.items()):
                draft.append({"bs": bs, "q": budget, "ctx": 0, "ms": measure_draft(model, heads, bs, tree_from_paths(paths))})
    meta = {"key": calibration_key(model, heads), "config": asdict(config),
            "seconds": round(time.perf_counter() - started, 1), "raw_rows": forward,
            "note": "ms = best of reps; overhead and draft tables then the monotone envelope (see monotone_envelope); "
                    "forward = verify + LM head + argmax over bs x q tree slots at context ctx"}
    # The forward table keeps its raw points: its true cost is not monotone in the work (on this CPU
    # bs 3 × 1 query token measured 129-132 ms against 89 ms for bs 3 × 2, at both contexts: MKL's
    # kernel for 2-3 rows is slower than its GEMM for 4+), and lowering it to the envelope mispriced
    # exactly those points. Best-of-``reps`` is its only noise filter.
    return CostModel(LatencyTable.from_rows(forward), LatencyTable.from_rows(monotone_envelope(overhead)),
                     LatencyTable.from_rows(monotone_envelope(draft)) if draft else None, meta)


#: calibrations this process measured but could not write to the cache, by cache path
_IN_MEMORY: dict[Path, CostModel] = {}


def read_calibration(path: Path, key: dict) -> CostModel | None:
    """The cached calibration at ``path`` if it is usable for ``key``, else None. A cache is
    never trusted: a file that cannot be read or is implausible (truncated, not JSON, no
    points, NaN or negative times...) is reported once, naming it, and measured again."""
    if path in _IN_MEMORY:
        return _IN_MEMORY[path]
    try:
        if not path.is_file():
            return None
        cost = load_cost_surface(path)
    except (CostSurfaceError, OSError) as err:
        warnings.warn(f"ignoring the cached calibration {path}: {err}; measuring it again (the new result "
                      "replaces the file).", UserWarning, stacklevel=3)
        return None
    return cost if cost.meta.get("key") == key else None


def write_calibration(path: Path, cost: CostModel) -> None:
    """Cache a calibration (atomically); where the cache cannot be written (a read-only or
    file-valued ``DRAFTHEADS_CACHE``) warn and keep it in memory for this process."""
    try:
        write_text_atomic(path, json.dumps(cost.to_dict(), indent=1))
        _IN_MEMORY.pop(path, None)
    except UnwritablePathError as err:
        _IN_MEMORY[path] = cost
        warnings.warn(f"the calibration could not be cached: {err} It is kept in memory for this process only; set "
                      "DRAFTHEADS_CACHE to a writable folder to keep it across runs.", UserWarning, stacklevel=3)


def calibrate(model, heads=None, config: CalibrationConfig = CalibrationConfig(), refresh: bool = False,
              log=None) -> CostModel:
    """The cost model of this base on this device/dtype/torch (and these heads): read from
    ``cache_root()/calibration/`` when measured before (and usable), else measured now and
    cached (in memory when the cache cannot be written)."""
    key = calibration_key(model, heads)
    path = calibration_path(key, config)
    cost = None if refresh else read_calibration(path, key)
    if cost is None:
        cost = run_calibration(model, heads, config, log=log)
        write_calibration(path, cost)
    return cost


def best_budget(heads, cost: CostModel, batch_size: int = 1, context_length: int = 256,
                tau_scale: float = 1.0, budgets: Iterable[int] | None = None) -> list["Choice"]:
    """The cost model's ranking of the stored trees (and plain decoding) for a fixed tree:
    expected τ (the checkpoint's, its drafted part scaled by ``tau_scale``) over the calibrated
    step time at this batch size and context; best first. The default tree a checkpoint ships
    for each dtype is the first of these at batch size 1."""
    policy = AdaptivePolicy.from_heads(heads, cost, budgets, learn=False, prior_scale=tau_scale)
    return policy.rank(batch_size, context_length)


# -- the policy ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One tree the policy may pick: its node budget (0 = plain decoding), the tree, and the
    prior expected tokens per step τ (1 for plain decoding)."""

    budget: int
    tree: Tree
    tau: float


def candidates_from_heads(heads, budgets: Iterable[int] | None = None) -> list[Candidate]:
    """Plain decoding plus every stored tree whose budget has an expected τ in the checkpoint."""
    plain = Candidate(0, chain_tree(0), 1.0)
    if heads is None:
        return [plain]
    taus = {int(k): float(v) for k, v in heads.config.expected_tau.items()}
    trees = {int(k): v for k, v in heads.config.trees.items()}
    if not taus or not trees:
        raise CheckpointError("The adaptive policy needs the checkpoint's stored trees and their expected τ "
                         "(config.trees and config.expected_tau, written by training's tree search); "
                         "this checkpoint lacks them: pin a tree instead (tree=<node budget>).")
    wanted = sorted(set(trees) & set(taus) if budgets is None else set(budgets) - {0})
    missing = [b for b in wanted if b not in trees or b not in taus]
    if missing:
        raise InputError(f"No stored tree with an expected τ for budget(s) {missing}; stored: {sorted(set(trees) & set(taus))}.")
    out = [plain]
    for budget in wanted:
        tree = tree_from_paths(trees[budget])
        heads.check_tree(tree.spec)
        out.append(Candidate(budget, tree, taus[budget]))
    return out


@dataclass
class Choice:
    budget: int
    nodes: int
    tau: float
    step_ms: float
    tokens_per_second: float


class AdaptivePolicy:
    """Each step, the candidate tree with the highest expected tokens/s for the live batch.

    Online τ: the checkpoint's τ comes from held-out training text and overestimates other
    text (MT-Bench halves head accuracy). One scale s on the *drafted* part, τ = 1 + s·(τ₀ − 1),
    is fitted as an exponentially decayed ratio of accepted to expected-accepted tokens. One
    scale rather than one average per budget: every step informs every budget, including
    budgets the policy is not currently choosing. It depends only on accepted counts, never on
    timings, so greedy runs are deterministic (and the output tokens never depend on it)."""

    def __init__(self, candidates: Sequence[Candidate], cost: CostModel, learn: bool = True, decay: float = 0.98,
                 prior_weight: float = 16.0, prior_scale: float = 1.0):
        if not candidates:
            raise ValueError("AdaptivePolicy needs at least one candidate tree.")
        self.candidates = sorted(candidates, key=lambda c: c.budget)
        self.cost = cost
        self.learn = learn
        self.decay = decay
        self.prior_weight = prior_weight
        self.prior_scale = prior_scale  # the scale before any observation (fades as steps are seen)
        self._accepted = 0.0  # decayed sums behind the scale
        self._expected = 0.0
        self._last: Candidate | None = None

    @classmethod
    def from_heads(cls, heads, cost: CostModel, budgets: Iterable[int] | None = None, **kwargs) -> "AdaptivePolicy":
        return cls(candidates_from_heads(heads, budgets), cost, **kwargs)

    @property
    def scale(self) -> float:
        return (self._accepted + self.prior_weight * self.prior_scale) / (self._expected + self.prior_weight)

    def tau(self, candidate: Candidate) -> float:
        return 1.0 + self.scale * (candidate.tau - 1.0)

    def rank(self, batch_size: int, context_length: int) -> list[Choice]:
        """Every candidate's predicted step time and goodput, best first (ties: smaller tree)."""
        choices = []
        for c in self.candidates:
            ms = self.cost.step_ms(batch_size, c.tree.num_nodes, context_length, c.budget)
            tau = self.tau(c)
            choices.append(Choice(c.budget, c.tree.num_nodes, tau, ms, batch_size * tau * 1000.0 / ms))
        return sorted(choices, key=lambda ch: (-ch.tokens_per_second, ch.nodes))

    def prefers_plain(self, batch_size: int, context_length: int) -> bool:
        """Whether plain decoding has the best expected goodput for this batch. With the
        decoder's ``delegate_plain`` on, the whole call then goes to the base's own ``generate``
        (as vLLM's ``speculative_disable_by_batch_size`` does); off (the default), the loop runs
        plain steps itself, drops finished rows, and may return to trees as the batch shrinks."""
        return self.rank(batch_size, context_length)[0].budget == 0

    def max_nodes(self, batch_size: int, context_length: int) -> int:
        """The largest tree this policy may choose (what the memory check prices)."""
        return max(c.tree.num_nodes for c in self.candidates)

    def choose(self, batch_size: int, context_length: int) -> Tree:
        best = self.rank(batch_size, context_length)[0]
        self._last = next(c for c in self.candidates if c.budget == best.budget)
        return self._last.tree

    def observe(self, tree: Tree, accepted: torch.Tensor) -> None:
        """Called by the loop after each verification with the rows' accepted draft counts.
        Steps whose tree was cut short (near ``max_new_tokens``) or plain steps say nothing
        about the heads and are skipped."""
        last = self._last
        if not self.learn or last is None or last.budget == 0 or tree is not last.tree:
            return
        self._accepted = self.decay * self._accepted + float(accepted.sum())
        self._expected = self.decay * self._expected + accepted.numel() * (last.tau - 1.0)

    def reset(self) -> None:
        self._accepted = self._expected = 0.0
        self._last = None

    def __repr__(self) -> str:
        return f"AdaptivePolicy(budgets={[c.budget for c in self.candidates]}, scale={self.scale:.3f})"
