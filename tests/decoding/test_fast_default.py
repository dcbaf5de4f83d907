"""Fast by default: the dtype chosen from the base and the hardware, the cheaper step's pieces
(float32 few-row LM head, greedy argmax, sibling projections stacked into one product) equal to
what they replace, the per-dtype default tree,
and the streamer that colours accepted drafts."""
from __future__ import annotations

import io
import warnings

import pytest
import torch

from helpers import OracleHeads, tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.base import binding as binding_module, loading as loading_module, packed as packed_module
from draftheads.decoding.base import plan as plan_module, rows as rows_module, siblings as siblings_module
from draftheads.decoding.accept import greedy_tokens
from draftheads.decoding.base.binding import PackedLinear, packed_linears
from draftheads.decoding.base.forward import lm_logits, prefill
from draftheads.decoding.base.loading import choose_dtype, native_dtype
from draftheads.decoding.base.packing import use_packed_linears
from draftheads.decoding.base.plan import packing_available
from draftheads.decoding.policy import default_budget
from draftheads.decoding.base.dtypes import DtypeError, parse_dtype
from draftheads.core.errors import InputTypeError
from draftheads.decoding.step import PHASES, PhaseTimer
from draftheads.streamer import DRAFT_COLOUR, RESET, DraftColourStreamer


# -- dtype -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,dtype", [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp32", torch.float32),
                                        ("torch.float16", torch.float16), ("float64", torch.float64),
                                        (torch.float32, torch.float32)])
def test_parse_dtype_accepts_names_and_dtypes(text, dtype):
    assert parse_dtype(text) is dtype


@pytest.mark.parametrize("bad,error,message", [
    ("bogus", DtypeError, "dtype='bogus' is not a dtype draftheads knows; use one of auto, bfloat16, float16, float32"),
    ("int8", DtypeError, "not a dtype draftheads knows"), (torch.int64, DtypeError, "needs a floating dtype"),
    (3, InputTypeError, "must be a torch.dtype or its name"), (["bf16"], InputTypeError, "got list")])
def test_parse_dtype_refuses_what_is_not_a_float_dtype(bad, error, message):
    with pytest.raises(error, match=message):
        parse_dtype(bad)
    assert parse_dtype("auto") is None and parse_dtype(None) is None


def test_auto_takes_the_native_dtype_only_where_the_hardware_computes_it(monkeypatch):
    monkeypatch.setattr(loading_module, "native_cpu_dtypes", lambda: {torch.float32, torch.bfloat16})
    assert choose_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert choose_dtype(None, torch.float16) is torch.float32  # fp16 is emulated on this CPU: fp32
    assert choose_dtype("auto", torch.float32) is torch.float32
    monkeypatch.setattr(loading_module, "native_cpu_dtypes", lambda: {torch.float32})
    assert choose_dtype("auto", torch.bfloat16) is torch.float32


def test_an_explicit_dtype_wins_with_a_warning_when_emulated(monkeypatch):
    monkeypatch.setattr(loading_module, "native_cpu_dtypes", lambda: {torch.float32})
    with pytest.warns(UserWarning, match="no native bfloat16 arithmetic.*'auto' picks float32"):
        assert choose_dtype("bfloat16", torch.bfloat16) is torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_dtype("float32", torch.bfloat16) is torch.float32
        assert choose_dtype("float64", torch.bfloat16) is torch.float64


def test_native_dtype_reads_the_config_and_calls_gguf_bfloat16(tmp_path):
    (tmp_path / "config.json").write_text('{"dtype": "bfloat16"}')
    assert native_dtype(tmp_path) is torch.bfloat16
    (tmp_path / "config.json").write_text('{"torch_dtype": "float16"}')
    assert native_dtype(tmp_path) is torch.float16
    assert native_dtype(tmp_path / "missing") is torch.float32
    assert native_dtype(tmp_path, gguf="model.gguf") is torch.bfloat16


def test_load_base_refuses_a_bad_dtype_before_loading():
    with pytest.raises(DtypeError, match="dtype='bogus' is not a dtype"):
        loading_module.load_base("/nonexistent/model", dtype="bogus")


# -- the cheaper step's pieces -------------------------------------------------------------------
needs_bf16_packing = pytest.mark.skipif(not packing_available(torch.bfloat16),
                                        reason="no native bfloat16 here (torch/oneDNN report no AVX512-BF16/AMX)")
needs_fp32_packing = pytest.mark.skipif(not packing_available(torch.float32),
                                        reason="this torch build has no oneDNN packed linear")


