"""The A/B scripts' shared bookkeeping (draftheads/bench/ab.py): totals, the run's meta and the
written JSON + PNG."""
from __future__ import annotations

import json
from argparse import Namespace
from types import SimpleNamespace

import torch

from draftheads.bench.ab import ab_meta, ab_totals, ab_write


def records() -> list[dict]:
    return [{"category": "qa", "prompt_tokens": 9, "same_tokens": True,
             "fast": {"new_tokens": 11, "steps": 5, "seconds": 1.0}, "slow": {"new_tokens": 11, "steps": 5, "seconds": 2.0}},
            {"category": "rag", "prompt_tokens": 7, "same_tokens": False,
             "fast": {"new_tokens": 21, "steps": 10, "seconds": 1.0}, "slow": {"new_tokens": 21, "steps": 10, "seconds": 4.0}}]


def test_totals_meta_and_files(tmp_path):
    summary = ab_totals(records(), ["fast", "slow"])
    assert summary["fast"] == {"tokens_per_second": 16.0, "ms_per_step": 133.33, "tau": 2.0}
    assert summary["slow"]["tokens_per_second"] == round(32 / 6, 2)
    assert summary["fast_over_slow"]["median_prompt_speedup"] == 3.0  # the medians of 2x and 4x
    assert summary["same_tokens"] == 1
    model = SimpleNamespace(base=SimpleNamespace(dtype=torch.bfloat16))
    args = Namespace(heads="checkpoints/x", max_new_tokens=64)
    meta = ab_meta("bench_x.py", ["--out", "o"], model, args, ("mt-bench@1",))
    assert meta["command"] == "python scripts/bench_x.py --out o" and meta["dtype"] == "bfloat16"
    assert meta["prompts"] == ["mt-bench@1"] and meta["max_new_tokens"] == 64
    result = {"meta": meta, "summary": summary, "prompts": records()}
    ab_write(tmp_path / "out", "x", result, {"fast": "fast way", "slow": "slow way"}, "Two ways")
    assert json.loads((tmp_path / "out" / "x.json").read_text()) == result
    assert (tmp_path / "out" / "x.png").stat().st_size > 0
