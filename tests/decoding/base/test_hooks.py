"""What a user adds to their model after draftheads bound it — a forward hook or pre-hook, a
parametrization, weight norm, an adapter swapped in for a layer — on the LM head or on a layer
inside the body, registered after the decoder was built and used: each call sees it and gives
transformers' own answer (float32 greedy, every product forced onto the packed path, bs 1 and a
left-padded batch of 3, ``DraftHeadsModel.generate`` and ``custom_generate``); a call on a model
carrying a hook decodes token by token with its own loop (tests/decoding/test_hooked_calls.py)."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from draftheads import custom_generate
from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.base import plan
from helpers import left_pad, saved_tree_heads, tiny_llama

NEW = 12
PROMPTS = {1: [[5, 17, 33, 8, 9, 5, 17, 33]], 3: [[3, 5, 9, 13, 21, 3, 5], [7, 8], [40, 41, 42, 40, 41]]}


def _vector(size: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed)) * scale


class Scale(nn.Module):
    """A parametrization: each output row of the weight scaled by its own factor."""

    def __init__(self, rows: int):
        super().__init__()
        self.register_buffer("factor", 1 + _vector(rows, 7, 6.0).abs())

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.factor[:, None]


class LowRank(nn.Module):
    """An adapter swapped in for a linear layer (as peft's LoRA layers are): the layer's output
    plus a low-rank update; ``weight`` still reads the wrapped layer's."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        self.down = nn.Parameter(_vector(base.in_features * 2, 3, 2.0).view(2, base.in_features))
        self.up = nn.Parameter(_vector(base.out_features * 2, 4, 2.0).view(base.out_features, 2))

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.down.T @ self.up.T


def _weight_norm_then_change(module: nn.Module, dim: int) -> None:
    """weight_norm (its pre-hook recomputes the weight at each forward), then its magnitudes changed
    (the tied LM head's norms are over its input features: its padding row is zero)."""
    nn.utils.weight_norm(module, dim=dim)
    factors = _vector(module.weight_g.numel(), 9, 3.0) if dim == 1 else 1 + _vector(module.weight_g.numel(), 9, 6.0).abs()
    with torch.no_grad():
        module.weight_g.mul_(factors.view_as(module.weight_g))


#: each case: what the user does to their model after binding (returns a handle to remove, or None)
CASES: dict[str, Callable] = {
    "lm_head pre-hook (steering)": lambda m: m.lm_head.register_forward_pre_hook(
        lambda mod, args: (args[0] + _vector(32, 1, 3.0).to(args[0].dtype),)),
    "lm_head forward hook": lambda m: m.lm_head.register_forward_hook(
        lambda mod, args, out: out + _vector(96, 2, 4.0).to(out.dtype)),
    "global pre-hook on the lm_head": lambda m: nn.modules.module.register_module_forward_pre_hook(
        lambda mod, args: (args[0] + _vector(32, 1, 3.0).to(args[0].dtype),) if mod is m.lm_head else None),
    "lm_head parametrization": lambda m: _parametrized(m.lm_head, Scale(96)),
    "lm_head new-style weight_norm": lambda m: _parametrized_norm(m.lm_head),
    "lm_head weight_norm": lambda m: _weight_norm_then_change(m.lm_head, dim=1),
    "lm_head swapped for an adapter": lambda m: setattr(m, "lm_head", LowRank(m.lm_head)),
    "inner pre-hook": lambda m: m.model.layers[1].mlp.down_proj.register_forward_pre_hook(
        lambda mod, args: (args[0] + _vector(64, 5, 2.0).to(args[0].dtype),)),
    "inner forward hook": lambda m: m.model.layers[0].self_attn.o_proj.register_forward_hook(
        lambda mod, args, out: out + _vector(32, 6, 2.0).to(out.dtype)),
    "inner parametrization (a q/k/v sibling)": lambda m: _parametrized(m.model.layers[1].self_attn.v_proj, Scale(16)),
    "inner weight_norm": lambda m: _weight_norm_then_change(m.model.layers[1].self_attn.o_proj, dim=0),
    "inner layer swapped for an adapter (a gate/up sibling)": lambda m: setattr(
        m.model.layers[0].mlp, "up_proj", LowRank(m.model.layers[0].mlp.up_proj)),
}


def _parametrized(module: nn.Module, parametrization: nn.Module) -> None:
    parametrize.register_parametrization(module, "weight", parametrization)


def _parametrized_norm(module: nn.Module) -> None:
    nn.utils.parametrizations.weight_norm(module, dim=1)
    with torch.no_grad():
        original = module.parametrizations.weight.original0
        original.mul_(_vector(original.numel(), 8, 3.0).view_as(original))


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    return saved_tree_heads(tmp_path_factory.mktemp("hooks") / "heads", tiny_llama(0, dtype=torch.float32))


@pytest.fixture(autouse=True)
def packed_everywhere(monkeypatch):
    """Every product of every shape takes the packed path (where the hooks were ignored)."""
    monkeypatch.setattr(plan.PLAN, "path_of", lambda key, rows, kind=None: "packed")


def _reference(model, prompt) -> list:
    """transformers' own greedy answer."""
    ids, mask = left_pad(prompt)
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0).tolist()


