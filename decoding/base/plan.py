"""Prepacked linear layers for CPU inference (oneDNN), used by the decoder's own forwards only.

Why: on a CPU, ``F.linear`` re-lays out the weight for oneDNN (bfloat16) or runs MKL's sgemm
(float32, slow for 2-32 rows) on every call. Packing each weight once into oneDNN's blocked
layout and calling its linear primitive directly measured 1.5-2× faster for bfloat16 at every
row count (the 49,152 × 576 LM head: 8.4 vs 17.5 ms for 1 row, one thread) and 1.7-3× for
float32 at 4-9 rows (AVX512 and AVX2 alike). Packed bfloat16 results are bit-identical to
``F.linear`` (same accumulation); float32 results differ by float32 rounding (~1e-5 on
SmolLM2's logits), which the float32 guarantee (identical, or a first divergence at a near-tie)
allows. A third path, the few-row kernel (:mod:`.fewrow`: float32 on AVX2, bfloat16 on
AVX512-BF16), reads each weight once for up to 6 rows; its bf16 sums land one bf16 ulp from
``F.linear``'s on ~0.1 % of outputs, which the bfloat16 guarantee (a first divergence within the
dtype's rounding) allows.

Where packing pays is a property of the machine, the dtype, the weight's shape and the row
count (on an AVX2 CPU a 1-row product can be faster through MKL), so it is decided **per
dtype** from what torch and oneDNN report (:func:`packing_available`: a limited ISA, e.g.
``ONEDNN_MAX_CPU_ISA=AVX2``, is honoured) and **per shape and row count by measurement**
(:class:`PackingPlan`: a few timings per weight shape at load, cached per machine by the
decoder). Unmeasured shapes take the packed path wherever the dtype packs.

The packed path is only taken inside the decoder's own forwards (:func:`packed_forward`), and
nothing of it lives in the model: the copies are kept beside it (:class:`Binding`), each
``nn.Linear`` wears :class:`PackedLinear` as its class only while the decoder runs, and every
copy is checked against its weight's content before each decoding call
(:func:`content_fingerprint`), so the model the user holds is exactly the one they built — the
base's own ``generate``, ``deepcopy``, ``pickle``, quantizers and peft see plain layers with the
weights they have now.
"""
from __future__ import annotations

import contextvars
import functools
import math
import re
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch import nn

from .fewrow import block_weight, fewrow_linear, kernel, kernel_dtypes
from .hardware import bf16_native

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("draftheads_packed_linears", default=False)


@dataclass(eq=False)
class RowSubset:
    """The rows (flat token positions) a forward's linear layers compute; the others come out
    zero. Why: in a batched step rows draft different numbers of tree nodes and are padded to
    the widest, and where the forward is compute-bound (SmolLM2 at bs 16 adds ~22 ms a step per
    slot a row) a padding slot nobody reads costs what a real one does."""

    index: torch.Tensor  # (K,) long, ascending
    total: int  # rows of a full input
    _source: torch.Tensor | None = None
    _version: int = -1
    _gathered: torch.Tensor | None = None

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) with ``total`` rows → (K, in). The same tensor for the same input, so
        sibling projections (:class:`SiblingProduct`) still find their shared product."""
        version = -2 if x.is_inference() else x._version
        if x is not self._source or version != self._version:
            self._gathered = x.reshape(-1, x.shape[-1]).index_select(0, self.index)
            self._source, self._version = x, version
        return self._gathered

    def scatter(self, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """y (K, out) → (..., out) shaped as ``like``'s rows, zeros in the rows not computed."""
        out = y.new_zeros(self.total, y.shape[-1])
        out.index_copy_(0, self.index, y)
        return out.view(*like.shape[:-1], y.shape[-1])


_ROWS: contextvars.ContextVar[RowSubset | None] = contextvars.ContextVar("draftheads_rows", default=None)


@contextmanager
def computed_rows(valid: torch.Tensor | None) -> Iterator[None]:
    """Inside: the wrapped linear layers (:class:`PackedLinear`) and :func:`subset_product`
    compute only the rows whose ``valid`` (..., a row's position in the input's leading
    dimensions) is True; None or all True: every row, as outside."""
    if valid is None or bool(valid.all()):
        yield
        return
    token = _ROWS.set(RowSubset(valid.reshape(-1).nonzero().flatten(), valid.numel()))
    try:
        yield
    finally:
        _ROWS.reset(token)


