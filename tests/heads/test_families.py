"""Every head family: token identity with the base, tree drafting semantics, checkpoints."""
from __future__ import annotations

import pytest
import torch

from helpers import FAMILIES, random_heads, tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import load_heads

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_family_decodes_token_identically(family, seed):
    model = tiny_llama(seed)
    ids = torch.tensor([[0, 0, 5, 9, 33, 4], [7, 8, 9, 10, 11, 12], [0, 0, 0, 0, 40, 41]])
    mask = (ids != 0).long()
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    drafter = DraftHeadsModel(model, random_heads(family, model, seed), tree=tree_from_paths(TREE))
    assert drafter.generate(ids, attention_mask=mask, max_new_tokens=30).tolist() == reference.tolist()


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "eagle3"])  # EAGLE-3 is one layer, not ResBlocks
def test_multilayer_heads_decode_token_identically(family):
    """KOALA's K-layer heads (``num_layers`` > 1, distinct blocks) keep every family exact."""
    model = tiny_llama(3)
    heads = random_heads(family, model, seed=3, num_layers=3)
    blocks = [m for m in heads.modules() if type(m).__name__ == "ResBlock"]
    assert len({id(b.linear.weight) for b in blocks}) == len(blocks) >= 3 * heads.num_heads
    ids = torch.tensor([[0, 3, 5, 9, 33, 4], [7, 8, 9, 10, 11, 12]])
    mask = (ids != 0).long()
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    drafter = DraftHeadsModel(model, heads, tree=tree_from_paths(TREE))
    assert drafter.generate(ids, attention_mask=mask, max_new_tokens=24).tolist() == reference.tolist()


@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_sequential_heads_condition_each_node_on_its_own_path(draft_vocab):
    """Hydra's tree: a node at depth d holds the rank-r token of head d-1 evaluated on the
    node's own path (root + drafted tokens), exactly as teacher-forced training computes it."""
    model = tiny_llama(0)
    heads = random_heads("hydra", model, draft_vocab=draft_vocab)
    tree = tree_from_paths(TREE)
    hidden = torch.randn(2, model.config.hidden_size, dtype=model.dtype)
    roots = torch.tensor([5, 17])
    tokens = heads.propose(hidden, roots, tree.spec)
    assert tokens[:, 0].tolist() == roots.tolist()
    for node in range(1, tree.num_nodes):
        depth, rank = int(tree.depth[node]), int(tree.rank[node])
        path = tree.path_slots[node, :depth].tolist()  # root .. parent
        prefix = tokens[:, path]
        padded = torch.cat([prefix, torch.zeros(2, heads.num_heads - depth, dtype=torch.long)], dim=1)
        logits = heads(hidden, tokens=padded)[:, depth - 1]
        expected = heads.to_vocab(logits.topk(rank + 1, dim=-1).indices[:, rank])
        assert tokens[:, node].tolist() == expected.tolist(), node
    # A deeper head's distribution depends on the path it extends (unlike Medusa's).
    first = heads(hidden, tokens=torch.tensor([[5, 7, 0], [17, 7, 0]]))[:, 1]
    other = heads(hidden, tokens=torch.tensor([[5, 9, 0], [17, 9, 0]]))[:, 1]
    assert (first - other).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_family_checkpoint_round_trip(tmp_path, family):
    model = tiny_llama(0)
    heads = random_heads(family, model, draft_vocab=40)
    heads.save_pretrained(tmp_path, dtype=None)
    loaded = load_heads(tmp_path, expected_fingerprint=fingerprint(model).to_dict(), dtype=model.dtype)
    loaded.bind(model.lm_head.weight, model.get_input_embeddings().weight)
    hidden = torch.randn(4, model.config.hidden_size, dtype=model.dtype)
    tokens = torch.randint(0, model.config.vocab_size, (4, 3))
    if heads.contextual:  # reads whole sequences
        hidden, tokens = hidden[None], tokens[None]
    assert loaded.family == family
    assert torch.equal(heads(hidden, tokens=tokens), loaded(hidden, tokens=tokens))


def test_hydra_without_path_tokens_says_what_it_needs():
    model = tiny_llama(0)
    heads = random_heads("hydra", model)
    with pytest.raises(ValueError, match="path tokens"):
        heads(torch.randn(2, model.config.hidden_size, dtype=model.dtype))


def test_prefix_layer_cache_matches_a_full_pass():
    """Hydra++'s layer run step by step through a transformers Cache (a tree per step, the
    accepted slot kept) equals one causal pass over the accepted sequence."""
    from transformers import DynamicCache

    from draftheads.decoding.accept import Acceptance
    from draftheads.decoding.head_state import HeadState

    model = tiny_llama(0)
    heads = random_heads("hydra++", model)
    d = model.config.hidden_size
    torch.manual_seed(1)
    sequence = torch.randn(2, 7, d, dtype=model.dtype)  # the hidden states the rows accept
    full = heads.contextualize(sequence, torch.arange(7).expand(2, 7),
                               torch.ones(7, 7, dtype=torch.bool).tril()[None, None].expand(2, 1, 7, 7))
    context = HeadState(heads, sequence[:, 0])
    assert torch.allclose(context.hidden, full[:, 0], atol=1e-10)
    tree = tree_from_paths([[0], [1], [0, 0]])  # slots: root, (0), (1), (0, 0)
    position = [1, 1]
    while min(position) < 6:
        # row 0 accepts (0,0): 2 drafts; row 1 accepts (1): 1 draft; other slots hold noise
        states = torch.randn(2, 4, d, dtype=model.dtype)
        accepted = torch.tensor([min(2, 6 - position[0]), min(1, 6 - position[1])])
        slots = [[0, 1, 3][: int(accepted[0]) + 1], [0, 2][: int(accepted[1]) + 1]]
        for row in range(2):
            for i, slot in enumerate(slots[row]):
                states[row, slot] = sequence[row, position[row] + i]
        best = torch.tensor([slots[0][-1], slots[1][-1]])
        path = torch.stack([torch.tensor(s + [s[-1]] * (3 - len(s))) for s in slots])
        context.step(states, tree, Acceptance(best, accepted, path, torch.zeros(2, dtype=torch.long)))
        for row in range(2):
            position[row] += int(accepted[row]) + 1
            assert torch.allclose(context.hidden[row], full[row, position[row] - 1], atol=1e-10), (row, position)
        if max(position) >= 6:
            break


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_drafting_changes_drafts_not_outputs(family):
    """Heads may read out in bfloat16 (the decoder's default for fp32 bases on CPUs with native
    bf16): drafts are only proposals, so the output stays the base's own."""
    from draftheads.decoding.base.hardware import bf16_native
    from draftheads.decoding.generate import drafting_dtype

    model = tiny_llama(5)
    assert drafting_dtype(model) is None  # float64 bases draft in float64
    assert drafting_dtype(tiny_llama(5, dtype=torch.float32)) == (torch.bfloat16 if bf16_native() else None)
    ids = torch.tensor([[3, 5, 9, 33, 4, 6], [7, 8, 9, 10, 11, 12]])
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    drafter = DraftHeadsModel(model, random_heads(family, model, seed=5), tree=tree_from_paths(TREE))
    drafter.heads.draft_dtype = torch.bfloat16
    hidden = torch.randn(2, model.config.hidden_size, dtype=model.dtype)
    assert drafter.heads.readout(hidden).dtype == torch.bfloat16
    assert drafter.generate(ids, max_new_tokens=24).tolist() == reference.tolist()
