"""Kernels for products of a few rows, float32 and bfloat16, compiled on first use (``fewrow.c``).

Why: tree verification multiplies every weight of the base by a handful of rows (the tree's
nodes). On a CPU without AVX512 neither of torch's paths does that at the cost of one row:
MKL's ``F.linear`` is a matrix-vector product for 1 row and a slow small-matrix one above it,
and oneDNN's packed product costs more at 5 rows than at 1. This kernel reads each weight once
per call in 16-feature blocks while up to 6 rows accumulate in registers, so a 5-row product
costs about what one row does. Where bfloat16 is native (AVX512-BF16), oneDNN's packed bf16
product reads the weights at about half the memory bandwidth for a few rows; the bf16 kernel
(VDPBF16PS, the same blocking) streams them. Its sums are float32 in input order, rounded to
bf16 once as ``F.linear`` rounds: a few outputs land one bf16 ulp from ``F.linear``'s (a
different summation order), which the bfloat16 guarantee (a first divergence within the dtype's
rounding) allows.
evidence: results/cpu_classes (scripts/bench_linear_paths.py, scripts/profile_step.py)

Which path a (shape, row count) takes is decided by measurement on this machine
(:class:`~.plan.PackingPlan`): the kernel is one more candidate beside ``F.linear`` and the
packed product, never assumed faster. Float32 results differ from ``F.linear`` by float32
rounding (one accumulation chain per output), which the float32 guarantee allows; each dtype's
kernel is checked against ``F.linear`` before first use.

It is compiled with the system C compiler (``CC``, split as a shell splits it, else ``cc``/``gcc``;
under a second) into the cache folder, keyed by the source, the compiler and the flags, loaded
with ctypes, and linked to the OpenMP runtime torch has already loaded, so its threads are
torch's. Where anything is missing (not x86, torch's CPU capability below AVX2, no compiler, a
failed check) it is simply absent — :func:`kernel_status` says why — and the plan never picks
it; a compiler that fails says so once, with its first line of output. The bf16 kernel is only
called where torch reports native bf16 with AVX512-BF16 (so ``ATEN_CPU_CAPABILITY=avx2`` or
``ONEDNN_MAX_CPU_ISA=AVX2`` turn it off like oneDNN's own bf16 path).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Callable

import torch

from ...core.atomic import atomic_file
from ...core.errors import DraftheadsError
from .hardware import bf16_native, is_x86

SOURCE = Path(__file__).with_name("fewrow.c")
#: every file the library is built from (``fewrow.c`` includes the others): what its cache key reads
SOURCES = (SOURCE, SOURCE.with_name("body.c"))
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
#: after the source: the libraries it calls into (sqrtf)
LIBRARIES = ("-lm",)
BLOCK = 16  # output features per block (two AVX registers)

_state: dict[str, object] = {"lib": None, "status": "not loaded (the decoder loads it with the base)",
                             "dtypes": frozenset(), "build": None}


def kernel_status() -> str:
    """Whether the kernel is loaded here, or why not (for ``draftheads env`` and bug reports)."""
    return str(_state["status"])


def kernel():
    """The loaded kernel library, or None (see :func:`load_kernel`)."""
    return _state["lib"]


def kernel_dtypes() -> frozenset:
    """The dtypes the loaded kernel multiplies here: float32, and bfloat16 where it is native
    with AVX512-BF16 and the bf16 kernel agreed with ``F.linear`` (empty when not loaded)."""
    return _state["dtypes"]  # type: ignore[return-value]


def kernel_identity() -> str | None:
    """Which kernel this process multiplies with, for the keys of cached step costs: the loaded
    library's build digest (its sources, compiler and flags as they were when it was loaded: a source
    edited since does not change it) and the dtypes it runs here (None when not loaded)."""
    if _state["lib"] is None:
        return None
    names = sorted(str(d).removeprefix("torch.") for d in kernel_dtypes())
    return f"{_state['build']}:{'+'.join(names)}"


def _source_bytes() -> bytes:
    return b"".join(path.read_bytes() for path in SOURCES)


def bf16_kernel_supported() -> bool:
    """Whether this CPU, as torch sees it (ISA limits honoured), runs the bf16 kernel's VDPBF16PS."""
    return is_x86() and bf16_native() and bool(torch.cpu._is_avx512_bf16_supported())


def unsupported_reason() -> str | None:
    """Why this machine cannot run the kernel, or None."""
    if not is_x86():
        return "not an x86 CPU (the kernel is AVX2 code)"
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith(("AVX2", "AVX512")):
        return f"torch runs at CPU capability {capability!r} here (the kernel needs AVX2)"
    missing = [path for path in SOURCES if not path.is_file()]
    if missing:
        return f"its source {missing[0]} is missing from this install"
    return None


class CompilerError(DraftheadsError):
    """The C compiler could not build the kernel (not a problem of the cache folder)."""


