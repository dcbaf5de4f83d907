"""Lines that say what went wrong: a C compiler that fails is named with its first line of output
(not taken for a permissions problem) and ``CC`` is split as make splits it; a prompt file is
checked whole when it is read — an empty name, a folder, binary bytes, a list-valued category —
so a bad one fails in one line naming the file and line before any model loads."""
from __future__ import annotations

import json
import shlex
import shutil
import sys
import warnings

import pytest

from draftheads.cli import main
from draftheads.decoding.base import fewrow
from draftheads.prompts import PromptFileError, read_prompts


def fake_compiler(path, exit_code: int, stderr: str):
    """An executable that records its arguments beside itself, prints ``stderr`` and exits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(path) + '.args'!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
                    f"sys.stderr.write({stderr!r})\nsys.exit({exit_code})\n")
    path.chmod(0o755)
    return path


@pytest.fixture()
def fresh_kernel(monkeypatch):
    monkeypatch.setattr(fewrow, "_state", {"lib": None, "status": "not loaded", "dtypes": frozenset()})
    monkeypatch.setattr(fewrow, "unsupported_reason", lambda: None)


@pytest.mark.parametrize("program", ["cc-fake", "a folder/cc fake"])
@pytest.mark.parametrize("stderr", ["cc1: error: bad value 'x' for '-march='\nsecond line\n", ""])
def test_a_failing_compiler_is_named_with_its_first_line_and_the_kernel_falls_back(tmp_path, monkeypatch,
                                                                                   fresh_kernel, program, stderr):
    compiler = fake_compiler(tmp_path / "bin" / program, 1, stderr)
    monkeypatch.setenv("CC", f"'{compiler}' -O2 -march=x")
    cache = tmp_path / "kernels"
    with pytest.warns(UserWarning, match="few-row kernel is off: the C compiler"):
        assert fewrow.load_kernel(cache) is False
    first = stderr.splitlines()[0] if stderr else "no message"
    command = shlex.join([str(compiler), "-O2", "-march=x"])
    assert fewrow.kernel_status() == f"off: the C compiler `{command}` failed (exit 1): {first}"
    assert "permission" not in fewrow.kernel_status() and fewrow.kernel() is None
    args = json.loads((compiler.parent / (compiler.name + ".args")).read_text())
    assert args[:-1] == ["-O2", "-march=x", *fewrow.FLAGS, str(fewrow.SOURCE), "-o"]  # one program, CC's flags first
    assert not list(cache.iterdir())  # the temporary library is gone


@pytest.mark.parametrize("cc,status", [
    ("{tmp}/no-such-cc", r"the C compiler `.*no-such-cc` could not be run \(No such file or directory\): set CC to an "
                         r"installed compiler, or unset it"),
    ("'unbalanced -O2", r"CC=\"'unbalanced -O2\" cannot be split into a command \(No closing quotation\): fix its "
                        r"quoting"),
])
def test_a_compiler_that_cannot_run_says_so(tmp_path, monkeypatch, fresh_kernel, cc, status):
    monkeypatch.setenv("CC", cc.replace("{tmp}", str(tmp_path)))
    with pytest.warns(UserWarning, match="few-row kernel is off"):
        assert fewrow.load_kernel(tmp_path / "kernels") is False
    assert __import__("re").fullmatch(f"off: {status}", fewrow.kernel_status()), fewrow.kernel_status()


@pytest.mark.parametrize("cc,expected", [("gcc -O2", ["gcc", "-O2"]), ("ccache gcc", ["ccache", "gcc"]),
                                         ("'/opt/my cc/gcc' -g", ["/opt/my cc/gcc", "-g"])])
def test_cc_is_split_as_make_splits_it(monkeypatch, cc, expected):
    monkeypatch.setenv("CC", cc)
    assert fewrow._compiler() == expected


def test_an_empty_cc_falls_back_to_the_system_compiler(monkeypatch):
    monkeypatch.setenv("CC", "  ")
    found = shutil.which("cc") or shutil.which("gcc")
    assert fewrow._compiler() == ([found] if found else None)


def test_cc_with_flags_builds_the_kernel(tmp_path, monkeypatch):
    gcc = shutil.which("gcc")
    if gcc is None or fewrow.unsupported_reason() is not None:
        pytest.skip(f"the few-row kernel is off here ({fewrow.unsupported_reason() or 'no gcc'})")
    monkeypatch.setattr(fewrow, "_state", {"lib": None, "status": "not loaded", "dtypes": frozenset()})
    monkeypatch.setenv("CC", f"{gcc} -O2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fewrow.load_kernel(tmp_path) is True
    assert fewrow.kernel_status().startswith("on (")


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
        read_prompts([name.replace("{tmp}", str(tmp_path))])


def test_a_byte_order_mark_and_unicode_line_separators_inside_strings_are_text(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes("\ufeff".encode() + json.dumps({"prompt": "one\u2028two", "category": "qa"},
                                                    ensure_ascii=False).encode() + b"\n")
    [record] = read_prompts(str(path))
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
