"""Data pipeline: self-distillation resumes without dropping or duplicating a prompt and keeps
its provenance; conversations put the answer where training expects it; data is a local file or
folder or a Hub dataset id (split, config, column mapping), and each way it can fail is one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import FIXTURES, REPO, tiny_llama
from draftheads.training.data import records as data, self_distillation
from draftheads.training.recipe import load_recipe
from draftheads.training.preflight import preflight


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from draftheads.decoding.base.loading import resolve_base

    return AutoTokenizer.from_pretrained(resolve_base(None)[0])


def test_selfdistill_resumes_after_a_crash_without_dropping_or_duplicating(tmp_path, smollm2_tokenizer,
                                                                         monkeypatch):
    model = tiny_llama(0, vocab=49152, dtype=torch.float32)  # answers are gibberish; the bookkeeping is the point
    prompts = data.load_records(FIXTURES / "train_prompts_sample.jsonl").select(range(10))
    config = dict(max_new_tokens=3, batch_size=3, shard_size=4)
    whole = self_distillation.self_distill(model, smollm2_tokenizer, prompts,
                              self_distillation.SelfDistillConfig(out=str(tmp_path / "whole"), **config), {"fp": 1})

    calls, real = {"n": 0}, self_distillation.answer_batch

    def crash_in_second_shard(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # shard 0 took 2 calls (4 prompts, batch 3)
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(self_distillation, "answer_batch", crash_in_second_shard)
    resumed_cfg = self_distillation.SelfDistillConfig(out=str(tmp_path / "resumed"), **config)
    with pytest.raises(KeyboardInterrupt):
        self_distillation.self_distill(model, smollm2_tokenizer, prompts, resumed_cfg, {"fp": 1})
    assert sorted(p.name for p in (tmp_path / "resumed" / "shards").iterdir()) == ["shard-00000"]
    monkeypatch.setattr(self_distillation, "answer_batch", real)
    resumed = self_distillation.self_distill(model, smollm2_tokenizer, prompts, resumed_cfg, {"fp": 1})
    assert list(resumed["id"]) == list(prompts["id"]) == list(whole["id"])  # every prompt once, in order
    assert list(resumed["response_ids"]) == list(whole["response_ids"])
    reloaded = data.load_records(tmp_path / "resumed")  # the merged datasets dataset
    assert list(reloaded["id"]) == list(prompts["id"]) and '"max_new_tokens": 3' in reloaded.info.description
    with pytest.raises(data.DataError, match="max_new_tokens: 3 → 5"):
        self_distillation.self_distill(model, smollm2_tokenizer, prompts,
                          self_distillation.SelfDistillConfig(out=str(tmp_path / "resumed"), **(config | {"max_new_tokens": 5})),
                          {"fp": 1})


def test_conversation_examples_start_the_answer_after_the_prompt(smollm2_tokenizer):
    examples = data.load_examples("conversations", FIXTURES / "train_conversations_sample.jsonl", smollm2_tokenizer, limit=3)
    records = data.load_records(FIXTURES / "train_conversations_sample.jsonl").select(range(3))
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
        return self_distillation.select_prompts(prompts, self_distillation.SelfDistillConfig(**config))["id"]

    assert ids(skip=2, limit=3) == [2, 3, 4]
    assert ids(skip=2, sources=["gpteacher-roleplay", "self-instruct"]) == [3, 4, 6, 7]
    assert ids(skip=2, sources=["gpteacher-roleplay", "self-instruct"], limit=2) == [3, 4]
    assert ids(skip=1, exclude_sources=["gsm8k-train", "t0:a"]) == [1, 3, 4, 6, 7]
    parsed = self_distillation.parse_selfdistill_args(["--prompts", "x.jsonl", "--source", "a", "--source", "b", "--skip", "5",
                                          "--columns", "question:prompt,idx:id"])
    assert parsed.sources == ["a", "b"] and parsed.columns == {"question": "prompt", "idx": "id"}
    with pytest.raises(SystemExit):  # no default prompt set: a clone carries none
        self_distillation.parse_selfdistill_args(["--skip", "5"])
    with pytest.raises(data.DataError, match="'source' column"):
        self_distillation.select_prompts(datasets.Dataset.from_list([{"prompt": "x"}]), self_distillation.SelfDistillConfig(sources=["a"]))


# -- data by path or by name --------------------------------------------------------------------
def test_a_datasets_folder_and_a_json_file_load_with_the_column_mapping(tmp_path):
    """What a Hub dataset becomes in the cache (a ``datasets`` folder), and a JSON-lines file read
    with ``load_dataset("json")``: both renamed by ``columns`` and checked against the kind."""
    import datasets

    rows = [{"question": f"q{i}", "idx": i} for i in range(5)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for source in (tmp_path / "saved", tmp_path / "rows.jsonl"):
        loaded = data.load_records(source, columns={"question": "prompt", "idx": "id"})
        assert loaded.column_names == ["prompt", "id"] and loaded["prompt"] == [r["question"] for r in rows]
        data.require_columns(loaded, "prompts", source)
        with pytest.raises(data.DataError, match="no column 'prompt' needed for data kind 'prompts'.*data.columns"):
            data.require_columns(data.load_records(source), "prompts", source)
        with pytest.raises(data.DataError, match="has no column 'questoin' to rename"):
            data.load_records(source, columns={"questoin": "prompt"})
        with pytest.raises(data.DataError, match="already has a column 'idx'"):
            data.load_records(source, columns={"question": "idx"})


def test_bad_local_data_is_one_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(data.DataError, match=r"bad\.jsonl cannot be read as json data \(JSON parse error") as err:
        data.load_records(tmp_path / "bad.jsonl")
    assert "\n" not in str(err.value)
    with pytest.raises(data.DataError, match=r"Data '\.\./nowhere/x\.jsonl' not found .*Hub dataset id"):
        data.load_records("../nowhere/x.jsonl")


def test_hub_ids_are_names_not_paths():
    assert data.is_hub_id("openai/gsm8k") and data.is_hub_id("gsm8k") and data.is_hub_id("data_cache/answers")
    assert not any(data.is_hub_id(p) for p in ("../elsewhere/x.jsonl", "/abs/dir", "a/b/c", "rows.jsonl", "./x"))


def test_training_data_that_is_not_set_or_not_found_names_both_ways(tmp_path):
    with pytest.raises(data.DataError, match=r"data.path is not set \(--data.path PATH_OR_HUB_ID\); use a local "
                                             r"JSON-lines file .* or a Hub dataset id"):
        preflight(load_recipe(None))
    with pytest.raises(data.DataError, match=r"missing\.jsonl does not exist .*; use a local JSON-lines file"):
        preflight(load_recipe(None, ["--data.path", str(tmp_path / "missing.jsonl")]))


def test_an_uncached_hub_dataset_fails_in_one_line_naming_the_local_way(tmp_path):
    """No machine here reaches the Hub: ``draftheads train`` on a Hub id that is not cached stops
    before loading anything, with one line (offline mode: no retries against the network)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-m", "draftheads.cli", "train", str(REPO / "recipes/hydra-smollm2.yaml"),
                           "--data.kind", "selfdistill", "--data.path", "no-such-owner/no-such-dataset",
                           "--data.name", "main"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: Data 'no-such-owner/no-such-dataset' is no local file or folder") \
        and "use a local JSON-lines file or datasets folder" in lines[0], lines[0]


