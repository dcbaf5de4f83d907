"""Record the EAGLE-3 layouts the real packages write, as the fixture the default suite compares
``draftheads export --to speculators | specforge`` with (``tests/data/eagle3_layouts.json``;
regenerated here, never edited by hand).

The packages make the layouts themselves: speculators' ``Eagle3DraftModel.save_pretrained`` and
SpecForge's ``LlamaForCausalLMEagle3.save_pretrained`` (the embedding dropped, as SpecForge's SGLang
exporter drops it), for a SmolLM2-135M-shaped draft (d 576, 9 heads, 3 KV heads, head_dim 64, MLP
1536, vocabulary 49,152, draft vocabulary 8,192, layers 2/15/27). Recorded per layout: every tensor's
name, dtype and shape — each dimension written as the size it is (``hidden_size``,
``3*hidden_size``, ``draft_vocab_size``...), so a test scales it to any base — and config.json's
keys, nested keys and the values that do not depend on the base (:data:`VARIABLE` lists those that do).

    # an environment with speculators and specforge importable (their wheels need not be installed:
    # PYTHONPATH to the unpacked wheels works), e.g.
    PYTHONPATH=/tmp/eagle3/src/speculators:/tmp/eagle3/src/specforge:/tmp/eagle3/deps \\
        python scripts/eagle3_layout_fixture.py
    # or from folders those packages wrote:
    python scripts/eagle3_layout_fixture.py --speculators DIR --specforge DIR
"""
from __future__ import annotations

import argparse
import json
import tempfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "data" / "eagle3_layouts.json"
#: the draft the packages build (SmolLM2-135M's shape; draftheads' shipped recipe)
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192, hidden_act="silu",
             tie_word_embeddings=False, rope_theta=100000.0, attention_bias=False, mlp_bias=False)
DRAFT_VOCAB, LAYERS, VERIFIER = 8192, [2, 15, 27], "HuggingFaceTB/SmolLM2-135M-Instruct"
#: a shape's sizes by name, first match wins (the values below are distinct for SHAPE)
SIZES = ("hidden_size", "2*hidden_size", "3*hidden_size", "intermediate_size", "num_key_value_heads*head_dim",
         "draft_vocab_size", "vocab_size")
#: config entries (dotted paths; the speculators layer config's by their own names) whose values come
#: from the base, the heads or the exporter's choice rather than the layout: their keys are
#: recorded, their values are not
VARIABLE = {"vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "rope_parameters.rope_theta", "rope_theta", "bos_token_id",
            "eos_token_id", "pad_token_id", "draft_vocab_size", "dtype", "transformers_version",
            "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "speculators_config.verifier.name_or_path",
            "speculators_config.verifier.architectures", "speculators_config.proposal_methods.0.speculative_tokens"}
#: what draftheads' export leaves out of the package's layout, and why (the test allows exactly these)
LEFT_OUT = {"speculators": {"auto_map": "names the config.py speculators saves beside it, which imports speculators; "
                                        "vLLM and speculators dispatch on speculators_model_type instead"},
            "specforge": {}}


def size_names(config: dict) -> dict[int, str]:
    values = {"hidden_size": config["hidden_size"], "2*hidden_size": 2 * config["hidden_size"],
              "3*hidden_size": 3 * config["hidden_size"], "intermediate_size": config["intermediate_size"],
              "num_key_value_heads*head_dim": config["num_key_value_heads"] * config["head_dim"],
              "draft_vocab_size": config["draft_vocab_size"], "vocab_size": config["vocab_size"]}
    names: dict[int, str] = {}
    for name in SIZES:
        names.setdefault(values[name], name)
    assert len(names) == len(SIZES), f"sizes coincide, the rule would be ambiguous: {values}"
    return names


def flatten(value, prefix: str = "") -> dict:
    """{dotted path: leaf value} of a JSON value (list items by index)."""
    if isinstance(value, dict) and value:
        return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}{key}.").items()}
    if isinstance(value, list) and value and all(isinstance(i, dict) for i in value):
        return {k: v for n, item in enumerate(value) for k, v in flatten(item, f"{prefix}{n}.").items()}
    return {prefix.rstrip("."): value}


def describe(folder: Path, layer_config: str | None) -> dict:
    """A saved layout → its tensors (symbolic shapes) and config structure."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    sizes = dict(config[layer_config]) if layer_config else dict(config)
    sizes["draft_vocab_size"] = config["draft_vocab_size"]
    names = size_names(sizes)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {name: {"shape": [names[n] for n in f.get_slice(name).get_shape()],
                          "dtype": str(f.get_tensor(name).dtype).removeprefix("torch.")} for name in sorted(f.keys())}
    flat = flatten(config)
    return {"tensors": tensors, "config_keys": sorted(flat),
            "constants": {path: value for path, value in sorted(flat.items()) if not variable(path)}}


def variable(path: str) -> bool:
    """Whether a config entry's value depends on the base, the heads or the exporter (:data:`VARIABLE`;
    the layer config's entries by their own names)."""
    return path in VARIABLE or path.removeprefix("transformer_layer_config.") in VARIABLE


def make_speculators(out: Path) -> None:
    """speculators builds and saves its own EAGLE-3 draft (norm_before_residual as draftheads exports it)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    config = Eagle3SpeculatorConfig(
        transformer_layer_config=LlamaConfig(**SHAPE), draft_vocab_size=DRAFT_VOCAB, norm_before_residual=False,
        target_hidden_size=None, eagle_aux_hidden_state_layer_ids=LAYERS,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=VERIFIER, architectures=["LlamaForCausalLM"])))
    config.transformer_layer_config._attn_implementation = "eager"
    Eagle3DraftModel(config).save_pretrained(str(out))


def make_specforge(out: Path) -> None:
    """SpecForge builds its draft; saved without the embedding, as its SGLang exporter writes it."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    config = LlamaConfig(architectures=["LlamaForCausalLMEagle3"], pad_token_id=0, **SHAPE)
    config.draft_vocab_size = DRAFT_VOCAB
    model = LlamaForCausalLMEagle3(config)
    kept = {k: v for k, v in model.state_dict().items() if "embed" not in k.lower()}
    model.save_pretrained(str(out), state_dict=kept)


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speculators", type=Path, default=None, help="a folder speculators saved (default: make one)")
    parser.add_argument("--specforge", type=Path, default=None, help="a folder SpecForge saved (default: make one)")
    parser.add_argument("--out", type=Path, default=FIXTURE)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        made = []
        if args.speculators is None:
            args.speculators = Path(tmp) / "speculators"
            make_speculators(args.speculators)
            made.append("speculators")
        if args.specforge is None:
            args.specforge = Path(tmp) / "specforge"
            make_specforge(args.specforge)
            made.append("specforge")
        layouts = {"speculators": describe(args.speculators, "transformer_layer_config"),
                   "specforge": describe(args.specforge, None)}
    import transformers

    fixture = {"recorded_by": "scripts/eagle3_layout_fixture.py (regenerate there; never edit by hand)",
               "made_here_by_the_packages": made,
               "packages": {"speculators": version("speculators"), "specforge": version("specforge"),
                            "transformers": transformers.__version__, "torch": torch.__version__},
               "shape_rule": "each tensor dimension is named by the size it equals: " + ", ".join(SIZES),
               "variable_config_entries": sorted(VARIABLE), "left_out_by_draftheads": LEFT_OUT, "layouts": layouts}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_name(args.out.name + ".tmp")
    tmp_out.write_text(json.dumps(fixture, indent=1) + "\n")
    tmp_out.replace(args.out)  # whole or not at all
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
