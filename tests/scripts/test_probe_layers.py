"""scripts/probe_layers.py on a tiny random Llama: the capture picks the layers its docstring
names (index i = decoder layer i's output computed by hand, index L = the final-normed state), the
positions and labels line up with the tokens, and the accuracy and τ functions are right on
hand-made ranks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import load_script, tiny_llama


@pytest.fixture(scope="module")
def probe():
    return load_script("probe_layers")


def by_hand(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """[embeddings, layer 1's output, ..., layer L's output] of a causal forward, layer by layer."""
    inner = model.model
    h = inner.embed_tokens(ids)
    positions = torch.arange(ids.shape[1])[None]
    rotary = inner.rotary_emb(h, position_ids=positions)
    mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf"), dtype=h.dtype).triu(1)[None, None]
    outputs = [h]
    for layer in inner.layers:
        h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        h = h[0] if isinstance(h, tuple) else h
        outputs.append(h)
    return outputs


def test_capture_picks_the_named_layers(probe):
    model = tiny_llama(0)  # 2 layers, float64
    ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    L = model.config.num_hidden_layers
    got = probe.capture_states(model, ids, tuple(range(L + 1)))
    manual = by_hand(model, ids)
    last = model.model(input_ids=ids).last_hidden_state[0]
    assert torch.allclose(got[0], manual[0][0])                       # 0: the embeddings
    for i in range(1, L):
        assert torch.allclose(got[i], manual[i][0], atol=1e-10)       # i: decoder layer i's output
        assert not torch.allclose(got[i], manual[i + 1][0], atol=1e-3)  # not the next one's
    assert torch.allclose(got[L], last, atol=1e-10)                   # L: after the final norm
    assert torch.allclose(got[L], model.model.norm(manual[L])[0], atol=1e-10)
    assert not torch.allclose(got[L], manual[L][0], atol=1e-3)        # not the un-normed residual
    # the LM head on index L gives the model's own logits
    assert torch.allclose(got[L] @ model.lm_head.weight.T, model(ids).logits[0], atol=1e-8)
    with pytest.raises(ValueError):
        probe.capture_states(model, ids, (L + 1,))


def test_answer_positions_line_up():
    probe = load_script("probe_layers")
    tokens = np.array([10, 11, 12, 20, 21, 22, 23, 24])  # prompt of 3, answer of 5
    t, future = probe.answer_positions(tokens, 3, num_heads=2)
    assert t.tolist() == [2, 3, 4, 5]  # the last prompt token .. len − 3
    assert future.tolist() == [[20, 21, 22], [21, 22, 23], [22, 23, 24], [23, 24, -1]]


def test_accuracy_and_tau_on_hand_made_ranks(probe):
    # 3 positions, 2 heads, a draft vocabulary of 4
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0], [5.0, 4.0, 3.0, 2.0]],
                           [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 2.0, 3.0]],
                           [[0.0, 0.0, 9.0, 1.0], [1.0, 2.0, 3.0, 4.0]]])
    lookup = torch.tensor([-2, 0, 1, 2, 3])                       # base id 0 is outside the draft vocabulary
    future = torch.tensor([[2, 1], [1, 0], [3, -1]])              # base ids; −1: past the end
    labels = probe.draft_labels(future, lookup)
    assert labels.tolist() == [[1, 0], [0, -2], [2, -1]]
    ranks = probe.label_ranks(logits, labels, cap=16)
    assert ranks.tolist() == [[0, 0], [0, 16], [0, 16]]
    hits, scored = probe.topk_hits(ranks, labels, ks=(1, 5))
    assert scored.tolist() == [[True, True], [True, True], [True, False]]
    # head 1: 3 of 3; head 2: position 0 hit, position 1's label is undraftable (a miss), position 2 unscored
    assert probe.accuracy(hits[1], scored) == [1.0, 0.5]
    assert probe.accuracy(hits[5], scored) == [1.0, 0.5]
    ranks2 = torch.tensor([[0, 0], [1, 0], [0, 3]])
    assert probe.tree_depths(ranks2, [[0], [0, 0]]).tolist() == [2.0, 0.0, 1.0]
    assert probe.tree_depths(ranks2, [[0], [1], [0, 0], [1, 0]]).tolist() == [2.0, 2.0, 1.0]
    assert probe.accuracy(torch.tensor([[True, False], [False, False]]), torch.ones(2, 2, dtype=torch.bool)) == [0.5, 0.0]


def test_bootstrap_interval_is_centred_and_signed(probe):
    rng = np.random.default_rng(0)
    n = 40
    scored = np.full((n, 4), 50.0)
    base = {"hits1": rng.binomial(50, 0.5, (n, 4)).astype(float), "scored": scored, "chain": rng.random(n) * 50,
            "tree": rng.random(n) * 60, "full": np.full(n, 50.0)}
    better = {**base, "hits1": np.minimum(base["hits1"] + 10, 50.0)}
    d = probe.bootstrap_diff(better, base, 500, 0)
    assert d["mean"]["lo"] > 0 and d["mean"]["lo"] <= d["mean"]["diff"] <= d["mean"]["hi"]
    same = probe.bootstrap_diff(base, base, 200, 0)
    assert same["head1"] == {"diff": 0.0, "lo": 0.0, "hi": 0.0}


def test_probe_starts_as_the_lm_head_on_its_top_layer(probe):
    torch.manual_seed(0)
    d, V = 8, 5
    readout, embed, gain = torch.randn(V, d), torch.randn(11, d), torch.rand(d) + 0.5
    feats = [torch.randn(3, d), torch.randn(3, d)]
    path = torch.tensor([[1, 2, 3, 4]] * 3)
    for hydra in (False, True):
        fused = probe.Probe((2, 30), 30, readout, embed, gain, 1e-6, hydra=hydra)
        assert torch.allclose(fused(feats, path), (feats[1] @ readout.T)[:, None].expand(3, 4, V), atol=1e-6)
        no_final = probe.Probe((2, 27), 30, readout, embed, gain, 1e-6, hydra=hydra)
        normed = feats[1] * torch.rsqrt(feats[1].pow(2).mean(-1, keepdim=True) + 1e-6) * gain
        assert torch.allclose(no_final(feats, path), (normed @ readout.T)[:, None].expand(3, 4, V), atol=1e-5)
