"""Where packing pays: per dtype from what torch and oneDNN report, per weight shape and row count
by measurement (:class:`PackingPlan`).

Why packing: on a CPU, ``F.linear`` re-lays out the weight for oneDNN (bfloat16) or runs MKL's
sgemm (float32, slow for a few rows) on every call; a weight packed once into oneDNN's blocked
layout and multiplied through its linear primitive is faster for bfloat16 at every row count and
for float32 at a few rows. Packed bfloat16 results are bit-identical to ``F.linear`` (same
accumulation); float32 results differ by float32 rounding, which the float32 guarantee
(identical, or a first divergence at a near-tie) allows. A third path, the few-row kernel
(:mod:`.fewrow`: float32 on AVX2, bfloat16 on AVX512-BF16), reads each weight once for up to 6
rows; its bf16 sums land within one bf16 rounding of ``F.linear``'s, which the bfloat16
guarantee (a first divergence within the dtype's rounding) allows.
evidence: results/cpu_classes

Where packing pays is a property of the machine, the dtype, the weight's shape and the row
count (on an AVX2 CPU a 1-row product can be faster through MKL), so it is decided **per
dtype** from what torch and oneDNN report (:func:`packing_available`: a limited ISA, e.g.
``ONEDNN_MAX_CPU_ISA=AVX2``, is honoured) and **per shape and row count by measurement**
(:class:`PackingPlan`: a few timings per weight shape at load, cached per machine by the
decoder, :mod:`.packing`). Unmeasured shapes take the packed path wherever the dtype packs. The
packed path is only taken inside the decoder's own forwards (:mod:`.binding`).
"""
from __future__ import annotations

import functools
import itertools
import math
import re
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

import torch
from torch import nn

from .fewrow import block_weight, fewrow_product, kernel, kernel_dtypes
from .blocks import GROUP, KINDS, blocks_available, blocks_product, make_blocks, random_parts
from .hardware import bf16_native


PACKED_DTYPES = (torch.bfloat16, torch.float32)
#: the row counts at which a shape's two paths are timed: powers of two, so a call's rows fall
#: in the bucket of the largest one not above them (verification: bs × tree nodes, 1 to ~128)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@functools.lru_cache(maxsize=None)
def packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs here for ``dtype`` and agrees with ``F.linear``
    (bit-exact for bfloat16, within float32 rounding for float32). Per dtype: float32 packing
    never depends on bfloat16's (on AVX2 oneDNN refuses bf16 packing but packs float32), and
    bfloat16 packs only where it is native (:func:`bf16_native`)."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not bf16_native():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(24, 16, generator=generator).to(dtype)
        x = torch.randn(3, 16, generator=generator).to(dtype)
        packed = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(weight, 8), None,
                                                    "none", [], "")
        reference = nn.functional.linear(x, weight)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    if dtype == torch.bfloat16:
        return torch.equal(packed, reference)
    return torch.allclose(packed, reference, rtol=1e-4, atol=1e-5)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (out, in) can take the packed path at all (CPU, a dtype that packs here)."""
    return weight.device.type == "cpu" and weight.dim() == 2 and packing_available(weight.dtype)


# -- where packing pays: measured per shape and row count ----------------------------------------
ShapeKey = str  # "float32 1728x576": dtype, out × in features


def shape_key(dtype: torch.dtype, out_features: int, in_features: int) -> ShapeKey:
    return f"{str(dtype).removeprefix('torch.')} {out_features}x{in_features}"


def row_bucket(rows: int) -> int:
    """The index in :data:`ROW_BUCKETS` of the largest bucket not above ``rows``."""
    return min(len(ROW_BUCKETS) - 1, max(0, int(rows).bit_length() - 1))


def _best_ms(fn, reps: int) -> float:
    """Best-of-``reps`` milliseconds per call; each timing repeats the call until it spans ~2 ms
    (a 1-row product of a small weight takes microseconds)."""
    start = time.perf_counter()
    fn()  # warm-up: first calls allocate
    calls = max(1, min(200, int(2e-3 / max(time.perf_counter() - start, 1e-6))))
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


#: the most bytes of weight copies a shape is timed over (:func:`measure_shape`): more than a
#: CPU's last-level cache, so a product reads its weight from memory as in decoding, where a
#: base's weights (212-424 MB for SmolLM2) stream past between two uses of one. Timed warm in
#: cache instead, the compute-bound paths win at 4-7 rows where the memory-bound few-row kernel
#: is faster in decoding. evidence: results/cpu_classes/packing_regime
STREAM_BYTES = 128 << 20

#: what a timing's footprint counts (a cache timed under another rule is measured again): every
#: weight a decoding step streams, the base's around the heads' (:func:`~.packing.plan_packing`)
FOOTPRINT_RULE = "decoder working set"


def stream_copies(weight_bytes: int, footprint: int) -> int:
    """How many copies of a weight of ``weight_bytes`` a product is timed over: enough to fill
    the smaller of ``footprint`` (the bytes a decoding step streams, :data:`FOOTPRINT_RULE`: a model small enough
    to stay in cache is timed warm) and :data:`STREAM_BYTES`."""
    return max(1, min(footprint, STREAM_BYTES) // max(1, weight_bytes))


def _rotating(products: list[Callable[[torch.Tensor], torch.Tensor]]) -> Callable[[torch.Tensor], torch.Tensor]:
    """One product per call, the next copy's each time: x → products[i % n](x)."""
    turn = itertools.count()
    return lambda x: products[next(turn) % len(products)](x)


