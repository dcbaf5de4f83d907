"""The house stays tidy by construction: these bars fail the suite when a module outgrows 400
lines, the README outgrows 250 lines, ``results/`` outgrows 20 topic folders, or anything but the
builder sets how a model decodes (two modules sharing a file name and imports that climb a floor:
test_layout.py)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: the checkout's package folders (pyproject.toml's package-dir)
PACKAGES = ("core", "heads", "decoding", "training", "draftheads")
MAX_MODULE_LINES = 400
MAX_README_LINES = 250
MAX_RESULT_FOLDERS = 20


def package_modules() -> list[Path]:
    return sorted(p for folder in PACKAGES for p in (REPO / folder).rglob("*.py"))


def test_no_module_over_400_lines():
    long = {str(p.relative_to(REPO)): n for p in package_modules() + sorted((REPO / "scripts").glob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these modules (at most {MAX_MODULE_LINES} lines): {long}"


def test_readme_and_results_stay_small():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md is {lines} lines: figures come from results/, history goes to docs/"
    folders = [p for p in (REPO / "results").iterdir() if p.is_dir()]
    assert len(folders) <= MAX_RESULT_FOLDERS, f"results/ holds {len(folders)} folders (≤ {MAX_RESULT_FOLDERS} topics)"


ASSIGNS = re.compile(r"\.(policy|drafter)\s*=[^=]")


@pytest.mark.parametrize("folder", ["core", "heads", "decoding", "training", "draftheads", "scripts", "tests"])
def test_nothing_but_the_builder_sets_how_a_model_decodes(folder):
    """``model.policy`` / ``model.drafter`` are read from the one build (decoding/builder.py);
    another configuration is ``model.with_decoding(...)``."""
    found = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / folder).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if ASSIGNS.search(line.split("#")[0])]
    assert not found, f"set a model's policy or drafter through with_decoding / the builder: {found}"
