"""draftheads.readme_figures and results/: the README's Figures are what the results JSON say,
every results/ path the docs and the package cite exists, and results/ stays a small set of
topic folders with an index and no code."""
from __future__ import annotations

import ast
import io
import json
import shutil
import tokenize
from pathlib import Path

import pytest

from draftheads import readme_figures, readme_spec
from draftheads.readme_figures import FiguresError, cited_paths, missing_paths, render, split, write

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"
#: the package's folders, whose comments and docstrings point at results/ as evidence
PACKAGE = ("core", "heads", "decoding", "training", "draftheads")
#: measurements.md's last section lists removed folders, by definition not in the tree
REMOVED_RUNS = "\n## Removed runs"


@pytest.fixture
def results(tmp_path) -> Path:
    """A copy of results/ without its figures and logs (render reads JSON and checks folders)."""
    root = tmp_path / "results"
    shutil.copytree(RESULTS, root, ignore=shutil.ignore_patterns("*.png", "*.log", "*.txt"))
    return root


def edit_json(path: Path, change) -> None:
    payload = json.loads(path.read_text())
    change(payload)
    path.write_text(json.dumps(payload))


def test_the_readme_figures_are_the_results_json():
    section = split((REPO / "README.md").read_text(), "README.md")[1]
    assert section == "\n" + render(RESULTS), "README.md's Figures differ from results/: run `draftheads figures`."


def test_a_changed_number_changes_its_table_and_the_check_sees_it(results, tmp_path, capsys):
    before = render(results)
    assert "| AVX512-BF16 (bfloat16), 8912efb | 17.9 | 48.9 | **2.73x** (2.10) |" in before
    edit_json(results / readme_spec.NATIVE_BS1,
              lambda p: p["overall"].update(hf_tokens_per_second=99.94, speedup=0.5))
    after = render(results)
    assert "| AVX512-BF16 (bfloat16), 8912efb | 99.9 | 48.9 | **0.50x** (2.10) |" in after
    assert after.replace("99.9", "17.9").replace("0.50x", "2.73x") == before

    readme = tmp_path / "README.md"
    shutil.copy(REPO / "README.md", readme)
    argv = ["--readme", str(readme), "--results", str(results)]
    assert readme_figures.main([*argv, "--check"]) == 1
    assert capsys.readouterr().err.strip() == (f"{readme}'s Figures differ from {results}/: "
                                               "run `draftheads figures` to rewrite them.")
    assert readme_figures.main(argv) == 0
    assert "| AVX512-BF16 (bfloat16), 8912efb | 99.9 |" in readme.read_text()
    assert readme_figures.main([*argv, "--check"]) == 0
    assert write(readme, results) is False  # written once: nothing left to change
    rest = lambda text: text.replace(split(text, "x")[1], "")  # noqa: E731
    assert rest(readme.read_text()) == rest((REPO / "README.md").read_text())


def test_the_old_drafts_key_and_the_new_sources_key_read_alike(results):
    path = results / readme_spec.NATIVE_BS1
    assert "drafts" in json.loads(path.read_text())["overall"]  # written before the rename
    before = render(results)
    edit_json(path, lambda p: p["overall"].update(sources=p["overall"].pop("drafts")))
    assert render(results) == before


def test_a_missing_key_is_one_line_naming_the_file_the_key_and_the_fix(results, tmp_path, capsys):
    edit_json(results / "batch/batch_bs4_3988df7/results.json",
              lambda p: p["results"]["4"]["strategies"]["hf"].pop("prefill_seconds"))
    with pytest.raises(FiguresError) as error:
        render(results)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("results/batch/batch_bs4_3988df7/results.json has no key "
                              "results.4.strategies.hf.prefill_seconds (the README's 'Padded batches end to end' "
                              "table, row 4, column prefill s: HF / default): rerun the figure's command")
    assert message.endswith("or point the figure elsewhere in draftheads/readme_spec.py.")

    readme = tmp_path / "README.md"
    shutil.copy(REPO / "README.md", readme)
    assert readme_figures.main(["--readme", str(readme), "--results", str(results), "--check"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


def test_a_missing_file_or_folder_is_one_line_naming_it(results):
    (results / "other_bases/gemma3_270m/avx2_fp32/results.json").unlink()
    with pytest.raises(FiguresError, match=r"^results/other_bases/gemma3_270m/avx2_fp32/results.json not found "
                                           r"\(a README figure reads it\): restore it from git"):
        render(results)
    shutil.copy(RESULTS / "other_bases/gemma3_270m/avx2_fp32/results.json",
                results / "other_bases/gemma3_270m/avx2_fp32/results.json")
    shutil.rmtree(results / "loop/inference_mode")
    with pytest.raises(FiguresError, match=r"^the README's figures name results/loop/inference_mode, which does not "
                                           r"exist: restore it from git or change the figure in "):
        render(results)


def test_a_readme_without_markers_is_refused(tmp_path, results):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Figures\n")
    with pytest.raises(FiguresError, match=r"has no '<!-- figures:begin -->' \.\.\. '<!-- figures:end -->' markers"):
        write(readme, results)


def test_cited_paths_expand_braces_and_skip_paths_at_a_commit():
    text = ("see `results/batch/batch_drafts_{bf16,fp32}/` and ../results/loop/x.json, "
            "`8d085cf:results/cpu_classes/avx512_bf16`, `results/<dir>`.")
    assert cited_paths(text) == ["results/batch/batch_drafts_bf16/", "results/batch/batch_drafts_fp32/",
                                 "results/loop/x.json"]
    assert missing_paths(text, RESULTS) == ["results/loop/x.json"]


def comments_and_docstrings(source: str) -> str:
    """A Python file's comments and docstrings, the text where evidence is cited."""
    comments = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT]
    nodes = [node for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return "\n".join(comments + [doc for node in nodes if (doc := ast.get_docstring(node))])


def cited_texts() -> dict[str, str]:
    texts = {"README.md": (REPO / "README.md").read_text()}
    for doc in sorted((REPO / "docs").glob("*.md")):
        texts[f"docs/{doc.name}"] = doc.read_text().split(REMOVED_RUNS)[0]
    for folder in PACKAGE:
        for source in sorted((REPO / folder).rglob("*.py")):
            texts[str(source.relative_to(REPO))] = comments_and_docstrings(source.read_text())
    return texts


def test_every_results_path_the_docs_and_the_package_cite_exists():
    texts = cited_texts()
    assert sum(len(cited_paths(text)) for text in texts.values()) > 50  # the scan finds the citations
    missing = {name: paths for name, text in texts.items() if (paths := missing_paths(text, RESULTS))}
    assert missing == {}


def test_results_is_a_few_topic_folders_with_an_index_and_no_code():
    topics = sorted(p.name for p in RESULTS.iterdir() if p.is_dir())
    assert 5 <= len(topics) <= 20
    assert sorted(p.name for p in RESULTS.iterdir() if p.is_file()) == ["README.md"]
    index = (RESULTS / "README.md").read_text()
    rows = [line for line in index.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [f"{name}/" for name in topics]  # one row per folder, in order
    code = sorted(str(p.relative_to(RESULTS)) for pattern in ("*.py", "*.sh", "*.ipynb")
                  for p in RESULTS.rglob(pattern))
    assert code == []
