"""What could differ silently, checked against transformers itself: a batch's per-step
scores/logits and its returned cache equal transformers' (rows that finished early included),
a prompt near the context limit warns when its answer is cut, and no FutureWarning leaks from
the forwards."""
from __future__ import annotations

import warnings

import pytest
import torch

from helpers import OracleHeads, left_pad, tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths

MODEL = tiny_llama(0, max_pos=128)
TREE = tree_from_paths([[0], [1], [0, 0], [0, 0, 0], [0, 1]])


def early_eos_batch() -> tuple[torch.Tensor, torch.Tensor, int, list[list[int]]]:
    """A left-padded batch and an EOS id that ends row 0 at its first token while the others run on
    (this tiny model repeats its last token, so row 0's first token is one the others never emit)."""
    ids, mask = left_pad([[5, 9, 17, 33], [40, 41, 7], [12, 60, 61, 62, 63]])
    plain = MODEL.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[:, ids.shape[1]:].tolist()
    eos = plain[0][0]
    assert all(eos not in row for row in plain[1:])
    return ids, mask, eos, plain


def drafter(continuations) -> DraftHeadsModel:
    return DraftHeadsModel(MODEL, OracleHeads(continuations, 96, num_heads=3), tree=TREE)


@pytest.mark.parametrize("options", [{"output_scores": True}, {"output_logits": True},
                                     {"output_scores": True, "repetition_penalty": 1.3}])
def test_batch_scores_and_cache_equal_transformers(options):
    ids, mask, eos, plain = early_eos_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0,
                  return_dict_in_generate=True, **options)
    theirs = MODEL.generate(ids, do_sample=False, **kwargs)
    ours = drafter(plain).generate(ids, **kwargs)
    assert ours.sequences.tolist() == theirs.sequences.tolist()
    assert (ours.sequences[0] == 0).sum() > (ids[0] == 0).sum()  # row 0 really finished early (padded)
    name = "scores" if options.get("output_scores") else "logits"
    ours_steps, their_steps = getattr(ours, name), getattr(theirs, name)
    assert len(ours_steps) == len(their_steps)
    for mine, reference in zip(ours_steps, their_steps):
        assert torch.allclose(mine.double(), reference.double(), atol=1e-6, rtol=0, equal_nan=True)
    assert ours.past_key_values is not None
    assert ours.past_key_values.get_seq_length() == theirs.past_key_values.get_seq_length()
    for mine, reference in zip(ours.past_key_values.layers, theirs.past_key_values.layers):
        assert torch.allclose(mine.keys, reference.keys, atol=1e-9)
        assert torch.allclose(mine.values, reference.values, atol=1e-9)


def test_batch_without_early_rows_keeps_its_scores_and_returns_a_cache():
    ids, mask = left_pad([[5, 9, 17], [40, 41, 7, 8]])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, eos_token_id=None, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True)
    theirs = MODEL.generate(ids, do_sample=False, **kwargs)
    ours = DraftHeadsModel(MODEL).generate(ids, **kwargs)
    assert all(torch.allclose(a, b, atol=1e-9) for a, b in zip(ours.scores, theirs.scores))
    assert ours.past_key_values.get_seq_length() == theirs.past_key_values.get_seq_length()


def test_cut_at_the_context_limit_warns_with_the_numbers():
    prompt = torch.full((1, 120), 5)
    with pytest.warns(UserWarning, match=r"max_new_tokens=16 was cut to 8 new tokens.*max_position_embeddings=128"):
        out = DraftHeadsModel(MODEL).generate(prompt, max_new_tokens=16)
    assert out.shape[1] == 128


def test_no_warning_when_the_answer_fits_and_no_future_warning_from_the_forwards():
    ids, mask, eos, plain = early_eos_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafter(plain).generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
        DraftHeadsModel(MODEL).generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0,
                                        return_dict_in_generate=True, output_scores=True)
