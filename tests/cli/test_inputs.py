"""Issue 22: the CLI refuses bad numeric options and bad prompt files with one clear line,
before any model loads, and checks numbers exactly as the Python API does."""
from __future__ import annotations

import json

import pytest

from draftheads.cli import main, read_prompts
from draftheads.decoding.limits import InputError


def run_cli(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code not in (0, None)
    code = exit_info.value.code
    return (code if isinstance(code, str) else "") + capsys.readouterr().err


@pytest.mark.parametrize("option,value,message", [
    ("--limit", "-1", r"--limit: must be ≥ 1, got -1"),
    ("--limit", "0", r"--limit: must be ≥ 1, got 0"),
    ("--max-new-tokens", "0", r"--max-new-tokens: must be ≥ 1, got 0"),
    ("--repeats", "0", r"--repeats: must be ≥ 1, got 0"),
    ("--batch-sizes", "4,0", r"--batch-sizes: expected integers ≥ 1"),
    ("--max-batches", "-2", r"--max-batches: expected integers ≥ 1"),
    ("--budgets", "-1", r"--budgets: expected integers ≥ 0"),
    ("--tree", "-1", r"--tree: tree \(a node budget\) must be ≥ 0, got -1"),
    ("--tree", "1.5", r"--tree: tree='1.5': expected 'adaptive' or a node budget"),
])
def test_bench_numeric_options(tmp_path, capsys, option, value, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    err = run_cli(["bench", "--prompts", str(prompts), "--heads", "none", option, value], capsys)
    assert __import__("re").search(message, err), err


@pytest.mark.parametrize("content,message", [
    ("", r"p\.jsonl holds no prompts"),
    ("\n\n", r"p\.jsonl holds no prompts"),
    ('{"prompt": "a"}\n{"prompt": "b"\n', r"p\.jsonl:2 is not valid JSON"),
    ('{"turns": []}\n', r"p\.jsonl:1 has 'turns' \[\]; it must be a non-empty list"),
    ('[1, 2]\n', r"p\.jsonl:1 is a JSON list, expected an object"),
    ('{"prompt": ""}\n', r"p\.jsonl:1: the prompt '' must be a non-empty string"),
    ('{"text": "x"}\n', r"p\.jsonl:1 has neither 'turns' nor 'prompt'"),
])
def test_bad_prompt_files_fail_before_the_model_loads(tmp_path, capsys, content, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(content)
    err = run_cli(["bench", "--prompts", str(prompts), "--heads", "none", "--base", "/nonexistent"], capsys)
    assert __import__("re").search(message, err), err


def test_missing_prompt_file(capsys, tmp_path):
    err = run_cli(["bench", "--prompts", str(tmp_path / "nope.jsonl"), "--heads", "none"], capsys)
    assert "nope.jsonl' is neither a prompt file nor a built-in prompt set" in err and len(err.strip().splitlines()) == 1


def test_an_unknown_prompt_set_name_lists_the_names(capsys):
    err = run_cli(["bench", "--prompts", "mt-bench", "spec-bnch@8", "--heads", "none"], capsys)
    assert "'spec-bnch' is neither a prompt file nor a built-in prompt set; the built-in sets are mt-bench, " \
           "spec-bench" in err and len(err.strip().splitlines()) == 1, err


def test_an_empty_prompt_file_is_one_line(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    err = run_cli(["bench", "--prompts", str(tmp_path / "empty.jsonl"), "--heads", "none"], capsys)
    assert err.strip().splitlines() == [f"error: {tmp_path / 'empty.jsonl'} holds no prompts; write one JSON object "
                                        "per line with 'turns' or 'prompt'."]


def test_builtin_prompt_sets_are_the_shipped_files_with_the_suffix_syntax():
    """``mt-bench spec-bench@8`` (the README's bench) is MT-Bench's 80 prompts plus 8 of each of
    Spec-Bench's 5 other tasks, read from the package's own data folder (nothing outside the clone)."""
    from draftheads.prompts import DATA_DIR, prompt_file

    assert prompt_file("mt-bench") == DATA_DIR / "mt_bench.jsonl" and prompt_file("mt-bench").is_file()
    first_lines = [json.loads(line)["turns"][0] for line in open(DATA_DIR / "mt_bench.jsonl", encoding="utf-8")]
    both = read_prompts(["mt-bench", "spec-bench@8"], None)
    assert [p["prompt"] for p in both[:80]] == first_lines and len(both) == 80 + 5 * 8
    assert {p["category"] for p in both[80:]} == {"translation", "summarization", "qa", "math_reasoning", "rag"}
    picked = read_prompts(["spec-bench@2:qa,mt_bench"], None)
    assert [p["category"] for p in picked].count("qa") == 2 and len(picked) == 2 + 2 * 8


def test_limit_takes_the_first_prompts(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"q{i}", "second"]}) + "\n" for i in range(3)))
    assert [p["prompt"] for p in read_prompts(str(prompts), 2)] == ["q0", "q1"]
    assert len(read_prompts(str(prompts), None)) == 3
    with pytest.raises(InputError, match="--limit must be ≥ 1, got 0"):
        read_prompts(str(prompts), 0)
