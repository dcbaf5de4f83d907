"""The few-row kernels (decoding/base/fewrow.py), float32 and bfloat16: agreement with F.linear, how they
are built and rebuilt (a C compiler that fails is named with its first line of output, not taken
for a permissions problem, and ``CC`` is split as make splits it), and how the packing plan picks
them only where they measured fastest."""
from __future__ import annotations

import json
import shlex
import shutil
import sys
import warnings

import pytest
import torch

from draftheads.decoding.base import fewrow, plan as plan_module, siblings
from draftheads.decoding.base.plan import PackingPlan, ROW_BUCKETS, fastest_paths, shape_key, valid_timings

#: the modules that read the process's packing plan (a test replaces it in each)

from helpers import plan_readers, tiny_llama


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kernels")
    if not fewrow.load_kernel(folder):
        pytest.skip(f"the few-row kernel is off here ({fewrow.kernel_status()})")
    return folder


@pytest.mark.parametrize("out_features, in_features", [(37, 29), (16, 8), (64, 576), (49, 1), (1, 13)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 20])
def test_the_kernel_agrees_with_f_linear_within_float32_rounding(kernel_dir, out_features, in_features, rows):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    got = fewrow.fewrow_linear(x, fewrow.block_weight(weight), out_features)
    exact = torch.nn.functional.linear(x.double(), weight.double())
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # one accumulation chain per output: within a few float32 ulps of the sum's magnitude
    bound = 4 * in_features * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T)
    assert ((got.double() - exact).abs() <= bound + 1e-30).all()


def test_batched_strided_input_and_bias(kernel_dir):
    generator = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(40, 24, generator=generator), torch.randn(40, generator=generator)
    x = torch.randn(3, 24, 4, generator=generator).transpose(1, 2)  # (3, 4, 24), not contiguous
    got = fewrow.fewrow_linear(x, fewrow.block_weight(weight), 40, bias)
    assert got.shape == (3, 4, 40)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_a_missing_compiler_turns_the_kernel_off_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(fewrow, "_state", {"lib": None, "status": "not loaded", "dtypes": frozenset()})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert fewrow.load_kernel(tmp_path) is False
    assert fewrow.kernel() is None and fewrow.kernel_status().startswith("off: ")
    monkeypatch.setattr(fewrow, "unsupported_reason", lambda: "not an x86 CPU (the kernel is AVX2 code)")
    assert fewrow.load_kernel(tmp_path) is False
    assert fewrow.kernel_status() == "off: not an x86 CPU (the kernel is AVX2 code)"


def test_a_damaged_cached_library_is_rebuilt_not_trusted(kernel_dir, monkeypatch, tmp_path):
    monkeypatch.setattr(fewrow, "_state", {"lib": None, "status": "not loaded", "dtypes": frozenset()})
    compiler = fewrow._compiler()
    path = fewrow._library_path(tmp_path, compiler)
    path.write_bytes(b"\x7fELF not really a library")
    assert fewrow.load_kernel(tmp_path) is True
    assert fewrow.kernel_status().startswith(f"on ({path}; float32")
    assert path.read_bytes()[:4] == b"\x7fELF" and path.stat().st_size > 1000


def test_the_kernels_identity_is_the_loaded_librarys(kernel_dir, monkeypatch):
    """What keys the cached step costs names the library this process loaded: a source edited on disk
    since (a checkout updated under a running process) does not change it, another build does."""
    identity = fewrow.kernel_identity()
    assert identity is not None and identity.endswith(":float32" if torch.bfloat16 not in fewrow.kernel_dtypes()
                                                      else ":bfloat16+float32")
    monkeypatch.setattr(fewrow, "_source_bytes", lambda: b"another source")
    assert fewrow.kernel_identity() == identity
    assert fewrow._library_path(kernel_dir, fewrow._compiler()).stem.removeprefix("fewrow-") not in identity


@pytest.fixture(scope="module")
def bf16_kernel(kernel_dir):
    if torch.bfloat16 not in fewrow.kernel_dtypes():
        pytest.skip("no native bfloat16 here (the bfloat16 kernel needs AVX512-BF16 as torch reports it)")
    return kernel_dir


@pytest.mark.parametrize("out_features, in_features", [(37, 30), (16, 8), (64, 576), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 20])
def test_the_bf16_kernel_rounds_a_float32_sum_once(bf16_kernel, out_features, in_features, rows):
    """Each output is one float32 sum of exact bf16 products, rounded to bf16 once: within one
    bf16 rounding (2^-8 relative) of the exact product plus float32 summation slack, as F.linear
    is, and one bf16 ulp from F.linear's on a small fraction of outputs at most."""
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    got = fewrow.fewrow_linear(x, fewrow.block_weight(weight), out_features)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T
    slack = in_features * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T)
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + slack + 1e-30).all()
    theirs = torch.nn.functional.linear(x, weight)
    assert (got != theirs).float().mean() <= 0.02
    torch.testing.assert_close(got.float(), theirs.float(), rtol=2.0 ** -7, atol=1e-6)


