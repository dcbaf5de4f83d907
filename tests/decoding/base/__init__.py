"""Tests of the base's compute under decoding/: attention packing, the KV cache, linear packing,
the few-row kernel, hardware, its disk cache."""
