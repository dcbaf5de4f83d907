"""Folder writes cannot lose the user's files: export, save and the generated custom_generate
module replace only a folder draftheads wrote (keeping the files it does not write), refuse
someone else's, leave nothing behind when they fail part-way, and put no user text into code."""
from __future__ import annotations

import ast
import builtins
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from helpers import tiny_llama
from draftheads.cli.checkpoint_commands import export_custom_generate
from draftheads.cli import main
from draftheads.custom_generate import write_custom_generate
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.core.errors import InputError
from draftheads.heads import CheckpointError, HeadConfig, MedusaHeads, load_heads
from draftheads.core import atomic
from draftheads.core.atomic import FolderNotOursError
from draftheads.heads.checkpoint.vllm_export import export_heads


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0)


@pytest.fixture()
def checkpoint(tmp_path, model):
    cfg = model.config
    heads = MedusaHeads(HeadConfig(num_heads=2, num_layers=1, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                                   base_fingerprint=fingerprint(model).to_dict(), base_name="tiny/base-0"))
    return heads.save_pretrained(tmp_path / "ckpt", dtype=None)


def user_files(folder: Path, count: int = 30) -> None:
    """``count`` files of the user's, some in a sub-folder, beside whatever is there."""
    (folder / "notes").mkdir(exist_ok=True)
    for i in range(count):
        (folder / ("notes" if i % 3 == 0 else ".") / f"mine-{i}.txt").write_text(f"user file {i}\n")


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path → bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# each writer of a folder: (name, write(model, checkpoint folder, out, beside) → where it went)
def write_save(model, ckpt: Path, out: Path, beside: bool) -> Path:
    assert not beside  # save_pretrained has no beside: it refuses
    return load_heads(ckpt).save_pretrained(out, dtype=None)


def write_vllm(model, ckpt: Path, out: Path, beside: bool) -> Path:
    return export_heads(load_heads(ckpt), "vllm-medusa", out, model.lm_head.weight, beside=beside)


def write_custom(model, ckpt: Path, out: Path, beside: bool) -> Path:
    export_custom_generate(load_heads(ckpt), str(out), None, beside)
    return out if not beside else out.with_name(out.name + "-draftheads")


WRITERS = {"save_pretrained": write_save, "export vllm-medusa": write_vllm, "export custom-generate": write_custom}


@pytest.mark.parametrize("writer", WRITERS, ids=str)
def test_a_folder_of_someone_elses_is_refused_and_left_as_it_is(tmp_path, model, checkpoint, writer):
    out = tmp_path / "theirs"
    out.mkdir()
    user_files(out)
    (out / "config.json").write_text('{"model_type": "llama"}')  # a config.json that is not draftheads'
    before = snapshot(out)
    with pytest.raises(FolderNotOursError, match=r"theirs already exists and holds files draftheads did not write "
                                                 r"\(config\.json, mine-1\.txt, mine-10\.txt and \d+ more\); it is "
                                                 r"left as it is: choose a new or empty folder"):
        WRITERS[writer](model, checkpoint, out, False)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "theirs"]  # no staging folder, no .old-*


@pytest.mark.parametrize("writer", WRITERS, ids=str)
def test_an_empty_folder_is_filled_and_our_own_is_replaced_keeping_the_users_files(tmp_path, model, checkpoint,
                                                                                    writer):
    out = tmp_path / "out"
    out.mkdir()
    WRITERS[writer](model, checkpoint, out, False)
    assert (out / "config.json").is_file()
    user_files(out)
    (out / "config.json").write_bytes((out / "config.json").read_bytes())  # still ours
    mine = {k: v for k, v in snapshot(out).items() if "mine-" in k}
    WRITERS[writer](model, checkpoint, out, False)
    assert {k: v for k, v in snapshot(out).items() if "mine-" in k} == mine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]


@pytest.mark.parametrize("writer", ["export vllm-medusa", "export custom-generate"], ids=str)
def test_beside_writes_next_to_a_folder_of_someone_elses(tmp_path, model, checkpoint, writer):
    out = tmp_path / "theirs"
    out.mkdir()
    user_files(out, 4)
    before = snapshot(out)
    written = WRITERS[writer](model, checkpoint, out, True)
    assert written == tmp_path / "theirs-draftheads" and (written / "config.json").is_file()
    assert snapshot(out) == before
    assert WRITERS[writer](model, checkpoint, out, True) == written  # a second time: the same sibling, replaced


