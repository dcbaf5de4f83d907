"""At the command line every subcommand ends a bad argument, a bad file or a Hub failure with ONE
``error:`` line on stderr naming the problem, exit status 2, and no traceback (the CLI catches
the project's error root once, at its top). Run in-process; one subprocess checks the installed
entry point end to end."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch

from helpers import reference_heads, save_tiny_base, tiny_llama, tiny_recipe, write_medusa
from draftheads.cli import main
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads import HeadConfig, MedusaHeads


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Every good and bad input the tables below name, built once."""
    root = tmp_path_factory.mktemp("cli")
    base = save_tiny_base(root / "base")
    tiny_llama(0).save_pretrained(root / "base-no-tokenizer")
    heads = MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96, trees={"1": [[0]], "3": [[0], [1], [0, 0]]},
                                   expected_tau={"1": 1.4, "3": 1.7}, base_fingerprint=fingerprint(base).to_dict()))
    heads.double().save_pretrained(root / "heads", dtype=None)
    (root / "broken-heads").mkdir()
    (root / "broken-heads" / "config.json").write_text("{not json")
    (root / "a-file").write_text("a file, not a folder")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "w5 w6"}) + "\n")
    medusa = reference_heads(32, 96, heads=2, layers=1, projection=True)
    write_medusa(root / "medusa", medusa, 1, "safetensors")
    for name, change in MEDUSA_DAMAGE.items():
        write_medusa(root / f"medusa-{name}", medusa, 1, "safetensors")
        change(root / f"medusa-{name}")
    for name, text in REPORTS.items():
        heads.double().save_pretrained(root / f"card-{name}", dtype=None)
        (root / f"card-{name}" / "training_report.json").write_text(text)
    (root / "results-broken.json").write_text("[1, 2")
    (root / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe" * 4)
    (root / "list.yaml").write_text("- name: x\n- base: y\n")
    recipe = tiny_recipe(root, "run")
    (root / "recipe-ok.yaml").write_text(recipe.read_text())
    return {"root": root}


def save_tensors(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "medusa_lm_head.safetensors"))
    save_file(change(state), str(folder / "medusa_lm_head.safetensors"))