def subset_product(x: torch.Tensor, width: int, product) -> torch.Tensor:
    """``product(x)`` (x (..., width) → (..., out)) on the rows :func:`computed_rows` keeps."""
    subset = _ROWS.get()
    if subset is not None and x.numel() == subset.total * width:
        return subset.scatter(product(subset.gather(x)), x)
    return product(x)


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


def measure_shape(dtype: torch.dtype, out_features: int, in_features: int, reps: int = 3) -> dict[str, list[float]]:
    """ms per call of ``F.linear``, of the packed product and (where it is loaded for the dtype) of the
    few-row kernel for a random weight of this shape at every row count of :data:`ROW_BUCKETS`,
    interleaved (one noisy spell hits every path alike)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
    paths = {"linear_ms": lambda x: nn.functional.linear(x, weight),
             "packed_ms": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
    if fewrow_applies(weight):
        blocked = block_weight(weight)
        paths["fewrow_ms"] = lambda x: fewrow_linear(x, blocked, out_features)
    timings: dict[str, list[float]] = {name: [] for name in paths}
    with torch.no_grad():
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, in_features, generator=generator).to(dtype)
            for name, path in paths.items():
                timings[name].append(round(_best_ms(lambda: path(x), reps), 4))
    return timings


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
            and ("fewrow_ms" not in entry or _timing_list(entry["fewrow_ms"])))


_SHAPE_KEY = re.compile(r"(?P<dtype>[a-z0-9]+) [1-9][0-9]{0,8}x[1-9][0-9]{0,8}")


def valid_shape_key(key) -> bool:
    """A key as :func:`shape_key` writes it: a dtype that packs, then positive ``out``x``in``
    features ("float32 1728x576"); a cached entry under any other key is dropped."""
    match = _SHAPE_KEY.fullmatch(key) if isinstance(key, str) else None
    return match is not None and match["dtype"] in {str(d).removeprefix("torch.") for d in PACKED_DTYPES}


#: packing is the measured-faster path almost everywhere; it is turned off for a (shape, rows)
#: point only where it measured more than this much slower (timing noise only adds time)
PACK_TOLERANCE = 1.1
#: the paths a product can take: "linear" (``F.linear``), "packed" (oneDNN), "fewrow" (the kernel)
PATHS = ("linear", "packed", "fewrow")


def fastest_paths(entry: dict[str, list[float]], kernel_loaded: bool = True) -> tuple[str, ...]:
    """Per row bucket of a measured shape, the path taken: packed unless it measured more than
    :data:`PACK_TOLERANCE` slower than ``F.linear``; the few-row kernel (when loaded and
    measured) where it beat both."""
    chosen = []
    for bucket, (p, f) in enumerate(zip(entry["packed_ms"], entry["linear_ms"])):
        path, ms = ("packed", p) if p <= f * PACK_TOLERANCE else ("linear", f)
        if kernel_loaded and "fewrow_ms" in entry and entry["fewrow_ms"][bucket] < min(p, f):
            path = "fewrow"
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


@dataclass
class PackingPlan:
    """Per weight shape and dtype, the measured ms of each path per row bucket; the fastest is
    taken (:func:`fastest_paths`). Shapes never measured pack wherever the dtype packs."""

    timings: dict[ShapeKey, dict[str, list[float]]] = field(default_factory=dict)
    _verdicts: dict[ShapeKey, tuple[str, ...]] = field(default_factory=dict, repr=False)
    _fusions: dict[tuple[ShapeKey, int], bool] = field(default_factory=dict, repr=False)

    def path(self, weight: torch.Tensor, rows: int) -> str:
        """The path a product of ``rows`` rows with ``weight`` takes (one of :data:`PATHS`)."""
        return self.path_of(shape_key(weight.dtype, weight.shape[0], weight.shape[1]), rows)

    def path_of(self, key: ShapeKey, rows: int) -> str:
        verdict = self._verdicts.get(key)
        if verdict is None:
            entry = self.timings.get(key)
            if entry is None:
                return "packed"
            verdict = self._verdicts[key] = fastest_paths(entry, kernel() is not None)
        return verdict[row_bucket(rows)]

    def pays(self, weight: torch.Tensor, rows: int) -> bool:
        return self.path(weight, rows) != "linear"

    def best_ms(self, key: ShapeKey, rows: int) -> float | None:
        """The measured ms of the path taken for ``rows`` rows of shape ``key`` (None: unmeasured)."""
        entry = self.timings.get(key)
        if entry is None:
            return None
        bucket = row_bucket(rows)
        return entry[f"{self.path_of(key, rows)}_ms"][bucket]

    def fusion_pays(self, fused: ShapeKey, members: tuple[ShapeKey, ...], rows: int) -> bool:
        """Whether one product of the stacked weight (``fused``) measured faster than the
        ``members``' products one by one, at ``rows`` rows (unmeasured: no)."""
        verdict = self._fusions.get((fused, row_bucket(rows)))
        if verdict is None:
            together = self.best_ms(fused, rows)
            alone = [self.best_ms(key, rows) for key in members]
            verdict = together is not None and None not in alone and together < sum(alone)
            self._fusions[(fused, row_bucket(rows))] = verdict
        return verdict

    def missing(self, weights: Iterable[torch.Tensor]) -> list[tuple[torch.dtype, int, int]]:
        """The (dtype, out, in) shapes among ``weights`` that pack here but were not measured yet
        (or were measured before the few-row kernel was loaded, for the shapes it applies to)."""
        shapes = {(w.dtype, int(w.shape[0]), int(w.shape[1])) for w in weights if can_pack(w)}
        kernel_shapes = {(w.dtype, int(w.shape[0]), int(w.shape[1])) for w in weights if fewrow_applies(w)}

        def unmeasured(s) -> bool:
            entry = self.timings.get(shape_key(*s))
            return entry is None or (s in kernel_shapes and "fewrow_ms" not in entry)
        return sorted((s for s in shapes if unmeasured(s)), key=str)

    def add(self, key: ShapeKey, entry: dict[str, list[float]]) -> None:
        self.timings[key] = entry
        self._verdicts.pop(key, None)
        self._fusions.clear()


