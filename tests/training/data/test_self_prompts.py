"""Prompts the base writes itself (training/data/self_prompts.py): a stopped run resumes to the same
file, no kept request overlaps an evaluation prompt or repeats, cut requests are dropped, and a
base without a chat template or an unreadable file is named in one line."""
from __future__ import annotations

import json

import pytest

from helpers import tiny_distill_setup
from draftheads.training.data import self_prompts
from draftheads.training.data.self_prompts import SelfPromptsConfig, cut_at_end, keep, spans


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("self-prompts")
    tiny_distill_setup(root, prompts=1, seed=0)
    return root


def config(base, out, **kw) -> SelfPromptsConfig:
    values = dict(out=str(out), count=12, batch_size=8, max_new_tokens=48, min_words=2, base=str(base / "base"),
                  heads=str(base / "heads"), dtype="float32", exclude=[])
    return SelfPromptsConfig(**{**values, **kw})


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resumed_run_writes_the_same_requests_and_keeps_out_the_evaluation_prompts(base, tmp_path, monkeypatch):
    whole = tmp_path / "whole.jsonl"
    assert self_prompts.run(config(base, whole)) == 0
    records = lines(whole)
    assert len(records) == 12 and len({r["prompt"] for r in records}) == 12
    assert all(r["source"] == "self-open" and len(r["prompt"].split()) >= 2 for r in records)

    stopped = tmp_path / "stopped.jsonl"
    real, calls = self_prompts.sample_batch, []

    def dies_after_two(*args):
        if len(calls) == 2:
            raise KeyboardInterrupt  # the run is stopped after two whole batches
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(self_prompts, "sample_batch", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        self_prompts.run(config(base, stopped))
    assert 0 < len(lines(stopped)) < 12
    monkeypatch.setattr(self_prompts, "sample_batch", real)
    assert self_prompts.run(config(base, stopped)) == 0
    assert stopped.read_text() == whole.read_text()

    with pytest.raises(self_prompts.DataError, match=r"was sampled with other settings \(seed 0 → 1\); use another --out"):
        self_prompts.run(config(base, whole, seed=1, count=20))

    banned = next(r["prompt"] for r in records if len(r["prompt"].split()) >= 13)  # inside an evaluation turn
    evaluation = tmp_path / "eval.jsonl"
    evaluation.write_text(json.dumps({"turns": ["please " + banned + " now"]}) + "\n")
    clean = tmp_path / "clean.jsonl"
    assert self_prompts.run(config(base, clean, exclude=[str(evaluation)])) == 0
    kept = [r["prompt"] for r in lines(clean)]
    assert banned not in kept and len(kept) == 12
    assert not any(spans(text) & spans("please " + banned + " now") for text in kept)


def test_filters():
    assert cut_at_end([5, 6, 2, 7], {2}) == [5, 6] and cut_at_end([5, 6, 7], {2}) is None
    seen: set[str] = set()
    long_eval = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    banned = spans(long_eval)
    assert keep("Write a poem about rain.", seen, banned, 4)
    assert not keep("write a POEM about rain", seen, banned, 4)  # the same request, normalized
    assert not keep("Hi there", seen, banned, 4)  # too short
    assert not keep("Say " + " ".join(long_eval.split()[1:]) + " please", seen, banned, 4)  # a 13-word span
    assert keep("Say " + " ".join(long_eval.split()[2:]) + " please", seen, banned, 4)  # only 12 shared


def test_unreadable_file_is_sampled_again_and_a_plain_base_is_refused(base, tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    out.write_text('{"id": "x", "prompt": "cut')  # a file without its progress record
    assert self_prompts.run(config(base, out, count=4)) == 0
    assert "unreadable or out of step with its progress file; sampling it again" in capsys.readouterr().err
    assert len(lines(out)) == 4

    class Plain:
        chat_template = None

    with pytest.raises(self_prompts.DataError, match="needs an instruct base with a chat template"):
        self_prompts.user_prefix_ids(Plain())
    missing = tmp_path / "nothing.jsonl"
    assert self_prompts.main(["--out", str(tmp_path / "q.jsonl"), "--base", str(base / "base"), "--exclude", str(missing)]) == 2
    assert f"{missing}: no such evaluation prompt file" in capsys.readouterr().err


def test_passage_prompts_wrap_a_jobs_finished_answers(base, tmp_path):
    """Tasks over passages (training/data/passage_prompts.py): each prompt holds the decoded answers
    of the sequences it names, joined, in one of the wordings; summaries and questions alternate;
    skipped sources and unfinished answers never appear; an empty job is one line."""
    from transformers import AutoTokenizer

    from draftheads.training.data import distill_job, passage_prompts
    from draftheads.training.data.distill_shards import open_shard
    from draftheads.training.data.passage_prompts import QUESTION, SUMMARY, PassagePromptsConfig

    prompts, answers = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    records = [{"id": f"{'gsm8k-train' if i % 3 == 0 else 'talk'}-{i}", "prompt": f"w{5 + i} w{9 + i} w7",
                "response_ids": [10 + (i * j) % 80 for j in range(3 + i)] + ([2] if i % 4 else [])}  # 2: EOS
               for i in range(12)]
    prompts.write_text("".join(json.dumps({"id": r["id"], "source": r["id"].rsplit("-", 1)[0], "prompt": r["prompt"]})
                               + "\n" for r in records))
    answers.write_text("".join(json.dumps(r) + "\n" for r in records))
    job = tmp_path / "job"
    assert distill_job.main(["--out", str(job), "--prompts", str(prompts), "--answers", str(answers), "--base",
                             str(base / "base"), "--heads", str(base / "heads"), "--dtype", "float32",
                             "--shard-size", "4"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(base / "base")
    texts, finished = {}, set()
    for folder in sorted((job / "shards").glob("shard-*")):
        shard = open_shard(folder, {}, "", with_hidden=False)
        for k, text_id in enumerate(shard.ids):
            ids = shard.sequence(k)[int(shard.answer_starts[k]):].tolist()
            texts[text_id] = tokenizer.decode(ids, skip_special_tokens=True).strip()
            finished |= {text_id} if shard.finished[k] else set()
    out = tmp_path / "passages.jsonl"
    config = PassagePromptsConfig(job=str(job), out=str(out), count=50, min_chars=20, max_chars=10_000,
                                  skip_sources=["gsm8k"], base=str(base / "base"))
    assert passage_prompts.run(config) == 0
    records = lines(out)
    assert len(finished) > 4 and len(finished) < len(texts)
    assert any(len(r["passage_of"]) > 1 for r in records)  # short answers are joined
    assert records and [r["source"] for r in records[:2]] == ["self-passage-summary", "self-passage-question"]
    for n, record in enumerate(records):
        assert all(i in finished and not i.startswith("gsm8k") for i in record["passage_of"])
        passage = "\n\n".join(texts[i] for i in record["passage_of"])
        wordings = SUMMARY if n % 2 == 0 else QUESTION
        assert record["prompt"] == wordings[(n // 2) % len(wordings)].format(passage=passage)
    assert passage_prompts.main(["--job", str(tmp_path), "--out", str(tmp_path / "x.jsonl"), "--base",
                                 str(base / "base")]) == 2
