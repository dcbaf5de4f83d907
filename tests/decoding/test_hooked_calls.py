"""A model carrying a forward hook or pre-hook — on a decoder layer, the LM head, the model object
itself, or one registered for every module — decodes token by token with the model's own loop,
with one warning naming the hooked module: draftheads runs the base's modules on several positions,
tree slots and packed rows at once (and never the model's own forward), so a hook written for
transformers' loop — one that edits ``output[:, -1]`` — would see other tensors there. Each case
gives transformers' own answer through both doors (``DraftHeadsModel.generate``, ``custom_generate``),
at batch size 1 and for a left-padded batch of 3; where the own loop cannot honour the call
(``generator=``) it is refused by name before any work. transformers' own output-capturing hooks
(installed on a first ``output_hidden_states``) are not a caller's: the trees stay
(decoding/request.py ``token_by_token``, decoding/base/forward.py ``hook_site``)."""
from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
from torch import nn

from draftheads import custom_generate
from draftheads.core.errors import InputError
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from helpers import OracleHeads, left_pad, saved_tree_heads, varied_llama

NEW = 8
PROMPTS = [[5, 17, 33, 8, 9, 5, 17], [40, 41, 42], [60, 61, 62, 63, 64]]
TREE = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)]
VOCAB, PAD = 96, 0


def vector(size: int, seed: int, scale: float) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def at_last_position(shift: torch.Tensor, fired: list) -> Callable:
    """A forward hook written for transformers' loop: it shifts the output's last position only."""
    def hook(module, args, output):
        fired.append(module)
        hidden = (output[0] if isinstance(output, tuple) else output).clone()
        hidden[:, -1] += shift.to(hidden.dtype)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
    return hook


def steering(fired: list) -> Callable:
    def pre_hook(module, args):
        fired.append(module)
        return (args[0] + vector(32, 2, 3.0).to(args[0].dtype),)
    return pre_hook


def biasing(fired: list) -> Callable:
    """A hook on the model object (``with_kwargs``, ``always_call``): its logits biased."""
    def hook(module, args, kwargs, output):
        fired.append(module)
        output.logits = output.logits + vector(VOCAB, 3, 4.0).to(output.logits.dtype)
        return output
    return hook


def on_the_norm(model, fired: list) -> Callable:
    shift = at_last_position(vector(32, 4, 3.0), fired)
    return lambda module, args, output: shift(module, args, output) if module is model.model.norm else None


#: case → (register the hook on the model, appending to ``fired`` when it runs → its handle; the warning's words)
HOOKS: dict[str, tuple[Callable, str]] = {
    "position-indexing hook on a decoder layer": (
        lambda m, fired: m.model.layers[1].register_forward_hook(at_last_position(vector(32, 1, 3.0), fired)),
        "a forward hook or pre-hook on model.layers.1 "),
    "pre-hook on the lm_head (steering)": (lambda m, fired: m.lm_head.register_forward_pre_hook(steering(fired)),
                                           "a forward hook or pre-hook on lm_head "),
    "global hook": (lambda m, fired: nn.modules.module.register_module_forward_hook(on_the_norm(m, fired)),
                    "registered for every module"),
    "hook on the model object": (lambda m, fired: m.register_forward_hook(biasing(fired), with_kwargs=True,
                                                                          always_call=True),
                                 "on the model itself (LlamaForCausalLM)"),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny model and its custom_generate callable; one torch thread while the module runs."""
    folder, threads = tmp_path_factory.mktemp("hooked"), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("DRAFTHEADS_CACHE", str(folder / "cache"))
            model = varied_llama()
            yield model, custom_generate(saved_tree_heads(folder / "heads", model), sources="heads,context", tree=3)
    finally:
        torch.set_num_threads(threads)


def prompt(batch: int) -> tuple[torch.Tensor, dict]:
    if batch == 1:
        return torch.tensor(PROMPTS[:1]), {}
    ids, mask = left_pad(PROMPTS, pad=PAD)
    return ids, {"attention_mask": mask}


def theirs(model, batch: int) -> list[list[int]]:
    ids, extra = prompt(batch)
    return model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **extra).tolist()


def ours(setup, form: str, batch: int, answer: list[list[int]], **kwargs):
    """One call through a door (drafts that know ``answer``), → (its tokens, the decoder's stats or
    None, the warnings saying it decodes token by token)."""
    model, fn = setup
    ids, extra = prompt(batch)
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": PAD, **extra, **kwargs}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if form == "custom_generate":
            output, stats = model.generate(ids, custom_generate=fn, **kwargs), None
        else:
            drafts = OracleHeads([row[ids.shape[1]:] for row in answer], vocab=VOCAB, error=0.1, seed=1)
            decoder = DraftHeadsModel(model, drafts, tree=tree_from_paths(TREE))
            output, stats = decoder.generate(ids, **kwargs), decoder.last_stats
    said = [str(w.message) for w in caught if "token by token" in str(w.message)]
    return output.tolist(), stats, said


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("form", ["api", "custom_generate"])
@pytest.mark.parametrize("case", list(HOOKS))
def test_a_hooked_model_gives_transformers_answer_with_one_warning(setup, case, form, batch):
    model, _ = setup
    plain = theirs(model, batch)
    register, words = HOOKS[case]
    fired: list = []
    handle = register(model, fired)
    try:
        expected = theirs(model, batch)
        assert expected != plain and fired, "the hook must change transformers' answer"
        tokens, stats, said = ours(setup, form, batch, expected)
        assert tokens == expected
        assert len(said) == 1 and words in said[0] and "\n" not in said[0], said
        assert stats is None or stats.delegated
    finally:
        handle.remove()
    tokens, stats, said = ours(setup, form, batch, plain)  # the hook gone: the trees again, no word
    assert tokens == plain and not said
    assert stats is None or sum(stats.accepted) > 0


@pytest.mark.parametrize("case", list(HOOKS))
def test_a_seeded_generator_is_refused_naming_the_hook_before_any_work(setup, case):
    model, _ = setup
    register, words = HOOKS[case]
    fired: list = []
    handle = register(model, fired)
    try:
        with pytest.raises(InputError, match="generator=") as err:
            ours(setup, "api", 3, [[]] * 3, do_sample=True, generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    assert words in str(err.value) and "\n" not in str(err.value)
    assert not fired, "the model ran before the refusal"


def test_transformers_own_output_capturing_hooks_keep_the_trees(setup):
    """transformers installs hooks of its own on the layers at a first ``output_hidden_states``:
    they only record, during a forward that asks, so the call still decodes with draft trees."""
    model, _ = setup
    model(torch.tensor(PROMPTS[:1]), output_hidden_states=True)
    assert any(m._forward_hooks for m in model.modules())
    expected = theirs(model, 3)
    tokens, stats, said = ours(setup, "api", 3, expected)
    assert tokens == expected and not said and sum(stats.accepted) > 0
