"""Export head checkpoints to the formats vLLM's speculators load.

``vllm-medusa`` — vLLM's ``Medusa`` draft model (``vllm/model_executor/models/medusa.py``,
config ``vllm/transformers_utils/configs/medusa.py``), as vLLM 0.32's own loader takes it:

* ``config.json``: ``model_type: medusa``, ``architectures: [MedusaModel]``, ``hidden_size``,
  ``vocab_size``, ``num_heads``, ``num_hidden_layers``, ``medusa_fc_bias`` (our ResBlocks have a
  bias; vLLM's default is none), ``truncated_vocab_size`` = ``vocab_size`` and ``original_lm_head``.
* ``model.safetensors``: ``blocks.{i}.layers.{j}.weight`` (d, d) / ``.bias`` (d,), and the readout
  over the **whole vocabulary**: heads that read out through the base's LM head get it once as
  ``lm_heads.0.weight`` (V, d) with ``original_lm_head: true`` (vLLM reads the draft's LM head
  from the draft checkpoint); heads owning full-vocabulary projections get ``lm_heads.{i}.weight``.
* No draft vocabulary: vLLM 0.32's loader asserts every LM head has ``vocab_size`` rows and never
  marks a ``token_map`` loaded (its strict check then refuses the folder), so heads that read out
  through the base's LM head over a draft vocabulary are exported reading all V rows (on the draft
  vocabulary the logits are draftheads' own; a token outside it may now be drafted), and heads
  owning draft-vocabulary projections are refused by name.

``vllm-mlp-speculator`` — refused for every draftheads family, with the reason
(:data:`MLP_SPECULATOR_REASON`): no family here computes what an MLPSpeculator stage computes.

``speculators`` / ``specforge`` — the EAGLE-3 family's layouts (:mod:`.eagle3_export`); this
module refuses every other family for them, and EAGLE-3 heads for ``vllm-medusa``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..head_config import DRAFTHEADS_VERSION
from ...core.errors import CheckpointError
from ..protocol import DraftHeads
from ...core.atomic import atomic_directory, check_output_dir

#: the EAGLE-3 family's layouts (:mod:`.eagle3_export`, which needs the base's config and embeddings)
EAGLE3_TARGETS = ("speculators", "specforge")
TARGETS = ("vllm-medusa", "vllm-mlp-speculator", *EAGLE3_TARGETS)
#: the families each target can express (the refusals list them)
EXPRESSIBLE = {"vllm-medusa": ("medusa",), "vllm-mlp-speculator": (), "speculators": ("eagle3",),
               "specforge": ("eagle3",)}

MLP_SPECULATOR_REASON = (
    "vLLM's MLPSpeculator stage k computes s_k = GELU(RMSNorm_k(P_k s_(k-1) + c·E_k[x_k])) and logits H_k s_k: "
    "it sees only its previous stage's normalised state and the one token drafted last, through its own "
    "embedding table. A Hydra head k computes ResBlocks(h_t + W[h_t; e(x_(t+1)); ...; e(x_(t+k+1))]) read out "
    "through the base's LM head: it keeps h_t on a residual path and reads every earlier path token linearly, "
    "with SiLU residual blocks and no normalisation. An RMS norm and a GELU cannot be undone, so h_t and the "
    "earlier tokens do not survive into later stages and no choice of MLPSpeculator weights reproduces Hydra's "
    "logits (Hydra++ adds a prefix attention layer and Amphista cross-head attention, neither of which an MLP "
    "stage has; Medusa heads read no token and have no norm). Export Medusa heads with --to vllm-medusa, or "
    "serve Hydra-family heads with draftheads.")


class ExportError(CheckpointError):
    """The target format cannot represent these heads."""


def medusa_tensors(heads: DraftHeads, lm_head_weight: torch.Tensor | None,
                   dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """vLLM Medusa weight names → tensors (each its own storage, as safetensors requires).
    ``lm_head_weight`` (V, d): the base's LM head, needed unless the heads own their projections."""
    cfg = heads.config

    def out(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().cpu()
        return (t.to(dtype) if dtype is not None and t.is_floating_point() else t).clone().contiguous()

    tensors = {}
    for i, head in enumerate(heads.heads):
        for j, block in enumerate(head):
            tensors[f"blocks.{i}.layers.{j}.weight"] = out(block.linear.weight)
            tensors[f"blocks.{i}.layers.{j}.bias"] = out(block.linear.bias)
    if cfg.owns_lm_head:
        tensors.update({f"lm_heads.{i}.weight": out(lm.weight) for i, lm in enumerate(heads.lm_heads)})
    else:
        if lm_head_weight is None:
            raise ExportError("These heads read out through the base's LM head, which vLLM needs inside the draft "
                              "checkpoint: pass the base (lm_head_weight=base.get_output_embeddings().weight).")
        tensors["lm_heads.0.weight"] = out(lm_head_weight)  # (V, d): every row, vLLM's original_lm_head
    return tensors


def medusa_config(heads: DraftHeads) -> dict:
    cfg = heads.config
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
            "medusa_fc_bias": True, "truncated_vocab_size": cfg.vocab_size,
            "original_lm_head": not cfg.owns_lm_head, "logit_scale": 1.0,
            "draftheads": {"version": DRAFTHEADS_VERSION, "base_name": cfg.base_name,
                           "base_fingerprint": cfg.base_fingerprint}}


