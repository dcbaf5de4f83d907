"""Data pipeline: self-distillation resumes without dropping or duplicating a prompt and keeps
its provenance; conversations put the answer where training expects it."""
from __future__ import annotations

import pytest
import torch

from helpers import DATA, tiny_llama
from draftheads.training import data


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from draftheads.decoding.base import resolve_base

    return AutoTokenizer.from_pretrained(resolve_base(None)[0])


def test_selfdistill_resumes_after_a_crash_without_dropping_or_duplicating(tmp_path, smollm2_tokenizer,
                                                                         monkeypatch):
    model = tiny_llama(0, vocab=49152, dtype=torch.float32)  # answers are gibberish; the bookkeeping is the point
    prompts = data.load_records(DATA / "train_prompts.jsonl").select(range(10))
    config = dict(max_new_tokens=3, batch_size=3, shard_size=4)
    whole = data.self_distill(model, smollm2_tokenizer, prompts,
                              data.SelfDistillConfig(out=str(tmp_path / "whole"), **config), {"fp": 1})

    calls, real = {"n": 0}, data.answer_batch

    def crash_in_second_shard(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # shard 0 took 2 calls (4 prompts, batch 3)
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(data, "answer_batch", crash_in_second_shard)
    resumed_cfg = data.SelfDistillConfig(out=str(tmp_path / "resumed"), **config)
    with pytest.raises(KeyboardInterrupt):
        data.self_distill(model, smollm2_tokenizer, prompts, resumed_cfg, {"fp": 1})
    assert sorted(p.name for p in (tmp_path / "resumed" / "shards").iterdir()) == ["shard-00000"]
    monkeypatch.setattr(data, "answer_batch", real)
    resumed = data.self_distill(model, smollm2_tokenizer, prompts, resumed_cfg, {"fp": 1})
    assert list(resumed["id"]) == list(prompts["id"]) == list(whole["id"])  # every prompt once, in order
    assert list(resumed["response_ids"]) == list(whole["response_ids"])
    reloaded = data.load_records(tmp_path / "resumed")  # the merged datasets dataset
    assert list(reloaded["id"]) == list(prompts["id"]) and '"max_new_tokens": 3' in reloaded.info.description
    with pytest.raises(data.DataError, match="max_new_tokens: 3 → 5"):
        data.self_distill(model, smollm2_tokenizer, prompts,
                          data.SelfDistillConfig(out=str(tmp_path / "resumed"), **(config | {"max_new_tokens": 5})),
                          {"fp": 1})


def test_conversation_examples_start_the_answer_after_the_prompt(smollm2_tokenizer):
    examples = data.load_examples("conversations", DATA / "train_conversations.jsonl", smollm2_tokenizer, limit=3)
    records = data.load_records(DATA / "train_conversations.jsonl").select(range(3))
    assert len(examples) == 3
    for example, record in zip(examples, records):
        answer = smollm2_tokenizer.decode(example.input_ids[example.response_start:], skip_special_tokens=True)
        assert answer.strip() == record["messages"][-1]["content"].strip()[: len(answer.strip())]
        prompt = smollm2_tokenizer.decode(example.input_ids[: example.response_start])
        assert record["messages"][0]["content"][:20] in prompt


def test_prompt_selection_skips_file_lines_then_filters_sources_then_limits():
    """``--skip 3072`` means "after the shared answers" whatever the source filters: skipping
    after filtering would silently re-answer (or drop) prompts."""
    import datasets

    sources = ["gsm8k-train", "gpteacher-roleplay", "t0:a", "self-instruct-user", "gpteacher-roleplay",
               "gsm8k-train", "self-instruct-seed", "gpteacher-roleplay"]
    prompts = datasets.Dataset.from_list([{"id": i, "source": s, "prompt": f"p{i}"} for i, s in enumerate(sources)])

    def ids(**config):
        return data.select_prompts(prompts, data.SelfDistillConfig(**config))["id"]

    assert ids(skip=2, limit=3) == [2, 3, 4]
    assert ids(skip=2, sources=["gpteacher-roleplay", "self-instruct"]) == [3, 4, 6, 7]
    assert ids(skip=2, sources=["gpteacher-roleplay", "self-instruct"], limit=2) == [3, 4]
    assert ids(skip=1, exclude_sources=["gsm8k-train", "t0:a"]) == [1, 3, 4, 6, 7]
    assert data.parse_selfdistill_args(["--source", "a", "--source", "b", "--skip", "5"]).sources == ["a", "b"]
    with pytest.raises(data.DataError, match="'source' column"):
        data.select_prompts(datasets.Dataset.from_list([{"prompt": "x"}]), data.SelfDistillConfig(sources=["a"]))
