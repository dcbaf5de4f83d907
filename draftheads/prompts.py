"""Prompt files and chat formatting: the one place the CLI, the benches, the evaluation and the
scripts read prompts from, so every figure is measured on prompts selected the same way.

A prompt file is JSON lines: MT-Bench / Spec-Bench records (``turns``: the first turn is the
prompt; ``category``) or ``{"prompt": ...}``. A built-in name (``mt-bench``, ``spec-bench``: the
files shipped in ``draftheads/data/``, :data:`PROMPT_SETS`) stands for its file wherever a path
does, so the README's commands run on a clone or an installed wheel. A path may end in ``@N``: the first N prompts of
each category of that file (``spec_bench_dev.jsonl@8``), or ``@N:cat,cat`` for those categories
only (``spec_bench_dev.jsonl@8:qa,rag``; a group name such as ``mt_bench`` stands for its categories). Several files are read in order and a
prompt text seen in an earlier file is skipped, so ``mt_bench.jsonl spec_bench_dev.jsonl@8``
is MT-Bench's 80 prompts plus 8 of each other Spec-Bench category.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from .core.errors import DraftheadsError
from .training.features import chat_prompt_ids

#: the data shipped with the package (evaluation prompts, GPU cost surfaces; README and licences there)
DATA_DIR = Path(__file__).resolve().parent / "data"
#: built-in prompt sets: name → file in DATA_DIR (``clean-eval``: :data:`CLEAN_EVAL_PROMPTS`)
PROMPT_SETS = {"mt-bench": "mt_bench.jsonl", "spec-bench": "spec_bench_dev.jsonl", "clean-eval": "clean_eval.jsonl"}
#: the dev prompts the heads are scored on (the README's bench rows, the data-scaling table):
#: MT-Bench's first of each category and 8 of each other Spec-Bench dev task
DEV_PROMPTS = ("mt-bench@1", "spec-bench@8:translation,summarization,qa,math_reasoning,rag")
#: the batched bench's prompts (the README's batch rows, the batch-path scripts): two of each
#: MT-Bench category and four of each other Spec-Bench dev task, dealt round-robin into batches
BATCH_PROMPTS = ("mt-bench@2", "spec-bench@4:translation,summarization,qa,math_reasoning,rag")
#: the clean evaluation set the heads' trees and best epoch are chosen on (a recipe's data.eval_path
#: job answers it): every record of the built-in spec-bench file whose prompt is in neither
#: DEV_PROMPTS nor BATCH_PROMPTS, so no figure the benches report is measured on a prompt the heads
#: were selected on; 8 of each MT-Bench category and 32 of each other Spec-Bench dev task, 224 in
#: all. Written to its file by :func:`clean_eval_text` (the distill job reads files by path)
CLEAN_EVAL_PROMPTS = "clean-eval"

#: MT-Bench's eight categories (Spec-Bench counts them as one task, "mt_bench")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


class PromptError(DraftheadsError, ValueError):
    """A prompt that cannot be used (empty), or a prompt file that cannot be read."""


class PromptFileError(PromptError):
    """A prompt file that cannot be read: names the file (and line) and what is wrong."""


def group_of(category: str) -> str:
    """Spec-Bench category group: MT-Bench's eight categories count as one task."""
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def chat_input(tokenizer, prompt: str) -> torch.Tensor:
    """(1, L) input ids of one chat-formatted prompt."""
    if not prompt.strip():
        raise PromptError("the prompt is empty; pass some text (--prompt \"...\").")
    return torch.tensor([chat_prompt_ids(tokenizer, prompt)])


def conversation_input(tokenizer, turns: Sequence[str], answers: Sequence[str]) -> torch.Tensor:
    """(1, L) input ids of a multi-turn chat: user turns[0], assistant answers[0], ..., the last
    user turn, ready for the next answer (MT-Bench's second turn has the first answer in context)."""
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    return torch.tensor([list(ids)])