MEDUSA_DAMAGE = {
    "int32": lambda f: save_tensors(f, lambda s: {**s, "0.0.linear.weight": s["0.0.linear.weight"].to(torch.int32)}),
    "nan": lambda f: save_tensors(f, lambda s: {**s, "1.0.linear.bias": torch.full_like(s["1.0.linear.bias"], float("nan"))}),
    "shape": lambda f: save_tensors(f, lambda s: {**s, "1.0.linear.weight": s["1.0.linear.weight"][:, :16].contiguous()}),
    "config-not-json": lambda f: (f / "config.json").write_text("medusa_num_heads: 2"),
    "config-list": lambda f: (f / "config.json").write_text("[2, 1]"),
    "layers-abc": lambda f: (f / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": "abc"})),
}
REPORTS = {"corrupt": '{"recipe": ', "list": "[]", "keyless": "{}",
           "measured": json.dumps({"measured": {"results": "results-broken.json", "command": "x"}})}


def run_cli(argv: list[str], capsys) -> str:
    """Run the CLI in-process; assert exit status 2, one ``error:`` line on stderr and no
    traceback; return that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        code = main(argv)
        raise SystemExit(code)  # a subcommand that returns its status (train) instead of raising
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("Writing model shards",
                                                                                        "Loading weights"))]
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def fill(argv: list[str], root: Path) -> list[str]:
    return [a.replace("ROOT", str(root)) for a in argv]


GENERATE = [
    (["--base", "/nonexistent/base"], "base model '/nonexistent/base' does not exist"),
    (["--base", "ROOT/base-no-tokenizer", "--heads", "none"], "has no usable tokenizer"),
    (["--base", "ROOT/base", "--heads", "/nonexistent/heads"], "/nonexistent/heads/config.json not found"),
    (["--base", "ROOT/base", "--heads", "ROOT/broken-heads"], "broken-heads/config.json is not valid JSON"),
    (["--base", "ROOT/base", "--heads", "ROOT/base"], "is a model's config (model_type 'llama'), not draft heads"),
    (["--base", "ROOT/base", "--heads", "none", "--sources", "store"], "No lookup_store.safetensors beside the heads"),
    (["--base", "ROOT/base", "--heads", "ROOT/heads", "--sources", "all"], "No lookup_store.safetensors beside the heads"),
    (["--base", "ROOT/base", "--heads", "none", "--sources", "context", "--review"], "--review: review=True"),
    (["--base", "ROOT/base", "--heads", "ROOT/heads", "--prompt", "   "], "the prompt is empty"),
    (["--base", "ROOT/base", "--heads", "ROOT/heads", "--review"], "--review: review=True"),
    (["--base", "ROOT/base", "--heads", "ROOT/heads", "--sources", "heads,nope"], "argument --sources: sources="),
    (["--base", "ROOT/base", "--tree", "big"], "argument --tree: tree='big'"),
    (["--base", "ROOT/base", "--dtype", "int8"], "argument --dtype: invalid choice"),
]


@pytest.mark.parametrize("argv,message", GENERATE, ids=[" ".join(a[-2:]) for a, _ in GENERATE])
def test_generate_errors_are_one_line(files, capsys, argv, message):
    argv = fill(argv, files["root"])
    prompt = [] if "--prompt" in argv else ["--prompt", "w5 w6"]
    line = run_cli(["generate", *prompt, "--dtype", "float64", "--no-baseline", *argv], capsys)
    assert message in line, line


BENCH = [
    (["--prompts", "ROOT/missing.jsonl"], "is neither a prompt file nor a built-in prompt set"),
    (["--prompts", "ROOT/prompts.jsonl", "--base", "/nonexistent/base"], "does not exist"),
    (["--prompts", "ROOT/prompts.jsonl", "--base", "ROOT/base", "--heads", "none", "--batch-sizes", "1"],
     "--batch-sizes compares tree strategies and needs heads"),
    (["--prompts", "ROOT/prompts.jsonl", "--base", "ROOT/base", "--heads", "ROOT/heads", "--batch-sizes", "1",
      "--budgets", "7"], "no stored tree for budget(s) [7]"),
    (["--prompts", "ROOT/prompts.jsonl", "--base", "ROOT/base", "--heads", "ROOT/heads", "--batch-sizes", "1,2",
      "--max-batches", "1,2,3"], "--max-batches needs one positive number or one per batch size"),
    (["--prompts", "ROOT/prompts.jsonl", "--limit", "0"], "--limit: must be ≥ 1"),
]


@pytest.mark.parametrize("argv,message", BENCH, ids=[" ".join(a[-2:]) for a, _ in BENCH])
def test_bench_errors_are_one_line(files, capsys, argv, message):
    line = run_cli(["bench", "--dtype", "float64", *fill(argv, files["root"])], capsys)
    assert message in line, line


TRAIN = [
    (["ROOT/missing.yaml"], "Recipe ROOT/missing.yaml not found"),
    (["ROOT/binary.yaml"], "is not a text file"),
    (["ROOT/list.yaml", "--lr", "0.1"], "holds a YAML list at the top level"),
    (["ROOT/recipe-ok.yaml", "--train.lr", ".nan"], "train.lr must be a finite number, got nan"),
    (["ROOT/recipe-ok.yaml", "--train.lr", ".inf"], "train.lr must be a finite number, got inf"),
    (["ROOT/recipe-ok.yaml", "--epochs", ".inf"], "train.epochs must be a finite number"),
    (["ROOT/recipe-ok.yaml", "--loss.temperature", ".nan"], "loss.temperature must be a finite number"),
    (["ROOT/recipe-ok.yaml", "--no.such", "1"], "Unknown recipe key no.such"),
]


@pytest.mark.parametrize("argv,message", TRAIN, ids=[" ".join(a[-2:]) for a, _ in TRAIN])
def test_train_errors_are_one_line(files, capsys, argv, message):
    line = run_cli(["train", *fill(argv, files["root"])], capsys)
    assert fill([message], files["root"])[0] in line, line


SELFDISTILL = [
    ([], "draftheads selfdistill: the following arguments are required: --prompts (see `draftheads selfdistill --help`)"),
    (["--prompts", "ROOT/prompts.jsonl", "--bogus", "1"], "draftheads selfdistill: unrecognized arguments: --bogus 1"),
    (["--prompts", "ROOT/prompts.jsonl", "--columns", "question"], "argument --columns: expected FROM:TO"),
    (["--prompts", "ROOT/missing.jsonl", "--out", "ROOT/distilled"], "Data 'ROOT/missing.jsonl' not found"),
]


@pytest.mark.parametrize("argv,message", SELFDISTILL, ids=[" ".join(a[-2:]) or "none" for a, _ in SELFDISTILL])
def test_selfdistill_errors_are_one_line(files, capsys, argv, message):
    """The subcommand the data errors name (``draftheads selfdistill``) ends a bad argument as every other does."""
    line = run_cli(["selfdistill", *fill(argv, files["root"])], capsys)
    assert fill([message], files["root"])[0] in line, line
    assert not (files["root"] / "distilled").exists()


def test_selfdistill_help_names_the_subcommand(capsys):
    assert main(["selfdistill", "--help"]) == 0
    usage = capsys.readouterr().out
    assert usage.startswith("usage: draftheads selfdistill") and "--prompts" in usage and "python -m" not in usage


def test_figures_passes_its_options_on(monkeypatch, tmp_path):
    """``draftheads figures`` runs :func:`draftheads.readme_figures.main` with its options, and returns its status."""
    import types

    seen = []
    fake = types.ModuleType("draftheads.readme_figures")
    fake.main = lambda argv: seen.append(argv) or 1
    monkeypatch.setitem(sys.modules, "draftheads.readme_figures", fake)
    assert main(["figures", "--readme", str(tmp_path / "R.md"), "--check"]) == 1
    assert main(["figures", "--results", "res"]) == 1
    assert seen == [["--readme", str(tmp_path / "R.md"), "--results", "results", "--check"],
                    ["--readme", "README.md", "--results", "res"]]


def test_figures_errors_are_one_line(files, capsys, monkeypatch):
    line = run_cli(["figures", "--readme", str(files["root"] / "missing.md")], capsys)
    assert f"{files['root'] / 'missing.md'} not found" in line, line
    assert "unrecognized arguments: --bogus" in run_cli(["figures", "--bogus"], capsys)
    monkeypatch.setitem(sys.modules, "draftheads.readme_figures", None)  # an install without the module
    assert "draftheads figures needs draftheads.readme_figures" in run_cli(["figures"], capsys)


EXPORT = [
    (["ROOT/heads", "ROOT/heads"], "the output folder ROOT/heads is the source ROOT/heads"),
    (["ROOT/heads", "ROOT/heads/vllm"], "is inside the source"),
    (["ROOT/heads", "ROOT/a-file/vllm", "--base", "ROOT/base"], "cannot write to ROOT/a-file/vllm"),
    (["/nonexistent/heads", "ROOT/out"], "/nonexistent/heads/config.json not found"),
    (["ROOT/base", "ROOT/out"], "is a model's config"),
]


@pytest.mark.parametrize("argv,message", EXPORT, ids=[" ".join(a[:2]).replace("ROOT/", "") for a, _ in EXPORT])
def test_export_errors_are_one_line(files, capsys, argv, message):
    root = files["root"]
    before = (root / "heads" / "config.json").read_text()
    line = run_cli(["export", "--to", "vllm-medusa", *fill(argv, root)], capsys)
    assert fill([message], root)[0] in line, line
    assert (root / "heads" / "config.json").read_text() == before and not (root / "heads" / "vllm").exists()


def test_env_base_errors_are_one_line(files, capsys, monkeypatch):
    """``env --base`` on a heads folder or a base whose layers are not attention: one line,
    before the report prints anything (it used to end in transformers' traceback)."""
    import transformers

    root = files["root"]
    mamba = root / "mamba"
    if not mamba.exists():
        transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                                               state_size=4)).save_pretrained(mamba)
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(root / "cache"))
    line = run_cli(["env", "--base", str(root / "heads")], capsys)
    assert line == (f"error: --base {root / 'heads'} is a draft heads folder (its config.json names head family "
                    f"'medusa'), not a base model: pass the base the heads were trained on, or use --heads "
                    f"{root / 'heads'} with draftheads generate/bench.")
    line = run_cli(["env", "--base", str(mamba)], capsys)
    assert line == (f"error: --base {mamba}: mamba: layers of type linear_attention cannot verify a token tree (only "
                    "full and sliding-window attention can); use the model's own generate().")


