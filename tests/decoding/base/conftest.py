"""The fixtures of the base's tests."""
from __future__ import annotations

import pytest

from draftheads.decoding.base import fewrow
from draftheads.decoding.base.fused import KernelOps, kernel_ops


@pytest.fixture(scope="module")
def ops(tmp_path_factory) -> KernelOps:
    """The fused kernels, compiled here (they must agree with torch wherever the library loads)."""
    if not fewrow.load_kernel(tmp_path_factory.mktemp("kernels")):
        pytest.skip(f"the few-row kernel is off here ({fewrow.kernel_status()})")
    found = kernel_ops()
    assert isinstance(found, KernelOps), "the library loaded but a fused kernel disagreed with torch"
    return found