def measure_shape(dtype: torch.dtype, out_features: int, in_features: int, reps: int = 3,
                  footprint: int = 0, kinds: Iterable[str] = ()) -> dict[str, list[float]]:
    """ms per call of ``F.linear``, of the packed product and (where it is loaded for the dtype) of the
    few-row kernel for a random weight of this shape at every row count of :data:`ROW_BUCKETS`,
    interleaved (one noisy spell hits every path alike); each call reads the next of
    :func:`stream_copies` copies of the weight (``footprint``: the bytes a decoding step streams).
    For each of ``kinds`` (a weight of this shape has such GGUF blocks) whose block product applies
    here (:func:`blocks_apply`), that product is timed too, over random blocks."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    weights = [weight] + [weight.clone() for _ in range(stream_copies(weight.numel() * weight.element_size(),
                                                                         footprint) - 1)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
    paths = {"linear_ms": _rotating([functools.partial(_linear, weight=w) for w in weights]),
             "packed_ms": _rotating([functools.partial(_packed, packed=p) for p in packed])}
    if fewrow_applies(weight):
        blocked = [block_weight(w) for w in weights]
        paths["fewrow_ms"] = _rotating([fewrow_product(b, out_features) for b in blocked])
    for kind in (k for k in KINDS if k in set(kinds) and blocks_apply(weight, k)):
        first = make_blocks(kind, *random_parts(kind, out_features, in_features, generator), dtype=dtype)
        copies = [first] + [replace(first, data=first.data.clone(), scales=first.scales.clone())
                            for _ in range(stream_copies(first.nbytes, footprint) - 1)]
        paths[f"{kind}_ms"] = _rotating([blocks_product(b) for b in copies])
    timings: dict[str, list[float]] = {name: [] for name in paths}
    with torch.no_grad():
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, in_features, generator=generator).to(dtype)
            for name, path in paths.items():
                timings[name].append(round(_best_ms(lambda: path(x), reps), 4))
    return timings


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x, weight)


def _packed(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


#: the longest a measured product may take, ms: anything above is no measurement (a JSON file
#: carries integers of any size, which float conversion — ``math.isfinite`` included — overflows on)
MAX_MS = 1e6


def plausible_ms(value) -> bool:
    """A time a measurement can give: a number (not a bool) above 0 and below :data:`MAX_MS`
    (compared, never converted: NaN, infinities and huge integers all fail)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < MAX_MS


def _timing_list(value) -> bool:
    return isinstance(value, list) and len(value) == len(ROW_BUCKETS) and all(plausible_ms(v) for v in value)


def valid_timings(entry) -> bool:
    """A measured shape as :func:`measure_shape` writes it: lists of plausible ms
    (:func:`plausible_ms`), one per row bucket, for ``F.linear`` and the packed path, and for the
    kernel where it was measured (a cached entry is checked with this before it is used)."""
    return (isinstance(entry, dict) and all(_timing_list(entry.get(name)) for name in ("linear_ms", "packed_ms"))
            and all(name not in entry or _timing_list(entry[name]) for name in OPTIONAL_TIMINGS))


