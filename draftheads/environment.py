"""``draftheads env``: what a user pastes into a bug report (like ``transformers env`` and
``accelerate env``): versions, what torch will run on this CPU (capability, native dtypes, oneDNN
packing per dtype and where it measured faster), threads, the cache paths, and the GPU."""
from __future__ import annotations

import importlib.metadata
import json
import platform
import sys

import torch

from .decoding.base.fewrow import kernel_status, load_kernel
from .decoding.base.hardware import bf16_native, cpu_model, fp16_native, isa_limits
from .decoding.base.loading import cache_root
from .decoding.base.packing import packing_cache_path, read_packing_cache
from .decoding.base.plan import PACKED_DTYPES, PATHS, fastest_paths, packing_available
from .decoding.base.blocks import DTYPES, KINDS, blocks_available
from .decoding.base.siblings import STACKED_DTYPES

PACKAGES = ("draftheads", "torch", "transformers", "accelerate", "datasets", "huggingface_hub", "safetensors", "numpy")


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def blocks_report() -> str:
    """Per block kind, the dtypes whose products stream a converted base's GGUF blocks here
    (:mod:`~.decoding.base.blocks`)."""
    kinds = {kind: [str(d).removeprefix("torch.") for d in DTYPES if blocks_available(kind, d)] for kind in KINDS}
    found = "; ".join(f"{kind.upper()} {', '.join(dtypes)}" for kind, dtypes in kinds.items() if dtypes)
    return found or "off (the few-row kernel is off, or its block products did not agree)"


def stacking_report() -> str:
    """The dtypes whose sibling projections may run as one product here (they pack, and stacking
    is tried for them); each shape and row count still needs a measured win and a bit-identical probe."""
    dtypes = [str(d).removeprefix("torch.") for d in STACKED_DTYPES if packing_available(d)]
    return (", ".join(dtypes) + " (where the stacked shape measured faster and a probe finds it bit-identical)"
            if dtypes else "off (no 16-bit dtype packs here)")


def packing_report() -> dict[str, str]:
    """Per dtype: whether oneDNN packs it here and, for the shapes measured on this machine, how
    many (shape, rows) points take each path (from the packing cache)."""
    measured = read_packing_cache(packing_cache_path())
    report = {}
    for dtype in PACKED_DTYPES:
        name = str(dtype).removeprefix("torch.")
        if not packing_available(dtype):
            report[name] = "off (oneDNN does not pack it natively here)"
            continue
        shapes = {k.split(" ", 1)[1]: v for k, v in measured.items() if k.split(" ", 1)[0] == name}
        if not shapes:
            report[name] = "on (no shape measured yet: measured at the first model load)"
            continue
        chosen = [path for v in shapes.values() for path in fastest_paths(v, "fewrow_ms" in v)]
        counts = ", ".join(f"{path} {chosen.count(path)}" for path in PATHS if chosen.count(path))
        speedups = [f / min(v[f"{p}_ms"][i] for p in PATHS if f"{p}_ms" in v)
                    for v in shapes.values() for i, f in enumerate(v["linear_ms"])]
        report[name] = (f"on; of {len(chosen)} (shape, rows) points of {len(shapes)} shapes, the measured-fastest "
                        f"path: {counts} (median {sorted(speedups)[len(speedups) // 2]:.2f}x F.linear)")
    return report


def collect() -> dict:
    gpu = (f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s))"
           if torch.cuda.is_available() else "none")
    native = ["float32"] + [n for n, ok in (("bfloat16", bf16_native()), ("float16", fp16_native())) if ok]
    return {
        **{f"{p} version": version(p) for p in PACKAGES},
        "Python": sys.version.split()[0],
        "Platform": platform.platform(),
        "CPU": f"{cpu_model()} ({platform.machine()})",
        "CPU capability (torch)": torch.backends.cpu.get_cpu_capability(),
        "ISA limits": ", ".join(f"{k}={v}" for k, v in isa_limits().items()) or "none",
        "native CPU dtypes": ", ".join(native),
        **{f"oneDNN packing, {k}": v for k, v in packing_report().items()},
        "stacked q/k/v and gate/up products": stacking_report(),
        "few-row kernel": kernel_status(),
        "GGUF block products (bases converted from a GGUF)": blocks_report(),
        "torch threads": torch.get_num_threads(),
        "cache (DRAFTHEADS_CACHE)": str(cache_root()),
        "packing cache": str(packing_cache_path()),
        "calibration cache": str(cache_root() / "calibration"),
        "GPU": gpu,
    }


def format_report(info: dict) -> str:
    return "\n".join(f"- {key}: {value}" for key, value in info.items())


def base_section(base: str, dtype: str = "auto") -> dict[str, str]:
    """``--base``: the base loaded and bound as the decoder binds it (fast paths set up, the check
    against its own forward run), then what of it the decoder honours and which paths it runs."""
    from .decoding import DraftHeadsModel
    from .decoding.base.check import base_report
    from .decoding.base.loading import load_base

    model, _ = load_base(base, dtype=dtype)
    DraftHeadsModel(model, None)
    return {f"base, {key}": value for key, value in base_report(model).items()}


def main(as_json: bool = False, base: str | None = None, dtype: str = "auto") -> int:
    load_kernel(cache_root() / "kernels")  # builds it once if this machine never has (under a second)
    info = collect()
    if base is not None:
        info.update(base_section(base, dtype))
    print(json.dumps(info, indent=1) if as_json else
          "Copy-and-paste the text below in your GitHub issue:\n\n" + format_report(info))
    return 0
