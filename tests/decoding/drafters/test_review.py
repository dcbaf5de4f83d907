"""The vertical cascade: the heads review lookup drafts before they take verification slots.

``DraftHeads.path_probs`` is the probability the heads' own drafting gives each token of a
path; ``review`` folds that probability's bin into each lookup node's hit-rate bucket and
rescores; decoding with the review on stays token-identical to transformers (float64)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import FAMILIES, left_pad, random_heads, tiny_heads, tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.cost import LINEAR_COST
from draftheads.decoding.drafters import (DraftState, MergedDrafter, WidthChooser, build_drafter,
                                         check_review, review)
from draftheads.decoding.drafters import Candidates, ContextConfig, HitRate, LookupConfig, LookupSources
from draftheads.decoding.drafters import source_id
from draftheads.decoding.drafters.candidates import BUCKET_STRIDE
from draftheads.decoding.drafters.hitrate import default_q
from draftheads.decoding.drafters.hitrate import REVIEW_EDGES, reviewed_bucket
from draftheads.decoding.tree import chain_tree

PAD = 0


def contextual_hidden(heads, hidden: torch.Tensor) -> torch.Tensor:
    """What ``propose`` reads: Hydra++ reads its prefix layer's output, the others the hidden state."""
    if not heads.contextual:
        return hidden
    batch = hidden.shape[0]
    ones = torch.ones(batch, 1, 1, 1, dtype=torch.bool)
    extra = {"tokens": torch.full((batch, 1), 7)} if heads.reads_next_tokens else {}  # EAGLE-3: a next token
    return heads.contextualize(hidden[:, None], torch.zeros(batch, 1, dtype=torch.long), ones, **extra)[:, 0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_path_probs_are_the_probabilities_the_heads_draft_with(family, draft_vocab):
    """Along the heads' own greedy chain, path_probs equals propose's per-node probabilities;
    a token outside the draft vocabulary gets 0."""
    model = tiny_llama(1)
    heads = random_heads(family, model, seed=2, draft_vocab=draft_vocab)
    hidden = contextual_hidden(heads, torch.randn(3, model.config.hidden_size, dtype=model.dtype))
    roots = torch.tensor([5, 17, 60])
    chain = chain_tree(heads.num_heads)
    tokens, probs = heads.propose(hidden, roots, chain.spec, with_probs=True)
    reviewed = heads.path_probs(hidden, tokens)
    torch.testing.assert_close(reviewed, probs[:, 1:], rtol=1e-6, atol=1e-9)
    assert heads.path_probs(hidden, tokens[:, :2]).shape == (3, 1)  # shorter paths: the first heads only
    torch.testing.assert_close(heads.path_probs(hidden, tokens[:, :2]), probs[:, 1:2], rtol=1e-6, atol=1e-9)
    if draft_vocab:
        outside = sorted(set(range(model.config.vocab_size)) - set(heads.vocab_ids.tolist()))[0]
        odd = tokens.clone()
        odd[:, 1] = outside
        assert heads.path_probs(hidden, odd)[:, 0].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="at most 3 drafts per path"):
        heads.path_probs(hidden, torch.zeros(3, 5, dtype=torch.long))


def reference_bins(heads, hidden, roots, trie: Candidates, row: int) -> list[int | None]:
    """Node by node (one path_probs call each): the review bin of every node within the heads'
    depth, None deeper."""
    bins = []
    for i in range(len(trie)):
        path = list(trie.path(i))
        if len(path) > heads.num_heads:
            bins.append(None)
            continue
        prob = float(heads.path_probs(hidden[row: row + 1], torch.tensor([[int(roots[row])] + path]))[0, -1])
        bins.append(1 + sum(prob >= edge for edge in REVIEW_EDGES))
    return bins


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(FAMILIES), seed=st.integers(0, 5),
       chains=st.lists(st.lists(st.lists(st.integers(1, 95), min_size=1, max_size=7), max_size=4), min_size=1,
                       max_size=3))
