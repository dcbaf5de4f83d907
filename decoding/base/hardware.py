"""What this machine computes natively, as torch will run it — the one place that asks.

Every fast-path decision (the default dtype, oneDNN packing, drafting in bfloat16) and every
per-machine cache key reads this module, and it asks torch and oneDNN rather than
``/proc/cpuinfo``: torch honours ``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA`` and
``MKL_ENABLE_INSTRUCTIONS``, so a machine limited to AVX2 is treated as one (and any x86 class
can be reproduced on one machine), and Arm CPUs (Graviton, Apple silicon) follow the same rule.
"""
from __future__ import annotations

import functools
import os
import platform

import torch

#: the environment variables that limit what torch, oneDNN and MKL use (part of every cache key)
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@functools.lru_cache(maxsize=1)
def bf16_native() -> bool:
    """Whether this CPU multiplies bfloat16 natively: oneDNN's bf16 path is on (it honours
    ``ONEDNN_MAX_CPU_ISA``) and, on x86, ATen's kernels are not limited below AVX512
    (``ATEN_CPU_CAPABILITY``) and the CPU has AVX512-BF16 or AMX — elsewhere bf16 is converted,
    slower than float32. On Arm oneDNN's own check (the bf16 extension) decides."""
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    if not is_x86():
        return True
    if "AVX512" not in torch.backends.cpu.get_cpu_capability():
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@functools.lru_cache(maxsize=1)
def fp16_native() -> bool:
    """Whether this CPU multiplies float16 natively (AVX512-FP16 / AMX-FP16, Arm's fp16), as
    oneDNN reports it (honouring ``ONEDNN_MAX_CPU_ISA``)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_fp16_supported())


def native_cpu_dtypes() -> set[torch.dtype]:
    """float32 and the 16-bit float dtypes this CPU computes natively (the others it emulates)."""
    return {torch.float32} | ({torch.bfloat16} if bf16_native() else set()) | (
        {torch.float16} if fp16_native() else set())


def proc_field(path: str, name: str) -> str | None:
    """The value of the first ``name: value`` line of a Linux ``/proc`` file (``/proc/cpuinfo``,
    ``/proc/meminfo``, ``/proc/self/status``), stripped; None where the file or the line is missing."""
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            for line in handle:
                key, colon, value = line.partition(":")
                if colon and key.strip() == name:
                    return value.strip()
    except OSError:
        return None
    return None


def proc_kib(path: str, name: str) -> int | None:
    """A ``/proc`` field counted in kB (``MemAvailable``, ``VmRSS``...) in bytes, or None."""
    value = proc_field(path, name)
    return int(value.split()[0]) * 1024 if value else None


def available_ram_bytes() -> int | None:
    """Memory the OS can give this process now (``MemAvailable``); None where /proc does not say."""
    return proc_kib("/proc/meminfo", "MemAvailable")


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (a measurement from another CPU model is never reused)."""
    return proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine() or "cpu"


def machine_summary() -> str:
    """One line naming what a run ran on (the CPU model and its cores, the GPUs torch sees), for
    training reports and model cards: wall times mean little without it."""
    cpu = f"{cpu_model()}, {os.cpu_count()} logical cores"
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)}× {names[0]} ({cpu})"
    return f"{cpu}, no GPU"


def isa_limits() -> dict[str, str]:
    """The ISA-limiting environment variables that are set (see :data:`ISA_LIMITS`)."""
    return {name: os.environ[name] for name in ISA_LIMITS if os.environ.get(name)}


def cpu_key() -> dict:
    """What a CPU measurement depends on: the CPU, what torch runs on it (capability, ISA
    limits), torch's version and the thread count. Cached measurements are keyed by it."""
    return {"machine": platform.machine(), "cpu": cpu_model(), "capability": torch.backends.cpu.get_cpu_capability(),
            "isa_limits": isa_limits(), "torch": torch.__version__, "threads": torch.get_num_threads()}
