"""Export to vLLM without vLLM: the written tensors go through a reference forward of vLLM's
Medusa draft model written here from its documented shapes (``blocks.{i}.layers.{j}`` residual
SiLU layers with bias when ``medusa_fc_bias``, ``lm_heads.{i}`` or the single shared
``lm_heads.0`` when ``original_lm_head``, ``token_map`` scattering truncated-vocabulary logits
into the full vocabulary with −inf elsewhere), compared with draftheads' own logits."""
from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, draftheads_full_logits, tiny_llama, vllm_medusa_reference
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import HeadConfig, HydraHeads, MedusaHeads
from draftheads.heads.checkpoint.vllm_export import ExportError, export_heads


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
                                                    (40, False, True), (0, True, False), (40, True, False)])
def test_vllm_medusa_export_reproduces_our_logits(tmp_path, draft_vocab, owns, share):
    model = tiny_llama(0)
    heads = random_medusa(model, draft_vocab, owns)
    out = export_heads(heads, "vllm-medusa", tmp_path / "vllm", model.lm_head.weight, share_lm_head=share)
    written = load_file(str(out / "model.safetensors"))
    assert sum(k.startswith("lm_heads.") for k in written) == (1 if share else 3)
    assert ("token_map" in written) == bool(draft_vocab)
    hidden = torch.randn(6, model.config.hidden_size, dtype=torch.float64)
    ref, ours = vllm_medusa_reference(out, hidden), draftheads_full_logits(heads, hidden)
    # equal up to float64 rounding (per-head vs batched matmuls sum in different orders), −inf at the same places
    assert torch.equal(ref.isinf(), ours.isinf())
    assert torch.allclose(ref, ours, rtol=0, atol=1e-12)
    assert torch.equal(ref.argsort(-1, descending=True)[..., :5], ours.argsort(-1, descending=True)[..., :5])


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
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.slow
@pytest.mark.parametrize("share", [False, True])
def test_shipped_medusa_checkpoint_exports_for_vllm(tmp_path, smollm2, share):
    """The shipped SmolLM2 Medusa heads (8,192-token draft vocabulary → vLLM's token_map)."""

    from draftheads.heads import load_heads

    base, _ = smollm2
    checkpoint = REPO / "checkpoints" / "smollm2-135m-medusa"
    heads = load_heads(checkpoint, expected_fingerprint=fingerprint(base).to_dict()).bind(base.lm_head.weight)
    out = export_heads(heads, "vllm-medusa", tmp_path / "vllm", base.lm_head.weight, share_lm_head=share)
    hidden = torch.randn(4, base.config.hidden_size)
    ref, ours = vllm_medusa_reference(out, hidden), draftheads_full_logits(heads, hidden)
    finite = ours.isfinite()
    assert torch.equal(ref.isinf(), ~finite) and int(finite[0, 0].sum()) == 8192
    assert torch.allclose(ref[finite], ours[finite], atol=1e-4)
    assert torch.equal(ref.argmax(-1), ours.argmax(-1))
