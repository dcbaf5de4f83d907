"""Teacher-forced scoring of draft heads on the base's own greedy answers.

One place for what ``scripts/eval_heads.py`` and ``scripts/compare_heads.py`` both do, so the
two always score the same positions the same way: the base answers held-out prompts greedily
(cached as JSONL), its hidden states over prompt + answer are extracted once, and every head
checkpoint is ranked on those positions against the base's own next tokens (what the verifier
would accept). Per-head top-k accuracy and the τ each stored tree would reach follow from the
ranks, with no independence assumption between heads.
"""
from __future__ import annotations

import json
import tempfile
from typing import Sequence
from pathlib import Path

import torch

from .bench import hf_greedy
from .decoding.base.fingerprint import fingerprint
from .heads import DraftHeads
from .prompts import PROMPT_SETS
from .training.features import (Features, chat_prompt_ids, extract_features, load_shards, read_jsonl,
                                selfdistill_examples)
from .training.losses import topk_accuracy
from .training.evaluation import rank_table, tree_tau


def answers_cache_path(prompts_path: str | Path, limit: int | None, max_new_tokens: int, dtype: str,
                       root: str | Path = "data_cache") -> Path:
    """Where the base's answers for this prompt file / limit / length / dtype are cached
    (the name eval_heads.py has always used, so existing caches keep serving)."""
    stem = Path(PROMPT_SETS.get(str(prompts_path), prompts_path)).stem  # a built-in name: its file's stem
    return Path(root) / f"answers-{stem}-{limit}-{max_new_tokens}-{dtype}.jsonl"


@torch.no_grad()
def base_answers(base, tokenizer, prompts: list[dict], max_new_tokens: int, cache: Path | None = None) -> list[dict]:
    """The base's greedy answers (one prompt at a time: no padding effects), cached as JSONL;
    a cache made for other prompts is recomputed, never reused."""
    if cache is not None and cache.is_file():
        records = list(read_jsonl(cache))
        if [r["prompt"] for r in records] == [p["prompt"] for p in prompts]:
            return records
    records = []
    for item in prompts:
        ids = torch.tensor([chat_prompt_ids(tokenizer, item["prompt"])])
        out = hf_greedy(base, ids, max_new_tokens)
        records.append({"id": item["id"], "category": item["category"], "prompt": item["prompt"],
                        "response_ids": out[0, ids.shape[1]:].tolist()})
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def answer_features(base, tokenizer, records: list[dict], layers: Sequence[int] = ()) -> Features:
    """Hidden states + the base's own next tokens over prompt + answer, extracted once for
    every checkpoint (in a temporary directory: they are cheap next to decoding), with the states
    of ``layers`` (those multi-layer heads read beside the final state)."""
    fp = fingerprint(base).to_dict()
    examples = selfdistill_examples(records, tokenizer)
    if not examples:
        raise ValueError("No answer is long enough to score heads on (each needs ≥ 2 generated tokens).")
    with tempfile.TemporaryDirectory() as tmp:
        return load_shards(extract_features(base, examples, tmp, fp, layers=tuple(layers)), fp, tuple(layers))


def score_heads(heads: DraftHeads, base, features: Features) -> dict:
    """Per-head top-1/top-5 and each stored tree's τ, in float32 whatever the decoding dtype
    (the heads are bound to float32 copies of the base's LM head and embeddings)."""
    heads = heads.float()
    heads.bind(base.get_output_embeddings().weight.float(), base.get_input_embeddings().weight.float())
    ranks = rank_table(heads, features, "teacher", torch.float32, "cpu")
    taus = {budget: tree_tau(ranks, paths) for budget, paths in heads.config.trees.items()}
    return {"positions": len(features), "accuracy": topk_accuracy(ranks), "tree_tau": taus}
