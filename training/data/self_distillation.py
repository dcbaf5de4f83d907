"""Self-distillation: the base answers a prompt set, greedily by default, in resumable shards,
saved as a 🤗 ``datasets`` dataset with its provenance (what :mod:`.records` reads as ``selfdistill``).

Run ``python -m draftheads.training.data.self_distillation --help`` (or ``scripts/selfdistill.py``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterable

import torch
from tqdm.auto import tqdm

from ...decoding.output import generated_counts
from ...decoding.request import eos_token_ids, left_pad
from ...core.atomic import atomic_directory, saved_dataset
from .records import (HUB_DEFAULTS, PROVENANCE, DataError, load_records, require_columns, resolve_data_path,
                      select_sources)
from ..features import chat_prompt_ids


# -- self-distillation ----------------------------------------------------------------------------
@dataclass
class SelfDistillConfig:
    """How the base answers the prompts; recorded in the output's provenance."""

    prompts: str = ""  # a local prompt file or folder, or a Hub dataset id (no default: a clone carries none)
    name: str | None = None  # Hub prompts: the dataset's configuration (e.g. main for openai/gsm8k)
    split: str = "train"  # Hub prompts: the split to answer
    columns: dict[str, str] = field(default_factory=dict)  # {column in the data: prompt/id/source}, e.g. question→prompt
    out: str = "data_cache/selfdistill"
    skip: int = 0  # start after the first N lines of the prompt file (e.g. those already answered)
    limit: int = 0  # answer at most N prompts (0 = all), counted after the source filters
    sources: list[str] = field(default_factory=list)  # keep only these source prefixes (e.g. gpteacher-roleplay)
    exclude_sources: list[str] = field(default_factory=list)
    max_new_tokens: int = 384
    batch_size: int = 16  # prompts per generate call (left-padded, length-sorted within a shard)
    shard_size: int = 64  # prompts per resumable shard
    do_sample: bool = False  # greedy by default: heads learn exactly what greedy decoding accepts
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0  # sampling seed; shard i uses seed + i, so a resumed shard is reproducible
    base: str | None = None  # base model (default: the embedded SmolLM2)
    dtype: str = "bfloat16"


def select_prompts(dataset, config: SelfDistillConfig):
    """The prompts to answer, in file order: the first ``skip`` lines dropped (``skip`` counts
    file lines, so ``--skip 3072`` always means "after the shared answers" whatever the filters),
    then the source filters (``sources`` keeps prefixes, ``exclude_sources`` drops exact names),
    then at most ``limit`` prompts."""
    dataset = dataset.select(range(min(config.skip, len(dataset)), len(dataset)))
    if config.sources or config.exclude_sources:
        if "source" not in dataset.column_names:
            raise DataError("sources / exclude_sources need a 'source' column in the prompt data.")
        dataset = dataset.select(select_sources(dataset["source"], config.sources))
        excluded = set(config.exclude_sources)
        dataset = dataset.filter(lambda r: r["source"] not in excluded)
    return dataset.select(range(min(config.limit, len(dataset)) if config.limit else len(dataset)))


@torch.no_grad()
def answer_batch(model, tokenizer, prompts: list[str], config: SelfDistillConfig) -> list[list[int]]:
    """Answers (token ids, up to and including EOS) for a batch of chat prompts, left-padded
    so every row's answer starts at the same column."""
    encoded = [chat_prompt_ids(tokenizer, p) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = left_pad(encoded, pad)
    width = ids.shape[1]
    sampling = dict(do_sample=True, temperature=config.temperature, top_p=config.top_p) if config.do_sample \
        else dict(do_sample=False)
    device = next(model.parameters()).device
    out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=config.max_new_tokens,
                         pad_token_id=pad, **sampling)
    counts = generated_counts(out, width, set(eos_token_ids(model.generation_config)))
    return [row[:n] for row, n in zip(out[:, width:].tolist(), counts)]


def _prompt_key(dataset) -> str:
    """Hash of the prompt list (ids when present, else texts): a resumed run must answer the
    same prompts in the same order, or shard i would mean something else."""
    column = "id" if "id" in dataset.column_names else "prompt"
    return hashlib.sha256(json.dumps(list(dataset[column]), ensure_ascii=False).encode()).hexdigest()[:16]


def _check_provenance(path: Path, provenance: dict) -> None:
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(provenance, indent=2) + "\n")
        return
    saved = json.loads(path.read_text())
    diffs = [f"{k}: {saved.get(k)!r} → {v!r}" for k, v in provenance.items() if saved.get(k) != v]
    if diffs:
        raise DataError(f"{path.parent} holds a self-distillation run with other settings ({'; '.join(diffs)}); "
                        "use another output directory, or delete this one to start over.")