def test_review_rescores_each_lookup_node_by_the_heads_opinion(family, seed, chains):
    """Same nodes in the same order; each node within the heads' depth carries the bin of the
    heads' probability of its token given its own path (checked node by node); its score is
    the hit rate's for that bucket."""
    model = tiny_llama(0)
    heads = random_heads(family, model, seed=seed)
    batch = len(chains)
    hidden = contextual_hidden(heads, torch.randn(batch, model.config.hidden_size, dtype=model.dtype,
                                                  generator=torch.Generator().manual_seed(seed)))
    roots = torch.arange(batch) + 3
    tries = []
    for rows in chains:  # a trie per row from a few continuations (shared prefixes once)
        index, parent, token = {}, [], []
        for seq in rows:
            node = -1
            for t in seq:
                if (node, t) not in index:
                    index[(node, t)] = len(token)
                    parent.append(node)
                    token.append(t)
                node = index[(node, t)]
        n = len(token)
        tries.append(Candidates.from_lists(parent, token, [0.5] * n, [1] * n, [3] * n, [1.0] * n))
    hitrate = HitRate()
    hitrate.accepted[1, hitrate.key(3 + BUCKET_STRIDE * 5)] = 50.0  # the top bin has been accepted often
    hitrate.proposed[1, hitrate.key(3 + BUCKET_STRIDE * 5)] = 50.0
    state = DraftState(roots, hidden, list(range(batch)), [32] * batch, 10)
    out = review(heads, state, tries, hitrate)
    for b, (trie, scored) in enumerate(zip(tries, out)):
        assert scored.token.tolist() == trie.token.tolist() and scored.parent.tolist() == trie.parent.tolist()
        bins = reference_bins(heads, hidden, roots, trie, b)
        assert [int(x) // BUCKET_STRIDE if bin_ is not None else None for x, bin_ in zip(scored.bucket, bins)] == bins
        assert all(int(x) % BUCKET_STRIDE == 3 for x in scored.bucket)
        # each node's score, computed here from the counts set above: Π along its path of
        # min(1, q), q the top bin's smoothed rate (50 accepted of 50) or the prior elsewhere
        k, prior = hitrate.config.strength, default_q(source_id("context"), min(3, hitrate.config.max_bucket))
        expected: list[float] = []
        for i, bin_ in enumerate(bins):
            q = (50.0 + k * prior) / (50.0 + k) if bin_ == 5 else prior
            parent = int(trie.parent[i])
            expected.append(min(1.0, q) * (1.0 if parent < 0 else expected[parent]))
        np.testing.assert_allclose(scored.score, expected, rtol=1e-12)


def reviewed_decoder(model, heads, tree) -> DraftHeadsModel:
    lookup = LookupSources(None, LookupConfig((ContextConfig(),)), sources=("context",))
    return DraftHeadsModel(model, heads, tree=tree).with_decoding(
        drafter=MergedDrafter(heads, lookup, WidthChooser(LINEAR_COST), lookup_nodes=12, review=True))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(FAMILIES), seed=st.integers(0, 1), max_new=st.integers(1, 24),
       motifs=st.lists(st.tuples(st.lists(st.integers(3, 95), min_size=1, max_size=5), st.integers(1, 6)),
                       min_size=1, max_size=4))
def test_reviewed_merged_trees_greedy_matches_hf(family, seed, max_new, motifs):
    model = tiny_llama(seed)
    ids, mask = left_pad([(motif * times)[:40] for motif, times in motifs])
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=PAD)
    decoder = reviewed_decoder(model, random_heads(family, model, seed=seed), tree_from_paths([(0,), (1,), (0, 0)]))
    ours = decoder.generate(ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=PAD)
    assert ours.tolist() == reference.tolist()


def test_hit_rates_learn_what_the_review_is_worth():
    """Review bins are separate hit-rate cells with the match length's prior: acceptances seen
    in one bin raise that bin's calibration only."""
    hitrate = HitRate()
    low, high = 2 + BUCKET_STRIDE * 1, 2 + BUCKET_STRIDE * 5
    assert hitrate.q(1, low) == hitrate.q(1, high) == hitrate.q(1, 2)
    trie = Candidates.from_lists([-1, 0], [7, 8], [0.5, 0.4], [1, 1], [high, low], [1.0, 1.0])
    for _ in range(20):
        hitrate.observe(0, trie, [7])  # the high-bin node is accepted, the low-bin one not
    assert hitrate.q(1, high) > hitrate.q(1, 2) > hitrate.q(1, low)
    assert reviewed_bucket(np.array([2, 2, 2]), np.array([0.0, 0.05, 0.9])).tolist() == [2 + 64, 2 + 3 * 64,
                                                                                      2 + 5 * 64]


def test_review_arguments_are_checked_with_clear_errors():
    check_review(False, ("heads",))
    check_review(True, ("heads", "context"))
    for bad in (0.01, 1, "yes", None):
        with pytest.raises(ValueError, match="expected True"):
            check_review(bad, ("heads", "context"))
    with pytest.raises(ValueError, match="must include 'heads' and at least one of context, store, stats"):
        check_review(True, ("heads",))
    with pytest.raises(ValueError, match="must include 'heads'"):
        check_review(True, ("context",))
    model = tiny_llama(0)
    heads = random_heads("medusa", model)
    drafter = build_drafter(("heads", "context"), heads, review=True)
    assert isinstance(drafter, MergedDrafter) and drafter.review is True
    assert build_drafter(("heads", "context"), heads).review is False
    decoder = DraftHeadsModel(model, heads, tree=tree_from_paths([(0,)]))
    with pytest.raises(ValueError, match="sources must include 'heads' and at least one"):
        decoder.use_sources("heads", review=True)


