"""Head checkpoints: round trip, refusal of another base (in any dtype of their own base: the
fingerprint's dtype-independent sketch), corrupt files and damaged weights named at load,
unknown families."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import CheckpointError, HeadConfig, MedusaHeads, load_heads

MODEL = tiny_llama(0, max_pos=64)


def trained_like_heads(model, seed: int = 0, draft_vocab: int = 0) -> MedusaHeads:
    cfg = model.config
    heads = MedusaHeads(HeadConfig(num_heads=3, num_layers=2, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                                   draft_vocab_size=draft_vocab, base_fingerprint=fingerprint(model).to_dict(),
                                   trees={"3": [[0], [1], [0, 0]]}))
    torch.manual_seed(seed)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.5)
    if draft_vocab:
        heads.vocab_ids.copy_(torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values)
    return heads.to(model.dtype)


@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_round_trip_gives_identical_outputs(tmp_path, draft_vocab):
    model = tiny_llama(0)
    heads = trained_like_heads(model, draft_vocab=draft_vocab)
    heads.save_pretrained(tmp_path, dtype=None)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["family"] == "medusa" and saved["base_fingerprint"] == fingerprint(model).to_dict()
    loaded = load_heads(tmp_path, expected_fingerprint=fingerprint(model).to_dict(), dtype=model.dtype)
    hidden = torch.randn(5, model.config.hidden_size, dtype=model.dtype)
    heads.bind(model.lm_head.weight)
    loaded.bind(model.lm_head.weight)
    assert torch.equal(heads(hidden), loaded(hidden))
    prompt = torch.tensor([[3, 4, 5, 6]])
    tree = tree_from_paths([[0], [1], [0, 0], [0, 0, 0]])
    a = DraftHeadsModel(model, heads, tree=tree).generate(prompt, max_new_tokens=24)
    b = DraftHeadsModel.from_pretrained(tmp_path, base=model, tree=3)
    assert b.generate(prompt, max_new_tokens=24).tolist() == a.tolist()
    assert a.tolist() == model.generate(prompt, max_new_tokens=24, do_sample=False).tolist()


def test_layers_are_distinct_modules():
    heads = MedusaHeads(HeadConfig(num_heads=2, num_layers=3, hidden_size=8, vocab_size=10))
    weights = [block.linear.weight for head in heads.heads for block in head]
    assert len({w.data_ptr() for w in weights}) == 6


def test_checkpoint_for_another_base_is_refused(tmp_path):
    heads = trained_like_heads(tiny_llama(0))
    heads.save_pretrained(tmp_path)
    other = tiny_llama(1)  # same shapes, different weights
    with pytest.raises(CheckpointError, match="trained for another base model.*lm_head_sha256"):
        DraftHeadsModel.from_pretrained(tmp_path, base=other)


def test_checkpoint_for_a_base_of_other_shape_is_refused(tmp_path):
    heads = trained_like_heads(tiny_llama(0))
    heads.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="another base model.*vocab_size"):
        DraftHeadsModel.from_pretrained(tmp_path, base=tiny_llama(0, vocab=128))


def test_corrupt_and_missing_files_get_clear_errors(tmp_path):
    model = tiny_llama(0)
    heads = trained_like_heads(model)
    heads.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_heads(tmp_path)
    weights.unlink()
    with pytest.raises(CheckpointError, match="model.safetensors not found"):
        load_heads(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_heads(tmp_path)
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_heads(tmp_path / "nowhere")


def test_unknown_family_is_refused(tmp_path):
    heads = trained_like_heads(tiny_llama(0))
    heads.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["family"] = "eagle-9"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="Unknown head family 'eagle-9'"):
        load_heads(tmp_path)


def test_bad_config_values_are_named():
    with pytest.raises(ValueError, match="num_heads must be a positive integer"):
        HeadConfig(num_heads=0)
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        HeadConfig(vocab_size=10, draft_vocab_size=11)


# -- the base fingerprint across dtypes ----------------------------------------------------------------
def saved_heads(tmp_path, model, draft_vocab: int = 40, identity: dict | None = None):
    cfg = model.config
    heads = MedusaHeads(HeadConfig(num_heads=2, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                                   draft_vocab_size=draft_vocab,
                                   base_fingerprint=identity or fingerprint(model).with_sketch(model),
                                   trees={"3": [[0], [1], [0, 0]]}))
    heads.vocab_ids.copy_(torch.arange(draft_vocab))
    heads.save_pretrained(tmp_path, dtype=torch.float32)
    return tmp_path


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
