"""The self-distillation job's prompts: read from prompt, conversation and benchmark files, merged
into one plan in proportion (:func:`interleave`), with answers already given reused
(:func:`attach_answers`). The job (:mod:`.distill_job`) answers the rest."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .records import DataError, resolve_data_path
from ..features import read_jsonl


@dataclass
class Prompt:
    id: str
    source: str
    text: str
    answer: list[int] | None = None  # given answer ids (reused), or None: the decoder answers


def normalized(text: str) -> str:
    return " ".join(text.lower().split())


def read_prompts(path: str) -> list[Prompt]:
    """A prompt file's prompts: ``prompt`` records, conversations (``messages``: the first
    user turn; the later turns follow answers the base did not write), or benchmark questions
    (``turns``: MT-Bench / Spec-Bench, the first turn). The source is the record's ``source``,
    else the file's stem (``mt_bench``, ``spec_bench_dev``)."""
    prompts = []
    for record in read_jsonl(resolve_data_path(path)):
        if "prompt" in record:
            text = record["prompt"]
        elif isinstance(record.get("turns"), list) and record["turns"]:
            text = record["turns"][0]
        else:
            text = next((m["content"] for m in record.get("messages", []) if m.get("role") == "user"), None)
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{path}: record {record.get('id')!r} has no 'prompt', no user turn in 'messages' and no "
                            "'turns'.")
        prompts.append(Prompt(str(record.get("id", record.get("question_id", len(prompts)))), str(record.get("source", Path(path).stem)), text))
    return prompts


def interleave(sources: list[list[Prompt]]) -> list[Prompt]:
    """One list from several, a text asked twice kept once (its first source's), ordered by each
    prompt's relative position in its source: every prefix holds each source in proportion."""
    seen: set[str] = set()
    keyed = []
    for s, prompts in enumerate(sources):
        fresh = [p for p in prompts if normalized(p.text) not in seen]
        seen.update(normalized(p.text) for p in fresh)
        keyed += [((i + 0.5) / len(fresh), s, i, p) for i, p in enumerate(fresh)]
    return [p for *_, p in sorted(keyed, key=lambda k: k[:3])]


def attach_answers(prompts: list[Prompt], paths: list[str]) -> int:
    """Reuse the answers of ``paths`` for the prompts with the same id and text; returns how many."""
    by_id = {p.id: p for p in prompts}
    used = 0
    for path in paths:
        for record in read_jsonl(resolve_data_path(path)):
            prompt = by_id.get(str(record.get("id")))
            if prompt is not None and prompt.answer is None and record.get("prompt") == prompt.text \
                    and record.get("response_ids"):
                prompt.answer = [int(t) for t in record["response_ids"]]
                used += 1
    return used
