"""EAGLE-3 heads: what decoding drafts is what training-time test trains — the layer's context kept
across steps (prompt, accepted slots) and each tree node's path give the logits the training
forward gives on the same sequence — and decoding with them is the base's own."""
from __future__ import annotations

import pytest
import torch

from helpers import random_heads, tiny_llama, varied_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.tree import chain_tree
from draftheads.decoding.base.forward import tapped_layers
from draftheads.decoding.accept import Acceptance
from draftheads.decoding.head_state import HeadState, over_prompt
from draftheads.decoding.step_trees import StepTrees
from draftheads.heads import HeadConfig, build_heads
from draftheads.heads.eagle3 import DraftContext, eagle3_layers

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]]


def features(model, ids: torch.Tensor, layers) -> torch.Tensor:
    """The base's features at every position of ids (1, T): final state, then ``layers``'."""
    out = model.model(input_ids=ids, output_hidden_states=True)
    return torch.cat([out.last_hidden_state, tapped_layers(out.hidden_states, layers)], dim=-1)


def trained_logits(heads, feats: torch.Tensor, sequence: torch.Tensor, last_row: list[int]) -> torch.Tensor:
    """The training forward's logits (K, V) at the last position of ``feats`` (1, T, F): every
    position t reads x_{t+1} from ``sequence`` (1, T+1); the last one the tokens ``last_row``."""
    length, k = feats.shape[1], heads.num_heads
    tokens = torch.zeros(1, length, k, dtype=torch.long)
    tokens[0, :, 0] = sequence[0, 1:length + 1]
    tokens[0, -1, :len(last_row)] = torch.tensor(last_row)
    return heads(feats, tokens=tokens)[0, -1]


def test_default_layers_are_eagle3s():
    assert eagle3_layers(30) == [2, 15, 27] and eagle3_layers(32) == [2, 16, 29]
    assert eagle3_layers(2) == [1] and eagle3_layers(4) == [1, 2]
    with pytest.raises(ValueError, match="EAGLE-3 heads read base layers: set feature_layers"):
        build_heads(HeadConfig(family="eagle3", hidden_size=32, vocab_size=96))


@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_every_tree_node_is_what_training_time_test_predicts(draft_vocab):
    """Over a context of prompt pairs, a node at depth d holds the rank-r token of training's step
    d-1 evaluated on the node's own path: the layer's cache, positions and tree mask in decoding
    equal the training-time test's attention."""
    model = tiny_llama(0)
    heads = random_heads("eagle3", model, draft_vocab=draft_vocab)
    torch.manual_seed(3)
    sequence = torch.randint(3, 96, (1, 9))  # prompt x_0..x_7, root x_8
    length = sequence.shape[1] - 1
    feats = features(model, sequence[:, :length], heads.feature_layers)
    kv, hidden = over_prompt(heads, heads.read(feats), torch.ones(1, length, dtype=torch.long), sequence[:, 1:])
    layer = kv.cache.layers[0]
    context = DraftContext(layer.keys, layer.values, kv.valid, kv.next_pos)
    tree = tree_from_paths(TREE)
    roots = sequence[:, -1]
    tokens, probs = heads.propose(hidden, roots, tree.spec, with_probs=True, context=context)
    assert torch.allclose(heads.logits(hidden)[0], trained_logits(heads, feats, sequence, [])[0], atol=1e-10)
    for node in range(1, tree.num_nodes):
        depth, rank = int(tree.depth[node]), int(tree.rank[node])
        path = tokens[0, tree.path_slots[node, :depth]].tolist()  # root .. parent
        logits = trained_logits(heads, feats, sequence, path)[depth - 1]
        assert tokens[0, node].item() == heads.to_vocab(logits.topk(rank + 1).indices[rank]).item(), node
        expected = logits.softmax(-1).topk(rank + 1).values[rank].float()
        assert torch.allclose(probs[0, node], expected, rtol=1e-5), node  # the same distribution, not only its order
    # reviewing a path (the lookups' drafts) reads the same context: its probabilities are propose's
    chain = chain_tree(heads.num_heads)
    drafted, chained = heads.propose(hidden, roots, chain.spec, with_probs=True, context=context)
    torch.testing.assert_close(heads.path_probs(hidden, drafted, context), chained[:, 1:], rtol=1e-6, atol=1e-9)
    # the context matters: without it the same tree drafts from the draft's own pairs only
    alone = heads.propose(hidden, roots, tree.spec)
    assert not torch.equal(alone, tokens)


