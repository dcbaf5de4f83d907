"""Fast paths decided from what torch reports, per dtype, and where packing pays by measurement
(decoding/base/: hardware.py, plan.py, packing.py's packing cache)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from draftheads.decoding.base import hardware, loading, packing
from draftheads.decoding.base import plan as plan_module
from draftheads.decoding.base.plan import PackingPlan, ROW_BUCKETS, row_bucket, shape_key, valid_timings

AVX2_LIMIT = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
is_x86 = pytest.mark.skipif(not hardware.is_x86(), reason="the AVX2 limit is an x86 setting")


def run_python(code: str, extra_env: dict) -> str:
    env = {**os.environ, **extra_env}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


@is_x86
def test_an_avx2_limit_is_honoured_and_float32_still_packs():
    """Under the three ISA variables torch reports AVX2: bfloat16 is not native (auto → float32),
    and float32 packing does not depend on bfloat16's (the bug that made AVX2 CPUs 0.78x)."""
    out = run_python("import torch, json\n"
                     "from draftheads.decoding.base import fewrow, hardware, plan\n"
                     "from draftheads.decoding.base.loading import choose_dtype\n"
                     "print(json.dumps([torch.backends.cpu.get_cpu_capability(), hardware.bf16_native(),\n"
                     "  plan.packing_available(torch.float32), plan.packing_available(torch.bfloat16),\n"
                     "  str(choose_dtype('auto', torch.bfloat16)), hardware.cpu_key()['isa_limits'],\n"
                     "  fewrow.bf16_kernel_supported()]))", AVX2_LIMIT)
    capability, bf16, fp32_packs, bf16_packs, auto, limits, bf16_kernel = json.loads(out)
    assert capability == "AVX2"
    assert bf16 is False and bf16_packs is False and bf16_kernel is False  # the bf16 kernel honours the limit too
    assert auto == "torch.float32"
    assert fp32_packs is torch.backends.mkldnn.is_available()
    assert limits == AVX2_LIMIT  # the limit is part of every per-machine cache key


def test_float32_packing_never_depends_on_bfloat16(monkeypatch):
    monkeypatch.setattr(plan_module, "bf16_native", lambda: False)
    plan_module.packing_available.cache_clear()
    try:
        assert plan_module.packing_available(torch.bfloat16) is False
        assert plan_module.packing_available(torch.float32) is torch.backends.mkldnn.is_available()
        assert plan_module.packing_available(torch.float64) is False
    finally:
        plan_module.packing_available.cache_clear()


def test_native_dtypes_follow_torch_not_proc_cpuinfo(monkeypatch):
    monkeypatch.setattr(loading, "native_cpu_dtypes", lambda: {torch.float32})
    assert loading.native_half_dtypes("cpu") == set()
    assert loading.choose_dtype("auto", torch.bfloat16) is torch.float32
    monkeypatch.setattr(loading, "native_cpu_dtypes", lambda: {torch.float32, torch.bfloat16})
    assert loading.choose_dtype("auto", torch.bfloat16) is torch.bfloat16


@pytest.mark.parametrize("rows, bucket", [(1, 0), (2, 1), (3, 1), (4, 2), (9, 3), (17, 4), (127, 6), (128, 7), (5000, 7)])
def test_row_buckets(rows, bucket):
    assert row_bucket(rows) == bucket and ROW_BUCKETS[bucket] <= rows


def test_the_plan_packs_only_where_packing_measured_faster():
    weight = torch.zeros(12, 8)
    plan = PackingPlan()
    assert plan.pays(weight, 3)  # never measured: pack wherever the dtype packs
    linear_ms = [1.0] * len(ROW_BUCKETS)
    packed_ms = [2.0, 1.05, 0.5, 0.5, 0.5, 0.5, 3.0, 3.0]  # slower at 1 row and 64+ rows (1.05: within noise)
    plan.add(shape_key(torch.float32, 12, 8), {"linear_ms": linear_ms, "packed_ms": packed_ms})
    assert [plan.pays(weight, rows) for rows in (1, 2, 3, 9, 63, 64, 1000)] == [False, True, True, True, True, False, False]
    assert plan.pays(weight.double(), 1)  # another dtype is another shape
    plan.replace({shape_key(torch.float32, 12, 8): {"linear_ms": linear_ms, "packed_ms": [3.0] * len(ROW_BUCKETS)}})
    assert not any(plan.pays(weight, rows) for rows in (1, 3, 9, 64))  # every verdict made again
    plan.replace({})
    assert plan.pays(weight, 3) and not plan.timings


@pytest.mark.skipif(not plan_module.packing_available(torch.float32), reason="this torch build has no oneDNN packed linear")
def test_measure_shape_times_both_paths_at_every_bucket():
    entry = plan_module.measure_shape(torch.float32, 24, 16, reps=1)
    assert valid_timings(entry)
    assert len(entry["linear_ms"]) == len(entry["packed_ms"]) == len(ROW_BUCKETS)


def test_a_shape_is_timed_over_copies_filling_the_planned_weights_up_to_the_stream_bound():
    """Decoding reads a big base's weights from memory, a tiny one's from cache: the copies a
    product is timed over fill the footprint of the weights being planned, up to STREAM_BYTES."""
    assert plan_module.stream_copies(1 << 20, 0) == 1  # nothing said: warm
    assert plan_module.stream_copies(1 << 20, 4 << 20) == 4  # a small model: its own footprint
    assert plan_module.stream_copies(1 << 20, 1 << 40) == plan_module.STREAM_BYTES >> 20  # a big one: the bound
    assert plan_module.stream_copies(1 << 30, 1 << 40) == 1  # a weight bigger than the bound streams anyway


