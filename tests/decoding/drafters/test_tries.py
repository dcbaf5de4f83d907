"""The trie operations over a whole step (decoding/drafters/tries.py): every row of a
:class:`CandidateBatch` gets exactly what it would get alone, counting agrees with a dict-built
trie, the one-sort selection keeps exactly the nodes of the best-first walk from the root, in
its order, and every lookup source's batched proposal equals its rows' own."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from draftheads.decoding.drafters import (BigramTable, CandidateBatch, Candidates, ContextConfig, ContextSource,
                                          HitRate, ModelStore, source_id, StatsConfig, StatsSource, StoreConfig,
                                          StoreSource, count_trie, merge, merge_rows, select, select_rows)
from draftheads.decoding.drafters.heads_drafter import heads_batch
from draftheads.decoding.drafters.tries import count_rows, padded, select_by_heap
from draftheads.decoding.tree import tree_from_paths

from helpers import check_trie, write_store

chains_st = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1, max_size=6)
rows_st = st.lists(st.lists(chains_st, min_size=1, max_size=3), min_size=1, max_size=5)  # rows × sources × chains


def same(a: Candidates, b: Candidates) -> None:
    """Node for node equal: order, parents, tokens, scores, sources, buckets and shares."""
    for name in ("parent", "token", "depth", "score", "source", "bucket", "share"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name


def trie_of(chains, source=source_id("context"), bucket=2, q=0.9) -> Candidates:
    return count_trie(chains, source, bucket, q)


@settings(max_examples=200, deadline=None)
@given(chains_st, st.sampled_from([0.5, 0.9, 1.0]))
def test_count_trie_counts_like_a_dict_trie(chains, q):
    trie = trie_of(chains, q=q)
    check_trie(trie)
    prefixes = Counter(tuple(c[:d]) for c in chains for d in range(1, len(c) + 1))
    assert trie.paths().keys() == prefixes.keys()
    for path, i in trie.paths().items():
        parent_count = len(chains) if len(path) == 1 else prefixes[path[:-1]]
        assert trie.share[i] == prefixes[path] / parent_count
        expect = np.prod([q * prefixes[path[:d]] / (len(chains) if d == 1 else prefixes[path[:d - 1]])
                          for d in range(1, len(path) + 1)])
        assert trie.score[i] == pytest.approx(expect, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(chains_st, st.integers(0, 14))
def test_one_sort_selection_is_the_best_first_walk_node_for_node(chains, budget):
    trie = trie_of(chains)
    same(select(trie, budget), select_by_heap(trie, budget))


@settings(max_examples=200, deadline=None)
@given(rows_st, st.lists(st.integers(0, 12), min_size=5, max_size=5))
def test_every_row_of_a_batch_gets_what_it_gets_alone(rows, budgets):
    """count, select and merge over a batch of rows == the same call on each row by itself."""
    sources = [source_id("context"), source_id("store"), source_id("stats")]
    per_source = [[trie_of(chains_per_source[k], sources[k], 1 + b, 0.8) if k < len(chains_per_source)
                   else Candidates.empty() for b, chains_per_source in enumerate(rows)] for k in range(3)]
    budget = np.array(budgets[: len(rows)])
    batches = [CandidateBatch.from_rows(tries) for tries in per_source]
    for tries, batch in zip(per_source, batches):
        for alone, together in zip(tries, batch.split()):
            same(alone, together)
        for b, (got, unordered) in enumerate(zip(select_rows(batch, budget).split(),
                                                 select_rows(batch, budget, ordered=False).split())):
            same(got, select(tries[b], int(budget[b])))
            check_trie(unordered)  # the same nodes, in some parents-first order
            assert set(unordered.paths()) == set(got.paths())
    for b, got in enumerate(merge_rows(batches, budget).split()):
        same(got, merge([tries[b] for tries in per_source], int(budget[b])))
    # counting the rows' continuations in one call
    chains = [c for chains_per_source in rows for c in chains_per_source[0]]
    owner = [b for b, chains_per_source in enumerate(rows) for _ in chains_per_source[0]]
    block, lengths = padded(chains)
    together = count_rows(block, lengths, owner, len(rows), source_id("context"), np.arange(1, len(rows) + 1),
                          np.full(len(rows), 0.8)).split()
    for b, got in enumerate(together):
        same(got, per_source[0][b])


def test_a_batch_of_hand_made_rows_whose_scores_grow_walks_those_rows():
    grows = Candidates.from_lists([-1, 0, -1], [4, 5, 6], [0.1, 0.9, 0.5], [source_id("context")] * 3, [1] * 3, [1.0] * 3)
    plain = trie_of([[1, 2], [1, 3]])
    kept = select_rows(CandidateBatch.from_rows([grows, plain]), 2).split()
    assert list(kept[0].paths()) == [(6,), (4,)]
    same(kept[1], select(plain, 2))
    with pytest.raises(ValueError, match="budget"):
        merge_rows([CandidateBatch.from_rows([plain])], -1)


def test_rescoring_a_batch_is_rescoring_each_row():
    est = HitRate()
    tries = [trie_of([[1, 2, 3], [1, 2]], source_id("store"), 3, 1.0), Candidates.empty(), trie_of([[4], [5, 6]])]
    for _ in range(5):
        est.observe(0, tries[0], [1, 2, 9])
    for alone, together in zip(tries, est.rescore(CandidateBatch.from_rows(tries)).split()):
        same(est.rescore(alone), together)


def test_the_heads_batch_is_each_rows_trie_of_head_probabilities():
    tree = tree_from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    tokens = torch.tensor([[9, 1, 2, 3, 4, 5], [8, 6, 7, 1, 2, 3]])
    probs = torch.rand(2, 6)
    for b, got in enumerate(heads_batch(tree, tokens, probs).split()):
        want = Candidates.from_heads((tree.parent[1:] - 1).tolist(), tokens[b, 1:].tolist(), probs[b, 1:].tolist())
        for name in ("parent", "token", "depth", "source", "bucket", "share"):
            assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
        assert got.score.tolist() == pytest.approx(want.score.tolist(), rel=1e-12)


def test_each_lookup_source_proposes_for_every_row_what_it_proposes_for_one(tmp_path):
    write_store(tmp_path / "s.safetensors")
    store = ModelStore.open(tmp_path / "s.safetensors")
    histories = [[6, 7], [3, 3], [4], [], [7, 8, 9], [5, 6, 7, 8, 5, 6]]
    cfg = StoreConfig(max_depth=4, eos_token_id=2)
    rows = [StoreSource(store, h, cfg) for h in histories] + [None]
    for budget in (0, 1, 3, 10):
        batch = StoreSource.propose_rows(rows, budget).split()
        assert len(batch[-1]) == 0  # a row that does not ask
        for b, h in enumerate(histories):
            same(batch[b], StoreSource(store, h, cfg).propose(budget))
    table = BigramTable(np.array([1, 2, 3, -1, 0, 6, 7, 2, -1, -1], dtype=np.int32),
                        np.array([0.9, 0.5, 0.8, 0.0, 0.7, 0.6, 0.4, 0.3, 0.0, 0.0], dtype=np.float32))
    stats_cfg = StatsConfig(max_depth=5, min_prob=0.1, eos_token_id=2)
    stats = [StatsSource(table, h, stats_cfg) for h in ([0], [4], [3], [], [5], [9])]
    for got, source in zip(StatsSource.propose_rows(stats, 4).split(), stats):
        tokens, shares = table.chain(source.last, 4, stats_cfg.min_prob, stats_cfg.eos_token_id) if source.last is not None else ([], [])
        assert got.token.tolist() == tokens and got.share.tolist() == pytest.approx(shares)
        assert got.score.tolist() == pytest.approx(np.cumprod(np.asarray(shares) * 0.4).tolist())
    contexts = [ContextSource(p, ContextConfig(max_ngram=2, max_depth=3)) for p in ([3, 4, 5, 3, 4, 6, 3, 4], [1, 2, 1], [])]
    for got, source in zip(ContextSource.propose_rows(contexts, 5).split(), contexts):
        same(got, source.propose(5))
        n, conts = source.continuations(5)
        if conts:  # the best 5 (which of tied nodes: see test_a_sources_cut_keeps_...)
            exact = select(count_trie(conts, source_id("context"), n, 0.35 + 0.1 * n), 5)
            assert sorted(got.score.tolist()) == sorted(exact.score.tolist()) and len(got) == len(exact)


def walk_observe(est: HitRate, row: int, proposed: Candidates, accepted_tokens) -> int:
    """The hit-rate update as a walk over one row's nodes, parents first (the reference)."""
    accepted = np.zeros(len(proposed), dtype=bool)
    hits = 0
    for i in range(len(proposed)):
        p = int(proposed.parent[i])
        if p >= 0 and not accepted[p]:
            continue
        s, b, d = int(proposed.source[i]), int(est.key(proposed.bucket[i])), int(proposed.depth[i])
        est.proposed[s, b] += float(proposed.share[i])
        if d <= len(accepted_tokens) and int(proposed.token[i]) == int(accepted_tokens[d - 1]):
            accepted[i] = True
            est.accepted[s, b] += 1.0
            hits += 1
    est.row_steps[row] = est.row_steps.get(row, 0) + 1
    est.row_accepted[row] = est.row_accepted.get(row, 0) + hits
    return hits