def test_the_command_line_refusal_is_one_line_naming_beside(tmp_path, checkpoint, capsys):
    out = tmp_path / "theirs"
    out.mkdir()
    user_files(out, 2)
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--to", "custom-generate", str(checkpoint), str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"or pass --beside to write {tmp_path / 'theirs-draftheads'} next to it." in err


@pytest.mark.parametrize("where", ["working directory", "its parent"])
def test_the_working_directory_is_never_replaced(tmp_path, checkpoint, monkeypatch, where):
    out = tmp_path / "out"
    write_custom(None, checkpoint, out, False)  # ours, so only the working-directory rule refuses it
    (out / "inner").mkdir()
    monkeypatch.chdir(out if where == "working directory" else out / "inner")
    target = "." if where == "working directory" else ".."
    with pytest.raises(CheckpointError, match="is the working directory \\(or holds it\\)"):
        write_custom(None, checkpoint, Path(target), False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


class FailAfter:
    """Renames (the one-step swap included), moves, links and copies that work ``n`` times, then
    raise ``error``: every later call (``once=False``), or only that one (``once=True``)."""

    def __init__(self, monkeypatch, n: int, error: type[BaseException], once: bool):
        self.left, self.error, self.once = n, error, once
        for owner, name in ((os, "rename"), (os, "replace"), (shutil, "move"), (os, "link"), (shutil, "copy2"),
                            (os, "symlink"), (atomic, "exchange")):
            monkeypatch.setattr(owner, name, self.wrap(getattr(owner, name)))

    def wrap(self, real):
        def call(*args, **kwargs):
            self.left -= 1
            if self.left == -1 or (self.left < -1 and not self.once):
                raise self.error("injected failure")
            return real(*args, **kwargs)

        return call


@pytest.mark.parametrize("swap", ["one-step swap", "two renames"])
@pytest.mark.parametrize("error", [OSError, KeyboardInterrupt], ids=lambda e: e.__name__)
def test_a_failure_at_any_rename_or_copy_leaves_every_user_file_in_place(tmp_path, checkpoint, monkeypatch, error,
                                                                          swap):
    """Over a folder of ours holding 30 files of the user's: the export fails at the 1st, 2nd, ...
    rename / link / copy of a whole run; after each failure every file is where it was, with its
    bytes, and nothing is left beside it (no staging folder, no set-aside .old-*); where it
    still succeeds (a failed link falls back to a copy) the user's files are all there. Where
    the system swaps two folders in one rename every later call fails too; where it cannot (two
    renames) the failing call is the only one, so the first rename can be undone."""
    if swap == "two renames":
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    template, out = tmp_path / "template", tmp_path / "exported"
    write_custom(None, checkpoint, template, False)
    user_files(template)
    (template / "link-to-notes").symlink_to("notes")
    before = snapshot(template)
    heads = load_heads(checkpoint)
    with monkeypatch.context() as patch:
        counter = FailAfter(patch, 10**6, error, once=True)
        export_custom_generate(heads, str(shutil.copytree(template, out, symlinks=True)), "me/heads", False)
    calls = 10**6 - counter.left
    assert calls > 30  # the links of the carried-over files and the renames
    for n in range(calls + 1):
        shutil.rmtree(out)
        shutil.copytree(template, out, symlinks=True)
        with monkeypatch.context() as patch:
            FailAfter(patch, n, error, once=swap == "two renames")
            try:
                export_custom_generate(heads, str(out), "me/heads", False)
            except (error, Exception):
                succeeded = False
            else:
                succeeded = True
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "exported", "template"], n
        after = snapshot(out)
        if not succeeded:
            assert after == before, n
            continue
        assert {k: v for k, v in after.items() if "mine-" in k} == {k: v for k, v in before.items() if "mine-" in k}
        assert "me/heads" in (out / "custom_generate" / "generate.py").read_text() and (out / "link-to-notes").is_symlink()
    assert succeeded  # the last run, with nothing failing


def test_without_a_one_step_swap_a_rename_that_cannot_be_undone_names_the_kept_folder(tmp_path, checkpoint,
                                                                                       monkeypatch):
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    out = tmp_path / "exported"
    write_custom(None, checkpoint, out, False)
    user_files(out, 3)
    before = snapshot(out)
    real = os.rename
    calls = []

    def rename(a, b):  # the set-aside rename works, then renames fail
        calls.append(b)
        if len(calls) > 1:
            raise OSError(5, "Input/output error")
        return real(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointError, match=r"could not be replaced nor put back \(Input/output error\); the "
                                              r"previous folder is whole at .*\.exported\.old-\w+: rename it back "
                                              r"to exported"):
        export_custom_generate(load_heads(checkpoint), str(out), None, False)
    monkeypatch.undo()
    [kept] = [p for p in tmp_path.iterdir() if p.name.startswith(".exported.old-")]
    assert snapshot(kept) == before and sorted(p.name for p in tmp_path.iterdir()) == [kept.name, "ckpt"]


