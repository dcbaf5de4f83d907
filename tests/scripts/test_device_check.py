"""scripts/device_check.py, the check GPU users run, on this machine's CPU: its cases report
identity with transformers where the dtype guarantees it, and a broken case fails the run."""
from __future__ import annotations

import json

from helpers import load_script




def test_float64_cases_are_identical_and_the_run_passes(tmp_path):
    script = load_script("device_check")
    assert script.main(["--device", "cpu", "--dtypes", "float64", "--max-new-tokens", "10", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "device_check.json").read_text())
    greedy = [c for c in results["cases"] if "shape" in c]
    assert {(c["drafts"], c["shape"]) for c in greedy} == {(d, s) for d in script.DRAFTS for s in ("bs1", "bs4", "bs8")}
    assert all(c["identical"] == c["prompts"] and not c["divergences"] for c in greedy)
    assert results["failed"] == 0 and any("sampling" in c for c in results["cases"])


def test_a_case_that_raises_or_a_float64_divergence_fails_the_run():
    script = load_script("device_check")
    broken = {"cases": [{"dtype": "float32", "error": "RuntimeError: device-side assert"},
                        {"dtype": "float64", "divergences": [{"position": 3}]},
                        {"dtype": "bfloat16", "divergences": [{"position": 3}]}]}
    assert [c["dtype"] for c in script.failed(broken)] == ["float32", "float64"]
