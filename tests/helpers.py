"""Helpers the tests share (tiny models, padding, an oracle drafter, tree strategies, the tiny
training set-up, reference implementations of other projects' formats, lookup stores and tries).
Fixtures live in conftest.py; test modules import helpers from here, never from each other."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file
from hypothesis import strategies as st
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from draftheads.decoding.request import left_pad  # noqa: F401 (tests pad batches by the package's one rule)
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.decoding.calibration import CalibrationConfig
from draftheads.decoding.drafters import (Candidates, StoreHeader, TokenizerIdentity, build_arrays, save_store,
                                          tokenizer_identity)
from draftheads.decoding.drafters.store import FORMAT_VERSION, key_bits
from draftheads.heads import REGISTRY, DraftHeads, HeadConfig, MedusaHeads, TreeSpec, build_heads
from draftheads.training.recipe import load_recipe


REPO = Path(__file__).resolve().parents[1]
#: the tests' own data: samples of the training sets (tests/data/README.md: sources, licences)
FIXTURES = REPO / "tests" / "data"


def record_packed_steps(monkeypatch) -> list:
    """The :class:`~draftheads.decoding.base.attention.RaggedRows` of every step
    :func:`~draftheads.decoding.base.forward.verify` runs packed, appended as they run."""
    from draftheads.decoding.base import attention

    seen: list = []
    original = attention.RaggedRows.from_valid.__func__

    def recorded(cls, valid):
        rows = original(cls, valid)
        seen.append(rows)
        return rows

    monkeypatch.setattr(attention.RaggedRows, "from_valid", classmethod(recorded))
    return seen


class Collect:
    """A streamer that records what it is given (``end`` as a marker)."""

    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens += value.flatten().tolist()

    def end(self):
        self.tokens.append("end")


def load_script(name: str):
    """scripts/ is not a package: import ``scripts/<name>.py`` from its path, registered in
    ``sys.modules`` (where dataclasses look their module up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tiny_llama(seed: int = 0, vocab: int = 96, dtype=torch.float64, max_pos: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)
    model.generation_config.pad_token_id = 0
    return model


def ragged_step(model, seed: int, bs: int = 4, width: int = 6, kv_len: int = 10, skewed: bool = False,
                ragged: bool = True):
    """One random tree step over a random cache with holes: tokens, positions, the 4D mask, the real
    slots (B, N) and a factory of the filled cache. Per row a random tree of its own size (a prefix
    of ``width`` slots; row 0 the widest; ``skewed``: the others of one or two; not ``ragged``: every
    row ``width``): what a per-row step verifies."""
    from draftheads.decoding.base.cache import tree_attention_mask
    from draftheads.decoding.calibration import _synthetic_cache

    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 3 if skewed else width + 1, (bs,), generator=gen) if ragged else torch.full((bs,), width)
    sizes[0] = width
    valid = torch.arange(width)[None] < sizes[:, None]
    ancestor = torch.eye(width, dtype=torch.bool).repeat(bs, 1, 1)
    for b in range(bs):
        for i in range(1, int(sizes[b])):
            ancestor[b, i] |= ancestor[b, int(torch.randint(0, i, (1,), generator=gen))]
    kv_valid = torch.rand(bs, kv_len, generator=gen) > 0.3
    kv_valid[:, -1] = True
    mask = tree_attention_mask(kv_valid, ancestor)
    positions = kv_valid.sum(1, keepdim=True) + ancestor.sum(-1) - 1
    tokens = torch.randint(3, model.config.vocab_size, (bs, width), generator=gen)

    def cache():
        filled = _synthetic_cache(model, bs, kv_len)
        values = torch.Generator().manual_seed(1000 + seed)
        for layer in filled.layers:
            layer.keys.copy_(torch.randn(layer.keys.shape, generator=values).to(layer.keys.dtype))
            layer.values.copy_(torch.randn(layer.values.shape, generator=values).to(layer.values.dtype))
        return filled

    return tokens, positions, mask, valid, cache


