"""Prompts written by the base itself (Magpie: Xu et al., arXiv 2406.08464): an instruct model
given its chat template up to where the user's text begins writes a user's request, by sampling.
The self-distillation job then answers them. This widens the training mixture towards what users
ask an instruct model (writing, advice, science, explanations), which the shared sources (math,
code, role-play, T0 tasks) leave out, with no outside text and under the base's own licence.

    python -m draftheads.training.data.self_prompts --out DIR/self_prompts.jsonl --count 1472

The file is rewritten whole after every batch and a rerun continues after its last batch; batch
``k`` is sampled from seed ``(seed, k)``, so a stopped and resumed run writes the same file.
Requests that are cut (no end of turn within ``max_new_tokens``), repeated, or share a 13-word span
with an evaluation prompt (MT-Bench, Spec-Bench dev: the committed files) are dropped.
"""
from __future__ import annotations

from importlib import resources
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...decoding.base.loading import load_base
from ...decoding.generate import DraftHeadsModel
from ...decoding.request import eos_token_ids
from ...core.atomic import write_text_atomic
from .config_cli import parse_config, run_cli
from .records import DataError

EVAL_FILES = [str(resources.files("draftheads") / "data" / name) for name in ("mt_bench.jsonl", "spec_bench_dev.jsonl")]
SPAN = 13  # words: a request sharing this many consecutive words with an evaluation prompt is dropped
SOURCE = "self-open"


@dataclass
class SelfPromptsConfig:
    out: str = ""
    count: int = 1000  # requests kept
    batch_size: int = 32
    max_new_tokens: int = 160  # a request not ended by then is cut, and dropped
    temperature: float = 1.0  # Magpie samples at 1.0 with no top-p: the base's own distribution
    min_words: int = 4
    seed: int = 0
    base: str | None = None
    dtype: str = "bfloat16"
    heads: str = "checkpoints/smollm2-135m-hydra"  # drafts for draftheads' sampling (lossless: the base's distribution)
    exclude: list[str] = field(default_factory=lambda: list(EVAL_FILES))  # evaluation prompt files


def user_prefix_ids(tokenizer) -> list[int]:
    """The chat template's ids up to where the user's text begins (its system turn included)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("self_prompts needs an instruct base with a chat template; this tokenizer has none: "
                        "give --base an instruct model.")
    marker = "\x00USER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=False)
    return list(tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"])


def normalized_words(text: str) -> list[str]:
    return "".join(c if c.isalnum() else " " for c in text.lower()).split()


def spans(text: str, n: int = SPAN) -> set[tuple[str, ...]]:
    """Every run of ``n`` consecutive normalized words (the whole text when it is shorter)."""
    words = normalized_words(text)
    return {tuple(words[i:i + n]) for i in range(max(1, len(words) - n + 1))} if words else set()


def eval_spans(paths: list[str]) -> set[tuple[str, ...]]:
    """The 13-word spans of every turn of the evaluation prompt files (records with ``turns``)."""
    found: set[tuple[str, ...]] = set()
    for path in paths:
        if not Path(path).is_file():
            raise DataError(f"{path}: no such evaluation prompt file; give --exclude the files to keep out.")
        for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            try:
                record = json.loads(line) if line.strip() else {}
            except json.JSONDecodeError:
                raise DataError(f"{path}:{line_no} is not JSON; restore the file.") from None
            for turn in record.get("turns", []) + ([record["prompt"]] if "prompt" in record else []):
                found |= spans(turn)
    return found


def cut_at_end(row: list[int], ends: set[int]) -> list[int] | None:
    """A sampled row's ids up to its end of turn, or None when it never ended (cut)."""
    for i, token in enumerate(row):
        if token in ends:
            return row[:i]
    return None


