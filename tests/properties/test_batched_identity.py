"""Batched greedy tree decoding (left padding, per-row acceptance, per-row EOS) is
token-identical to transformers' batched greedy generate, float64."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import OracleHeads, left_pad, tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from helpers import trees

MODELS = {seed: tiny_llama(seed) for seed in range(2)}
PAD = 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1), paths=trees(max_depth=4, max_nodes=12), max_new=st.integers(1, 24),
       eos_pick=st.integers(0, 40), error=st.sampled_from([0.0, 0.3]),
       prompts=st.lists(st.lists(st.integers(3, 95), min_size=1, max_size=9), min_size=1, max_size=8))
def test_batched_tree_greedy_matches_hf(seed, paths, max_new, eos_pick, error, prompts):
    model = MODELS[seed]
    ids, mask = left_pad(prompts)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=PAD)
    continuations = free[:, ids.shape[1]:].tolist()
    # EOS taken from one row's continuation: that row (and any row producing it) stops early
    flat = [t for row in continuations for t in row]
    eos = flat[eos_pick % len(flat)]
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                               pad_token_id=PAD, eos_token_id=eos)
    heads = OracleHeads(continuations, vocab=96, error=error, seed=seed)
    drafter = DraftHeadsModel(model, heads, tree=tree_from_paths(paths))
    ours = drafter.generate(ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=PAD, eos_token_id=eos)
    assert ours.tolist() == reference.tolist()


def test_kv_cache_length_is_prompt_plus_accepted_per_row():
    """After every step each row's real cache entries = its prompt + its accepted tokens."""
    model = MODELS[0]
    ids, mask = left_pad([[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]])
    free = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    heads = OracleHeads(free[:, ids.shape[1]:].tolist(), vocab=96, error=0.3, seed=1)
    drafter = DraftHeadsModel(model, heads, tree=tree_from_paths([(0,), (1,), (0, 0), (0, 0, 0)]))
    seen = []
    commit = __import__("draftheads.decoding.base.cache", fromlist=["KVState"]).KVState.commit

    def spy(self, slots, count):
        commit(self, slots, count)
        seen.append((self.valid.sum(1).tolist(), self.next_pos.tolist(), self.length_with_tree()))

    from unittest import mock
    with mock.patch("draftheads.decoding.base.cache.KVState.commit", spy):
        out = drafter.generate(ids, attention_mask=mask, max_new_tokens=30, pad_token_id=PAD)
    assert out.tolist() == free.tolist()
    prompt_lengths = mask.sum(1).tolist()
    accepted_so_far = [0, 0, 0]
    stats = drafter.last_stats
    full_steps = 0
    for step, (valid, next_pos, length) in enumerate(seen):
        assert valid == next_pos  # real cache entries = positions used = prompt + accepted
        if len(valid) < 3:
            break  # a row finished and left the batch
        per_row = stats.accepted[3 * step: 3 * step + 3]
        accepted_so_far = [a + k + 1 for a, k in zip(accepted_so_far, per_row)]
        assert valid == [p + a for p, a in zip(prompt_lengths, accepted_so_far)]
        # no growth: the dense cache is as wide as the longest row (left padding included)
        assert length == max(ids.shape[1] - p + v for p, v in zip(prompt_lengths, valid))
        full_steps += 1
    assert full_steps >= 3
    assert max(stats.tree_nodes) == 5