@needs_bf16_packing
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 40])
def test_packed_forwards_are_bit_identical_in_bfloat16(rows):
    """Packed weights change nothing in bfloat16: the verify forward's hidden states, the LM
    head's logits; and the base's own forward (outside the decoder) still runs F.linear."""
    plain, packed = tiny_llama(1, dtype=torch.bfloat16), tiny_llama(1, dtype=torch.bfloat16)
    assert use_packed_linears(packed)
    assert binding_module.binding(packed.model).linears  # bound beside the model, which keeps its plain layers
    assert not any(isinstance(m, PackedLinear) for m in packed.modules())
    assert packed.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(3, 96, (2, rows))
    mask = torch.ones_like(ids)
    _, hidden_plain = prefill(plain, ids, mask)
    _, hidden_packed = prefill(packed, ids, mask)
    assert torch.equal(hidden_plain, hidden_packed)
    states = torch.randn(2, rows, 32).to(torch.bfloat16)
    assert torch.equal(lm_logits(packed, states), plain.lm_head(states))
    assert torch.equal(packed(ids).logits, plain(ids).logits)


@needs_fp32_packing
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_packed_forwards_stay_within_float32_rounding(rows):
    plain, packed = tiny_llama(1, dtype=torch.float32), tiny_llama(1, dtype=torch.float32)
    use_packed_linears(packed)
    states = torch.randn(1, rows, 32)
    torch.testing.assert_close(lm_logits(packed, states), plain.lm_head(states), rtol=1e-5, atol=1e-5)
    ids = torch.randint(3, 96, (1, rows))
    torch.testing.assert_close(prefill(packed, ids, torch.ones_like(ids))[1], prefill(plain, ids, torch.ones_like(ids))[1],
                               rtol=1e-4, atol=1e-5)
    with packed_linears(False):  # outside the decoder's forwards: exactly F.linear
        assert torch.equal(packed(ids).logits, plain(ids).logits)


def test_float64_is_never_packed():
    model = tiny_llama(1)
    assert not use_packed_linears(model)
    assert binding_module.binding(model.model) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_tokens_is_argmax_with_first_index_on_ties(dtype):
    logits = torch.randn(3, 7, 500).to(dtype)
    logits[0, 0, [10, 20, 30]] = 100.0  # a three-way tie: the first index wins, as torch.argmax
    logits[2, 4, [499, 3]] = 50.0
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert int(greedy_tokens(logits)[0, 0]) == 10 and int(greedy_tokens(logits)[2, 4]) == 3


def test_float32_tree_decoding_follows_the_base_with_packed_weights():
    """float32 tiny model with packed forwards, trees of 2-8 slots: identical tokens (no
    near-tie in this model's 40 tokens: float32 rounding cannot reach a decision)."""
    model = tiny_llama(2, dtype=torch.float32)
    prompt = torch.tensor([[5, 17, 33, 8, 9]])
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
    for paths in ([(0,)], [(0,), (1,), (0, 0)], [(0,), (0, 0), (0, 0, 0), (1,), (2,), (1, 0), (0, 1)]):
        heads = OracleHeads([reference[0, 5:].tolist()], vocab=96, error=0.3, seed=4)
        ours = DraftHeadsModel(model, heads, tree=tree_from_paths(paths)).generate(prompt, max_new_tokens=40)
        assert ours.tolist() == reference.tolist()


def test_phase_timer_sees_every_phase_of_every_step():
    model = tiny_llama(0)
    prompt = torch.tensor([[5, 17, 33]])
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False)
    heads = OracleHeads([reference[0, 3:].tolist()], vocab=96, error=0.2)
    drafter = DraftHeadsModel(model, heads, tree=tree_from_paths([(0,), (0, 0)]))
    timer = PhaseTimer()
    assert drafter.generate(prompt, max_new_tokens=20, timer=timer).tolist() == reference.tolist()
    assert timer.steps == drafter.last_stats.steps > 0
    per_step = timer.per_step()
    assert all(per_step[p] > 0 for p in PHASES)
    assert per_step["total"] == pytest.approx(sum(per_step[p] for p in PHASES))


# -- the default tree per dtype ------------------------------------------------------------------
def test_default_budget_is_chosen_per_dtype():
    heads = OracleHeads([[1]], vocab=96)
    heads.config.default_budget = 4
    heads.config.default_budget_by_dtype = {"bfloat16": {"budget": 8}, "float32": {"budget": 2}}
    assert default_budget(heads, torch.bfloat16) == 8
    assert default_budget(heads, torch.float32) == 2
    assert default_budget(heads, torch.float64) == 4  # no choice recorded for float64: the general default
    assert default_budget(heads) == 4


