"""The README's ``## Figures`` section, generated from the JSON under ``results/``.

Rules: every number in that section is read from a results file, never typed; the section says
what was run (the commands) and where the files are, not when or what came before (dates,
earlier runs and their noise live in ``docs/measurements.md``). :data:`FIGURES` declares which
file feeds which table cell; :func:`render` writes the section, :func:`write` puts it between the
README's markers and ``draftheads figures --check`` fails when README and results disagree.
A file or key a figure reads that is not there, or a ``results/`` path the section names that
does not exist, is one :class:`FiguresError` line naming it and the fix.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

from .bench.summary import with_sources
from .readme_spec import FIGURES, Figure, Section, Source
from .core.errors import DraftheadsError

BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
#: the README's line width for prose
WIDTH = 100
#: where a figure's spec lives, named by every error about one
SPEC = "draftheads/readme_spec.py"


class FiguresError(DraftheadsError, ValueError):
    """A results file, key or path the README's figures need is missing, or the README has no
    markers; the message names it and the fix."""


#: a template's field: a source's name, dotted keys, an optional format spec
FIELD = re.compile(r"\{(\w+)((?:\.[^.:{}]+)*)(?::([^{}]*))?\}")
#: a ``results/...`` path as prose and code name it; one after ``<commit>:`` is a path in git history
PATH = re.compile(r"(?<![\w-])results/[\w.*{},/+-]*[\w*}/-]")
AT_COMMIT = re.compile(r"[0-9a-f]{7,40}:$")


class Reader:
    """The results files one rendering reads, each loaded and validated once."""

    def __init__(self, root: Path):
        self.root, self.loaded = root, {}

    def file(self, path: str) -> dict:
        """The payload of ``path`` (under the root), its source configurations under ``sources``."""
        if path not in self.loaded:
            self.loaded[path] = with_sources(load_json(self.root / path, f"results/{path}"))
        return self.loaded[path]

    def value(self, source: Source, keys: list[str], what: str):
        """The value at ``source.at`` + ``keys`` in the source's file; a missing key: FiguresError."""
        data = self.file(source.path)
        path = [k for k in source.at.split(".") if k] + keys
        depth = 0
        while depth < len(path):
            key = path[depth]
            while isinstance(data, dict) and key not in data and depth + 1 < len(path):
                depth += 1  # a key holding a dot (a peer named "llama.cpp")
                key = f"{key}.{path[depth]}"
            if not isinstance(data, dict) or key not in data:
                raise FiguresError(
                    f"results/{source.path} has no key {'.'.join(path[:depth + 1])} (the README's {what}): rerun "
                    f"the figure's command to rewrite the file, or point the figure elsewhere in {SPEC}.")
            data = data[key]
            depth += 1
        return data


def load_json(path: Path, name: str) -> dict:
    """A results JSON file; a missing or unreadable one is one FiguresError line."""
    if not path.is_file():
        raise FiguresError(f"{name} not found (a README figure reads it): restore it from git or rerun the "
                           f"figure's command, or point the figure elsewhere in {SPEC}.")
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FiguresError(f"{name} is not readable JSON ({err}): restore it from git or rerun the figure's command.")
    if not isinstance(payload, dict):
        raise FiguresError(f"{name} is not a JSON object: restore it from git or rerun the figure's command.")
    return payload


def fill(template: str, sources: dict[str, Source], reader: Reader, what: str) -> str:
    """``template`` with every ``{name.keys:spec}`` field read from ``sources``."""
    def field_value(match: re.Match) -> str:
        name, keys, spec = match.group(1), match.group(2), match.group(3) or ""
        if name not in sources:
            raise FiguresError(f"the README's {what} names no source '{name}': add it to the figure in {SPEC}.")
        value = reader.value(sources[name], [k for k in keys.split(".") if k], what)
        try:
            return format(value, spec)
        except (TypeError, ValueError):
            raise FiguresError(f"results/{sources[name].path}: {keys.lstrip('.')} is {value!r}, not a number "
                               f"for '{spec}' (the README's {what}): rerun the figure's command or fix the figure "
                               f"in {SPEC}.")
    return FIELD.sub(field_value, template)


def render_table(figure: Figure, reader: Reader) -> list[str]:
    """A figure's Markdown table, one line a row."""
    headers = [*figure.labels, *(c.header for c in figure.columns)]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in figure.rows:
        what = f"'{figure.name}' table, row {' '.join(row.labels)}"
        cells = [*row.labels,
                 *(fill(c.cell, row.sources, reader, f"{what}, column {c.header}") for c in figure.columns)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def wrapped(text: str) -> str:
    """Prose at the README's width."""
    return textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False)


