"""On the embedded SmolLM2 (float32) with the shipped heads, over the first 20 MT-Bench
prompts × 128 new tokens, every token equals transformers' greedy generate, or the first
divergence sits at a near-tie of the base's logits (top-1 − top-2 < 1e-3)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import DATA
from draftheads.bench import divergence
from draftheads.cli import chat_input
from draftheads.decoding import DraftHeadsModel

CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-hydra"  # the default heads


@pytest.mark.slow
def test_mt_bench_first_20_prompts_are_token_identical(smollm2):
    base, tokenizer = smollm2
    model = DraftHeadsModel.from_pretrained(CHECKPOINT, base=base, tokenizer=tokenizer)
    prompts = [json.loads(line)["turns"][0] for line in open(DATA / "mt_bench.jsonl")][:20]
    identical, near_ties, taus = 0, [], []
    for prompt in prompts:
        ids = chat_input(tokenizer, prompt)
        reference = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, do_sample=False)
        ours = model.generate(ids, max_new_tokens=128)
        taus.append(model.last_stats.tau)
        diff = divergence(base, reference, ours, ids.shape[1])
        if diff is None:
            identical += 1
        else:
            assert diff["near_tie"], f"divergence not at a near-tie: {diff}"
            near_ties.append(diff)
    print(f"\nSmolLM2 fp32: {identical}/20 identical, {len(near_ties)} near-tie divergences {near_ties}; "
          f"mean τ {sum(taus) / len(taus):.2f}")
    assert identical + len(near_ties) == 20
    assert sum(taus) / len(taus) > 1.2  # the shipped heads really draft accepted tokens
