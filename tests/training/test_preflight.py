"""``draftheads train`` checks everything before any work: the whole recipe when it loads, then
its data and heads before the base loads — every record holds what training reads (ids inside the
base's vocabulary, ids where ids belong, conversations as lists of turns), the recipe's column
mapping and family options are real, the draft vocabulary fits the base's — and a missing base,
bad data or a damaged checkpoint to resume from ends the run too: each problem one line naming
the file, the line and the fix, not a traceback."""
from __future__ import annotations

import json

import pytest
import yaml

from helpers import REPO, tiny_recipe
from draftheads.training import train as train_module
from draftheads.training.data.records import DataError
from draftheads.training.frozen import base_dims, gguf_dims
from draftheads.training.recipe import load_recipe
from draftheads.training.recipe_sections import RecipeError
from draftheads.training.preflight import preflight
from draftheads.training.train import main

GOOD_TOKENS = {"input_ids": [5, 6, 7, 8, 9, 10], "response_start": 2}


def write_jsonl(path, records) -> str:
    """One JSON object per line, a blank line after the first (the reader skips it): the bad
    record, last, is on line len(records) + 1."""
    lines = [json.dumps(r) for r in records]
    path.write_text(lines[0] + "\n\n" + "".join(line + "\n" for line in lines[1:]))
    return str(path)