def tiny_peer_bench(tmp_path, monkeypatch, peers: str, dtype: str, new_tokens: int) -> dict:
    """``draftheads bench --peers PEERS`` on a saved tiny base and heads, two prompts: its results.json."""
    from draftheads.cli import main

    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    base = save_tiny_base(tmp_path / "base")
    save_tiny_heads(tmp_path / "heads", base)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": "a"}) + "\n" for p in ("w5 w6 w7", "w9 w8 w9")))
    out = tmp_path / "bench"
    assert main(["bench", "--prompts", str(prompts), "--base", str(tmp_path / "base"), "--heads", str(tmp_path / "heads"),
                 "--dtype", dtype, "--tree", "3", "--max-new-tokens", str(new_tokens), "--no-control", "--peers", peers,
                 "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())


def save_tiny_heads(folder: Path, base) -> MedusaHeads:
    """Two float64 Medusa heads with a stored 3-node tree for ``base`` (:func:`save_tiny_base`), saved."""
    heads = MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96, trees={"3": [[0], [1], [0, 0]]},
                                   expected_tau={"3": 1.7}, base_fingerprint=fingerprint(base).to_dict()))
    heads.double().save_pretrained(folder, dtype=None)
    return heads


def save_tiny_base(folder: Path, seed: int = 0) -> LlamaForCausalLM:
    """:func:`tiny_llama` saved as a model folder with a word-level tokenizer ("w0".."w95", a
    chat template), so the CLI's ``generate`` runs on it end to end; returns the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_llama(seed)
    model.save_pretrained(folder)
    words = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(96)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", pad_token="w0", bos_token="w1",
                                        eos_token="w2")
    tokenizer.chat_template = ("{% for m in messages %}w3 {{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}w4{% endif %}")
    tokenizer.save_pretrained(folder)
    return model


class OracleHeads(DraftHeads):
    """Knows each row's true greedy continuation; proposes it on rank-0 paths, with errors."""

    family = "oracle-test"

    def __init__(self, continuations: list[list[int]], vocab: int, num_heads: int = 6, error: float = 0.2, seed: int = 0,
                 feature_layers: tuple[int, ...] = ()):
        super().__init__(HeadConfig(family="medusa", num_heads=num_heads, hidden_size=32, vocab_size=vocab,
                                    feature_layers=list(feature_layers)))
        self.continuations = continuations
        self.vocab = vocab
        self.error = error
        self.generator = torch.Generator().manual_seed(seed)
        self.pointer = [0] * len(continuations)

    def _locate(self, row: int, root: int) -> int:
        seq = self.continuations[row]
        for p in range(self.pointer[row], min(len(seq), self.pointer[row] + 16)):
            if seq[p] == root:
                self.pointer[row] = p
                return p
        return self.pointer[row]

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, tree: TreeSpec, with_probs: bool = False):
        batch, nodes = roots.shape[0], tree.num_nodes
        tokens = torch.randint(0, self.vocab, (batch, nodes), generator=self.generator)
        parent = tree.parent.tolist()
        for b in range(batch):
            p = self._locate(b, int(roots[b]))
            seq = self.continuations[b]
            on_path = [True] * nodes
            for n in range(1, nodes):
                on_path[n] = on_path[parent[n]] and int(tree.rank[n]) == 0
                d = int(tree.depth[n])
                if on_path[n] and p + d < len(seq) and float(torch.rand(1, generator=self.generator)) > self.error:
                    tokens[b, n] = seq[p + d]
        tokens[:, 0] = roots
        if with_probs:  # the confidence a trained head would show: high on rank 0, low elsewhere
            probs = torch.where(tree.rank == 0, 0.8, 0.1).to(torch.float32).expand(batch, nodes).clone()
            probs[:, 0] = 1.0
            return tokens, probs
        return tokens


