"""Moved: self-distillation now lives in :mod:`draftheads.training.data` (one concept, one
place). This name only re-exports the legacy shard reader for callers not yet updated."""
from .data import read_shards

__all__ = ["read_shards"]