IMPORT = [
    (["ROOT/medusa", "ROOT/medusa"], "the output folder ROOT/medusa is the source ROOT/medusa"),
    (["ROOT/medusa", "ROOT/medusa/ours"], "is inside the source"),
    (["ROOT/medusa", "ROOT/a-file/ours"], "cannot write to ROOT/a-file/ours"),
    (["ROOT/medusa-int32", "ROOT/out"], "tensor '0.0.linear.weight' is torch.int32; Medusa weights are floating"),
    (["ROOT/medusa-nan", "ROOT/out"], "tensor '1.0.linear.bias' holds NaN or infinite values"),
    (["ROOT/medusa-shape", "ROOT/out"], "tensor '1.0.linear.weight' has shape (32, 16)"),
    (["ROOT/medusa-config-not-json", "ROOT/out"], "medusa-config-not-json/config.json is not valid JSON"),
    (["ROOT/medusa-config-list", "ROOT/out"], "holds a JSON list, not a Medusa config"),
    (["ROOT/medusa-layers-abc", "ROOT/out"], "medusa_num_layers must be a positive integer, got 'abc'"),
    (["/nonexistent/medusa", "ROOT/out"], "/nonexistent/medusa/config.json not found"),
]


@pytest.mark.parametrize("argv,message", IMPORT, ids=[" ".join(a).replace("ROOT/", "") for a, _ in IMPORT])
def test_import_medusa_errors_are_one_line(files, capsys, argv, message):
    root = files["root"]
    before = (root / "medusa" / "config.json").read_text()
    line = run_cli(["import-medusa", *fill(argv, root), "--base", str(root / "base")], capsys)
    assert fill([message], root)[0] in line, line
    assert (root / "medusa" / "config.json").read_text() == before and not (root / "out").exists()


