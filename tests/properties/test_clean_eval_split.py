"""The clean evaluation set (``prompts.CLEAN_EVAL_PROMPTS``, what a recipe's ``data.eval_path`` job
answers): no prompt the benches decode, every category the bench reports, and the committed file
is the rule's output, read by name and by the distill job with each record's Spec-Bench task."""
from __future__ import annotations

import json
from collections import Counter

from draftheads.prompts import (BATCH_PROMPTS, CLEAN_EVAL_PROMPTS, DATA_DIR, DEV_PROMPTS, MT_BENCH_CATEGORIES,
                                PROMPT_SETS, clean_eval_text, group_of, read_prompts)
from draftheads.training.data import distill_prompts

SPEC_BENCH_TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")
CLEAN_FILE = DATA_DIR / "clean_eval.jsonl"


def test_the_clean_set_holds_no_prompt_a_bench_decodes():
    clean = {r["prompt"] for r in read_prompts(CLEAN_EVAL_PROMPTS)}
    for spec in (DEV_PROMPTS, BATCH_PROMPTS):
        assert clean.isdisjoint(r["prompt"] for r in read_prompts(spec)), spec


def test_the_clean_set_covers_every_category_the_bench_reports_with_the_counts_left():
    counts = Counter(r["category"] for r in read_prompts(CLEAN_EVAL_PROMPTS))
    # spec-bench holds 10 of each MT-Bench category and 40 of each other task. DEV_PROMPTS decodes the
    # first 1 / 8 of each, BATCH_PROMPTS the first 2 / 4: together the first 2 of each MT-Bench
    # category (16) and the first 8 of each other task (40), so 280 − 56 = 224 remain
    assert counts == {**{c: 10 - 2 for c in MT_BENCH_CATEGORIES}, **{t: 40 - 8 for t in SPEC_BENCH_TASKS}}
    assert len(counts) == 13 and sum(counts.values()) == 64 + 5 * 32 == 224


def test_the_committed_file_is_the_rule_and_keeps_spec_benchs_records():
    assert PROMPT_SETS[CLEAN_EVAL_PROMPTS] == CLEAN_FILE.name
    assert CLEAN_FILE.read_text(encoding="utf-8") == clean_eval_text()
    original = {json.loads(line)["question_id"]: json.loads(line)
                for line in (DATA_DIR / PROMPT_SETS["spec-bench"]).read_text(encoding="utf-8").splitlines()}
    for line in CLEAN_FILE.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        assert record.pop("source") == group_of(record["category"])
        assert record == original[record["question_id"]]  # unchanged but for the added source


def test_the_name_takes_counts_and_the_distill_job_groups_it_by_task():
    assert Counter(r["category"] for r in read_prompts(f"{CLEAN_EVAL_PROMPTS}@4")) == {
        c: 4 for c in (*MT_BENCH_CATEGORIES, *SPEC_BENCH_TASKS)}
    assert len(read_prompts(f"{CLEAN_EVAL_PROMPTS}@2:mt_bench,rag")) == 8 * 2 + 2
    # the evaluation job's groups are its sources: mt_bench (what scripts/data_scaling.py reads) and each task
    sources = Counter(p.source for p in distill_prompts.read_prompts(str(CLEAN_FILE)))
    assert sources == {"mt_bench": 64, **{t: 32 for t in SPEC_BENCH_TASKS}}