# -- random trees (hypothesis) -----------------------------------------------------------------
@st.composite
def trees(draw, max_depth: int = 5, max_rank: int = 3, max_nodes: int = 24):
    paths: list[tuple[int, ...]] = []
    frontier = [()]
    target = draw(st.integers(0, max_nodes))
    while len(paths) < target and frontier:
        parent = frontier[draw(st.integers(0, len(frontier) - 1))]
        if len(parent) >= max_depth:
            frontier.remove(parent)
            continue
        taken = {p[-1] for p in paths if p[:-1] == parent and len(p) == len(parent) + 1}
        free = [r for r in range(max_rank) if r not in taken]
        if not free:
            frontier.remove(parent)
            continue
        child = parent + (draw(st.sampled_from(free)),)
        paths.append(child)
        frontier.append(child)
    return paths


# -- the head families --------------------------------------------------------------------------
FAMILIES = sorted(f for f in REGISTRY if not f.endswith("-test"))


# -- the tiny training set-up ------------------------------------------------------------------
RECIPES = REPO / "recipes"

def tiny_recipe(root: Path, run: str, **over) -> Path:
    recipe = {
        "name": "tiny", "base": str(root / "base"), "base_dtype": "float64",
        "heads": {"family": "medusa", "num_heads": 3, "num_layers": 1, "draft_vocab_size": 0},
        "data": {"kind": "tokens", "path": str(root / "tokens.jsonl"), "features_dir": str(root / "features"),
                 "eval_examples": 8, "max_length": 64},
        "loss": {"labels": "teacher", "ce_weight": 1.0, "kl_weight": 0.5, "head_decay": 0.8, "noise_alpha": 0.0},
        "train": {"epochs": 2, "batch_size": 64, "lr": 0.01, "mixed_precision": "no", "dtype": "float64"},
        "run": {"output_dir": str(root / run), "checkpoint_every": 4, "eval_every": 6, "log_every": 1,
                "wandb": False, "save_dtype": "float64", "tree_budgets": [1, 3]},
    }
    for key, value in over.items():  # "section__name", or a top-level key
        section, _, name = key.rpartition("__")
        (recipe[section] if section else recipe)[name] = value
    path = root / f"{run}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path

def run_inprocess(path: Path, *overrides: str) -> dict:
    from accelerate.state import AcceleratorState

    from draftheads.training.train import train

    AcceleratorState._reset_state(True)
    return train(load_recipe(path, list(overrides)))

def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))

def subprocess_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO / "tests"), TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    env.pop("WANDB_API_KEY", None)
    return env

KILL_AT = """
import os, signal, sys
import draftheads.training.train as t
write = t.JsonlLog.write
def write_then_die(self, record):
    write(self, record)
    if record.get("step") == int(os.environ["KILL_AT_STEP"]) and "loss" in record:
        os.kill(os.getpid(), signal.SIGKILL)
t.JsonlLog.write = write_then_die
sys.exit(t.main(sys.argv[1:]))
"""

