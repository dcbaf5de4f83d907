"""Heads and lookups in one tree per row: greedy decoding with merged, per-row different trees
is token-identical to transformers' batched greedy generate (float64), including EOS inside a
lookup chain and ``max_new_tokens`` reached mid-chain; the padded per-row tree tensors are
exactly the trees they stand for."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import OracleHeads, left_pad, record_packed_steps, tiny_llama, trees
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.cost import LINEAR_COST, CostModel
from draftheads.decoding.drafters import (DraftState, HeadsDrafter, MergedDrafter, WidthChooser, build_drafter, CandidateBatch, parse_sources)
from draftheads.decoding.drafters.candidates import step_trees
from draftheads.decoding.drafters import Candidates, ContextConfig, LookupConfig, LookupSources
from draftheads.decoding import step_trees as step_trees_module
from draftheads.decoding.step_trees import StepTrees

MODELS = {seed: tiny_llama(seed) for seed in range(2)}
PAD = 0


def repetitive_prompts(draw_lists, gen: torch.Generator) -> list[list[int]]:
    """Prompts that repeat a motif, so context matches (and long lookup chains) happen."""
    out = []
    for motif, times in draw_lists:
        out.append((motif * times)[:40])
    return out


def merged(model, heads, tree, lookup_nodes: int = 12, eos: int | None = None) -> DraftHeadsModel:
    lookup = LookupSources(None, LookupConfig((ContextConfig(eos_token_id=eos),)), sources=("context",))
    return DraftHeadsModel(model, heads, tree=tree).with_decoding(
        drafter=MergedDrafter(heads, lookup, WidthChooser(LINEAR_COST), lookup_nodes=lookup_nodes))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1), paths=trees(max_depth=4, max_nodes=8), max_new=st.integers(1, 24),
       eos_pick=st.integers(0, 60), error=st.sampled_from([0.0, 0.3, 1.0]), with_heads=st.booleans(),
       motifs=st.lists(st.tuples(st.lists(st.integers(3, 95), min_size=1, max_size=5), st.integers(1, 6)),
                       min_size=1, max_size=6), per_row=st.booleans())
def test_merged_per_row_trees_greedy_matches_hf(seed, paths, max_new, eos_pick, error, with_heads, motifs, per_row):
    """``per_row``: each row its own node count under one batch budget (rows given none make a
    plain step inside a tree step), with the padding slots left out of the linear layers and
    the LM head on every step that has any."""
    model = MODELS[seed]
    prompts = repetitive_prompts(motifs, torch.Generator().manual_seed(seed))
    ids, mask = left_pad(prompts)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=PAD)
    continuations = free[:, ids.shape[1]:].tolist()
    flat = [t for row in continuations for t in row]
    eos = flat[eos_pick % len(flat)]  # often inside a repeated (looked-up) stretch: EOS mid-chain
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                               pad_token_id=PAD, eos_token_id=eos)
    heads = OracleHeads(continuations, vocab=96, error=error, seed=seed) if with_heads else None
    decoder = merged(model, heads, tree_from_paths(paths) if with_heads else tree_from_paths([]))
    decoder.drafter.width.per_row = per_row
    threshold, step_trees_module.SKIP_PADDING_SLOTS = step_trees_module.SKIP_PADDING_SLOTS, 1 if per_row else step_trees_module.SKIP_PADDING_SLOTS
    try:
        ours = decoder.generate(ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=PAD, eos_token_id=eos)
    finally:
        step_trees_module.SKIP_PADDING_SLOTS = threshold
    assert ours.tolist() == reference.tolist()


def test_rows_really_verify_different_trees_and_lookups_get_accepted():
    """The case the property test relies on: in one step rows carry different shapes (padding
    slots), lookup chains longer than the heads' tree get accepted, and τ beats the heads alone."""
    model = MODELS[0]
    prompts = [[5, 6, 7, 8] * 6, [9, 10] * 8 + [11], [12, 13, 14, 15, 16, 17, 18]]
    ids, mask = left_pad(prompts)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=PAD)
    heads = OracleHeads(free[:, ids.shape[1]:].tolist(), vocab=96, error=0.5, seed=0)
    tree = tree_from_paths([(0,), (1,), (0, 0)])
    seen: list[StepTrees] = []
    decoder = merged(model, heads, tree)
    propose = decoder.drafter.propose

    def spy(state, tree_):
        proposed = propose(state, tree_)
        seen.append(proposed)
        return proposed

    decoder.drafter.propose = spy
    ours = decoder.generate(ids, attention_mask=mask, max_new_tokens=40, pad_token_id=PAD)
    assert ours.tolist() == free.tolist()
    assert any(d.shape is None and len(set(d.nodes_per_row().tolist())) > 1 for d in seen)
    assert max(d.max_depth for d in seen) > tree.max_depth  # lookups go deeper than the heads
    merged_tau = decoder.last_stats.tau
    heads_only = DraftHeadsModel(model, OracleHeads(free[:, ids.shape[1]:].tolist(), vocab=96, error=0.5, seed=0),
                                 tree=tree)
    assert heads_only.generate(ids, attention_mask=mask, max_new_tokens=40, pad_token_id=PAD).tolist() == free.tolist()
    assert merged_tau > heads_only.last_stats.tau


