"""Measuring the cost model on this machine: the verify forward, the loop's overhead and the
heads' drafting on a grid of batch sizes, query tokens and contexts (best of a few reps), cached
per base, device, dtype, torch, threads and heads (``cache_root()/calibration/``).
"""
from __future__ import annotations

import hashlib
import json
import platform
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..core.errors import InputError, InputTypeError, UnwritablePathError
from .input_checks import check_count
from .base.fewrow import kernel_identity
from .base.hardware import cpu_model, isa_limits
from ..core.atomic import write_text_atomic
from .accept import greedy_tokens
from .base.forward import lm_logits, verify
from .base.loading import cache_root
from .base.attention import PACKED_SDPA, uses_packed_sdpa
from .base.direct import uses_direct_body
from .base.cache import tree_attention_mask
from .base.fingerprint import fingerprint
from .base.packing import block_summary
from .output import in_loop_mode
from .cost import CostModel, CostSurfaceError, LatencyTable, Row, load_cost_surface
from .tree import Tree, chain_tree, tree_from_paths


#: the calibration grid's fields that list sizes (each a whole number ≥ 1), and whether the list may be empty
CALIBRATION_LISTS = {"batch_sizes": False, "nodes": False, "contexts": False, "extra_nodes": True}


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

    def __post_init__(self) -> None:
        """Every field checked as the grid is made (a grid that cannot be measured is refused here,
        naming the field, not when ``tree="adaptive"`` first measures it); lists become tuples."""
        for name, may_be_empty in CALIBRATION_LISTS.items():
            value = getattr(self, name)
            sizes = list(value) if isinstance(value, (list, tuple)) else None
            if sizes is None or (not sizes and not may_be_empty) or \
                    any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes):
                raise InputError(f"calibration.{name}={value!r}: expected a {'' if may_be_empty else 'non-empty '}list "
                                 "of whole numbers ≥ 1, such as [1, 2, 4].")
            object.__setattr__(self, name, tuple(sizes))
        check_count("calibration.max_tokens", self.max_tokens, 1)
        check_count("calibration.reps", self.reps, 1)
        if not isinstance(self.tree_nodes, bool):
            raise InputTypeError(f"calibration.tree_nodes={self.tree_nodes!r}: expected True or False.")

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


#: how the forward is timed (:func:`interleaved_best`): part of the key, so calibrations timed
#: otherwise are measured again rather than trusted
TIMING = "interleaved rounds"


def calibration_key(model, heads=None) -> dict:
    """What the measured costs depend on: the base (fingerprint + the sizes that set its cost),
    the device, the dtype, torch, the thread count, the few-row kernel (its build and the dtypes
    it runs here: a step through it costs less), the products through GGUF blocks (a base whose
    blocks are not at hand streams 2-6× the bytes), whether tree steps run the direct forward
    (:mod:`~.base.direct`: a step costs less), how it is timed and the heads (their drafting cost)."""
    param = next(model.parameters())
    cfg = model.config
    key = {"base": fingerprint(model).to_dict(), "layers": int(cfg.num_hidden_layers),
           "intermediate_size": int(getattr(cfg, "intermediate_size", 0)),
           "device": device_name(param.device), "dtype": str(param.dtype), "torch": torch.__version__,
           "attention": PACKED_SDPA if uses_packed_sdpa(model) else str(getattr(cfg, "_attn_implementation", None)),
           "kernel": kernel_identity(), "blocks": block_summary(model),
           "forward": "direct" if uses_direct_body(model) else "transformers",
           "timing": TIMING}
    if heads is not None:
        hc = heads.config
        key["heads"] = {"family": hc.family, "num_heads": hc.num_heads, "num_layers": hc.num_layers,
                        "draft_vocab_size": hc.draft_vocab_size, "budgets": sorted(int(b) for b in hc.trees)}
    return key