NASTY_SOURCES = [
    '"""; import builtins; builtins.PWNED = 1; """',
    "'''; import builtins; builtins.PWNED = 1; '''",
    '\\"; import builtins; builtins.PWNED = 1; x = "',
    "org/heads\\\\' + __import__('builtins').__setattr__('PWNED', 1) + '",
    "{heads} {version} %s {0}",
    "/tmp/a folder/with ünïcødé and \\N{SNOWMAN} and \\u0041",
    "C:\\new\\table\\x41",
]


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location("generated_custom_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("source", NASTY_SOURCES)
def test_quotes_in_the_source_never_become_code(tmp_path, source):
    folder = write_custom_generate(tmp_path, source)
    text = (folder / "generate.py").read_text(encoding="utf-8")
    tree = ast.parse(text)
    assert [type(node).__name__ for node in tree.body] == ["Expr", "ImportFrom", "Assign", "FunctionDef"]
    assert source not in ast.get_docstring(tree)
    [assign] = [node for node in tree.body if isinstance(node, ast.Assign)]
    assert [t.id for t in assign.targets] == ["HEADS"] and ast.literal_eval(assign.value) == source
    module = load_module(folder / "generate.py")
    assert module.HEADS == source and not hasattr(builtins, "PWNED")
    assert sorted(n for n in vars(module) if not n.startswith("__")) == ["HEADS", "generate", "run_folder_generate"]


@pytest.mark.parametrize("source", ["org/heads\nimport os", "a\rb", "a\x00b", "a\u2028b", "", "  "])
def test_a_source_that_is_not_one_line_of_text_is_refused(tmp_path, checkpoint, source, capsys):
    if source.strip():
        with pytest.raises(InputError, match=r"holds the control character .*: a repo id or a path is one line"):
            write_custom_generate(tmp_path, source)
        assert not (tmp_path / "custom_generate").exists()
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--to", "custom-generate", "--source", source, str(checkpoint), str(out)])
    assert exit_info.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--source" in err


def test_the_exported_module_names_the_source_from_the_command_line(tmp_path, checkpoint):
    source = NASTY_SOURCES[0]
    assert main(["export", "--to", "custom-generate", "--source", source, str(checkpoint), str(tmp_path / "o")]) == 0
    assert load_module(tmp_path / "o" / "custom_generate" / "generate.py").HEADS == source
    assert not hasattr(builtins, "PWNED")
    assert "PWNED" not in sys.modules


@pytest.mark.parametrize("base_name", ["org/x\nlicense: mit", "org/x: y", "./org/x", "org/x\n---\nmalicious: 1"])
def test_a_base_name_that_is_no_hub_id_stays_out_of_the_cards_front_matter(base_name):
    from draftheads.heads.checkpoint.card import basic_card

    card = basic_card(HeadConfig(num_heads=2, hidden_size=8, vocab_size=10, base_name=base_name))
    front = card.split("---\n")[1]
    assert "base_model" not in front and "mit" not in front and "malicious" not in front
    assert yaml.safe_load(front)["library_name"] == "draftheads"


def test_export_follows_symlinks_and_refuses_a_dangling_one_by_name(tmp_path, checkpoint, capsys):
    """A checkpoint holding a symlink: one that resolves is copied as its target's content; a
    dangling one is one line naming it, and nothing is written (no shutil.Error traceback)."""
    (tmp_path / "notes.md").write_text("kept")
    os.symlink(tmp_path / "notes.md", checkpoint / "notes.md")
    assert main(["export", "--to", "custom-generate", str(checkpoint), str(tmp_path / "good")]) == 0
    copied = tmp_path / "good" / "notes.md"
    assert not copied.is_symlink() and copied.read_text() == "kept"
    capsys.readouterr()
    os.symlink(tmp_path / "gone.bin", checkpoint / "extra.bin")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--to", "custom-generate", str(checkpoint), str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert str(checkpoint / "extra.bin") in err and "does not exist" in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