@settings(max_examples=200, deadline=None)
@given(shapes=st.lists(trees(max_depth=4, max_nodes=10), min_size=1, max_size=5))
def test_padded_step_trees_are_the_trees_they_stand_for(shapes):
    """StepTrees.from_rows(per-row tries) has, row by row, the parents, depths, ancestor mask,
    root→slot paths and children of the tree built from the same paths; padding slots see
    only themselves and are nobody's child."""
    built = [tree_from_paths(p) for p in shapes]
    padded = StepTrees.from_rows(torch.arange(len(built)), [(t.parent[1:] - 1).tolist() for t in built],
                              [list(range(100, 100 + t.num_nodes - 1)) for t in built])
    children = padded.children()
    for b, tree in enumerate(built):
        n = tree.num_nodes
        assert padded.parent[b, :n].tolist() == tree.parent.tolist()
        assert padded.depth[b, :n].tolist() == tree.depth.tolist()
        assert torch.equal(padded.ancestor[b, :n, :n], tree.ancestor)
        assert bool(padded.valid[b, :n].all()) and not bool(padded.valid[b, n:].any())
        for i in range(n):
            chain = tree.path_slots[i, : int(tree.depth[i]) + 1].tolist()
            assert padded.path_slots[b, i, : len(chain)].tolist() == chain
            kids = [k for k in children[b, i].tolist() if k >= 0]
            assert kids == [k for k in range(n) if int(tree.parent[k]) == i]
        for pad in range(n, padded.num_nodes):
            assert padded.ancestor[b, pad].nonzero().flatten().tolist() == [pad]
            assert pad not in children[b].flatten().tolist()


def test_per_row_steps_are_verified_packed_and_stay_identical(monkeypatch):
    """The per-row property test's path, shown to be taken: rows given different node counts are
    verified packed (:class:`~draftheads.decoding.base.attention.RaggedRows`) and the output is still
    transformers' greedy output."""
    model = MODELS[0]
    prompts = [[5, 6, 7, 8] * 6, [9, 10] * 8 + [11], [12, 13, 14, 15, 16, 17, 18], [20, 21] * 5]
    ids, mask = left_pad(prompts)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    heads = OracleHeads(free[:, ids.shape[1]:].tolist(), vocab=96, error=0.5, seed=0)
    decoder = merged(model, heads, tree_from_paths([(0,), (1,), (0, 0)]))
    decoder.drafter.width.per_row = True
    packed = record_packed_steps(monkeypatch)
    monkeypatch.setattr(step_trees_module, "SKIP_PADDING_SLOTS", 1)
    ours = decoder.generate(ids, attention_mask=mask, max_new_tokens=30, pad_token_id=PAD)
    assert ours.tolist() == free.tolist()
    assert packed and any(len(set(rows.sizes)) > 1 for rows in packed)


def test_per_row_sampling_packed_draws_what_the_padded_block_draws(monkeypatch):
    """Sampling over per-row trees (whose losslessness the χ² tests of ``properties/test_sampling.py`` check
    on the padded block) draws the same tokens when the ragged steps are verified packed: same
    seed, same output, the packed path taken."""
    from draftheads.decoding.base import forward

    model = MODELS[1]
    prompts = [[5, 6, 7, 8] * 6, [9, 10] * 8 + [11], [12, 13, 14, 15, 16, 17, 18], [20, 21] * 5]
    ids, mask = left_pad(prompts)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    monkeypatch.setattr(step_trees_module, "SKIP_PADDING_SLOTS", 1)
    packed = record_packed_steps(monkeypatch)
    capable = forward.verifies_ragged

    def sample(ragged: bool) -> list:
        monkeypatch.setattr(forward, "verifies_ragged", capable if ragged else (lambda model, cache: False))
        decoder = merged(model, OracleHeads(free[:, ids.shape[1]:].tolist(), vocab=96, error=0.3, seed=1),
                         tree_from_paths([(0,), (1,), (0, 0)]))
        decoder.drafter.width.per_row = True
        # top_k=0: transformers' default top-k of 50 off; seed 10: draws on which a step is ragged
        return decoder.generate(ids, attention_mask=mask, max_new_tokens=30, pad_token_id=PAD, do_sample=True,
                                temperature=0.8, top_k=0, generator=torch.Generator().manual_seed(10)).tolist()

    padded = sample(False)
    assert not packed
    assert sample(True) == padded
    assert packed


