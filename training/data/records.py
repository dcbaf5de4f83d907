"""Training data for draft heads, on top of 🤗 ``datasets``.

Three kinds of data become the same thing, a list of
:class:`~draftheads.training.features.Example` (token ids of prompt + answer, and where the answer
starts; only answer tokens are learned):

* ``selfdistill``: the base model's own answers to a prompt set (:func:`~.self_distillation.self_distill` makes
  them, resumable in shards). Heads trained on what the base actually writes learn what the
  base will accept; this is the default.
* ``conversations``: fixed ``messages`` (user → assistant), e.g. reference answers.
* ``tokens``: pre-tokenized ``input_ids`` (+ optional ``response_start``).

Each comes from a local file or folder, or from a Hub dataset id read with
``datasets.load_dataset`` (config name, split and a column mapping beside it: :func:`load_records`),
as TRL and axolotl configs name data; a clone of the project carries none of the training sets.

The examples then become training *positions* (the base's last hidden state at t, the text
tokens x_{t+1}.., the base's own argmax predictions) either once, into the fp16 feature cache
of :mod:`draftheads.training.features`, or on the fly from a base forward per batch (:func:`example_features`).

The base's own answers are made by :mod:`.self_distillation` (``python -m
draftheads.training.data.self_distillation --help`` or ``scripts/selfdistill.py``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import torch

from ...core.errors import DataError  # noqa: F401 (its home is core.errors; training imports it from here)
from ...decoding.base.loading import from_checkout
from ..features import (Example, Features, captured_states, check_fp16, selfdistill_examples, shift_targets,
                        shift_teacher)

PROVENANCE = "provenance.json"
#: the Hub options (a recipe's data.name / data.split / data.columns, self-distillation's --name /
#: --split / --columns) at their defaults: left out of a run's identity and provenance, so runs
#: made before they existed still resume
HUB_DEFAULTS = {"name": None, "split": "train", "columns": {}}
#: local data file types and the ``datasets`` builder that reads each
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
#: ``name`` or ``owner/name``: what may be a Hub dataset id when no such local path exists
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
#: what a data path (a recipe's data.path, self-distillation's --prompts) may be, for every "cannot read it" error
DATA_OPTIONS = ("use a local JSON-lines file or datasets folder (e.g. a self-distillation output: draftheads "
                "selfdistill --prompts FILE_OR_HUB_ID --out <that folder>), or a Hub dataset id already in "
                "this machine's datasets cache (a recipe's data.name / data.split / data.columns, self-distillation's "
                "--name / --split / --columns)")

#: columns each data kind needs, and where such data comes from (for the error message)
REQUIRED_COLUMNS = {
    "selfdistill": (("prompt", "response_ids"), "self-distilled answers (python -m draftheads.training.data.self_distillation)"),
    "conversations": (("messages",), "chat records with messages=[{role, content}, ...], e.g. train_conversations.jsonl"),
    "tokens": (("input_ids",), "pre-tokenized records with input_ids (and optionally response_start)"),
    "prompts": (("prompt",), "prompt records, e.g. train_prompts.jsonl"),
}


# -- loading ------------------------------------------------------------------------------------
def resolve_data_path(path: str | Path) -> Path:
    """Relative paths are tried from the working directory, then from the source checkout
    (so ``tests/data/...`` or ``data_cache/...`` in a recipe work from anywhere inside the project)."""
    return from_checkout(path)


def is_hub_id(path: str | Path) -> bool:
    """Whether a data path that is not on disk may be a Hub dataset id (``name`` or
    ``owner/name``, no data-file suffix); ``../x.jsonl`` or ``/abs/path`` never is."""
    text = str(path)
    return bool(HUB_ID.fullmatch(text)) and Path(text).suffix not in FILE_BUILDERS


def load_records(path: str | Path, name: str | None = None, split: str = "train",
                 columns: dict[str, str] | None = None):
    """Any ``datasets``-loadable source → ``datasets.Dataset``, columns renamed by ``columns``
    ({column in the data: column draftheads reads}). A local path wins: a .jsonl/.json/.parquet/.csv
    file, a ``save_to_disk`` directory, a self-distillation output directory (its merged
    ``dataset/``) or a directory of JSON-lines files; else ``path`` is read as a Hub dataset id
    (``load_dataset(path, name, split=split)``: the cache, or the Hub when online), the way TRL or
    axolotl configs name data. Whatever fails is one :class:`DataError` naming the alternatives."""
    source = resolve_data_path(path)
    if source.exists():
        dataset = load_local(source)
    elif is_hub_id(path):
        dataset = load_hub(str(path), name, split, source)
    else:
        raise DataError(f"Data {str(path)!r} not found (looked at {source}); {DATA_OPTIONS}.")
    return rename_columns(dataset, columns or {}, path)


def load_local(source: Path):
    """A local file or folder (see :func:`load_records`) → ``datasets.Dataset``."""
    import datasets

    if source.is_file():
        builder = FILE_BUILDERS.get(source.suffix)
        if builder is None:
            raise DataError(f"{source}: unknown data file type {source.suffix!r}; use .jsonl, .json, .parquet or .csv.")
        try:
            return datasets.load_dataset(builder, data_files=str(source), split="train")
        except Exception as err:  # datasets wraps a bad line in DatasetGenerationError (its cause says which)
            raise DataError(f"{source} cannot be read as {builder} data ({first_line(err)}); JSON lines need one "
                            "object per line, every line with the same fields.") from None
    if (source / "dataset_info.json").is_file() or (source / "state.json").is_file():
        return datasets.load_from_disk(str(source))
    if (source / "dataset").is_dir():
        return datasets.load_from_disk(str(source / "dataset"))
    if (source / "shards").is_dir():
        raise DataError(f"{source} is an unfinished self-distillation run (no merged dataset/ yet); "
                        "re-run the same self-distillation command to finish it.")
    files = sorted(source.glob("*.jsonl"))
    if files:
        return datasets.load_dataset("json", data_files=[str(f) for f in files], split="train")
    raise DataError(f"{source} holds no dataset: expected a save_to_disk directory or *.jsonl files.")


def load_hub(dataset_id: str, name: str | None, split: str, looked_at: Path):
    """A Hub dataset (cached, or fetched when online) → ``datasets.Dataset``. No machine here has
    internet access, so an id not in the cache must fail as one line naming the local way."""
    import datasets

    try:
        return datasets.load_dataset(dataset_id, name, split=split)
    except Exception as err:  # offline, unknown id, config or split: datasets raises many types
        raise DataError(f"Data {dataset_id!r} is no local file or folder (looked at {looked_at}) and no Hub dataset "
                        f"readable here ({type(err).__name__}: {first_line(err)}); {DATA_OPTIONS}.") from None


def first_line(err: BaseException) -> str:
    """An exception's cause's message (datasets wraps the real one), else its own, cut to one
    line for a one-line error."""
    text = str(err.__cause__ or "").strip() or str(err).strip() or type(err).__name__
    return text.splitlines()[0][:300]


def rename_columns(dataset, columns: dict[str, str], source: str | Path):
    """``columns`` = {column in the data: the column draftheads reads} (``Dataset.rename_columns``);
    a column the data lacks, or a target it already has, is refused rather than ignored."""
    if not columns:
        return dataset
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise DataError(f"{source} has no column {missing[0]!r} to rename (data.columns); it has {dataset.column_names}.")
    clash = [new for old, new in columns.items() if new in dataset.column_names and new not in columns]
    if clash:
        raise DataError(f"{source} already has a column {clash[0]!r}; data.columns cannot rename another one to it.")
    return dataset.rename_columns(columns)


def require_columns(dataset, kind: str, source: str | Path) -> None:
    """Refuse data without the columns ``kind`` needs, naming the missing one and what fits."""
    needed, what = REQUIRED_COLUMNS[kind]
    missing = [c for c in needed if c not in dataset.column_names]
    if missing:
        raise DataError(f"{source} has no column {missing[0]!r} needed for data kind {kind!r} "
                        f"(it has {dataset.column_names}); {kind!r} expects {what} (other names: map them with "
                        f"data.columns / --columns, e.g. {{question: {missing[0]}}}).")



def conversation_examples(records: Iterable[dict], tokenizer, max_length: int = 1024) -> list[Example]:
    """``messages`` conversations → examples whose answer is the last assistant turn (everything
    before it is prompt, chat template applied; single-turn records are the common case)."""
    examples = []
    for record in records:
        messages = record["messages"]
        if not messages or messages[-1].get("role") != "assistant":
            raise DataError(f"Conversation {record.get('id', '?')} does not end with an assistant message; "
                            "the answer to learn must be the last turn.")
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        if list(full[: len(prompt)]) != list(prompt):
            raise DataError("The chat template does not render the prompt as a prefix of the conversation; "
                            "cannot tell where the answer starts.")
        ids = list(full)[:max_length]
        if len(ids) > len(prompt) + 1:
            examples.append(Example(ids, len(prompt)))
    return examples


def token_examples(records: Iterable[dict], max_length: int = 1024) -> list[Example]:
    """Pre-tokenized records: ``input_ids`` and optional ``response_start`` (default 1: all
    tokens after the first are learned)."""
    examples = []
    for record in records:
        ids = list(record["input_ids"])[:max_length]
        start = int(record.get("response_start") or 1)
        if len(ids) > start + 1:
            examples.append(Example(ids, max(1, start)))
    return examples


def select_sources(sources: list[str], keep: Iterable[str] = (), caps: dict[str, int] | None = None) -> list[int]:
    """Indices of the records to use, in order: those whose source starts with one of ``keep``
    (all when empty), at most N of those starting with each ``caps`` prefix. Rebalances a
    prompt mix (e.g. the shared prompts are 45 % GSM8K) without copying the data."""
    keep, caps = tuple(keep), dict(caps or {})
    taken = dict.fromkeys(caps, 0)
    chosen = []
    for index, source in enumerate(sources):
        source = source or ""  # a record without a source (e.g. self-distilled from a Hub prompt set)
        if keep and not source.startswith(keep):
            continue
        capped = [p for p in caps if source.startswith(p)]
        if any(taken[p] >= caps[p] for p in capped):
            continue
        for p in capped:
            taken[p] += 1
        chosen.append(index)
    return chosen


def load_examples(kind: str, path: str | Path, tokenizer=None, max_length: int = 1024, limit: int = 0,
                  sources: Iterable[str] = (), source_caps: dict[str, int] | None = None, name: str | None = None,
                  split: str = "train", columns: dict[str, str] | None = None) -> list[Example]:
    """Data of ``kind`` at ``path`` (a local file/folder or a Hub id: :func:`load_records`) →
    examples: records selected by ``source`` prefix and caps (:func:`select_sources`), then the
    first ``limit`` of them when > 0."""
    if kind not in ("selfdistill", "conversations", "tokens"):
        raise DataError(f"Unknown data kind {kind!r}; use selfdistill, conversations or tokens.")
    dataset = load_records(path, name, split, columns)
    require_columns(dataset, kind, path)
    if tuple(sources) or source_caps:
        if "source" not in dataset.column_names:
            raise DataError(f"{path} has no 'source' column, so data.sources / data.source_caps cannot select "
                            "records; remove them from the recipe.")
        dataset = dataset.select(select_sources(dataset["source"], sources, source_caps))
    if limit:
        dataset = dataset.select(range(min(limit, len(dataset))))
    if kind == "tokens":
        return token_examples(dataset, max_length)
    if tokenizer is None:
        raise DataError(f"Data kind {kind!r} needs the base's tokenizer (chat template); the base has none.")
    if kind == "selfdistill":
        return selfdistill_examples(dataset, tokenizer, max_length)
    return conversation_examples(dataset, tokenizer, max_length)


# -- training positions -------------------------------------------------------------------------
@torch.no_grad()
def example_features(model, examples: list[Example], layers: list[int] | tuple[int, ...] = ()) -> Features:
    """The same positions the feature cache stores, computed now (the on-the-fly path): one
    base forward over the batch of examples (the states of ``layers`` from it too). Rows of one
    example stay contiguous and in order, which :func:`shifted_rows` relies on."""
    hidden, named, targets, teacher = [], [], [], []
    for example, captured in zip(examples, captured_states(model, examples, layers)):
        hidden.append(captured.hidden)
        named.append(captured.layers)
        targets.append(shift_targets(torch.tensor(example.input_ids), example.response_start))
        teacher.append(shift_teacher(captured.predicted))
    return Features(torch.cat(hidden), torch.cat(targets), torch.cat(teacher),
                    layers=check_fp16(torch.cat(named), layers, "the base's forward") if layers else None)


def shifted_rows(targets: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(P, K) row index of position t+k+1 for head k at row t, -1 where it does not exist.

    The teacher of head k (which drafts x_{t+k+2}) is the base's distribution at position
    t+k+1. Positions of one sequence are consecutive rows, and x_{t+k+2} exists exactly when
    t+k+1 is a stored position of the same sequence, so a valid label means row t+k+1."""
    rows = torch.arange(targets.shape[0])[:, None] + torch.arange(1, num_heads + 1)[None, :]
    return torch.where(targets[:, 1: num_heads + 1] >= 0, rows, torch.full_like(rows, -1))
