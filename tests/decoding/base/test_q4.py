"""Float32 products through Q4_1 blocks (decoding/base/q4.py, gguf_blocks.py): the kernel computes the
float32 kernel's sums bit for bit; a GGUF's Q4_1 rows read as gguf dequantizes them; a base converted
from such a GGUF gets its blocks only where they are its weights exactly (rows matched by content,
permuted as transformers permutes q/k), decodes through them as its own ``generate``, and loses them
when a weight changes or the GGUF does not read."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from draftheads.decoding.base import fewrow, packed, packing, plan as plan_module, siblings
from draftheads.decoding.base.architecture import decoder_body
from draftheads.decoding.base.binding import binding
from draftheads.decoding.base.gguf_blocks import attach_gguf_blocks, q4_1_parts
from draftheads.decoding.base.loading import SOURCE_RECORD
from draftheads.decoding.base.plan import ROW_BUCKETS, PackingPlan, fastest_paths, shape_key, valid_timings
from draftheads.decoding.base.q4 import q4_available, q4_blocks, q4_dequantized, q4_product, random_q4

from helpers import OracleHeads, tiny_llama

PLAN_READERS = (plan_module, packed, siblings, packing)


@pytest.fixture(scope="module")
def q4_kernel(tmp_path_factory):
    if not fewrow.load_kernel(tmp_path_factory.mktemp("kernels")) or not q4_available():
        pytest.skip(f"the Q4_1 product is off here ({fewrow.kernel_status()})")


@pytest.fixture(scope="module")
def q4_bf16(q4_kernel):
    if not q4_available(torch.bfloat16):
        pytest.skip("the bfloat16 Q4_1 product needs AVX512-BF16 (torch not limited below it)")


@pytest.mark.parametrize("out_features, in_features", [(37, 64), (16, 32), (100, 96), (8, 32), (48, 128)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 7, 8, 9, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_q4_product_is_the_few_row_kernel_over_the_weight(q4_kernel, dtype, out_features, in_features, rows):
    """Through the blocks, bit for bit what the dtype's few-row kernel computes over the weight
    (float32: the dequantized values; bfloat16: them rounded to bf16, as a bf16 base holds them)."""
    if not q4_available(dtype):
        pytest.skip(f"no {dtype} Q4_1 product here")
    generator = torch.Generator().manual_seed(rows * 100 + out_features)
    q, d, m = random_q4(out_features, in_features, generator)
    weight = q4_dequantized(q, d, m).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    ours = q4_product(q4_blocks(q, d, m, dtype), bias)(x)
    assert ours.dtype == dtype and torch.equal(ours, fewrow.fewrow_product(fewrow.block_weight(weight), out_features, bias)(x))
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(ours.float(), torch.nn.functional.linear(x, weight, bias).float(), rtol=tolerance,
                               atol=tolerance)


def test_gguf_q4_1_rows_read_as_gguf_dequantizes_them():
    from gguf import GGMLQuantizationType, quants

    values = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32) * 0.05
    raw = quants.quantize(values, GGMLQuantizationType.Q4_1)
    q, d, m = q4_1_parts(raw, 24, 96)
    assert q.max() <= 15 and d.dtype == m.dtype == np.float16
    ours = q4_dequantized(*(torch.from_numpy(p) for p in (q, d, m)))
    assert torch.equal(ours, torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_1).astype(np.float32)))


def q4_base(folder, seed: int = 2, edit=None, dtype=torch.float32):
    """A tiny float32 Llama whose every linear weight is its Q4_1 quantization dequantized, and the
    GGUF of those blocks (other names than transformers', q/k rows permuted as in a llama GGUF,
    ``edit`` applied to the tensors written), recorded as the GGUF the base was converted from."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    model = tiny_llama(seed, dtype=torch.float32)
    writer = GGUFWriter(str(folder / "tiny.gguf"), "llama")
    for index, (name, module) in enumerate((n, m) for n, m in decoder_body(model).named_modules()
                                           if type(m) is torch.nn.Linear):
        raw = quants.quantize(module.weight.detach().numpy(), GGMLQuantizationType.Q4_1)
        module.weight.data.copy_(torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_1)))
        if name.endswith(("q_proj", "k_proj")):
            raw = raw[np.random.default_rng(index).permutation(raw.shape[0])]
        raw = edit(name, raw) if edit is not None else raw
        writer.add_tensor(f"t{index}", raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (folder / SOURCE_RECORD).write_text(json.dumps({"gguf": str(folder / "tiny.gguf")}))
    model = model.to(dtype)
    model.name_or_path = str(folder)
    return model


def blocked_layers(model) -> dict[str, bool]:
    bound = binding(decoder_body(model))
    return {name: bound.linears[id(m)].copies.q4(m.weight) is not None
            for name, m in decoder_body(model).named_modules() if id(m) in bound.linears}


def force_plan(model, monkeypatch, q4_ms: float = 1.0) -> None:
    """Every product of ``model`` (its stacked siblings' too) through the blocks where it has them
    (``q4_ms`` below the kernel's 5), else the few-row kernel."""
    plan, n = PackingPlan(), len(ROW_BUCKETS)
    layer = model.model.layers[0]
    stacked = [(sum(m.out_features for m in ms), ms[0].in_features) for ms in (
        (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj), (layer.mlp.gate_proj, layer.mlp.up_proj))]
    for shape in [tuple(p.shape) for p in model.parameters() if p.dim() == 2] + stacked:
        plan.add(shape_key(model.dtype, *shape), {"linear_ms": [9.0] * n, "packed_ms": [9.0] * n,
                                                  "fewrow_ms": [5.0] * n, "q4_ms": [q4_ms] * n})
    for module in PLAN_READERS:
        monkeypatch.setattr(module, "PLAN", plan)


@pytest.mark.skipif(not plan_module.packing_available(torch.float32), reason="this torch build has no oneDNN packed linear")
def test_a_base_converted_from_q4_1_decodes_through_its_blocks_as_its_own_generate(q4_kernel, tmp_path, monkeypatch):
    from draftheads.decoding import DraftHeadsModel, tree_from_paths

    model = q4_base(tmp_path)
    prompt = torch.tensor([[5, 17, 33, 8, 9]])
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
    force_plan(model, monkeypatch)
    calls = []
    real = packed.q4_product
    monkeypatch.setattr(packed, "q4_product", lambda blocks, bias=None: (
        lambda x, product=real(blocks, bias): calls.append(x.shape) or product(x)))
    for paths in ([(0,)], [(0,), (1,), (0, 0)]):
        heads = OracleHeads([reference[0, 5:].tolist()], vocab=96, error=0.3, seed=4)
        ours = DraftHeadsModel(model, heads, tree=tree_from_paths(paths)).generate(prompt, max_new_tokens=40)
        assert ours.tolist() == reference.tolist()
    assert all(blocked_layers(model).values()) and len(blocked_layers(model)) == 14
    assert len(calls) > 50, "the Q4_1 product was not used"
    # a weight written in place loses its blocks at the next call's refresh, and is multiplied as it is now
    layer = model.model.layers[1].mlp.down_proj
    layer.weight.data.mul_(-1.0)
    packing.refresh_packing(model)
    assert not blocked_layers(model)["layers.1.mlp.down_proj"]
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
    heads = OracleHeads([reference[0, 5:].tolist()], vocab=96, error=0.3, seed=4)
    assert DraftHeadsModel(model, heads, tree=3).generate(prompt, max_new_tokens=40).tolist() == reference.tolist()


def test_blocks_that_are_not_the_weight_are_not_attached(q4_kernel, tmp_path):
    def edit(name, raw):  # one q of the GGUF's up projection of layer 0 changed: no longer the weight
        if name == "layers.0.mlp.up_proj":
            raw = raw.copy()
            raw[3, 7] ^= 0x11
        return raw

    model = q4_base(tmp_path, edit=edit)
    packing.use_packed_linears(model)
    attached = blocked_layers(model)
    assert not attached["layers.0.mlp.up_proj"] and sum(attached.values()) == 13


def test_a_gguf_that_does_not_read_leaves_the_weights_without_blocks(q4_kernel, tmp_path):
    model = q4_base(tmp_path)
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.warns(UserWarning, match=r"the Q4_1 blocks of .*tiny\.gguf could not be read .*float32 products"):
        packing.use_packed_linears(model)
    assert not any(blocked_layers(model).values())
    (tmp_path / SOURCE_RECORD).unlink()  # not a conversion at all: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert attach_gguf_blocks(model) == 0


def test_the_plan_takes_q4_only_for_a_weight_with_blocks_and_where_it_measured_fastest():
    n = len(ROW_BUCKETS)
    measured = {"linear_ms": [1.0] * n, "packed_ms": [0.8] * n, "fewrow_ms": [0.5, 0.5, 0.5, 0.5, 0.9, 0.9, 0.9, 0.9],
                "q4_ms": [0.3, 0.6, 0.3, 0.3, 0.7, 0.9, 0.3, 2.0]}
    assert fastest_paths(measured) == ("fewrow",) * 4 + ("packed",) * 4
    assert fastest_paths(measured, quantized=True) == ("q4", "fewrow", "q4", "q4", "q4", "packed", "q4", "packed")
    assert valid_timings(measured) and not valid_timings({**measured, "q4_ms": [0.1]})


def test_the_layout_holds_each_weight_where_the_kernel_reads_it(q4_kernel):
    q, d, m = random_q4(20, 64, torch.Generator().manual_seed(3))  # 20 outputs: the second 16-output block is padded
    blocks = q4_blocks(q, d, m)
    groups = 64 // 32
    nib, dm = blocks.nib.numpy().reshape(2, groups, 32, 8), blocks.dm.numpy().view(np.float16).reshape(2, groups, 2, 16)
    for o in range(20):
        b, j = divmod(o, 16)
        for k in range(64):
            g, kk = divmod(k, 32)
            byte = int(nib[b, g, kk, j % 8])
            assert (byte >> 4 if j >= 8 else byte & 0xF) == q[o, k]
            assert dm[b, g, 0, j] == d[o, g].numpy() and dm[b, g, 1, j] == m[o, g].numpy()
    assert not dm[1, :, :, 4:].any() and not nib[1, :, :, 4:].any() and not (nib[1, :, :, :4] >> 4).any()  # padding: zero


@pytest.mark.skipif(not plan_module.packing_available(torch.bfloat16), reason="bfloat16 does not pack here")
def test_a_bfloat16_base_decodes_through_its_blocks_as_through_the_bf16_kernel(q4_bf16, tmp_path, monkeypatch):
    """A bf16 base converted from Q4_1 blocks: every layer and each stacked q/k/v and gate/up product
    gets blocks, and greedy decoding through them gives the tokens the bf16 kernel gives (the same
    products bit for bit)."""
    from draftheads.decoding import DraftHeadsModel

    prompt = torch.tensor([[5, 17, 33, 8, 9]])
    outputs, shapes = [], []
    real = packed.q4_product
    monkeypatch.setattr(packed, "q4_product", lambda blocks, bias=None: (
        lambda x, product=real(blocks, bias): shapes.append(blocks.out_features) or product(x)))
    for q4_ms in (1.0, 7.0):  # through the blocks; then the kernel over the weights (the same base made again)
        (tmp_path / str(q4_ms)).mkdir()
        model = q4_base(tmp_path / str(q4_ms), dtype=torch.bfloat16)
        force_plan(model, monkeypatch, q4_ms)
        heads = OracleHeads([list(range(20, 60))], vocab=96, error=0.5, seed=4)
        outputs.append(DraftHeadsModel(model, heads, tree=3, sources="heads").generate(prompt, max_new_tokens=30).tolist())
        if q4_ms == 1.0:
            assert all(blocked_layers(model).values()) and {64, 128, 32} <= set(shapes)  # q/k/v and gate/up stacked
            shapes.clear()
    assert not shapes, "the second run went through the blocks too"
    assert outputs[0] == outputs[1]
