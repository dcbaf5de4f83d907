"""Head checkpoints: round trip, refusal of another base, corrupt files, unknown families."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import tiny_llama
from draftheads.decoding import DraftHeadsModel, fingerprint, tree_from_paths
from draftheads.heads import CheckpointError, HeadConfig, MedusaHeads, load_heads


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
