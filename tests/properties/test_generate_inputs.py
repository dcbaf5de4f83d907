"""Bad input gets a clear message, never a shape error from deep inside torch."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_llama
from draftheads.decoding import DraftHeadsModel, chain_tree, tree_from_paths
from draftheads.heads import HeadConfig, MedusaHeads

MODEL = tiny_llama(0, max_pos=64)


def drafter(tree=None) -> DraftHeadsModel:
    heads = MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96)).to(torch.float64)
    return DraftHeadsModel(MODEL, heads, tree=tree or tree_from_paths([[0], [1], [0, 0]]))


@pytest.mark.parametrize("kwargs,message", [
    ({"max_new_tokens": 0}, "max_new_tokens.*(must be positive|greater than 0)"),
    ({"max_new_tokens": -3}, "max_new_tokens.*(must be positive|greater than 0)"),
    ({"num_beams": 4}, "num_beams=4.*not supported"),
    ({"do_sample": True, "guidance_scale": 1.5}, "guidance_scale=1.5.*not supported"),
    ({"acceptance": "typical"}, "acceptance=.*pass do_sample=True"),
    ({"frobnicate": 1}, "does not understand.*frobnicate"),
])
def test_bad_generate_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        drafter().generate(torch.tensor([[3, 4]]), **kwargs)


def test_empty_prompt():
    with pytest.raises(ValueError, match="prompt is empty"):
        drafter().generate(torch.zeros((1, 0), dtype=torch.long), max_new_tokens=4)


def test_prompt_at_context_limit():
    with pytest.raises(ValueError, match="at or over the model's context limit of 64"):
        drafter().generate(torch.full((1, 64), 5), max_new_tokens=4)


def test_generation_stops_at_context_limit():
    prompt = torch.full((1, 60), 5)
    out = drafter().generate(prompt, max_new_tokens=50)
    assert out.shape[1] == 64
    assert out.tolist() == MODEL.generate(prompt, max_new_tokens=4, do_sample=False).tolist()


def test_right_padded_batch_is_refused():
    with pytest.raises(ValueError, match="right-padded.*padding_side = 'left'"):
        drafter().generate(torch.tensor([[3, 4], [5, 0]]), attention_mask=torch.tensor([[1, 1], [1, 0]]),
                           max_new_tokens=4)


def test_streamer_needs_batch_size_one():
    with pytest.raises(ValueError, match="streamer needs batch size 1"):
        drafter().generate(torch.tensor([[3, 4], [5, 6]]), max_new_tokens=4, streamer=object())


def test_batch_with_an_empty_prompt():
    with pytest.raises(ValueError, match="prompt in the batch is empty"):
        drafter().generate(torch.tensor([[3, 4], [0, 0]]), attention_mask=torch.tensor([[1, 1], [0, 0]]),
                           max_new_tokens=4)


def test_tree_deeper_than_heads():
    heads = MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96))
    with pytest.raises(ValueError, match="3 deep but the checkpoint has only 2 heads"):
        heads.check_tree(chain_tree(3).spec)
    small = MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96, draft_vocab_size=4))
    with pytest.raises(ValueError, match="top-6 candidates but the heads draft from 4 tokens"):
        small.check_tree(tree_from_paths([[5]]).spec)


@pytest.mark.parametrize("paths,message", [
    ([[0, 1]], "has no parent \\[0\\]"),
    ([[0], [0]], "appears twice"),
    ([[0], [-1]], "non-negative integer ranks"),
    ([[]], "must not be empty"),
])
def test_bad_tree_paths(paths, message):
    with pytest.raises(ValueError, match=message):
        tree_from_paths(paths)
