"""decoding/sequences.py: the one owner of a call's tokens."""
from __future__ import annotations

import torch

from draftheads.decoding.sequences import Sequences


def sequences() -> Sequences:
    seqs = Sequences(torch.tensor([[0, 0, 7], [3, 4, 5]]), torch.tensor([[0, 0, 1], [1, 1, 1]]))
    for token in (8, 9):
        seqs.append(0, token)
    seqs.append(1, 6)
    return seqs


def test_prompts_drop_padding_and_counts_follow_appends():
    seqs = sequences()
    assert seqs.prompts() == [[7], [3, 4, 5]]
    assert [seqs.count(0), seqs.count(1)] == [2, 1] and seqs.new_tokens == 3
    assert seqs.so_far(0).tolist() == [[0, 0, 7, 8, 9]]


def test_history_is_the_padded_prompt_then_the_tokens_right_filled():
    """As transformers' processors see each row (pads included), with each row's own length."""
    history, ends = sequences().history(torch.tensor([1, 0]), fill=50)
    assert history.tolist() == [[3, 4, 5, 6, 50], [0, 0, 7, 8, 9]] and ends.tolist() == [4, 5]


def test_assembled_is_transformers_shape_right_filled_with_pad():
    assert sequences().assembled(pad=2).tolist() == [[0, 0, 7, 8, 9], [3, 4, 5, 6, 2]]