#: the process's plan (the decoder fills it at load, from its per-machine cache or by measuring)
PLAN = PackingPlan()


def packs(weight: torch.Tensor, rows: int) -> bool:
    """Whether a product of ``rows`` rows with ``weight`` takes a path other than ``F.linear``:
    the dtype packs here and the shape measured faster that way at that row count."""
    return can_pack(weight) and PLAN.pays(weight, rows)


# -- a weight's copies, and whether they still hold its content ----------------------------------
#: one refresh's fingerprints, by tensor (storage, dtype, shape, strides, device): a weight shared
#: by two owners (a tied LM head, the heads' readout) is read once
FingerprintMemo = dict


def content_fingerprint(weight: torch.Tensor) -> torch.Tensor:
    """Per row of ``weight``, the wrapping int64 sum of its bytes read as 64-bit words (narrower
    words where a row does not split into them). Why the content: a write through ``.data``
    (peft's LoRA ``merge()``, an EMA update, FSDP copying parameters in) changes neither the
    tensor's storage nor its ``_version``, so nothing but the bytes shows it. Any changed word
    changes its row's sum, and rows that trade places trade sums. An integer sum of the weight's
    own bytes needs no conversion, so it runs at memory speed (about what one verification step
    spends reading the same weight)."""
    w = weight.detach()
    rows = w.reshape(w.shape[0] if w.dim() else 1, -1)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    raw = rows.view(torch.uint8)
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if raw.shape[1] % size == 0 and raw.storage_offset() % size == 0:
            return raw.view(word).sum(1, dtype=torch.int64)
    return raw.sum(1, dtype=torch.int64)


def fingerprint_of(weight: torch.Tensor, memo: FingerprintMemo | None = None) -> torch.Tensor:
    """:func:`content_fingerprint`, read once per tensor within one ``memo``."""
    if memo is None:
        return content_fingerprint(weight)
    key = (weight.data_ptr(), weight.dtype, tuple(weight.shape), weight.stride(), weight.device)
    found = memo.get(key)
    if found is None:
        found = memo[key] = content_fingerprint(weight)
    return found


def tensor_key(weight: torch.Tensor) -> tuple:
    """What identifies a weight's tensor cheaply (dtype, device, storage, autograd version, shape):
    a copy whose key differs is remade on its next use."""
    return weight.dtype, weight.device, weight.data_ptr(), weight._version, tuple(weight.shape)


