"""Issue 27, class 8: arguments of the wrong type are refused naming the argument (an
``InputTypeError``: a project error, also a ``TypeError`` and a ``ValueError``), a lookup store
that is named is checked even when the drafts do not use it, and what transformers accepts
(``eos_token_id`` as a tensor) is accepted."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_llama
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.drafters import StoreError
from draftheads.decoding.limits import InputTypeError
from draftheads.heads import DraftheadsError, HeadConfig, MedusaHeads

MODEL = tiny_llama(0, max_pos=64)


def decoder() -> DraftHeadsModel:
    heads = MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96)).to(torch.float64)
    return DraftHeadsModel(MODEL, heads, tree=tree_from_paths([[0], [1], [0, 0]]))


@pytest.mark.parametrize("drafts", [None, 42, ["heads", 42], ("heads", None), b"heads", {"heads"}, 1.5])
def test_drafts_of_the_wrong_type_name_the_argument(drafts):
    for call in (lambda: decoder().use_drafts(drafts),
                 lambda: DraftHeadsModel.from_pretrained(None, base=MODEL, drafts=drafts)):
        with pytest.raises(InputTypeError, match=rf"drafts must be a str .* or a list/tuple of such names, got "
                                                 rf"{type(drafts).__name__}"):
            call()


@pytest.mark.parametrize("store", [42, 3.5, ["a.safetensors"], b"store.safetensors"])
def test_lookup_store_of_the_wrong_type_names_the_argument(store):
    for call in (lambda: decoder().use_drafts("heads,context", lookup_store=store),
                 lambda: DraftHeadsModel.from_pretrained(None, base=MODEL, drafts="context", lookup_store=store)):
        with pytest.raises(InputTypeError, match=rf"lookup_store must be a path .* got {type(store).__name__}"):
            call()


@pytest.mark.parametrize("drafts", ["heads", "heads,context"])
def test_a_named_lookup_store_is_checked_even_when_unused(tmp_path, drafts):
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(StoreError, match=rf"store file {missing} does not exist"):
        decoder().use_drafts(drafts, lookup_store=missing)
    with pytest.raises(StoreError, match=rf"store file {missing} does not exist"):
        DraftHeadsModel.from_pretrained(None, base=MODEL, drafts="context", lookup_store=missing)


@pytest.mark.parametrize("generator", [42, "seed", torch.tensor(3), object()])
def test_generator_must_be_a_torch_generator(generator):
    with pytest.raises(InputTypeError, match=rf"generator must be a torch.Generator .* got {type(generator).__name__}"):
        decoder().generate(torch.tensor([[3, 4]]), max_new_tokens=4, do_sample=True, generator=generator)


@pytest.mark.parametrize("shape", ["list", "1-d tensor", "0-d tensor"])
def test_eos_token_id_as_a_tensor_is_accepted_like_transformers(shape):
    ids = torch.tensor([[7, 3, 9, 4]])
    free = MODEL.generate(ids, max_new_tokens=12, do_sample=False)[0, 4:].tolist()
    stop = free[5]  # a token the answer reaches: it must end there
    eos = {"list": [2, stop], "1-d tensor": torch.tensor([2, stop]), "0-d tensor": torch.tensor(stop)}[shape]
    reference = MODEL.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    ours = decoder().generate(ids, max_new_tokens=12, eos_token_id=eos)
    assert ours.tolist() == reference.tolist() and ours.shape[1] < 16


def test_argument_errors_are_project_errors():
    assert issubclass(InputTypeError, DraftheadsError) and issubclass(InputTypeError, TypeError)
