"""Hub ids: loading from a populated Hub cache with no network at all, pinned revisions,
clear errors when not cached offline, and ``push_to_hub`` uploading exactly what
``save_pretrained`` writes (HfApi replaced by a recorder: no network)."""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants, scan_cache_dir, try_to_load_from_cache
from huggingface_hub.file_download import repo_folder_name

from helpers import tiny_llama
from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import CheckpointError, HeadConfig, MedusaHeads, load_heads
from draftheads.heads.checkpoint.hub import upload_checkpoint

REPO_ID = "someone/tiny-medusa"


def trained_heads(model, seed: int) -> MedusaHeads:
    cfg = model.config
    heads = MedusaHeads(HeadConfig(num_heads=3, num_layers=1, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                                   base_fingerprint=fingerprint(model).to_dict(), trees={"3": [[0], [1], [0, 0]]}))
    torch.manual_seed(seed)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return heads.double()


def add_to_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str, ref: str | None = "main") -> None:
    """Lay a snapshot out as the Hub cache does (huggingface_hub's documented layout, folder name
    from its own ``repo_folder_name``): blobs by content hash, ``snapshots/<commit>/`` linking to
    them, ``refs/<ref>`` holding the commit."""
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        blob = storage / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    if ref:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / ref).write_text(commit)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_hub_id_loads_from_the_cache_without_network(tmp_path, monkeypatch, no_network):
    """HF_HUB_OFFLINE=1 and every socket refused: the cache alone serves the Hub id."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = tiny_llama(0)
    old, new = "a" * 40, "b" * 40
    for seed, commit in ((0, old), (1, new)):
        trained_heads(model, seed).save_pretrained(tmp_path / f"ckpt{seed}", dtype=None)
        add_to_hub_cache(tmp_path / "cache", REPO_ID, tmp_path / f"ckpt{seed}", commit, ref=None)
    (tmp_path / "cache" / repo_folder_name(repo_id=REPO_ID, repo_type="model") / "refs").mkdir()
    (tmp_path / "cache" / repo_folder_name(repo_id=REPO_ID, repo_type="model") / "refs" / "main").write_text(new)
    # huggingface_hub itself sees a valid cache
    [repo] = scan_cache_dir(tmp_path / "cache").repos
    assert repo.repo_id == REPO_ID and {r.commit_hash for r in repo.revisions} == {old, new}
    assert try_to_load_from_cache(REPO_ID, "config.json", cache_dir=tmp_path / "cache") is not None

    prompt = torch.tensor([[3, 4, 5, 6]])
    for seed, revision in ((1, None), (0, old)):  # main → the newest commit; a pinned revision → that one
        hub = DraftHeadsModel.from_pretrained(REPO_ID, base=model, tree=3, cache_dir=tmp_path / "cache",
                                              revision=revision)
        local = DraftHeadsModel.from_pretrained(tmp_path / f"ckpt{seed}", base=model, tree=3)
        hidden = torch.randn(2, model.config.hidden_size, dtype=torch.float64)
        assert torch.equal(hub.heads(hidden), local.heads(hidden))
        assert hub.generate(prompt, max_new_tokens=16).tolist() == local.generate(prompt, max_new_tokens=16).tolist()


def test_uncached_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch, no_network):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match=r"'someone/absent' is no local folder, and as a Hub id it is not in "
                                              r"the local Hugging Face cache .*HF_HUB_OFFLINE=1"):
        load_heads("someone/absent", cache_dir=tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(CheckpointError, match=r"revision 'v2'.*local_files_only=True"):
        load_heads("someone/absent", cache_dir=tmp_path, revision="v2", local_files_only=True)


class RecordingHfApi:
    """Stands in for ``huggingface_hub.HfApi``: records calls and a copy of the uploaded folder."""

    calls: list = []

    def __init__(self, token=None, **_):
        self.token = token

    def create_repo(self, repo_id, **kwargs):
        RecordingHfApi.calls.append(("create_repo", repo_id, kwargs, self.token))

    def upload_folder(self, folder_path, repo_id, **kwargs):
        files = {p.name: p.read_bytes() for p in Path(folder_path).iterdir()}
        RecordingHfApi.calls.append(("upload_folder", repo_id, kwargs, files))
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/c0ffee"})()


def test_push_to_hub_uploads_exactly_the_saved_folder(tmp_path, monkeypatch, no_network):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the Hub is mocked: pass where the shell sets it
    RecordingHfApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHfApi)
    heads = trained_heads(tiny_llama(0), 0)
    url = heads.push_to_hub(REPO_ID, dtype=None, token="hf_test", private=True)
    assert url == f"https://huggingface.co/{REPO_ID}/commit/c0ffee"
    (create, repo_id, kwargs, token), (upload, repo_id2, upload_kwargs, files) = RecordingHfApi.calls
    assert (create, repo_id, kwargs["private"], kwargs["exist_ok"], token) == ("create_repo", REPO_ID, True, True,
                                                                               "hf_test")
    assert (upload, repo_id2) == ("upload_folder", REPO_ID)
    saved = heads.save_pretrained(tmp_path / "local", dtype=None)
    assert files == {p.name: p.read_bytes() for p in saved.iterdir()}
    assert set(files) == {"config.json", "model.safetensors", "README.md"}


def test_uploading_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path, monkeypatch):
    RecordingHfApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHfApi)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"not a head checkpoint \(missing \['model.safetensors'\]\)"):
        upload_checkpoint(tmp_path, REPO_ID)
    assert RecordingHfApi.calls == []
