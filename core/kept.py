"""Tensors kept past the call that makes them — cached tree buffers, the heads' gathered LM-head
rows, the bound base tensors — are normal tensors, even when that call runs under
``torch.inference_mode`` (the decoder's own loop, a transformers pipeline). Why: an inference
tensor cannot be saved for backward nor updated in place outside inference mode, so a cache made
there would break a later training step or the user's own code."""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import torch

T = TypeVar("T")


@contextmanager
def keeping() -> Iterator[None]:
    """Tensors made inside the block are normal tensors, inside inference mode too."""
    with torch.inference_mode(False):
        yield


def kept(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` (a cached builder) makes its tensors inside :func:`keeping`."""
    @functools.wraps(fn)
    def build(*args, **kwargs) -> T:
        with keeping():
            return fn(*args, **kwargs)
    return build
