"""``draftheads export --to speculators | specforge`` without the engines: the written folders have
the tensor names, shapes, dtypes and config keys of the layouts the real packages write
(``tests/data/eagle3_layouts.json``, recorded by ``scripts/eagle3_layout_fixture.py`` from
speculators 0.9.0's and SpecForge 0.2.0's own ``save_pretrained``), and a pure-torch copy of vLLM
0.32's EAGLE-3 Llama draft (``vllm/model_executor/models/llama_eagle3.py``: config parsing,
``load_weights`` renames and refusals, ``combine_hidden_states``, the layer, ``compute_logits``
through ``d2t``), reading only the written folder, reproduces our heads' logits — first pass and
chained steps, fed the base's own layer states picked by the ids the folder names."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import REPO, load_script, random_heads, tiny_llama
from draftheads.cli import main
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import HeadConfig, HydraHeads
from draftheads.heads.checkpoint.eagle3_export import export_eagle3
from draftheads.heads.checkpoint.vllm_export import ExportError, export_heads

FIXTURE = REPO / "tests" / "data" / "eagle3_layouts.json"
LAYOUTS = ("speculators", "specforge")
OPTIONS = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48, "rope_theta": 5000.0,
           "rms_norm_eps": 1e-6}


def llama(layers: int = 8, vocab: int = 128) -> LlamaForCausalLM:
    """A float64 Llama deep enough for EAGLE-3's three layers (2, 4, 5 of 8), LM head untied."""
    torch.manual_seed(0)
    config = LlamaConfig(name_or_path="tiny-base", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    model = LlamaForCausalLM(config).double().eval().requires_grad_(False)
    model.lm_head.weight.normal_(std=1.0)  # logits of order 1-10, so a wrong export shows
    return model


def eagle3(base, draft_vocab: int = 40, layers: tuple[int, ...] = (), seed: int = 0):
    heads = random_heads("eagle3", base, seed=seed, draft_vocab=draft_vocab, extra=OPTIONS, feature_layers=layers)
    if draft_vocab:  # in no particular order: the export sorts it as the engines do
        heads.vocab_ids.copy_(torch.randperm(base.config.vocab_size, generator=torch.Generator().manual_seed(seed))
                              [:draft_vocab])
    return heads


# -- vLLM 0.32's EAGLE-3 Llama draft, from the written folder alone ---------------------------
def vllm_config(folder) -> dict:
    """The draft's hf_config as vLLM builds it (speculators: ``transformer_layer_config`` plus
    ``update_eagle3``'s keys, ``norm_before_residual`` defaulting to True; else the flat config)."""
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") is None and config.get("speculators_config") is not None:
        assert config["speculators_model_type"] == "eagle3"
        spec = config["speculators_config"]
        assert spec["proposal_methods"][0]["speculative_tokens"] and spec["verifier"]["name_or_path"]
        flat = dict(config["transformer_layer_config"])
        flat["draft_vocab_size"] = config.get("draft_vocab_size")
        if config.get("target_hidden_size") is not None:
            flat["target_hidden_size"] = config["target_hidden_size"]
        flat["norm_before_residual"] = config.get("norm_before_residual", True)
        for key in ("norm_before_fc", "fc_norm", "norm_output"):
            flat[key] = config.get(key, False)
        if config.get("eagle_aux_hidden_state_layer_ids"):
            flat["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
        assert flat.get("model_type", "llama") == "llama"  # → Eagle3LlamaForCausalLM
        return flat
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    return config


def rms(x, weight, eps):
    """vLLM's RMSNorm (in float32 there; here at least float32, so a float64 test stays exact)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class VllmEagle3:
    """``Eagle3LlamaForCausalLM`` over ``folder`` for a target of ``vocab`` tokens (``embed``: the
    target's input embeddings, used when the folder has none)."""

    def __init__(self, folder, vocab: int, embed: torch.Tensor):
        cfg = self.cfg = vllm_config(folder)
        self.d, self.eps, self.vocab = cfg["hidden_size"], cfg["rms_norm_eps"], vocab
        self.heads, self.kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or self.d // self.heads
        self.theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
        self.draft_vocab = cfg.get("draft_vocab_size") or vocab
        eagle = cfg.get("eagle_config") or {}
        assert not cfg.get("norm_before_fc") and not eagle.get("norm_before_fc") and not cfg.get("fc_norm")
        n_aux = cfg.get("num_aux_hidden_states") or len(eagle.get("eagle_aux_hidden_state_layer_ids") or ()) or 3
        d, q, kv = self.d, self.heads * self.hd, self.kv * self.hd
        shapes = {"model.fc.weight": (d, cfg.get("target_hidden_size", d) * n_aux), "model.norm.weight": (d,),
                  "lm_head.weight": (self.draft_vocab, d), "model.embed_tokens.weight": (vocab, d),
                  **{f"model.layers.0.{n}.weight": (d,) for n in ("input_layernorm", "hidden_norm",
                                                                     "post_attention_layernorm")},
                  "model.layers.0.self_attn.q_proj.weight": (q, 2 * d),
                  "model.layers.0.self_attn.o_proj.weight": (d, q),
                  **{f"model.layers.0.self_attn.{n}_proj.weight": (kv, 2 * d) for n in "kv"},
                  **{f"model.layers.0.mlp.{n}_proj.weight": (cfg["intermediate_size"], d) for n in ("gate", "up")},
                  "model.layers.0.mlp.down_proj.weight": (d, cfg["intermediate_size"])}
        if self.draft_vocab != vocab:
            shapes["draft_id_to_target_id"] = (self.draft_vocab,)
        w = {}
        for name, tensor in load_file(str(folder / "model.safetensors")).items():  # load_weights' renames
            if "t2d" in name:
                continue
            name = name.replace("d2t", "draft_id_to_target_id") if "d2t" in name else \
                name if "lm_head" in name else "model." + name
            name = name.replace("midlayer.", "layers.0.")  # hf_to_vllm_mapper
            assert name in shapes, f"vLLM raises: there is no module or parameter named {name!r}"
            assert tuple(tensor.shape) == shapes[name], f"vLLM's weight_loader asserts {name}'s size"
            w[name] = tensor
        self.w = w
        self.embed = w.get("model.embed_tokens.weight", embed)
        self.d2t = w.get("draft_id_to_target_id", torch.zeros(self.draft_vocab, dtype=torch.long))
        p = "model.layers.0."
        self.qkv = torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])  # QKVParallelLinear
        self.gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])

    def aux_ids(self, num_layers: int) -> list[int]:
        """The target layers vLLM captures (gpu_model_runner: top-level ids, else eagle_config's, else
        (2, L//2, L-3)), ascending."""
        ids = self.cfg.get("eagle_aux_hidden_state_layer_ids") or \
            (self.cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or \
            (2, num_layers // 2, num_layers - 3)
        return sorted(set(ids))

    def rope(self, x, positions):
        """neox-style rotary from vLLM's float32 cos/sin cache."""
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float) / self.hd))
        freqs = positions.float()[:, None] * inv_freq[None]
        cos, sin = freqs.cos().to(x.dtype)[:, None], freqs.sin().to(x.dtype)[:, None]
        x1, x2 = x[..., : self.hd // 2], x[..., self.hd // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def layer(self, embeds, hidden, positions, past, visible):
        """One decoder-layer call over N tokens: (N, d) each, positions (N,), past = (keys, values) of
        earlier calls (S, H_kv, D), visible (N, S + N) bool → (hidden after the MLP, the residual), and this
        call's keys/values."""
        w, p, d = self.w, "model.layers.0.", self.d
        embeds = rms(embeds, w[p + "input_layernorm.weight"], self.eps)
        if self.cfg.get("norm_before_residual", False):
            hidden = rms(hidden, w[p + "hidden_norm.weight"], self.eps)
            residual = hidden
        else:
            residual, hidden = hidden, rms(hidden, w[p + "hidden_norm.weight"], self.eps)
        qkv = torch.cat([embeds, hidden], dim=-1) @ self.qkv.t()
        q, k, v = qkv.split([self.heads * self.hd, self.kv * self.hd, self.kv * self.hd], dim=-1)
        q = self.rope(q.view(-1, self.heads, self.hd), positions)
        k = self.rope(k.view(-1, self.kv, self.hd), positions)
        v = v.view(-1, self.kv, self.hd)
        keys, values = torch.cat([past[0], k]), torch.cat([past[1], v])
        group = self.heads // self.kv
        scores = torch.einsum("nhd,shd->hns", q, keys.repeat_interleave(group, 1)) * self.hd ** -0.5
        attn = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
        out = torch.einsum("hns,shd->nhd", attn, values.repeat_interleave(group, 1)).reshape(-1, self.heads * self.hd)
        residual = out @ w[p + "self_attn.o_proj.weight"].t() + residual  # fused add + norm
        gate, up = (rms(residual, w[p + "post_attention_layernorm.weight"], self.eps) @ self.gate_up.t()).chunk(2, -1)
        return torch.nn.functional.silu(gate) * up @ w[p + "mlp.down_proj.weight"].t(), residual, (k, v)

    def model(self, input_ids, positions, hidden, past, visible):
        """LlamaModel.forward → (normed output, the hidden fed to the next step), keys/values."""
        h, residual, kv = self.layer(self.embed[input_ids], hidden, positions, past, visible)
        prenorm = h + residual
        normed = rms(prenorm, self.w["model.norm.weight"], self.eps)
        return normed, (normed if self.cfg.get("norm_output", False) else prenorm), kv

    def compute_logits(self, normed):
        logits = normed @ self.w["lm_head.weight"].t() * self.cfg.get("logit_scale", 1.0)
        if self.draft_vocab == self.vocab:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab), float("-inf"))
        full[:, torch.arange(self.draft_vocab) + self.d2t] = logits
        return full

    def draft(self, aux, tokens):
        """aux (T, n·d): the captured target states, ascending; tokens (T, K): the token fed at each
        step (step 0: the next token). Step 0 is one pass over the T positions (causal); step s
        chains from each position t with its own previous output at position t + s, over step 0's
        keys up to t and its chain's own keys → logits (T, K, V) over the target vocabulary."""
        length, steps = tokens.shape
        empty = aux.new_zeros(0, self.kv, self.hd)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        hidden = aux @ self.w["model.fc.weight"].t()  # combine_hidden_states
        normed, hidden, (k0, v0) = self.model(tokens[:, 0], torch.arange(length), hidden, (empty, empty), causal)
        out = [self.compute_logits(normed)]
        chain_k, chain_v = [], []
        for s in range(1, steps):
            rows = []
            for t in range(length):  # one request per origin t, its context the first t + 1 pairs
                past = (torch.cat([k0[: t + 1], *[c[t] for c in chain_k]]),
                        torch.cat([v0[: t + 1], *[c[t] for c in chain_v]]))
                visible = torch.ones(1, past[0].shape[0] + 1, dtype=torch.bool)
                rows.append(self.model(tokens[t, s, None], torch.tensor([t + s]), hidden[t, None], past, visible))
            normed = torch.cat([r[0] for r in rows])
            hidden = torch.cat([r[1] for r in rows])
            chain_k.append(torch.stack([r[2][0] for r in rows]))
            chain_v.append(torch.stack([r[2][1] for r in rows]))
            out.append(self.compute_logits(normed))
        return torch.stack(out, dim=1)


