"""A base whose layers are not attention (Mamba; RWKV, whose config does not say so) is refused by
every door that loads a base — ``load_base``, ``DraftHeadsModel.from_pretrained`` and the CLI
commands that take ``--base`` — in one line naming the folder and the fix, before its weights load
where its folder's config tells (decoding/base/loading.py ``check_base_architecture``); it used
to end in transformers' traceback (it has no SDPA attention)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from draftheads.cli import main
from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.base.architecture import UnsupportedBaseError
from draftheads.decoding.base.loading import load_base
from draftheads.heads import HeadConfig, MedusaHeads
from helpers import reference_heads, write_medusa


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A tiny random Mamba and RWKV saved as model folders, Medusa heads of ours and a Medusa
    checkpoint to import, a prompt file."""
    root = tmp_path_factory.mktemp("unsupported")
    transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                                           state_size=4)).save_pretrained(root / "mamba")
    transformers.RwkvForCausalLM(transformers.RwkvConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                                         attention_hidden_size=32, intermediate_size=64,
                                                         context_length=64)).save_pretrained(root / "rwkv")
    MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96)).save_pretrained(root / "heads")
    write_medusa(root / "medusa", reference_heads(32, 96, heads=2, layers=1, projection=True), 1, "safetensors")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "w5 w6"}) + "\n")
    return root


@pytest.fixture
def loads(monkeypatch, root) -> list:
    """Every model transformers' ``from_pretrained`` is asked to load, in order."""
    asked: list = []
    real = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def recorded(cls, path, *args, **kwargs):
        asked.append(str(path))
        return real(cls, path, *args, **kwargs)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(recorded))
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(root / "cache"))
    return asked


def mamba_refusal(folder: Path) -> str:
    return (f"base model '{folder}': mamba: layers of type linear_attention cannot verify a token tree (only full and "
            "sliding-window attention can); use the model's own generate().")


COMMANDS = {
    "generate": ["generate", "--prompt", "hi", "--max-new-tokens", "2", "--base", "ROOT/mamba"],
    "bench": ["bench", "--prompts", "ROOT/prompts.jsonl", "--base", "ROOT/mamba"],
    "export": ["export", "--to", "vllm-medusa", "ROOT/heads", "ROOT/out", "--base", "ROOT/mamba"],
    "import-medusa": ["import-medusa", "ROOT/medusa", "ROOT/imported", "--base", "ROOT/mamba"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_refuses_a_mamba_base_in_one_line_before_it_loads(root, loads, capsys, command):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([part.replace("ROOT", str(root)) for part in COMMANDS[command]])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [f"error: {mamba_refusal(root / 'mamba')}"]
    assert not loads, "the weights were loaded before the refusal"


def test_python_refuses_a_mamba_base_in_one_line_before_it_loads(root, loads):
    for load in (lambda: load_base(str(root / "mamba")),
                 lambda: DraftHeadsModel.from_pretrained(str(root / "heads"), base_name_or_path=str(root / "mamba"))):
        with pytest.raises(UnsupportedBaseError) as err:
            load()
        assert str(err.value) == mamba_refusal(root / "mamba")
    assert not loads


def test_a_base_without_attention_its_config_does_not_name_is_refused_in_one_line(root, loads):
    """RWKV's config lists no layer types: transformers' own refusal to give it SDPA, in one line."""
    with pytest.raises(UnsupportedBaseError, match=r"^base model '.*rwkv' cannot be loaded with attn_implementation="
                                                   r"'sdpa' \(RwkvForCausalLM does not support .*\): draftheads "
                                                   r"verifies token trees .*own generate\(\)\.$") as err:
        load_base(str(root / "rwkv"))
    assert "\n" not in str(err.value)
