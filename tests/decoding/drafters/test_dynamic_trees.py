"""The heads alone on a dynamic tree (``heads_offer_scale`` > 1): each row verifies its policy's node
budget, its best nodes by calibrated path confidence out of a larger stored tree; greedy stays
token-identical to transformers (float64, batched, padded), the hit rates learn from every
verification, the policy still learns from the steps, and a tree the caller gives is verified as
given."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from helpers import left_pad, tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.accept import Acceptance
from draftheads.decoding.drafters import DraftState, HeadsDrafter
from draftheads.decoding.step_trees import StepTrees
from draftheads.core.errors import InputError, InputTypeError
from draftheads.heads import DraftHeads, HeadConfig, HydraHeads, TreeSpec

#: stored trees as a checkpoint keeps them: each budget's best shape, the larger ones the offers
STORED = {"1": [[0]], "2": [[0], [0, 0]], "4": [[0], [0, 0], [1], [0, 0, 0]],
          "8": [[0], [0, 0], [1], [0, 0, 0], [2], [0, 1], [1, 0], [0, 0, 0, 0]]}


def stored_hydra(model, seed: int = 0) -> HydraHeads:
    """Random Hydra heads (the sequential family: a node's children depend on its token) with
    stored trees, bound to ``model``."""
    cfg = model.config
    heads = HydraHeads(HeadConfig(family="hydra", num_heads=4, hidden_size=cfg.hidden_size,
                                  vocab_size=cfg.vocab_size, trees=STORED,
                                  expected_tau={"1": 1.3, "2": 1.4, "4": 1.5, "8": 1.6}))
    torch.manual_seed(seed)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return heads.to(model.dtype).bind(model.lm_head.weight, model.get_input_embeddings().weight)


class TableHeads(DraftHeads):
    """Fills any tree from fixed per-row (token, probability) choices by depth and rank."""

    family = "table-test"

    def __init__(self, probs: list[list[list[float]]]):  # [row][depth - 1][rank]
        super().__init__(HeadConfig(family="medusa", num_heads=len(probs[0]), hidden_size=8, vocab_size=64))
        self.table = probs

    def propose(self, hidden, roots, tree: TreeSpec, with_probs: bool = False):
        depth, rank = tree.depth.tolist(), tree.rank.tolist()
        tokens = torch.tensor([[int(roots[b])] + [10 * d + r for d, r in zip(depth[1:], rank[1:])]
                               for b in range(roots.shape[0])])
        probs = torch.tensor([[1.0] + [self.table[b][d - 1][r] for d, r in zip(depth[1:], rank[1:])]
                              for b in range(roots.shape[0])], dtype=torch.float32)
        return (tokens, probs) if with_probs else tokens


def path_score(tree, probs_row, node: int) -> float:
    score = 1.0
    while node > 0:
        score *= probs_row[int(tree.depth[node]) - 1][int(tree.rank[node])]
        node = int(tree.parent[node])
    return score


def test_each_row_keeps_its_best_nodes_of_the_offer():
    """Row 0's heads are sure of their first choice at every depth (a chain pays), row 1's are
    torn at depth 1 (width pays): each row keeps the budget's best-scoring nodes of the offer,
    prefix-closed, and the step says which policy tree it stands for."""
    offer = tree_from_paths(STORED["8"])
    table = [[[0.9, 0.05, 0.05], [0.9, 0.05], [0.9], [0.9]],
             [[0.45, 0.4, 0.15], [0.3, 0.1], [0.2], [0.2]]]
    drafter = HeadsDrafter(TableHeads(table), offer=lambda tree: offer)
    tree = tree_from_paths(STORED["4"])
    state = DraftState(torch.tensor([1, 2]), torch.zeros(2, 8), [0, 1], [10, 10], 32)
    steps = drafter.propose(state, tree)
    assert steps.chosen is tree and steps.shape is None
    assert steps.nodes_per_row().tolist() == [5, 5]
    kept = [set() for _ in range(2)]
    for b, slot in itertools.product(range(2), range(1, 5)):
        kept[b].add(int(steps.tokens[b, slot]))
    for b in range(2):  # brute force: the 4 best path scores of the offer
        scores = sorted(((path_score(offer, table[b], n), 10 * int(offer.depth[n]) + int(offer.rank[n]))
                         for n in range(1, offer.num_nodes)), reverse=True)
        assert kept[b] == {token for _, token in scores[:4]}
    assert kept[0] == {10, 20, 30, 40} and kept[1] == {10, 11, 12, 20}
    parents = steps.parent[:, 1:5]
    assert bool((parents < torch.arange(1, 5)).all())  # parents first


def test_static_tree_when_the_offer_is_off():
    heads = TableHeads([[[0.9, 0.05, 0.05], [0.9, 0.05], [0.9], [0.9]]])
    tree = tree_from_paths(STORED["4"])
    state = DraftState(torch.tensor([1]), torch.zeros(1, 8), [0], [10], 32)
    steps = HeadsDrafter(heads).propose(state, tree)
    assert steps.shape is tree and steps.chosen is tree


@pytest.mark.parametrize("tree", [2, None])
def test_dynamic_trees_greedy_identity_batched(tree):
    """float64, three padded rows, a 2-node budget drawn from the 8-node stored tree: the output
    is transformers' greedy output token for token; the hit rates saw the verifications."""
    model = tiny_llama(seed=1)
    heads = stored_hydra(model)
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]])
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    decoder = DraftHeadsModel(model, heads, tree=tree, heads_offer_scale=4)
    assert decoder.drafter.offer is not None
    ours = decoder.generate(ids, attention_mask=mask, max_new_tokens=20, pad_token_id=0)
    assert ours.tolist() == reference.tolist()
    hitrate = decoder.drafter.hitrate
    assert hitrate.proposed.sum() > 0  # every dynamic step was observed


