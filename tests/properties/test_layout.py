"""The installed package is exactly what pyproject.toml maps: ``draftheads/`` plus the folders
``core/``, ``heads/``, ``decoding/`` (with ``decoding/drafters/``) and ``training/`` as
``draftheads.core``, ``draftheads.heads``, ``draftheads.decoding`` and ``draftheads.training``. Nothing else in the checkout (``scripts/``,
``tests/``, ``recipes/``, a second copy of ``draftheads/``) is importable under ``draftheads``.

The suite runs against an editable install of this checkout (``scripts/test.sh``), so the
sub-packages must be this checkout's folders, and the checkout's paths (``checkpoints/``, one
that climbs out and back in) must resolve from any working directory."""
from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import draftheads
from draftheads.decoding.base.loading import from_checkout, source_root

REPO = Path(__file__).resolve().parents[2]
NOT_PACKAGES = ("draftheads.scripts", "draftheads.tests", "draftheads.recipes", "draftheads.draftheads")
SUBPACKAGES = {"draftheads.core": "core", "draftheads.heads": "heads", "draftheads.decoding": "decoding",
               "draftheads.decoding.drafters": "decoding/drafters", "draftheads.training": "training"}


@pytest.mark.parametrize("name", NOT_PACKAGES)
def test_checkout_folders_outside_the_mapping_are_not_importable(name):
    assert importlib.util.find_spec(name) is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)


def test_the_package_path_is_the_package_folder_alone():
    assert [Path(p).resolve() for p in draftheads.__path__] == [REPO / "draftheads"]


@pytest.mark.parametrize("name, folder", SUBPACKAGES.items())
def test_subpackages_are_this_checkouts_folders(name, folder):
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve() == REPO / folder / "__init__.py", (
        f"{name} comes from {module.__file__}, not from {REPO / folder}: the tests need an editable install "
        "of this checkout (scripts/test.sh)")


def test_checkout_paths_resolve_in_this_process():
    assert source_root() == REPO
    assert from_checkout("checkpoints").resolve() == REPO / "checkpoints"  # relative when run from REPO
    assert from_checkout("no/such/path") == Path("no/such/path")


def test_a_fresh_interpreter_elsewhere_sees_the_same_layout(tmp_path):
    """No working directory or test-runner path entry helps: run from an unrelated folder."""
    code = f"""
import importlib.util, json
import draftheads, draftheads.heads, draftheads.decoding.drafters, draftheads.training
from draftheads.decoding.base.loading import from_checkout, source_root
print(json.dumps({{
    "missing": [n for n in {list(NOT_PACKAGES)!r} if importlib.util.find_spec(n) is None],
    "files": {{n: __import__("sys").modules[n].__file__ for n in {list(SUBPACKAGES)!r}}},
    "path": list(draftheads.__path__),
    "root": str(source_root()),
    "checkpoints": str(from_checkout("checkpoints")),
    "climbing": str(from_checkout({f"../{REPO.name}/checkpoints"!r})),
}}))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["missing"] == list(NOT_PACKAGES)
    assert {n: Path(f).resolve() for n, f in seen["files"].items()} == {
        n: REPO / folder / "__init__.py" for n, folder in SUBPACKAGES.items()}
    assert [Path(p).resolve() for p in seen["path"]] == [REPO / "draftheads"]
    assert Path(seen["root"]) == REPO
    assert Path(seen["checkpoints"]) == REPO / "checkpoints" and (REPO / "checkpoints").is_dir()
    assert Path(seen["climbing"]).resolve() == REPO / "checkpoints"


# -- imports run one way ----------------------------------------------------------------------------
FOLDERS = {"core": "draftheads.core", "heads": "draftheads.heads", "decoding": "draftheads.decoding",
           "training": "draftheads.training", "draftheads": "draftheads"}
#: the layers, ground first: a module may import its own layer and the ones before it (a module's
#: layer is its longest prefix here: decoding/base/ is the floor the rest of decoding/ stands on)
LAYERS = ("draftheads.core", "draftheads.heads", "draftheads.decoding.base", "draftheads.decoding",
          "draftheads.training", "draftheads")
#: upward imports not yet gone, each with its way out; one that is gone must leave this list too
KNOWN_UPWARD: set[tuple[str, str]] = set()
#: within decoding/: what the verifier and the acceptance rules read stands below the drafters that fill it
BELOW_DRAFTERS = ("draftheads.decoding.tree", "draftheads.decoding.step_trees", "draftheads.decoding.accept")


def module_imports() -> dict[str, set[str]]:
    """{module: the package modules it imports}, read from the source (every import, deferred
    ones inside functions included), relative imports resolved."""
    import ast

    modules = {}
    for folder, package in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(REPO / folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            for candidate in [target, *(f"{target}.{a.name}" for a in node.names)]:
                if candidate in modules and candidate != name and not name.startswith(candidate + "."):
                    graph[name].add(candidate)
    return graph


def test_no_import_cycle_and_nothing_imports_the_cli():
    graph = module_imports()
    assert not [m for m, targets in graph.items() if "draftheads.cli" in targets]
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, f"import cycle: {' → '.join(trail + [node, nxt])}"
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_imports_run_from_the_ground_up():
    """core/ imports nothing of ours; heads/ nothing of decoding/ or training/; decoding/base/
    nothing of the rest of decoding/; decoding/ nothing of training/ or the roof."""
    def layer(module: str) -> int:
        return max((len(prefix), i) for i, prefix in enumerate(LAYERS)
                   if module == prefix or module.startswith(prefix + "."))[1]

    upward = {(m, t) for m, targets in module_imports().items() for t in targets if layer(t) > layer(m)}
    assert not upward - KNOWN_UPWARD, f"imports against the layering (module, what it imports): {upward - KNOWN_UPWARD}"
    assert not KNOWN_UPWARD - upward, f"gone: drop them from KNOWN_UPWARD: {KNOWN_UPWARD - upward}"
    graph = module_imports()
    assert not {(m, t) for m in BELOW_DRAFTERS for t in graph[m] if t.startswith("draftheads.decoding.drafters")}
    assert layer("draftheads.decoding.generate") > layer("draftheads.decoding.base.cache") > layer("draftheads.heads.hydra")


def test_scripts_do_not_import_the_cli():
    """Scripts stand beside the CLI, not on it: what both need lives in the package root."""
    import ast

    found = [p.name for p in sorted((REPO / "scripts").glob("*.py"))
             if any(isinstance(n, ast.ImportFrom) and (n.module or "").startswith("draftheads.cli")
                    for n in ast.walk(ast.parse(p.read_text())))]
    assert not found


def test_no_two_modules_share_a_file_name():
    """A file name says which module it is: no two modules of the package share one (``__init__``
    and ``__main__`` aside), so ``config.py`` or ``options.py`` never needs its folder to be read."""
    seen: dict[str, list[str]] = {}
    for folder in FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            if path.name not in ("__init__.py", "__main__.py"):
                seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, f"modules sharing a file name: {shared}"
