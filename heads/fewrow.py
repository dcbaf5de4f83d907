"""A float32 kernel for products of a few rows, compiled on first use (``heads/fewrow.c``).

Why: tree verification multiplies every weight of the base by a handful of rows (the tree's
nodes). On a CPU without AVX512 neither of torch's paths does that at the cost of one row:
MKL's ``F.linear`` is a matrix-vector product for 1 row and a slow small-matrix one above it,
and oneDNN's packed product spends ~1.5× its 1-row time at 5 rows. This kernel reads each
weight once per call in 16-feature blocks while up to 6 rows accumulate in registers, so a
5-row product costs about what one row does. Measured on an AVX2-only AMD EPYC, one thread, µs,
``F.linear`` / oneDNN packed / this kernel (scripts/profile_step.py, README "Hardware"):
SmolLM2's 49,152 × 576 LM head at 5 rows 29,500 / 15,700 / 10,400; its 1,536 × 576 MLP
projection 380 / 237 / 142; 576 × 576 143 / 109 / 52.

Which path a (shape, row count) takes is decided by measurement on this machine
(:class:`~.linear.PackingPlan`): the kernel is one more candidate beside ``F.linear`` and the
packed product, never assumed faster. Results differ from ``F.linear`` by float32 rounding (one
accumulation chain per output), which the float32 guarantee allows; the kernel is checked
against ``F.linear`` before first use.

It is compiled with the system C compiler (``CC``, else ``cc``/``gcc``; under a second) into the
cache folder, keyed by the source, the compiler and the flags, loaded with ctypes, and linked to
the OpenMP runtime torch has already loaded, so its threads are torch's. Where anything is
missing (not x86, torch's CPU capability below AVX2, no compiler, a failed check) it is simply
absent — :func:`kernel_status` says why — and the plan never picks it.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

from .atomic import atomic_file
from .errors import DraftheadsError
from .hardware import is_x86

SOURCE = Path(__file__).with_name("fewrow.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
BLOCK = 16  # output features per block (two AVX registers)

_state: dict[str, object] = {"lib": None, "status": "not loaded (the decoder loads it with the base)"}


def kernel_status() -> str:
    """Whether the kernel is loaded here, or why not (for ``draftheads env`` and bug reports)."""
    return str(_state["status"])


def kernel():
    """The loaded kernel library, or None (see :func:`load_kernel`)."""
    return _state["lib"]


def unsupported_reason() -> str | None:
    """Why this machine cannot run the kernel, or None."""
    if not is_x86():
        return "not an x86 CPU (the kernel is AVX2 code)"
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith(("AVX2", "AVX512")):
        return f"torch runs at CPU capability {capability!r} here (the kernel needs AVX2)"
    if not SOURCE.is_file():
        return f"its source {SOURCE} is missing from this install"
    return None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _library_path(folder: Path, compiler: str) -> Path:
    """One file per (source, compiler, flags): an edited source or another compiler never reuses it."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = compiler
    digest = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return folder / f"fewrow-{digest}.so"


def _compile(compiler: str, target: Path) -> None:
    """Build into a temporary file renamed over ``target`` (:func:`~.atomic.atomic_file`): a
    reader never sees half a library."""
    with atomic_file(target) as tmp:
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True,
                                timeout=120)
        if result.returncode != 0:
            raise OSError(((result.stderr or result.stdout).strip().splitlines() or ["compiler failed"])[-1])


def _bind(path: Path):
    lib = ctypes.CDLL(str(path))
    lib.draftheads_block16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
    lib.draftheads_block16.restype = None
    lib.draftheads_fewrow.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.draftheads_fewrow.restype = None
    return lib


def _agrees(lib) -> bool:
    """The kernel against ``F.linear`` on awkward shapes (a partial block, 1-13 rows)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 29, generator=generator)
    blocked = _blocked(lib, weight)
    for rows in (1, 5, 6, 7, 13):
        x = torch.randn(rows, 29, generator=generator)
        if not torch.allclose(_run(lib, x, blocked, 37), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5):
            return False
    return True


def load_kernel(folder: Path) -> bool:
    """Compile (once per machine, into ``folder``) and load the kernel; returns whether it is
    usable. A cached library that fails to load or to agree with ``F.linear`` is rebuilt once,
    never trusted."""
    if _state["lib"] is not None:
        return True
    reason = unsupported_reason()
    compiler = _compiler()
    if reason is None and compiler is None:
        reason = "no C compiler (install gcc, or set CC)"
    if reason is not None:
        _state["status"] = f"off: {reason}"
        return False
    path = _library_path(Path(folder), compiler)
    for attempt in range(2):
        try:
            if attempt or not path.is_file():
                _compile(compiler, path)
            lib = _bind(path)
            if _agrees(lib):
                _state["lib"], _state["status"] = lib, f"on ({path})"
                return True
            reason = "it disagreed with F.linear"
        except (OSError, AttributeError, subprocess.SubprocessError, DraftheadsError) as err:
            reason = f"{type(err).__name__}: {err}"
    _state["status"] = f"off: {reason}"
    return False


def _blocked(lib, weight: torch.Tensor) -> torch.Tensor:
    weight = weight.detach().contiguous()
    out, inp = weight.shape
    blocked = torch.empty(((out + BLOCK - 1) // BLOCK) * BLOCK * inp, dtype=torch.float32)
    lib.draftheads_block16(weight.data_ptr(), blocked.data_ptr(), out, inp)
    return blocked


#: below this many multiply-adds a call runs on one thread (starting the others costs more)
PARALLEL_WORK = 1 << 17


def _run(lib, x: torch.Tensor, blocked: torch.Tensor, out_features: int) -> torch.Tensor:
    rows, inp = x.shape
    y = torch.empty(rows, out_features, dtype=torch.float32)
    threads = torch.get_num_threads() if rows * inp * out_features >= PARALLEL_WORK else 1
    lib.draftheads_fewrow(x.data_ptr(), blocked.data_ptr(), y.data_ptr(), rows, inp, out_features, threads)
    return y


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight (out, in) float32 → the kernel's blocked copy (flat); needs :func:`load_kernel`."""
    return _blocked(kernel(), weight)


def fewrow_linear(x: torch.Tensor, blocked: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) float32 · Wᵀ through W's blocked copy → (..., out_features)."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    y = _run(kernel(), flat, blocked, out_features)
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], out_features)