def _compiler() -> list[str] | None:
    """The C compiler command: ``CC`` split as a shell splits it, as make and distutils take it
    (``CC='gcc -O2'``, ``CC='ccache gcc'``), else ``cc`` or ``gcc``; None when there is none. A
    ``CC`` that cannot be split (an unbalanced quote) is a :class:`CompilerError`."""
    cc = os.environ.get("CC", "")
    if cc.strip():
        try:
            return shlex.split(cc)
        except ValueError as err:
            raise CompilerError(f"CC={cc!r} cannot be split into a command ({err}): fix its quoting") from None
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _library_path(folder: Path, compiler: list[str]) -> Path:
    """One file per (source, compiler command, its version, flags): an edited source or another
    compiler never reuses it."""
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    key = (_source_bytes() + shlex.join(compiler).encode() + version.encode()
           + " ".join(FLAGS + LIBRARIES).encode())
    return folder / f"fewrow-{hashlib.sha256(key).hexdigest()[:16]}.so"


def first_line(text: str) -> str:
    """The first non-empty line of a compiler's output (where it names what went wrong)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "no message")


def _compile(compiler: list[str], target: Path) -> None:
    """Build into a temporary file renamed over ``target``
    (:func:`~draftheads.core.atomic.atomic_file`): a reader never sees half a library. A
    compiler that cannot run or fails is a :class:`CompilerError` naming it and its first line
    of output (an unwritable cache folder stays
    :func:`~draftheads.core.errors.cannot_write`'s error)."""
    command = shlex.join(compiler)
    with atomic_file(target) as tmp:
        try:
            result = subprocess.run([*compiler, *FLAGS, str(SOURCE), "-o", str(tmp), *LIBRARIES], capture_output=True,
                                    text=True, timeout=120)
        except OSError as err:
            raise CompilerError(f"the C compiler `{command}` could not be run ({err.strerror or err}): set CC to an "
                                "installed compiler, or unset it") from None
        except subprocess.TimeoutExpired:
            raise CompilerError(f"the C compiler `{command}` did not finish in 120 s") from None
        if result.returncode != 0:
            raise CompilerError(f"the C compiler `{command}` failed (exit {result.returncode}): "
                                f"{first_line(result.stderr or result.stdout)}")


def _bind(path: Path):
    lib = ctypes.CDLL(str(path))
    lib.draftheads_block16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
    lib.draftheads_block16.restype = None
    lib.draftheads_fewrow.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.draftheads_fewrow.restype = None
    lib.draftheads_block16_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
    lib.draftheads_block16_bf16.restype = None
    lib.draftheads_fewrow_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.draftheads_fewrow_bf16.restype = None
    lib.draftheads_q4_layout.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 2 + [ctypes.c_int]
    lib.draftheads_q4_layout.restype = None
    lib.draftheads_q8_layout.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_int]
    lib.draftheads_q8_layout.restype = None
    for name in ("draftheads_fewrow_q4", "draftheads_fewrow_q4_bf16", "draftheads_fewrow_q8",
                 "draftheads_fewrow_q8_bf16"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
        getattr(lib, name).restype = None
    for suffix in ("", "_bf16"):
        for name, args in (("add_rms_norm", [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_float]),
                           ("rope", [ctypes.c_void_p] + [ctypes.c_long] * 4 + [ctypes.c_void_p] * 2 + [ctypes.c_long])):
            function = getattr(lib, f"draftheads_{name}{suffix}")
            function.argtypes, function.restype = args, None
        store = getattr(lib, f"draftheads_rope_store{suffix}")
        store.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 7 + [ctypes.c_void_p] * 2 + [ctypes.c_long] \
            + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2
        store.restype = None
        attention = getattr(lib, f"draftheads_tree_attention{suffix}")
        attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 7 + [ctypes.c_float, ctypes.c_int]
        attention.restype = None
        step = getattr(lib, f"draftheads_step_attention{suffix}")
        step.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 7 + [ctypes.c_void_p] * 2 + [ctypes.c_long] \
            + [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_float, ctypes.c_int]
        step.restype = None
        gate = getattr(lib, f"draftheads_silu_mul{suffix}")
        gate.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] + [ctypes.c_void_p] + [ctypes.c_long] * 2
        gate.restype = None
        body = getattr(lib, f"draftheads_body{suffix}")
        body.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 8 + [ctypes.c_void_p] * 2 + [ctypes.c_long] \
            + [ctypes.c_void_p] + [ctypes.c_float] * 2 + [ctypes.c_int] * 2 + [ctypes.c_long, ctypes.c_void_p]
        body.restype = None
    return lib


#: how far each dtype's kernel may land from ``F.linear`` in the check: float32 rounding; for
#: bfloat16 one bf16 rounding (relative 2^-8 either way, so 2^-7 between the two)
AGREEMENT = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2.0 ** -7, 1e-3)}


def _agrees(lib, dtype: torch.dtype) -> bool:
    """The kernel against ``F.linear`` on awkward shapes (a partial block, 1-13 rows)."""
    generator = torch.Generator().manual_seed(0)
    inp = 30 if dtype == torch.bfloat16 else 29  # the bf16 kernel reads inputs in pairs
    weight = torch.randn(37, inp, generator=generator).to(dtype)
    blocked = _blocked(lib, weight)
    rtol, atol = AGREEMENT[dtype]
    for rows in (1, 5, 6, 7, 13):
        x = torch.randn(rows, inp, generator=generator).to(dtype)
        ours, theirs = _run(lib, x, blocked, 37).float(), torch.nn.functional.linear(x, weight).float()
        if not torch.allclose(ours, theirs, rtol=rtol, atol=atol):
            return False
    return True


