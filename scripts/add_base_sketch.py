"""Add the dtype-independent ``lm_head_sketch`` to head checkpoints written before it existed,
so they also load on their base in float16 (whose rounding changes the LM-head hash).

    python scripts/add_base_sketch.py checkpoints/smollm2-135m-* [--base <model dir/.gguf>]

The base is loaded in float32 and must match each checkpoint's recorded hash first: the
sketch is only ever added for the base the heads were trained on.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from draftheads.decoding.base.loading import load_base
from draftheads.decoding.base.fingerprint import fingerprint
from draftheads.heads.checkpoint.io import fingerprint_diffs
from draftheads.heads.head_config import CONFIG_NAME


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--base", default=None, help="default: the embedded SmolLM2")
    args = parser.parse_args()
    base, _ = load_base(args.base, dtype=torch.float32)
    identity = fingerprint(base).with_sketch(base)
    for directory in map(Path, args.checkpoints):
        path = directory / CONFIG_NAME
        config = json.loads(path.read_text())
        diffs = fingerprint_diffs(config.get("base_fingerprint") or {}, fingerprint(base).to_dict())
        if diffs:
            raise SystemExit(f"error: {directory} was not trained for this base ({'; '.join(diffs)}).")
        config["base_fingerprint"] = identity
        path.write_text(json.dumps(config, indent=2) + "\n")
        print(f"{directory}: lm_head_sketch added")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
