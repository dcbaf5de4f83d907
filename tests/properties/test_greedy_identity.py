"""Greedy tree decoding is token-identical to transformers' greedy generate (float64)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import OracleHeads, tiny_llama, trees
from draftheads.decoding import DraftHeadsModel, tree_from_paths

MODELS = {seed: tiny_llama(seed) for seed in range(3)}


def hf_greedy(model, prompt: torch.Tensor, max_new: int, eos) -> torch.Tensor:
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=eos, pad_token_id=0)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2), paths=trees(), prompt_len=st.integers(1, 12), max_new=st.integers(1, 40),
       use_eos=st.booleans(), eos_pick=st.integers(0, 30), error=st.sampled_from([0.0, 0.2, 0.6]),
       data=st.data())
def test_tree_greedy_matches_hf(seed, paths, prompt_len, max_new, use_eos, eos_pick, error, data):
    model = MODELS[seed]
    prompt = torch.tensor([data.draw(st.lists(st.integers(3, 95), min_size=prompt_len, max_size=prompt_len))])
    reference = hf_greedy(model, prompt, max_new, eos=None)
    continuation = reference[0, prompt_len:].tolist()
    # An EOS that really occurs in the greedy continuation (often inside an accepted path).
    eos = continuation[eos_pick % len(continuation)] if use_eos else None
    if eos is not None:
        reference = hf_greedy(model, prompt, max_new, eos=eos)
    heads = OracleHeads([continuation], vocab=96, error=error, seed=seed)
    drafter = DraftHeadsModel(model, heads, tree=tree_from_paths(paths))
    ours = drafter.generate(prompt, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
    assert ours.tolist() == reference.tolist()


def test_deep_paths_are_accepted():
    """With a perfect oracle a chain of 5 is accepted whole: τ = 6 until the end."""
    model = MODELS[0]
    prompt = torch.tensor([[5, 17, 33, 8]])
    reference = hf_greedy(model, prompt, 37, eos=None)
    heads = OracleHeads([reference[0, 4:].tolist()], vocab=96, error=0.0)
    drafter = DraftHeadsModel(model, heads, tree=tree_from_paths([(0,) * k for k in range(1, 6)]))
    ours = drafter.generate(prompt, max_new_tokens=37)
    assert ours.tolist() == reference.tolist()
    assert drafter.last_stats.accepted[:5] == [5] * 5
    assert drafter.last_stats.steps == 6  # 1 (prefill token) + 6 steps × 6 = 37


def test_kv_cache_holds_prompt_plus_accepted():
    model = MODELS[1]
    prompt = torch.tensor([[7, 9, 11]])
    reference = hf_greedy(model, prompt, 20, eos=None)
    heads = OracleHeads([reference[0, 3:].tolist()], vocab=96, error=0.3, seed=3)
    drafter = DraftHeadsModel(model, heads, tree=tree_from_paths([(0,), (1,), (0, 0), (0, 0, 0)]))
    out = drafter.generate(prompt, max_new_tokens=20, return_dict_in_generate=True)
    assert out.sequences.tolist() == reference.tolist()
    # Every emitted token but the last has its KV in the cache, nothing more.
    assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 1


@pytest.mark.parametrize("eos_index,max_new", [(2, 37), (4, 37), (30, 3), (7, 9)])
def test_eos_and_max_new_tokens_inside_an_accepted_path(eos_index, max_new):
    """A perfect 5-chain accepts 6 tokens per step; EOS (or max_new_tokens) falls inside it."""
    model = MODELS[2]
    prompt = torch.tensor([[4, 40, 41, 42, 43]])
    continuation = hf_greedy(model, prompt, 40, eos=None)[0, 5:].tolist()
    eos = continuation[eos_index]
    reference = hf_greedy(model, prompt, max_new, eos=eos)
    heads = OracleHeads([continuation], vocab=96, error=0.0)
    drafter = DraftHeadsModel(model, heads, tree=tree_from_paths([(0,) * k for k in range(1, 6)]))
    ours = drafter.generate(prompt, max_new_tokens=max_new, eos_token_id=eos)
    assert ours.tolist() == reference.tolist()
    assert ours.shape[1] - 5 == min(max_new, continuation.index(eos) + 1)
