"""Choose each checkpoint's default tree per dtype with the cost model, and record it in the
checkpoint (``default_budget_by_dtype`` in its config): for every dtype, a short batch-size-1
calibration of this machine's step cost (the base forward over each stored tree size, the
loop's overhead and the heads' drafting) times the heads' expected τ per budget, with the
drafted part of τ scaled by ``--tau-scale``, then the budget with the highest expected
tokens/s at ``--context`` tokens.

Why a τ scale: a checkpoint's expected τ measured on held-out self-distilled text is
in-distribution, so decoding counts on 0.75 of its drafted part; one measured on the base's
answers to evaluation prompts (``expected_tau_on: dev``) is used as it is. Without ``--tau-scale``
the checkpoint's own (:func:`~draftheads.decoding.policy.expected_tau_scale`), as decoding uses.

    python scripts/default_trees.py checkpoints/smollm2-135m-hydra --dtypes bfloat16,float32
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.base.loading import dtype_name
from draftheads.decoding.base.dtypes import parse_dtype
from draftheads.decoding.calibration import CalibrationConfig, calibrate
from draftheads.decoding.policy import best_budget, expected_tau_scale

#: batch size 1 at the context the default is chosen for, best of 30 runs per point: a bs-1 forward
#: is short, so one slow spell of a shared machine must not decide the default
BATCH_ONE = CalibrationConfig(batch_sizes=(1,), contexts=(256,), reps=30)


def choose(checkpoint: str, dtype: torch.dtype, context: int, tau_scale: float | None, refresh: bool) -> dict:
    model = DraftHeadsModel.from_pretrained(checkpoint, dtype=dtype, tree=0)
    tau_scale = expected_tau_scale(model.heads) if tau_scale is None else tau_scale
    cost = calibrate(model.base, model.heads, BATCH_ONE, refresh=refresh)
    ranked = best_budget(model.heads, cost, 1, context, tau_scale)
    return {"budget": ranked[0].budget, "context": context, "tau_scale": tau_scale,
            "ranked": [{"budget": c.budget, "nodes": c.nodes, "tau": round(c.tau, 3), "step_ms": round(c.step_ms, 2),
                        "tokens_per_second": round(c.tokens_per_second, 2)} for c in ranked],
            "calibration": cost.meta.get("key", {}).get("device", "")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--context", type=int, default=256, help="context length the default is chosen for")
    parser.add_argument("--tau-scale", type=float, default=None,
                        help="the drafted part of the expected τ counted on (default: the checkpoint's, by what it "
                             "was measured on)")
    parser.add_argument("--refresh", action="store_true", help="measure again even if a calibration is cached")
    parser.add_argument("--dry-run", action="store_true", help="print the choice, do not write the checkpoint")
    args = parser.parse_args(argv)
    for checkpoint in args.checkpoints:
        config_path = Path(checkpoint) / "config.json"
        config = json.loads(config_path.read_text())
        chosen = dict(config.get("default_budget_by_dtype") or config.get("extra", {}).get("default_budget_by_dtype") or {})
        for name in args.dtypes.split(","):
            dtype = parse_dtype(name)
            result = choose(checkpoint, dtype, args.context, args.tau_scale, args.refresh)
            chosen[dtype_name(dtype)] = result
            print(f"{checkpoint} {dtype_name(dtype)}: budget {result['budget']}  " + "  ".join(
                f"{c['budget']}:{c['tokens_per_second']:.1f}" for c in result["ranked"]), flush=True)
        if not args.dry_run:
            config.get("extra", {}).pop("default_budget_by_dtype", None)
            config["default_budget_by_dtype"] = chosen
            config_path.write_text(json.dumps(config, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
