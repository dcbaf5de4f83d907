"""The user's model stays theirs. Binding draftheads to a model (one ``custom_generate`` call)
changes nothing in it: its layers' types, ``__dict__``, state dict and hooks are what its owner
built, so ``copy.deepcopy``, ``pickle``, ``torch.save`` and type-based layer search
(``quantize_dynamic``, peft's ``target_modules``) see plain layers; ``unbind`` releases what
draftheads keeps beside it. And every later call decodes with the weights as they are then, however
they were changed — through ``.data`` too, which moves no version counter — on each fast path:
oneDNN-packed copies, the few-row kernel's blocked copies, stacked sibling products."""
from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
from torch import nn

from draftheads import custom_generate
from draftheads.custom_generate import _DECODERS, unbind
from draftheads.decoding.base import binding as binding_module, fewrow, packed as packed_module
from draftheads.decoding.base import packing as packing_module, plan as plan_module, siblings as siblings_module
from draftheads.decoding.base.binding import PackedLinear
from draftheads.decoding.base.packed import PackedWeight
from draftheads.decoding.base.plan import PackingPlan, packing_available
from helpers import saved_tree_heads, tiny_llama

IDS = torch.tensor([[5, 17, 33, 8, 9, 5, 17, 33]])
#: how the decoder's products run, forced whatever this machine measured
PATHS = ["packed", "fewrow", "stacked"]


@pytest.fixture(params=PATHS)
def bound(request, monkeypatch, tmp_path):
    """A float32 tiny Llama, its heads' folder and a custom_generate callable; every product of
    the decoder's forwards takes the path named by the parameter (timings are not measured: the
    plan is a fresh one told the answer)."""
    if not packing_available(torch.float32):
        pytest.skip("this torch build has no oneDNN packed linear")
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    if request.param == "fewrow" and not fewrow.load_kernel(tmp_path / "kernels"):
        pytest.skip(f"the few-row kernel is off here ({fewrow.kernel_status()})")
    plan = PackingPlan()
    monkeypatch.setattr(plan, "path_of", lambda key, rows, kind=None: "fewrow" if request.param == "fewrow" else "packed")
    for module in (plan_module, packed_module, siblings_module, packing_module):  # each reads the plan
        monkeypatch.setattr(module, "PLAN", plan)
    monkeypatch.setattr(packing_module, "measure_shape", lambda dtype, out, inp, **_: {
        name: [1.0] * len(plan_module.ROW_BUCKETS) for name in ("linear_ms", "packed_ms", "fewrow_ms")})
    if request.param == "stacked":
        monkeypatch.setattr(siblings_module, "STACKED_DTYPES", (torch.float32,))
        monkeypatch.setattr(siblings_module.SiblingProduct, "pays", lambda self, rows: True)
    model = lively_llama(0)
    heads = saved_tree_heads(tmp_path / "heads", model)
    return model, custom_generate(heads, sources="heads", tree=3), request.param


def lively_llama(seed: int) -> nn.Module:
    """A float32 tiny Llama whose answer depends on every layer: :func:`tiny_llama`'s init
    (std 0.02) leaves the residual stream to the embeddings, so most weights could change
    unseen; std 0.3 makes each layer count."""
    model = tiny_llama(seed, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


def products_taken(monkeypatch) -> list:
    """Every product the decoder's layers computed through a copy, appended as they run."""
    taken: list = []
    real = packed_module.packed_matmul
    counted = lambda *a, **k: taken.append(1) or real(*a, **k)
    for module in (siblings_module, binding_module):  # the stacked and the single products
        monkeypatch.setattr(module, "packed_matmul", counted)
    return taken


def ours(model, fn, **kwargs) -> list:
    return model.generate(IDS, max_new_tokens=16, do_sample=False, custom_generate=fn, **kwargs).tolist()


def theirs(model) -> list:
    return model.generate(IDS, max_new_tokens=16, do_sample=False).tolist()


def layout(model: nn.Module) -> dict:
    """What the owner built, module by module: type, attribute names, hooks, parameter tensors."""
    return {name: (type(m), sorted(vars(m)), len(m._forward_hooks), len(m._forward_pre_hooks),
                   {k: (p.data_ptr(), p.dtype, tuple(p.shape)) for k, p in m._parameters.items() if p is not None})
            for name, m in model.named_modules()}


def a_users_hook(module, args, output) -> None:
    """A forward hook of the owner's (module-level: a pickled model keeps it)."""


def plain_linears(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m) is nn.Linear]


