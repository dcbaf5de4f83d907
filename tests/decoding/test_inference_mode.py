"""The decoder's loop runs under ``torch.inference_mode`` (decoding/generate.py); what it hands the
caller is a normal tensor (decoding/output.py ``released``), and what it keeps across calls —
the heads' gathered LM-head rows, the bound base tensors, cached tree buffers — is made outside
inference mode (core/kept.py), so the caller's in-place writes and a later training step work
as after transformers' own ``generate``."""
from __future__ import annotations

import torch

from helpers import random_heads, tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.output import released
from draftheads.heads.hydra import _levels

TREE = [(0,), (1,), (0, 0), (0, 0, 0)]
PROMPT = torch.tensor([[5, 6, 7, 8]])


def decoder(draft_vocab: int = 0):
    model = tiny_llama(0)
    heads = random_heads("hydra", model, draft_vocab=draft_vocab)
    return model, heads, DraftHeadsModel(model, heads, tree=tree_from_paths(TREE))


def test_the_sequences_are_a_normal_tensor_the_caller_may_write_into():
    _, _, dec = decoder()
    out = dec.generate(PROMPT, max_new_tokens=8)
    assert not out.is_inference()
    out[0, -1] = 3  # an inference tensor refuses this outside inference mode
    assert int(out[0, -1]) == 3


def test_a_returned_cache_and_scores_are_normal_and_the_cache_continues_decoding():
    """bs 1 returns the loop's own cache (reserved layers: their buffers are dropped), bs 2 the
    one of a forward over the output; either continues a plain forward as transformers' would."""
    model, _, dec = decoder()
    for ids, mask in ((PROMPT, None), (torch.tensor([[0, 5, 6, 7], [9, 8, 7, 6]]), torch.tensor([[0, 1, 1, 1], [1] * 4]))):
        out = dec.generate(ids, attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True,
                           output_scores=True)
        assert not out.sequences.is_inference()
        assert all(not s.is_inference() for s in out.scores)
        for layer in out.past_key_values.layers:
            assert not layer.keys.is_inference() and not layer.values.is_inference()
            assert getattr(layer, "_key_buffer", None) is None
        full_mask = torch.ones_like(out.sequences) if mask is None else torch.cat(
            [mask, torch.ones(2, out.sequences.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        nxt = model(input_ids=out.sequences[:, -1:], attention_mask=full_mask, past_key_values=out.past_key_values,
                    use_cache=True).logits[:, -1]
        whole = model(input_ids=out.sequences, attention_mask=full_mask).logits[:, -1]
        rows = [1] if mask is not None else [0]  # the padded row's positions differ by design
        torch.testing.assert_close(nxt[rows], whole[rows], atol=1e-9, rtol=1e-9)


def test_heads_used_under_inference_mode_still_train():
    """A pipeline calls generate under its own inference mode; the heads' caches made during that
    call (draft rows gathered from the LM head, the bound base tensors, Hydra's per-tree levels)
    must still serve a training step after it."""
    model, heads, dec = decoder(draft_vocab=48)
    with torch.inference_mode():
        heads.bind(model.lm_head.weight, model.get_input_embeddings().weight)  # caches emptied, remade inside
        dec.generate(PROMPT, max_new_tokens=8)
    assert not heads.draft_weight().is_inference()
    assert not heads.shared.lm_head_weight.is_inference()
    tree = tree_from_paths(TREE)
    levels = _levels(tuple(tree.parent.tolist()), tuple(tree.depth.tolist()), tuple(tree.rank.tolist()))
    assert not any(t.is_inference() for level in levels for t in level)
    heads.train().requires_grad_(True)
    hidden = torch.randn(3, model.config.hidden_size, dtype=model.dtype, requires_grad=True)
    tokens = torch.randint(3, 96, (3, heads.num_heads))
    heads.path_logits(hidden, tokens).logsumexp(-1).sum().backward()  # saves the draft rows for backward
    assert hidden.grad is not None and any(p.grad is not None for p in heads.parameters())


def test_a_streamer_may_keep_and_change_what_it_is_given():
    kept = []

    class Keeper:
        def put(self, value):
            kept.append(value)

        def end(self):
            pass

    _, _, dec = decoder()
    dec.generate(PROMPT, max_new_tokens=6, streamer=Keeper())
    assert len(kept) >= 2
    for value in kept:
        value.add_(1)  # in place, outside inference mode


def test_released_clones_only_inference_tensors():
    normal = torch.arange(3)
    with torch.inference_mode():
        made = torch.arange(3)
    out = released({"a": (normal, made), "b": [made]})
    assert out["a"][0] is normal
    assert not out["a"][1].is_inference() and not out["b"][0].is_inference()
    assert out["a"][1].tolist() == [0, 1, 2]


def test_a_model_built_and_decoded_under_inference_mode_decodes_as_transformers():
    """A pipeline, or a user, may build the model inside inference mode: its weights are then
    inference tensors (no version counter), and the decoder's first look at a fused product's
    exactness happens inside a forward; neither may fail."""
    from draftheads.decoding.base.packed import tensor_key
    from draftheads.decoding.base.siblings import stacking_exact

    stacking_exact.cache_clear()
    with torch.inference_mode():
        assert all(isinstance(v, bool) for v in stacking_exact(torch.float32, ((16, 8), (16, 8))))
        model = tiny_llama(1, dtype=torch.float32)
        heads = random_heads("hydra", model)
        assert tensor_key(model.lm_head.weight)[3] == 0  # no version to read
        ours = DraftHeadsModel(model, heads, tree=tree_from_paths(TREE)).generate(PROMPT, max_new_tokens=10)
        theirs = model.generate(PROMPT, max_new_tokens=10, do_sample=False)
    assert ours.tolist() == theirs.tolist()
