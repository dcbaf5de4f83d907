"""decoding/base/cache.py: each row keeps exactly its accepted tree slots, right after its real
region, whatever the other rows accepted; finished rows leave — in transformers' own cache and
in the decoder's, whose layers keep room ahead and write new slots in place."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from draftheads.decoding.base import cache as cache_module
from draftheads.decoding.base.cache import KVState, reserved_cache

KINDS = {"dynamic": DynamicCache, "reserved": lambda: reserved_cache(None)}


@pytest.fixture(params=sorted(KINDS))
def make_cache(request):
    return KINDS[request.param]


def cache_with(batch: int, prompt: int, tree: int, make=DynamicCache) -> tuple[KVState, DynamicCache]:
    """One layer whose key/value at column t of row b is 100·b + t (easy to follow)."""
    cache = make()
    columns = torch.arange(prompt, dtype=torch.float64)
    keys = (100 * torch.arange(batch, dtype=torch.float64)[:, None] + columns)[:, None, :, None]
    cache.update(keys.clone(), keys.clone(), 0)
    kv = KVState.after_prefill(cache, torch.ones(batch, prompt, dtype=torch.long))
    columns = torch.arange(prompt, prompt + tree, dtype=torch.float64)
    tree_kv = (100 * torch.arange(batch, dtype=torch.float64)[:, None] + columns)[:, None, :, None]
    cache.update(tree_kv.clone(), tree_kv.clone(), 0)  # what verify appends: one slot per tree node
    return kv, cache


def row_keys(cache: DynamicCache, row: int) -> list[int]:
    return [int(v) for v in cache.layers[0].keys[row, 0, :, 0].tolist()]


def test_commit_moves_each_rows_accepted_slots_behind_its_prompt(make_cache):
    kv, cache = cache_with(batch=2, prompt=3, tree=4, make=make_cache)
    # row 0 accepted the root (slot 3) and tree slots 5, 6; row 1 only its root
    slots = torch.tensor([[3, 5, 6], [3, 3, 3]])
    kv.commit(slots, torch.tensor([3, 1]))
    assert kv.length == 6 and kv.length_with_tree() == 6  # the longest row: prompt + 3
    assert row_keys(cache, 0) == [0, 1, 2, 3, 5, 6]
    assert row_keys(cache, 1)[:4] == [100, 101, 102, 103]
    assert kv.valid.tolist() == [[True] * 6, [True] * 4 + [False] * 2]
    assert kv.end.tolist() == [6, 4] and kv.next_pos.tolist() == [6, 4]


def test_the_next_tree_attends_to_each_rows_own_region_only(make_cache):
    kv, cache = cache_with(batch=2, prompt=3, tree=2, make=make_cache)
    kv.commit(torch.tensor([[3, 4], [3, 3]]), torch.tensor([2, 1]))
    ancestor = torch.tensor([[True, False], [True, True]])
    mask, positions, past = kv.tree_inputs(ancestor, torch.tensor([0, 1]))
    assert past == 5 and positions.tolist() == [[5, 6], [4, 5]]
    allowed = mask[:, 0]  # (B, N, T + N): True where a tree slot may attend
    assert allowed[1, 0].tolist() == [True] * 4 + [False] + [True, False]  # row 1's hole at column 4


def test_finished_rows_leave_the_cache(make_cache):
    kv, cache = cache_with(batch=3, prompt=2, tree=1, make=make_cache)
    kv.commit(torch.tensor([[2], [2], [2]]), torch.tensor([1, 1, 1]))
    kv.select_rows(torch.tensor([0, 2]))
    assert row_keys(cache, 1) == [200, 201, 202] and kv.end.tolist() == [3, 3]


def test_reserving_slots_and_writing_them_is_an_update(monkeypatch):
    """The direct forward's way into the cache (``reserve`` the step's slots, the kernel writes
    them into the buffers) leaves what ``update`` leaves, step after step, through growth of the
    buffer (its old slots carried over) and crops."""
    monkeypatch.setattr(cache_module, "RESERVE_SLOTS", 4)
    reserved, updated = reserved_cache(None), reserved_cache(None)
    generator = torch.Generator().manual_seed(1)
    first = torch.randn(2, 3, 2, 4, generator=generator)
    for cache in (reserved, updated):
        cache.update(first, first + 1, 0)
    grown = 0
    for new, keep in [(5, 5), (3, 1), (2, 2), (9, 4), (1, 1)]:
        kv = torch.randn(2, 3, new, 4, generator=generator)
        updated.update(kv, kv + 1, 0)
        layer = reserved.layers[0]
        before = layer._key_buffer
        key, value, start = layer.reserve(new)
        grown += key is not before
        assert start + new == layer.keys.shape[-2] == layer.values.shape[-2] and key.shape[2] >= start + new
        key[:, :, start:start + new] = kv
        value[:, :, start:start + new] = kv + 1
        for cache in (reserved, updated):
            if new - keep:
                cache.crop(-(new - keep))
        assert torch.equal(reserved.layers[0].keys, updated.layers[0].keys)
        assert torch.equal(reserved.layers[0].values, updated.layers[0].values)
        assert reserved.layers[0].keys.data_ptr() == reserved.layers[0]._key_buffer.data_ptr()
    assert 1 <= grown < 5


def test_reserved_layers_write_in_place_and_match_concatenation(monkeypatch):
    """Step after step (append a tree, keep part of it, crop the rest), the reserved cache holds
    exactly what transformers' concatenating cache holds; its tensors stay views of one buffer
    until the room runs out, and a replaced tensor (finished rows dropped) starts a new one."""
    monkeypatch.setattr(cache_module, "RESERVE_SLOTS", 4)
    reserved, dynamic = reserved_cache(None), DynamicCache()
    generator = torch.Generator().manual_seed(0)
    buffers = set()
    for step, (new, keep) in enumerate([(5, 5), (3, 1), (2, 2), (4, 0), (6, 3), (1, 1)]):
        kv = torch.randn(2, 3, new, 4, generator=generator, dtype=torch.float64)
        for cache in (reserved, dynamic):
            keys, values = cache.update(kv, kv + 1, 0)
            assert keys.shape[-2] == cache.get_seq_length()
            if new - keep:
                cache.crop(-(new - keep))
        assert torch.equal(reserved.layers[0].keys, dynamic.layers[0].keys)
        assert torch.equal(reserved.layers[0].values, dynamic.layers[0].values)
        buffers.add(reserved.layers[0]._key_buffer.data_ptr())
        assert reserved.layers[0].keys.data_ptr() == reserved.layers[0]._key_buffer.data_ptr()
    assert 1 < len(buffers) < 6  # grown now and then, not at every step
    for cache in (reserved, dynamic):
        cache.batch_select_indices(torch.tensor([1]))
        cache.update(torch.ones(1, 3, 2, 4, dtype=torch.float64), torch.ones(1, 3, 2, 4, dtype=torch.float64), 0)
    assert torch.equal(reserved.layers[0].keys, dynamic.layers[0].keys)
