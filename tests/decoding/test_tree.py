"""Tree buffers, greedy acceptance and the greedy tree search, against hand-computed values."""
from __future__ import annotations

import torch

from draftheads.decoding import greedy_accept, tree_from_paths, tree_from_ranks


def test_buffers_of_a_small_tree():
    tree = tree_from_paths([[1], [0], [0, 0], [0, 1], [0, 0, 0]])
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert tree.parent.tolist() == [-1, 0, 0, 1, 1, 3]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert tree.rank.tolist() == [0, 0, 1, 0, 1, 0]
    assert tree.ancestor[5].tolist() == [True, True, False, True, False, True]
    assert tree.ancestor[2].tolist() == [True, False, True, False, False, False]
    assert tree.path_slots[5].tolist() == [0, 1, 3, 5]
    assert tree.path_slots[2].tolist() == [0, 2, 2, 2]
    assert tree.truncated(1).paths == ((0,), (1,))


def test_greedy_accept_picks_the_deepest_matching_path():
    tree = tree_from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    #               root  (0)  (1)  (0,0) (0,1) (0,0,0)
    tokens = torch.tensor([[7, 10, 11, 20, 21, 30],
                           [7, 10, 11, 20, 21, 30],
                           [7, 10, 11, 20, 21, 30]])
    # predicted[s] = the base's argmax after slot s
    predicted = torch.tensor([[10, 21, 0, 0, 99, 0],   # 10 ✓, then (0,1)=21 ✓, bonus 99
                              [11, 20, 5, 30, 0, 0],   # (1)=11 ✓ only: its child absent; bonus 5
                              [12, 0, 0, 0, 0, 0]])    # nothing: bonus 12
    result = greedy_accept(tokens, tree.parent, tree.depth, tree.path_slots, predicted)
    assert result.accepted.tolist() == [2, 1, 0]
    assert result.best.tolist() == [4, 2, 0]
    assert result.bonus.tolist() == [99, 5, 12]
    assert result.path[0].tolist() == [0, 1, 4, 4]


def test_tree_from_ranks_uses_joint_frequencies():
    # 10 positions, 2 heads. Head-1 rank 0 is right 6/10; head-2 rank 0 right 5/10 but only
    # 1 of those together with head-1 rank 0; head-1 rank 1 right 3/10, all with head-2 rank 0.
    ranks = torch.tensor([[0, 0]] + [[0, 3]] * 5 + [[1, 0]] * 3 + [[2, 1]])
    paths, tau = tree_from_ranks(ranks, budget=3, max_rank=3)  # rank 3 = not in top-3
    assert paths == [(0,), (1,), (1, 0)]
    assert abs(tau - (1 + 0.6 + 0.3 + 0.3)) < 1e-9
