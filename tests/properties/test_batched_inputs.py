"""Bad or unusual batched input: a clear error or transformers' own behaviour, never
silently different tokens."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from helpers import tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.memory import decode_memory_bytes
from draftheads.heads import HeadConfig, MedusaHeads

MODEL = tiny_llama(0)  # pad 0, eos 2


def drafter(model=MODEL) -> DraftHeadsModel:
    heads = MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96)).to(torch.float64)
    return DraftHeadsModel(model, heads, tree=tree_from_paths([[0], [1], [0, 0]]))


def hf(model, ids, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, do_sample=False, **kwargs)


def test_right_padding_without_mask_is_refused_when_padding_can_be_inferred():
    ids = torch.tensor([[3, 4, 5], [6, 7, 0]])  # pad 0 ≠ eos: the mask is inferred, and it is right-padded
    with pytest.warns(UserWarning, match="right-padding was detected"):
        with pytest.raises(ValueError, match="right-padded.*padding_side = 'left'"):
            drafter().generate(ids, max_new_tokens=4)


def test_right_padding_with_pad_equal_to_eos_warns_and_matches_transformers():
    # pad == eos: neither transformers nor we can tell padding from text; both warn and read it as text
    ids = torch.tensor([[3, 4, 5], [6, 7, 2]])
    with pytest.warns(UserWarning, match="right-padding was detected"):
        ours = drafter().generate(ids, max_new_tokens=6, pad_token_id=2)
    assert ours.tolist() == hf(MODEL, ids, max_new_tokens=6, pad_token_id=2).tolist()


def test_missing_pad_token_falls_back_to_eos_like_transformers():
    model = copy.deepcopy(MODEL)
    model.generation_config.pad_token_id = None
    model.config.pad_token_id = None
    ids = torch.tensor([[9, 9, 3, 4, 5], [9, 9, 9, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]])
    free = hf(model, ids, attention_mask=mask, max_new_tokens=8)
    eos = int(free[0, 5 + 2])  # row 0 stops after 3 tokens; its padding must be the EOS id
    reference = hf(model, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos)
    ours = drafter(model).generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos)
    assert ours.tolist() == reference.tolist()
    if eos not in free[1, 5:].tolist():  # row 1 ran on: row 0 is padded with the EOS id as transformers does
        assert ours[0, 8:].tolist() == [eos] * (ours.shape[1] - 8)
    with pytest.warns(UserWarning, match="attention mask and the pad token id were not set"):
        drafter(model).generate(torch.tensor([[3, 4], [5, 6]]), max_new_tokens=2, eos_token_id=eos)


def test_empty_prompt_in_a_batch_is_refused():
    with pytest.raises(ValueError, match="a prompt in the batch is empty"):
        drafter().generate(torch.tensor([[3, 4], [0, 0]]), attention_mask=torch.tensor([[1, 1], [0, 0]]),
                           max_new_tokens=4)


@pytest.mark.parametrize("max_new", [1, 5])
def test_rows_finishing_on_the_first_step(max_new):
    ids = torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9], [0, 0, 10, 11]])
    mask = (ids != 0).long()
    first = hf(MODEL, ids, attention_mask=mask, max_new_tokens=1)[:, -1]
    eos = int(first[1])  # row 1's very first token is EOS: it finishes at the prefill
    reference = hf(MODEL, ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos)
    ours = drafter().generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos)
    assert ours.tolist() == reference.tolist()
    assert ours[1, 4:].tolist() == [eos] + [0] * (max_new - 1)


def test_memory_estimate_grows_with_the_batch():
    one = decode_memory_bytes(MODEL.config, 1, 100, 50, 9, 8)
    eight = decode_memory_bytes(MODEL.config, 8, 100, 50, 9, 8)
    assert eight["kv_cache"] == 8 * one["kv_cache"] and eight["total"] == 8 * one["total"]
    # KV: 2 (k, v) × 2 kv heads × 8 dims × 8 bytes a slot, × (2 layers × (100 + 50 + 9 slots + the
    # 256 each keeps ahead) + one layer's 159 held while it grows into a new buffer)
    assert one["kv_cache"] == 2 * 2 * 8 * 8 * (2 * (159 + 256) + 159)


def test_batch_larger_than_memory_is_refused_before_any_work(monkeypatch):
    monkeypatch.setattr("draftheads.decoding.memory.available_memory_bytes", lambda device: 4 << 20)

    def no_prefill(*_args, **_kwargs):
        raise AssertionError("work started before the memory check")

    monkeypatch.setattr("draftheads.decoding.loop.prefill", no_prefill)
    ids = torch.randint(3, 96, (64, 200))
    with pytest.raises(MemoryError, match=r"batch of 64 × 200-token prompts.*GiB is free on cpu; split it into "
                                          r"batches of at most \d+ rows"):
        drafter().generate(ids, max_new_tokens=50)
    small = torch.randint(3, 96, (1, 4))
    with pytest.raises(AssertionError, match="work started"):  # a small batch passes the check
        drafter().generate(small, max_new_tokens=2)
