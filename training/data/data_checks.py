"""Every record of the training data checked before the base loads: the right columns, of the
right types, token ids inside the base's vocabulary; the first problem is one
:class:`~.records.DataError` naming the file, the line (or record) and the fix."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .records import DataError, load_records, require_columns, resolve_data_path


#: the column of token ids each data kind reads
ID_COLUMNS = {"tokens": "input_ids", "selfdistill": "response_ids"}


def json_lines_file(source: str | Path) -> Path | None:
    """The local JSON-lines file ``source`` names (``.jsonl``, or ``.json`` not holding one
    JSON array), else None: such a file is checked line by line as written (:func:`check_json_lines`)."""
    path = resolve_data_path(source)
    if not (path.is_file() and path.suffix in (".jsonl", ".json")):
        return None
    with open(path, encoding="utf-8", errors="replace") as handle:
        return None if handle.read(4096).lstrip().startswith("[") else path


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def ids_problem(name: str, ids: Any, vocab_size: int | None, kind: str) -> str | None:
    """What is wrong with one record's list of token ids ``name``, or None: the embedding would
    fail mid-training on the first id that is not in [0, vocab_size)."""
    if ids is None:
        return f"{name} is missing; every record of data kind {kind!r} needs a list of token ids there"
    if not isinstance(ids, list):
        return (f"{name} is a {type(ids).__name__} ({str(ids)[:40]!r}), not a list of token ids; write it as a JSON "
                "list of integers (tokenize text with the base's tokenizer first)")
    for value in ids:
        if not is_int(value):
            return (f"{name} holds {value!r}, not a token id; token ids are JSON integers (tokenize text with the "
                    "base's tokenizer first)")
        if value < 0 or (vocab_size is not None and value >= vocab_size):
            return (f"{name} holds {value}, outside the base's vocabulary "
                    f"{f'[0, {vocab_size})' if vocab_size is not None else '(ids are ≥ 0)'}; the ids must come from "
                    "the base's own tokenizer (re-tokenize this record with it, or drop it)")
    return None


#: what a scalar field must be: (test, how the message says it)
SCALARS = {"text": (lambda v: isinstance(v, str), "a string (the text)"),
           "text or none": (lambda v: v is None or isinstance(v, str), "a string (the text) or left out"),
           "start or none": (lambda v: v is None or (is_int(v) and v >= 0),
                             "a whole number ≥ 0 (the index of the first answer token) or left out")}


def scalar_problem(name: str, value: Any, wanted: str) -> str | None:
    """What is wrong with one record's scalar field ``name`` (see :data:`SCALARS`), or None."""
    test, what = SCALARS[wanted]
    if test(value):
        return None
    shown = "missing" if value is None else f"{type(value).__name__} {repr(value)[:40]}"
    return f"{name} is {shown}; it must be {what}"


def conversation_problem(messages: Any) -> str | None:
    """What is wrong with one record's ``messages``, or None."""
    example = 'a list of turns like [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]'
    if not isinstance(messages, list) or not messages:
        shown = "missing" if messages is None else f"{type(messages).__name__} {repr(messages)[:40]}"
        return f"messages is {shown}; it must be {example}"
    for turn, message in enumerate(messages, 1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            return f"turn {turn} of messages is {str(message)[:60]!r}; each turn needs a role and a content string"
    if messages[-1]["role"] != "assistant":
        return (f"messages ends with a {messages[-1]['role']!r} turn; the answer to learn must be the last turn, "
                "with role 'assistant'")
    return None


def field_checks(kind: str, vocab_size: int | None, select_by_source: bool,
                 skip: str | None = None) -> list[tuple[str, Callable[[Any], str | None]]]:
    """(field, check of its value) for every field training reads from a ``kind`` record."""
    checks: list[tuple[str, Callable[[Any], str | None]]] = []
    if kind in ID_COLUMNS and ID_COLUMNS[kind] != skip:
        name = ID_COLUMNS[kind]
        checks.append((name, lambda v: ids_problem(name, v, vocab_size, kind)))
    if kind == "tokens":
        checks.append(("response_start", lambda v: scalar_problem("response_start", v, "start or none")))
    elif kind == "selfdistill":
        checks.append(("prompt", lambda v: scalar_problem("prompt", v, "text")))
    elif kind == "conversations":
        checks.append(("messages", conversation_problem))
    if select_by_source:
        checks.append(("source", lambda v: scalar_problem("source", v, "text or none")))
    return checks


def record_problem(record: dict, checks) -> str | None:
    """The first problem of one record under ``checks`` (:func:`field_checks`), or None."""
    return next((problem for name, check in checks if (problem := check(record.get(name))) is not None), None)


def check_json_lines(path: Path, source: str | Path, kind: str, vocab_size: int | None, select_by_source: bool,
                     columns: dict[str, str] | None = None) -> None:
    """Every line of a JSON-lines file as written (the types before any reader converts them:
    an id written ``"5"`` or ``5.0`` is not an id), columns renamed by ``columns``; the first
    problem is one :class:`DataError` naming the file, the line and the fix."""
    import json

    checks = field_checks(kind, vocab_size, select_by_source)
    with open(path, encoding="utf-8", errors="strict") as handle:
        try:
            for line_no, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{source}, line {line_no} is not valid JSON ({err.msg} at column {err.colno}); "
                                    "write one JSON object per line.") from None
                if not isinstance(record, dict):
                    raise DataError(f"{source}, line {line_no} is a JSON {type(record).__name__}; write one JSON object "
                                    "per line.")
                record = {(columns or {}).get(k, k): v for k, v in record.items()}
                problem = record_problem(record, checks)
                if problem is not None:
                    raise DataError(f"{source}, line {line_no}: {problem}.")
        except UnicodeDecodeError:
            raise DataError(f"{source} is not UTF-8 text (a binary file?); training data is JSON lines, parquet, CSV "
                            "or a datasets folder.") from None


