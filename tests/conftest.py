"""Shared fixtures: the embedded SmolLM2 base (float32, bfloat16) and the tiny training
set-up (a float64 tiny Llama saved as a model dir plus its own greedy continuations as token
data). Helpers the tests share are in helpers.py."""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import tiny_llama


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


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A float64 tiny Llama saved as a model dir, and its own greedy continuations as token data
    (self-distilled, so heads have something learnable)."""
    root = tmp_path_factory.mktemp("tiny")
    model = tiny_llama(0, dtype=torch.float64)
    model.save_pretrained(root / "base")
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 96, (48, 4), generator=generator)
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=20, do_sample=False,
                         min_new_tokens=20)
    with open(root / "tokens.jsonl", "w") as handle:
        for row in out.tolist():
            handle.write(json.dumps({"input_ids": row, "response_start": 4}) + "\n")
    return root