def kill_then_resume(cwd: Path, recipe: Path, run_dir: Path, kill_at: int, after_kill=None) -> dict:
    """SIGKILL a training run right after it logs step ``kill_at`` (checkpoints every 4 steps),
    call ``after_kill(checkpoint_dir)``, relaunch the same command, and return the finished
    run's training report."""
    killed = subprocess.run([sys.executable, "-c", KILL_AT, str(recipe)], cwd=cwd, capture_output=True,
                            text=True, env=subprocess_env() | {"KILL_AT_STEP": str(kill_at)}, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (run_dir / "final").exists()
    checkpoint = run_dir / "checkpoints" / f"step-{kill_at // 4 * 4:07d}"
    assert checkpoint.is_dir()
    if after_kill is not None:
        after_kill(checkpoint)
    resumed = subprocess.run([sys.executable, "-m", "draftheads.training.train", str(recipe)], cwd=cwd,
                             capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    return json.loads((run_dir / "final" / "training_report.json").read_text())

def launch_two_processes(cwd: Path, recipe: Path, run_dir: Path, port: int) -> dict:
    """``accelerate launch`` the recipe on 2 CPU processes (gloo); the finished run's report."""
    launched = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(RECIPES / "accelerate" / "multi_cpu.yaml"), "--main_process_port", str(port), "-m",
         "draftheads.training.train", str(recipe)],
        cwd=cwd, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert launched.returncode == 0, launched.stderr[-3000:]
    return json.loads((run_dir / "final" / "training_report.json").read_text())


# -- vLLM's Medusa draft model, from its documented shapes -------------------------------------------
def vllm_medusa_reference(folder, hidden: torch.Tensor) -> torch.Tensor:
    """hidden (B, d) → (B, K, V) as vLLM 0.32's Medusa computes it from the folder's files, after the
    checks its loader makes: every LM head has ``vocab_size`` rows and nothing is left unloaded (it
    never marks a ``token_map`` loaded, so a folder holding one is refused)."""
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert "token_map" not in weights and config["truncated_vocab_size"] == config["vocab_size"]
    out = []
    for i in range(config["num_heads"]):
        x = hidden
        for j in range(config["num_hidden_layers"]):
            bias = weights[f"blocks.{i}.layers.{j}.bias"] if config.get("medusa_fc_bias", False) else None
            x = x + torch.nn.functional.silu(torch.nn.functional.linear(x, weights[f"blocks.{i}.layers.{j}.weight"], bias))
        lm_head = weights["lm_heads.0.weight"] if config.get("original_lm_head") else weights[f"lm_heads.{i}.weight"]
        assert lm_head.shape[0] == config["vocab_size"]
        out.append(x @ lm_head.t())
    return torch.stack(out, dim=1)

@torch.no_grad()
def draftheads_full_logits(heads, hidden: torch.Tensor) -> torch.Tensor:
    """Our draft logits over the full vocabulary (−inf outside the draft vocabulary)."""
    logits = heads(hidden)
    if not heads.config.draft_vocab_size:
        return logits
    full = torch.full((*logits.shape[:-1], heads.config.vocab_size), -torch.inf, dtype=logits.dtype)
    full[..., heads.vocab_ids] = logits
    return full


# -- FasterDecoding Medusa checkpoints, from its documented modules ----------------------------
class RefResBlock(nn.Module):
    """Medusa's ResBlock: x + SiLU(Linear(x))."""

    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))

def reference_heads(d: int, vocab: int, heads: int, layers: int, projection: bool, seed: int = 0) -> nn.ModuleList:
    """Medusa-1 (projection=True): Sequential(*([ResBlock(d)] * L), Linear(d, V, bias=False)) per head
    — one ResBlock object repeated, as Medusa builds it; the shared-LM-head layout drops the Linear."""
    torch.manual_seed(seed)
    module = nn.ModuleList(
        nn.Sequential(*([RefResBlock(d)] * layers), *([nn.Linear(d, vocab, bias=False)] if projection else []))
        for _ in range(heads)).double()
    for p in module.parameters():
        nn.init.normal_(p, std=0.3)
    return module

def write_medusa(folder, module: nn.ModuleList, layers: int, fmt: str, base: str = "tiny/llama") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    shared = not isinstance(module[0][-1], nn.Linear)  # train_legacy.py marks the shared-LM-head layout version 2
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": len(module), "medusa_num_layers": layers,
                                                    "base_model_name_or_path": base,
                                                    **({"version": "2"} if shared else {})}))
    state = module.state_dict()
    if fmt == "pt":
        torch.save(state, folder / "medusa_lm_head.pt")
    else:
        from safetensors.torch import save_file

        save_file({k: v.clone().contiguous() for k, v in state.items()}, str(folder / "medusa_lm_head.safetensors"))


def saved_tree_heads(folder, model):
    """Random Medusa heads for ``model`` with two stored trees and their expected τ (what the
    default tree's calibration and the adaptive policy need), saved to ``folder``."""
    from draftheads.decoding.base.fingerprint import fingerprint
    from draftheads.heads import MedusaHeads

    cfg = model.config
    heads = MedusaHeads(HeadConfig(num_heads=2, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                                   base_fingerprint=fingerprint(model).with_sketch(model),
                                   trees={"1": [[0]], "3": [[0], [1], [0, 0]]}, expected_tau={"1": 1.6, "3": 1.9}))
    torch.manual_seed(0)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    heads.save_pretrained(folder, dtype=torch.float32)
    return folder


