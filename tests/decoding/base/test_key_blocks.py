"""Attention without each row's leading hidden key blocks (decoding/base/key_blocks.py): the runs
are the cheapest contiguous cut, rows are grouped so a long prompt does not split the short ones,
the cut attention equals the full one, and a batch mixing a prompt past one block with short ones
decodes token-identically to transformers (float64) while the cut is taken."""
from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings, strategies as st

import draftheads.decoding.base.attention as attention
import draftheads.decoding.base.key_blocks as key_blocks
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.base.cache import tree_attention_mask
from draftheads.decoding.base.key_blocks import KV_BLOCK, grouped_order, leading_hidden_blocks, row_runs
from helpers import OracleHeads, left_pad, tiny_llama


def _cost(runs, skips: list[int], length: int, call: int) -> int:
    return sum((b - a) * (length - s) + call for a, b, s in runs)


@settings(max_examples=150, deadline=None)
@given(blocks=st.lists(st.integers(0, 3), min_size=1, max_size=7), extra=st.integers(1, 600),
       call=st.sampled_from([0, 256, 768, 5000]))
def test_row_runs_is_the_cheapest_contiguous_cut(blocks, extra, call):
    skips = [b * KV_BLOCK for b in blocks]
    length = max(skips) + extra
    runs = row_runs(skips, length, call)
    assert [a for a, _, _ in runs] == [0] + [b for _, b, _ in runs[:-1]] and runs[-1][1] == len(skips)
    assert all(s == min(skips[a:b]) for a, b, s in runs)  # a run never reads past a row's first visible block
    best = min(_cost(tuple((a, b, min(skips[a:b])) for a, b in zip((0, *cuts), (*cuts, len(skips)))), skips, length, call)
               for n in range(len(skips)) for cuts in itertools.combinations(range(1, len(skips)), n))
    assert _cost(runs, skips, length, call) == best


def test_leading_hidden_blocks_round_each_row_down():
    valid = torch.zeros(4, 1100, dtype=torch.bool)
    for row, first in enumerate([0, 511, 512, 1030]):
        valid[row, first:] = True
    mask = tree_attention_mask(valid, torch.tril(torch.ones(3, 3, dtype=torch.bool)))  # (4, 1, 3, 1103)
    assert leading_hidden_blocks(mask) == [0, 0, 512, 1024]


def test_grouped_order_puts_equal_cuts_side_by_side():
    def valid(firsts, length=800):
        v = torch.zeros(len(firsts), length, dtype=torch.bool)
        for row, first in enumerate(firsts):
            v[row, first:] = True
        return v

    assert grouped_order(valid([600, 0, 700, 0])).tolist() == [1, 3, 0, 2]  # long prompts first, else stable
    assert grouped_order(valid([0, 0, 600, 700])) is None  # already grouped
    assert grouped_order(valid([10, 0, 300, 0])) is None  # nothing hidden in a whole block
    assert grouped_order(valid([300, 0], length=500)) is None  # shorter than one block


class _Groups:
    num_key_value_groups = 2
    is_causal = True


def test_cut_attention_equals_attention_over_every_key():
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        query = torch.randn(6, 4, 3, 16, generator=gen, dtype=torch.float64).to(dtype)
        key, value = (torch.randn(6, 2, 1100, 16, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
        valid = torch.zeros(6, 1097, dtype=torch.bool)
        for row, first in enumerate([0, 600, 700, 1050, 1060, 1070]):
            valid[row, first:] = True
        mask = tree_attention_mask(valid, torch.tril(torch.ones(3, 3, dtype=torch.bool)))
        assert key_blocks.key_runs(mask) == ((0, 1, 0), (1, 3, 512), (3, 6, 1024))
        cut, _ = attention._attend(_Groups(), query, key, value, mask, 0.0, 0.25, None, **{attention.PACK_FLAG: True})
        full, _ = attention._attend_rows(_Groups(), query, key, value, mask, True, 0.0, 0.25, None)
        torch.testing.assert_close(cut, full, rtol=tol, atol=tol)


def test_mixed_batch_with_a_long_prompt_is_identical_to_hf(monkeypatch):
    """A 600-token prompt between short ones: the prefill runs the real tokens only, the rows are
    regrouped and the short rows' attention skips the first block, and the tokens are transformers' own."""
    model = tiny_llama(0, max_pos=1024)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (12, 600, 7, 20)]
    ids, mask = left_pad(prompts)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    cuts, orders = [], []
    plan, group = key_blocks.key_runs, grouped_order

    def spy_runs(m):
        runs = plan(m)
        cuts.append(runs)
        return runs

    def spy_order(valid, *a):
        order = group(valid, *a)
        orders.append(order)
        return order

    monkeypatch.setattr(attention, "key_runs", spy_runs)
    monkeypatch.setattr("draftheads.decoding.loop.grouped_order", spy_order)
    packed = []
    from_slots = attention.RaggedRows.from_slots
    monkeypatch.setattr(attention.RaggedRows, "from_slots", classmethod(lambda cls, v: packed.append(v) or from_slots(v)))
    heads = OracleHeads(reference[:, ids.shape[1]:].tolist(), vocab=96, error=0.3, seed=0)
    ours = DraftHeadsModel(model, heads, tree=tree_from_paths([(0,), (1,), (0, 0)])).generate(
        ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0)
    assert ours.tolist() == reference.tolist()
    assert orders and orders[0].tolist() == [1, 0, 2, 3]
    assert len(packed) == 1 and int(packed[0].sum()) == sum(map(len, prompts))  # the prefill ran the real tokens only
    assert any(runs is not None and any(s > 0 for _, _, s in runs) for runs in cuts)


def test_a_forward_lets_go_of_what_it_derived_from_its_masks(monkeypatch):
    """Within a forward the plan and the repeated mask are made once for all layers; after it,
    none is kept (a prefill's repetition would otherwise stay alive)."""
    from draftheads.decoding.base.attention import use_packed_sdpa
    from draftheads.decoding.base.forward import forward_all
    from draftheads.decoding.base.mask_memo import MaskMemo

    memo, made = MaskMemo(kept=2), []
    masks = [torch.ones(1, 1, 2, 3, dtype=torch.bool) for _ in range(3)]
    for mask in (masks[0], masks[1], masks[0], masks[1]):  # two masks alternating: each made once
        memo.get(mask, None, lambda m=mask: made.append(m) or len(made))
    assert len(made) == 2
    memo.get(masks[2], None, lambda: made.append(masks[2]))  # a third evicts the oldest
    memo.get(masks[0], None, lambda: made.append(masks[0]))
    assert len(made) == 4
    model = tiny_llama(0, max_pos=1024)
    assert use_packed_sdpa(model)
    gen = torch.Generator().manual_seed(1)
    ids, mask = left_pad([torch.randint(3, 96, (n,), generator=gen).tolist() for n in (600, 9)])
    plans, repeats, plan, repeat = [], [], key_blocks._plan, torch.Tensor.repeat
    monkeypatch.setattr(key_blocks, "_plan", lambda m: plans.append(m) or plan(m))
    monkeypatch.setattr(torch.Tensor, "repeat", lambda t, *a: repeats.append(t.dtype) or repeat(t, *a))
    forward_all(model, ids, mask)
    assert len(plans) == 1 and repeats.count(torch.bool) == 1  # two layers, one plan and one repetition
    assert attention._REPEATED._entries == () and key_blocks._PLANS._entries == ()
