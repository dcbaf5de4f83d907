"""A tree step's body in one library call (decoding/base/body_call.py, body.c): the hidden states,
cache entries and tapped layers of the layer-by-layer direct forward bit for bit — products through
the few-row kernel's copies, stacked siblings and GGUF blocks; single rows, batches, key runs — and the
layer-by-layer path wherever a piece has no kernel. The SiLU gate kernel lands within a rounding of
torch's two operations."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import force_plan, gguf_base, ragged_step, tiny_llama
from draftheads.decoding.base import direct, fewrow, plan as plan_module, siblings
from draftheads.decoding.base.attention import use_packed_sdpa
from draftheads.decoding.base.blocks import blocks_available
from draftheads.decoding.base.direct import direct_body, use_direct_body
from draftheads.decoding.base.forward import verify
from draftheads.decoding.base.fused import FusedOps
from draftheads.decoding.base.packing import use_packed_linears

#: the layers multi-layer heads read: the embeddings and two layers' residual streams
TAPS = (0, 1, 2)


def _native(dtype: torch.dtype) -> None:
    if dtype not in fewrow.kernel_dtypes():
        pytest.skip("no native bfloat16 here (the bfloat16 products need AVX512-BF16, torch not limited below it)")


def _model(variant: str, dtype: torch.dtype, monkeypatch, tmp_path):
    """A tiny base whose every product runs through the library: the few-row kernel's copies
    (``fewrow``), q/k/v and gate/up stacked into one product each (``stacked``), or GGUF blocks
    (``blocks``)."""
    if variant == "blocks" and not blocks_available("q4_1", dtype):
        pytest.skip(f"the block products are off here ({fewrow.kernel_status()})")
    model = gguf_base(tmp_path, dtype=dtype) if variant == "blocks" else tiny_llama(3, dtype=dtype)
    if variant == "stacked":  # float32 stacks too here: the few-row kernel's columns do not depend on the width
        monkeypatch.setattr(siblings, "STACKED_DTYPES", (dtype,))
    force_plan(model, monkeypatch)
    use_packed_sdpa(model)
    use_packed_linears(model)
    return model


def _cases(model):
    """Every row full (the one call runs only there): single rows of 1-17 slots, batches, key runs."""
    cases = [ragged_step(model, seed, bs, width, kv_len=9, ragged=False)
             for seed, (bs, width) in enumerate([(1, 1), (1, 2), (1, 5), (1, 17), (3, 4), (2, 1)])]
    tokens, positions, mask, valid, cache = ragged_step(model, 9, 3, 4, kv_len=40, ragged=False)
    mask = mask.clone()
    mask[1:, :, :, :32] = False  # left padding: two key runs
    return cases + [(tokens, positions, mask, valid, cache)]


def _run(model, ops, one_call: bool, cases, taps):
    assert use_direct_body(model, ops, one_call=one_call)
    outs = []
    for tokens, positions, mask, _, cache in cases:
        filled = cache()
        outs.append((verify(model, tokens, positions, mask, filled, None, taps), filled))
    return outs


@pytest.mark.parametrize("variant", ["fewrow", "stacked", "blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_body_in_one_call_is_the_layer_by_layer_path_bit_for_bit(ops, dtype, variant, monkeypatch, tmp_path):
    _native(dtype)
    model = _model(variant, dtype, monkeypatch, tmp_path)
    calls = []
    real = direct.run_body
    monkeypatch.setattr(direct, "run_body", lambda *args: calls.append(args[1].table.clone()) or real(*args))
    cases = _cases(model)
    for taps in ((), TAPS):
        ours = _run(model, ops, True, cases, taps)
        theirs = _run(model, ops, False, cases, taps)
        for (states, ours_cache), (other, theirs_cache) in zip(ours, theirs):
            assert torch.equal(states, other)
            for a, b in zip(ours_cache.layers, theirs_cache.layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert len(calls) == 2 * len(cases), "the one call did not run"
    kinds = {int(k) for table in calls for k in table[:, 0:21:3].flatten()}
    expected = {"fewrow": {0}, "stacked": {0, -1}, "blocks": {1}}[variant]
    assert kinds == expected


def test_a_product_off_the_kernels_leaves_the_step_layer_by_layer(ops, monkeypatch, tmp_path):
    """The down projection through oneDNN's packed path (or ``F.linear``): no one call, the same
    states as the layer-by-layer path."""
    model = _model("fewrow", torch.float32, monkeypatch, tmp_path)
    down = model.model.layers[1].mlp.down_proj.weight
    n = len(plan_module.ROW_BUCKETS)
    plan_module.PLAN.add(plan_module.shape_key(down.dtype, *down.shape),
                         {"linear_ms": [1.0] * n, "packed_ms": [9.0] * n, "fewrow_ms": [9.0] * n})
    calls = []
    monkeypatch.setattr(direct, "run_body", lambda *args: calls.append(1))
    cases = _cases(model)
    ours = _run(model, ops, True, cases, ())
    tables = direct_body(model).tables
    assert tables and all(table is None for table in tables.values()) and not calls
    theirs = _run(model, ops, False, cases, ())
    for (states, _), (other, _) in zip(ours, theirs):
        assert torch.equal(states, other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gate_kernel_is_torchs_silu_gate_within_a_rounding(ops, dtype):
    """silu(gate)·up in one call against torch's two operations: strided halves of one product and
    separate tensors, widths with a partial last 8, values out to where exp saturates."""
    gen = torch.Generator().manual_seed(11)
    mlp = nn.Module()
    mlp.act_fn = nn.SiLU()
    reference = FusedOps()
    for rows, width in ((1, 8), (2, 1536), (5, 61), (130, 300)):
        stacked = (6 * torch.randn(rows, 2 * width, generator=gen)).to(dtype)
        stacked[0, :4] = torch.tensor([-100.0, 100.0, -88.5, 0.0]).to(dtype)[: min(4, width)]
        for gate, up in ((stacked[:, :width], stacked[:, width:]), (stacked[:, :width].clone(), stacked[:, width:].clone())):
            ours, theirs = ops.gated(mlp, gate, up), reference.gated(mlp, gate, up)
            rounding = 2 ** -7 if dtype == torch.bfloat16 else 2e-6
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=rounding, atol=1e-30)
            assert ours.dtype == dtype and ours.shape == (rows, width)