def render_figure(figure: Figure, reader: Reader) -> list[str]:
    """A figure's title, commands, table and notes, with the blank lines between."""
    lines = [wrapped(figure.title), ""]
    if figure.commands:
        lines += ["```bash", *figure.commands, "```", ""]
    lines += render_table(figure, reader)
    for note in figure.notes:
        lines += ["", wrapped(fill(note.text, note.sources, reader, f"note under '{figure.name}'"))]
    return lines + [""]


def cited_paths(text: str) -> list[str]:
    """Every ``results/...`` path ``text`` names, braces expanded (``{a,b}``), globs kept;
    paths at a commit (``abc1234:results/...``) left out."""
    found = []
    for match in PATH.finditer(text):
        if not AT_COMMIT.search(text[max(0, match.start() - 41): match.start()]):
            found += expand(match.group(0))
    return found


def expand(path: str) -> list[str]:
    """``path`` with its first ``{a,b}`` expanded, recursively."""
    braces = re.search(r"\{([^{}]*)\}", path)
    if not braces:
        return [path]
    return [p for alt in braces.group(1).split(",") for p in expand(path[:braces.start()] + alt + path[braces.end():])]


def missing_paths(text: str, results_root: Path) -> list[str]:
    """The paths :func:`cited_paths` finds in ``text`` that match nothing under ``results_root``."""
    missing = []
    for path in cited_paths(text):
        relative = path.removeprefix("results/").rstrip("/")
        if relative and not any(results_root.glob(relative)):
            missing.append(path)
    return list(dict.fromkeys(missing))


def render(results_root: Path, section: Section = FIGURES) -> str:
    """The README's whole ``## Figures`` section, from the JSON under ``results_root``."""
    reader = Reader(Path(results_root))
    lines = ["## Figures", "", section.intro, ""]
    for figure in section.figures:
        lines += render_figure(figure, reader)
    lines += [wrapped(f"- {pointer}").replace("\n", "\n  ") for pointer in section.pointers]
    text = "\n".join(lines).rstrip("\n") + "\n"
    missing = missing_paths(text, Path(results_root))
    if missing:
        raise FiguresError(f"the README's figures name {missing[0]}, which does not exist: restore it from git or "
                           f"change the figure in {SPEC}.")
    return text


def split(readme_text: str, name: str) -> tuple[str, str, str]:
    """README text as (before the section, the section, after it), by its markers."""
    start, end = readme_text.find(BEGIN), readme_text.find(END)
    if start < 0 or end < start:
        raise FiguresError(f"{name} has no '{BEGIN}' ... '{END}' markers in that order: add them around its "
                           "## Figures section.")
    return readme_text[:start + len(BEGIN)], readme_text[start + len(BEGIN):end], readme_text[end:]


def write(readme: Path, results_root: Path) -> bool:
    """Put :func:`render` between ``readme``'s markers; True where the file changed."""
    text = Path(readme).read_text()
    before, current, after = split(text, str(readme))
    wanted = "\n" + render(results_root)
    if current == wanted:
        return False
    Path(readme).write_text(before + wanted + after)
    return True


def differs(readme: Path, results_root: Path) -> bool:
    """Whether ``readme``'s Figures section is other than :func:`render` makes."""
    return split(Path(readme).read_text(), str(readme))[1] != "\n" + render(results_root)


def main(argv: list[str] | None = None) -> int:
    """``draftheads figures``: rewrite README.md's Figures section from results/, or with
    ``--check`` exit 1 where it disagrees. 0 done / up to date, 1 out of date, 2 an error."""
    parser = argparse.ArgumentParser(prog="draftheads figures", description=main.__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=Path("README.md"), help="the README to write (README.md)")
    parser.add_argument("--results", type=Path, default=Path("results"), help="the results folder (results)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the README is out of date")
    args = parser.parse_args(argv)
    try:
        if not args.readme.is_file():
            raise FiguresError(f"{args.readme} not found: run from the repository root or pass --readme.")
        if args.check:
            if differs(args.readme, args.results):
                print(f"{args.readme}'s Figures differ from {args.results}/: run `draftheads figures` to rewrite "
                      "them.", file=sys.stderr)
                return 1
            return 0
        changed = write(args.readme, args.results)
    except FiguresError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.readme}: Figures {'rewritten' if changed else 'already up to date'}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