def test_width_chooser_weighs_expected_tokens_against_step_time():
    """Cheap extra nodes with high scores are kept; a step-time table that makes nodes dear cuts them."""
    import numpy as np

    scores = [np.array([0.9, 0.8, 0.7, 0.1, 0.05])]
    assert WidthChooser(CostModel.from_table((1, 33), (10.0, 10.5))).choose(scores, 0) == 6  # nearly free: keep all
    assert WidthChooser(CostModel.from_table((1, 2, 33), (10.0, 30.0, 100.0))).choose(scores, 0) == 1  # dear: plain step
    steep = CostModel.from_ranked([{"nodes": 1, "step_ms": 10}, {"nodes": 4, "step_ms": 12}, {"nodes": 5, "step_ms": 11},
                                   {"nodes": 8, "step_ms": 20}])
    assert steep.step_ms(1, 4, 0) == 11  # lowered to the cheaper larger tree (monotone)
    assert WidthChooser(steep).choose(scores, 0) == 5  # 4 drafts cost what 3 do; the 0.05 node costs 3 ms


def test_cap_depth_keeps_a_prefix_closed_trie():
    trie = Candidates.from_lists([-1, 0, 1, -1, 3], [5, 6, 7, 8, 9], [0.9, 0.8, 0.7, 0.6, 0.5], [1] * 5, [2] * 5,
                                 [1.0] * 5)
    batch = CandidateBatch.from_rows([trie, trie])
    capped = batch.cap_depth([1, 2]).split()
    assert capped[0].token.tolist() == [5, 8] and capped[0].parent.tolist() == [-1, -1]
    assert capped[1].token.tolist() == [5, 6, 8, 9] and capped[1].parent.tolist() == [-1, 0, -1, 2]
    assert batch.cap_depth([3, 3]) is batch


def test_draft_sources_are_checked_with_clear_errors():
    assert parse_sources("heads, context") == ("heads", "context")
    assert parse_sources(["stats", "heads"]) == ("heads", "stats")
    assert parse_sources("all") == ("heads", "context", "store", "stats")
    with pytest.raises(ValueError, match="comma-separated subset of heads, context, store, stats"):
        parse_sources("heads,suffix")
    with pytest.raises(ValueError, match="no head checkpoint was loaded"):
        build_drafter(("heads", "context"), None)
    with pytest.raises(ValueError, match="need a model store: build one with"):
        build_drafter(("context", "store"), None)
    assert isinstance(build_drafter(("heads",), OracleHeads([[1]], vocab=96)), HeadsDrafter)
    drafter = build_drafter(("context",), None)
    assert isinstance(drafter, MergedDrafter) and drafter.heads is None


def test_the_lookup_drafter_is_a_drafter_the_loop_runs():
    """``LookupDrafter`` (the lookup sources alone) implements the whole ``Drafter`` contract:
    the loop drafts with it and the output is HF's greedy batch."""
    from draftheads.decoding.drafters import Drafter, LookupDrafter

    model = MODELS[0]
    ids, mask = left_pad([[5, 6, 7] * 5, [9, 10, 11, 12] * 3])
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    decoder = DraftHeadsModel(model, None).with_decoding(drafter=LookupDrafter(sources=("context",)))
    assert all(callable(getattr(decoder.drafter, name)) for name in Drafter.__dict__ if name in
               ("start", "propose", "observe", "max_nodes"))
    assert decoder.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=PAD).tolist() == reference.tolist()


def test_reach_counts_the_continuation_a_tree_accepts():
    """What the heads bought on a step is counted against what the lookups' own tree would have
    accepted of the base's continuation (reach), not against the heads-sourced nodes."""
    from draftheads.decoding.drafters.worth import reach

    # root → 5 → 6 → 7, and root → 9
    tree = Candidates.from_lists([-1, 0, 1, -1], [5, 6, 7, 9], [0.9, 0.8, 0.7, 0.1], [0] * 4, [0] * 4, [1.0] * 4)
    assert reach(tree, [5, 6, 7, 8]) == 3
    assert reach(tree, [5, 6, 1]) == 2
    assert reach(tree, [9, 5]) == 1
    assert reach(tree, [6]) == 0 and reach(tree, []) == 0
    assert reach(Candidates.empty(), [5]) == 0


