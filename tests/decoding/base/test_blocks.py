"""Products through a GGUF's blocks (decoding/base/blocks.py, gguf_blocks.py), Q4_1 and Q8_0, float32 and
bfloat16: the block products compute the few-row kernel's sums bit for bit; a GGUF's rows read as gguf
dequantizes them; a base converted from such a GGUF gets its blocks (body and LM head) only where they
are its weights exactly (rows matched by content, permuted as transformers permutes q/k), decodes
through them as its own ``generate``, and loses them when a weight changes or the GGUF does not read."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from draftheads.decoding.base import fewrow, packed, packing, plan as plan_module
from draftheads.decoding.base.architecture import decoder_body
from draftheads.decoding.base.binding import binding
from draftheads.decoding.base.gguf_blocks import attach_gguf_blocks, gguf_parts
from draftheads.decoding.base.loading import SOURCE_RECORD
from draftheads.decoding.base.plan import ROW_BUCKETS, fastest_paths, valid_timings
from draftheads.decoding.base.blocks import KINDS, blocks_available, blocks_product, dequantized, make_blocks, random_parts

from helpers import OracleHeads, force_plan, gguf_base

@pytest.fixture(scope="module")
def q4_kernel(tmp_path_factory):
    if not fewrow.load_kernel(tmp_path_factory.mktemp("kernels")) or not blocks_available("q4_1"):
        pytest.skip(f"the block products are off here ({fewrow.kernel_status()})")


@pytest.fixture(scope="module")
def q4_bf16(q4_kernel):
    if not blocks_available("q4_1", torch.bfloat16):
        pytest.skip("no native bfloat16 here (the bfloat16 block products need AVX512-BF16, torch not "
                    "limited below it)")


@pytest.mark.parametrize("out_features, in_features", [(37, 64), (16, 32), (100, 96), (8, 32), (48, 128)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 7, 8, 9, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_the_block_product_is_the_few_row_kernel_over_the_weight(q4_kernel, kind, dtype, out_features, in_features, rows):
    """Through the blocks, bit for bit what the dtype's few-row kernel computes over the weight
    (float32: the dequantized values; bfloat16: them rounded to bf16, as a bf16 base holds them)."""
    if not blocks_available(kind, dtype):  # bf16's needs AVX512-BF16; float32's any AVX2 CPU with a compiler
        native = dtype != torch.bfloat16 or fewrow.bf16_kernel_supported()
        pytest.skip(f"no {dtype} {kind} product here" if native
                    else f"no native bfloat16 here (the {kind} product needs AVX512-BF16)")
    generator = torch.Generator().manual_seed(rows * 100 + out_features)
    parts = random_parts(kind, out_features, in_features, generator)
    weight = dequantized(kind, *parts).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    ours = blocks_product(make_blocks(kind, *parts, dtype=dtype), bias)(x)
    assert ours.dtype == dtype and torch.equal(ours, fewrow.fewrow_product(fewrow.block_weight(weight), out_features, bias)(x))
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(ours.float(), torch.nn.functional.linear(x, weight, bias).float(), rtol=tolerance,
                               atol=tolerance)


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_rows_read_as_gguf_dequantizes_them(kind):
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind.upper()]
    values = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32) * 0.05
    raw = quants.quantize(values, qtype)
    parts = gguf_parts(kind, raw, 24, 96)
    assert parts[1].dtype == np.float16 and (parts[0].max() <= 15 if kind == "q4_1" else parts[0].dtype == np.int8)
    ours = dequantized(kind, *(None if p is None else torch.from_numpy(p) for p in parts))
    assert torch.equal(ours, torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32)))


def blocked_layers(model) -> dict[str, str | None]:
    """Each bound layer's block kind (None: no blocks), and the LM head's."""
    bound = binding(decoder_body(model))
    kinds = {name: bound.linears[id(m)].copies.blocks(m.weight) for name, m in decoder_body(model).named_modules()
             if id(m) in bound.linears}
    kinds["lm_head"] = packing.packed_lm_head(model).blocks(model.lm_head.weight)
    return {name: None if blocks is None else blocks.kind for name, blocks in kinds.items()}


@pytest.mark.skipif(not plan_module.packing_available(torch.float32), reason="this torch build has no oneDNN packed linear")
def test_a_base_converted_from_a_gguf_decodes_through_its_blocks_as_its_own_generate(q4_kernel, tmp_path, monkeypatch):
    from draftheads.decoding import DraftHeadsModel, tree_from_paths

    model = gguf_base(tmp_path)
    prompt = torch.tensor([[5, 17, 33, 8, 9]])
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
    force_plan(model, monkeypatch)
    calls = []
    real = packed.blocks_product
    monkeypatch.setattr(packed, "blocks_product", lambda blocks, bias=None: (
        lambda x, product=real(blocks, bias): calls.append(blocks.kind) or product(x)))
    for paths in ([(0,)], [(0,), (1,), (0, 0)]):
        heads = OracleHeads([reference[0, 5:].tolist()], vocab=96, error=0.3, seed=4)
        ours = DraftHeadsModel(model, heads, tree=tree_from_paths(paths)).generate(prompt, max_new_tokens=40)
        assert ours.tolist() == reference.tolist()
    kinds = blocked_layers(model)
    assert kinds.pop("lm_head") == "q8_0" and set(kinds.values()) == {"q4_1"} and len(kinds) == 14
    assert calls.count("q4_1") > 50 and calls.count("q8_0") > 5, "the block products were not used"
    # a weight written in place loses its blocks at the next call's refresh, and is multiplied as it is now
    layer = model.model.layers[1].mlp.down_proj
    layer.weight.data.mul_(-1.0)
    packing.refresh_packing(model)
    assert not blocked_layers(model)["layers.1.mlp.down_proj"]
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
    heads = OracleHeads([reference[0, 5:].tolist()], vocab=96, error=0.3, seed=4)
    assert DraftHeadsModel(model, heads, tree=3).generate(prompt, max_new_tokens=40).tolist() == reference.tolist()


def test_the_calibration_of_a_base_is_not_reused_once_its_blocks_are_gone(q4_kernel, tmp_path):
    """A step through the blocks costs a fraction of one streaming the float weights: the measured
    costs are keyed by the blocks in use, so a base that lost them (its GGUF gone, a weight changed)
    is measured again."""
    from draftheads.decoding.calibration import calibration_key

    model = gguf_base(tmp_path)
    plain = calibration_key(model)["blocks"]
    packing.use_packed_linears(model)
    with_blocks = calibration_key(model)["blocks"]
    assert plain == [] and "float32:96x32:q8_0" in with_blocks and "float32:64x32:q4_1" in with_blocks
    model.model.layers[1].mlp.down_proj.weight.data.mul_(-1.0)
    model.model.layers[0].mlp.down_proj.weight.data.mul_(-1.0)
    packing.refresh_packing(model)
    assert calibration_key(model)["blocks"] == [b for b in with_blocks if b != "float32:32x64:q4_1"]


def test_blocks_that_are_not_the_weight_are_not_attached(q4_kernel, tmp_path):
    def edit(name, raw):  # one q of the GGUF's up projection of layer 0 changed: no longer the weight
        if name == "layers.0.mlp.up_proj":
            raw = raw.copy()
            raw[3, 7] ^= 0x11
        return raw

    model = gguf_base(tmp_path, edit=edit)
    packing.use_packed_linears(model)
    attached = blocked_layers(model)
    assert attached.pop("layers.0.mlp.up_proj") is None and set(attached.values()) == {"q4_1", "q8_0"}


def test_a_gguf_that_does_not_read_leaves_the_weights_without_blocks(q4_kernel, tmp_path):
    model = gguf_base(tmp_path)
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.warns(UserWarning, match=r"the blocks of .*tiny\.gguf could not be read .*products stream the weights"):
        packing.use_packed_linears(model)
    assert not any(blocked_layers(model).values())
    (tmp_path / SOURCE_RECORD).unlink()  # not a conversion at all: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert attach_gguf_blocks(model) == 0


def test_the_plan_takes_blocks_only_for_a_weight_with_them_and_where_they_measured_fastest():
    n = len(ROW_BUCKETS)
    measured = {"linear_ms": [1.0] * n, "packed_ms": [0.8] * n, "fewrow_ms": [0.5, 0.5, 0.5, 0.5, 0.9, 0.9, 0.9, 0.9],
                "q4_1_ms": [0.3, 0.6, 0.3, 0.3, 0.7, 0.9, 0.3, 2.0], "q8_0_ms": [0.4] * n}
    assert fastest_paths(measured) == ("fewrow",) * 4 + ("packed",) * 4
    assert fastest_paths(measured, kind="q4_1") == ("q4_1", "fewrow", "q4_1", "q4_1", "q4_1", "packed", "q4_1", "packed")
    assert fastest_paths(measured, kind="q8_0") == ("q8_0",) * n
    assert valid_timings(measured) and not valid_timings({**measured, "q8_0_ms": [0.1]})


def test_the_layout_holds_each_weight_where_the_kernel_reads_it(q4_kernel):
    q, d, m = random_parts("q4_1", 20, 64, torch.Generator().manual_seed(3))  # 20 outputs: the second block is padded
    blocks = make_blocks("q4_1", q, d, m)
    groups = 64 // 32
    nib, dm = blocks.data.numpy().reshape(2, groups, 32, 8), blocks.scales.numpy().view(np.float16).reshape(2, groups, 2, 16)
    for o in range(20):
        b, j = divmod(o, 16)
        for k in range(64):
            g, kk = divmod(k, 32)
            byte = int(nib[b, g, kk, j % 8])
            assert (byte >> 4 if j >= 8 else byte & 0xF) == q[o, k]
            assert dm[b, g, 0, j] == d[o, g].numpy() and dm[b, g, 1, j] == m[o, g].numpy()
    assert not dm[1, :, :, 4:].any() and not nib[1, :, :, 4:].any() and not (nib[1, :, :, :4] >> 4).any()  # padding: zero


@pytest.mark.skipif(not plan_module.packing_available(torch.bfloat16),
                    reason="no native bfloat16 here (bfloat16 does not pack)")
def test_a_bfloat16_base_decodes_through_its_blocks_as_through_the_bf16_kernel(q4_bf16, tmp_path, monkeypatch):
    """A bf16 base converted from Q4_1 blocks: every layer and each stacked q/k/v and gate/up product
    gets blocks, and greedy decoding through them gives the tokens the bf16 kernel gives (the same
    products bit for bit)."""
    from draftheads.decoding import DraftHeadsModel

    prompt = torch.tensor([[5, 17, 33, 8, 9]])
    outputs, shapes = [], []
    real = packed.blocks_product
    monkeypatch.setattr(packed, "blocks_product", lambda blocks, bias=None: (
        lambda x, product=real(blocks, bias): shapes.append(blocks.out_features) or product(x)))
    for blocks_ms in (1.0, 7.0):  # through the blocks; then the kernel over the weights (the same base made again)
        (tmp_path / str(blocks_ms)).mkdir()
        model = gguf_base(tmp_path / str(blocks_ms), dtype=torch.bfloat16)
        force_plan(model, monkeypatch, blocks_ms)
        heads = OracleHeads([list(range(20, 60))], vocab=96, error=0.5, seed=4)
        outputs.append(DraftHeadsModel(model, heads, tree=3, sources="heads").generate(prompt, max_new_tokens=30).tolist())
        if blocks_ms == 1.0:
            assert all(blocked_layers(model).values()) and {64, 128, 32, 96} <= set(shapes)  # stacked, LM head
            shapes.clear()
    assert not shapes, "the second run went through the blocks too"
    assert outputs[0] == outputs[1]


def test_the_header_reader_finds_the_tensors_gguf_writes_and_refuses_a_truncated_file(tmp_path):
    """Only the header is parsed (metadata skipped: strings, arrays of strings, the alignment):
    the tensors found are the ones written, at their bytes; a file cut inside its header or its
    tensors is refused in one line."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    from draftheads.decoding.base.gguf_blocks import gguf_tensors

    writer = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "déf"] * 50)
    writer.add_string("general.name", "tiny")
    writer.add_custom_alignment(64)
    values = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    raw = {kind: quants.quantize(values, GGMLQuantizationType[kind.upper()]) for kind in KINDS}
    writer.add_tensor("norm", values[0])  # float32, 1-D: not a block tensor
    for kind in KINDS:
        writer.add_tensor(kind, raw[kind], raw_shape=raw[kind].shape, raw_dtype=GGMLQuantizationType[kind.upper()])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = gguf_tensors(tmp_path / "t.gguf")
    assert [(kind, out, inn) for kind, out, inn, _ in found] == [("q4_1", 8, 64), ("q8_0", 8, 64)]
    assert all(np.array_equal(data, raw[kind]) for kind, _, _, data in found)
    whole = (tmp_path / "t.gguf").read_bytes()
    for cut in (100, len(whole) - 100):  # inside the metadata; inside the last tensor (the file ends padded)
        (tmp_path / "cut.gguf").write_bytes(whole[:cut])
        with pytest.raises(ValueError, match="ends inside its header|runs past its end"):
            gguf_tensors(tmp_path / "cut.gguf")
