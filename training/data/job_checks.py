"""The self-distillation job's checks, made before any work and any write: its options, the
folder it writes (absent, empty, or one the job stamped with its ``plan.json``), the shard
folders it would replace, and a committed folder of token ids (``--from-tokens``). Each refusal
is one :class:`~draftheads.training.data.records.DataError` line naming the option or file and
the fix; nothing is written before it."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .distill_shards import ARRAYS, MANIFEST, Shard, ShardError, is_shard_folder
from ...core.errors import one_line
from .records import DataError, resolve_data_path

PLAN = "plan.json"
INDEX = "index.json"
#: what a shard folder holds when the job wrote it: only such files are ever removed with it
SHARD_FILES = {MANIFEST, "hidden.npy", "layers.npy", "predicted.npy", *(f"{name}.npy" for name in ARRAYS)}
#: the integer options and their least value
AT_LEAST = {"shard_size": 1, "batch_size": 1, "max_new_tokens": 1, "forward_tokens": 1, "shards": 0,
            "start_at": 0, "seconds": 0}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_options(config) -> None:
    """Every option the job reads, before the base loads or a file is written."""
    from ...decoding.base.dtypes import parse_dtype
    from ...decoding.base.loading import check_base_path

    for name, least in AT_LEAST.items():
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise DataError(f"{flag(name)} {value!r}: it must be an integer ≥ {least}; pass e.g. "
                            f"{flag(name)} {max(least, 1)}.")
    try:
        parse_dtype(config.dtype, "--dtype")
        torch.device(config.device)
    except RuntimeError:
        raise DataError(f"--device {config.device!r} is not a device; pass cpu or cuda (cuda:0, ...).") from None
    if torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
        raise DataError(f"--device {config.device}: this machine has no CUDA GPU torch can use; pass --device cpu.")
    for name in ("prompts", "answers"):
        for path in getattr(config, name):
            if not resolve_data_path(path).is_file():
                raise DataError(f"{flag(name)} {path}: no such file; pass an existing JSONL file.")
    if config.layers and not config.from_tokens:
        raise DataError(f"--layers {' '.join(map(str, config.layers))}: the states of base layers are kept only by a "
                        "rebuild from token ids (the decoder keeps the final state only): answer the prompts, --export "
                        "their ids, then run --from-tokens DIR --out OUT --layers ...")
    if getattr(config, "predicted", False) and not config.from_tokens:
        raise DataError("--predicted rebuilds the shards that lack the base's predictions (predicted.npy), which a "
                        "rebuild from token ids adds: run --from-tokens DIR --out OUT --predicted (a job the decoder "
                        "answers keeps them in every new shard without it).")
    if config.from_tokens and not (Path(config.from_tokens) / "index.json").is_file():
        raise DataError(f"--from-tokens {config.from_tokens}: it holds no index.json; pass the folder the job's "
                        "--export wrote (e.g. recipes/data/selfdistill-smollm2).")
    check_base_path(config.base)
    if config.layers:  # the base's depth from its config, before it loads
        from ..frozen import base_depth

        job_layers(config.layers, base_depth(config.base or "embedded"))


def job_layers(values: list, depth: int | None) -> list[int]:
    """``--layers`` (layer numbers, or ``default``) for a base of ``depth`` decoder layers (None: not
    known yet, the form only), by :func:`draftheads.heads.fusion.resolve_feature_layers`; anything
    else is one line naming the option, before a file is written."""
    from ...heads.fusion import resolve_feature_layers

    shown = " ".join(map(str, values))
    try:
        layers = values if list(values) == ["default"] else [int(v) for v in values]
        return resolve_feature_layers(layers, depth)
    except ValueError as err:  # int() of a word, or the resolver's words
        words = str(err) if str(err).startswith("feature_layers") else "pass layer numbers (e.g. --layers 8 22) or --layers default"
        raise DataError(f"--layers {shown}: {words}.") from None


def job_folder(out: Path) -> bool:
    """Whether ``out`` is a job's folder: its ``plan.json`` is one the job wrote (a plan key)."""
    try:
        plan = json.loads((out / PLAN).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(plan, dict) and isinstance(plan.get("plan_key"), str)


def check_out(out: Path) -> None:
    """``--out`` is absent, empty or the job's own, and every ``shards/shard-*`` folder in it is a
    shard the job wrote: anything else is someone's files, refused and left as they are."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; pass a new or empty folder.")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not job_folder(out):
        names = sorted(p.name for p in out.iterdir())
        raise DataError(f"--out {out} already exists and holds files the self-distillation job did not write "
                        f"({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}); it is left as it is: pass a "
                        "new or empty folder.")
    for folder in sorted((out / "shards").glob("shard-[0-9]*")):
        if not is_shard_folder(folder):
            raise DataError(f"{folder} is not a shard the job wrote (no shard manifest.json); it is left as it is: "
                            f"move it out of {out / 'shards'} and run again.")


def check_discardable(folder: Path, problem: str) -> None:
    """A bad shard is removed only when it holds nothing but the job's files."""
    foreign = sorted(p.name for p in folder.iterdir() if p.name not in SHARD_FILES)
    if foreign:
        raise DataError(f"{folder}: {problem}, and it holds files the job did not write ({', '.join(foreign[:3])}); "
                        "it is left as it is: move those files out and run again.")


def check_export(out: Path, target: Path) -> None:
    """``--export`` reads a job's folder and writes into one that is absent, empty or a committed
    folder (its ``index.json``), never over a shard file its index does not list."""
    if not job_folder(out):
        raise DataError(f"--out {out} holds no self-distillation job (no plan.json); pass the --out of a job that "
                        "ran, to export its shards.")
    if target.exists() and not target.is_dir():
        raise DataError(f"--export {target} is a file; pass a folder.")
    if not target.is_dir() or (target / "index.json").is_file():
        return
    foreign = sorted(p.name for p in target.glob("shard-*.npz"))
    if foreign:
        raise DataError(f"--export {target} holds shard files without an index.json ({', '.join(foreign[:3])}); "
                        "they are left as they are: pass a new or empty folder, or a folder an export wrote.")


def check_entries(source: Path, index: dict) -> list[dict]:
    """The committed index's entries: each ``{"shard": int ≥ 0, "ids": [str, ...]}``, no shard twice."""
    path, seen = source / "index.json", set()
    for k, entry in enumerate(index["shards"]):
        shard = entry.get("shard") if isinstance(entry, dict) else None
        ids = entry.get("ids") if isinstance(entry, dict) else None
        if not isinstance(shard, int) or isinstance(shard, bool) or shard < 0 or shard in seen:
            raise ShardError(f"{path}: entry {k} has shard {shard!r}, not a new integer ≥ 0; restore it from git "
                             f"(`git checkout -- {path}`).")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ShardError(f"{path}: entry {k} (shard {shard}) has no 'ids' list of prompt ids; restore it from git "
                             f"(`git checkout -- {path}`).")
        seen.add(shard)
    return index["shards"]


def check_vocabulary(shards: dict[int, tuple[Path, Shard]], vocab: int) -> None:
    """Every committed token id is one of the base's ``vocab`` ids."""
    for path, shard in shards.values():
        if len(shard.tokens) and int(shard.tokens.max()) >= vocab:
            raise ShardError(f"{path} holds token id {int(shard.tokens.max())}, past this base's vocabulary of "
                             f"{vocab}; pass the --base these ids were made with.")


def read_index(folder: Path) -> dict:
    """A committed folder's ``index.json`` ({plan, shards}); unreadable or malformed: one line naming it."""
    path = folder / INDEX
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(index["plan"]["plan_key"], str) or not isinstance(index["shards"], list):
            raise ValueError("plan.plan_key or shards of the wrong type")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ShardError(f"{path} cannot be read ({one_line(err)}); restore it from git "
                         f"(`git checkout -- {path}`).") from None
    return index