@pytest.mark.skipif(not plan_module.packing_available(torch.float32), reason="this torch build has no oneDNN packed linear")
def test_measure_shape_reads_a_new_copy_of_the_weight_each_call(monkeypatch):
    seen = []
    real = plan_module._linear
    monkeypatch.setattr(plan_module, "_linear", lambda x, weight: seen.append(weight.data_ptr()) or real(x, weight))
    entry = plan_module.measure_shape(torch.float32, 24, 16, reps=1, footprint=5 * 24 * 16 * 4)
    assert valid_timings(entry)
    assert len(set(seen)) == 5  # every copy, in turn
    assert seen[:5] == list(dict.fromkeys(seen))[:5] and seen[5] == seen[0]


@pytest.mark.skipif(not plan_module.packing_available(torch.float32), reason="this torch build has no oneDNN packed linear")
def test_the_plan_is_measured_with_the_footprint_of_the_weights_planned(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    footprints = []
    monkeypatch.setattr(packing, "measure_shape", lambda dtype, out, inp, footprint=0, **_: footprints.append(footprint) or {
        "linear_ms": [1.0] * len(ROW_BUCKETS), "packed_ms": [0.5] * len(ROW_BUCKETS)})
    monkeypatch.setattr(packing, "PLAN", plan_module.PackingPlan())
    weights = [torch.zeros(40, 24), torch.zeros(24, 40), torch.zeros(40, 24)]
    packing.plan_packing(weights)
    assert footprints and set(footprints) == {3 * 40 * 24 * 4}
    footprints.clear()  # the heads' shapes: timed with the base's weights streaming between two uses
    packing.plan_packing([torch.zeros(8, 24)], alongside=weights)
    assert footprints == [8 * 24 * 4 + 3 * 40 * 24 * 4]


def test_a_cache_timed_under_another_rule_is_not_read(monkeypatch):
    """Timings made warm, or with another footprint, decide other paths: each rule has its own file."""
    path = packing.packing_cache_path()
    monkeypatch.setattr(packing, "FOOTPRINT_RULE", "the planned weights only")
    assert packing.packing_cache_path() != path
    monkeypatch.setattr(packing, "STREAM_BYTES", 0)
    assert len({packing.packing_cache_path(), path}) == 2


def test_the_heads_are_planned_with_the_base_streaming_alongside(monkeypatch):
    """Between two uses of a head's weight a step streams the whole base: the heads' shapes are
    timed with the base's weights in their footprint, not warm in cache."""
    from draftheads.decoding import generate
    from helpers import random_heads, tiny_llama

    seen = []
    monkeypatch.setattr(generate, "plan_packing", lambda weights, alongside=(): seen.append(list(alongside)))
    base = tiny_llama(dtype=torch.float32)
    generate.attach_heads(random_heads("medusa", base), base)
    body = [p for p in base.model.parameters() if p.dim() == 2]
    assert len(seen) == 1 and seen[0][0] is base.lm_head.weight and len(seen[0]) == 1 + len(body)


@pytest.mark.parametrize("content", ["", "{", "[]", '{"key": 1}', "\x00\x01binary", '{"key": null, "shapes": {}}'])
def test_an_unreadable_packing_cache_is_measured_again_with_a_warning(tmp_path, content):
    path = tmp_path / "packing.json"
    path.write_text(content)
    with pytest.warns(UserWarning, match=f"Ignoring the packing cache {path}"):
        assert packing.read_packing_cache(path) == {}


def test_malformed_cache_entries_are_dropped_not_trusted(tmp_path):
    good = {"linear_ms": [1.0] * len(ROW_BUCKETS), "packed_ms": [0.5] * len(ROW_BUCKETS)}
    bad = [{"linear_ms": [1.0], "packed_ms": [0.5]}, {"linear_ms": [float("nan")] * 8, "packed_ms": [1.0] * 8},
           {"linear_ms": [-1.0] * 8, "packed_ms": [1.0] * 8}, {"linear_ms": ["1"] * 8, "packed_ms": [1.0] * 8}, []]
    shapes = {"float32 4x4": good, **{f"float32 {i}x4": b for i, b in enumerate(bad, start=5)}}
    path = tmp_path / "packing.json"
    path.write_text(json.dumps({"key": hardware.cpu_key(), "shapes": shapes}))
    with pytest.warns(UserWarning, match=f"Ignoring {len(bad)} malformed entries of the packing cache {path}"):
        assert packing.read_packing_cache(path) == {"float32 4x4": good}


def test_packing_cache_round_trip_and_an_unwritable_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(packing, "PLAN", PackingPlan())
    monkeypatch.setattr(packing, "measure_shape", lambda dtype, out, inp, **_: {
        "linear_ms": [1.0] * len(ROW_BUCKETS), "packed_ms": [float(out)] * len(ROW_BUCKETS)})
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    weights = [torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(5, 4).double()]
    packing.plan_packing(weights)
    path = packing.packing_cache_path()
    assert set(json.loads(path.read_text())["shapes"]) == ({"float32 3x4", "float32 5x4"}
                                                            if plan_module.packing_available(torch.float32) else set())
    monkeypatch.setattr(packing, "PLAN", PackingPlan())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packing.plan_packing(weights)  # read back, nothing measured, nothing to warn about
    assert set(packing.PLAN.timings) == set(json.loads(path.read_text())["shapes"])
    if not plan_module.packing_available(torch.float32):
        return
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(blocker))
    monkeypatch.setattr(packing, "PLAN", PackingPlan())
    with pytest.warns(UserWarning, match="Cannot write the packing cache .* kept for this process only"):
        packing.plan_packing(weights)
    assert "float32 3x4" in packing.PLAN.timings