def test_batched_bench_strategies_and_mixed_batches():
    """--batch-sizes with --sources: HF, the heads-only adaptive policy and the same policy with
    lookups (and the reviewed mix); batches mix categories round-robin."""
    from draftheads.bench import batch_draft_combos, strategy_names
    from draftheads.prompts import round_robin

    assert batch_draft_combos("all") == [("context", "store", "stats"), ("heads", "context", "store", "stats")]
    assert batch_draft_combos("heads,context", True) == [("context",), ("heads", "context"),
                                                         ("heads", "context", "review")]
    assert batch_draft_combos("heads") == []
    assert strategy_names([0, 4], True, ["context", "heads+context"]) == ["hf", "adaptive", "adaptive+context",
                                                                         "adaptive+heads+context"]
    assert strategy_names([0, 4], True) == ["hf", "fixed:0", "fixed:4", "adaptive", "adaptive:mask"]
    records = [{"category": c, "prompt": f"{c}{i}"} for c, n in (("a", 3), ("b", 1), ("c", 2)) for i in range(n)]
    assert [r["prompt"] for r in round_robin(records)] == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert np.array_equal(np.array([len(round_robin([]))]), np.array([0]))


def test_cli_refuses_review_without_heads_and_lookups(tmp_path, capsys):
    """--review needs --sources mixing heads and lookups: one error line before any model loads."""
    import json

    from draftheads.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    for argv in (["bench", "--prompts", str(prompts), "--review", "--base", "/nonexistent"],
                 ["bench", "--prompts", str(prompts), "--review", "--sources", "context", "--base", "/nonexistent"],
                 ["generate", "--prompt", "hi", "--review", "--base", "/nonexistent"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        message = str(exit_info.value.code) + capsys.readouterr().err
        assert "--review: review=True: the heads review lookup drafts, so sources must include 'heads'" in message


def test_batched_bench_runs_lookup_strategies_end_to_end(tmp_path, monkeypatch):
    """``run_batch_bench(..., sources=..., review=True)`` on a tiny float64 model: the heads-only
    adaptive policy and the same policy with lookups, the merged mix (one width, and each row its
    own node count) and the reviewed mix, all
    token-identical to HF's batched greedy output, with their gain over the heads-only policy
    recorded and the figure written."""
    import json

    import draftheads.decoding.calibration as calibration
    import draftheads.prompts as prompts_module
    from draftheads.bench import run_batch_bench

    from draftheads.decoding.cost import CostModel, LatencyTable

    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    # a fixed cost surface (a step of 10 ms, 0.5 ms a query token), not one measured inside the
    # test: a measurement taken beside other jobs can price every draft out, and then no
    # strategy drafts and the test says nothing about the lookups
    surface = CostModel(LatencyTable.from_rows({"bs": b, "q": q, "ctx": c, "ms": 10.0 + 0.5 * b * q}
                                               for b in (1, 2) for q in (1, 2, 4, 8) for c in (8, 64)))
    monkeypatch.setattr(calibration, "calibrate", lambda model, heads, **kw: surface)
    # "prompts" are token ids written as text: repetitive, so the context source finds matches
    monkeypatch.setattr(prompts_module, "chat_input", lambda _tok, text: torch.tensor([[int(t) for t in text.split()]]))
    model = tiny_llama(0, max_pos=128)
    decoder = DraftHeadsModel(model, tiny_heads(), tree=tree_from_paths([(0,)]))
    motifs = [[5, 6, 7], [9, 10, 11, 12], [20, 21], [30, 31, 32, 33, 34]]
    prompts = [{"prompt": " ".join(map(str, (m * 6)[: 12 + i])), "category": f"c{i % 2}"} for i, m in enumerate(motifs)]
    before = (decoder.policy, decoder.drafter, decoder.sources, decoder.decoding)
    payload = run_batch_bench(decoder, prompts, [1, 2], [0, 1, 3], 12, tmp_path / "out", max_batches=2,
                              sources=("heads", "context"), review=True, log=lambda *_: None)
    # each strategy was a light model (with_decoding): the model's own decoding is untouched
    assert (decoder.policy, decoder.drafter, decoder.sources, decoder.decoding) == before
    assert decoder.decoding.finished_rows == "shrink"
    for bs in ("1", "2"):
        strategies = payload["results"][bs]["strategies"]
        assert list(strategies) == ["hf", "adaptive", "adaptive+context", "adaptive+heads+context",
                                    "adaptive+heads+context:per-row", "adaptive+heads+context+review"]
        for name, entry in strategies.items():
            if name != "hf":
                assert entry["mismatching_rows"] == 0, (bs, name, entry["mismatches"])
            if name.startswith("adaptive+"):
                assert entry["vs_adaptive_heads"] > 0 and entry["tau"] > 1.0  # the lookups get accepted
                assert entry["decode_vs_adaptive_heads"] > 0
            # the phases: a prefill that took time, and the decode phase's own rate (tokens after
            # each row's first, over the seconds after the prefill)
            assert 0 < entry["prefill_seconds"] < entry["seconds"], (bs, name)
            rows = int(bs) * payload["results"][bs]["batches"]
            assert entry["decode_tokens_per_second"] == pytest.approx(
                (entry["new_tokens"] - rows) / (entry["seconds"] - entry["prefill_seconds"]), rel=0.05)
    assert (tmp_path / "out" / "throughput.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "results.json").read_text())["results"]["2"]["batches"] == 2
    assert decoder.drafter is before[1]  # the bench leaves the model's own drafter in place
