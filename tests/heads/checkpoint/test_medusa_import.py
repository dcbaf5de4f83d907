"""Import of FasterDecoding Medusa checkpoints: both layouts built in the test from Medusa's
documented modules (``medusa/model/medusa_model.py`` and ``medusa_model_legacy.py``), logits
compared with the source layout's own forward, then lossless batched decoding."""
from __future__ import annotations


import pytest
import torch
from torch import nn

from helpers import left_pad, reference_heads, tiny_llama, write_medusa
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import CheckpointError, load_heads
from draftheads.heads.checkpoint.medusa_import import import_medusa


def reference_logits(module: nn.ModuleList, hidden: torch.Tensor, lm_head: torch.Tensor, projection: bool):
    """(B, d) → (B, K, V) by the source layout's forward."""
    outs = [head(hidden) if projection else head(hidden) @ lm_head.t() for head in module]
    return torch.stack(outs, dim=1)


@pytest.mark.parametrize("projection,layers,fmt", [(True, 1, "safetensors"), (True, 2, "pt"),
                                                    (False, 1, "safetensors"), (False, 2, "pt")])
def test_import_gives_the_source_logits_and_lossless_decoding(tmp_path, projection, layers, fmt):
    model = tiny_llama(0)
    d, vocab = model.config.hidden_size, model.config.vocab_size
    module = reference_heads(d, vocab, heads=3, layers=layers, projection=projection)
    write_medusa(tmp_path / "medusa", module, layers, fmt)
    heads = import_medusa(tmp_path / "medusa", fingerprint(model).to_dict())
    assert heads.config.owns_lm_head is projection and heads.config.num_layers == layers
    hidden = torch.randn(5, d, dtype=torch.float64)
    heads.bind(model.lm_head.weight)
    assert torch.equal(heads(hidden), reference_logits(module, hidden, model.lm_head.weight, projection))
    # saved as a draftheads checkpoint, reloaded, it decodes batched exactly like the base
    heads.save_pretrained(tmp_path / "ours", dtype=None)
    loaded = load_heads(tmp_path / "ours", expected_fingerprint=fingerprint(model).to_dict(), dtype=torch.float64)
    assert torch.equal(loaded.bind(model.lm_head.weight)(hidden), heads(hidden))
    ids, mask = left_pad([[3, 4, 5, 6], [7, 8], [9, 10, 11]])
    ours = DraftHeadsModel(model, loaded, tree=tree_from_paths([[0], [1], [0, 0], [0, 0, 0]]))
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=20)
    assert out.tolist() == model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False).tolist()


def test_vocab_size_mismatch_is_named(tmp_path):
    model = tiny_llama(0)
    write_medusa(tmp_path, reference_heads(32, 128, 2, 1, True), 1, "safetensors")
    with pytest.raises(CheckpointError, match="Vocabulary-size mismatch.*project to 128 tokens but the base has 96"
                                              ".*tiny/llama"):
        import_medusa(tmp_path, fingerprint(model).to_dict())


def test_hidden_size_mismatch_and_bad_files_are_named(tmp_path):
    model = tiny_llama(0)
    write_medusa(tmp_path / "a", reference_heads(16, 96, 2, 1, False), 1, "safetensors")
    with pytest.raises(CheckpointError, match="hidden states of size 16 but the base has hidden_size 32"):
        import_medusa(tmp_path / "a", fingerprint(model).to_dict())
    write_medusa(tmp_path / "b", reference_heads(32, 96, 2, 2, False), 1, "pt")  # config says 1 layer, file has 2
    with pytest.raises(CheckpointError, match="medusa_num_layers=1 but medusa_lm_head.pt holds 2"):
        import_medusa(tmp_path / "b", fingerprint(model).to_dict())
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a Medusa head checkpoint"):
        import_medusa(tmp_path / "c", fingerprint(model).to_dict())
    (tmp_path / "c" / "medusa_lm_head.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot be read"):
        import_medusa(tmp_path / "c", fingerprint(model).to_dict())


def test_imported_heads_get_trees_and_decode_with_the_adaptive_policy(tmp_path, monkeypatch):
    """Imported checkpoints carry no trees: fit_trees runs training's tree search on the heads'
    ranks over the base's outputs, after which tree=<budget> and the calibrated adaptive policy work."""
    from draftheads.decoding.calibration import CalibrationConfig
    from draftheads.decoding.policy import AdaptivePolicy, resolve_tree
    from draftheads.training.features import Example, extract_features, load_shards
    from draftheads.tree_fit import fit_trees

    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    model = tiny_llama(0, max_pos=64)
    write_medusa(tmp_path / "medusa", reference_heads(32, 96, heads=2, layers=1, projection=True), 1, "safetensors")
    heads = import_medusa(tmp_path / "medusa", fingerprint(model).to_dict())
    generator = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(3, 96, (20,), generator=generator).tolist(), 4) for _ in range(6)]
    fp = fingerprint(model).to_dict()
    features = load_shards(extract_features(model, examples, tmp_path / "features", fp), fp)
    taus = fit_trees(heads, model, features, budgets=(1, 3))
    assert list(heads.config.trees) == ["1", "3"] and 1.0 <= taus["1"] <= taus["3"] <= 3.0
    heads.save_pretrained(tmp_path / "ours", dtype=None)
    loaded = load_heads(tmp_path / "ours", expected_fingerprint=fp, dtype=torch.float64)
    assert loaded.config.expected_tau_on == "dev"  # fitted on the base's answers: counted in full
    grid = CalibrationConfig(batch_sizes=(1, 2), nodes=(1, 2, 4), contexts=(8, 16), max_tokens=4, reps=1)
    loaded.bind(model.get_output_embeddings().weight, model.get_input_embeddings().weight)
    policy = resolve_tree("adaptive", model, loaded, grid)
    assert isinstance(policy, AdaptivePolicy) and [c.budget for c in policy.candidates] == [0, 1, 3]
    ids, mask = left_pad([[5, 6, 7, 8], [9, 10]])
    out = DraftHeadsModel(model, loaded, tree=policy).generate(ids, attention_mask=mask, max_new_tokens=12)
    assert out.tolist() == model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False).tolist()