class PackedWeight:
    """A weight's oneDNN-packed copy and its few-row kernel copy, each made on first use and kept
    with the fingerprint of the content it was made from (:func:`content_fingerprint`). A copy is
    remade when the weight is another tensor or was changed through autograd
    (:func:`tensor_key`, checked on every use, for free), and dropped by :meth:`drop_stale` —
    called before each decoding call — when the content changed any other way."""

    def __init__(self) -> None:
        self._copies: dict[str, tuple[tuple, torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def key(self, weight: torch.Tensor) -> tuple:
        return tensor_key(weight)

    def fingerprint(self, weight: torch.Tensor, memo: FingerprintMemo | None = None) -> tuple[torch.Tensor, ...]:
        return (fingerprint_of(weight, memo),)

    def source(self, weight: torch.Tensor) -> torch.Tensor:
        """The tensor a copy is made from."""
        return weight.detach().contiguous()

    def _copy(self, kind: str, weight: torch.Tensor, make) -> torch.Tensor:
        key = self.key(weight)
        cached = self._copies.get(kind)
        if cached is None or cached[0] != key:
            cached = self._copies[kind] = (key, make(self.source(weight)), self.fingerprint(weight))
        return cached[1]

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        return self._copy("packed", weight, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 8))

    def blocked(self, weight: torch.Tensor) -> torch.Tensor:
        return self._copy("fewrow", weight, block_weight)

    def drop_stale(self, weight: torch.Tensor, memo: FingerprintMemo | None = None) -> bool:
        """Drop every copy not made from ``weight`` as it is now (another tensor, or other content);
        returns whether one was dropped. Reads the weight once (none when no copy was made)."""
        if not self._copies:
            return False
        key = self.key(weight)
        current = None
        stale = []
        for kind, (made_key, _, made_from) in self._copies.items():
            if made_key == key:
                current = current if current is not None else self.fingerprint(weight, memo)
                if all(torch.equal(a, b) for a, b in zip(made_from, current)):
                    continue
            stale.append(kind)
        for kind in stale:
            del self._copies[kind]
        return bool(stale)

    def clear(self) -> None:
        self._copies.clear()


def packed_matmul(x: torch.Tensor, weight: torch.Tensor, cache: PackedWeight,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) · weightᵀ (weight (out, in)) through the copy in ``cache`` that the plan picks
    for this row count (packed, or the few-row kernel); callers check :func:`packs` and that
    ``x`` has the weight's dtype."""
    if PLAN.path(weight, x.numel() // x.shape[-1]) == "fewrow" and fewrow_applies(weight):
        return fewrow_linear(x, cache.blocked(weight), weight.shape[0], bias)
    return torch.ops.mkldnn._linear_pointwise(x, cache.get(weight), bias, "none", [], "")


# -- a model's linear layers, bound beside it ------------------------------------------------------
@dataclass(eq=False)
class BoundLinear:
    """What draftheads keeps for one of a module's ``nn.Linear`` layers: its copies and, where it
    has siblings (:data:`SIBLINGS`), its slice of their one product."""

    module: nn.Linear
    copies: PackedWeight = field(default_factory=PackedWeight)
    siblings: "tuple[SiblingProduct, int] | None" = None


#: the bound linears of the bindings now entered (:meth:`Binding.enter`), by ``id`` of the module
#: (held by its binding while listed, so the id is its own)
_LIVE: dict[int, BoundLinear] = {}
_WEAR_LOCK = threading.Lock()


class PackedLinear(nn.Linear):
    """The class a bound ``nn.Linear`` wears while its binding is entered (inside the decoder's
    forwards), and only then: the same object, parameters, hooks and ``__dict__``; its product
    through the packed oneDNN primitive, the few-row kernel or its slice of its siblings' one
    product (:class:`SiblingProduct`), whichever the plan picks, while :func:`packed_linears` is
    active in this thread; ``F.linear`` otherwise (another thread's call sees the plain layer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return subset_product(x, self.in_features, self._product)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        bound = _LIVE.get(id(self)) if _ACTIVE.get() else None
        if bound is not None and x.dtype == self.weight.dtype:
            rows = x.numel() // self.in_features
            if bound.siblings is not None and bound.siblings[0].pays(rows):
                return bound.siblings[0].output(bound.siblings[1], x)
            if packs(self.weight, rows):
                return packed_matmul(x, self.weight, bound.copies, self.bias)
        return nn.functional.linear(x, self.weight, self.bias)


def _wear(module: nn.Module, cls: type) -> None:
    # object.__setattr__: nn.Module.__setattr__ would first look the name up among parameters,
    # buffers and submodules (~15× slower, and a bound model has hundreds of linears)
    object.__setattr__(module, "__class__", cls)


def _layout(root: nn.Module) -> tuple:
    """The plain ``nn.Linear`` layers below ``root`` as (id, dtype, device, shape, has bias): a
    binding made for another layout is remade (a layer replaced, cast, moved or wrapped by peft)."""
    return tuple((id(m), m.weight.dtype, m.weight.device, tuple(m.weight.shape), m.bias is None)
                 for m in root.modules() if type(m) is nn.Linear)


class Binding:
    """Everything draftheads keeps for one module's linear layers, beside the module, never in it:
    each layer's copies and sibling products (:class:`BoundLinear`). Between the decoder's
    forwards the module is exactly as its owner built it — type, ``__dict__``, state dict,
    hooks — so ``copy.deepcopy``, ``pickle``, ``torch.save`` and type-based module search
    (``quantize_dynamic``, peft's ``target_modules``) see nothing of draftheads.

    Inside (:meth:`enter` … :meth:`exit`, refcounted across threads and nested uses) each plain
    ``nn.Linear`` wears :class:`PackedLinear` as its ``__class__`` and is restored on exit. Why
    this and not a wrapper module: a wrapper put in the model's place is what deepcopy, pickle and
    quantizers then find; a class swap touches no attribute, costs two pointer writes per layer
    per entry (~0.1 ms for SmolLM2's 210 layers), and a decoding call enters once for all its
    forwards (:func:`packed_forward` is then a refcount)."""

    def __init__(self) -> None:
        self.linears: dict[int, BoundLinear] = {}
        self.products: list[SiblingProduct] = []
        self.fused = False
        self._layout: tuple = ()
        self._users = 0
        self._worn: list[nn.Linear] = []

    def rescan(self, root: nn.Module) -> bool:
        """Follow ``root``'s layers as they are now (outside :meth:`enter` only): layers kept keep
        their copies, new ones get theirs, gone ones are released. Returns whether anything changed."""
        if self._users:  # entered: its layers wear another class until the last user leaves
            return False
        layout = _layout(root)
        if layout == self._layout:
            return False
        previous = self.linears
        self.linears = {}
        for m in root.modules():
            if type(m) is nn.Linear:
                kept = previous.get(id(m))
                self.linears[id(m)] = BoundLinear(m, kept.copies if kept is not None else PackedWeight())
        self._layout = layout
        self.products = []
        if self.fused:
            self.fuse(root)
        return True

    def fuse(self, root: nn.Module) -> list[SiblingProduct]:
        """Give every sibling group of bound layers under ``root`` (:func:`sibling_groups`) one
        :class:`SiblingProduct` (idempotent)."""
        self.fused = True
        if not self.products:
            for members in sibling_groups(root, self.linears):
                product = SiblingProduct(members)
                for index, member in enumerate(members):
                    self.linears[id(member)].siblings = (product, index)
                self.products.append(product)
        return self.products

    def drop_stale(self, memo: FingerprintMemo | None = None) -> int:
        """Drop every copy made from content its weight no longer has; returns how many layers
        (and sibling products) had one."""
        memo = {} if memo is None else memo
        dropped = sum(bound.copies.drop_stale(bound.module.weight, memo) for bound in self.linears.values())
        return dropped + sum(product.copies.drop_stale(product.shape, memo) for product in self.products)

    def enter(self) -> None:
        with _WEAR_LOCK:
            self._users += 1
            if self._users > 1:
                return
            self._worn = [bound.module for bound in self.linears.values() if type(bound.module) is nn.Linear]
            for module in self._worn:
                _LIVE[id(module)] = self.linears[id(module)]
                _wear(module, PackedLinear)

    def exit(self) -> None:
        with _WEAR_LOCK:
            self._users -= 1
            if self._users > 0:
                return
            for module in self._worn:
                if type(module) is PackedLinear:
                    _wear(module, nn.Linear)
                _LIVE.pop(id(module), None)
            self._worn = []


#: root module → its binding; an entry goes with its module (a binding holds the root's layers,
#: which hold no reference back to it)
_BINDINGS: "weakref.WeakKeyDictionary[nn.Module, Binding]" = weakref.WeakKeyDictionary()


def binding(root: nn.Module) -> Binding | None:
    """The binding :func:`use_packed_linears` made for ``root`` (None: not bound)."""
    return _BINDINGS.get(root)


def use_packed_linears(module: nn.Module) -> int:
    """Bind every plain ``nn.Linear`` below ``module`` (:class:`Binding`: copies kept beside the
    module, nothing in it changes; idempotent). Returns how many layers are bound (0 where no
    dtype packs here)."""
    if not any(packing_available(dtype) for dtype in PACKED_DTYPES):
        return 0
    found = _BINDINGS.get(module)
    if found is None:
        found = _BINDINGS[module] = Binding()
    found.rescan(module)
    return len(found.linears)


def refresh_linears(module: nn.Module, memo: FingerprintMemo | None = None) -> bool:
    """Before a decoding call: follow ``module``'s layers as they are now and drop every copy of
    a weight whose content changed since it was made. Returns whether the layout changed (new
    shapes may need measuring)."""
    found = _BINDINGS.get(module)
    if found is None:
        return False
    changed = found.rescan(module)
    found.drop_stale(memo)
    return changed


def release_linears(module: nn.Module) -> None:
    """Forget everything bound for ``module`` (its copies go with it)."""
    _BINDINGS.pop(module, None)


@contextmanager
def packed_linears(active: bool = True) -> Iterator[None]:
    """Within this block, bound layers inside an entered binding (:func:`packed_forward`) and
    the decoder's LM head take the packed path."""
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextmanager
def wearing(*roots: nn.Module | None) -> Iterator[None]:
    """The bound layers of each of ``roots`` (None and unbound ones skipped) wear
    :class:`PackedLinear` until the block ends, however it ends; the packed path itself is only
    taken where :func:`packed_linears` is active too."""
    entered: list[Binding] = []
    try:
        for root in roots:
            found = _BINDINGS.get(root) if root is not None else None
            if found is not None:
                found.enter()
                entered.append(found)
        yield
    finally:
        for found in reversed(entered):
            found.exit()


@contextmanager
def packed_forward(*roots: nn.Module | None) -> Iterator[None]:
    """The decoder's own forwards: :func:`packed_linears` active and ``roots``' layers
    :func:`wearing` the packed class."""
    with packed_linears(), wearing(*roots):
        yield


def packing_active() -> bool:
    return _ACTIVE.get()


#: Projections a module calls one after another on the same input tensor: attention's query,
#: key and value, a gated MLP's gate and up (the names of Llama, Mistral, Qwen, Gemma, ...).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
#: the dtypes whose siblings are stacked: in float32 (twice the bytes a weight moves) stacking
#: measured neutral to 1-2 ms slower per SmolLM2 forward at 1-17 rows, against 0.7-2.8 ms faster
#: in bfloat16 (interleaved, 9 forwards each, AVX512-BF16 machine, 2026-11-25)
STACKED_DTYPES = (torch.bfloat16, torch.float16)


class _StackedCopies(PackedWeight):
    """The packed / blocked copies of the siblings' weights stacked along the output axis,
    remade when any sibling's weight changes; the stacked weight itself is not kept."""

    def __init__(self, members: tuple[nn.Linear, ...]):
        super().__init__()
        self.members = members

    def key(self, weight: torch.Tensor) -> tuple:
        return tuple(tensor_key(m.weight) for m in self.members)

    def fingerprint(self, weight: torch.Tensor, memo: FingerprintMemo | None = None) -> tuple[torch.Tensor, ...]:
        return tuple(fingerprint_of(m.weight, memo) for m in self.members)

    def source(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.cat([m.weight.detach() for m in self.members])


class SiblingProduct:
    """One packed product for sibling linears (:data:`SIBLINGS`) that their module calls on the
    same input: the first sibling called computes every sibling's output in one product and
    keeps the others' slices; a sibling called with that very tensor (same object, same
    version) takes its slice, once; any other input is computed afresh. Why: at the 1-16 rows
    of a verification step a small product costs mostly its call and the weight's trip through
    memory — SmolLM2's q/k/v + gate/up as two products instead of five measured ~2 ms less per
    step in bfloat16 (30 layers), and each output column is the same dot product, so the result
    is bit-identical in bfloat16. Taken only where the plan measured the stacked shape faster
    than the siblings one by one (:meth:`PackingPlan.fusion_pays`)."""

    def __init__(self, members: tuple[nn.Linear, ...]):
        self.members = members
        self.widths = [m.out_features for m in members]
        first = members[0].weight
        #: a stand-in with the stacked weight's dtype, shape and device (no memory): what the plan
        #: and :func:`packed_matmul` read of a weight
        self.shape = torch.empty((), dtype=first.dtype, device=first.device).expand(sum(self.widths), first.shape[1])
        self.key = shape_key(first.dtype, sum(self.widths), first.shape[1])
        self.member_keys = tuple(shape_key(first.dtype, *m.weight.shape) for m in members)
        self.member_shapes = tuple(tuple(m.weight.shape) for m in members)
        self.copies = _StackedCopies(members)
        self._input: torch.Tensor | None = None
        self._version = -1
        self._outputs: list[torch.Tensor | None] = []

    def pays(self, rows: int) -> bool:
        return (PLAN.fusion_pays(self.key, self.member_keys, rows)
                and stacking_exact(self.shape.dtype, self.member_shapes)[row_bucket(rows)])

    def bias(self) -> torch.Tensor | None:
        return None if self.members[0].bias is None else torch.cat([m.bias for m in self.members])

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling ``index``'s product with x (..., in)."""
        version = -2 if x.is_inference() else x._version  # inference tensors keep no version
        if x is not self._input or version != self._version or self._outputs[index] is None:
            stacked = packed_matmul(x, self.shape, self.copies, self.bias())
            self._outputs = list(stacked.split(self.widths, dim=-1))
            self._input, self._version = x, version
        out, self._outputs[index] = self._outputs[index], None
        if all(o is None for o in self._outputs):
            self._input = None  # every slice served: hold no tensor between forwards
        return out


@functools.lru_cache(maxsize=None)
def stacking_exact(dtype: torch.dtype, shapes: tuple[tuple[int, int], ...]) -> tuple[bool, ...]:
    """Per row bucket: whether one product of random weights of ``shapes`` stacked equals, bit
    for bit, the products each weight takes alone here (the plan's path for its shape). Why a
    probe: in bfloat16 oneDNN accumulates every output column alike (equal: fusion changes no
    result), but float32 blocking depends on the output width, and a float32 answer must not
    change because a product was stacked. Call after the plan measured these shapes."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(*shape, generator=generator).to(dtype) for shape in shapes]
    stacked, copies = torch.cat(weights), _StackedCopies(())
    copies._copy = lambda kind, weight, make: make(stacked)  # the stacked weight is at hand here
    alone_copies = [PackedWeight() for _ in weights]
    exact = []
    with torch.no_grad():
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, shapes[0][1], generator=generator).to(dtype)
            alone = [packed_matmul(x, w, c) if packs(w, rows) else nn.functional.linear(x, w)
                     for w, c in zip(weights, alone_copies)]
            exact.append(torch.equal(packed_matmul(x, stacked, copies), torch.cat(alone, dim=-1)))
    return tuple(exact)


def sibling_groups(module: nn.Module, bound: dict[int, BoundLinear] | None = None) -> list[tuple[nn.Linear, ...]]:
    """Under ``module``, each set of :data:`SIBLINGS` present as plain ``nn.Linear`` children of
    one parent (bound ones, when ``bound`` is given) with one input size, dtype (one of
    :data:`STACKED_DTYPES`) and device, all with a bias or none."""
    groups = []
    for parent in module.modules():
        for names in SIBLINGS:
            members = tuple(getattr(parent, n, None) for n in names)
            if not all(type(m) is nn.Linear and (bound is None or id(m) in bound) for m in members):
                continue
            w = members[0].weight
            if w.dtype in STACKED_DTYPES and all(m.weight.shape[1] == w.shape[1] and m.weight.dtype == w.dtype
                                                 and m.weight.device == w.device
                                                 and (m.bias is None) == (members[0].bias is None) for m in members):
                groups.append(members)
    return groups


def fuse_siblings(module: nn.Module) -> list[SiblingProduct]:
    """Give every sibling group of ``module``'s bound layers (:func:`use_packed_linears` first)
    one :class:`SiblingProduct` (idempotent). Returns the products, whose ``shape`` the plan must
    measure before they are taken."""
    found = _BINDINGS.get(module)
    return found.fuse(module) if found is not None else []
