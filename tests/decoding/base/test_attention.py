"""Grouped-query packing for tree verification (decoding/base/attention.py): the same hidden
states as transformers' SDPA with repeated key/value heads, and no effect on any forward
that did not ask for it (the base's own generate)."""
from __future__ import annotations

import copy

import pytest
import torch

from helpers import left_pad, ragged_step, record_packed_steps, tiny_llama
from draftheads.decoding.base.attention import use_packed_sdpa, uses_packed_sdpa
from draftheads.decoding.base.forward import prefill, verify
from draftheads.decoding.base.cache import tree_attention_mask
from draftheads.decoding.generate import DraftHeadsModel
from draftheads.decoding.calibration import _synthetic_cache


def _verify_states(model, bs: int, q: int, kv_len: int, seed: int = 0) -> torch.Tensor:
    """Hidden states of a verification forward over a random cache with holes and a random tree."""
    gen = torch.Generator().manual_seed(seed)
    cache = _synthetic_cache(model, bs, kv_len)
    for layer in cache.layers:  # same random cache whatever the attention implementation
        layer.keys.copy_(torch.randn(layer.keys.shape, generator=gen, dtype=layer.keys.dtype))
        layer.values.copy_(torch.randn(layer.values.shape, generator=gen, dtype=layer.values.dtype))
    valid = torch.rand(bs, kv_len, generator=gen) > 0.3
    valid[:, -1] = True
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, q)]
    ancestor = torch.eye(q, dtype=torch.bool)
    for i in range(1, q):
        ancestor[i] |= ancestor[parent[i]]
    depth = ancestor.sum(1) - 1
    mask = tree_attention_mask(valid, ancestor)
    positions = valid.sum(1, keepdim=True) + depth[None]
    tokens = torch.randint(3, model.config.vocab_size, (bs, q), generator=gen)
    return verify(model, tokens, positions, mask, cache)


def test_packed_verification_equals_repeated_heads(monkeypatch):
    import transformers.integrations.sdpa_attention as hf_sdpa

    copies = []
    original = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda x, n: copies.append(n) or original(x, n))
    reference = tiny_llama(0)
    packed = copy.deepcopy(reference)
    assert use_packed_sdpa(packed) and uses_packed_sdpa(packed) and not uses_packed_sdpa(reference)
    assert packed.config._attn_implementation == reference.config._attn_implementation == "sdpa"  # the config stays
    for bs, q, kv_len in [(1, 1, 5), (1, 7, 9), (3, 4, 12), (5, 2, 3)]:
        copies.clear()
        ours = _verify_states(packed, bs, q, kv_len)
        assert not copies  # packed: no key/value head was repeated
        theirs = _verify_states(reference, bs, q, kv_len)
        assert len(copies) == (0 if q == 1 else 2 * reference.config.num_hidden_layers)  # keys + values per layer
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_packed_prefill_equals_sdpa_with_left_padding():
    reference = tiny_llama(1)
    packed = copy.deepcopy(reference)
    use_packed_sdpa(packed)
    ids, mask = left_pad([[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]])
    _, ours = prefill(packed, ids, mask)
    _, theirs = prefill(reference, ids, mask)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_base_generate_is_untouched_and_only_grouped_sdpa_bases_switch():
    """The switch leaves the base's own generate on transformers' SDPA path (its config is never
    changed, and the forward flag is absent there); bases without grouped heads or with another
    implementation are not switched."""
    model = tiny_llama(0)
    ids, mask = left_pad([[5, 6, 7], [8, 9, 10, 11, 12, 13]])
    before = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                            return_dict_in_generate=True, output_scores=True)
    DraftHeadsModel(model, None)
    assert uses_packed_sdpa(model) and model.config._attn_implementation == "sdpa"
    after = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True, output_scores=True)
    assert after.sequences.tolist() == before.sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(after.scores, before.scores))  # bit-identical logits

    no_groups = tiny_llama(0)
    no_groups.config.num_key_value_heads = no_groups.config.num_attention_heads
    assert not use_packed_sdpa(no_groups) and not uses_packed_sdpa(no_groups)
    eager = tiny_llama(0)
    eager.set_attn_implementation("eager")
    assert not use_packed_sdpa(eager) and not uses_packed_sdpa(eager) and eager.config._attn_implementation == "eager"
    kept = tiny_llama(0)
    DraftHeadsModel(kept, None, packed_attention=False)
    assert not uses_packed_sdpa(kept)
    DraftHeadsModel.from_pretrained(None, base=kept, packed_attention=False)
    assert not uses_packed_sdpa(kept)
    DraftHeadsModel.from_pretrained(None, base=kept)
    assert uses_packed_sdpa(kept) and kept.config._attn_implementation == "sdpa"


