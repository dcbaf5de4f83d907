"""Export EAGLE-3 heads (:mod:`draftheads.heads.eagle3`) in the two layouts serving engines load.

Both hold the same tensors (``nn.Linear`` weights (out, in)): ``fc.weight`` (d, 3d), the layer's
``{input_layernorm, hidden_norm, post_attention_layernorm}.weight``,
``self_attn.{q,k,v,o}_proj.weight`` and ``mlp.{gate,up,down}_proj.weight``, ``norm.weight``,
``lm_head.weight`` (DV, d) — the base's LM-head rows at the heads' draft vocabulary, gathered in
ascending token order — ``d2t`` (DV,) int64 (target id = i + d2t[i]) and ``t2d`` (V,) bool (a
full-vocabulary draft writes neither: vLLM then has no map to load them into).

``speculators`` (speculators 0.9.0's ``save_pretrained``, ``speculators_model_type: eagle3``; vLLM
reads it as ``LLM(base, speculative_config={"model": OUT, "method": "eagle3", ...})`` or ``vllm
serve OUT``): the layer as ``layers.0.*``, plus ``embed_tokens.weight`` (the base's input
embeddings; vLLM shares the target's when equal); config.json with ``transformer_layer_config`` (a
one-layer Llama of the draft layer's shape), ``eagle_aux_hidden_state_layer_ids`` = the heads'
``feature_layers`` (transformers' ``output_hidden_states`` numbering, which is vLLM's: id k is the
residual stream entering layer k), ``norm_before_residual: false`` (the layer's residual is the
un-normed fused state; vLLM reads a missing key as true), ``norm_output: false``.

``specforge`` (SpecForge 0.2.0's ``LlamaForCausalLMEagle3``, which SGLang loads): the layer as
``midlayer.*``, no embedding (engines use the target's); config.json a flat Llama config plus
``draft_vocab_size`` and ``rope_theta`` (as SpecForge's exporter mirrors it). SpecForge and SGLang
number captured layers one lower (j = layer j's output = our j + 1): heads reading EAGLE-3's default
layers (2, L // 2, L − 3 — the same states in vLLM's, SGLang's and SpecForge's defaults) get no
``eagle_config``, so every engine reads the right states; other layers are written in SGLang's
numbering (``eagle_config.eagle_aux_hidden_state_layer_ids``), which vLLM would read one layer
early — serve such heads in vLLM from the speculators layout.

Both layouts read exactly three base layers and a Llama layer (vLLM's ``Eagle3LlamaForCausalLM``
computes what :class:`~draftheads.heads.eagle3.Eagle3Layer` does: [input_layernorm(embedding);
hidden_norm(g)] into q/k/v, residual g, neox-style RoPE at ``rope_theta``, scale head_dim^-½,
gated SiLU MLP, final norm, LM head; ``tests/heads/checkpoint/test_eagle3_export.py`` re-implements
vLLM 0.32's forward over the written folder and compares logits)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..head_config import DRAFTHEADS_VERSION
from ..protocol import DraftHeads
from ...core.atomic import atomic_directory, check_output_dir
from .vllm_export import EAGLE3_TARGETS, ExportError, check_exportable

#: the speculators schema the speculators layout follows (written as ``speculators_version``)
SPECULATORS_VERSION = "0.9.0"
#: the layer's tensors, as the engines name them below ``layers.0.`` / ``midlayer.``
LAYER_TENSORS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
LAYER_PREFIX = {"speculators": "layers.0.", "specforge": "midlayer."}


def engine_default_layers(num_hidden_layers: int) -> list[int]:
    """The layers vLLM (2, L // 2, L − 3), SGLang and SpecForge read when a draft names none, in
    our numbering (SmolLM2's 30 → [2, 15, 27])."""
    return [2, num_hidden_layers // 2, num_hidden_layers - 3]


def text_config(base):
    """The base's language-model config (a multimodal model's text part)."""
    config = base.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_eagle3_exportable(heads: DraftHeads, to: str, num_hidden_layers: int | None = None) -> None:
    """Refuse, in one line naming the fix, what the layout cannot hold (before a base loads;
    ``num_hidden_layers``: the base's, when known)."""
    check_exportable(heads, to)  # the target is known and the family is EAGLE-3
    layers = list(heads.feature_layers)
    if not layers:
        raise ExportError(f"These EAGLE-3 heads' config.json names no feature_layers, the base layers the {to} "
                          "layout's fc reads: set feature_layers in the checkpoint's config.json to the layers they "
                          "were trained on (EAGLE-3's default for a 30-layer base: [2, 15, 27]).")
    if len(layers) != 3:
        raise ExportError(f"These EAGLE-3 heads read {len(layers)} base layer(s) {layers}, but the {to} layout's fc "
                          "reads exactly three (vLLM 0.32 sizes it for three, SpecForge requires three): train "
                          "EAGLE-3 heads on three feature_layers.")
    if num_hidden_layers is not None and layers[-1] >= num_hidden_layers:
        raise ExportError(f"These EAGLE-3 heads read base layer {layers[-1]}, but this base has {num_hidden_layers} "
                          f"layers (0-{num_hidden_layers - 1} can be read): export with the base they were trained on "
                          "(--base).")
    if (to == "specforge" and layers[0] == 0 and num_hidden_layers is not None
            and layers != engine_default_layers(num_hidden_layers)):
        raise ExportError(f"These EAGLE-3 heads read base layer 0 (the embeddings), which SpecForge and SGLang cannot "
                          "name (they number layer outputs): export them with --to speculators for vLLM.")
    names = {name for name, _ in heads.named_parameters()}
    expected = {"fc.weight", "norm.weight", *(f"midlayer.{t}" for t in LAYER_TENSORS)}
    if names != expected:
        raise ExportError(f"These EAGLE-3 heads hold parameters the {to} layout has no place for "
                          f"({sorted(names ^ expected)}): export heads of this draftheads version's EAGLE-3 layer.")
    ids = heads.vocab_ids
    if ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= heads.config.vocab_size:
        raise ExportError("These heads' draft vocabulary (vocab_ids) repeats a token or names one outside the base's "
                          "vocabulary, which d2t cannot express: re-save the checkpoint with distinct vocab_ids.")


def layer_shape(heads: DraftHeads) -> dict:
    """The draft layer's shape read off the module (what the engine must build)."""
    layer = heads.midlayer
    eps = {m.eps for m in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, heads.norm)}
    if len(eps) != 1 or None in eps:
        raise ExportError(f"These EAGLE-3 heads' norms use different eps {sorted(map(str, eps))}, but engines build "
                          "every norm with one rms_norm_eps: export heads whose norms share one eps.")
    return {"hidden_size": heads.config.hidden_size, "intermediate_size": layer.mlp.gate_proj.out_features,
            "num_attention_heads": layer.heads, "num_key_value_heads": layer.kv_heads, "head_dim": layer.head_dim,
            "rms_norm_eps": float(eps.pop()), "rope_theta": float(layer.theta)}


def eagle3_tensors(heads: DraftHeads, layout: str, lm_head_weight: torch.Tensor, embed_weight: torch.Tensor | None,
                   dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The layout's tensor names → tensors (each its own storage, as safetensors requires);
    ``lm_head_weight`` / ``embed_weight`` (V, d): the base's."""
    def out(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().cpu()
        return (t.to(dtype) if dtype is not None and t.is_floating_point() else t).clone().contiguous()

    cfg = heads.config
    prefix = LAYER_PREFIX[layout]
    parameters = dict(heads.midlayer.named_parameters())
    tensors = {"fc.weight": out(heads.fc.weight), **{prefix + name: out(parameters[name]) for name in LAYER_TENSORS},
               "norm.weight": out(heads.norm.weight)}
    ids = heads.vocab_ids.detach().cpu().long().sort().values  # ascending: d2t non-decreasing, as the engines make it
    lm_head = lm_head_weight.detach()
    tensors["lm_head.weight"] = out(lm_head.index_select(0, ids.to(lm_head.device)))
    if cfg.draft_vocab_size and cfg.draft_vocab_size != cfg.vocab_size:
        tensors["d2t"] = (ids - torch.arange(ids.numel())).contiguous()
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    if layout == "speculators":
        if embed_weight is None:
            raise ExportError("The speculators layout carries the base's input embeddings: pass the base.")
        tensors["embed_tokens.weight"] = out(embed_weight)
    return tensors


def layer_config(heads: DraftHeads, base_config, shape: dict) -> dict:
    """The one-layer Llama config both layouts hold (the keys transformers' ``LlamaConfig`` saves)."""
    import transformers

    return {"model_type": "llama", "vocab_size": heads.config.vocab_size, "hidden_size": shape["hidden_size"],
            "intermediate_size": shape["intermediate_size"], "num_hidden_layers": 1,
            "num_attention_heads": shape["num_attention_heads"], "num_key_value_heads": shape["num_key_value_heads"],
            "head_dim": shape["head_dim"], "hidden_act": "silu", "rms_norm_eps": shape["rms_norm_eps"],
            "max_position_embeddings": int(getattr(base_config, "max_position_embeddings", 2048)),
            "rope_parameters": {"rope_theta": shape["rope_theta"], "rope_type": "default"},
            "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "initializer_range": 0.02,
            "pretraining_tp": 1, "tie_word_embeddings": False, "use_cache": True,
            "bos_token_id": getattr(base_config, "bos_token_id", None),
            "eos_token_id": getattr(base_config, "eos_token_id", None),
            "pad_token_id": getattr(base_config, "pad_token_id", None),
            "transformers_version": transformers.__version__}


def provenance(heads: DraftHeads, layout: str) -> dict:
    """The ``draftheads`` entry: marks the folder as ours (a later export may replace it)."""
    cfg = heads.config
    return {"version": DRAFTHEADS_VERSION, "family": heads.family, "layout": layout, "base_name": cfg.base_name,
            "base_fingerprint": cfg.base_fingerprint, "feature_layers": list(heads.feature_layers)}


def dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    return str(tensors["fc.weight"].dtype).removeprefix("torch.")


def speculators_config(heads: DraftHeads, base, shape: dict, verifier: str, dtype: str) -> dict:
    layer = layer_config(heads, text_config(base), shape)
    return {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": heads.num_heads,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": verifier,
                             "architectures": list(getattr(base.config, "architectures", None) or [])}},
            "transformer_layer_config": layer,
            "draft_vocab_size": int(heads.vocab_ids.numel()), "norm_before_residual": False,
            "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": list(heads.feature_layers),
            "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
            "tie_word_embeddings": False, "dtype": dtype,
            "transformers_version": layer["transformers_version"],
            "draftheads": provenance(heads, "speculators")}


def specforge_config(heads: DraftHeads, base, shape: dict, dtype: str) -> dict:
    base_config = text_config(base)
    config = {"architectures": ["LlamaForCausalLMEagle3"], **layer_config(heads, base_config, shape),
              "draft_vocab_size": int(heads.vocab_ids.numel()), "rope_theta": shape["rope_theta"], "dtype": dtype}
    layers = list(heads.feature_layers)
    if layers != engine_default_layers(int(base_config.num_hidden_layers)):  # SGLang/SpecForge numbering: ours − 1
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [layer - 1 for layer in layers],
                                  "use_aux_hidden_state": True}
    config["draftheads"] = provenance(heads, "specforge")
    return config


def export_eagle3(heads: DraftHeads, layout: str, base, out: str | Path, dtype: torch.dtype | None = None,
                  beside: bool = False, verifier: str | None = None) -> Path:
    """Write ``out`` (atomically) in ``layout`` ("speculators" or "specforge") for ``base``, the
    transformers model the heads were trained on (its config, LM head and embeddings are read);
    ``verifier``: how the speculators layout names the base (default: ``base.name_or_path``, the
    local folder or Hub id it was loaded from, else the heads' ``base_name``). Returns where it went
    (``beside``: next to a folder of someone else's, :class:`~draftheads.core.atomic.atomic_directory`)."""
    from safetensors.torch import save_file

    if layout not in EAGLE3_TARGETS:
        raise ExportError(f"Unknown EAGLE-3 layout {layout!r}; known: {list(EAGLE3_TARGETS)}.")
    base_config = text_config(base)
    check_eagle3_exportable(heads, layout, int(base_config.num_hidden_layers))
    lm_head = base.get_output_embeddings().weight
    if tuple(lm_head.shape) != (heads.config.vocab_size, heads.config.hidden_size):
        raise ExportError(f"These heads were made for a base with an LM head of ({heads.config.vocab_size}, "
                          f"{heads.config.hidden_size}), but this base's is {tuple(lm_head.shape)}: export with the "
                          "base they were trained on (--base).")
    check_output_dir(out, heads.checkpoint_dir)  # never over the checkpoint it reads
    shape = layer_shape(heads)
    tensors = eagle3_tensors(heads, layout, lm_head, base.get_input_embeddings().weight, dtype)
    if layout == "speculators":
        verifier = verifier or str(getattr(base, "name_or_path", "") or "") or heads.config.base_name
        if not verifier:
            raise ExportError("The speculators layout names its verifier (the base vLLM loads with it), but this base "
                              "was not loaded from a folder or Hub id: pass verifier= its folder or Hub id.")
        config = speculators_config(heads, base, shape, verifier, dtype_name(tensors))
    else:
        config = specforge_config(heads, base, shape, dtype_name(tensors))
    writer = atomic_directory(out, beside=beside)
    with writer as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return writer.target if beside else Path(out)


def export_speculators(heads: DraftHeads, base, out: str | Path, dtype: torch.dtype | None = None,
                       beside: bool = False, verifier: str | None = None) -> Path:
    """``draftheads export --to speculators``: :func:`export_eagle3` in speculators' layout (vLLM)."""
    return export_eagle3(heads, "speculators", base, out, dtype, beside, verifier)


def export_specforge(heads: DraftHeads, base, out: str | Path, dtype: torch.dtype | None = None,
                     beside: bool = False) -> Path:
    """``draftheads export --to specforge``: :func:`export_eagle3` in SpecForge's layout (SGLang, vLLM)."""
    return export_eagle3(heads, "specforge", base, out, dtype, beside)
