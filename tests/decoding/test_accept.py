"""decoding/accept.py: the acceptance rules on hand-made trees, and the acceptor reading the
call's sequences (the repetition penalty's history)."""
from __future__ import annotations

import torch
from transformers import GenerationConfig

from draftheads.decoding.accept import Acceptor, greedy_accept, greedy_tokens
from draftheads.decoding.sequences import Sequences
from draftheads.decoding.tree import tree_from_paths

VOCAB = 16


def one_hot_logits(predicted: list[list[int]]) -> torch.Tensor:
    """(B, N, V) logits whose argmax at slot i is ``predicted[b][i]``."""
    logits = torch.zeros(len(predicted), len(predicted[0]), VOCAB)
    for b, row in enumerate(predicted):
        for i, token in enumerate(row):
            logits[b, i, token] = 5.0
    return logits


def test_greedy_keeps_the_longest_path_the_base_agrees_with_and_its_bonus():
    # slots: 0 root; 1 = (0,), 2 = (1,), 3 = (0, 0), 4 = (0, 0, 0)
    tree = tree_from_paths([(0,), (1,), (0, 0), (0, 0, 0)])
    assert tree.parent.tolist() == [-1, 0, 0, 1, 3]
    tokens = torch.tensor([[7, 3, 4, 5, 6],    # the base says 3 after 7, 5 after 3, 9 after 5: path 0→1→3, bonus 9
                           [7, 3, 4, 5, 6]])   # the base says 4 after 7: only slot 2, bonus at slot 2
    predicted = torch.tensor([[3, 5, 1, 9, 1],
                              [4, 1, 8, 1, 1]])
    result = greedy_accept(tokens, tree.parent, tree.depth, tree.path_slots, predicted)
    assert result.accepted.tolist() == [2, 1]
    assert result.best.tolist() == [3, 2]
    assert result.bonus.tolist() == [9, 8]
    assert result.path[0, :3].tolist() == [0, 1, 3] and result.path[1, :2].tolist() == [0, 2]


def test_greedy_rejects_everything_when_the_first_draft_is_wrong():
    tree = tree_from_paths([(0,), (0, 0)])
    tokens = torch.tensor([[7, 2, 3]])
    predicted = torch.tensor([[5, 3, 4]])
    result = greedy_accept(tokens, tree.parent, tree.depth, tree.path_slots, predicted)
    assert result.accepted.tolist() == [0] and result.best.tolist() == [0] and result.bonus.tolist() == [5]


def test_greedy_tokens_take_the_first_maximum_like_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    assert greedy_tokens(logits).tolist() == torch.argmax(logits, -1).tolist() == [1, 0]


def test_the_acceptor_reads_the_penalty_history_from_the_sequences():
    """With a repetition penalty the first token is chosen from the processed scores, whose
    history is each row's prompt plus what the sequences hold; transformers' penalty skips each
    row's padding (its per-row ``prompt_ignore_length``, re-indexed to the rows it is given)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    ids = torch.tensor([[0, 5, 6], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # row 0's leading 0 is padding, row 1's is text
    sequences = Sequences(ids, mask)
    penalty = RepetitionPenaltyLogitsProcessor(100.0, prompt_ignore_length=torch.tensor([1, 0]))
    acceptor = Acceptor(GenerationConfig(do_sample=False), "greedy", VOCAB, sequences, processors=[penalty])
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 2.0  # the best raw token, in both prompts: penalized to 0.02
    logits[:, 0] = 1.0  # penalized only where it is text (row 1)
    logits[:, 9] = 0.5
    assert acceptor.first(logits).tolist() == [0, 9]
    sequences.append(0, 0)  # now row 0 has said 0 itself: the same logits give 9
    assert acceptor.first(logits).tolist() == [9, 9]