def test_the_bf16_kernel_takes_batched_input_and_bias(bf16_kernel):
    generator = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(40, 24, generator=generator).bfloat16(), torch.randn(40, generator=generator).bfloat16()
    x = torch.randn(3, 24, 4, generator=generator).bfloat16().transpose(1, 2)  # (3, 4, 24), not contiguous
    got = fewrow.fewrow_linear(x, fewrow.block_weight(weight), 40, bias)
    assert got.shape == (3, 4, 40) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, weight, bias).float(), rtol=2 ** -6, atol=2 ** -6)


def test_stacked_bf16_products_through_the_kernel_are_exact(bf16_kernel, monkeypatch):
    """One float32 chain per output whatever the output count: a stacked q/k/v product through
    the kernel equals, bit for bit, each member's own product through it (so sibling stacking
    stays a pure speed-up)."""
    plan = PackingPlan()
    n = len(ROW_BUCKETS)
    for shape in ((64, 48), (16, 48), (96, 48)):
        plan.add(shape_key(torch.bfloat16, *shape), entry([9.0] * n, [9.0] * n, [1.0] * n))
    for module in plan_readers():
        monkeypatch.setattr(module, "PLAN", plan)
    siblings.stacking_exact.cache_clear()
    try:
        assert all(siblings.stacking_exact(torch.bfloat16, ((64, 48), (16, 48), (16, 48))))
    finally:
        siblings.stacking_exact.cache_clear()


def entry(linear_ms, packed_ms, fewrow_ms=None):
    out = {"linear_ms": [float(v) for v in linear_ms], "packed_ms": [float(v) for v in packed_ms]}
    if fewrow_ms is not None:
        out["fewrow_ms"] = [float(v) for v in fewrow_ms]
    return out


def test_the_plan_takes_the_kernel_only_where_it_beat_both_paths():
    n = len(ROW_BUCKETS)
    measured = entry([1.0] * n, [2.0, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8], [0.5, 0.9, 0.4, 0.4, 0.4, 0.4, 0.9, 3.0])
    assert fastest_paths(measured) == ("fewrow", "packed", "fewrow", "fewrow", "fewrow", "fewrow", "packed", "packed")
    assert fastest_paths(measured, kernel_loaded=False) == ("linear",) + ("packed",) * (n - 1)
    assert fastest_paths(entry([1.0] * n, [0.5] * n)) == ("packed",) * n  # never measured: never taken


@pytest.mark.parametrize("bad", [[1.0], [float("nan")] * len(ROW_BUCKETS), [0.0] * len(ROW_BUCKETS), "fast", None])
def test_a_malformed_kernel_timing_is_not_trusted(bad):
    good = entry([1.0] * len(ROW_BUCKETS), [1.0] * len(ROW_BUCKETS))
    assert valid_timings(good) and valid_timings({**good, "fewrow_ms": [0.5] * len(ROW_BUCKETS)})
    assert not valid_timings({**good, "fewrow_ms": bad})


def test_shapes_measured_before_the_kernel_are_measured_again(kernel_dir):
    plan = PackingPlan()
    weight = torch.zeros(12, 8)
    plan.add(shape_key(torch.float32, 12, 8), entry([1.0] * len(ROW_BUCKETS), [1.0] * len(ROW_BUCKETS)))
    assert plan.missing([weight]) == ([(torch.float32, 12, 8)] if plan_module.packing_available(torch.float32) else [])
    plan.add(shape_key(torch.float32, 12, 8), plan_module.measure_shape(torch.float32, 12, 8, reps=1))
    assert plan.missing([weight]) == [] and valid_timings(plan.timings["float32 12x8"])


@pytest.mark.skipif(not plan_module.packing_available(torch.float32), reason="this torch build has no oneDNN packed linear")
def test_float32_decoding_through_the_kernel_follows_the_base(kernel_dir, monkeypatch):
    """Every linear of a tiny float32 base and its LM head forced onto the kernel (trees of 2-8
    slots): the decoder's greedy output equals transformers' greedy generate."""
    from draftheads.decoding import DraftHeadsModel, tree_from_paths
    from helpers import OracleHeads

    model = tiny_llama(2, dtype=torch.float32)
    prompt = torch.tensor([[5, 17, 33, 8, 9]])
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
    plan = PackingPlan()
    n = len(ROW_BUCKETS)
    for w in [p for p in model.parameters() if p.dim() == 2]:
        plan.add(shape_key(w.dtype, w.shape[0], w.shape[1]), entry([9.0] * n, [9.0] * n, [1.0] * n))
    for module in plan_readers():
        monkeypatch.setattr(module, "PLAN", plan)
    calls = []
    real = fewrow._product

    def counted(lib, blocked, out_features):  # every product through the kernel, bound or per call
        product = real(lib, blocked, out_features)
        return lambda x: calls.append(x.shape) or product(x)
    monkeypatch.setattr(fewrow, "_product", counted)
    for paths in ([(0,)], [(0,), (1,), (0, 0)], [(0,), (0, 0), (0, 0, 0), (1,), (2,), (1, 0), (0, 1)]):
        heads = OracleHeads([reference[0, 5:].tolist()], vocab=96, error=0.3, seed=4)
        ours = DraftHeadsModel(model, heads, tree=tree_from_paths(paths)).generate(prompt, max_new_tokens=40)
        assert ours.tolist() == reference.tolist()
    assert len(calls) > 100, "the kernel was not used"


