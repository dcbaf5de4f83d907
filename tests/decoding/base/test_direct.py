"""The direct verification forward (decoding/base/direct.py, fused.py): the hidden states and
cache entries of transformers' forward — bit for bit through the modules' own elementwise code,
within one rounding through the fused kernels — for single rows, batches and ragged steps; and
transformers' forward wherever it could differ (hooks, other layers, other attention)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers import ragged_step, tiny_llama
from draftheads.decoding.base.attention import release_packed_sdpa, use_packed_sdpa
from draftheads.decoding.base import direct
from draftheads.decoding.base.direct import direct_body, direct_body_reason, release_direct_body, use_direct_body
from draftheads.decoding.base.forward import verify
from draftheads.decoding.base.fused import ATTENTION_AGREEMENT, FusedOps, sdpa_tree_attention
from draftheads.decoding.base.key_blocks import key_runs
from draftheads.decoding.base.packing import refresh_packing, use_packed_linears


def _case(model, seed: int, bs: int, width: int, ragged: bool = False):
    """A random tree step (:func:`helpers.ragged_step`); valid None where every row is full."""
    tokens, positions, mask, valid, cache = ragged_step(model, seed, bs, width, kv_len=9, ragged=ragged)
    return tokens, positions, mask, valid if ragged and not bool(valid.all()) else None, cache


def _pair(dtype: torch.dtype, ops: FusedOps | None, packed: bool = False, seed: int = 0):
    """(transformers' forward, the direct one) over the same random base."""
    reference = tiny_llama(seed, dtype=dtype)
    use_packed_sdpa(reference)
    direct = copy.deepcopy(reference)
    use_packed_sdpa(direct)
    if packed:
        use_packed_linears(reference)
        use_packed_linears(direct)
    assert use_direct_body(direct, ops) and direct_body(direct) is not None and direct_body(reference) is None
    return reference, direct


def _compare(reference, direct, cases, exact: bool, tolerance: dict | None = None, taps: tuple[int, ...] = ()):
    for tokens, positions, mask, valid, cache in cases:
        theirs_cache, ours_cache = cache(), cache()
        theirs = verify(reference, tokens, positions, mask, theirs_cache, valid, taps)
        ours = verify(direct, tokens, positions, mask, ours_cache, valid, taps)
        pairs = [(ours, theirs)] + [(a.keys, b.keys) for a, b in zip(ours_cache.layers, theirs_cache.layers)] \
            + [(a.values, b.values) for a, b in zip(ours_cache.layers, theirs_cache.layers)]
        for a, b in pairs:
            if exact:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a.float(), b.float(), **tolerance)


#: the layers multi-layer heads read in these tests: the embeddings and the first layer's residual stream
TAPS = (0, 1)