def split_spec(spec: str) -> tuple[str, int | None, list[str] | None]:
    """``path@N:cat1,cat2`` → (path, N, [cat1, cat2]): the first N prompts of each of those
    categories (or groups, e.g. ``mt_bench``); ``path@N`` → every category; a plain path → all."""
    path, sep, cap = str(spec).rpartition("@")
    count, _, cats = cap.partition(":")
    if sep and count.isdigit() and path:
        if int(count) < 1:
            raise PromptFileError(f"{spec}: the per-category count after '@' must be at least 1.")
        return path, int(count), [c.strip() for c in cats.split(",") if c.strip()] or None
    return str(spec), None, None


def prompt_file(name_or_path: str | Path) -> Path:
    """The file a built-in prompt-set name (:data:`PROMPT_SETS`) or a path stands for; a name
    wins over a file of the same name in the working directory. Neither → one line that lists
    the names (a typo'd name and a wrong path look alike); an empty name or a folder is refused
    by name (``Path('')`` is the working directory)."""
    sets = f"the built-in sets are {', '.join(PROMPT_SETS)} (e.g. --prompts mt-bench spec-bench@8)"
    if not str(name_or_path).strip():
        raise PromptFileError(f"--prompts {str(name_or_path)!r} names no file: pass a JSON-lines prompt file; {sets}.")
    if str(name_or_path) in PROMPT_SETS:
        return DATA_DIR / PROMPT_SETS[str(name_or_path)]
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise PromptFileError(f"{str(name_or_path)!r} is neither a prompt file nor a built-in prompt set; {sets}, or "
                              "pass a JSON-lines file.")
    if path.is_dir():
        raise PromptFileError(f"{name_or_path} is a folder: pass a JSON-lines prompt file (one JSON object per line); "
                              f"{sets}.")
    return path