def load_kernel(folder: Path) -> bool:
    """Compile (once per machine, into ``folder``) and load the kernel; returns whether it is
    usable. A cached library that fails to load or to agree with ``F.linear`` is rebuilt once,
    never trusted."""
    if _state["lib"] is not None:
        return True
    reason = unsupported_reason()
    try:
        compiler = _compiler() if reason is None else None
    except CompilerError as err:
        return _off(str(err), warn=True)
    if reason is None and compiler is None:
        reason = "no C compiler (install gcc, or set CC)"
    if reason is not None:
        return _off(reason)
    path = _library_path(Path(folder), compiler)
    for attempt in range(2):
        try:
            if attempt or not path.is_file():
                _compile(compiler, path)
            lib = _bind(path)
            if _agrees(lib, torch.float32):
                bf16 = bf16_kernel_supported() and _agrees(lib, torch.bfloat16)
                _state["dtypes"] = frozenset({torch.float32, torch.bfloat16} if bf16 else {torch.float32})
                _state["lib"], _state["status"] = lib, f"on ({path}; {'float32 and bfloat16' if bf16 else 'float32'})"
                _state["build"] = path.stem.removeprefix("fewrow-")
                return True
            reason = "it disagreed with F.linear"
        except CompilerError as err:  # building again would fail the same way
            return _off(str(err), warn=True)
        except (OSError, AttributeError, subprocess.SubprocessError, DraftheadsError) as err:
            reason = f"{type(err).__name__}: {err}"
    return _off(reason)


def _off(reason: str, warn: bool = False) -> bool:
    """The kernel stays off for ``reason`` (:func:`kernel_status`); products take torch's paths.
    ``warn``: a compiler the user can fix failed, which is said once, not only in the status."""
    _state["status"] = f"off: {reason}"
    if warn:
        warnings.warn(f"draftheads' few-row kernel is off: {reason}; products fall back to torch's paths (same "
                      "results, slower on some CPUs).", UserWarning, stacklevel=3)
    return False


def _blocked(lib, weight: torch.Tensor) -> torch.Tensor:
    weight = weight.detach().contiguous()
    out, inp = weight.shape
    blocked = torch.empty(((out + BLOCK - 1) // BLOCK) * BLOCK * inp, dtype=weight.dtype)
    block = lib.draftheads_block16_bf16 if weight.dtype == torch.bfloat16 else lib.draftheads_block16
    block(weight.data_ptr(), blocked.data_ptr(), out, inp)
    return blocked


#: below this many multiply-adds a call runs on one thread (starting the others costs more)
PARALLEL_WORK = 1 << 17


def _run(lib, x: torch.Tensor, blocked: torch.Tensor, out_features: int) -> torch.Tensor:
    return _product(lib, blocked, out_features)(x)


def _product(lib, blocked: torch.Tensor, out_features: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The kernel bound to a blocked copy: x (rows, in) contiguous → y (rows, out_features)."""
    run = lib.draftheads_fewrow_bf16 if blocked.dtype == torch.bfloat16 else lib.draftheads_fewrow
    dtype, pointer = blocked.dtype, blocked.data_ptr()

    def product(x: torch.Tensor) -> torch.Tensor:
        rows, inp = x.shape
        y = torch.empty(rows, out_features, dtype=dtype)
        threads = torch.get_num_threads() if rows * inp * out_features >= PARALLEL_WORK else 1
        run(x.data_ptr(), pointer, y.data_ptr(), rows, inp, out_features, threads)
        return y
    product.keeps = blocked  # the copy lives as long as the product
    product.kernel = ("fewrow", blocked, None)  # what it multiplies through (:mod:`.body_call` reads it)
    return product


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight (out, in) float32, or bfloat16 with ``in`` even → the kernel's blocked copy (flat,
    the weight's dtype); needs :func:`load_kernel` (and bfloat16 in :func:`kernel_dtypes`)."""
    return _blocked(kernel(), weight)


def fewrow_product(blocked: torch.Tensor, out_features: int,
                   bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x (rows, in) contiguous · Wᵀ (+ bias) through W's blocked copy, the library function and the
    copy bound once (what :func:`fewrow_linear` does per call; the packed path's resolved product,
    :func:`~.packed.resolved_matmul`)."""
    product = _product(kernel(), blocked, out_features)
    if bias is None:
        return product

    def biased(x: torch.Tensor) -> torch.Tensor:
        y = product(x)
        y += bias
        return y
    return biased


def fewrow_linear(x: torch.Tensor, blocked: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) · Wᵀ through W's blocked copy (both in W's dtype) → (..., out_features)."""
    y = fewrow_product(blocked, out_features, bias)(x.reshape(-1, x.shape[-1]).contiguous())
    return y.reshape(*x.shape[:-1], out_features)