# -- the streamer --------------------------------------------------------------------------------
class LetterTokenizer:
    """Token t decodes to chr(ord('a') + t % 26): enough to see which tokens were coloured."""

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in tokens)


def test_streamer_colours_accepted_drafts_only_on_a_terminal():
    out = io.StringIO()
    streamer = DraftColourStreamer(LetterTokenizer(), out, colour=True)
    streamer.put(torch.tensor([[0, 1, 2]]))  # the prompt: not printed
    streamer.put_step(torch.tensor([3]), 0)
    streamer.put_step(torch.tensor([4, 5, 6]), 2)
    streamer.end()
    assert out.getvalue() == f"d{DRAFT_COLOUR}e{RESET}{DRAFT_COLOUR}f{RESET}g\n"
    assert streamer.drafted_tokens == 2
    plain = io.StringIO()  # StringIO is not a tty: no escape codes by default
    streamer = DraftColourStreamer(LetterTokenizer(), plain)
    streamer.put_step(torch.tensor([4, 5, 6]), 2)
    assert plain.getvalue() == "efg"


def test_generate_tells_the_streamer_which_tokens_were_drafts():
    model = tiny_llama(1)
    prompt = torch.tensor([[7, 9, 11]])
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False)
    heads = OracleHeads([reference[0, 3:].tolist()], vocab=96, error=0.3, seed=2)
    drafter = DraftHeadsModel(model, heads, tree=tree_from_paths([(0,), (0, 0), (1,)]))
    streamer = DraftColourStreamer(LetterTokenizer(), io.StringIO(), colour=False)
    out = drafter.generate(prompt, max_new_tokens=30, streamer=streamer)
    assert out.tolist() == reference.tolist()
    assert streamer.tokens == reference[0, 3:].tolist()
    assert streamer.drafted_tokens == sum(drafter.last_stats.accepted) > 0


# -- calibration caches are per dtype and per machine ------------------------------------------------
def test_calibration_cache_is_never_shared_across_dtypes_or_cpus(monkeypatch):
    from draftheads.decoding import calibration
    from draftheads.decoding.calibration import CalibrationConfig, calibration_key, calibration_path

    config = CalibrationConfig()
    fp64, fp32 = tiny_llama(4), tiny_llama(4, dtype=torch.float32)
    key64, key32 = calibration_key(fp64), calibration_key(fp32)
    assert key64["dtype"] != key32["dtype"]
    assert calibration_path(key64, config) != calibration_path(key32, config)
    monkeypatch.setattr(calibration, "cpu_model", lambda: "Some Other CPU")
    other = calibration_key(fp32)
    assert "Some Other CPU" in other["device"]
    assert calibration_path(other, config) != calibration_path(key32, config)


# -- sibling projections stacked into one product ---------------------------------------------
@needs_bf16_packing
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_stacked_siblings_are_bit_identical_in_bfloat16(monkeypatch, rows):
    """q/k/v and gate/up computed as one product each (forced on, whatever the plan measured)
    leave the verify forward's hidden states bit-identical, and the stacked product did run."""
    stacked = tiny_llama(1, dtype=torch.bfloat16)
    use_packed_linears(stacked)
    products = binding_module.binding(stacked.model).products
    assert len(products) == 2 * stacked.config.num_hidden_layers
    calls = []
    real_output = siblings_module.SiblingProduct.output
    monkeypatch.setattr(siblings_module.SiblingProduct, "output",
                        lambda self, index, x: calls.append(index) or real_output(self, index, x))
    ids = torch.randint(3, 96, (2, rows))
    monkeypatch.setattr(plan_module.PLAN, "fusion_pays", lambda *a: False)
    _, hidden_plain = prefill(stacked, ids, torch.ones_like(ids))
    assert not calls
    monkeypatch.setattr(plan_module.PLAN, "fusion_pays", lambda *a: True)
    _, hidden_stacked = prefill(stacked, ids, torch.ones_like(ids))
    assert torch.equal(hidden_plain, hidden_stacked)
    assert sorted(set(calls)) == [0, 1, 2] and len(calls) == 5 * stacked.config.num_hidden_layers