def read_prompt_file(path: str | Path) -> list[dict]:
    """All records of one file (or built-in prompt set) as {"id", "category", "prompt",
    "later_turns"}, in file order, every field checked now (:func:`prompt_record`) so a bad file
    fails before any work; every problem is one :class:`PromptFileError` naming the file, the
    line and the fix. A UTF-8 byte-order mark is allowed."""
    source = prompt_file(path)
    try:
        data = source.read_bytes()
    except OSError as err:
        raise PromptFileError(f"cannot read the prompt file {path}: {err.strerror}.") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise PromptFileError(f"{path}:{line} is not UTF-8 text (a binary file?): a prompt file is JSON lines, "
                              "one object with 'turns' or 'prompt' per line.") from None
    prompts = [prompt_record(line, f"{path}:{line_no}", line_no)
               for line_no, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not prompts:
        raise PromptFileError(f"{path} holds no prompts; write one JSON object per line with 'turns' or 'prompt'.")
    return prompts


def cost_surfaces() -> list[Path]:
    """The measured GPU cost surfaces shipped with the package (``draftheads/data/cost_surfaces``)."""
    return sorted((DATA_DIR / "cost_surfaces").glob("cost_*.json"))


def prompt_record(line: str, where: str, line_no: int) -> dict:
    """One prompt-file line → {id, category, prompt, later_turns}, or a one-line error naming
    ``where``: every field the benches read is checked here, so a list-valued ``category`` or a
    non-text turn fails before any work, not in the summary after the whole run."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise PromptFileError(f"{where} is not valid JSON ({err.msg} at column {err.colno}).") from None
    if not isinstance(record, dict):
        raise PromptFileError(f"{where} is a JSON {type(record).__name__}, expected an object with 'turns' or 'prompt'.")
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise PromptFileError(f"{where} has 'turns' {turns!r}; it must be a non-empty list of strings.")
        bad = next((t for t in turns if not isinstance(t, str) or not t.strip()), None)
        if bad is not None:
            raise PromptFileError(f"{where} has the turn {bad!r} in 'turns'; every turn must be a non-empty string.")
        text = turns[0]
    elif "prompt" in record:
        text = record["prompt"]
    else:
        raise PromptFileError(f"{where} has neither 'turns' nor 'prompt'.")
    if not isinstance(text, str) or not text.strip():
        raise PromptFileError(f"{where}: the prompt {text!r} must be a non-empty string.")
    for key in ("category", "source"):
        if key in record and not isinstance(record[key], str):
            raise PromptFileError(f"{where} has {key} {record[key]!r}; it must be a string (one name per prompt), "
                                  f"or left out.")
    for key in ("question_id", "id"):
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int))):
            raise PromptFileError(f"{where} has {key} {value!r}; it must be a string or a whole number, or left out.")
    return {"id": record.get("question_id", record.get("id", line_no)),
            "category": record.get("category", record.get("source", "")), "prompt": text,
            "later_turns": record.get("turns", [])[1:]}


def first_per_category(records: list[dict], per_category: int) -> list[dict]:
    """The first ``per_category`` records of each category, in file order."""
    counts: dict[str, int] = {}
    chosen = []
    for item in records:
        if counts.get(item["category"], 0) < per_category:
            counts[item["category"]] = counts.get(item["category"], 0) + 1
            chosen.append(item)
    return chosen


def round_robin(records: list[dict]) -> list[dict]:
    """Records reordered one per category in turn (categories in order of first appearance,
    each in its own order): the batched bench's batches then mix tasks as a server's do,
    instead of taking the first task's prompts only."""
    groups: dict[str, list[dict]] = {}
    for item in records:
        groups.setdefault(item["category"], []).append(item)
    order = []
    for i in range(max((len(g) for g in groups.values()), default=0)):
        order += [g[i] for g in groups.values() if i < len(g)]
    return order


def read_prompts(paths: str | Sequence[str], limit: int | None = None) -> list[dict]:
    """Prompts from one or more files (see the module docstring for ``@N`` and de-duplication),
    then the first ``limit`` of them (None: all)."""
    if limit is not None and limit < 1:
        raise PromptFileError(f"--limit must be ≥ 1, got {limit}.")
    seen: set[str] = set()
    prompts: list[dict] = []
    for spec in [paths] if isinstance(paths, str) else list(paths):
        path, cap, categories = split_spec(spec)
        records = read_prompt_file(path)
        if categories:
            records = [r for r in records if r["category"] in categories or group_of(r["category"]) in categories]
            if not records:
                raise PromptFileError(f"{path} has no prompt of categories {categories}.")
        if cap is not None:
            records = first_per_category([r for r in records if r["prompt"] not in seen], cap)
        for record in records:
            if record["prompt"] not in seen:
                seen.add(record["prompt"])
                prompts.append(record)
    if not prompts:
        raise PromptFileError(f"No prompts in {', '.join(map(str, [paths] if isinstance(paths, str) else paths))}.")
    return prompts[:limit] if limit else prompts


def clean_eval_text() -> str:
    """The clean evaluation set's file (:data:`CLEAN_EVAL_PROMPTS`): the records of the built-in
    spec-bench file whose prompt no bench decodes, in file order, each unchanged but for an added
    ``source``, its Spec-Bench task (:func:`group_of`), which an evaluation job groups its scores by."""
    # each set read on its own, as the benches read it (read together, a later @N skips the earlier ones' prompts)
    decoded = {r["prompt"] for spec in (DEV_PROMPTS, BATCH_PROMPTS) for r in read_prompts(spec)}
    lines = [line for line in prompt_file("spec-bench").read_text(encoding="utf-8").split("\n") if line.strip()]
    kept = [json.dumps({**json.loads(line), "source": group_of(record["category"])}, ensure_ascii=False)
            for line, record in zip(lines, read_prompt_file("spec-bench")) if record["prompt"] not in decoded]
    return "".join(line + "\n" for line in kept)
