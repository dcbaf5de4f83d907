"""The rows a forward's linear layers compute: in a batched step rows draft different numbers of
tree nodes and are padded to the widest; inside :func:`computed_rows` the padding rows nobody
reads are left out (they come out zero), so a step costs what its real rows cost."""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass(eq=False)
class RowSubset:
    """The rows (flat token positions) a forward's linear layers compute; the others come out
    zero. Why: in a batched step rows draft different numbers of tree nodes and are padded to
    the widest, and where the forward is compute-bound a padding slot nobody reads costs what a
    real one does."""

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