@settings(max_examples=100, deadline=None)
@given(rows_st, st.lists(st.lists(st.integers(0, 3), max_size=4), min_size=5, max_size=5))
def test_observing_a_batch_counts_what_observing_each_row_counts(rows, accepted):
    tries = [merge([trie_of(c, source_id("context") + k, 1 + k, 0.7) for k, c in enumerate(per_source)], 6)
             for per_source in rows]
    accepted = accepted[: len(tries)]
    one, batch = HitRate(), HitRate()
    hits = [walk_observe(one, 10 + b, t, a) for b, (t, a) in enumerate(zip(tries, accepted))]
    assert batch.observe_rows([10 + b for b in range(len(tries))], CandidateBatch.from_rows(tries), accepted).tolist() == hits
    assert np.array_equal(one.proposed, batch.proposed) and np.array_equal(one.accepted, batch.accepted)
    assert one.row_steps == batch.row_steps and one.row_accepted == batch.row_accepted


@settings(max_examples=200, deadline=None)
@given(rows_st, st.integers(0, 12))
def test_a_sources_cut_keeps_as_many_nodes_as_the_best_first_walk_and_as_good(rows, budget):
    """best_nodes (a source's cut before the merge) keeps, per row, a prefix-closed set of
    ``budget`` nodes whose scores are the best-first walk's: only which of several tied nodes
    it keeps may differ (the merge ranks every source's nodes again)."""
    from draftheads.decoding.drafters.tries import best_nodes
    batch = CandidateBatch.from_rows([trie_of(chains_per_source[0]) for chains_per_source in rows])
    for kept, exact, whole in zip(best_nodes(batch, budget).split(), select_rows(batch, budget).split(), batch.split()):
        check_trie(kept)
        if len(whole) <= budget:
            same(kept, whole)
        assert set(kept.paths()) <= set(whole.paths())
        assert sorted(kept.score.tolist()) == sorted(exact.score.tolist())