# -- the C compiler: ``CC`` and its failures ------------------------------------------------------------
def fake_compiler(path, exit_code: int, stderr: str):
    """An executable that records its arguments beside itself, prints ``stderr`` and exits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(path) + '.args'!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
                    f"sys.stderr.write({stderr!r})\nsys.exit({exit_code})\n")
    path.chmod(0o755)
    return path


@pytest.fixture()
def fresh_kernel(monkeypatch):
    monkeypatch.setattr(fewrow, "_state", {"lib": None, "status": "not loaded", "dtypes": frozenset()})
    monkeypatch.setattr(fewrow, "unsupported_reason", lambda: None)


@pytest.mark.parametrize("program", ["cc-fake", "a folder/cc fake"])
@pytest.mark.parametrize("stderr", ["cc1: error: bad value 'x' for '-march='\nsecond line\n", ""])
def test_a_failing_compiler_is_named_with_its_first_line_and_the_kernel_falls_back(tmp_path, monkeypatch,
                                                                                   fresh_kernel, program, stderr):
    compiler = fake_compiler(tmp_path / "bin" / program, 1, stderr)
    monkeypatch.setenv("CC", f"'{compiler}' -O2 -march=x")
    cache = tmp_path / "kernels"
    with pytest.warns(UserWarning, match="few-row kernel is off: the C compiler"):
        assert fewrow.load_kernel(cache) is False
    first = stderr.splitlines()[0] if stderr else "no message"
    command = shlex.join([str(compiler), "-O2", "-march=x"])
    assert fewrow.kernel_status() == f"off: the C compiler `{command}` failed (exit 1): {first}"
    assert "permission" not in fewrow.kernel_status() and fewrow.kernel() is None
    args = json.loads((compiler.parent / (compiler.name + ".args")).read_text())
    n = len(fewrow.LIBRARIES)  # one program, CC's flags first, the libraries last
    assert args[:-1 - n] == ["-O2", "-march=x", *fewrow.FLAGS, str(fewrow.SOURCE), "-o"]
    assert args[-n:] == list(fewrow.LIBRARIES)
    assert not list(cache.iterdir())  # the temporary library is gone


@pytest.mark.parametrize("cc,status", [
    ("{tmp}/no-such-cc", r"the C compiler `.*no-such-cc` could not be run \(No such file or directory\): set CC to an "
                         r"installed compiler, or unset it"),
    ("'unbalanced -O2", r"CC=\"'unbalanced -O2\" cannot be split into a command \(No closing quotation\): fix its "
                        r"quoting"),
])
def test_a_compiler_that_cannot_run_says_so(tmp_path, monkeypatch, fresh_kernel, cc, status):
    monkeypatch.setenv("CC", cc.replace("{tmp}", str(tmp_path)))
    with pytest.warns(UserWarning, match="few-row kernel is off"):
        assert fewrow.load_kernel(tmp_path / "kernels") is False
    assert __import__("re").fullmatch(f"off: {status}", fewrow.kernel_status()), fewrow.kernel_status()


@pytest.mark.parametrize("cc,expected", [("gcc -O2", ["gcc", "-O2"]), ("ccache gcc", ["ccache", "gcc"]),
                                         ("'/opt/my cc/gcc' -g", ["/opt/my cc/gcc", "-g"])])
def test_cc_is_split_as_make_splits_it(monkeypatch, cc, expected):
    monkeypatch.setenv("CC", cc)
    assert fewrow._compiler() == expected


def test_an_empty_cc_falls_back_to_the_system_compiler(monkeypatch):
    monkeypatch.setenv("CC", "  ")
    found = shutil.which("cc") or shutil.which("gcc")
    assert fewrow._compiler() == ([found] if found else None)


def test_cc_with_flags_builds_the_kernel(tmp_path, monkeypatch):
    gcc = shutil.which("gcc")
    if gcc is None or fewrow.unsupported_reason() is not None:
        pytest.skip(f"the few-row kernel is off here ({fewrow.unsupported_reason() or 'no gcc'})")
    monkeypatch.setattr(fewrow, "_state", {"lib": None, "status": "not loaded", "dtypes": frozenset()})
    monkeypatch.setenv("CC", f"{gcc} -O2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fewrow.load_kernel(tmp_path) is True
    assert fewrow.kernel_status().startswith("on (")