# -- nothing in the model changes ---------------------------------------------------------------
def test_a_bound_model_is_exactly_what_its_owner_built(bound, monkeypatch):
    model, fn, _ = bound
    model.model.layers[0].mlp.down_proj.register_forward_hook(a_users_hook)
    before, state = layout(model), {k: v.clone() for k, v in model.state_dict().items()}
    taken = products_taken(monkeypatch)
    assert ours(model, fn) == theirs(model)
    assert taken  # the fast path ran, in the very layers the model holds
    assert layout(model) == before
    assert model.config._attn_implementation == "sdpa"  # packed attention is switched inside our forwards only
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    linears = plain_linears(model)
    assert len(linears) == 2 * 7 + 1  # and the LM head
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert plain_linears(clone) == linears and theirs(clone) == theirs(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert plain_linears(torch.load(buffer, weights_only=False)) == linears
    quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    assert len([m for m in quantized.modules() if type(m) is torch.ao.nn.quantized.dynamic.Linear]) == len(linears)


def test_the_packed_class_is_worn_only_while_the_decoder_runs(bound):
    """Inside the decoder's forwards the layers compute through the copies; after a call —
    also one that failed part-way — each is a plain ``nn.Linear`` again, and the model's own
    forward never takes the packed path."""
    model, fn, _ = bound
    layer = model.model.layers[1].self_attn.o_proj
    seen = []
    layer.register_forward_pre_hook(lambda module, args: seen.append((type(module), binding_module.packing_active())))
    ours(model, fn)
    assert (PackedLinear, True) in seen and type(layer) is nn.Linear

    class Failing:
        def __init__(self):
            self.calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls == 3:
                raise KeyboardInterrupt

        def end(self):
            pass

    with pytest.raises(KeyboardInterrupt):
        ours(model, fn, streamer=Failing())
    assert all(type(model.get_submodule(name)) is nn.Linear for name in plain_linears(tiny_llama(0)))
    assert not binding_module._LIVE
    seen.clear()
    model(IDS)
    assert seen == [(nn.Linear, False)]


def test_unbind_releases_everything_and_a_deleted_model_is_freed(bound):
    model, fn, _ = bound
    ours(model, fn)
    assert model in _DECODERS and model in packing_module._PACKED_BASES
    assert binding_module.binding(model.model) is not None
    heads = next(iter(_DECODERS[model].values())).heads
    unbind(model)
    assert model not in _DECODERS and model not in packing_module._PACKED_BASES
    assert binding_module.binding(model.model) is None and binding_module.binding(heads) is None
    assert model.config._attn_implementation == "sdpa"
    assert ours(model, fn) == theirs(model)  # binds again
    other = lively_llama(0)  # (the fixture's model is held by pytest)
    assert ours(other, fn) == theirs(other)
    gone = weakref.ref(other)
    del other
    gc.collect()
    assert gone() is None  # nothing draftheads keeps holds a model it decoded for


# -- the weights are what they are now ---------------------------------------------------------
def lora_merge(model):
    for w in (model.model.layers[0].self_attn.q_proj.weight, model.model.layers[1].mlp.down_proj.weight):
        a, b = torch.randn(w.shape[0], 2), torch.randn(2, w.shape[1])
        w.data += a @ b


def ema_update(model):
    for p in model.model.layers[1].parameters():
        p.data.mul_(0.2).add_(torch.randn_like(p), alpha=0.8)


def fsdp_copy(model):
    w = model.model.layers[0].mlp.gate_proj.weight
    w.data.copy_(torch.randn_like(w))


def one_element(model):
    model.model.layers[1].mlp.down_proj.weight.data[5, 7] += 400.0


def rows_swapped(model):
    w = model.model.layers[1].self_attn.o_proj.weight
    w.data[[0, 3, 9]] = w.data[[9, 0, 3]].clone() * -1


def new_storage(model):
    w = model.model.layers[0].self_attn.v_proj.weight
    w.data = torch.randn_like(w)


def tied_lm_head(model):
    model.lm_head.weight.data[:, :16] = torch.randn(model.lm_head.weight.shape[0], 16)


def state_dict_loaded(model):
    model.load_state_dict(lively_llama(7).state_dict())


def layer_replaced(model):
    old = model.model.layers[0].mlp.up_proj
    model.model.layers[0].mlp.up_proj = nn.Linear(old.in_features, old.out_features, bias=False)


CHANGES = [lora_merge, ema_update, fsdp_copy, one_element, rows_swapped, new_storage, tied_lm_head,
           state_dict_loaded, layer_replaced]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__)
def test_a_changed_weight_is_decoded_as_it_is_now(bound, change):
    """Whatever changed a weight between two calls, the second decodes with it as it is now
    (each change here alters the model's own answer, so a stale copy would show)."""
    model, fn, _ = bound
    before = theirs(model)
    assert ours(model, fn) == before
    torch.manual_seed(1)
    with torch.no_grad():
        change(model)
    after = theirs(model)
    assert after != before
    assert ours(model, fn) == after


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("edit", ["one bit", "rows swapped", "columns swapped", "added through .data", "same values"])
def test_a_copy_is_dropped_exactly_when_its_weights_bytes_changed(dtype, edit):
    """The check behind it, on every dtype: any changed byte — one bit of one element, rows or
    columns trading places — drops the copy; writing back the same values keeps it."""
    weight = torch.randn(24, 18).to(dtype)
    copies = PackedWeight()
    copies._copy("test", weight, lambda w: w.clone())
    bits = weight.data.view(torch.int16 if dtype != torch.float32 else torch.int32)
    if edit == "one bit":
        bits[7, 11] ^= 1
    elif edit == "rows swapped":
        weight.data[[2, 5]] = weight.data[[5, 2]].clone()
    elif edit == "columns swapped":
        weight.data[:, [1, 4]] = weight.data[:, [4, 1]].clone()
    elif edit == "added through .data":
        weight.data += 1e-3
    else:
        weight.data.copy_(weight.data.clone())
    assert weight._version == 0  # nothing but the bytes shows these edits
    assert copies.drop_stale(weight) == (edit != "same values")


# -- both, as a user of peft and TRL would go -------------------------------------------------------
def test_bind_then_copy_pickle_quantize_and_merge_a_lora_then_decode_as_the_model_does(bound, monkeypatch):
    model, fn, _ = bound
    before = theirs(model)
    assert ours(model, fn) == before
    linears = plain_linears(model)
    reference_model = copy.deepcopy(model)  # TRL's reference model
    restored = pickle.loads(pickle.dumps(model))
    quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    assert len([m for m in quantized.modules() if type(m) is torch.ao.nn.quantized.dynamic.Linear]) == len(linears)
    torch.manual_seed(3)
    with torch.no_grad():
        lora_merge(model)
    assert theirs(model) != before
    taken = products_taken(monkeypatch)
    assert ours(model, fn) == theirs(model) and taken
    for other in (reference_model, restored):  # the copies decode as they are, and as the model did
        assert ours(other, fn) == theirs(other) == before