def sample_batch(decoder, prefix: list[int], config: SelfPromptsConfig, batch: int) -> list[list[int] | None]:
    """``batch_size`` requests sampled from the same prefix by draftheads' batched decoder (each row
    its own tree and end), seeded by (seed, batch)."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + batch)
    ids = torch.tensor([prefix] * config.batch_size)  # (B, P)
    ends = eos_token_ids(decoder.base.generation_config)
    out = decoder.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=config.temperature,
                           top_p=1.0, top_k=0, max_new_tokens=config.max_new_tokens, generator=generator,
                           pad_token_id=ends[0] if ends else 0)  # (B, P + new)
    return [cut_at_end(row, set(ends)) for row in out[:, len(prefix):].tolist()]


def keep(text: str, seen: set[str], banned: set[tuple[str, ...]], min_words: int) -> bool:
    """A request worth answering: long enough, not seen before, not overlapping an evaluation prompt."""
    words = normalized_words(text)
    key = " ".join(words)
    if len(words) < min_words or key in seen or spans(text) & banned:
        return False
    seen.add(key)
    return True


def sampling_settings(config: SelfPromptsConfig) -> dict:
    """What fixes the file's batches: a resume with other settings would mix two samplings."""
    return {k: getattr(config, k) for k in ("seed", "batch_size", "max_new_tokens", "temperature", "min_words",
                                            "base", "dtype")}


def read_done(out: Path, settings: dict) -> tuple[list[dict], int]:
    """The records a stopped run wrote and the next batch to sample; an unreadable file starts
    over, one sampled with other settings is refused."""
    if not out.is_file():
        return [], 0
    try:
        state = json.loads(out.with_suffix(".progress.json").read_text(encoding="utf-8"))
        records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines() if line.strip()]
        if len(records) != state["records"]:
            raise ValueError("count")
        done = records, int(state["next_batch"])
        saved = state["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        print(f"{out}: unreadable or out of step with its progress file; sampling it again", file=sys.stderr)
        return [], 0
    if saved != settings:
        changed = ", ".join(f"{k} {saved.get(k)!r} → {v!r}" for k, v in settings.items() if saved.get(k) != v)
        raise DataError(f"{out} was sampled with other settings ({changed}); use another --out, or delete it to start over.")
    return done


def run(config: SelfPromptsConfig) -> int:
    out = Path(config.out)
    settings = sampling_settings(config)
    records, batch = read_done(out, settings)
    if len(records) >= config.count:
        print(f"{out}: {len(records)} requests already")
        return 0
    base, tokenizer = load_base(config.base, dtype=config.dtype)
    prefix = user_prefix_ids(tokenizer)
    banned = eval_spans(config.exclude)
    seen = {" ".join(normalized_words(r["prompt"])) for r in records}
    while len(records) < config.count:
        # a fresh decoder a batch: lookup drafts learn from earlier outputs, and other drafts draw other
        # (equally lossless) samples, so a resumed run would not repeat the stopped one's batches
        decoder = DraftHeadsModel.from_pretrained(config.heads, base=base, tokenizer=tokenizer, tree="adaptive")
        rows = sample_batch(decoder, prefix, config, batch)
        for row in rows:
            text = tokenizer.decode(row, skip_special_tokens=True).strip() if row is not None else ""
            if row is not None and len(records) < config.count and keep(text, seen, banned, config.min_words):
                records.append({"id": f"{SOURCE}:{config.seed}:{batch}:{len(records)}", "source": SOURCE,
                                "prompt": text})
        batch += 1
        write_text_atomic(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        write_text_atomic(out.with_suffix(".progress.json"), json.dumps({"records": len(records), "next_batch": batch,
                                                                       "settings": settings}))
        print(f"batch {batch}: {len(records)} of {config.count} requests", flush=True)
    return 0


def parse_args(argv: list[str] | None = None) -> SelfPromptsConfig:
    return parse_config(SelfPromptsConfig, argv, "python -m draftheads.training.data.self_prompts", __doc__, required=("out",))


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, parse_args(argv), (DataError,))


if __name__ == "__main__":
    raise SystemExit(main())
