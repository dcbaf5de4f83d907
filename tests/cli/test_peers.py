"""``draftheads bench --peers`` (draftheads/bench/peers.py): CPU engines as columns of the bs-1
bench — each peer's tokens/s beside HF's and draftheads', its tokens compared with HF's greedy
ones; a peer not installed is one line naming the install command; bad input is one line."""
from __future__ import annotations

import json

import pytest

from draftheads.bench import peers
from draftheads.core.errors import InputError


def test_a_peer_that_is_not_installed_is_one_line_saying_how_to_install_it(monkeypatch):
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    lines: list[str] = []
    assert peers.load_peers(("llama.cpp",), None, [2], log=lines.append) == {}
    assert lines == ['peer llama.cpp: not installed; to compare with it: pip install -e ".[peers]"  (llama-cpp-python)']


@pytest.mark.parametrize("argv, message", [
    (["--peers", "vllm"], "argument --peers: unknown peer(s) vllm; choose from llama.cpp, openvino."),
    (["--peers", ","], "argument --peers: unknown peer(s) (none given); choose from llama.cpp, openvino."),
    (["--peers", "llama.cpp", "--batch-sizes", "1,2"], "--peers compares engines in the bs-1 bench: drop --batch-sizes."),
])
def test_bad_peer_options_are_one_line(capsys, argv, message):
    from draftheads.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--prompts", "mt-bench@1", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_base_not_loaded_from_a_gguf_names_what_to_pass(tmp_path):
    base = type("Base", (), {"name_or_path": str(tmp_path)})()
    with pytest.raises(InputError, match=r"was not loaded from a GGUF file; pass --base a \.gguf"):
        peers.source_gguf(base)
    (tmp_path / "draftheads_source.json").write_text(json.dumps({"gguf": str(tmp_path / "gone.gguf")}))
    with pytest.raises(InputError, match=r"gone\.gguf is gone"):
        peers.source_gguf(base)


def test_peers_are_columns_of_the_bench_with_tokens_compared_to_hf(tmp_path, monkeypatch, capsys):
    """Two stand-in engines through the real bench on a tiny base in float64: one decodes as HF's
    greedy generate does (same tokens on every prompt), one changes its third token; each gets
    tokens/s, its speedup over HF and draftheads' over it, and the prompts where it matched HF."""
    from draftheads.bench.runs import hf_greedy
    from helpers import tiny_peer_bench

    def engine(change: bool):
        def load(base, eos):
            def run(ids, max_new_tokens):
                out = hf_greedy(base, ids, max_new_tokens)
                if change:
                    out = out.clone()
                    out[0, ids.shape[1] + 2] = (out[0, ids.shape[1] + 2] + 1) % 90 + 3
                return out, 0.01, 0.002
            return run
        return load

    for name, change in (("same", False), ("other", True)):
        monkeypatch.setitem(peers.PEERS, name, ("json", "pip install nothing"))
        monkeypatch.setitem(peers.LOADERS, name, engine(change))
    results = tiny_peer_bench(tmp_path, monkeypatch, "same,other", "float64", 10)
    for row in results["per_prompt"]:
        assert row["peers"]["same"]["same_as_hf"] and row["peers"]["same"]["first_difference"] is None
        assert not row["peers"]["other"]["same_as_hf"] and row["peers"]["other"]["first_difference"] == 2
    overall = results["overall"]["peers"]
    assert overall["same"]["same_as_hf_prompts"] == 2 and overall["other"]["same_as_hf_prompts"] == 0
    ours = results["overall"]["draftheads_tokens_per_second"]
    assert overall["same"]["draftheads_vs_peer"] == pytest.approx(ours / overall["same"]["tokens_per_second"], abs=1e-4)
    later = sum(r["peers"]["same"]["new_tokens"] - 1 for r in results["per_prompt"])
    assert overall["same"]["decode_ms_per_token"] == pytest.approx(2 * 8.0 / later, rel=1e-3)
    ours = [r["draftheads"] for r in results["per_prompt"]]
    decode_ms = 1e3 * sum(r["seconds"] - r["prefill_seconds"] for r in ours) / sum(r["verify_steps"] for r in ours)
    assert 0 < ours[0]["prefill_seconds"] < ours[0]["seconds"]
    assert overall["same"]["draftheads_ms_per_verify_step"] == pytest.approx(decode_ms, rel=1e-2)
    table = capsys.readouterr().out
    assert "| same |" in table and "| 2/2 |" in table and "| other |" in table and "| 0/2 |" in table


def test_the_peer_file_holds_the_base_weights_in_the_bench_dtype(tmp_path, monkeypatch):
    """A Q4_1 + Q8_0 + F32 GGUF written here: its bf16 / float32 copies hold every matrix's
    dequantized values rounded to the dtype as torch rounds them, keep the norms and the
    metadata, are reused when sound and written again when damaged."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    import torch
    from draftheads.bench.peer_gguf import typed_gguf

    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    source = tmp_path / "tiny.Q4_1.gguf"
    writer = gguf.GGUFWriter(source, arch="llama")
    writer.add_block_count(1)
    writer.add_file_type(3)
    matrices = {"blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q4_1, "token_embd.weight": gguf.GGMLQuantizationType.Q8_0}
    for name, kind in matrices.items():
        writer.add_tensor(name, gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), kind), raw_dtype=kind)
    norm = rng.standard_normal(64).astype(np.float32)
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    original = {t.name: t for t in gguf.GGUFReader(source).tensors}
    lines: list[str] = []
    for dtype, kind in ((torch.bfloat16, "BF16"), (torch.float32, "F32")):
        path = typed_gguf(source, dtype, log=lines.append)
        reader = gguf.GGUFReader(path)
        assert reader.fields["general.file_type"].contents() == {"BF16": 32, "F32": 0}[kind]
        assert reader.fields["llama.block_count"].contents() == 1
        tensors = {t.name: t for t in reader.tensors}
        for name in matrices:
            expected = torch.from_numpy(gguf.quants.dequantize(original[name].data, original[name].tensor_type).copy()).to(dtype)
            assert tensors[name].tensor_type.name == kind
            stored = torch.from_numpy(np.array(tensors[name].data).view(np.uint16 if kind == "BF16" else np.float32))
            assert torch.equal(stored.view(dtype).reshape(expected.shape), expected)
        assert np.array_equal(np.array(tensors["blk.0.attn_norm.weight"].data), norm)
        assert typed_gguf(source, dtype, log=lines.append) == path  # sound: reused
    assert sum("writing" in line for line in lines) == 2
    path.write_bytes(b"GGUF not really")
    assert typed_gguf(source, torch.float32, log=lines.append) == path
    assert "is unusable" in lines[-2] and gguf.GGUFReader(path).tensors
    with pytest.raises(InputError, match="no GGUF tensor type for torch.float64"):
        typed_gguf(source, torch.float64)