CARD = [
    (["ROOT/card-corrupt"], "card-corrupt/training_report.json is not valid JSON"),
    (["ROOT/card-list"], "card-list/training_report.json holds a JSON list, not a training report"),
    (["ROOT/card-keyless"], "card-keyless/training_report.json lacks what the card cites (KeyError: 'recipe')"),
    (["ROOT/card-measured", "--root", "ROOT"], "results-broken.json is not valid JSON"),
    (["ROOT/card-keyless", "--results", "r.json"], "--results needs --command"),
    (["ROOT/base"], "is a model's config"),
    (["/nonexistent/heads"], "/nonexistent/heads/config.json not found"),
]


@pytest.mark.parametrize("argv,message", CARD, ids=[" ".join(a).replace("ROOT/", "") for a, _ in CARD])
def test_card_errors_are_one_line(files, capsys, argv, message):
    line = run_cli(["card", *fill(argv, files["root"])], capsys)
    assert message in line, line


def test_card_into_an_unwritable_checkpoint_is_one_line(files, capsys, monkeypatch):
    """A read-only checkpoint folder (refused directly: the tests may run as root)."""
    import draftheads.core.atomic as atomic

    def refuse(*_args, **_kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(atomic.tempfile, "mkstemp", refuse)
    line = run_cli(["card", str(files["root"] / "heads")], capsys)
    assert f"cannot write to {files['root'] / 'heads' / 'README.md'} (Permission denied)" in line


class FailingHfApi:
    """Stands in for ``huggingface_hub.HfApi`` (no network): every call raises ``failure``."""

    failure: Exception = OSError("no network")

    def __init__(self, token=None, **_):
        pass

    def create_repo(self, *_args, **_kwargs):
        raise FailingHfApi.failure

    upload_folder = create_repo


def http_error(status: int) -> Exception:
    from huggingface_hub.errors import HfHubHTTPError

    response = type("Response", (), {"status_code": status, "headers": {}, "request": None})()
    err = HfHubHTTPError(f"{status} Client Error", response=response)
    return err


PUSH = [
    (["ROOT/base", "me/heads"], None, "is a model's config"),
    (["ROOT/a-file", "me/heads"], None, "is not a head checkpoint (missing"),
    (["ROOT/heads", "not a repo id"], None, "repo id 'not a repo id' is invalid"),
    (["ROOT/heads", "me/bad name!"], None, "a repo id is 'namespace/name'"),
    (["ROOT/heads", "me/heads"], "offline", "HF_HUB_OFFLINE is set: unset it"),
    (["ROOT/heads", "me/heads"], ConnectionError("Failed to resolve 'huggingface.co'"),
     "cannot reach the Hugging Face Hub"),
    (["ROOT/heads", "me/heads"], "no-token", "`hf auth login` (or `huggingface-cli login`)"),
    (["ROOT/heads", "me/heads"], "401", "(HTTP 401): log in with a token"),
]


@pytest.mark.parametrize("argv,failure,message", PUSH, ids=[f"{a[0].replace('ROOT/', '')} {a[1]} {f}" for a, f, _ in PUSH])
def test_push_errors_are_one_line_and_never_touch_the_network(files, capsys, monkeypatch, argv, failure, message):
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalTokenNotFoundError

    monkeypatch.setattr(huggingface_hub, "HfApi", FailingHfApi)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", failure == "offline")
    FailingHfApi.failure = {"no-token": LocalTokenNotFoundError("no token"), "401": http_error(401)}.get(
        failure, failure if isinstance(failure, Exception) else OSError("unexpected call"))
    line = run_cli(["push", *fill(argv, files["root"])], capsys)
    assert message in line, line


def test_the_entry_point_prints_one_line_and_exits_2(tmp_path):
    """End to end through a fresh interpreter: the module entry point, a missing base."""
    done = subprocess.run([sys.executable, "-m", "draftheads.cli", "generate", "--prompt", "hi", "--base",
                           str(tmp_path / "missing-base"), "--heads", "none"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and done.stderr.startswith("error: base model")


def test_generate_times_each_side_twice_and_names_its_drafting(files, capsys):
    """README command 1's report: both sides timed twice, interleaved (the faster run counts, as
    the bench's --repeats), the answer checked against plain generate, the drafting named last."""
    root = files["root"]
    argv = ["generate", "--base", str(root / "base"), "--heads", str(root / "heads"), "--prompt", "w5 w6 w7",
            "--max-new-tokens", "8", "--dtype", "float64"]
    capsys.readouterr()
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    ours, plain, drafting = lines[-3:]
    assert ours.startswith("[draftheads] float64:") and "(the faster of two runs)" in ours
    assert plain.startswith("[plain HF generate, same dtype]") and "(the faster of two runs); speedup" in plain
    assert "identical" in plain, plain
    assert drafting.startswith("[drafting] heads") and "(--sources heads: the heads alone)" in drafting
