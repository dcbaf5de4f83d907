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
    assert "cannot read the prompt file" in err and "nope.jsonl" in err


def test_limit_takes_the_first_prompts(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"q{i}", "second"]}) + "\n" for i in range(3)))
    assert [p["prompt"] for p in read_prompts(str(prompts), 2)] == ["q0", "q1"]
    assert len(read_prompts(str(prompts), None)) == 3
    with pytest.raises(InputError, match="--limit must be ≥ 1, got 0"):
        read_prompts(str(prompts), 0)
