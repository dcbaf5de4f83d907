"""A clone is whole. Nothing the tests, the package or the scripts' defaults read lies
outside the clone (the evaluation prompts and cost surfaces ship in ``draftheads/data/``, the
tests' training samples in ``tests/data/``); a recipe that names this machine's local training
files also names a way that works without them; and a test that skips for want of an outside
resource fails the suite (conftest.py), so a plain clone's summary shows 0 such skips."""
from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib

from helpers import FIXTURES, REPO
from draftheads.prompts import DATA_DIR, PROMPT_SETS
from draftheads.training.data.self_distillation import SelfDistillConfig
from draftheads.training.recipe_sections import DataSection

OUTSIDE = "sha" + "red"  # spelled apart so that this file does not match its own patterns
#: a path into the data folder that sat beside the checkout, however it is spelled
NAMES_OUTSIDE = re.compile(rf"\.\./{OUTSIDE}\b|\b{OUTSIDE}/data\b|/\s*[\"']{OUTSIDE}[\"']|/work/{OUTSIDE}")
#: a script default (argparse default= or a module constant) that points at it
SCRIPT_DEFAULT_OUTSIDE = re.compile(rf"(default=|^[A-Z_]+ = ).*({NAMES_OUTSIDE.pattern})", re.M)
PACKAGE_FOLDERS = ("core", "heads", "decoding", "training", "draftheads", "tests")
LOCAL_SAMPLE = "tests/data/selfdistill_smollm2_sample.jsonl"


def test_no_test_and_no_package_module_names_a_path_outside_the_clone():
    hits = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for folder in PACKAGE_FOLDERS
            for path in sorted((REPO / folder).rglob("*.py")) if ".venv" not in path.parts
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if NAMES_OUTSIDE.search(line)]
    assert not hits, "these lines read data the clone does not carry:\n" + "\n".join(hits)


def test_no_script_defaults_to_a_path_outside_the_clone():
    hits = [f"{path.name}: {m.group(0).strip()}" for path in sorted((REPO / "scripts").glob("*.py"))
            for m in SCRIPT_DEFAULT_OUTSIDE.finditer(path.read_text(encoding="utf-8"))]
    assert not hits, hits


def test_data_defaults_point_nowhere_outside():
    """No default training set (a clone carries none): preflight asks for data.path by name."""
    assert DataSection().path == "" and SelfDistillConfig().prompts == ""


def test_recipes_naming_local_files_name_a_way_without_them():
    """The shipped recipes read this machine's local answers; each also names the public source
    (a Hub prompt set to self-distill) and the committed sample, which exists."""
    assert (REPO / LOCAL_SAMPLE).is_file()
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        text = recipe.read_text(encoding="utf-8")
        if NAMES_OUTSIDE.search(text):
            assert f"--data.path {LOCAL_SAMPLE}" in text and "--prompts openai/gsm8k --name main" in text, recipe.name


def test_the_shipped_data_is_what_its_readmes_say_and_a_wheel_carries_it():
    for name, file in PROMPT_SETS.items():
        assert (DATA_DIR / file).is_file(), name
    counts = {f.name: sum(1 for line in open(f, encoding="utf-8") if line.strip())
              for f in [*DATA_DIR.glob("*.jsonl"), *FIXTURES.glob("*.jsonl")]}
    assert counts == {"mt_bench.jsonl": 80, "spec_bench_dev.jsonl": 280, "clean_eval.jsonl": 224,
                      "gsm8k_test_sample.jsonl": 50, "train_prompts_sample.jsonl": 16,
                      "train_conversations_sample.jsonl": 16, "selfdistill_smollm2_sample.jsonl": 256}
    provenance = json.loads((DATA_DIR / "provenance.json").read_text())
    for name, entry in provenance.items():
        assert (DATA_DIR / name).exists() and ("license_file" not in entry or (DATA_DIR / entry["license_file"]).is_file())
    readme = (FIXTURES / "README.md").read_text()
    assert all(f"`{f.name}`" in readme for f in FIXTURES.iterdir() if f.is_file() and f.name != "README.md")
    assert all(f"licenses/{f.name}" in readme for f in (FIXTURES / "licenses").iterdir())
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["draftheads"]
    shipped = [p.relative_to(DATA_DIR.parent).as_posix() for p in DATA_DIR.rglob("*") if p.is_file()]
    assert [p for p in shipped if not any(fnmatch.fnmatch(p, g) for g in globs)] == []


def test_a_skip_for_want_of_an_outside_resource_fails_the_run(tmp_path):
    """The conftest hook, run on its own: an allowed skip passes, a skip for a missing file fails
    the whole run (exit 1) and is listed; the suite's own status is never turned into 0."""
    for name in ("conftest.py", "helpers.py"):
        shutil.copy(REPO / "tests" / name, tmp_path / name)
    (tmp_path / "test_inner.py").write_text(
        "import pytest\n"
        "def test_passes():\n    assert True\n"
        "def test_asked():\n    pytest.skip('DRAFTHEADS_SKIP_SMOLLM2 is set')\n"
        "def test_wants_outside():\n    pytest.skip('../elsewhere/data/train.jsonl not found')\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    summary = done.stdout.split("skipped for want of something the clone does not carry")[-1]
    assert done.returncode == 1, done.stdout[-2000:]
    assert "test_inner.py::test_wants_outside: ../elsewhere/data/train.jsonl not found" in summary
    assert "test_asked" not in summary and "1 passed, 2 skipped" in done.stdout