def tiny_distill_setup(root: Path, prompts: int, seed: int):
    """A saved tiny base and random tree heads under ``root`` (``base/``, ``heads/``) and
    ``prompts`` random word prompts in ``root/prompts.jsonl`` (ids p0.., source "tiny"): what the
    self-distillation job's tests answer. Returns the base and the prompts' texts."""
    model = save_tiny_base(root / "base")
    saved_tree_heads(root / "heads", model)
    generator = torch.Generator().manual_seed(seed)
    texts = [" ".join(f"w{int(t)}" for t in torch.randint(5, 96, (int(n),), generator=generator))
             for n in torch.randint(1, 7, (prompts,), generator=generator)]
    with open(root / "prompts.jsonl", "w") as handle:
        for i, text in enumerate(texts):
            handle.write(json.dumps({"id": f"p{i}", "source": "tiny", "prompt": text}) + "\n")
    return model, texts


def tiny_job_args(root: Path, max_new_tokens: int = 10) -> list[str]:
    """The self-distillation job over :func:`tiny_distill_setup`'s folder into ``root/job``: float64,
    the tree heads alone, shards of 8 answered in batches of 8."""
    return ["--out", str(root / "job"), "--prompts", str(root / "prompts.jsonl"), "--base", str(root / "base"),
            "--heads", str(root / "heads"), "--dtype", "float64", "--tree", "3", "--sources", "heads",
            "--max-new-tokens", str(max_new_tokens), "--shard-size", "8", "--batch-size", "8"]


# -- heads and a calibration grid several test modules use ------------------------------------------
def random_heads(family: str, model, seed: int = 0, draft_vocab: int = 0, num_layers: int = 1,
                 extra: dict | None = None, feature_layers: tuple[int, ...] = ()):
    """Heads with random (non-zero) weights so drafts are diverse and mostly wrong (``extra``: the
    family's options; ``feature_layers``: the base layers they read beside its final state)."""
    cfg = model.config
    if family == "eagle3" and not feature_layers:  # EAGLE-3 reads base layers, never the final state alone
        from draftheads.heads.eagle3 import eagle3_layers

        feature_layers = tuple(eagle3_layers(cfg.num_hidden_layers))
    heads = build_heads(HeadConfig(family=family, num_heads=3, num_layers=num_layers, hidden_size=cfg.hidden_size,
                                   vocab_size=cfg.vocab_size, draft_vocab_size=draft_vocab,
                                   base_fingerprint=fingerprint(model).to_dict(), extra=dict(extra or {}),
                                   feature_layers=list(feature_layers)))
    torch.manual_seed(seed)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    if draft_vocab:
        heads.vocab_ids.copy_(torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values)
    return heads.to(model.dtype).bind(model.lm_head.weight, model.get_input_embeddings().weight)


#: a calibration grid small enough for a test (seconds)
TINY_GRID = CalibrationConfig(batch_sizes=(1, 2), nodes=(1, 2, 4), contexts=(8, 16), max_tokens=4, reps=1)


def tiny_heads() -> MedusaHeads:
    config = HeadConfig(num_heads=2, hidden_size=32, vocab_size=96, trees={"1": [[0]], "3": [[0], [1], [0, 0]]},
                        expected_tau={"1": 1.4, "3": 1.7})
    heads = MedusaHeads(config).to(torch.float64)
    return heads


# -- lookup stores and tries ---------------------------------------------------------------------------
class FakeTokenizer:
    def __init__(self, vocab: int, salt: str = ""):
        self.vocab = {f"tok{salt}{i}": i for i in range(vocab)}

    def get_vocab(self):
        return dict(self.vocab)


#: the records of the lookup stores the tests write
STORE_RECORDS = [[5, 6, 7, 8, 9, 2], [6, 7, 8, 1, 2], [3, 3, 3, 3], [7, 8, 9, 9, 2]]


def write_store(path: Path, records=STORE_RECORDS, vocab: int = 10, salt: str = "") -> TokenizerIdentity:
    ident = tokenizer_identity(FakeTokenizer(vocab, salt))
    bits = key_bits(ident.vocab_size)
    header = StoreHeader(FORMAT_VERSION, ident.vocab_size, ident.vocab_sha256, 64 // bits, bits, "2026-11-24", "test",
                         len(records), sum(map(len, records)))
    save_store(path, build_arrays(records, ident.vocab_size), header)
    return ident


