"""Issue 22: every bad input gets a clear error of the package's own type, before any work,
naming the problem and the fix; no deep torch/transformers traceback and no silent result."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import tiny_llama
from draftheads.decoding import DraftHeadsModel, fingerprint, tree_from_paths
from draftheads.decoding.limits import InputError, InputTypeError, check_count, parse_dtype, parse_tree_option
from draftheads.heads import CheckpointError, HeadConfig, MedusaHeads, load_heads

MODEL = tiny_llama(0, max_pos=64)


def drafter() -> DraftHeadsModel:
    heads = MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96)).to(torch.float64)
    return DraftHeadsModel(MODEL, heads, tree=tree_from_paths([[0], [1], [0, 0]]))


def saved_heads(tmp_path, model, draft_vocab: int = 40, identity: dict | None = None):
    cfg = model.config
    heads = MedusaHeads(HeadConfig(num_heads=2, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                                   draft_vocab_size=draft_vocab,
                                   base_fingerprint=identity or fingerprint(model).with_sketch(model),
                                   trees={"3": [[0], [1], [0, 0]]}))
    heads.vocab_ids.copy_(torch.arange(draft_vocab))
    heads.save_pretrained(tmp_path, dtype=torch.float32)
    return tmp_path


# -- generate() inputs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ids,mask,error,message", [
    (torch.tensor([[3.0, 4.0]]), None, InputTypeError, "input_ids must hold integer token ids.*input_ids.long"),
    (torch.tensor([[3, 96]]), None, InputError, r"token id 96 is outside the vocabulary \[0, 96\)"),
    (torch.tensor([[-100, 4]]), None, InputError, r"token id -100 is outside the vocabulary.*pad id"),
    (torch.zeros((0, 3), dtype=torch.long), None, InputError, "the batch is empty.*at least one prompt"),
    (torch.tensor([[3, 4]]), [[1, 1]], InputTypeError, "attention_mask must be a torch.Tensor.*got list"),
    ([[3, 4]], None, InputTypeError, "input_ids must be a torch.Tensor.*got list.*return_tensors='pt'"),
    (torch.tensor([3, 4]), None, InputError, r"2-D tensor.*input_ids\[None\]"),
    (torch.tensor([[3, 4]], device="meta"), None, InputError, "input_ids is on meta but the base model is on cpu"),
    (torch.tensor([[3, 4]]), torch.ones((1, 2), device="meta"), InputError, "attention_mask is on meta"),
    (torch.tensor([[3, 4, 5]]), torch.tensor([[1, 2, 1]]), InputError, r"only 0 \(padding\) and 1.*got values \[2\]"),
    (torch.tensor([[3, 4, 5]]), torch.tensor([[0.5, 1.0, 1.0]]), InputError, r"got values \[0\.5\]"),
])
def test_bad_generate_inputs_are_refused(ids, mask, error, message):
    with pytest.raises(error, match=message):
        drafter().generate(ids, attention_mask=mask, max_new_tokens=4)


def test_a_bool_or_float_zero_one_mask_is_the_same_as_a_long_one():
    ids, mask = torch.tensor([[0, 3, 4], [5, 6, 7]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    reference = drafter().generate(ids, attention_mask=mask, max_new_tokens=6)
    assert torch.equal(drafter().generate(ids, attention_mask=mask.bool(), max_new_tokens=6), reference)
    assert torch.equal(drafter().generate(ids, attention_mask=mask.float(), max_new_tokens=6), reference)


# -- from_pretrained arguments ------------------------------------------------------------------------
@pytest.mark.parametrize("tree,error,message", [
    (2.5, InputTypeError, r"tree=2\.5 \(float\)"),
    (True, InputTypeError, r"tree=True \(bool\)"),
    ([[0], [1]], InputTypeError, r"tree=\[\[0\], \[1\]\] \(list\).*tree_from_paths|a Tree"),
    (-3, InputError, r"node budget.*must be ≥ 0, got -3"),
    ("-1", InputError, r"must be ≥ 0, got -1"),
    ("big", InputError, "expected 'adaptive' or a node budget"),
])
def test_bad_tree_argument_is_refused_before_loading(tree, error, message):
    with pytest.raises(error, match=message):
        DraftHeadsModel.from_pretrained(None, base=MODEL, tree=tree)


def test_tree_zero_and_string_budget_still_work():
    assert parse_tree_option("4") == 4 and parse_tree_option(0) == 0 and parse_tree_option(" Adaptive ") == "adaptive"


@pytest.mark.parametrize("dtype,error,message", [
    ("bogus", InputError, "dtype='bogus' is not a dtype draftheads knows; use one of.*bfloat16"),
    (torch.int64, InputError, "needs a floating dtype"),
    (3, InputTypeError, "dtype must be a torch.dtype or its name"),
])
def test_bad_dtype_is_refused_before_loading(dtype, error, message):
    with pytest.raises(error, match=message):
        DraftHeadsModel.from_pretrained(None, dtype=dtype)


def test_one_dtype_parser_for_every_spelling():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("torch.float16") is torch.float16
    assert parse_dtype("Float32") is torch.float32 and parse_dtype(torch.float64) is torch.float64


@pytest.mark.parametrize("path", ["/nonexistent/base-model", "./no-such-model", "weights/base.gguf"])
def test_missing_base_directory_is_one_clear_error(path):
    with pytest.raises(FileNotFoundError, match=f"base model '{path}' does not exist: pass an existing model"):
        DraftHeadsModel.from_pretrained(None, base_name_or_path=path)


@pytest.mark.parametrize("value,error", [(0, InputError), (-1, InputError), (2.0, InputTypeError), (True, InputTypeError)])
def test_counts_refuse_non_positive_and_non_integers(value, error):
    with pytest.raises(error, match="--limit must be"):
        check_count("--limit", value)


# -- the base fingerprint across dtypes ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_heads_load_on_their_base_in_any_dtype(tmp_path, dtype):
    saved_heads(tmp_path, tiny_llama(0, dtype=torch.float32))
    model = DraftHeadsModel.from_pretrained(tmp_path, base=tiny_llama(0, dtype=dtype))
    assert model.heads.config.num_heads == 2


def test_heads_trained_on_a_float16_base_load_on_the_float32_base(tmp_path):
    half = tiny_llama(0, dtype=torch.float16)
    saved_heads(tmp_path, half)
    assert fingerprint(half).lm_head_sha256 != fingerprint(tiny_llama(0, dtype=torch.float32)).lm_head_sha256
    DraftHeadsModel.from_pretrained(tmp_path, base=tiny_llama(0, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_another_base_is_still_refused_in_any_dtype(tmp_path, dtype):
    saved_heads(tmp_path, tiny_llama(0, dtype=torch.float32))
    with pytest.raises(CheckpointError, match="trained for another base model.*lm_head_sha256"):
        DraftHeadsModel.from_pretrained(tmp_path, base=tiny_llama(1, dtype=dtype))


def test_old_checkpoint_without_sketch_says_why_float16_fails(tmp_path):
    model = tiny_llama(0, dtype=torch.float32)
    saved_heads(tmp_path, model, identity=fingerprint(model).to_dict())
    DraftHeadsModel.from_pretrained(tmp_path, base=model)  # same dtype: the hash still matches
    with pytest.raises(CheckpointError, match="records no dtype-independent lm_head_sketch"):
        DraftHeadsModel.from_pretrained(tmp_path, base=tiny_llama(0, dtype=torch.float16))


@pytest.mark.slow
def test_shipped_heads_load_on_smollm2_in_float16():
    if os.environ.get("DRAFTHEADS_SKIP_SMOLLM2"):
        pytest.skip("DRAFTHEADS_SKIP_SMOLLM2 is set")
    model = DraftHeadsModel.from_pretrained("checkpoints/smollm2-135m-hydra", dtype="float16")
    assert next(model.base.parameters()).dtype == torch.float16 and model.heads.family == "hydra"


# -- damaged head checkpoints --------------------------------------------------------------------------
def damage(directory, name, value):
    state = load_file(str(directory / "model.safetensors"))
    state[name] = value(state[name])
    save_file(state, str(directory / "model.safetensors"))


@pytest.mark.parametrize("name,value,message", [
    ("vocab_ids", lambda t: t + 1000, r"vocab_ids holds token id 1039 outside the vocabulary \[0, 96\)"),
    ("vocab_ids", lambda t: t - 5, r"vocab_ids holds token id -5 outside"),
    ("vocab_ids", lambda t: t[:10], r"'vocab_ids' has shape \(10,\).*draft_vocab_size=40.*needs \(40,\)"),
])
def test_damaged_weights_are_refused_at_load(tmp_path, name, value, message):
    saved_heads(tmp_path, MODEL)
    damage(tmp_path, name, value)
    with pytest.raises(CheckpointError, match=f"model.safetensors: .*{message}"):
        load_heads(tmp_path)


def test_overwritten_tensor_bytes_are_refused(tmp_path):
    saved_heads(tmp_path, MODEL)
    state = load_file(str(tmp_path / "model.safetensors"))
    weight = next(k for k, v in state.items() if v.is_floating_point())
    damage(tmp_path, weight, lambda t: t.view(torch.int32).fill_(0x7FC00000).view(torch.float32))  # bytes → NaN
    with pytest.raises(CheckpointError, match=f"'{weight}' holds NaN or infinite values"):
        load_heads(tmp_path)


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", 64, r"has shape .* but config.json \(hidden_size=64"),
    ("draft_vocab_size", 20, r"draft_vocab_size=20.*config and the weights disagree"),
    ("num_heads", "two", "config.json: HeadConfig.num_heads must be a positive integer"),
])
def test_config_that_disagrees_with_the_weights(tmp_path, field, value, message):
    saved_heads(tmp_path, MODEL)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_heads(tmp_path)


def test_one_weight_of_the_wrong_shape(tmp_path):
    saved_heads(tmp_path, MODEL)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = next(k for k, v in state.items() if v.dim() == 2)
    damage(tmp_path, name, lambda t: t[:, :-1].contiguous())
    with pytest.raises(CheckpointError, match=f"tensor '{name}' has shape .*the config and the weights disagree"):
        load_heads(tmp_path)