def _call(form: str, model, decoder, ids, mask):
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    if form == "api":
        return decoder.generate(ids, **kwargs)
    return model.generate(ids, custom_generate=decoder, **kwargs)


def _bound(form: str, heads, model):
    """The decoder (API) or callable, built and used once on ``model`` before the user's change."""
    decoder = (DraftHeadsModel.from_pretrained(heads, base=model, tree=3, sources="heads") if form == "api"
               else custom_generate(heads, tree=3, sources="heads"))
    for ids, mask in (left_pad(p) for p in PROMPTS.values()):
        _call(form, model, decoder, ids, mask)
    return decoder


@pytest.mark.parametrize("form", ["api", "custom_generate"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_change_made_after_binding_gives_transformers_answer(heads, tmp_path, monkeypatch, case, form):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    model = tiny_llama(0, dtype=torch.float32)
    decoder = _bound(form, heads, model)
    before = {batch: _reference(model, prompt) for batch, prompt in PROMPTS.items()}
    handle = CASES[case](model)
    try:
        for batch, prompt in PROMPTS.items():
            ours = _call(form, model, decoder, *left_pad(prompt)).tolist()  # first: nothing ran the change yet
            expected = _reference(model, prompt)
            assert expected != before[batch], "the change must change transformers' answer"
            assert ours == expected, (case, form, batch)
    finally:
        if handle is not None:
            handle.remove()


@pytest.mark.parametrize("form", ["api", "custom_generate"])
def test_a_hook_on_the_model_itself_decodes_with_the_models_own_loop(heads, tmp_path, monkeypatch, form):
    """The decoder never runs the causal LM's own forward: with a hook there the call decodes token
    by token with the model's own loop (one warning naming it), so the hook runs as it would there."""
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    model = tiny_llama(0, dtype=torch.float32)
    decoder = _bound(form, heads, model)
    before = _reference(model, PROMPTS[3])

    def bias(module, args, output):
        output.logits = output.logits + _vector(96, 2, 4.0).to(output.logits.dtype)
        return output

    hooks = {"forward hook": lambda: model.register_forward_hook(bias),
             "pre-hook": lambda: model.register_forward_pre_hook(lambda module, args: None)}
    for kind, register in hooks.items():
        handle = register()
        try:
            expected = _reference(model, PROMPTS[3])
            assert (expected != before) == (kind == "forward hook")  # the bias changes transformers' answer
            with pytest.warns(UserWarning, match=r"on the model itself \(LlamaForCausalLM\).*token by token"):
                assert _call(form, model, decoder, *left_pad(PROMPTS[3])).tolist() == expected, kind
        finally:
            handle.remove()
    assert _call(form, model, decoder, *left_pad(PROMPTS[1])).shape[1] == len(PROMPTS[1][0]) + NEW  # hooks gone