def test_hub_options_at_their_defaults_leave_a_runs_identity_unchanged():
    """Runs made before data.name / data.split / data.columns existed must still resume."""
    plain = load_recipe(None, ["--data.path", "x.jsonl"]).identity()["data"]
    assert not {"name", "split", "columns"} & set(plain)
    named = load_recipe(None, ["--data.path", "openai/gsm8k", "--data.name", "main", "--data.columns",
                               "{question: prompt}"]).identity()["data"]
    assert named["name"] == "main" and named["columns"] == {"question": "prompt"} and "split" not in named


def test_the_committed_selfdistill_sample_trains_as_the_recipes_data(smollm2_tokenizer):
    """The sample a clone carries is the recipes' kind of data: every answer ends where the
    recorded ids end, and the recipes' source caps select from it."""
    path = FIXTURES / "selfdistill_smollm2_sample.jsonl"
    records = data.load_records(path)
    assert len(records) == 256
    examples = data.load_examples("selfdistill", path, smollm2_tokenizer, limit=4)
    for example, record in zip(examples, records):
        assert example.input_ids[example.response_start:] == record["response_ids"][: len(example.input_ids)
                                                                                   - example.response_start]
    capped = data.select_sources(records["source"], caps={"gsm8k-train": 10, "t0": 5})
    assert len(capped) == 256 - records["source"].count("gsm8k-train") - sum(s.startswith("t0") for s in
                                                                               records["source"]) + 15