def self_distill(model, tokenizer, prompts, config: SelfDistillConfig, base_fingerprint: dict | None = None):
    """Answer ``prompts`` (a ``datasets.Dataset`` with ``prompt``; already selected) shard by
    shard into ``config.out`` and return the merged ``datasets.Dataset``.

    Shard i always holds prompts [i·S, (i+1)·S) and is written to a temporary directory then
    renamed, so a killed run redoes only the shard it was in: no prompt is dropped or answered
    twice. A second run with other settings or prompts is refused (provenance.json)."""
    import datasets

    require_columns(prompts, "prompts", config.prompts)
    out = Path(config.out)
    settings = {k: v for k, v in asdict(config).items()
                if k not in ("out", "batch_size") and not (k in HUB_DEFAULTS and v == HUB_DEFAULTS[k])}
    provenance = {"kind": "selfdistill", "base_fingerprint": base_fingerprint, "prompt_count": len(prompts),
                  "prompt_key": _prompt_key(prompts), **settings}
    _check_provenance(out / PROVENANCE, provenance)
    num_shards = (len(prompts) + config.shard_size - 1) // config.shard_size
    shard_dirs = [out / "shards" / f"shard-{i:05d}" for i in range(num_shards)]
    eos = set(eos_token_ids(model.generation_config))
    for index in tqdm([i for i, d in enumerate(shard_dirs) if not d.is_dir()], desc="self-distillation", unit="shard"):
        chunk = prompts.select(range(index * config.shard_size, min(len(prompts), (index + 1) * config.shard_size)))
        texts = list(chunk["prompt"])
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # less padding per batch
        if config.do_sample:
            torch.manual_seed(config.seed + index)
        answers: dict[int, list[int]] = {}
        for start in range(0, len(order), config.batch_size):
            batch = order[start: start + config.batch_size]
            for i, ids in zip(batch, answer_batch(model, tokenizer, [texts[i] for i in batch], config)):
                answers[i] = ids
        rows = [{"id": chunk[i].get("id"), "source": chunk[i].get("source"), "prompt": texts[i],
                 "response": tokenizer.decode(answers[i], skip_special_tokens=True), "response_ids": answers[i],
                 "finished": bool(answers[i] and answers[i][-1] in eos)} for i in range(len(texts))]
        save_dataset(datasets.Dataset.from_list(rows), shard_dirs[index])
    merged = datasets.concatenate_datasets([datasets.load_from_disk(str(d)) for d in shard_dirs]) if shard_dirs \
        else datasets.Dataset.from_list([])
    merged.info.description = json.dumps(provenance)
    if not (out / "dataset").is_dir():
        save_dataset(merged, out / "dataset")
    return merged


def save_dataset(dataset, target: Path) -> None:
    """``save_to_disk`` written whole (:class:`~draftheads.core.atomic.atomic_directory`): a
    dataset folder that exists is complete, and only a saved dataset is ever replaced."""
    with atomic_directory(target, ours=saved_dataset) as tmp:
        dataset.save_to_disk(str(tmp))


def read_shards(paths: Iterable[Path]) -> list[dict]:
    """Records of legacy ``answers-*.jsonl`` self-distillation shards (kept for old caches;
    :func:`load_records` reads such a directory as a dataset)."""
    records = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            records.extend(json.loads(line) for line in handle if line.strip())
    return records


def parse_selfdistill_args(argv: list[str] | None = None) -> SelfDistillConfig:
    parser = argparse.ArgumentParser(
        prog="python -m draftheads.training.data.self_distillation",
        description="Self-distillation: the base answers a prompt set (resumable shards, saved as a datasets "
                    "dataset with provenance). Re-run the same command to resume.")
    for f in fields(SelfDistillConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name == "exclude_sources":
            parser.add_argument("--exclude-source", dest="exclude_sources", action="append", default=[])
        elif f.name == "sources":
            parser.add_argument("--source", dest="sources", action="append", default=[],
                                help="keep only prompts whose source starts with this (repeatable)")
        elif f.name == "prompts":
            parser.add_argument("--prompts", required=True,
                                help="a local prompt file or folder (records with 'prompt', e.g. the project's "
                                     "train_prompts.jsonl) or a Hub dataset id (with --name, --split, "
                                     "--columns), e.g. --prompts openai/gsm8k --name main --columns question:prompt")
        elif f.name == "columns":
            parser.add_argument("--columns", type=column_map, default={},
                                help="rename columns of the prompt data: FROM:TO[,FROM:TO] (e.g. question:prompt)")
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, default=f.default)
    return SelfDistillConfig(**vars(parser.parse_args(argv)))


def column_map(text: str) -> dict[str, str]:
    """``question:prompt,idx:id`` → {"question": "prompt", "idx": "id"} (argparse ``type=``)."""
    pairs = [item.partition(":") for item in text.split(",") if item.strip()]
    if not pairs or any(not old.strip() or not sep or not new.strip() for old, sep, new in pairs):
        raise argparse.ArgumentTypeError(f"expected FROM:TO[,FROM:TO], got {text!r}")
    return {old.strip(): new.strip() for old, _, new in pairs}


def main(argv: list[str] | None = None) -> int:
    from ...decoding.base.loading import load_base
    from ...decoding.base.fingerprint import fingerprint

    config = parse_selfdistill_args(argv)
    local = resolve_data_path(config.prompts)
    if local.exists():  # provenance records the file itself, wherever the command ran from
        config.prompts = str(local.resolve())
    try:
        prompts = select_prompts(load_records(config.prompts, config.name, config.split, config.columns), config)
        require_columns(prompts, "prompts", config.prompts)  # before the base loads
        model, tokenizer = load_base(config.base, dtype=config.dtype)
        dataset = self_distill(model, tokenizer, prompts, config, fingerprint(model).to_dict())
    except DataError as err:  # one clear line, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(dataset)} answers in {Path(config.out) / 'dataset'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
