"""The dtypes a base may run in, by name: the package's one dtype parser (:func:`parse_dtype`)."""
from __future__ import annotations

from typing import Any

import torch

from ...core.errors import InputError, InputTypeError


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32", "float64")


class DtypeError(InputError):
    """A dtype that is not one, or one this hardware cannot compute."""


def parse_dtype(value: Any, name: str = "dtype") -> torch.dtype | None:
    """The package's one dtype parser: a floating torch dtype or its name ("bfloat16", "bf16",
    "torch.float16"...) → the torch dtype; ``None`` or ``"auto"`` → ``None`` (the loader then
    picks the base's native dtype where the hardware computes it: ``decoding.base.loading.choose_dtype``)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise DtypeError(f"{name}={value}: the base needs a floating dtype; use one of "
                             f"{', '.join(DTYPE_CHOICES)}.")
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in DTYPES:
            return DTYPES[key]
        raise DtypeError(f"{name}={value!r} is not a dtype draftheads knows; use one of "
                         f"{', '.join(DTYPE_CHOICES)} (or a torch.dtype).")
    raise InputTypeError(f"{name} must be a torch.dtype or its name (e.g. 'bfloat16'), got {type(value).__name__}.")