def test_the_mask_is_repeated_once_per_forward_and_redone_when_it_changes():
    """Every layer gets the same 4D mask tensor: its repetition is made once and reused; a new
    mask, an in-place change or another group size repeat it again."""
    from draftheads.decoding.base.attention import repeated_mask

    mask = torch.rand(2, 1, 3, 7) > 0.5
    first = repeated_mask(mask, 3)
    assert torch.equal(first, mask.repeat(1, 1, 3, 1))
    assert repeated_mask(mask, 3) is first
    assert torch.equal(repeated_mask(mask, 2), mask.repeat(1, 1, 2, 1))
    mask[0, 0, 0, 0] = ~mask[0, 0, 0, 0]
    assert torch.equal(repeated_mask(mask, 2), mask.repeat(1, 1, 2, 1))
    other = mask.clone()
    assert repeated_mask(other, 2) is not repeated_mask(mask, 2)


def test_ragged_rows_verified_packed_equal_the_padded_block(monkeypatch):
    """Rows of different node counts verified packed (the real slots as one sequence, attention
    unpacked per row, in one call or split in two) give the padded block's hidden states and
    cache entries at every real slot, zeros at the padding; the split is taken in some cases."""
    model = tiny_llama(0)
    use_packed_sdpa(model)
    packed_runs, splits = record_packed_steps(monkeypatch), []
    for seed in range(30):
        tokens, positions, mask, valid, cache = ragged_step(model, seed, bs=2 + seed % 5, width=2 + seed % 7,
                                                             skewed=seed % 2 == 1)
        padded_cache, packed_cache = cache(), cache()
        padded = verify(model, tokens, positions, mask, padded_cache)
        packed = verify(model, tokens, positions, mask, packed_cache, valid)
        if bool(valid.all()):
            continue
        splits.append(packed_runs[-1].split[1] is not None)
        torch.testing.assert_close(packed[valid], padded[valid], rtol=1e-12, atol=1e-12)
        assert not packed[~valid].any()
        for ours, theirs in zip(packed_cache.layers, padded_cache.layers):
            new = valid.shape[1]
            torch.testing.assert_close(ours.keys[:, :, -new:].transpose(1, 2)[valid],
                                       theirs.keys[:, :, -new:].transpose(1, 2)[valid], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ours.values[:, :, :-new], theirs.values[:, :, :-new], rtol=0, atol=0)
    assert any(splits) and not all(splits)  # both attention paths ran


def test_ragged_rows_on_a_base_without_the_packed_attention_verify_the_padded_block():
    """Another attention implementation (eager here) cannot unpack rows: the same call verifies
    the padded block, with the same states at the real slots."""
    from draftheads.decoding.base.forward import ragged_capable

    model = tiny_llama(0)
    model.set_attn_implementation("eager")
    assert not ragged_capable(model)
    tokens, positions, mask, valid, cache = ragged_step(model, 3)
    plain = verify(model, tokens, positions, mask, cache())
    given_valid = verify(model, tokens, positions, mask, cache(), valid)
    assert torch.equal(plain, given_valid)


def test_ragged_attention_splits_off_only_the_few_long_rows():
    """One row of nine slots among fifteen of one: the first slot of every row in one call, the
    long row's other eight in a second (one call would make every row pay nine); rows of alike
    sizes, or two rows, stay in one call."""
    from draftheads.decoding.base.attention import RaggedRows

    def rows(sizes):
        width = max(sizes)
        return RaggedRows.from_valid(torch.arange(width)[None] < torch.tensor(sizes)[:, None])

    short, long = rows([1] * 7 + [9] + [1] * 8).split
    assert short == 1 and long.tolist() == [7]
    short, long = rows([9, 9] + [2] * 14).split
    assert short == 2 and long.tolist() == [0, 1]
    assert rows([3, 4, 4, 3, 4, 3]).split[1] is None
    assert rows([9, 1]).split[1] is None
    packed = rows([2, 1, 3])
    assert packed.count == 6 and packed.index.tolist() == [0, 1, 3, 6, 7, 8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_additive_mask_is_the_one_sdpa_makes_of_the_boolean_mask(dtype):
    """Handing SDPA the boolean mask as 0 / −inf in the query's dtype, made once a forward, gives
    its result bit for bit (SDPA converts a boolean mask so at every call)."""
    from draftheads.decoding.base.attention import additive_mask
    from draftheads.decoding.base.mask_memo import mask_memos

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 16, generator=gen).to(dtype) for n in (12, 40, 40))
    mask = torch.rand(2, 1, 12, 40, generator=gen) > 0.4
    mask[..., 0] = True
    with mask_memos():
        additive = additive_mask(mask, dtype)
        assert additive.dtype == dtype and additive_mask(mask, dtype) is additive  # once a forward
        ours = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(ours, theirs)
    assert additive_mask(additive, dtype) is additive  # a float mask passes as it is
