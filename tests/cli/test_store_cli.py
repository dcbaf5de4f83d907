"""``draftheads store build``: a store built from a base's own answers opens for that base's
tokenizer and drafts its answers (accepted: τ > 1, the output the base's own); records are held
out and capped as asked; a store file is rebuilt in place; every bad argument is one ``error:``
line naming the fix, before the tokenizer loads, and leaves an existing file as it was."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from helpers import STORE_RECORDS, save_tiny_base, write_store
from draftheads.cli import main
from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.drafters import ModelStore, StoreSource, tokenizer_identity

PROMPTS = ["w5 w6 w7", "w9 w8", "w3 w4"]  # one-digit words: the tiny tokenizer splits w10 into w1 w0


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny base saved with its word-level tokenizer (96 ids), and its own greedy answers to
    :data:`PROMPTS` beside it as ``answers.jsonl``."""
    folder = tmp_path_factory.mktemp("store-cli") / "base"
    model = save_tiny_base(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    lines = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        answer = model.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, ids.shape[1]:]
        lines.append(json.dumps({"prompt": prompt, "response_ids": answer.tolist()}))
    (folder.parent / "answers.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def build(argv: list[str], capsys) -> dict:
    """Run ``draftheads store build`` in-process; its JSON report."""
    capsys.readouterr()
    assert main(["store", "build", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def run_cli(argv: list[str], capsys) -> str:
    """Exit status 2, one ``error:`` line on stderr and no traceback; that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_a_built_store_opens_for_its_tokenizer_and_drafts_the_bases_answers(base, tmp_path, capsys):
    out = tmp_path / "lookup_store.safetensors"
    report = build(["--data", str(base.parent / "answers.jsonl"), "--out", str(out), "--tokenizer", str(base)], capsys)
    tokenizer = AutoTokenizer.from_pretrained(base)
    store = ModelStore.open(out, expect=tokenizer_identity(tokenizer))
    answers = [json.loads(line)["response_ids"] for line in (base.parent / "answers.jsonl").read_text().splitlines()]
    assert report == {**report, "out": str(out), "records": 3, "tokens": 72, "n": store.header.n,
                      "bytes": out.stat().st_size}
    assert store.tokens.tolist() == [t for a in answers for t in a + [-1]]
    assert store.header.source.startswith("answers.jsonl sha256:")
    for answer in answers:  # the store proposes each answer's next tokens after its first ones
        assert tuple(answer[6:9]) in set(StoreSource(store, answer[:6]).propose(4).paths())
    # and a model drafting from it alone answers as the base does, taking several tokens a step
    model = DraftHeadsModel.from_pretrained(None, base_name_or_path=str(base), dtype="float64", sources="store",
                                            lookup_store=str(out), tree=8)
    for prompt, answer in zip(PROMPTS, answers):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        assert model.generate(ids, max_new_tokens=24, min_new_tokens=24)[0, ids.shape[1]:].tolist() == answer
        assert model.last_stats.tau > 2


def test_the_last_records_are_held_out_and_the_first_kept(base, tmp_path, capsys):
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps({"response_ids": r}) + "\n" for r in STORE_RECORDS))
    out = tmp_path / "store.safetensors"
    report = build(["--data", str(data), "--out", str(out), "--tokenizer", str(base), "--holdout-last", "1"], capsys)
    store = ModelStore.open(out)
    assert report["records"] == store.header.records == 3 and store.header.tokens == 15
    assert store.tokens.tolist() == [t for r in STORE_RECORDS[:3] for t in r + [-1]]
    assert "held out: last 1" in store.header.source and report["bytes"] == out.stat().st_size
    build(["--data", str(data), "--out", str(out), "--tokenizer", str(base), "--max-records", "2"], capsys)
    assert ModelStore.open(out).tokens.tolist() == [t for r in STORE_RECORDS[:2] for t in r + [-1]]  # rebuilt in place


def test_a_selfdistill_output_folder_is_data(base, tmp_path, capsys):
    """What ``draftheads selfdistill --out`` writes (a ``datasets`` folder under ``dataset/``) builds as its JSONL would."""
    import datasets

    datasets.Dataset.from_list([{"prompt": "p", "response_ids": r} for r in STORE_RECORDS]).save_to_disk(
        str(tmp_path / "run" / "dataset"))
    out = tmp_path / "store.safetensors"
    build(["--data", str(tmp_path / "run"), "--out", str(out), "--tokenizer", str(base)], capsys)
    assert ModelStore.open(out).tokens.tolist() == [t for r in STORE_RECORDS for t in r + [-1]]


BAD = [  # (argv, text the one error line holds); DATA: the good answers, BASE: the tokenizer
    (["--data", "ROOT/missing.jsonl", "--out", "ROOT/s.safetensors"],
     "--data ROOT/missing.jsonl does not exist: pass the base's own answers"),
    (["--data", "DATA", "--out", "ROOT/notes.txt"],
     "--out ROOT/notes.txt exists and is not a draftheads lookup store: pass a new path"),
    (["--data", "DATA", "--out", "DATA"], "exists and is not a draftheads lookup store"),
    (["--data", "DATA", "--out", "ROOT"], "--out ROOT is a folder: pass the store file to write, e.g. --out "
                                          "ROOT/lookup_store.safetensors"),
    (["--data", "ROOT/prompts.jsonl", "--out", "ROOT/s.safetensors"], "has no column 'response_ids'"),
    (["--data", "ROOT/bad-ids.jsonl", "--out", "ROOT/s.safetensors"], "record 2: response_ids must be a list of token ids"),
    (["--data", "ROOT/big-ids.jsonl", "--out", "ROOT/s.safetensors", "--tokenizer", "BASE"],
     "holds token id 500, outside this tokenizer's vocabulary [0, 96): pass --tokenizer"),
    (["--data", "DATA", "--out", "ROOT/s.safetensors", "--holdout-last", "3"],
     "--holdout-last 3 leaves none of the 3 records for the store: pass a number below 3"),
    (["--data", "DATA", "--out", "ROOT/s.safetensors", "--holdout-last", "-1"], "argument --holdout-last: must be ≥ 0"),
    (["--data", "DATA", "--out", "ROOT/s.safetensors", "--max-records", "0"], "argument --max-records: must be ≥ 1"),
    (["--out", "ROOT/s.safetensors"], "the following arguments are required: --data (see `draftheads store build --help`)"),
    ([], "the following arguments are required: --data, --out"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a[-2:]) or "none" for a, _ in BAD])
def test_bad_arguments_are_one_line_and_change_nothing(base, tmp_path, capsys, argv, message):
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "w5"}) + "\n")
    (tmp_path / "bad-ids.jsonl").write_text(json.dumps({"response_ids": [5, 6]}) + "\n" + json.dumps({"x": 1}) + "\n")
    (tmp_path / "big-ids.jsonl").write_text(json.dumps({"response_ids": [5, 500, 6]}) + "\n")
    names = {"ROOT": str(tmp_path), "DATA": str(base.parent / "answers.jsonl"), "BASE": str(base)}

    def fill(text: str) -> str:
        for key, value in names.items():
            text = text.replace(key, value)
        return text

    before = {p: p.read_bytes() for p in [*tmp_path.iterdir(), base.parent / "answers.jsonl"] if p.is_file()}
    line = run_cli(["store", "build", *map(fill, argv)], capsys)
    assert fill(message) in line, line
    assert {p: p.read_bytes() for p in before} == before and not (tmp_path / "s.safetensors").exists()


def test_a_damaged_store_is_refused_until_deleted(base, tmp_path, capsys):
    """A store whose header no longer reads is not overwritten (it may be someone else's file);
    the error says to delete it, and then the build writes it."""
    out = tmp_path / "s.safetensors"
    write_store(out)
    out.write_bytes(out.read_bytes()[:5])
    argv = ["store", "build", "--data", str(base.parent / "answers.jsonl"), "--out", str(out), "--tokenizer", str(base)]
    assert "a damaged one, delete it first" in run_cli(argv, capsys)
    out.unlink()
    assert main(argv) == 0 and ModelStore.open(out).header.records == 3


def test_the_store_errors_name_this_subcommand_in_a_command_line_that_parses(base):
    """The command the store's errors tell the user to run is this one, with its options spelled right."""
    import re

    from draftheads.cli import build_parser
    from draftheads.decoding.drafters import StoreError
    from draftheads.decoding.drafters.store import FIX

    with pytest.raises(StoreError) as missing:  # no store beside the heads (here: no heads)
        DraftHeadsModel.from_pretrained(None, base_name_or_path=str(base), dtype="float64", sources="store")
    for message in (FIX, str(missing.value)):
        command = re.search(r"`draftheads (store build [^`]*)`", message).group(1)
        args = build_parser().parse_args(re.sub(r"<[^>]*>", "x", command).split())
        assert args.func.__name__ == "cmd_store_build" and args.data == "x", message
