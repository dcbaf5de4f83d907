"""decoding/input_checks.py and memory.py: the input checks of ``generate`` (padding side, empty prompts, the mask
transformers infers) and the memory check, each before any work."""
from __future__ import annotations

import pytest
import torch

from draftheads.core.errors import InputError
from draftheads.decoding.input_checks import check_inputs, wanted_new_tokens
from draftheads.decoding import memory
from draftheads.decoding.memory import check_memory, decode_memory_bytes
from helpers import tiny_llama


@pytest.fixture(scope="module")
def base():
    return tiny_llama(0, max_pos=64)


def test_padding_is_inferred_from_the_pad_id_unless_it_is_also_eos(base):
    ids = torch.tensor([[0, 0, 5, 6], [3, 4, 5, 6]])
    _, mask = check_inputs(ids, None, base, pad=0, eos=[2])
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    _, mask = check_inputs(ids, None, base, pad=0, eos=[0, 2])  # pad = an EOS: cannot tell, no inference
    assert mask.tolist() == [[1] * 4] * 2


@pytest.mark.parametrize("ids, mask, match", [
    (torch.zeros(1, 0, dtype=torch.long), None, "the prompt is empty"),
    (torch.tensor([[3, 4], [5, 6]]), torch.tensor([[1, 1], [0, 0]]), "empty \\(all padding\\)"),
    (torch.tensor([[3, 4], [5, 6]]), torch.tensor([[1, 1], [1, 0]]), "right-padded"),
    (torch.tensor([[3, 4]]), torch.tensor([[1, 1, 1]]), "attention_mask shape"),
    (torch.full((1, 64), 3), None, "context limit of 64"),
])
def test_bad_inputs_are_refused_naming_the_fix(base, ids, mask, match):
    with pytest.raises(InputError, match=match):
        check_inputs(ids, mask, base, pad=0, eos=[2])


def test_wanted_new_tokens_follow_transformers(base):
    config = base.generation_config
    config.max_new_tokens, config.max_length = None, 20
    assert wanted_new_tokens(config, 12) == 8
    with pytest.raises(InputError, match="leaves no room"):
        wanted_new_tokens(config, 20)
    config.max_new_tokens = 0
    with pytest.raises(InputError, match="must be positive"):
        wanted_new_tokens(config, 12)


def test_the_memory_estimate_grows_with_every_size_and_refuses_what_does_not_fit(base, monkeypatch):
    small = decode_memory_bytes(base.config, 1, 16, 16, 1, 8)
    assert small["total"] == small["kv_cache"] + small["activations"]
    for bigger in ([2, 16, 16, 1, 8], [1, 32, 16, 1, 8], [1, 16, 32, 1, 8], [1, 16, 16, 9, 8], [1, 16, 16, 1, 16]):
        assert decode_memory_bytes(base.config, *bigger)["total"] > small["total"]
    need = decode_memory_bytes(base.config, 4, 16, 16, 9, 8)["total"]
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: int(need / 0.9) + 1024)
    check_memory(base, 4, 16, 16, 9)  # fits
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: need)
    with pytest.raises(MemoryError, match="split it into batches of at most 3 rows"):
        check_memory(base, 4, 16, 16, 9)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: None)
    check_memory(base, 4, 16, 16, 9)  # cannot tell: no refusal