def sglang_aux_ids(folder, num_layers: int) -> list[int]:
    """The target states SGLang feeds a SpecForge-layout draft, in our numbering: an explicit id j
    is layer j's output (= our j + 1), the default (2, L//2, L-3) is not shifted."""
    ids = (json.loads((folder / "config.json").read_text()).get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return [j + 1 for j in ids] if ids else [2, num_layers // 2, num_layers - 3]


def ours_full(heads, features, tokens) -> torch.Tensor:
    """Our heads' training-time-test logits (T, K, DV) widened to the target vocabulary."""
    logits = heads(features[None], tokens[None])[0]
    full = logits.new_full((*logits.shape[:-1], heads.config.vocab_size), float("-inf"))
    full[..., heads.vocab_ids] = logits
    return full


@pytest.mark.parametrize("layout, layers, engine", [("speculators", (), "vllm"), ("speculators", (1, 3, 6), "vllm"),
                                                    ("specforge", (), "vllm"), ("specforge", (), "sglang"),
                                                    ("specforge", (1, 3, 6), "sglang")])
def test_the_export_computes_our_function_in_the_engine(tmp_path, layout, layers, engine):
    base = llama()
    heads = eagle3(base, layers=layers)
    out = export_eagle3(heads, layout, base, tmp_path / layout)
    draft = VllmEagle3(out, base.config.vocab_size, base.get_input_embeddings().weight)
    gen = torch.Generator().manual_seed(1)
    length, steps = 7, heads.num_heads
    ids = torch.randint(3, base.config.vocab_size, (1, length), generator=gen)
    states = base(ids, output_hidden_states=True).hidden_states  # (L + 1): embeddings, then each layer's output
    num_layers = base.config.num_hidden_layers
    picked = draft.aux_ids(num_layers) if engine == "vllm" else sglang_aux_ids(out, num_layers)
    assert picked == list(heads.feature_layers)  # the engine captures the states our heads read
    aux = torch.cat([states[k][0] for k in picked], dim=-1)
    tokens = torch.randint(0, base.config.vocab_size, (length, steps), generator=gen)
    features = torch.cat([states[-1][0], *[states[k][0] for k in heads.feature_layers]], dim=-1)
    ours, theirs = ours_full(heads, features, tokens), draft.draft(aux, tokens)
    assert torch.equal(ours.isinf(), theirs.isinf())  # the same draft vocabulary, through d2t
    drafted = ours.isfinite()
    diff, scale = (ours[drafted] - theirs[drafted]).abs().max().item(), ours[drafted].abs().max().item()
    # float64 throughout but our training-time test's softmax, which runs in float32 (~1e-8 relative;
    # with it in float64 the two agree to ~1e-16)
    assert diff < 1e-6 * scale, f"max abs logit difference {diff} (logits up to {scale})"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_a_full_vocabulary_draft_has_no_maps_and_still_matches(tmp_path):
    base = llama()
    heads = eagle3(base, draft_vocab=0)
    out = export_eagle3(heads, "speculators", base, tmp_path / "full")
    assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))  # vLLM has no map to load them into
    draft = VllmEagle3(out, base.config.vocab_size, base.get_input_embeddings().weight)
    ids = torch.randint(3, base.config.vocab_size, (1, 5))
    states = base(ids, output_hidden_states=True).hidden_states
    tokens = torch.randint(0, base.config.vocab_size, (5, heads.num_heads))
    features = torch.cat([states[-1][0], *[states[k][0] for k in heads.feature_layers]], dim=-1)
    theirs = draft.draft(torch.cat([states[k][0] for k in draft.aux_ids(8)], dim=-1), tokens)
    assert torch.allclose(ours_full(heads, features, tokens), theirs, rtol=1e-6, atol=1e-6)


