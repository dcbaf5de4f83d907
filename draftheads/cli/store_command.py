"""``draftheads store build``: the model-generated lookup store from the base's own answers.

    draftheads store build --data <the base's answers.jsonl> \\
        --out checkpoints/smollm2-135m-hydra/lookup_store.safetensors [--holdout-last 300]

Reads ``response_ids`` of every record of ``--data`` (a JSON-lines file, a ``draftheads
selfdistill`` output folder or any data ``draftheads train`` reads; the last ``--holdout-last``
records are left out, so they can measure hit rates on answers the store never saw), packs the
n-gram keys, positions and the bigram table (:mod:`draftheads.decoding.drafters.store`) and writes
one safetensors file whose header names the tokenizer (vocab size + hash, from the embedded base's
tokenizer unless ``--tokenizer`` points elsewhere), n, the build date and the source. Prints the
build time and size as JSON. Saved as ``lookup_store.safetensors`` beside the heads, the store is
drafted from by default."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..decoding.drafters import STORE_NAME
from ..decoding.drafters.store import (FORMAT, FORMAT_VERSION, StoreHeader, build_arrays, key_bits,
                                       save_store, tokenizer_identity)
from ..core.errors import InputError
from .parsing import count_argument


@dataclass(frozen=True)
class StoreBuild:
    """What ``store build`` was asked: the answers, the file to write and the tokenizer that wrote them."""
    data: str
    out: Path
    tokenizer: str | None = None  # base path / Hub id / .gguf; None: the embedded SmolLM2
    holdout_last: int = 0  # leave the last N records out
    max_records: int | None = None  # keep at most N records (before the held-out ones)


def store_format(path: Path) -> str | None:
    """The ``format`` a safetensors file's header names, or None where the file has no readable
    safetensors header (a text file, a truncated download)."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > min(path.stat().st_size - 8, 100_000_000):
                return None
            meta = json.loads(handle.read(length)).get("__metadata__")
    except (struct.error, ValueError, AttributeError):  # short, not JSON, JSON but no object
        return None
    return meta.get("format") if isinstance(meta, dict) else None


def check_out(out: Path) -> None:
    """``--out`` is a new file or a lookup store (rebuilt in place); never a folder or someone else's file."""
    if out.is_dir():
        raise InputError(f"--out {out} is a folder: pass the store file to write, e.g. --out {out / STORE_NAME}.")
    if out.exists() and store_format(out) != FORMAT:
        raise InputError(f"--out {out} exists and is not a draftheads lookup store: pass a new path (a store file is "
                         "rebuilt in place; a damaged one, delete it first).")


def read_answers(data: str) -> list[list[int]]:
    """Every record's ``response_ids``, in order, from whatever ``draftheads train`` reads
    (:func:`draftheads.training.data.records.load_records`: a file, a folder, a cached Hub dataset)."""
    from ..training.data.records import DataError, is_hub_id, load_records, resolve_data_path
    from ..training.train import quiet_library_bars

    if not resolve_data_path(data).exists() and not is_hub_id(data):
        raise InputError(f"--data {data} does not exist: pass the base's own answers (JSON lines with response_ids, "
                         "or the folder `draftheads selfdistill --out` wrote).")
    quiet_library_bars()
    dataset = load_records(data)
    if "response_ids" not in dataset.column_names:
        raise DataError(f"{data} has no column 'response_ids' (it has {dataset.column_names}): pass the base's own "
                        "answers as token ids, e.g. what `draftheads selfdistill` writes.")
    answers = []
    for number, ids in enumerate(dataset["response_ids"], 1):
        try:
            answers.append([int(t) for t in ids])
        except (TypeError, ValueError):
            raise DataError(f"{data} record {number}: response_ids must be a list of token ids, got {ids!r:.60}.") \
                from None
    return answers


def split_records(answers: list, holdout_last: int, max_records: int | None) -> tuple[list, list]:
    """(store records, held-out records), in file order; refuses a split that keeps nothing."""
    if holdout_last >= len(answers):
        raise InputError(f"--holdout-last {holdout_last} leaves none of the {len(answers)} records for the store: "
                         f"pass a number below {len(answers)}.")
    cut = len(answers) - holdout_last
    return answers[:cut][:max_records], answers[cut:]