@needs_fp32_packing
def test_a_sibling_takes_its_slice_once_and_only_for_the_same_input(monkeypatch):
    """The stacked product is reused only by a sibling called with the very tensor the first
    sibling saw, unchanged; another tensor, an in-place change or a second call recompute."""
    monkeypatch.setattr(siblings_module, "STACKED_DTYPES", (torch.float32,))
    monkeypatch.setattr(plan_module.PLAN, "fusion_pays", lambda *a: True)
    monkeypatch.setattr(siblings_module.SiblingProduct, "pays", lambda self, rows: True)
    parent = torch.nn.Module()
    for name, out in (("q_proj", 6), ("k_proj", 2), ("v_proj", 2)):
        parent.add_module(name, torch.nn.Linear(8, out, bias=False))
    binding_module.use_packed_linears(parent)
    (product,) = binding_module.fuse_siblings(parent)
    computed = []
    real_matmul = packed_module.packed_matmul
    counted = lambda *a, **k: computed.append(1) or real_matmul(*a, **k)
    for module in (siblings_module, binding_module):  # the stacked and the single products
        monkeypatch.setattr(module, "packed_matmul", counted)
    x, other = torch.randn(3, 8), torch.randn(3, 8)
    with binding_module.packed_forward(parent):
        q, k = parent.q_proj(x), parent.k_proj(x)
        assert len(computed) == 1
        k_other = parent.k_proj(other)
        assert len(computed) == 2
        x.mul_(2)
        v = parent.v_proj(x)
        assert len(computed) == 3
        again = parent.v_proj(x)
        assert len(computed) == 4
    for got, linear, inp in ((q, parent.q_proj, x / 2), (k, parent.k_proj, x / 2), (k_other, parent.k_proj, other),
                             (v, parent.v_proj, x), (again, parent.v_proj, x)):
        torch.testing.assert_close(got, torch.nn.functional.linear(inp, linear.weight), rtol=1e-5, atol=1e-6)
    assert product._input is None or product._outputs.count(None) < 3


def test_float32_siblings_stay_separate_and_groups_need_one_input_size():
    """Stacking is for 16-bit weights (in float32 it measured no faster); siblings of different
    input sizes are never grouped."""
    model = tiny_llama(1, dtype=torch.float32)
    use_packed_linears(model)
    assert binding_module.fuse_siblings(model.model) == []
    parent = torch.nn.Module()
    parent.gate_proj, parent.up_proj = torch.nn.Linear(8, 4).to(torch.bfloat16), torch.nn.Linear(6, 4).to(torch.bfloat16)
    assert siblings_module.sibling_groups(parent) == []


# -- padding slots left out of the linear layers ----------------------------------------------
@needs_fp32_packing
def test_linear_layers_compute_only_the_rows_asked_and_siblings_still_share_one_product(monkeypatch):
    """Under ``computed_rows``: each wrapped linear (siblings stacked or not) returns its rows as
    computed on the full input, zeros elsewhere; q/k/v still take their slices of one product."""
    monkeypatch.setattr(siblings_module, "STACKED_DTYPES", (torch.float32,))
    monkeypatch.setattr(siblings_module.SiblingProduct, "pays", lambda self, rows: True)
    parent = torch.nn.Module()
    for name, out in (("q_proj", 6), ("k_proj", 2), ("v_proj", 2), ("o_proj", 8)):
        parent.add_module(name, torch.nn.Linear(8, out, bias=name == "o_proj"))
    binding_module.use_packed_linears(parent)
    (product,) = binding_module.fuse_siblings(parent)
    computed = []
    real_matmul = packed_module.packed_matmul
    counted = lambda x, *a, **k: computed.append(x.shape[0]) or real_matmul(x, *a, **k)
    for module in (siblings_module, binding_module):  # the stacked and the single products
        monkeypatch.setattr(module, "packed_matmul", counted)
    x = torch.randn(2, 5, 8)
    valid = torch.tensor([[True, True, False, False, False], [True, True, True, True, False]])
    with binding_module.packed_forward(parent), rows_module.computed_rows(valid):
        outs = {name: getattr(parent, name)(x) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert computed[0] == int(valid.sum()) and len(computed) == 2  # one stacked q/k/v product, then o_proj
    for name, got in outs.items():
        linear = getattr(parent, name)
        full = torch.nn.functional.linear(x, linear.weight, linear.bias)
        torch.testing.assert_close(got[valid], full[valid], rtol=1e-5, atol=1e-6)
        assert not got[~valid].any()
    with rows_module.computed_rows(torch.ones(2, 5, dtype=torch.bool)):  # nothing to leave out: as outside
        assert torch.equal(parent.o_proj(x), torch.nn.functional.linear(x, parent.o_proj.weight, parent.o_proj.bias))
