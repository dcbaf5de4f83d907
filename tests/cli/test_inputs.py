"""The command line's inputs, checked before any model loads and each refused in one line: numeric
options (checked exactly as the Python API checks them) and prompt files — read whole when they
are read (an empty name, a folder, binary bytes, a bad record or a list-valued category fail
naming the file and line), the built-in prompt sets and their ``@N`` suffix, ``--limit``."""
from __future__ import annotations

import json

import pytest

from draftheads.cli import main
from draftheads.cli.parsing import read_prompts
from draftheads.core.errors import InputError
from draftheads.prompts import PromptFileError, read_prompts as read_prompt_file


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


def run_bench(capsys, *prompts: str) -> str:
    """``draftheads bench`` on ``prompts`` with a base that does not exist: a prompt problem must
    be reported before the base is looked at. Returns the one error line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--prompts", *prompts, "--heads", "none", "--base", "/nonexistent/base"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "nonexistent" not in err
    return err


@pytest.mark.parametrize("content,message", [
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", r"p\.jsonl:1 is not UTF-8 text \(a binary file\?\): a prompt file is JSON lines"),
    (b'{"prompt": "a"}\n{"prompt": "b"}\n\xff\xfe\x00', r"p\.jsonl:3 is not UTF-8 text"),
    (b'{"prompt": "a"}\n{"prompt": "b", "category": ["qa", "rag"]}\n',
     r"p\.jsonl:2 has category \['qa', 'rag'\]; it must be a string \(one name per prompt\), or left out"),
    (b'{"prompt": "a", "category": 7}\n', r"p\.jsonl:1 has category 7; it must be a string"),
    (b'{"prompt": "a", "source": {"x": 1}}\n', r"p\.jsonl:1 has source \{'x': 1\}; it must be a string"),
    (b'{"turns": ["a", 5]}\n', r"p\.jsonl:1 has the turn 5 in 'turns'; every turn must be a non-empty string"),
    (b'{"turns": ["a", ""]}\n', r"p\.jsonl:1 has the turn '' in 'turns'"),
    (b'{"prompt": "a", "question_id": [1]}\n', r"p\.jsonl:1 has question_id \[1\]; it must be a string or a whole "
                                               r"number"),
    (b'{"prompt": "a", "id": true}\n', r"p\.jsonl:1 has id True; it must be a string or a whole number"),
])
def test_a_bad_prompt_file_fails_whole_before_any_work(tmp_path, capsys, content, message):
    (tmp_path / "p.jsonl").write_bytes(content)
    assert __import__("re").search(message, run_bench(capsys, str(tmp_path / "p.jsonl")))


@pytest.mark.parametrize("name,message", [
    ("", r"--prompts '' names no file: pass a JSON-lines prompt file; the built-in sets are mt-bench, spec-bench"),
    ("   ", r"--prompts '   ' names no file"),
    ("{tmp}", r"is a folder: pass a JSON-lines prompt file \(one JSON object per line\)"),
])
def test_an_empty_name_or_a_folder_is_no_prompt_file(tmp_path, capsys, name, message):
    err = run_bench(capsys, name.replace("{tmp}", str(tmp_path)))
    assert __import__("re").search(message, err), err
    with pytest.raises(PromptFileError, match=message):
        read_prompt_file([name.replace("{tmp}", str(tmp_path))])


def test_a_byte_order_mark_and_unicode_line_separators_inside_strings_are_text(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes("\ufeff".encode() + json.dumps({"prompt": "one\u2028two", "category": "qa"},
                                                    ensure_ascii=False).encode() + b"\n")
    [record] = read_prompt_file(str(path))
    assert record["prompt"] == "one\u2028two" and record["category"] == "qa"


def test_import_medusa_checks_its_trees_prompt_file_before_the_base_loads(tmp_path, capsys):
    from helpers import reference_heads, write_medusa

    write_medusa(tmp_path / "medusa", reference_heads(32, 96, heads=2, layers=1, projection=False), 1, "safetensors")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a", "category": ["x"]}\n')
    with pytest.raises(SystemExit) as exit_info:
        main(["import-medusa", str(tmp_path / "medusa"), str(tmp_path / "out"), "--base", "/nonexistent/base",
              "--trees-from", str(tmp_path / "p.jsonl")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "p.jsonl:1 has category ['x']; it must be a string" in err and not (tmp_path / "out").exists()
