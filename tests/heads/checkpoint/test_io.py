"""Checkpoint folders: atomic saves, versions, and the errors that name both sides."""
from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch

from helpers import REPO, tiny_llama
from draftheads import __version__
from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import CheckpointError, HeadConfig, HydraHeads, MedusaHeads, load_heads, read_config
from draftheads.heads import head_config
from draftheads.core import atomic
from draftheads.core.atomic import current_umask



def random_heads(model, seed: int = 0) -> MedusaHeads:
    cfg = model.config
    heads = MedusaHeads(HeadConfig(num_heads=2, num_layers=1, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                                   base_fingerprint=fingerprint(model).to_dict(), base_name="tiny/base-0"))
    torch.manual_seed(seed)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return heads.to(model.dtype)


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_save_writes_config_weights_card_and_version(tmp_path):
    heads = random_heads(tiny_llama(0))
    out = heads.save_pretrained(tmp_path / "ckpt", dtype=None)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    saved = json.loads((out / "config.json").read_text())
    assert saved["format_version"] == head_config.FORMAT_VERSION and saved["draftheads_version"] == __version__
    assert (out / "README.md").read_text().startswith("---\n")
    assert leftovers(tmp_path) == []
    umask = current_umask()  # the temporary folder was private; the checkpoint follows the umask like any folder
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o666 & ~umask


def test_failed_save_keeps_the_old_checkpoint_and_leaves_nothing(tmp_path):
    model = tiny_llama(0)
    target = tmp_path / "ckpt"
    random_heads(model, seed=0).save_pretrained(target, dtype=None, files={"training_report.json": "{}"})
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(FileNotFoundError):  # a file in a missing sub-folder fails half-way through the save
        random_heads(model, seed=1).save_pretrained(target, dtype=None, files={"no/such/dir.txt": "x"})
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert leftovers(tmp_path) == []
    # a successful re-save replaces the checkpoint and keeps files it does not write itself
    random_heads(model, seed=1).save_pretrained(target, dtype=None)
    assert (target / "training_report.json").read_text() == "{}"
    assert (target / "model.safetensors").read_bytes() != before["model.safetensors"]


def test_interrupted_save_never_leaves_a_loadable_folder(tmp_path, monkeypatch):
    """A process killed during the save leaves only its temporary folder, which has no config.json
    (written last) and so does not load; the target name never appears."""
    model = tiny_llama(0)
    monkeypatch.setattr(atomic.shutil, "rmtree", lambda *a, **k: None)  # as if killed: no cleanup runs
    original = Path.write_text

    def killed_on_config(self, text, *args, **kwargs):
        if self.name == "config.json":
            raise KeyboardInterrupt
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", killed_on_config)
    with pytest.raises(KeyboardInterrupt):
        random_heads(model).save_pretrained(tmp_path / "ckpt")
    monkeypatch.undo()
    assert not (tmp_path / "ckpt").exists()
    [partial] = [p for p in tmp_path.iterdir()]
    assert partial.name.startswith(".ckpt.tmp-") and (partial / "model.safetensors").is_file()
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_heads(partial)


def test_newer_format_names_both_versions(tmp_path):
    random_heads(tiny_llama(0)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(format_version=head_config.FORMAT_VERSION + 1, draftheads_version="9.9.0", tree_grammar="x")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"written by draftheads 9\.9\.0; this is draftheads {__version__}.*"
                                              r"Upgrade draftheads"):
        load_heads(tmp_path)


def test_format_1_checkpoints_still_load(tmp_path):
    model = tiny_llama(0)
    heads = random_heads(model)
    heads.save_pretrained(tmp_path, dtype=None)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("draftheads_version", "base_revision", "owns_lm_head", "expected_tau_on"):
        del config[key]
    config["format_version"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_heads(tmp_path, dtype=model.dtype)
    assert loaded.config.draftheads_version is None and not loaded.config.owns_lm_head
    assert loaded.config.expected_tau_on == "held_out"  # what every checkpoint before format 4 fitted on
    hidden = torch.randn(3, model.config.hidden_size, dtype=model.dtype)
    assert torch.equal(heads.bind(model.lm_head.weight)(hidden), loaded.bind(model.lm_head.weight)(hidden))


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "checkpoints").iterdir()))
def test_shipped_checkpoints_read_with_their_extras(name):
    """Shipped checkpoints keep default_budget / expected_tau in ``extra`` (formats 1-2): they
    load into the typed fields of format 3, and ``extra`` no longer holds them."""
    config = read_config(REPO / "checkpoints" / name)
    assert config.default_budget == 4 and config.expected_tau
    assert "default_budget" not in config.extra and "expected_tau" not in config.extra
    assert config.base_fingerprint["lm_head_sha256"]


def test_wrong_base_names_both_fingerprints_and_both_ids(tmp_path):
    heads = random_heads(tiny_llama(0))
    heads.save_pretrained(tmp_path)
    other = tiny_llama(1)
    other.name_or_path = "tiny/base-1"
    with pytest.raises(CheckpointError) as err:
        DraftHeadsModel.from_pretrained(tmp_path, base=other)
    message = str(err.value)
    assert "tiny/base-0" in message and "tiny/base-1" in message
    assert fingerprint(tiny_llama(0)).lm_head_sha256 in message and fingerprint(other).lm_head_sha256 in message


def test_owned_lm_head_is_refused_by_families_without_it():
    with pytest.raises(CheckpointError, match="'hydra' family reads out through the base's shared LM head only"):
        HydraHeads(HeadConfig(num_heads=2, hidden_size=8, vocab_size=10, owns_lm_head=True))


def test_save_over_a_file_is_refused(tmp_path):
    (tmp_path / "ckpt").write_text("not a folder")
    with pytest.raises(CheckpointError, match="is a file"):
        random_heads(tiny_llama(0)).save_pretrained(tmp_path / "ckpt")
    assert leftovers(tmp_path) == []
