"""Build the model-generated lookup store from the base's own answers.

    python scripts/build_store.py --data ../shared/data/selfdistill_smollm2.jsonl \\
        --out checkpoints/smollm2-135m-hydra/lookup_store.safetensors [--holdout-last 300]

Reads ``response_ids`` of every record (the last ``--holdout-last`` records are left out, so
they can measure hit rates on answers the store never saw), packs the n-gram keys, positions
and the bigram table (``decoding/drafters/store.py``) and writes one safetensors file whose
header names the tokenizer (vocab size + hash, from the embedded base's tokenizer unless
``--tokenizer`` points elsewhere), n, the build date and the source. Prints build time and size.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import sys
import time
from pathlib import Path

from draftheads.decoding.base.loading import load_tokenizer
from draftheads.decoding.drafters.store import (StoreHeader, FORMAT_VERSION, build_arrays, key_bits, save_store,
                                                tokenizer_identity)
from draftheads.training.features import read_jsonl


def read_records(path: Path, holdout_last: int, max_records: int | None) -> tuple[list[dict], list[dict]]:
    """(store records, held-out records), in file order."""
    records = list(read_jsonl(path))
    cut = len(records) - holdout_last if holdout_last else len(records)
    kept = records[:cut][:max_records] if max_records else records[:cut]
    return kept, records[cut:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="JSONL with response_ids (the base's own answers)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer", default=None, help="base path / Hub id (default: the embedded SmolLM2)")
    parser.add_argument("--holdout-last", type=int, default=0, help="leave the last N records out")
    parser.add_argument("--max-records", type=int, default=None)
    args = parser.parse_args(argv)

    data = Path(args.data)
    tokenizer = load_tokenizer(args.tokenizer)
    identity = tokenizer_identity(tokenizer)
    kept, held = read_records(data, args.holdout_last, args.max_records)
    start = time.perf_counter()
    arrays = build_arrays([r["response_ids"] for r in kept], identity.vocab_size)
    digest = hashlib.sha256(data.read_bytes()).hexdigest()[:16]
    source = f"{data.name} sha256:{digest} records 0..{len(kept) - 1} (held out: last {len(held)})"
    bits = key_bits(identity.vocab_size)
    header = StoreHeader(FORMAT_VERSION, identity.vocab_size, identity.vocab_sha256, 64 // bits, bits,
                         dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), source, len(kept),
                         int(sum(len(r["response_ids"]) for r in kept)))
    out = save_store(args.out, arrays, header)
    seconds = time.perf_counter() - start
    print(json.dumps({"out": str(out), "records": len(kept), "tokens": header.tokens, "n": header.n,
                      "build_seconds": round(seconds, 3), "bytes": out.stat().st_size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