def check_ids(answers: list[list[int]], vocab_size: int, data: str) -> None:
    """Every token id in the tokenizer's vocabulary: else the answers are another base's."""
    ids = [t for r in answers for t in (min(r), max(r)) if r]
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InputError(f"{data} holds token id {bad}, outside this tokenizer's vocabulary [0, {vocab_size}): "
                         "pass --tokenizer <the base that wrote the answers>.")


def data_digest(data: str, answers: list[list[int]]) -> str:
    """The source's fingerprint for the header: a file's bytes, else the answers themselves."""
    from ..training.data.records import resolve_data_path

    path = resolve_data_path(data)
    blob = path.read_bytes() if path.is_file() else json.dumps(answers).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def store_header(vocab, kept: list[list[int]], held: int, source: str) -> StoreHeader:
    """The header of a store of ``kept`` for the tokenizer ``vocab`` (:class:`TokenizerIdentity`)."""
    bits = key_bits(vocab.vocab_size)
    return StoreHeader(FORMAT_VERSION, vocab.vocab_size, vocab.vocab_sha256, 64 // bits, bits,
                       dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                       f"{source} records 0..{len(kept) - 1} (held out: last {held})", len(kept),
                       int(sum(len(r) for r in kept)))


def build_store(job: StoreBuild) -> dict:
    """Check ``--out``, read the answers, check them against the tokenizer, write the store;
    returns what was written (path, records, tokens, n, seconds, bytes)."""
    from ..decoding.base.loading import load_tokenizer

    check_out(job.out)
    answers = read_answers(job.data)
    kept, held = split_records(answers, job.holdout_last, job.max_records)
    vocab = tokenizer_identity(load_tokenizer(job.tokenizer))
    check_ids(kept, vocab.vocab_size, job.data)
    start = time.perf_counter()
    arrays = build_arrays(kept, vocab.vocab_size)
    header = store_header(vocab, kept, len(held), f"{Path(job.data).name} sha256:{data_digest(job.data, answers)}")
    job.out.parent.mkdir(parents=True, exist_ok=True)
    out = save_store(job.out, arrays, header)
    return {"out": str(out), "records": len(kept), "tokens": header.tokens, "n": header.n,
            "build_seconds": round(time.perf_counter() - start, 3), "bytes": out.stat().st_size}


def cmd_store_build(args) -> int:
    report = build_store(StoreBuild(args.data, Path(args.out), args.tokenizer, args.holdout_last, args.max_records))
    print(json.dumps(report))
    print(f"wrote {report['out']}: as {STORE_NAME} beside the heads it is drafted from by default "
          "(elsewhere: lookup_store=<file> in Python)", file=sys.stderr)
    return 0


def add_command(sub) -> None:
    """Register ``store build`` on the ``draftheads`` parser."""
    store = sub.add_parser("store", help="the lookup store the 'store' and 'stats' sources draft from")
    actions = store.add_subparsers(dest="action", metavar="{build}", required=True)
    build = actions.add_parser("build", help="build a store from the base's own answers (JSON lines with response_ids)",
                               description="Build the lookup store the 'store' and 'stats' sources draft from, "
                                           "out of the base's own answers.")
    build.add_argument("--data", required=True, help="the base's own answers: JSON lines with response_ids, a "
                                                     "`draftheads selfdistill` output folder, or any data train reads")
    build.add_argument("--out", required=True, help=f"the store file to write, e.g. <heads dir>/{STORE_NAME}")
    build.add_argument("--tokenizer", default=None, help="the base that wrote the answers: path / Hub id / .gguf "
                                                         "(default: the embedded SmolLM2)")
    build.add_argument("--holdout-last", type=count_argument(0), default=0, help="leave the last N records out")
    build.add_argument("--max-records", type=count_argument(1), default=None, help="keep at most the first N records")
    build.set_defaults(func=cmd_store_build)