def arrow_bad_ids(column, vocab_size: int | None) -> int | None:
    """Index of the first record of a ``list<int>`` Arrow column whose ids are missing or not
    all in [0, vocab_size), at Arrow's speed (a self-distilled set holds millions of ids)."""
    import pyarrow.compute as pc

    offset = 0
    for chunk in column.chunks:
        if chunk.null_count:
            return offset + chunk.is_null().to_pylist().index(True)
        values = pc.list_flatten(chunk)
        bad = pc.less(values, 0) if vocab_size is None else pc.or_(pc.less(values, 0),
                                                                  pc.greater_equal(values, vocab_size))
        bad = pc.or_kleene(bad, values.is_null())
        if pc.any(bad).as_py():
            return offset + pc.list_parent_indices(chunk)[pc.index(bad, True).as_py()].as_py()
        offset += len(chunk)
    return None


def check_dataset(dataset, source: str | Path, kind: str, vocab_size: int | None, select_by_source: bool) -> None:
    """:func:`check_json_lines` for data read through ``datasets`` (a datasets folder, parquet,
    CSV, the Hub): the id column at Arrow's speed where it is a list of integers, every other
    field record by record; a problem names the record (its line in a CSV file)."""
    import pyarrow as pa

    def place(index: int) -> str:
        return f"{source}, line {index + 2}" if str(source).endswith(".csv") else f"{source}, record {index + 1}"

    skip = None
    name = ID_COLUMNS.get(kind)
    column = dataset.data.column(name) if name in dataset.column_names else None
    if column is not None and len(column) == len(dataset) and pa.types.is_list(column.type) \
            and pa.types.is_integer(column.type.value_type):
        index = arrow_bad_ids(column, vocab_size)
        if index is not None:
            raise DataError(f"{place(index)}: {ids_problem(name, dataset[index][name], vocab_size, kind)}.")
        skip = name
    checks = field_checks(kind, vocab_size, select_by_source, skip)
    fields = [n for n, _ in checks if n in dataset.column_names]
    if not fields:
        return
    rows = dataset.select_columns(fields)
    for start in range(0, len(rows), 4096):
        block = rows[start: start + 4096]
        for offset in range(len(block[fields[0]])):
            problem = record_problem({n: block[n][offset] for n in fields}, checks)
            if problem is not None:
                raise DataError(f"{place(start + offset)}: {problem}.")


def check_data(path: str | Path, kind: str, vocab_size: int | None, name: str | None = None, split: str = "train",
               columns: dict[str, str] | None = None, select_by_source: bool = False) -> None:
    """Every record of the data at ``path`` holds what training of ``kind`` reads, of the right
    type, its token ids inside the base's vocabulary (``vocab_size``; None = not known, only
    ≥ 0): checked before the base loads, the first problem one :class:`DataError` naming the
    file, the line (or record) and the fix. A JSON-lines file is read line by line as written
    (also where ``datasets`` cannot read it, to name the line); anything else through
    ``datasets`` (:func:`check_dataset`). ``select_by_source``: data.sources / source_caps read ``source``."""
    lines = json_lines_file(path)
    try:
        dataset = load_records(path, name, split, columns)
    except DataError:
        if lines is not None:
            check_json_lines(lines, path, kind, vocab_size, select_by_source, columns)
        raise
    require_columns(dataset, kind, path)
    if lines is not None:
        check_json_lines(lines, path, kind, vocab_size, select_by_source, columns)
    else:
        check_dataset(dataset, path, kind, vocab_size, select_by_source)