def check_exportable(heads: DraftHeads, to: str, share_lm_head: bool = False) -> None:
    """Refuse, saying why, what the target format cannot represent."""
    if to not in TARGETS:
        raise ExportError(f"Unknown export target {to!r}; known: {list(TARGETS)}.")
    if to == "vllm-mlp-speculator":
        raise ExportError(f"Cannot export {heads.family!r} heads to vLLM's MLPSpeculator: {MLP_SPECULATOR_REASON}")
    takes = ", ".join(EXPRESSIBLE[to])
    if to in EAGLE3_TARGETS:
        if heads.family not in EXPRESSIBLE[to]:
            raise ExportError(f"The {to} layout holds one EAGLE-3 draft layer over fused base layers and cannot "
                              f"express {heads.family!r} heads; --to {to} takes: {takes} "
                              "(Medusa heads: --to vllm-medusa).")
        return  # the layout's own checks: eagle3_export.check_eagle3_exportable
    if heads.family == "eagle3":
        raise ExportError("vLLM's Medusa format holds independent ResBlock heads on the last hidden state and cannot "
                          "express 'eagle3' heads (a decoder layer over fused base layers, drafting autoregressively); "
                          f"--to vllm-medusa takes: {takes}. Export EAGLE-3 heads with --to speculators (vLLM) or "
                          "--to specforge (SpecForge, SGLang).")
    if heads.family not in EXPRESSIBLE[to]:
        hint = " (for Hydra-family heads, MLPSpeculator cannot represent them either; see --to vllm-mlp-speculator)" \
            if heads.family.startswith("hydra") else ""
        raise ExportError(f"vLLM's Medusa format holds independent ResBlock heads on the last hidden state; "
                          f"{heads.family!r} heads also read drafted tokens or attend across heads, which it "
                          f"cannot express{hint}; --to vllm-medusa takes: {takes}.")
    if heads.feature_layers:
        raise ExportError(f"These heads read the base's layers {list(heads.feature_layers)} beside its last hidden state; "
                          "vLLM's Medusa format reads the last hidden state only: export heads trained without "
                          "heads.feature_layers.")
    if heads.config.owns_lm_head and share_lm_head:
        raise ExportError("These heads each own their vocabulary projection: they cannot share one LM head "
                          "(drop --share-lm-head).")
    if heads.config.owns_lm_head and heads.config.draft_vocab_size:
        raise ExportError(f"These heads each own a projection over a {heads.config.draft_vocab_size}-token draft "
                          "vocabulary, which vLLM's Medusa loader cannot take (it asserts full-vocabulary LM heads "
                          "and refuses a token_map): train them with draft_vocab_size 0 or without owns_lm_head.")


def export_vllm_medusa(heads: DraftHeads, out: str | Path, lm_head_weight: torch.Tensor | None = None,
                       share_lm_head: bool = False, dtype: torch.dtype | None = None, beside: bool = False) -> Path:
    """Write ``out`` (atomically) as a vLLM Medusa draft model folder; returns where it went:
    ``out``, or with ``beside`` a sibling when ``out`` is a folder of someone else's
    (:class:`~.atomic.atomic_directory`)."""
    from safetensors.torch import save_file

    check_exportable(heads, "vllm-medusa", share_lm_head)
    check_output_dir(out, heads.checkpoint_dir)  # never over the checkpoint it reads
    tensors = medusa_tensors(heads, lm_head_weight, dtype)
    writer = atomic_directory(out, beside=beside)
    with writer as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(medusa_config(heads), indent=2) + "\n")
    return writer.target if beside else Path(out)


def export_heads(heads: DraftHeads, to: str, out: str | Path, lm_head_weight: torch.Tensor | None = None,
                 share_lm_head: bool = False, dtype: torch.dtype | None = None, beside: bool = False) -> Path:
    """``draftheads export --to TARGET``: dispatch on the target, refusing what it cannot hold
    (the EAGLE-3 layouts read the whole base: :func:`.eagle3_export.export_eagle3`)."""
    check_exportable(heads, to, share_lm_head)
    if to in EAGLE3_TARGETS:
        raise ExportError(f"--to {to} reads the base's config and embeddings: call "
                          "draftheads.heads.checkpoint.eagle3_export.export_eagle3(heads, layout, base, out).")
    return export_vllm_medusa(heads, out, lm_head_weight, share_lm_head, dtype, beside)
