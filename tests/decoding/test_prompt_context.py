"""Hydra++ with ``prefix_context="sequence"``: the decoder runs the prefix layer over the whole
prompt at the prefill and keeps its cache over prompt + answer, so what the heads read at each
answer position is what training's forward over the whole sequence computes; decoding stays
the base's own greedy output, left padding included."""
from __future__ import annotations

import pytest
import torch

from helpers import left_pad, random_heads, tiny_llama
from draftheads.decoding import DraftHeadsModel, chain_tree, tree_from_paths
from draftheads.decoding.accept import Acceptance
from draftheads.decoding.base.cache import KVState
from draftheads.decoding.base.forward import forward_all, prefill, verify
from draftheads.decoding.head_state import HeadState

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]]
PROMPTS = [[5, 9, 33, 4], [7, 8, 9, 10, 11, 12, 13], [40, 41]]


def sequence_heads(model, seed: int = 0):
    return random_heads("hydra++", model, seed, extra={"prefix_context": "sequence"})


def right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return ids, mask


def path_tokens(ids: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T) right-padded ids → (B, T, k): x_{t+1}..x_{t+k} at each t (0 past a row's end)."""
    padded = torch.cat([ids * mask, torch.zeros(ids.shape[0], k, dtype=torch.long)], dim=1)
    return torch.stack([padded[:, 1 + j: 1 + j + ids.shape[1]] for j in range(k)], dim=-1)


@pytest.mark.parametrize("chain", [0, 2], ids=["plain", "chains"])
def test_training_forward_equals_what_decoding_feeds_the_heads(chain):
    """Per answer position: the heads' draft logits from training's forward over the whole
    right-padded sequence equal those the decoder computes from ``HeadState.hidden`` after a
    left-padded prefill and verification steps (plain steps, or chains where rows accept
    different numbers of drafts), in float64."""
    model = tiny_llama(0)
    heads = sequence_heads(model)
    generator = torch.Generator().manual_seed(3)
    answers = [torch.randint(3, 96, (12,), generator=generator).tolist() for _ in PROMPTS]
    full_ids, full_mask = right_padded([p + a for p, a in zip(PROMPTS, answers)])
    _, full_hidden = forward_all(model, full_ids, full_mask)  # positions from 0 at the first prompt token
    tokens = path_tokens(full_ids, full_mask, heads.num_heads)
    trained = heads(full_hidden, tokens=tokens, attention_mask=full_mask)  # (B, T, K, V)

    ids, mask = left_pad(PROMPTS)
    cache, states = prefill(model, ids, mask, all_states=True)
    kv = KVState.after_prefill(cache, mask)
    state = HeadState(heads, states[:, -1], states, mask)
    tree = chain_tree(chain)
    done = [0] * len(PROMPTS)  # answer tokens each row has fed the base
    for step in range(12):
        for b, prompt in enumerate(PROMPTS):  # what the heads read after the row's last fed token
            t = len(prompt) - 1 + done[b]
            decoded = heads.path_logits(state.hidden[b: b + 1], tokens[b, t][None])
            assert torch.allclose(decoded[0], trained[b, t], rtol=0, atol=1e-9), (step, b, t)
        if max(done) + chain + 1 > len(answers[0]):
            break
        # each row's tree: the true next tokens, a wrong one after the accepted drafts
        accepted = torch.tensor([(step + b) % (chain + 1) for b in range(len(PROMPTS))])
        tree_tokens = torch.stack([torch.tensor(answers[b][done[b]: done[b] + chain + 1]) for b in range(len(PROMPTS))])
        for b in range(len(PROMPTS)):
            tree_tokens[b, int(accepted[b]) + 1:] = (tree_tokens[b, int(accepted[b]) + 1:] + 1) % 96
        tree_mask, positions, past = kv.tree_inputs(tree.ancestor, tree.depth)
        verified = verify(model, tree_tokens, positions, tree_mask, kv.cache)
        path = torch.arange(chain + 1).expand(len(PROMPTS), -1).clamp(max=accepted[:, None])
        kv.commit(path + past, accepted + 1)
        state.step(verified, tree, Acceptance(accepted, accepted, path, torch.zeros(len(PROMPTS), dtype=torch.long)))
        done = [d + int(a) + 1 for d, a in zip(done, accepted)]
    assert min(done) >= 8


def test_the_sequence_layer_reads_the_prompt_and_the_answer_layer_does_not():
    """Two prompts differing only in their first token: "sequence" heads read different states
    at the last prompt token, "answer" heads (the shipped ones) the same."""
    model = tiny_llama(0)
    ids, mask = left_pad([[5, 9, 33, 4], [6, 9, 33, 4]])
    _, states = prefill(model, ids, mask, all_states=True)
    states = states.clone()
    states[:, -1] = states[0, -1]  # the same last state: only the earlier prompt differs
    sequence = HeadState(sequence_heads(model), states[:, -1], states, mask).hidden
    answer = HeadState(random_heads("hydra++", model), states[:, -1]).hidden
    assert (sequence[0] - sequence[1]).abs().max() > 1e-3
    assert torch.equal(answer[0], answer[1])


def test_sequence_heads_without_the_prompt_states_say_what_they_need():
    model = tiny_llama(0)
    with pytest.raises(ValueError, match=r"read the whole prompt: pass HeadState the prefill's prompt_states") as e:
        HeadState(sequence_heads(model), torch.zeros(2, model.config.hidden_size, dtype=model.dtype))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("prompts", [[[5, 9, 33, 4, 17]], PROMPTS], ids=["bs1", "bs3-left-padded"])
@pytest.mark.parametrize("seed", [0, 1])
def test_sequence_heads_decode_token_identically(prompts, seed):
    model = tiny_llama(seed)
    ids, mask = left_pad(prompts)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    drafter = DraftHeadsModel(model, sequence_heads(model, seed), tree=tree_from_paths(TREE))
    assert drafter.generate(ids, attention_mask=mask, max_new_tokens=30).tolist() == reference.tolist()
    assert not drafter.last_stats.delegated and max(drafter.last_stats.tree_nodes) > 1  # the heads drafted


def test_rows_that_finish_early_leave_the_prefix_layer_cache_too():
    """A row that stops at its end-of-sequence token leaves the batch, its prefix-layer cache rows
    with it; the other rows go on decoding the base's own tokens."""
    model = tiny_llama(2)
    ids, mask = left_pad(PROMPTS)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    eos = int(free[0, ids.shape[1] + 6])  # row 0 stops there; the others later, if at all
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                               eos_token_id=eos)
    drafter = DraftHeadsModel(model, sequence_heads(model, 2), tree=tree_from_paths(TREE))
    output = drafter.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    assert output.tolist() == reference.tolist()
    assert reference.shape[1] > ids.shape[1] + 8 and drafter.last_stats.batch_sizes[-1] < len(PROMPTS)
