"""One bad cache entry never breaks a load. Everything read back from ``DRAFTHEADS_CACHE`` is
checked field by field — the packing plan's keys and timings, the calibration's sizes, contexts
and times, a converted base's files — and a bad entry is dropped with one warning naming the
file and measured or converted again; a damaged model folder of the user's is one line naming
the file; the cache path itself is ``~``-expanded as a shell would."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from draftheads import environment
from draftheads.decoding.base import loading, packing
from draftheads.decoding.calibration import CalibrationConfig, calibration_path, write_calibration
from draftheads.decoding.cost import CostModel
from draftheads.decoding.base import hardware
from draftheads.core.errors import DamagedFileError, MissingPathError
from draftheads.decoding.base.plan import ROW_BUCKETS, PackingPlan, packing_available
from helpers import save_tiny_base

GOOD = {"linear_ms": [1.0] * len(ROW_BUCKETS), "packed_ms": [0.5] * len(ROW_BUCKETS),
        "fewrow_ms": [0.4] * len(ROW_BUCKETS)}
HUGE = 10 ** 400  # JSON carries integers of any size


def timings(**changes) -> dict:
    return {**GOOD, **changes}


BAD_ENTRIES = {
    "huge integer time": ("float32 8x4", timings(linear_ms=[HUGE] * len(ROW_BUCKETS))),
    "nan time": ("float32 8x4", timings(packed_ms=[float("nan")] * len(ROW_BUCKETS))),
    "infinite time": ("float32 8x4", timings(packed_ms=[float("inf")] * len(ROW_BUCKETS))),
    "zero time": ("float32 8x4", timings(linear_ms=[0.0] * len(ROW_BUCKETS))),
    "bool time": ("float32 8x4", timings(linear_ms=[True] * len(ROW_BUCKETS))),
    "one bucket short": ("float32 8x4", timings(linear_ms=[1.0] * (len(ROW_BUCKETS) - 1))),
    "a path missing": ("float32 8x4", {"linear_ms": GOOD["linear_ms"]}),
    "bad kernel times": ("float32 8x4", timings(fewrow_ms=["fast"] * len(ROW_BUCKETS))),
    "entry not an object": ("float32 8x4", [1.0, 2.0]),
    "key without a shape": ("float32", GOOD),
    "key without in features": ("float32 8x", GOOD),
    "zero features": ("float32 0x4", GOOD),
    "negative features": ("bfloat16 -8x4", GOOD),
    "a dtype that never packs": ("float64 8x4", GOOD),
    "three dimensions": ("float32 8x4x2", GOOD),
    "leading space": (" float32 8x4", GOOD),
    "empty key": ("", GOOD),
}


@pytest.mark.parametrize("case", list(BAD_ENTRIES))
def test_a_bad_packing_entry_is_dropped_with_one_warning_and_measured_again(tmp_path, monkeypatch, case):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path))
    key, entry = BAD_ENTRIES[case]
    path = packing.packing_cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": hardware.cpu_key(), "shapes": {"float32 3x4": GOOD, key: entry}}))
    with pytest.warns(UserWarning, match=f"Ignoring 1 malformed entries of the packing cache {path}") as seen:
        assert packing.read_packing_cache(path) == {"float32 3x4": GOOD}
    assert len(seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same one warning
        report = environment.collect()  # `draftheads env` reads the same file
    assert report["packing cache"] == str(path)
    if not packing_available(torch.float32):
        return
    measured = []
    plan = PackingPlan()
    monkeypatch.setattr(packing, "PLAN", plan)
    monkeypatch.setattr(packing, "measure_shape", lambda dtype, out, inp, **_: measured.append((out, inp)) or dict(GOOD))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packing.plan_packing([torch.zeros(3, 4), torch.zeros(8, 4)])
    assert measured == [(8, 4)]  # the dropped shape measured again, the good one read
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewritten file is clean
        assert set(packing.read_packing_cache(path)) == {"float32 3x4", "float32 8x4"}


# -- a converted base ----------------------------------------------------------------------------
def truncate(path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


DAMAGE = {
    "weights cut in half": lambda folder: truncate(folder / "model.safetensors",
                                                   (folder / "model.safetensors").stat().st_size // 2),
    "weights cut to their header length": lambda folder: truncate(folder / "model.safetensors", 8),
    "weights empty": lambda folder: truncate(folder / "model.safetensors", 0),
    "config cut short": lambda folder: truncate(folder / "config.json", 20),
    "tokenizer not JSON": lambda folder: (folder / "tokenizer.json").write_bytes(b"\x00\xff binary"),
    "config a list": lambda folder: (folder / "config.json").write_text("[1, 2]"),
}


@pytest.fixture
def converted(tmp_path, monkeypatch):
    """A GGUF stand-in whose conversion (counted) saves the tiny Llama into the cache."""
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    conversions = []

    def convert(source, target):
        conversions.append(target)
        save_tiny_base(target)
        return target

    monkeypatch.setattr(loading, "_convert_gguf", convert)
    return gguf, conversions


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_converted_base_is_converted_again_with_one_warning(converted, damage):
    gguf, conversions = converted
    path, _ = loading.resolve_base(str(gguf))
    assert len(conversions) == 1
    folder = conversions[0]
    DAMAGE[damage](folder)
    with pytest.warns(UserWarning, match=rf"the converted base {folder} is damaged \(\w+\.\w+ .*\); converting "
                                         "tiny.gguf again") as seen:
        model, _ = loading.load_base(str(gguf), dtype="float32")
    assert len(seen) == 1 and len(conversions) == 2
    assert model.config.vocab_size == 96
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # nothing left aside
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new conversion is read silently
        assert loading.resolve_base(str(gguf))[0] == path and len(conversions) == 2


def test_a_reused_conversion_records_the_gguf_it_is_loaded_for(converted, tmp_path):
    """A conversion whose record names a GGUF since removed (another virtual environment's, another
    checkout's) is pointed at the file it is loaded for now, without converting again: the GGUF's
    blocks are read through that record (a stale one silently streamed the float weights)."""
    gguf, conversions = converted
    folder = Path(loading.resolve_base(str(gguf))[0])
    (folder / loading.SOURCE_RECORD).write_text(json.dumps({"gguf": str(tmp_path / "gone" / "tiny.gguf")}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loading.resolve_base(str(gguf))[0] == str(folder) and len(conversions) == 1
    assert loading.converted_from(folder) == gguf.absolute()
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # the record replaced in one rename


@pytest.mark.parametrize("keep", [0, 8, 100, -100])
def test_a_truncated_weights_file_of_the_users_is_one_line_naming_it(tmp_path, keep):
    folder = tmp_path / "my-model"
    save_tiny_base(folder)
    weights = folder / "model.safetensors"
    truncate(weights, keep if keep >= 0 else weights.stat().st_size + keep)
    with pytest.raises(DamagedFileError, match=r"'.*my-model' could not be loaded: model.safetensors cannot be "
                                               r"read: .*\. Download or save the model again\.") as raised:
        loading.load_base(str(folder), dtype="float32")
    assert "\n" not in str(raised.value) and isinstance(raised.value, ValueError)


# -- the cache path ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [("~/x", "x"), ("~", ""), ("~/a/b", "a/b")])
def test_the_cache_path_expands_the_home_folder(tmp_path, monkeypatch, value, expected):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("DRAFTHEADS_CACHE", value)
    assert loading.cache_root() == home / expected
    assert packing.packing_cache_path().is_relative_to(home)
    target = calibration_path({"base": "x"}, CalibrationConfig())
    write_calibration(target, CostModel.from_table((1, 2), (1.0, 2.0)))
    assert target.is_file() and not os.listdir(cwd)  # no folder named "~" where the user stands


def test_the_tokenizer_alone_loads_no_weights_and_a_folder_without_one_is_one_line(tmp_path, monkeypatch):
    """``load_tokenizer`` (jobs that only read token ids): the same tokenizer ``load_base`` gives,
    without reading the weights; a model folder saved without a tokenizer names the fix."""
    from transformers import AutoModelForCausalLM

    from helpers import tiny_llama

    folder = tmp_path / "base"
    save_tiny_base(folder)
    _, expected = loading.load_base(str(folder), dtype="float32")

    def no_weights(*args, **kwargs):
        raise AssertionError("load_tokenizer read the weights")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    tokenizer = loading.load_tokenizer(str(folder))
    assert tokenizer.get_vocab() == expected.get_vocab()
    tiny_llama(0).save_pretrained(tmp_path / "no-tokenizer")
    with pytest.raises(MissingPathError, match="has no usable tokenizer.*tokenizer.save_pretrained") as err:
        loading.load_tokenizer(str(tmp_path / "no-tokenizer"))
    assert "\n" not in str(err.value)
