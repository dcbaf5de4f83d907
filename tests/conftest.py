"""Shared fixtures: tiny random Llama models (float64, for exact identity) and an oracle
draft source that proposes the base's true continuation with noise, so trees get accepted
to every depth (any draft is legal; the oracle only makes the tests reach deep paths)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftheads.heads import DraftHeads, HeadConfig, TreeSpec

SHARED = Path(__file__).resolve().parents[2] / "shared"
if not SHARED.exists():
    SHARED = Path(__file__).resolve().parents[1].parent / "shared"
DATA = SHARED / "data"
REPO = Path(__file__).resolve().parents[1]


def tiny_llama(seed: int = 0, vocab: int = 96, dtype=torch.float64, max_pos: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)
    model.generation_config.pad_token_id = 0
    return model


def left_pad(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch and its attention mask, as a tokenizer with padding_side='left' gives."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


class OracleHeads(DraftHeads):
    """Knows each row's true greedy continuation; proposes it on rank-0 paths, with errors."""

    family = "oracle-test"

    def __init__(self, continuations: list[list[int]], vocab: int, num_heads: int = 6, error: float = 0.2, seed: int = 0):
        super().__init__(HeadConfig(family="medusa", num_heads=num_heads, hidden_size=32, vocab_size=vocab))
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

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor, tree: TreeSpec) -> torch.Tensor:
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
        return tokens


@pytest.fixture(scope="session")
def smollm2():
    from draftheads.decoding.base import load_base

    if os.environ.get("DRAFTHEADS_SKIP_SMOLLM2"):
        pytest.skip("DRAFTHEADS_SKIP_SMOLLM2 is set")
    return load_base(dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_bf16():
    from draftheads.decoding.base import load_base

    if os.environ.get("DRAFTHEADS_SKIP_SMOLLM2"):
        pytest.skip("DRAFTHEADS_SKIP_SMOLLM2 is set")
    return load_base(dtype=torch.bfloat16)