def calibration_path(key: dict, config: CalibrationConfig) -> Path:
    digest = hashlib.sha256(json.dumps([key, asdict(config)], sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "calibration" / f"{digest}.json"


def _synthetic_cache(model, bs: int, kv_len: int):
    """A cache of ``kv_len`` random keys/values per row: costs are independent of the values, and
    this skips a prefill of bs × kv_len tokens (the slowest part of a naive calibration)."""
    from .base.cache import reserved_cache

    cfg = model.config
    param = next(model.parameters())
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = reserved_cache(cfg)
    for layer in range(cfg.num_hidden_layers):
        kv = torch.randn(bs, heads, kv_len, dim, dtype=param.dtype, device=param.device)
        cache.update(kv, kv.clone(), layer)
    return cache


def _best_of(fn, reps: int, warm: bool = True) -> float:
    """Minimum of ``reps`` timed calls after one warm-up (``warm``), in ms: the minimum is the
    least disturbed by other jobs sharing the machine."""
    if warm:
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


@in_loop_mode
def measure_forward(model, bs: int, q: int, kv_len: int, reps: int = 2, warm: bool = True, cache=None) -> float:
    """ms of one verification forward exactly as the loop runs it (4D tree mask over the cache,
    LM head over every node, argmax); the cache (``cache``: one of bs rows and kv_len positions
    to reuse, else a new one) is cropped back after each call."""
    device = next(model.parameters()).device
    cache = _synthetic_cache(model, bs, kv_len) if cache is None else cache
    valid = torch.ones(bs, kv_len, dtype=torch.bool, device=device)
    mask = tree_attention_mask(valid, torch.tril(torch.ones(q, q, dtype=torch.bool, device=device)))
    positions = (kv_len + torch.arange(q, device=device))[None].expand(bs, q)
    tokens = torch.randint(3, model.config.vocab_size, (bs, q), device=device)

    def step():
        states = verify(model, tokens, positions, mask, cache)
        greedy_tokens(lm_logits(model, states))
        _sync(device)
        cache.crop(-q)

    return _best_of(step, reps, warm)


@in_loop_mode
def measure_overhead(model, bs: int, q: int, kv_len: int = 64, reps: int = 3) -> float:
    """ms of the loop's work around the forward: greedy acceptance, KV compaction of the
    accepted path, and the per-row Python bookkeeping of emitting tokens."""
    from .accept import greedy_accept
    from .base.cache import KVState

    device = next(model.parameters()).device
    tree = chain_tree(q - 1)
    vocab = model.config.vocab_size
    tokens = torch.randint(3, vocab, (bs, q), device=device)
    predicted = tokens.roll(-1, 1)  # every draft accepted: the longest path to compact

    def step():
        cache = _synthetic_cache(model, bs, kv_len + q)
        kv = KVState(cache, torch.ones(bs, kv_len, dtype=torch.bool, device=device),
                     torch.full((bs,), kv_len, device=device), torch.full((bs,), kv_len, device=device))
        start = time.perf_counter()
        result = greedy_accept(tokens, tree.parent.to(device), tree.depth.to(device), tree.path_slots.to(device),
                               predicted)
        kv.commit(result.path + kv_len, result.accepted + 1)
        for i in range(bs):
            a = int(result.accepted[i])
            tokens[i, result.path[i, 1: a + 1]].tolist()
        _sync(device)
        return (time.perf_counter() - start) * 1000

    step()
    return min(step() for _ in range(reps))


@in_loop_mode
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


def interleaved_best(points: list, measure, rounds: int, on_round=None) -> list[float]:
    """The least of ``rounds`` timings of each point, the grid measured once per round (each
    point warmed up in the first round only): a busy spell on a shared machine then lifts one
    round of many points, which the other rounds undo, where repeating each point in a row let
    it lift every timing of the few points it fell on (an AVX2 run priced 2-3 query tokens
    above 4-5 at one context and not at the other). ``measure(point, warm)`` → ms;
    ``on_round(round, rounds, seconds)`` after each round (a long calibration's progress)."""
    best = [float("inf")] * len(points)
    for round_ in range(rounds):
        started = time.perf_counter()
        for i, point in enumerate(points):
            best[i] = min(best[i], measure(point, round_ == 0))
        if on_round is not None:
            on_round(round_ + 1, rounds, time.perf_counter() - started)
    return best


def forward_timer(model):
    """``measure((kv_len, bs, q), warm)`` for :func:`interleaved_best`: one forward's ms, the
    synthetic cache built once for the consecutive points of one context and batch size (each
    call crops it back), not once per call: filling it costs more than the forwards at large bs."""
    held: dict[tuple[int, int], object] = {}

    def measure(point: tuple[int, int, int], warm: bool) -> float:
        kv_len, bs, q = point
        if (kv_len, bs) not in held:
            held.clear()  # one cache alive at a time
            held[kv_len, bs] = _synthetic_cache(model, bs, kv_len)
        return measure_forward(model, bs, q, kv_len, 1, warm, cache=held[kv_len, bs])

    return measure


def monotone_envelope(rows: list[Row]) -> list[Row]:
    """Each point lowered to the cheapest point with at least as many query tokens and rows
    (same kv_len). For the loop's overhead and the drafting cost more work never takes less time,
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
    overhead, draft = [], []
    nodes = config.grid_nodes(heads)
    # Warm-up first: a fresh process's first forwards page in the (memory-mapped) weights and size
    # the allocator, and would overprice the first grid point.
    for q in (1, max(nodes)):
        measure_forward(model, 1, q, config.contexts[0], reps=3)
    # q = 1 and 2 always, so every batch size has a slope to extrapolate along
    points = [(kv_len, bs, q) for kv_len in config.contexts for bs in config.batch_sizes
              for q in nodes if q <= 2 or bs * q <= config.max_tokens]
    progress = None if log is None else (
        lambda done, rounds, seconds: log(f"calibration: round {done} of {rounds} over {len(points)} forwards, {seconds:.1f} s"))
    times = interleaved_best(points, forward_timer(model), config.reps, progress)
    forward = [{"bs": bs, "q": q, "ctx": kv_len, "ms": ms} for (kv_len, bs, q), ms in zip(points, times)]
    if log:
        for kv_len in config.contexts:
            for bs in config.batch_sizes:
                log(f"calibration kv_len={kv_len} bs={bs}: " + " ".join(f"q{r['q']}={r['ms']:.0f}ms"
                                                                for r in forward if r['bs'] == bs and r['ctx'] == kv_len))
    for bs in config.batch_sizes:
        for q in (1, 5):
            overhead.append({"bs": bs, "q": q, "ctx": 0, "ms": measure_overhead(model, bs, q)})
        if heads is not None:
            for budget, paths in sorted((int(b), p) for b, p in heads.config.trees.items()):
                draft.append({"bs": bs, "q": budget, "ctx": 0, "ms": measure_draft(model, heads, bs, tree_from_paths(paths))})
    meta = {"key": calibration_key(model, heads), "config": asdict(config),
            "seconds": round(time.perf_counter() - started, 1), "raw_rows": forward,
            "note": "ms = best of reps (the forward: of reps rounds over the grid, interleaved_best); overhead and draft tables then the monotone envelope (see monotone_envelope); "
                    "forward = verify + LM head + argmax over bs x q tree slots at context ctx"}
    # The forward table keeps its raw points: its true cost is not monotone in the work (MKL's
    # kernel for 2-3 rows can be slower than its GEMM for 4+), and lowering it to the envelope
    # misprices exactly those points. The best of ``reps`` interleaved rounds is its only noise filter.
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
