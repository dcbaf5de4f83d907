"""A padded batch of prompts runs only its real tokens through the base (decoding/base/forward.py,
``_forward_packed``): the same states at every real position and the same cache as the padded
forward, zeros at the padding — attention windows included — and the padded forward wherever
packing does not apply."""
from __future__ import annotations

import pytest
import torch
import transformers

import draftheads.decoding.base.forward as forward
from draftheads.decoding.base.attention import RaggedRows, use_packed_sdpa
from helpers import left_pad, tiny_llama


def _batch():
    gen = torch.Generator().manual_seed(5)
    return left_pad([torch.randint(3, 96, (n,), generator=gen).tolist() for n in (3, 40, 11, 1)])


def _packed_against_padded(model, monkeypatch) -> None:
    """The packed prefill (the base sees the real tokens only) against the padded forward: the
    same states and cache at every real position, zeros at the padding."""
    assert use_packed_sdpa(model)
    ids, mask = _batch()
    assert forward.packs_prompts(model, mask)
    seen = []
    from_slots = RaggedRows.from_slots
    monkeypatch.setattr(RaggedRows, "from_slots", classmethod(lambda cls, v: seen.append(v) or from_slots(v)))
    packed_cache, packed = forward.forward_all(model, ids, mask)
    assert len(seen) == 1 and int(seen[0].sum()) == int(mask.sum())  # the base saw the 55 real tokens only
    monkeypatch.setattr(forward, "packs_prompts", lambda model, mask: False)
    padded_cache, padded = forward.forward_all(model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(packed[real], padded[real], rtol=1e-12, atol=1e-12)
    assert bool((packed[~real] == 0).all())
    for ours, theirs in zip(packed_cache.layers, padded_cache.layers):
        for name in ("keys", "values"):
            a, b = getattr(ours, name), getattr(theirs, name)  # (B, H, T, D)
            assert a.shape == b.shape
            torch.testing.assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real], rtol=1e-12, atol=1e-12)


def test_packed_prompts_give_the_padded_forwards_states_and_cache(monkeypatch):
    _packed_against_padded(tiny_llama(1), monkeypatch)


SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
#: windows shorter than the 40-token prompt: one window for every layer (Mistral), windowed and
#: full layers by type (Gemma 3), windows from a layer on (Qwen2)
WINDOWED = {"mistral": ("MistralConfig", dict(sliding_window=8)),
            "gemma3": ("Gemma3TextConfig", dict(head_dim=8, sliding_window=8,
                                                layer_types=["sliding_attention", "full_attention"])),
            "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1))}


@pytest.mark.parametrize("name", WINDOWED)
def test_windowed_bases_pack_their_prompts_too(name, monkeypatch):
    """The windows cut the (B, T) mask by the padded positions before the positions are packed."""
    torch.manual_seed(0)
    config = getattr(transformers, WINDOWED[name][0])(**SMALL, **WINDOWED[name][1])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(torch.float64).eval()
    _packed_against_padded(model, monkeypatch)


def test_prompts_are_not_packed_where_it_does_not_apply():
    model = tiny_llama(1)
    use_packed_sdpa(model)
    ids, mask = _batch()
    assert not forward.packs_prompts(model, mask[:1])  # one row
    assert not forward.packs_prompts(model, torch.ones_like(mask))  # no padding
    eager = tiny_llama(1)
    eager.config._attn_implementation = "eager"
    assert not use_packed_sdpa(eager) and not forward.packs_prompts(eager, mask)  # attention that cannot unpack rows