def test_decoding_keeps_the_layers_context_as_training_reads_it():
    """At every step of a real decode (trees, acceptance, the cache compacted), the heads' input is
    the layer's output at the last accepted pair as a training forward over the sequence so far
    computes it, and every row's decode is the base's own."""
    model = varied_llama()  # answers that vary: each pair's next token differs from its own
    heads = random_heads("eagle3", model, seed=4)
    seen = []
    propose = heads.propose

    def recording(hidden, roots, tree, with_probs=False, context=None):
        seen.append((hidden.clone(), int(context.next_pos[0])))
        return propose(hidden, roots, tree, with_probs=with_probs, context=context)

    heads.propose = recording
    ids = torch.tensor([[7, 8, 9, 10, 11, 12]])
    reference = model.generate(ids, max_new_tokens=20, do_sample=False)
    out = DraftHeadsModel(model, heads, tree=tree_from_paths(TREE)).generate(ids, max_new_tokens=20)
    assert out.tolist() == reference.tolist()
    assert len(seen) >= 3 and len(set(out[0, 6:].tolist())) > 3
    for hidden, next_pos in seen:
        sequence = out[:, :next_pos + 1]  # the root at next_pos
        feats = features(model, sequence[:, :next_pos], heads.feature_layers)
        expected = trained_logits(heads, feats, sequence, [])[0]
        assert torch.allclose(heads.logits(hidden)[0], expected, atol=1e-9), next_pos


def test_training_time_test_feeds_each_step_its_own_output():
    """Step k's logits depend on the tokens the chain fed steps 1..k and on the draft's own earlier
    outputs, not on later positions (causal), and a padded row's valid positions read as unpadded."""
    model = tiny_llama(1)
    heads = random_heads("eagle3", model, seed=1)
    torch.manual_seed(0)
    feats = torch.randn(2, 6, heads.config.hidden_size * (1 + len(heads.feature_layers)), dtype=model.dtype)
    tokens = torch.randint(3, 96, (2, 6, heads.num_heads))
    base = heads(feats, tokens=tokens)
    changed = tokens.clone()
    changed[:, 3, 1] = (changed[:, 3, 1] + 1) % 96  # step 1's token at position 3
    other = heads(feats, tokens=changed)
    assert torch.equal(other[:, :, 0], base[:, :, 0])  # step 0 never reads it
    assert torch.equal(other[:, :3], base[:, :3])  # earlier positions never read it
    assert not torch.allclose(other[:, 3, 1:], base[:, 3, 1:])  # steps 1.. at position 3 do
    assert torch.allclose(other[:, 4:, 1:], base[:, 4:, 1:], atol=1e-12)  # later chains see step 0's keys only
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0  # row 1: four real positions, left-aligned
    padded = heads(feats, tokens=tokens, attention_mask=mask)
    alone = heads(feats[1:, :4], tokens=tokens[1:, :4])
    assert torch.allclose(padded[1, :4], alone[0], atol=1e-10)


def test_eagle3_heads_decode_batches_and_sampling_as_the_base():
    model = tiny_llama(2)
    heads = random_heads("eagle3", model, seed=2, draft_vocab=40)
    ids = torch.tensor([[0, 0, 5, 9, 33, 4], [7, 8, 9, 10, 11, 12], [0, 0, 0, 0, 40, 41]])
    mask = (ids != 0).long()
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    drafter = DraftHeadsModel(model, heads, tree=tree_from_paths(TREE))
    assert drafter.generate(ids, attention_mask=mask, max_new_tokens=24).tolist() == reference.tolist()


def test_accepted_slots_enter_the_context_with_the_token_after_each():
    """After a step that accepts several drafts, the heads' input is the layer's output at the last
    accepted slot paired with the bonus token, over a context of every accepted pair — as a training
    forward over the sequence computes it; the other slots leave no trace."""
    model = varied_llama()
    heads = random_heads("eagle3", model, seed=6)
    torch.manual_seed(6)
    sequence = torch.randint(3, 96, (1, 16))
    feats = features(model, sequence, heads.feature_layers)  # (1, 16, F)
    start = 5  # the prompt x_0..x_4, the root x_5
    state = HeadState(heads, feats[:, start - 1], feats[:, :start], torch.ones(1, start, dtype=torch.long),
                      sequence[:, :start], sequence[:, start])
    tree = tree_from_paths([[0], [1], [0, 0], [0, 0, 0]])  # slots: root, (0), (1), (0,0), (0,0,0)
    position = start
    for accepted in (2, 0, 3, 1):
        chain = [0, 1, 3, 4][:accepted + 1]  # the accepted slots, root first
        tokens = torch.randint(3, 96, (1, 5))
        states = torch.randn(1, 5, feats.shape[-1], dtype=model.dtype)  # off the path: noise
        for i, slot in enumerate(chain):
            tokens[0, slot], states[0, slot] = sequence[0, position + i], feats[0, position + i]
        path = torch.tensor([chain + [chain[-1]] * (4 - len(chain))])
        bonus = sequence[:, position + accepted + 1]
        state.step(states, StepTrees.uniform(tree, tokens), Acceptance(torch.tensor([chain[-1]]), torch.tensor([accepted]), path, bonus))
        position += accepted + 1
        expected = trained_logits(heads, feats[:, :position], sequence[:, :position + 1], [])[0]
        assert torch.allclose(heads.logits(state.hidden)[0], expected, atol=1e-9), accepted
