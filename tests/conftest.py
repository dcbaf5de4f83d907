"""Shared fixtures: the embedded SmolLM2 base (float32, bfloat16) and the tiny training
set-up (a float64 tiny Llama saved as a model dir plus its own greedy continuations as token
data). Helpers the tests share are in helpers.py.

A clone must carry what its tests need: a test may skip only for a reason in
:data:`ALLOWED_SKIPS` (asked for by whoever runs the suite, or a capability this machine lacks);
any other skip — a file outside the clone, a dataset not cached — fails the run."""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import tiny_llama

#: the only reasons a test may skip (prefixes of the skip reason); see the module docstring
ALLOWED_SKIPS = ("DRAFTHEADS_SKIP_SMOLLM2 is set", "this torch build has no oneDNN packed linear",
                 "no native bfloat16 here", "the AVX2 limit is an x86 setting",
                 "the few-row kernel is off here",
                 "the demo's browser test needs")  # a browser or Playwright, naming the package to install
_unwanted_skips: list[str] = []


def skip_reason(report) -> str:
    """The reason of a skipped test's report (``pytest.skip`` and ``skipif`` alike)."""
    text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return text.removeprefix("Skipped: ")


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail") and not skip_reason(report).startswith(ALLOWED_SKIPS):
        _unwanted_skips.append(f"{report.nodeid}: {skip_reason(report)}")


def pytest_sessionfinish(session, exitstatus):
    """A run whose tests all passed still fails when one skipped for want of something outside
    the clone (a run that failed, or ran nothing, keeps its own non-zero status)."""
    if _unwanted_skips and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _unwanted_skips:
        terminalreporter.section("skipped for want of something the clone does not carry (fails the run)")
        for line in _unwanted_skips:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def smollm2():
    from draftheads.decoding.base.loading import load_base

    if os.environ.get("DRAFTHEADS_SKIP_SMOLLM2"):
        pytest.skip("DRAFTHEADS_SKIP_SMOLLM2 is set")
    return load_base(dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_bf16():
    from draftheads.decoding.base.loading import load_base

    if os.environ.get("DRAFTHEADS_SKIP_SMOLLM2"):
        pytest.skip("DRAFTHEADS_SKIP_SMOLLM2 is set")
    return load_base(dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A float64 tiny Llama saved as a model dir, and its own greedy continuations as token data
    (self-distilled, so heads have something learnable)."""
    root = tmp_path_factory.mktemp("tiny")
    model = tiny_llama(0, dtype=torch.float64)
    model.save_pretrained(root / "base")
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 96, (48, 4), generator=generator)
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=20, do_sample=False,
                         min_new_tokens=20)
    with open(root / "tokens.jsonl", "w") as handle:
        for row in out.tolist():
            handle.write(json.dumps({"input_ids": row, "response_start": 4}) + "\n")
    return root