def _cases(model):
    return [_case(model, seed, bs, width, ragged=ragged)
            for seed, (bs, width, ragged) in enumerate([(1, 1, False), (1, 5, False), (1, 17, False), (3, 4, False),
                                                         (4, 6, True), (5, 3, True)])]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_direct_forward_through_the_modules_code_is_transformers_bit_for_bit(dtype):
    """Single rows, plain steps, trees, batches and ragged (packed) steps: the same hidden states
    and cache entries as the body's own forward, in every dtype, with the products packed or not —
    and the layers multi-layer heads read (``taps``) as ``output_hidden_states`` gives them."""
    for packed in (False, True):
        reference, direct = _pair(dtype, FusedOps(), packed)
        _compare(reference, direct, _cases(reference), exact=True)
        _compare(reference, direct, _cases(reference), exact=True, taps=TAPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_kernels_stay_within_one_rounding_of_transformers(ops, dtype):
    reference, direct = _pair(dtype, ops, packed=True)
    tolerance = {"rtol": 2 ** -6, "atol": 2 ** -6} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    _compare(reference, direct, _cases(reference), exact=False, tolerance=tolerance)
    _compare(reference, direct, _cases(reference), exact=False, tolerance=tolerance, taps=TAPS)  # kernels add in place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_kernel_and_the_residual_add_are_exact_on_stacked_views(ops, dtype):
    """On a stacked q/k/v product's views (rows apart by the stacked width) and a batch whose
    positions differ per row: the rotary kernel equals transformers' rotation bit for bit; the
    residual add too, and the norm lands within one rounding."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    reference = FusedOps()
    gen = torch.Generator().manual_seed(3)
    batch, length, dim, heads, kv_heads = 3, 5, 64, 9, 3
    qkv = torch.randn(batch * length, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    for cos_batch in (1, batch):
        cos = torch.randn(cos_batch, length, dim, generator=gen).to(dtype)
        sin = torch.randn(cos_batch, length, dim, generator=gen).to(dtype)
        q, k = qkv[:, :heads * dim].clone(), qkv[:, heads * dim:(heads + kv_heads) * dim].clone()
        theirs = reference.rotary(apply_rotary_pos_emb, q, k, cos, sin, (batch, length, dim))
        stacked = qkv.clone()
        views = stacked.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        ours = ops.rotary(apply_rotary_pos_emb, views[0], views[1], cos, sin, (batch, length, dim))
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    nn.init.normal_(norm.weight, generator=gen)
    hidden, delta = (torch.randn(batch * length, 576, generator=gen).to(dtype) for _ in range(2))
    ours_h, ours = ops.add_rms_norm(hidden.clone(), delta, norm)
    theirs_h, theirs = reference.add_rms_norm(hidden.clone(), delta, norm)
    assert torch.equal(ours_h, theirs_h)
    rounding = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=rounding, atol=rounding)


def _key_runs_case(model, seed: int):
    """A batch of three over a 1,500-slot cache whose last two rows hide their first 1,100 keys (left
    padding): attention runs in two key runs (:mod:`~draftheads.decoding.base.key_blocks`)."""
    tokens, positions, mask, valid, cache = ragged_step(model, seed, 3, 4, kv_len=1500, ragged=False)
    mask = mask.clone()
    mask[1:, :, :, :1100] = False
    assert key_runs(mask) is not None
    return tokens, positions, mask, None, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_attention_is_the_general_path_bit_for_bit(ops, dtype, monkeypatch):
    """One kernel call rotating q/k and writing the cache, then SDPA called directly
    (:class:`~draftheads.decoding.base.direct.StepAttention`), against the general path (the rotary
    kernel, the cache's update, ``packed_gqa_sdpa``): the same hidden states and cache entries bit
    for bit — single rows, batches, plain steps and ragged steps (left to the general path), key
    runs — and it does run where it can."""
    _, model = _pair(dtype, ops, packed=True)
    assert use_direct_body(model, ops, attention="sdpa")
    cases = _cases(model) + [_key_runs_case(model, 7)]
    taken = []
    real = direct.plan_step_attention

    def counted(*args):
        found = real(*args)
        taken.append(found is not None)
        return found
    monkeypatch.setattr(direct, "plan_step_attention", counted)
    ours = [(verify(model, t, p, m, c := cache(), v), c) for t, p, m, v, cache in cases]
    assert taken == [False, True, True, True, False, False, True]  # N = 1 and ragged steps: the general path
    assert use_direct_body(model, ops, attention="general")
    for (states, ours_cache), (t, p, m, v, cache) in zip(ours, cases):
        theirs = verify(model, t, p, m, theirs_cache := cache(), v)
        assert torch.equal(states, theirs)
        for a, b in zip(ours_cache.layers, theirs_cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_attention_kernel_is_attention_within_the_dtypes_rounding(ops, dtype):
    """The tree-attention kernel against float64 attention of the same inputs, as closely as the
    dtype's own SDPA lands: grouped heads, batches, 1-8 query rows, caches of 5-700 keys with room
    past their length, masks hiding keys anywhere (left padding's whole leading blocks included);
    a row that sees no key gets zeros."""
    gen = torch.Generator().manual_seed(5)
    for trial in range(12):
        batch, rows = 1 + trial % 3, 1 + trial % 8
        length = int(torch.randint(5, 700, (1,), generator=gen))
        query = (2 * torch.randn(batch, 9, rows, 64, generator=gen)).to(dtype)
        key = (2 * torch.randn(batch, 3, length + 7, 64, generator=gen)).to(dtype)
        value = torch.randn(batch, 3, length + 7, 64, generator=gen).to(dtype)
        mask = torch.rand(batch, rows, length, generator=gen) > 0.3
        mask[:, :, -1] = True
        mask[-1, :, : length // 2] = False  # a padded row's hidden prefix
        ours = ops.tree_attention(query, key, value, length, mask, 0.125).double()
        exact = sdpa_tree_attention(query.double(), key.double(), value.double(), length, mask, 0.125)
        torch.testing.assert_close(ours, exact, **ATTENTION_AGREEMENT[dtype])
        theirs = sdpa_tree_attention(query, key, value, length, mask, 0.125).double()
        assert (ours - exact).abs().max() <= 1.5 * (theirs - exact).abs().max() + 1e-6  # as close as SDPA
    mask[0, 0] = False
    out = ops.tree_attention(query, key, value, length, mask, 0.125)
    assert not out[0].any() and out[1:].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_through_the_attention_kernel_stays_within_rounding_of_the_general_path(ops, dtype, monkeypatch):
    """The direct forward's default step (rotation, cache write and attention in kernels): the
    first layer's cache entries bit for bit those of the general path (the rest follow attention's
    outputs), the hidden states and later entries within the dtype's rounding."""
    _, model = _pair(dtype, ops, packed=True)
    cases = _cases(model) + [_key_runs_case(model, 7)]
    calls = []
    real = direct.plan_step_attention

    def seen(*args):
        found = real(*args)
        calls.append(found is not None and found.call is not None)  # rotation, store and attention in one call
        return found
    monkeypatch.setattr(direct, "plan_step_attention", seen)
    ours = [(verify(model, t, p, m, c := cache(), v), c) for t, p, m, v, cache in cases]
    assert calls == [True, True, True, True, False, False, True]  # ragged steps: the general path
    assert use_direct_body(model, ops, attention="general")
    tolerance = {"rtol": 2 ** -6, "atol": 2 ** -6} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    for (states, ours_cache), (t, p, m, v, cache) in zip(ours, cases):
        theirs = verify(model, t, p, m, theirs_cache := cache(), v)
        torch.testing.assert_close(states.float(), theirs.float(), **tolerance)
        first, other = ours_cache.layers[0], theirs_cache.layers[0]
        assert torch.equal(first.keys, other.keys) and torch.equal(first.values, other.values)
        for a, b in zip(ours_cache.layers[1:], theirs_cache.layers[1:]):
            torch.testing.assert_close(a.keys.float(), b.keys.float(), **tolerance)
            torch.testing.assert_close(a.values.float(), b.values.float(), **tolerance)


def test_a_hook_registered_after_preparation_is_honoured():
    """A forward hook on any module of the body (steering, activation patching) sends the step
    to transformers' forward, which runs it; removed, the direct forward runs again."""
    reference, direct = _pair(torch.float64, None)
    tokens, positions, mask, valid, cache = _case(reference, 0, 1, 4)
    steer = lambda module, args, output: output + 0.5  # noqa: E731
    handles = [m.mlp.register_forward_hook(steer) for m in (reference.model.layers[0], direct.model.layers[0])]
    assert direct_body(direct) is None
    hooked = verify(direct, tokens, positions, mask, cache())
    assert torch.equal(hooked, verify(reference, tokens, positions, mask, cache()))
    for handle in handles:
        handle.remove()
    assert direct_body(direct) is not None
    plain = verify(direct, tokens, positions, mask, cache())
    assert torch.equal(plain, verify(reference, tokens, positions, mask, cache())) and not torch.equal(plain, hooked)
    pre = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        assert direct_body(direct) is None  # a global hook too
    finally:
        pre.remove()


def test_transformers_own_capturing_hooks_leave_the_direct_forward_on():
    """transformers installs recording hooks on the body's layers at the first forward asked for
    ``output_hidden_states`` (as every prefill for multi-layer heads is): they are not a caller's,
    so the direct forward keeps running; a caller's hook beside them still turns it off."""
    _, direct = _pair(torch.float64, None)
    direct.model(input_ids=torch.tensor([[3, 4, 5]]), output_hidden_states=True)
    assert any(m._forward_hooks for m in direct.model.modules())  # transformers' own, now installed
    assert direct_body(direct) is not None
    handle = direct.model.layers[1].register_forward_hook(lambda module, args, output: None)
    assert direct_body(direct) is None
    handle.remove()


def test_bases_the_direct_forward_does_not_know_run_transformers_forward():
    class Adapter(nn.Linear):  # what peft or a quantizer puts in a projection's place
        pass

    model = tiny_llama(0)
    assert "grouped-query SDPA" in direct_body_reason(model) and not use_direct_body(model)
    use_packed_sdpa(model)
    assert direct_body_reason(model) is None
    layer = model.model.layers[1].self_attn
    adapter = Adapter(layer.q_proj.in_features, layer.q_proj.out_features, bias=False, dtype=torch.float64)
    adapter.weight = layer.q_proj.weight
    layer.q_proj = adapter
    assert "not a plain nn.Linear" in direct_body_reason(model) and not use_direct_body(model)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).eval()
    assert "GPT2Model" in direct_body_reason(gpt2)
    trained = tiny_llama(0)
    use_packed_sdpa(trained)
    use_direct_body(trained)
    trained.train()
    assert direct_body(trained) is None
    assert direct_body(trained.eval()) is not None
    release_packed_sdpa(trained)  # its steps attend as the model does again: transformers' forward
    assert direct_body(trained) is None
    use_packed_sdpa(trained)
    release_direct_body(trained)
    assert direct_body(trained) is None


def test_weights_changed_between_calls_are_followed():
    """A weight written in place between decoding calls (an optimizer step, a LoRA merge through
    ``.data``): after the refresh each call makes, the direct forward multiplies by the new weight
    (its resolved products are remade), as transformers' forward does."""
    reference, direct = _pair(torch.float32, FusedOps(), packed=True)
    tokens, positions, mask, valid, cache = _case(reference, 1, 1, 5)
    _compare(reference, direct, [(tokens, positions, mask, None, cache)], exact=True)
    for model in (reference, direct):
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.data.mul_(-2.0)
        refresh_packing(model)
    _compare(reference, direct, [(tokens, positions, mask, None, cache)], exact=True)


def test_a_module_replaced_after_preparation_is_followed_or_left_to_transformers():
    """An adapter injected into a projection after the base was prepared (peft's LoRA layers
    replace modules) sends the step to transformers' forward, which runs the adapter; a plain
    layer swapped in is picked up by a direct forward made anew."""
    class Lora(nn.Linear):  # a projection plus its own low-rank update
        def forward(self, x):
            return super().forward(x) + 0.25 * x[..., : self.out_features]

    reference, direct = _pair(torch.float64, None)
    case = [_case(reference, 2, 2, 4)]
    _compare(reference, direct, case, exact=True)
    for model in (reference, direct):
        mlp = model.model.layers[0].mlp
        lora = Lora(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False, dtype=torch.float64)
        lora.weight = mlp.down_proj.weight
        mlp.down_proj = lora
    assert direct_body(direct) is None
    _compare(reference, direct, case, exact=True)
    for model in (reference, direct):
        attn = model.model.layers[1].self_attn
        swapped = nn.Linear(attn.o_proj.in_features, attn.o_proj.out_features, bias=False, dtype=torch.float64)
        nn.init.normal_(swapped.weight, generator=torch.Generator().manual_seed(5))
        attn.o_proj = swapped
        model.model.layers[0].mlp.down_proj = nn.Linear(64, 32, bias=False, dtype=torch.float64)
        nn.init.normal_(model.model.layers[0].mlp.down_proj.weight, generator=torch.Generator().manual_seed(6))
    assert direct_body(direct) is not None
    _compare(reference, direct, case, exact=True)


def test_a_whole_decoding_call_is_the_same_with_the_direct_forward_or_without():
    """Greedy decoding end to end (Hydra heads and the context lookup, bs 1 and a left-padded
    batch of 3) gives the same tokens with ``direct_body`` on or off, in float64; the switch is
    checked like every option and belongs to the base's preparation."""
    from helpers import left_pad, random_heads
    from draftheads import DecodingConfig
    from draftheads.core.errors import InputError, InputTypeError
    from draftheads.decoding.calibration import calibration_key
    from draftheads.decoding.generate import DraftHeadsModel

    outputs = {}
    for flag in (True, False):
        base = tiny_llama(3)
        model = DraftHeadsModel(base, random_heads("hydra", base), tree=4, sources="heads,context", direct_body=flag)
        assert (direct_body(base) is not None) == flag
        # a step's measured cost is cached per forward: a calibration timed on the other is measured again
        assert calibration_key(base)["forward"] == ("direct" if flag else "transformers")
        single = model.generate(torch.tensor([[5, 6, 7, 5, 6, 7, 8]]), max_new_tokens=24)
        ids, mask = left_pad([[5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8, 9], [11, 12]])
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=20)
        outputs[flag] = (single, batch)
        with pytest.raises(InputError, match=f"direct_body={not flag}\\): the base was prepared with direct_body={flag}"):
            model.with_decoding(direct_body=not flag)
    assert all(torch.equal(a, b) for a, b in zip(outputs[True], outputs[False]))
    with pytest.raises(InputTypeError, match=r"direct_body='yes': expected True or False\."):
        DecodingConfig(direct_body="yes")
