"""The one builder of how a model decodes (decoding/builder.py): the policy and the drafter built
whole from a DecodingConfig; ``with_decoding`` for another configuration over the same base and
heads; the memory check priced at the drafter's widest step, not the policy's tree."""
from __future__ import annotations

import pytest
import torch

from helpers import OracleHeads, left_pad, random_heads, tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding import memory
from draftheads.decoding.drafters import HeadsDrafter, MergedDrafter, StoreError
from draftheads.core.errors import InputError

PAD = 0
MODEL = tiny_llama(0)


def repeated_batch():
    """Three rows that repeat a motif: the context lookup proposes long chains."""
    return left_pad([[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [20, 21, 22, 23, 24] * 3])


def oracle_merged(ids, mask, tree_nodes: int = 2) -> tuple[DraftHeadsModel, torch.Tensor]:
    reference = MODEL.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    heads = OracleHeads(reference[:, ids.shape[1]:].tolist(), vocab=96, error=0.3, seed=0)
    paths = [(0,) * d for d in range(1, tree_nodes)]
    return DraftHeadsModel(MODEL, heads, tree=tree_from_paths(paths), sources="heads,context"), reference


def test_a_merged_step_verifies_more_than_the_policys_tree_and_the_check_prices_it(monkeypatch):
    """The merged drafter's lookups join the policy's 2-node tree: real steps verify more slots a
    row than the policy's tree, never more than the drafter declares (max_nodes). With free
    memory between the two estimates, the old pricing (the policy's tree) admits the batch and
    the drafter's widest step refuses it, before any work."""
    ids, mask = repeated_batch()
    model, reference = oracle_merged(ids, mask)
    assert isinstance(model.drafter, MergedDrafter)
    batch, width = ids.shape
    policy_nodes = model.policy.max_nodes(batch, width)
    widest = model.max_nodes(batch, width)
    assert policy_nodes == 2 and widest == min(33, 2 + model.drafter.lookup_nodes)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=PAD)
    assert out.tolist() == reference.tolist()
    slots = model.last_stats.tree_nodes
    assert max(slots) > policy_nodes  # the step a batch really runs is wider than the policy's tree
    assert max(slots) <= widest

    size = MODEL.dtype.itemsize
    old = memory.decode_memory_bytes(MODEL.config, batch, width, 24, policy_nodes, size)["total"]
    new = memory.decode_memory_bytes(MODEL.config, batch, width, 24, widest, size)["total"]
    assert new > old
    free = int((old + new) / 2 / 0.9)  # admits the policy's tree, not the widest step
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: free)
    before = model.last_stats
    with pytest.raises(MemoryError, match="split it into batches"):
        model.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=PAD)
    assert model.last_stats is before  # refused before any work
    heads_alone = model.with_decoding(sources="heads")  # its widest step is the policy's tree: admitted
    assert heads_alone.max_nodes(batch, width) == policy_nodes
    assert heads_alone.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=PAD).tolist() \
        == reference.tolist()


def test_with_decoding_is_a_light_model_over_the_same_base_and_heads():
    ids, mask = repeated_batch()
    model, reference = oracle_merged(ids, mask)
    own = (model.policy, model.drafter, model.sources, model.decoding)
    twin = model.with_decoding(sources="heads", finished_rows="mask")
    assert twin.base is model.base and twin.heads is model.heads and twin.step_costs is model.step_costs
    assert isinstance(twin.drafter, HeadsDrafter) and twin.sources == ("heads",)
    assert twin.decoding.finished_rows == "mask" and twin.decoding.tree is model.decoding.tree
    assert (model.policy, model.drafter, model.sources, model.decoding) == own  # this model is unchanged
    assert twin.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=PAD).tolist() == reference.tolist()
    assert model.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=PAD).tolist() == reference.tolist()


def test_what_decodes_has_one_home():
    """policy, drafter, sources and decoding are read from the built decoding; none is assigned."""
    model = DraftHeadsModel(MODEL, random_heads("hydra", MODEL))
    for name in ("policy", "drafter", "sources", "decoding"):
        with pytest.raises(AttributeError):
            setattr(model, name, None)
    summary = model.drafting_summary()
    assert summary["sources"] == ["heads"] and summary["tree_nodes"] == model.policy.tree.num_nodes
    assert summary["max_nodes_per_row"] == model.policy.tree.num_nodes


def test_with_decoding_refuses_what_the_heads_cannot_serve_and_leaves_the_model():
    model = DraftHeadsModel(MODEL, random_heads("hydra", MODEL))  # 4 heads by default
    own = (model.policy, model.drafter, model.sources, model.decoding)
    deep = tree_from_paths([(0,) * d for d in range(1, model.heads.num_heads + 2)])
    with pytest.raises(InputError) as deep_error:
        model.with_decoding(tree=deep)
    assert "decoding.tree is" in str(deep_error.value) and "\n" not in str(deep_error.value)
    with pytest.raises(StoreError) as store_error:  # these heads ship no lookup store
        model.with_decoding(sources="heads,store")
    assert "lookup_store.safetensors" in str(store_error.value) and "\n" not in str(store_error.value)
    with pytest.raises(InputError, match="packed_linears"):
        model.with_decoding(packed_linears=not model.decoding.packed_linears)
    assert (model.policy, model.drafter, model.sources, model.decoding) == own


def test_a_drafter_of_ones_own_is_checked_where_it_is_given():
    model = DraftHeadsModel(MODEL, None)

    class NoWidth:
        def start(self, prompts): ...
        def propose(self, state, tree): ...
        def observe(self, trees, result, rows): ...

    with pytest.raises(TypeError, match="lacks max_nodes"):
        model.with_decoding(drafter=NoWidth())