def test_offer_is_the_stored_tree_of_scale_times_the_budget():
    model = tiny_llama(seed=1)
    heads = stored_hydra(model)
    offer = DraftHeadsModel(model, heads, tree=2, heads_offer_scale=4).drafter.offer
    assert offer(tree_from_paths(STORED["2"])).num_nodes == 9  # 2 × 4 → the 8-node tree (+ root)
    assert DraftHeadsModel(model, heads, tree=2, heads_offer_scale=2).drafter.offer(
        tree_from_paths(STORED["2"])).num_nodes == 5
    assert offer(tree_from_paths(STORED["8"])).num_nodes == 9  # nothing larger is stored: the largest


@pytest.mark.parametrize("options", [dict(tree=2), dict(tree=2, heads_offer_scale=1),
                                     dict(tree=tree_from_paths(STORED["4"]), heads_offer_scale=4)])
def test_static_by_default_when_asked_or_given_a_tree(options):
    """The default, scale 1, or a tree given as a Tree: every step verifies the policy's tree as it is."""
    model = tiny_llama(seed=1)
    decoder = DraftHeadsModel(model, stored_hydra(model), **options)
    assert decoder.drafter.offer is None
    seen = []
    original = StepTrees.uniform.__func__

    def spy(cls, tree, tokens):
        seen.append(tree)
        return original(cls, tree, tokens)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepTrees, "uniform", classmethod(spy))
        decoder.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8)
    assert seen and decoder.drafter.hitrate.proposed.sum() == 0


def test_heads_without_stored_trees_stay_static():
    model = tiny_llama(seed=1)
    cfg = model.config
    heads = HydraHeads(HeadConfig(family="hydra", num_heads=2, hidden_size=cfg.hidden_size,
                                  vocab_size=cfg.vocab_size)).to(model.dtype)
    heads.bind(model.lm_head.weight, model.get_input_embeddings().weight)
    assert DraftHeadsModel(model, heads, tree=2, heads_offer_scale=4).drafter.offer is None


@pytest.mark.parametrize("value,error,message", [(0, InputError, "heads_offer_scale must be ≥ 1"),
                                                 (2.5, InputTypeError, "heads_offer_scale must be an integer")])
def test_bad_offer_scale(value, error, message):
    model = tiny_llama(seed=1)
    with pytest.raises(error, match=message):
        DraftHeadsModel(model, stored_hydra(model), tree=2, heads_offer_scale=value)


def test_hit_rates_calibrate_the_scores():
    """After the heads' depth-1 drafts were never accepted, their calibrated scores fall below
    their face value: the selection weighs what the heads have been worth."""
    heads = TableHeads([[[0.6, 0.3, 0.1], [0.6, 0.3], [0.6], [0.6]]])
    offer = tree_from_paths(STORED["8"])
    drafter = HeadsDrafter(heads, offer=lambda tree: offer)
    state = DraftState(torch.tensor([1]), torch.zeros(1, 8), [0], [10], 32)
    tree = tree_from_paths(STORED["2"])
    none = torch.zeros(1, dtype=torch.long)
    for _ in range(20):  # every step: nothing accepted (best = the root)
        steps = drafter.propose(state, tree)
        drafter.observe(steps, Acceptance(none, none, torch.zeros(1, steps.max_depth + 1, dtype=torch.long), none),
                        [0])
    scores = drafter.hitrate.rescore(drafter._proposed).score
    depth1 = drafter._proposed.depth == 1
    assert np.all(scores[depth1] < 0.6 * 0.5)