_SHAPE_KEY = re.compile(r"(?P<dtype>[a-z0-9]+) [1-9][0-9]{0,8}x[1-9][0-9]{0,8}")


def valid_shape_key(key) -> bool:
    """A key as :func:`shape_key` writes it: a dtype that packs, then positive ``out``x``in``
    features ("float32 1728x576"); a cached entry under any other key is dropped."""
    match = _SHAPE_KEY.fullmatch(key) if isinstance(key, str) else None
    return match is not None and match["dtype"] in {str(d).removeprefix("torch.") for d in PACKED_DTYPES}


#: packing is the measured-faster path almost everywhere; it is turned off for a (shape, rows)
#: point only where it measured more than this much slower (timing noise only adds time)
PACK_TOLERANCE = 1.1
#: the paths a product can take: "linear" (``F.linear``), "packed" (oneDNN), "fewrow" (the kernel),
#: and each block kind (the kernel over the weight's GGUF blocks, :mod:`.blocks`: only a weight that has them)
PATHS = ("linear", "packed", "fewrow") + KINDS
#: the timings a measured shape has only where its path applies
OPTIONAL_TIMINGS = ("fewrow_ms",) + tuple(f"{kind}_ms" for kind in KINDS)


def fastest_paths(entry: dict[str, list[float]], kernel_loaded: bool = True,
                  kind: str | None = None) -> tuple[str, ...]:
    """Per row bucket of a measured shape, the path taken: packed unless it measured more than
    :data:`PACK_TOLERANCE` slower than ``F.linear``; the few-row kernel (when loaded and
    measured) where it beat both; for a weight with blocks of ``kind``, their product where it
    beat every other."""
    chosen = []
    for bucket, (p, f) in enumerate(zip(entry["packed_ms"], entry["linear_ms"])):
        path, best = ("packed", p) if p <= f * PACK_TOLERANCE else ("linear", f)
        if kernel_loaded and "fewrow_ms" in entry and entry["fewrow_ms"][bucket] < min(p, f):
            path, best = "fewrow", entry["fewrow_ms"][bucket]
        blocks_ms = entry.get(f"{kind}_ms") if kind is not None and kernel_loaded else None
        if blocks_ms is not None and blocks_ms[bucket] < min(best, p, f):
            path = kind
        chosen.append(path)
    return tuple(chosen)


def packed_wins(entry: dict[str, list[float]]) -> tuple[bool, ...]:
    """Per row bucket of a measured shape: whether a faster path than ``F.linear`` is taken."""
    return tuple(path != "linear" for path in fastest_paths(entry))


def fewrow_applies(weight: torch.Tensor) -> bool:
    """Whether the few-row kernel can multiply by ``weight``: on the CPU, in a dtype the loaded
    kernel multiplies here (:func:`~.fewrow.kernel_dtypes`), bfloat16 with an even input width."""
    return (weight.device.type == "cpu" and weight.dtype in kernel_dtypes()
            and (weight.dtype != torch.bfloat16 or weight.shape[-1] % 2 == 0))


def blocks_apply(weight: torch.Tensor, kind: str) -> bool:
    """Whether a weight of this shape and dtype could be multiplied through blocks of ``kind`` here
    (:mod:`.blocks`): on the CPU, whole blocks of inputs, a dtype whose block product agreed here."""
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.shape[-1] % GROUP == 0
            and blocks_available(kind, weight.dtype))


