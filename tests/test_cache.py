"""decoding/cache.py: each row keeps exactly its accepted tree slots, right after its real
region, whatever the other rows accepted; finished rows leave."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from draftheads.decoding.cache import KVState


def cache_with(batch: int, prompt: int, tree: int) -> tuple[KVState, DynamicCache]:
    """One layer whose key/value at column t of row b is 100·b + t (easy to follow)."""
    cache = DynamicCache()
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


def test_commit_moves_each_rows_accepted_slots_behind_its_prompt():
    kv, cache = cache_with(batch=2, prompt=3, tree=4)
    # row 0 accepted the root (slot 3) and tree slots 5, 6; row 1 only its root
    slots = torch.tensor([[3, 5, 6], [3, 3, 3]])
    kv.commit(slots, torch.tensor([3, 1]))
    assert kv.length == 6 and kv.length_with_tree() == 6  # the longest row: prompt + 3
    assert row_keys(cache, 0) == [0, 1, 2, 3, 5, 6]
    assert row_keys(cache, 1)[:4] == [100, 101, 102, 103]
    assert kv.valid.tolist() == [[True] * 6, [True] * 4 + [False] * 2]
    assert kv.end.tolist() == [6, 4] and kv.next_pos.tolist() == [6, 4]


def test_the_next_tree_attends_to_each_rows_own_region_only():
    kv, cache = cache_with(batch=2, prompt=3, tree=2)
    kv.commit(torch.tensor([[3, 4], [3, 3]]), torch.tensor([2, 1]))
    ancestor = torch.tensor([[True, False], [True, True]])
    mask, positions, past = kv.tree_inputs(ancestor, torch.tensor([0, 1]))
    assert past == 5 and positions.tolist() == [[5, 6], [4, 5]]
    allowed = mask[:, 0]  # (B, N, T + N): True where a tree slot may attend
    assert allowed[1, 0].tolist() == [True] * 4 + [False] + [True, False]  # row 1's hole at column 4


def test_finished_rows_leave_the_cache():
    kv, cache = cache_with(batch=3, prompt=2, tree=1)
    kv.commit(torch.tensor([[2], [2], [2]]), torch.tensor([1, 1, 1]))
    kv.select_rows(torch.tensor([0, 2]))
    assert row_keys(cache, 1) == [200, 201, 202] and kv.end.tolist() == [3, 3]