# -- the layouts the packages write ---------------------------------------------------------
def flat_keys(value) -> dict:
    """{dotted path: leaf} of a config, as the fixture's script records the packages' own."""
    return load_script("eagle3_layout_fixture").flatten(value)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_export_writes_the_layout_the_package_writes(tmp_path, layout):
    fixture = json.loads(FIXTURE.read_text())
    recorded = fixture["layouts"][layout]
    base = llama()
    heads = eagle3(base)
    out = export_eagle3(heads, layout, base, tmp_path / layout, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    layer = config["transformer_layer_config"] if layout == "speculators" else config
    size = {"hidden_size": 32, "2*hidden_size": 64, "3*hidden_size": 96, "intermediate_size": 48,
            "num_key_value_heads*head_dim": 16, "draft_vocab_size": 40, "vocab_size": 128}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        written = {name: (list(f.get_slice(name).get_shape()), str(f.get_tensor(name).dtype).removeprefix("torch."))
                   for name in f.keys()}
    assert written == {name: ([size[s] for s in t["shape"]], t["dtype"]) for name, t in recorded["tensors"].items()}
    flat = flat_keys({k: v for k, v in config.items() if k != "draftheads"})
    left_out = set(fixture["left_out_by_draftheads"][layout])
    extra = {"rope_theta"} if layout == "specforge" else set()  # SpecForge's own exporter mirrors it
    assert set(flat) == set(recorded["config_keys"]) - left_out | extra
    assert {k: flat[k] for k in recorded["constants"] if k not in left_out} == \
        {k: v for k, v in recorded["constants"].items() if k not in left_out}
    assert (layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"],
            layer["intermediate_size"], layer["rms_norm_eps"], layer["rope_parameters"]["rope_theta"],
            layer["vocab_size"], config["draft_vocab_size"], config["dtype"]) == \
        (32, 4, 2, 8, 48, 1e-6, 5000.0, 128, 40, "float32")
    if layout == "speculators":
        assert config["norm_before_residual"] is False and config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == heads.num_heads
    else:
        assert "eagle_config" not in config  # the default layers: every engine's default reads them
    assert config["draftheads"]["family"] == "eagle3"
    tensors = load_file(str(out / "model.safetensors"))
    ids = heads.vocab_ids.sort().values
    assert torch.equal(tensors["d2t"] + torch.arange(40), ids) and torch.equal(tensors["t2d"].nonzero()[:, 0], ids)
    assert torch.equal(tensors["lm_head.weight"], base.lm_head.weight[ids].float())


# -- refusals: one line, nothing written ------------------------------------------------------
def test_what_a_layout_cannot_hold_is_refused_by_name(tmp_path):
    base = llama()
    hydra = HydraHeads(HeadConfig(family="hydra", num_heads=2, hidden_size=32, vocab_size=128))
    for layout in LAYOUTS:
        with pytest.raises(ExportError, match=f"cannot express 'hydra' heads; --to {layout} takes: eagle3"):
            export_eagle3(hydra, layout, base, tmp_path / "a")
    with pytest.raises(ExportError, match="cannot express 'eagle3' heads .*takes: medusa. Export EAGLE-3 heads "
                                          "with --to speculators"):
        export_heads(eagle3(base), "vllm-medusa", tmp_path / "b", base.lm_head.weight)
    with pytest.raises(ExportError, match=r"read 1 base layer\(s\) \[1\], but the speculators layout's fc reads "
                                          "exactly three"):
        export_eagle3(random_heads("eagle3", tiny_llama(0)), "speculators", tiny_llama(0), tmp_path / "c")
    with pytest.raises(ExportError, match="read base layer 6, but this base has 6 layers"):
        export_eagle3(eagle3(base, layers=(1, 3, 6)), "speculators", llama(layers=6), tmp_path / "d")
    with pytest.raises(ExportError, match="LM head of \\(128, 32\\), but this base's is \\(96, 32\\)"):
        export_eagle3(eagle3(base), "specforge", llama(vocab=96), tmp_path / "e")
    assert list(tmp_path.iterdir()) == []


def command_line_setup(tmp_path):
    base = llama()
    base.save_pretrained(tmp_path / "base")
    heads = eagle3(base)
    heads.save_pretrained(tmp_path / "heads")
    return base, heads


def test_export_from_the_command_line(tmp_path, capsys):
    base, heads = command_line_setup(tmp_path)
    for layout in LAYOUTS:
        assert main(["export", "--to", layout, str(tmp_path / "heads"), str(tmp_path / layout), "--base",
                     str(tmp_path / "base"), "--dtype", "float32"]) == 0
    config = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "base")
    assert "method': 'eagle3'" in capsys.readouterr().err
    assert load_file(str(tmp_path / "specforge" / "model.safetensors"))["fc.weight"].dtype == torch.float32
    # again over our own export: replaced
    assert main(["export", "--to", "specforge", str(tmp_path / "heads"), str(tmp_path / "specforge"), "--base",
                 str(tmp_path / "base")]) == 0


def one_line_error(capsys, argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_command_line_refusals_are_one_line_and_write_nothing(tmp_path, capsys):
    base, heads = command_line_setup(tmp_path)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    err = one_line_error(capsys, ["export", "--to", "speculators", str(tmp_path / "heads"), str(theirs), "--base",
                                  str(tmp_path / "base")])
    assert "pass --beside" in err and [p.name for p in theirs.iterdir()] == ["notes.txt"]
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    config["feature_layers"] = []
    (tmp_path / "heads" / "config.json").write_text(json.dumps(config))
    err = one_line_error(capsys, ["export", "--to", "specforge", str(tmp_path / "heads"), str(tmp_path / "x")])
    assert "set feature_layers" in err
    HydraHeads(HeadConfig(family="hydra", num_heads=2, hidden_size=32, vocab_size=128,
                          base_fingerprint=fingerprint(base).to_dict())).save_pretrained(tmp_path / "hydra")
    err = one_line_error(capsys, ["export", "--to", "speculators", str(tmp_path / "hydra"), str(tmp_path / "y")])
    assert "--to speculators takes: eagle3" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
