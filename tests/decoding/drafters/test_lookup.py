"""Lookup draft sources (decoding/drafters): suffix matching against brute force, incremental
== rebuilt, the merge's budget / prefix closure / shared prefixes, the store's round trip and
every bad input it must refuse by name."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers import STORE_RECORDS as RECORDS, FakeTokenizer, check_trie, write_store
from draftheads.decoding.drafters import (BigramTable, Candidates, ContextConfig, ContextSource, HitRate, LookupConfig,
                                          LookupSources, ModelStore,
                                          NgramIndex, source_id, StatsSource, StoreConfig, StoreError, StoreHeader,
                                          StoreSource, SuffixAutomaton, build_arrays, count_trie,
                                          merge, save_store, tokenizer_identity)
from draftheads.decoding.drafters.store import FORMAT_VERSION
from draftheads.decoding.drafters.tries import select, select_by_heap

REPO = Path(__file__).resolve().parents[3]
tokens_st = st.lists(st.integers(0, 3), max_size=60)


def brute_matches(tokens: list[int], max_len: int | None) -> tuple[int, list[int]]:
    """Longest m (≤ max_len) with an earlier occurrence of the last m tokens that has a next
    token; its continuation starts, most recent first."""
    n_tok = len(tokens)
    top = n_tok if max_len is None else min(max_len, n_tok)
    for m in range(top, 0, -1):
        suffix = tokens[n_tok - m:]
        starts = [p for p in range(m, n_tok) if tokens[p - m:p] == suffix]
        if starts:
            return m, starts[::-1]
    return 0, []


@settings(max_examples=300, deadline=None)
@given(tokens_st, st.integers(1, 6))
def test_ngram_index_matches_brute_force(tokens, max_ngram):
    assert NgramIndex(max_ngram, tokens).match() == brute_matches(tokens, max_ngram)


@settings(max_examples=300, deadline=None)
@given(tokens_st)
def test_suffix_automaton_finds_the_longest_earlier_match(tokens):
    length, starts = SuffixAutomaton(tokens).match()
    expect_len, expect_starts = brute_matches(tokens, None)
    assert length == expect_len
    assert starts == ([min(expect_starts)] if expect_starts else [])  # its first occurrence


@settings(max_examples=200, deadline=None)
@given(tokens_st, st.lists(st.integers(0, 8), max_size=8))
def test_incremental_equals_rebuilt(tokens, cuts):
    """Appending chunk by chunk gives the very same index and proposals as one build."""
    bounds = sorted({min(c * 8, len(tokens)) for c in cuts} | {0, len(tokens)})
    cfg = ContextConfig(max_ngram=3, max_depth=5, max_occurrences=4)
    grown, grown_sam = ContextSource(tokens[:bounds[0]], cfg), SuffixAutomaton()
    for a, b in zip(bounds, bounds[1:]):
        grown.extend(tokens[a:b])
        grown_sam.extend(tokens[a:b])
    rebuilt = ContextSource(tokens, cfg)
    assert grown.index.table == rebuilt.index.table
    assert grown_sam.match() == SuffixAutomaton(tokens).match()
    one, two = grown.propose(12), rebuilt.propose(12)
    assert one.paths() == two.paths() and np.array_equal(one.score, two.score)


def test_context_branches_follow_the_most_recent_occurrences_and_stop_at_eos():
    prompt = [7, 8, 1, 9, 7, 8, 2, 5, 5, 7, 8]
    trie = ContextSource(prompt, ContextConfig(max_ngram=2, max_depth=3, eos_token_id=5)).propose(10)
    assert set(trie.paths()) == {(1,), (1, 9), (1, 9, 7), (2,), (2, 5)}  # (2, 5) stops at EOS 5
    assert set(trie.bucket.tolist()) == {2} and set(trie.source.tolist()) == {source_id("context")}
    assert np.allclose(trie.share[trie.depth == 1], 0.5)


chains_st = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1, max_size=6)


def as_trie(chains, source):
    return count_trie(chains, source, 2, 0.9)


@settings(max_examples=200, deadline=None)
@given(chains_st, chains_st, st.integers(0, 12))
def test_merge_keeps_budget_prefix_closure_and_shared_prefixes(a_chains, b_chains, budget):
    a, b = as_trie(a_chains, source_id("context")), as_trie(b_chains, source_id("store"))
    merged = merge([a, b], budget)
    check_trie(merged)
    union = {**{p: a.score[i] for p, i in a.paths().items()}}
    for p, i in b.paths().items():
        union[p] = max(union.get(p, -1.0), b.score[i])
    assert len(merged) == min(budget, len(union))
    kept = merged.paths()
    for p, i in kept.items():
        assert merged.score[i] == union[p]  # the max over sources
    # best-first: nothing left out on the frontier scores above the worst kept node
    frontier = [s for p, s in union.items() if p not in kept and (len(p) == 1 or p[:-1] in kept)]
    if kept and frontier:
        assert max(frontier) <= merged.score.min() + 1e-12
    # deterministic and order-independent
    again = merge([b, a], budget)
    assert {p: merged.score[i] for p, i in kept.items()} == {p: again.score[i] for p, i in again.paths().items()}
    assert merge([a, b], budget).token.tolist() == merged.token.tolist()


@settings(max_examples=200, deadline=None)
@given(chains_st, st.integers(0, 12))
def test_select_by_one_sort_keeps_what_the_best_first_walk_keeps(chains, budget):
    """The sort-based selection and the heap walk from the root keep equally good nodes (the
    same scores; which of two equal-score nodes is kept may differ), both prefix-closed."""
    trie = as_trie(chains, source_id("context"))
    by_sort, by_heap = select(trie, budget), select_by_heap(trie, budget)
    check_trie(by_sort)
    assert sorted(by_sort.score.tolist()) == pytest.approx(sorted(by_heap.score.tolist()))


def test_select_walks_a_trie_whose_scores_grow_along_a_path():
    grows = Candidates.from_lists([-1, 0, -1], [4, 5, 6], [0.1, 0.9, 0.5], [source_id("context")] * 3, [1] * 3, [1.0] * 3)
    assert list(select(grows, 2).paths()) == [(6,), (4,)]  # (4, 5) scores 0.9 but needs (4,) first
    assert list(select(grows, 3).paths()) == [(6,), (4,), (4, 5)]


def test_merge_takes_the_winning_source_and_budget_one_keeps_the_best_root_child():
    ctx = count_trie([[4, 5]], source_id("context"), 3, 0.8)
    store = count_trie([[4, 6], [4, 6], [9]], source_id("store"), 2, 0.5)
    merged = merge([store, ctx], 10)
    paths = merged.paths()
    assert merged.source[paths[(4,)]] == source_id("context") and merged.score[paths[(4,)]] == pytest.approx(0.8)
    assert merged.source[paths[(4, 6)]] == source_id("store")
    assert list(merge([store, ctx], 1).paths()) == [(4,)]
    assert len(merge([store, ctx], 0)) == 0
    with pytest.raises(ValueError, match="budget"):
        merge([ctx], -1)


# ---------------------------------------------------------------- store


def brute_store(records, history, n):
    for m in range(min(n, len(history)), 0, -1):
        conts = [r[p:] for r in records for p in range(m, len(r)) if r[p - m:p] == list(history[-m:])]
        if conts:
            return m, conts
    return 0, []


def test_store_round_trip_and_matches(tmp_path):
    ident = write_store(tmp_path / "s.safetensors")
    store = ModelStore.open(tmp_path / "s.safetensors", expect=ident)
    h = store.header
    assert (h.vocab_size, h.vocab_sha256, h.records, h.tokens, h.n) == (10, ident.vocab_sha256, 4, 20, 64 // 4)
    assert not store.keys.flags.owndata and not store.keys.flags.writeable  # mapped, not read into memory
    assert store.tokens.tolist() == [t for r in RECORDS for t in r + [-1]]
    for history in ([7, 8], [0, 6, 7, 8], [9], [3, 3, 3], [4]):
        m, lo, hi = store.match(history)
        expect_m, conts = brute_store(RECORDS, history, h.n)
        assert m == expect_m
        got = sorted(store.tokens[p:p + 3].tolist() for p in store.positions[lo:hi])
        assert [c[:1] for c in sorted(c[:3] for c in conts)] == [g[:1] for g in got]


def test_store_source_proposes_continuations_and_handles_short_histories(tmp_path):
    write_store(tmp_path / "s.safetensors")
    store = ModelStore.open(tmp_path / "s.safetensors")
    row = StoreSource(store, [6, 7], StoreConfig(max_depth=3, eos_token_id=2))
    trie = row.propose(10)
    assert set(trie.paths()) == {(8,), (8, 9), (8, 9, 2), (8, 1), (8, 1, 2)}
    assert trie.bucket.max() == 2
    assert list(row.propose(1).paths()) == [(8,)]
    assert len(row.propose(0)) == 0
    assert len(StoreSource(store, []).propose(8)) == 0  # empty history: nothing, no crash
    assert len(StoreSource(store, [6], StoreConfig(min_match=2)).propose(8)) == 0  # shorter than min_match
    row.extend([8, 9])
    assert row.tail == [6, 7, 8, 9][-store.header.n:]


def test_store_for_another_tokenizer_is_refused(tmp_path):
    write_store(tmp_path / "s.safetensors", salt="x")
    other = tokenizer_identity(FakeTokenizer(10))
    with pytest.raises(StoreError, match=r"s\.safetensors was built for another tokenizer.*draftheads store build"):
        ModelStore.open(tmp_path / "s.safetensors", expect=other)


@pytest.mark.parametrize("damage", ["truncated", "short", "garbage", "missing"])
def test_corrupt_or_truncated_store_is_refused(tmp_path, damage):
    path = tmp_path / "s.safetensors"
    write_store(path)
    blob = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(blob[:-7])
    elif damage == "short":
        path.write_bytes(blob[:5])
    elif damage == "garbage":
        path.write_bytes(blob[:8] + b"\xff" * (len(blob) - 8))
    else:
        path.unlink()
    with pytest.raises(StoreError, match=r"s\.safetensors .*(truncated|corrupt|does not exist).*draftheads store build"):
        ModelStore.open(path)


def test_empty_store_is_refused(tmp_path):
    with pytest.raises(StoreError, match="empty store"):
        write_store(tmp_path / "e.safetensors", records=[[], []])
    assert not (tmp_path / "e.safetensors").exists()
    # a file that claims tokens but holds no keys (written by something else) is refused on open
    ident = tokenizer_identity(FakeTokenizer(10))
    arrays = {"tokens": np.array([-1], np.int32), "keys": np.zeros(0, np.uint64), "positions": np.zeros(0, np.int32),
              "bigram_next": np.full(10, -1, np.int32), "bigram_prob": np.zeros(10, np.float32)}
    save_store(tmp_path / "e.safetensors", arrays,
               StoreHeader(FORMAT_VERSION, 10, ident.vocab_sha256, 16, 4, "2026-11-24", "test", 1, 1))
    with pytest.raises(StoreError, match=r"e\.safetensors is an empty store.*draftheads store build"):
        ModelStore.open(tmp_path / "e.safetensors")


def test_store_too_large_for_memory_is_refused_before_loading(tmp_path):
    write_store(tmp_path / "s.safetensors")
    with pytest.raises(StoreError, match=r"needs .* MiB but only .* available"):
        ModelStore.open(tmp_path / "s.safetensors", memory_limit=100)


def test_tokens_outside_the_vocab_are_refused():
    with pytest.raises(StoreError, match="another tokenizer"):
        build_arrays([[1, 2, 99]], 10)


def test_bigram_table_and_stats_chain(tmp_path):
    write_store(tmp_path / "s.safetensors")
    table = BigramTable.from_store(ModelStore.open(tmp_path / "s.safetensors"))
    pairs = Counter((a, b) for r in RECORDS for a, b in zip(r, r[1:]))
    for t in range(10):
        nexts = {b: c for (a, b), c in pairs.items() if a == t}
        if not nexts:
            assert table.next_token[t] == -1
            continue
        best = min(nexts, key=lambda b: (-nexts[b], b))
        assert table.next_token[t] == best and table.prob[t] == pytest.approx(nexts[best] / sum(nexts.values()))
    trie = StatsSource(table, [5], ).propose(4)
    assert [trie.path(i) for i in range(len(trie))] == [(6,), (6, 7), (6, 7, 8), (6, 7, 8, 9)]
    assert len(StatsSource(table, []).propose(4)) == 0 and len(StatsSource(table, [5]).propose(0)) == 0


def test_hit_rate_learns_and_rescores():
    est = HitRate()
    trie = count_trie([[1, 2, 3]], source_id("store"), 3, 1.0)
    prior = est.q(source_id("store"), 3)
    for _ in range(50):
        assert est.observe(0, trie, [1, 2, 9]) == 2  # two accepted, the third rejected
    q = est.q(source_id("store"), 3)
    assert q == pytest.approx((100 + 8 * prior) / (150 + 8))
    scored = est.rescore(trie)
    assert scored.score.tolist() == pytest.approx([q, q * q, q ** 3])
    assert est.row_accepted == {0: 100} and est.row_steps == {0: 50}
    # an ineligible node (parent rejected) is not counted against its source
    before = est.proposed.copy()
    est.observe(1, trie, [7])
    assert (est.proposed - before).sum() == pytest.approx(1.0)


def test_committed_store_opens_with_its_header():
    path = REPO / "checkpoints" / "smollm2-135m-hydra" / "lookup_store.safetensors"
    store = ModelStore.open(path)
    assert store.header.vocab_size == 49152 and store.header.n == 4 and store.header.tokens == 650104
    m, lo, hi = store.match([28, 284])
    assert m >= 1 and hi > lo


def test_context_budgets_zero_and_one_and_empty_prompt():
    row = ContextSource([3, 4, 5, 3, 4, 6, 3, 4], ContextConfig(max_ngram=2))
    assert len(row.propose(0)) == 0
    best = row.propose(1)
    assert len(best) == 1 and best.depth.tolist() == [1] and best.token[0] in (5, 6)
    assert best.paths() == ContextSource([3, 4, 5, 3, 4, 6, 3, 4], ContextConfig(max_ngram=2)).propose(1).paths()
    assert len(ContextSource([]).propose(8)) == 0 and len(ContextSource([1]).propose(8)) == 0
    with pytest.raises(ValueError, match="max_ngram"):
        NgramIndex(0)
    with pytest.raises(ValueError, match="structure"):
        ContextSource([1], ContextConfig(structure="trie"))


def test_automaton_context_proposes_the_chain_after_the_longest_match():
    prompt = [1, 2, 3, 9, 1, 2, 3, 4, 7, 0, 2, 3, 4]
    trie = ContextSource(prompt, ContextConfig(structure="automaton", max_depth=3)).propose(8)
    assert trie.paths() == {(7,): 0, (7, 0): 1, (7, 0, 2): 2}  # match "2 3 4" (length 3), not "2 3"
    assert trie.bucket.tolist() == [3, 3, 3]


def test_candidates_reject_children_before_parents():
    with pytest.raises(ValueError, match="parents must come first"):
        Candidates.from_lists([1, -1], [5, 6], [0.5, 0.5], [1, 1], [1, 1], [1.0, 1.0])
    with pytest.raises(ValueError, match="one entry per node"):
        Candidates.from_lists([-1], [5, 6], [0.5], [1], [1], [1.0])


def test_lookup_drafter_merges_rows_sources_and_learns(tmp_path):
    from draftheads.decoding.drafters import LookupSources

    write_store(tmp_path / "s.safetensors")
    drafter = LookupSources(ModelStore.open(tmp_path / "s.safetensors"))
    drafter.start(7, [6, 7, 8, 1, 6, 7])
    trie = drafter.propose(7, 6)
    check_trie(trie)
    assert len(trie) == 6 and source_id("context") in set(trie.source.tolist()) and len(set(trie.source.tolist())) >= 2
    assert trie.path(0) == (8,)  # context and store agree on the first token
    before = drafter.hitrate.accepted.sum()
    assert drafter.observe(7, trie, [8, 1]) >= 1 and drafter.hitrate.accepted.sum() > before
    drafter.extend(7, [8, 1, 2])
    assert drafter.rows[7][0].index.tokens[-3:] == [8, 1, 2] and drafter.rows[7][1].tail[-1] == 2
    drafter.drop(7)
    assert 7 not in drafter.rows
    only_context = LookupSources()
    only_context.start(0, [1, 2, 1])
    assert set(only_context.propose(0, 4).source.tolist()) == {source_id("context")}


def test_head_candidates_share_the_scale():
    heads = Candidates.from_heads([-1, 0, -1], [5, 6, 7], [0.6, 0.5, 0.2])
    assert heads.depth.tolist() == [1, 2, 1] and heads.bucket.tolist() == [1, 2, 1]
    assert heads.score.tolist() == pytest.approx([0.6, 0.3, 0.2])
    est = HitRate()
    assert est.rescore(heads).score.tolist() == pytest.approx([0.6, 0.3, 0.2])  # prior: face value
    lookup = count_trie([[5, 9]], source_id("context"), 4, 0.9)
    merged = merge([heads, lookup], 3)
    assert merged.paths().keys() == {(5,), (5, 9), (5, 6)}  # 0.81 and the head's 0.3 beat its 0.2
    assert merged.source[merged.paths()[(5,)]] == source_id("context")


def test_static_sources_that_never_hit_in_a_request_are_muted_for_that_row(tmp_path):
    """A row whose answers never follow the store: after ``mute_after`` steps the store and the
    bigram statistics stop being asked (they propose nothing); the context always is; a new
    request starts afresh."""
    write_store(tmp_path / "s.safetensors")
    store = ModelStore.open(tmp_path / "s.safetensors")
    lookup = LookupSources(store, LookupConfig(mute_after=4), sources=("context", "store", "stats"))
    lookup.start(0, [6, 7])
    lookup.start(1, [6, 7])
    for step in range(4):
        assert lookup.muted(0) == []
        tries = lookup.tries(0, 8)
        assert all(len(t) for t in tries[1:])  # the store and the statistics propose 8 after 7
        lookup.observe(0, merge(tries, 8), [0])  # the base never takes their drafts
        lookup.extend(0, [6, 7])
        hit = lookup.tries(1, 8)
        lookup.observe(1, merge(hit, 8), [8])  # row 1 takes the store's draft
        lookup.extend(1, [8, 6, 7])
    assert lookup.muted(0) == ["store", "stats"] and lookup.muted(1) == []
    context, store_trie, stats_trie = lookup.tries(0, 8)
    assert len(context) and not len(store_trie) and not len(stats_trie)
    lookup.reset()
    lookup.start(0, [6, 7])
    assert lookup.muted(0) == [] and all(len(t) for t in lookup.tries(0, 8)[1:])