@dataclass
class PackingPlan:
    """Per weight shape and dtype, the measured ms of each path per row bucket; the fastest is
    taken (:func:`fastest_paths`). Shapes never measured pack wherever the dtype packs."""

    timings: dict[ShapeKey, dict[str, list[float]]] = field(default_factory=dict)
    _verdicts: dict[tuple[ShapeKey, str | None], tuple[str, ...]] = field(default_factory=dict, repr=False)
    _fusions: dict[tuple[ShapeKey, int, str | None], bool] = field(default_factory=dict, repr=False)
    #: bumped whenever a verdict may change (what resolved products, :mod:`.direct`, compare)
    generation: int = 0

    def path(self, weight: torch.Tensor, rows: int, kind: str | None = None) -> str:
        """The path a product of ``rows`` rows with ``weight`` takes (one of :data:`PATHS`;
        ``kind``: the weight has blocks of that kind)."""
        return self.path_of(shape_key(weight.dtype, weight.shape[0], weight.shape[1]), rows, kind)

    def path_of(self, key: ShapeKey, rows: int, kind: str | None = None) -> str:
        verdict = self._verdicts.get((key, kind))
        if verdict is None:
            entry = self.timings.get(key)
            if entry is None:
                return "packed"
            verdict = self._verdicts[(key, kind)] = fastest_paths(entry, kernel() is not None, kind)
        return verdict[row_bucket(rows)]

    def pays(self, weight: torch.Tensor, rows: int, kind: str | None = None) -> bool:
        return self.path(weight, rows, kind) != "linear"

    def best_ms(self, key: ShapeKey, rows: int, kind: str | None = None) -> float | None:
        """The measured ms of the path taken for ``rows`` rows of shape ``key`` (None: unmeasured)."""
        entry = self.timings.get(key)
        if entry is None:
            return None
        bucket = row_bucket(rows)
        return entry[f"{self.path_of(key, rows, kind)}_ms"][bucket]

    def fusion_pays(self, fused: ShapeKey, members: tuple[ShapeKey, ...], rows: int, kind: str | None = None) -> bool:
        """Whether one product of the stacked weight (``fused``) measured faster than the
        ``members``' products one by one, at ``rows`` rows (unmeasured: no; ``kind``: all of them
        through their blocks of that kind)."""
        verdict = self._fusions.get((fused, row_bucket(rows), kind))
        if verdict is None:
            together = self.best_ms(fused, rows, kind)
            alone = [self.best_ms(key, rows, kind) for key in members]
            verdict = together is not None and None not in alone and together < sum(alone)
            self._fusions[(fused, row_bucket(rows), kind)] = verdict
        return verdict

    def missing(self, weights: Iterable[torch.Tensor],
                blocks: dict[tuple[torch.dtype, int, int], set[str]] | None = None
                ) -> list[tuple[torch.dtype, int, int]]:
        """The (dtype, out, in) shapes among ``weights`` that pack here but were not measured yet
        (or were measured before the few-row kernel was loaded, for the shapes it applies to, or
        without the block product of a kind ``blocks`` lists for the shape)."""
        blocks = blocks or {}
        shapes = {(w.dtype, int(w.shape[0]), int(w.shape[1])) for w in weights if can_pack(w)}
        kernel_shapes = {(w.dtype, int(w.shape[0]), int(w.shape[1])) for w in weights if fewrow_applies(w)}
        block_shapes = {kind: {(w.dtype, int(w.shape[0]), int(w.shape[1])) for w in weights if blocks_apply(w, kind)
                               and kind in blocks.get((w.dtype, int(w.shape[0]), int(w.shape[1])), ())}
                        for kind in KINDS}

        def unmeasured(s) -> bool:
            entry = self.timings.get(shape_key(*s))
            return (entry is None or (s in kernel_shapes and "fewrow_ms" not in entry)
                    or any(s in shapes and f"{kind}_ms" not in entry for kind, shapes in block_shapes.items()))
        return sorted((s for s in shapes if unmeasured(s)), key=str)

    def add(self, key: ShapeKey, entry: dict[str, list[float]]) -> None:
        self.timings[key] = entry
        for kind in (None,) + KINDS:
            self._verdicts.pop((key, kind), None)
        self._fusions.clear()
        self.generation += 1

    def replace(self, timings: dict[ShapeKey, dict[str, list[float]]]) -> None:
        """Decide from ``timings`` alone from now on (every verdict made again)."""
        self.timings = dict(timings)
        self._verdicts.clear()
        self._fusions.clear()
        self.generation += 1


#: the process's plan (the decoder fills it at load, from its per-machine cache or by measuring)
PLAN = PackingPlan()


def packs(weight: torch.Tensor, rows: int, kind: str | None = None) -> bool:
    """Whether a product of ``rows`` rows with ``weight`` takes a path other than ``F.linear``:
    the dtype packs here and the shape measured faster that way at that row count (``kind``: the
    weight has blocks of that kind)."""
    return can_pack(weight) and PLAN.pays(weight, rows, kind)