def check_trie(trie: Candidates) -> None:
    paths = [trie.path(i) for i in range(len(trie))]
    assert len(set(paths)) == len(paths), "a shared prefix appears twice"
    assert all(p[:-1] in set(paths) or len(p) == 1 for p in paths), "not prefix-closed"
    for i in range(len(trie)):
        p = trie.parent[i]
        assert p < i and trie.depth[i] == (1 if p < 0 else trie.depth[p] + 1)
        assert p < 0 or trie.score[i] <= trie.score[p] + 1e-12


def varied_llama():
    """:func:`tiny_llama` with weights of std 0.2: its greedy answers vary and repeat (at the
    default initialisation it repeats the prompt's last token, where most options change nothing)."""
    model = tiny_llama(0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.2)
    return model


def plan_readers() -> tuple:
    """The modules that read the packing plan by name (what a test's own plan replaces in each)."""
    from draftheads.decoding.base import packed, packing, plan, siblings

    return plan, packed, siblings, packing


def force_plan(model, monkeypatch, blocks_ms: float = 1.0) -> None:
    """Every product of ``model`` (its stacked siblings' and LM head's too) through the blocks where it
    has them (``blocks_ms`` below the kernel's 5), else the few-row kernel."""
    from draftheads.decoding.base.blocks import KINDS
    from draftheads.decoding.base.plan import ROW_BUCKETS, PackingPlan, shape_key

    plan, n = PackingPlan(), len(ROW_BUCKETS)
    layer = model.model.layers[0]
    stacked = [(sum(m.out_features for m in ms), ms[0].in_features) for ms in (
        (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj), (layer.mlp.gate_proj, layer.mlp.up_proj))]
    for shape in [tuple(p.shape) for p in model.parameters() if p.dim() == 2] + stacked:
        plan.add(shape_key(model.dtype, *shape), {"linear_ms": [9.0] * n, "packed_ms": [9.0] * n,
                                                  "fewrow_ms": [5.0] * n, **{f"{k}_ms": [blocks_ms] * n for k in KINDS}})
    for module in plan_readers():
        monkeypatch.setattr(module, "PLAN", plan)


def gguf_base(folder, seed: int = 2, edit=None, dtype=torch.float32):
    """A tiny float32 Llama whose every linear weight is its Q4_1 quantization dequantized and whose
    (tied) embeddings, some rows repeated, are their Q8_0 one, and the GGUF of those blocks (other names than
    transformers', q/k rows permuted as in a llama GGUF, ``edit`` applied to the tensors written),
    recorded as the GGUF the base was converted from."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    from draftheads.decoding.base.architecture import decoder_body
    from draftheads.decoding.base.loading import SOURCE_RECORD

    model = tiny_llama(seed, dtype=torch.float32)
    model.model.embed_tokens.weight.data[90:] = model.model.embed_tokens.weight.data[89]  # repeated rows, as unused tokens
    writer = GGUFWriter(str(folder / "tiny.gguf"), "llama")
    for index, (name, module) in enumerate((n, m) for n, m in decoder_body(model).named_modules()
                                           if type(m) in (torch.nn.Linear, torch.nn.Embedding)):
        qtype = GGMLQuantizationType.Q8_0 if type(module) is torch.nn.Embedding else GGMLQuantizationType.Q4_1
        raw = quants.quantize(module.weight.detach().numpy(), qtype)
        module.weight.data.copy_(torch.from_numpy(quants.dequantize(raw, qtype)))
        if name.endswith(("q_proj", "k_proj")):
            raw = raw[np.random.default_rng(index).permutation(raw.shape[0])]
        raw = edit(name, raw) if edit is not None else raw
        writer.add_tensor(f"t{index}", raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (folder / SOURCE_RECORD).write_text(json.dumps({"gguf": str(folder / "tiny.gguf")}))
    model = model.to(dtype)
    model.name_or_path = str(folder)
    return model