def test_finish_weights_value_the_row_that_finishes_last():
    """A batch lasts as long as its slowest row: a row's tokens are worth (its projected finish /
    the last one's)^power, from its pace so far."""
    import numpy as np
    from draftheads.decoding.drafters.width import finish_weights

    assert finish_weights([50, 50], [10, 10]).tolist() == [1.0, 1.0]  # the first steps: all alike
    assert np.allclose(finish_weights([100, 50], [10, 10], power=8), [1.0, 0.5 ** 8])  # less left to go
    assert np.allclose(finish_weights([60, 60], [20, 40], power=8), [1.0, 0.5 ** 8])  # twice the pace
    assert finish_weights([60, 10], [20, 40], power=0).tolist() == [1.0, 1.0]
    assert finish_weights([0, 0], [5, 5]).tolist() == [1.0, 1.0]


def test_per_row_counts_go_to_the_row_the_batch_waits_for():
    """Rows with the same ranked drafts: unweighted they share the budget alike; when three rows
    are far ahead (weight ~0) their drafts are not worth a slot and the row the batch waits for
    takes more than its share (the padding the others leave is skipped, so it costs less)."""
    import numpy as np

    chain = Candidates.from_lists([-1] + list(range(7)), list(range(5, 13)), [0.9 ** (i + 1) for i in range(8)],
                                  [1] * 8, [2] * 8, [1.0] * 8)
    tries = CandidateBatch.from_rows([chain] * 4)
    chooser = WidthChooser(CostModel.from_table((1, 65), (10.0, 10.0 + 64 * 3.0)), per_row=True)
    assert chooser.counts(tries, 0).tolist() == [2, 2, 2, 2]
    assert chooser.counts(tries, 0, np.array([1.0, 1e-3, 1e-3, 1e-3])).tolist() == [6, 0, 0, 0]


def test_per_row_counts_never_price_worse_than_one_width_for_every_row():
    """The per-row search includes one width for every row (every node under a cap), so under the
    cost model its choice yields at least the expected tokens per ms of the width chooser's."""
    import numpy as np
    from draftheads.decoding.step_trees import SKIP_PADDING_SLOTS
    from draftheads.decoding.drafters.width import PADDED_SLOT_SHARE

    rng = np.random.default_rng(0)
    cost = CostModel.from_table((1, 16, 64, 256), (10.0, 12.0, 30.0, 120.0))
    for _ in range(50):
        tries = []
        for _ in range(int(rng.integers(2, 9))):
            n = int(rng.integers(0, 9))
            tries.append(Candidates.from_lists([-1] + list(range(n - 1)) if n else [], list(range(n)),
                                               np.cumprod(rng.uniform(0.2, 1.0, n)).tolist(), [1] * n, [2] * n, [1.0] * n))
        batch = CandidateBatch.from_rows(tries)
        chooser = WidthChooser(cost, per_row=True)
        counts = chooser.counts(batch, 0)
        width = chooser.choose(batch.score_block(9), 0)

        def rate(keep):
            kept = batch.first(keep)
            computed = batch.rows + len(kept)
            widest = 1 + int(kept.sizes().max(initial=0))
            padding = batch.rows * widest - computed
            slots = (computed + PADDED_SLOT_SHARE * padding) / batch.rows if padding >= SKIP_PADDING_SLOTS else widest
            return (batch.rows + kept.score.sum()) / cost.step_ms_many(batch.rows, np.array([slots]), 0)[0]

        assert rate(counts) >= rate(np.full(batch.rows, width - 1)) * (1 - 1e-9)


def test_stats_report_drafting_milliseconds_per_step():
    model = MODELS[0]
    ids, mask = left_pad([[5, 6, 7] * 5, [9, 10, 11, 12] * 3])
    decoder = DraftHeadsModel(model, None).with_decoding(drafter=build_drafter(("context",), None))
    decoder.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=PAD)
    stats = decoder.last_stats
    assert stats.steps > 0 and stats.drafting_seconds > 0
    assert stats.to_dict()["drafting_ms_per_step"] == round(1e3 * stats.drafting_seconds / stats.steps, 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=0, max_size=5),
                min_size=1, max_size=4))
def test_drafts_from_a_candidate_batch_are_the_drafts_from_its_rows(chains_per_row):
    """candidates.step_trees (every row at once) builds the very tensors StepTrees.from_rows builds
    from the same tries row by row: tokens, parents, depths, path slots, valid slots."""
    from draftheads.decoding.drafters import CandidateBatch, Candidates, count_trie, source_id
    tries = [count_trie(chains, source_id("context"), 2, 0.9) if chains else Candidates.empty() for chains in chains_per_row]
    roots = torch.arange(len(tries)) + 100
    batch = CandidateBatch.from_rows(tries)
    got = step_trees(roots, batch)
    want = StepTrees.from_rows(roots, [t.parent.tolist() for t in tries], [t.token.tolist() for t in tries])
    for name in ("tokens", "parent", "depth", "path_slots", "valid"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