def refuse_loading_the_base(monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError("the base was loaded before the data was checked")

    monkeypatch.setattr(train_module, "load_frozen_base", loaded)


TOKEN_CASES = [
    ({"input_ids": [5, 96, 7]}, r"input_ids holds 96, outside the base's vocabulary \[0, 96\); the ids must come "
                                r"from the base's own tokenizer"),
    ({"input_ids": [5, -100, 7]}, r"input_ids holds -100, outside the base's vocabulary \[0, 96\)"),
    ({"input_ids": [5, 10**12]}, r"input_ids holds 1000000000000, outside the base's vocabulary"),
    ({"input_ids": ["w5", "w6"]}, r"input_ids holds 'w5', not a token id; token ids are JSON integers"),
    ({"input_ids": [5, "6", 7]}, r"input_ids holds '6', not a token id"),
    ({"input_ids": [5, True]}, r"input_ids holds True, not a token id"),
    ({"input_ids": [5, 6.5]}, r"input_ids holds 6\.5, not a token id"),
    ({"input_ids": [5, None]}, r"input_ids holds None, not a token id"),
    ({"input_ids": "5 6 7"}, r"input_ids is a str \('5 6 7'\), not a list of token ids"),
    ({"text": "no ids here"}, r"input_ids is missing; every record of data kind 'tokens' needs a list of token ids"),
    ({"input_ids": [5, 6, 7], "response_start": "2"}, r"response_start is str '2'; it must be a whole number ≥ 0"),
    ({"input_ids": [5, 6, 7], "response_start": -1}, r"response_start is int -1; it must be a whole number ≥ 0"),
    ({"input_ids": [5, 6, 7], "response_start": 1.5}, r"response_start is float 1\.5; it must be a whole number"),
]


@pytest.mark.parametrize("bad,message", TOKEN_CASES)
def test_token_records_are_checked_naming_the_line(tiny_setup, tmp_path, bad, message):
    data = write_jsonl(tmp_path / "tokens.jsonl", [GOOD_TOKENS, GOOD_TOKENS, bad])
    recipe = load_recipe(tiny_recipe(tiny_setup, "tok"), ["--data.path", data])
    with pytest.raises(DataError, match=rf"^{data}, line 4: {message}"):
        preflight(recipe)


CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
SELFDISTILL = {"prompt": "hi", "response_ids": [5, 6, 7]}


@pytest.mark.parametrize("kind,good,bad,message", [
    ("selfdistill", SELFDISTILL, {"prompt": ["hi"], "response_ids": [5]}, r"prompt is list \['hi'\]; it must be "
                                                                          r"a string \(the text\)"),
    ("selfdistill", SELFDISTILL, {"prompt": "hi", "response_ids": [5, 4000]}, r"response_ids holds 4000, outside "
                                                                              r"the base's vocabulary \[0, 96\)"),
    ("selfdistill", SELFDISTILL, {"prompt": "hi", "response_ids": ["5"]}, r"response_ids holds '5', not a token id"),
    ("conversations", {"messages": CONVERSATION}, {"messages": "hi there"},
     r"messages is str 'hi there'; it must be a list of turns like \[\{\"role\": \"user\""),
    ("conversations", {"messages": CONVERSATION}, {"messages": {"role": "user", "content": "x"}},
     r"messages is dict .*; it must be a list of turns"),
    ("conversations", {"messages": CONVERSATION}, {"messages": []}, r"messages is list \[\]; it must be a list"),
    ("conversations", {"messages": CONVERSATION}, {"messages": [{"role": "user"}, {"role": "assistant",
                                                                                   "content": "x"}]},
     r"turn 1 of messages is \"\{'role': 'user'.*\"; each turn needs a role and a content string"),
    ("conversations", {"messages": CONVERSATION}, {"messages": CONVERSATION[:1]},
     r"messages ends with a 'user' turn; the answer to learn must be the last turn, with role 'assistant'"),
])
def test_text_and_conversation_records_are_checked_naming_the_line(tiny_setup, tmp_path, kind, good, bad, message):
    data = write_jsonl(tmp_path / "data.jsonl", [good, good, bad])
    recipe = load_recipe(tiny_recipe(tiny_setup, "txt"), ["--data.path", data, "--data.kind", kind])
    with pytest.raises(DataError, match=rf"^{data}, line 4: {message}"):
        preflight(recipe)


@pytest.mark.parametrize("form", ["datasets folder", "parquet"])
@pytest.mark.parametrize("bad,message", [
    ({"input_ids": [5, 96], "response_start": 1}, r"input_ids holds 96, outside the base's vocabulary \[0, 96\)"),
    ({"input_ids": [5, -1], "response_start": 1}, r"input_ids holds -1, outside the base's vocabulary"),
    ({"input_ids": [5, 6], "response_start": -3}, r"response_start is int -3; it must be a whole number ≥ 0"),
])
def test_data_read_through_datasets_is_checked_naming_the_record(tiny_setup, tmp_path, form, bad, message):
    import datasets

    table = datasets.Dataset.from_list([GOOD_TOKENS, GOOD_TOKENS, bad])
    path = tmp_path / ("folder" if form == "datasets folder" else "data.parquet")
    table.save_to_disk(str(path)) if form == "datasets folder" else table.to_parquet(str(path))
    recipe = load_recipe(tiny_recipe(tiny_setup, "ds"), ["--data.path", str(path)])
    with pytest.raises(DataError, match=rf"^{path}, record 3: {message}"):
        preflight(recipe)


def test_a_binary_data_file_is_one_line(tiny_setup, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe" * 10)
    with pytest.raises(DataError, match=r"data\.jsonl"):
        preflight(load_recipe(tiny_recipe(tiny_setup, "bin"), ["--data.path", str(path)]))


def test_a_data_error_ends_the_run_in_one_line_before_the_base_loads(tiny_setup, tmp_path, capsys, monkeypatch):
    data = write_jsonl(tmp_path / "tokens.jsonl", [GOOD_TOKENS, {"input_ids": [5, 96]}])
    refuse_loading_the_base(monkeypatch)
    assert main([str(tiny_recipe(tiny_setup, "oneline")), "--data.path", data]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {data}, line 3: input_ids holds 96") and err.count("\n") == 1


@pytest.mark.parametrize("kind,sample", [("selfdistill", "selfdistill_smollm2_sample.jsonl"),
                                         ("conversations", "train_conversations_sample.jsonl")])
def test_the_samples_a_clone_carries_pass_against_the_embedded_base(kind, sample):
    """The committed samples (the recipes' kinds of data) against SmolLM2's vocabulary, read from
    the GGUF's header."""
    from draftheads.training.data.data_checks import check_data

    assert base_dims("embedded") == (49152, 576)
    check_data(REPO / "tests" / "data" / sample, kind, 49152, select_by_source=True)


def test_the_tiny_set_ups_own_data_passes(tiny_setup, monkeypatch):
    refuse_loading_the_base(monkeypatch)
    preflight(load_recipe(tiny_recipe(tiny_setup, "fine")))


def recipe_file(tiny_setup, name: str, **sections) -> str:
    """The tiny recipe with ``sections`` merged in, written as YAML (so errors can name its lines)."""
    path = tiny_recipe(tiny_setup, name)
    recipe = yaml.safe_load(path.read_text())
    for section, values in sections.items():
        recipe[section].update(values)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


def line_of(path: str, text: str) -> int:
    return next(n for n, line in enumerate(open(path), 1) if text in line)


@pytest.mark.parametrize("heads,key,message", [
    ({"family": "hydra++", "extra": {"prefx_heads": 2}}, "prefx_heads",
     r"heads\.extra\.prefx_heads is not an option of hydra\+\+ heads \(its options are dropout, prefix_context, "
     r"prefix_heads, "
     r"prefix_mlp_size\): did you mean prefix_heads\?"),
    ({"family": "amphista", "extra": {"attn_head": 2}}, "attn_head",
     r"heads\.extra\.attn_head is not an option of amphista heads \(its options are attn_heads, gated, mlp_size\): "
     r"did you mean attn_heads\?"),
    ({"family": "medusa", "extra": {"gated": True}}, "gated",
     r"heads\.extra\.gated is not an option of medusa heads \(it has no options\): remove it"),
    ({"family": "amphista", "extra": {"gated": "yes"}}, "gated", r"heads\.extra\.gated must be true or false"),
    ({"family": "hydra++", "extra": {"prefix_heads": "4"}}, "prefix_heads",
     r"heads\.extra\.prefix_heads must be a whole number ≥ 1, got '4'"),
    ({"family": "medusa", "extra": {"koala": {}}}, "koala", r"heads\.extra\.koala is written by draftheads"),
])
def test_family_options_are_checked_when_the_recipe_loads_naming_its_line(tiny_setup, heads, key, message):
    path = recipe_file(tiny_setup, "extra", heads=heads)
    with pytest.raises(RecipeError, match=rf"^{path}, line {line_of(path, key)}: Recipe key {message}"):
        load_recipe(path)


@pytest.mark.parametrize("columns,message", [
    ({"question": 5}, r"line {line}: Recipe key data\.columns\.question: 5 is not a column name; write \{column in "
                      r"the data: column draftheads reads\}"),
    ({"question": ["prompt"]}, r"line {line}: Recipe key data\.columns\.question: \['prompt'\] is not a column name"),
    ({"question": ""}, r"line {line}: Recipe key data\.columns\.question: '' is not a column name"),
    ({"a": "input_ids", "b": "input_ids"}, r"Recipe key data\.columns renames 'a' and 'b' both to 'input_ids'"),
])
def test_a_column_mapping_that_names_no_column_is_refused(tiny_setup, columns, message):
    path = recipe_file(tiny_setup, "columns", data={"columns": columns})
    line = line_of(path, next(iter(columns)) + ":")
    with pytest.raises(RecipeError, match=message.replace("{line}", str(line))):
        load_recipe(path)


def test_a_mapped_column_the_data_lacks_fails_at_preflight(tiny_setup, monkeypatch):
    refuse_loading_the_base(monkeypatch)
    recipe = load_recipe(tiny_recipe(tiny_setup, "lacks"), ["--data.columns", "{ids: input_ids}"])
    with pytest.raises(DataError, match=r"tokens\.jsonl has no column 'ids' to rename \(data\.columns\)"):
        preflight(recipe)


@pytest.mark.parametrize("override,message", [
    (["--heads.draft_vocab_size", "97"], r"heads\.draft_vocab_size=97 is larger than the base's vocabulary \(96 "
                                         r"tokens, .*\): use at most 96, or 0 for all of it"),
    (["--heads.family", "hydra++", "--heads.extra", "{prefix_heads: 5}"],
     r"heads\.extra does not fit the base \(.*: hidden size 32\): prefix_heads=5 must divide hidden_size=32"),
    (["--heads.family", "amphista", "--heads.extra", "{attn_heads: 3}"],
     r"heads\.extra does not fit the base .*extra\.attn_heads=3 must divide hidden_size=32"),
])
def test_heads_that_do_not_fit_the_base_fail_before_it_loads(tiny_setup, monkeypatch, override, message):
    refuse_loading_the_base(monkeypatch)
    with pytest.raises(RecipeError, match=message):
        preflight(load_recipe(tiny_recipe(tiny_setup, "fit"), override))


def test_a_final_folder_of_someone_elses_fails_before_the_run(tiny_setup, tmp_path, monkeypatch):
    refuse_loading_the_base(monkeypatch)
    theirs = tmp_path / "mine"
    theirs.mkdir()
    (theirs / "thesis.tex").write_text("years of work")
    with pytest.raises(RecipeError, match=r"Recipe key run\.final_dir: .*mine already exists and holds files "
                                          r"draftheads did not write \(thesis\.tex\)"):
        preflight(load_recipe(tiny_recipe(tiny_setup, "final"), ["--run.final_dir", str(theirs)]))
    assert (theirs / "thesis.tex").read_text() == "years of work"


def test_the_bases_dimensions_are_read_without_its_weights(tiny_setup, tmp_path):
    assert base_dims(str(tiny_setup / "base")) == (96, 32)
    assert base_dims(str(tmp_path / "missing")) is None and base_dims("no-such/model-here") is None
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf")
    assert gguf_dims(tmp_path / "fake.gguf") is None and base_dims(str(tmp_path / "fake.gguf")) is None


# -- the whole run: recipe values, missing data or base, a checkpoint to resume from -------------------
@pytest.mark.parametrize("override,message", [
    (["--heads.family", "medussa"], r"heads\.family='medussa' is not a known head family; use one of \[.*'medusa'"),
    (["--heads.draft_vocab_size", "-1"], r"heads\.draft_vocab_size must be ≥ 0, got -1"),
    (["--data.eval_examples", "0"], r"data\.eval_examples must be ≥ 1, got 0"),
    (["--train.warmup_ratio", "1.5"], r"train\.warmup_ratio must be in \[0, 1\], got 1\.5"),
    (["--loss.temperature", "0"], r"loss\.temperature must be > 0, got 0"),
    (["--run.tree_budgets", "[0, 4]"], r"run\.tree_budgets must be a non-empty list of node budgets ≥ 1"),
    (["--run.keep_checkpoints", "0"], r"run\.keep_checkpoints must be ≥ 1, got 0"),
    (["--train.max_steps", "-5"], r"train\.max_steps must be ≥ 0, got -5"),
])
def test_recipe_values_are_checked_when_it_loads(override, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("recipes/medusa-smollm2.yaml", override)


def run_main(recipe, capsys, *overrides) -> str:
    assert main([str(recipe), *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_family_typo_fails_before_any_work(tiny_setup, capsys):  # noqa: F811
    err = run_main(tiny_recipe(tiny_setup, "typo"), capsys, "--heads.family", "hydra+")
    assert "heads.family='hydra+' is not a known head family" in err
    assert not (tiny_setup / "typo").exists()  # nothing was created, extracted or loaded


def test_missing_data_is_one_line_before_the_base_loads(tiny_setup, capsys):  # noqa: F811
    err = run_main(tiny_recipe(tiny_setup, "nodata"), capsys, "--data.path", str(tiny_setup / "missing.jsonl"))
    assert "data.path" in err and "missing.jsonl does not exist" in err


def test_missing_base_is_one_line(tiny_setup, capsys):  # noqa: F811
    err = run_main(tiny_recipe(tiny_setup, "nobase"), capsys, "--base", str(tiny_setup / "no-base"))
    assert "no-base' does not exist" in err


def test_data_error_is_one_line(tiny_setup, tmp_path, capsys):  # noqa: F811
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no input_ids"}) + "\n")
    err = run_main(tiny_recipe(tiny_setup, "baddata"), capsys, "--data.path", str(bad))
    assert "input_ids" in err


def test_checkpoint_error_is_one_line(tiny_setup, tmp_path, capsys):  # noqa: F811
    fake = tmp_path / "step-0000004"
    fake.mkdir()
    (fake / "recipe.json").write_text(json.dumps(load_recipe(tiny_recipe(tiny_setup, "fake")).identity()))
    (fake / "optimizer.bin").write_bytes(b"not a torch file")
    err = run_main(tiny_recipe(tiny_setup, "fake"), capsys, "--run.resume", str(fake))
    assert "Refusing to resume" in err and "optimizer.bin is not plain tensor data" in err


def test_trees_from_dev_without_a_dev_table_is_one_line(tmp_path):
    from helpers import tiny_recipe

    from draftheads.training.recipe import load_recipe
    from draftheads.training.recipe_sections import RecipeError

    with pytest.raises(RecipeError, match="run.trees_from: dev fits the trees on data.eval_path"):
        load_recipe(tiny_recipe(tmp_path, "t", run__trees_from="dev"), [])
