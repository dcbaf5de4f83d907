"""What ``generate`` and ``from_pretrained`` are given: every bad input is refused before any
work with a clear error of the package's own type, naming the problem and the fix — never a
shape error from deep inside torch, a transformers traceback or a silent result. Arguments of
the wrong type are an ``InputTypeError`` (a project error, also a ``TypeError`` and a
``ValueError``) naming the argument; a lookup store that is named is checked even when the drafts
do not use it; what transformers accepts (``eos_token_id`` as a tensor) is accepted."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_llama
from draftheads.decoding import DraftHeadsModel, chain_tree, tree_from_paths
from draftheads.decoding.drafters import StoreError
from draftheads.core.errors import InputError, InputTypeError
from draftheads.decoding.input_checks import check_count, parse_tree_option
from draftheads.decoding.base.dtypes import parse_dtype
from draftheads.heads import DraftheadsError, HeadConfig, MedusaHeads

MODEL = tiny_llama(0, max_pos=64)


def drafter(tree=None) -> DraftHeadsModel:
    heads = MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96)).to(torch.float64)
    return DraftHeadsModel(MODEL, heads, tree=tree or tree_from_paths([[0], [1], [0, 0]]))


# -- generate() arguments, prompts, the context limit and trees -----------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    ({"max_new_tokens": 0}, "max_new_tokens.*(must be positive|greater than 0)"),
    ({"max_new_tokens": -3}, "max_new_tokens.*(must be positive|greater than 0)"),
    ({"num_beams": 4}, "num_beams=4.*not supported"),
    ({"do_sample": True, "guidance_scale": 1.5}, "guidance_scale=1.5.*not supported"),
    ({"acceptance": "typical"}, "acceptance=.*pass do_sample=True"),
    ({"frobnicate": 1}, "does not understand.*frobnicate"),
])
def test_bad_generate_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        drafter().generate(torch.tensor([[3, 4]]), **kwargs)


def test_empty_prompt():
    with pytest.raises(ValueError, match="prompt is empty"):
        drafter().generate(torch.zeros((1, 0), dtype=torch.long), max_new_tokens=4)


def test_prompt_at_context_limit():
    with pytest.raises(ValueError, match="at or over the model's context limit of 64"):
        drafter().generate(torch.full((1, 64), 5), max_new_tokens=4)


def test_generation_stops_at_context_limit():
    prompt = torch.full((1, 60), 5)
    out = drafter().generate(prompt, max_new_tokens=50)
    assert out.shape[1] == 64
    assert out.tolist() == MODEL.generate(prompt, max_new_tokens=4, do_sample=False).tolist()


def test_right_padded_batch_is_refused():
    with pytest.raises(ValueError, match="right-padded.*padding_side = 'left'"):
        drafter().generate(torch.tensor([[3, 4], [5, 0]]), attention_mask=torch.tensor([[1, 1], [1, 0]]),
                           max_new_tokens=4)


def test_streamer_needs_batch_size_one():
    with pytest.raises(ValueError, match="streamer needs batch size 1"):
        drafter().generate(torch.tensor([[3, 4], [5, 6]]), max_new_tokens=4, streamer=object())


def test_batch_with_an_empty_prompt():
    with pytest.raises(ValueError, match="prompt in the batch is empty"):
        drafter().generate(torch.tensor([[3, 4], [0, 0]]), attention_mask=torch.tensor([[1, 1], [0, 0]]),
                           max_new_tokens=4)


def test_tree_deeper_than_heads():
    heads = MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96))
    with pytest.raises(ValueError, match="3 deep but the checkpoint has only 2 heads"):
        heads.check_tree(chain_tree(3).spec)
    small = MedusaHeads(HeadConfig(num_heads=2, hidden_size=32, vocab_size=96, draft_vocab_size=4))
    with pytest.raises(ValueError, match="top-6 candidates but the heads draft from 4 tokens"):
        small.check_tree(tree_from_paths([[5]]).spec)


@pytest.mark.parametrize("paths,message", [
    ([[0, 1]], "has no parent \\[0\\]"),
    ([[0], [0]], "appears twice"),
    ([[0], [-1]], "non-negative integer ranks"),
    ([[]], "must not be empty"),
])
def test_bad_tree_paths(paths, message):
    with pytest.raises(ValueError, match=message):
        tree_from_paths(paths)


# -- generate() inputs: ids and mask ------------------------------------------------------------------
@pytest.mark.parametrize("ids,mask,error,message", [
    (torch.tensor([[3.0, 4.0]]), None, InputTypeError, "input_ids must hold integer token ids.*input_ids.long"),
    (torch.tensor([[3, 96]]), None, InputError, r"token id 96 is outside the vocabulary \[0, 96\)"),
    (torch.tensor([[-100, 4]]), None, InputError, r"token id -100 is outside the vocabulary.*pad id"),
    (torch.zeros((0, 3), dtype=torch.long), None, InputError, "the batch is empty.*at least one prompt"),
    (torch.tensor([[3, 4]]), [[1, 1]], InputTypeError, "attention_mask must be a torch.Tensor.*got list"),
    ([[3, 4]], None, InputTypeError, "input_ids must be a torch.Tensor.*got list.*return_tensors='pt'"),
    (torch.tensor([3, 4]), None, InputError, r"2-D tensor.*input_ids\[None\]"),
    (torch.tensor([[3, 4]], device="meta"), None, InputError, "input_ids is on meta but the base model is on cpu"),
    (torch.tensor([[3, 4]]), torch.ones((1, 2), device="meta"), InputError, "attention_mask is on meta"),
    (torch.tensor([[3, 4, 5]]), torch.tensor([[1, 2, 1]]), InputError, r"only 0 \(padding\) and 1.*got values \[2\]"),
    (torch.tensor([[3, 4, 5]]), torch.tensor([[0.5, 1.0, 1.0]]), InputError, r"got values \[0\.5\]"),
])
def test_bad_generate_inputs_are_refused(ids, mask, error, message):
    with pytest.raises(error, match=message):
        drafter().generate(ids, attention_mask=mask, max_new_tokens=4)


def test_a_bool_or_float_zero_one_mask_is_the_same_as_a_long_one():
    ids, mask = torch.tensor([[0, 3, 4], [5, 6, 7]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    reference = drafter().generate(ids, attention_mask=mask, max_new_tokens=6)
    assert torch.equal(drafter().generate(ids, attention_mask=mask.bool(), max_new_tokens=6), reference)
    assert torch.equal(drafter().generate(ids, attention_mask=mask.float(), max_new_tokens=6), reference)


# -- from_pretrained arguments ------------------------------------------------------------------------
@pytest.mark.parametrize("tree,error,message", [
    (2.5, InputTypeError, r"tree=2\.5 \(float\)"),
    (True, InputTypeError, r"tree=True \(bool\)"),
    ([[0], [1]], InputTypeError, r"tree=\[\[0\], \[1\]\] \(list\).*tree_from_paths|a Tree"),
    (-3, InputError, r"node budget.*must be ≥ 0, got -3"),
    ("-1", InputError, r"must be ≥ 0, got -1"),
    ("big", InputError, "expected 'adaptive' or a node budget"),
])
def test_bad_tree_argument_is_refused_before_loading(tree, error, message):
    with pytest.raises(error, match=message):
        DraftHeadsModel.from_pretrained(None, base=MODEL, tree=tree)


def test_tree_zero_and_string_budget_still_work():
    assert parse_tree_option("4") == 4 and parse_tree_option(0) == 0 and parse_tree_option(" Adaptive ") == "adaptive"


@pytest.mark.parametrize("dtype,error,message", [
    ("bogus", InputError, "dtype='bogus' is not a dtype draftheads knows; use one of.*bfloat16"),
    (torch.int64, InputError, "needs a floating dtype"),
    (3, InputTypeError, "dtype must be a torch.dtype or its name"),
])
def test_bad_dtype_is_refused_before_loading(dtype, error, message):
    with pytest.raises(error, match=message):
        DraftHeadsModel.from_pretrained(None, dtype=dtype)


def test_one_dtype_parser_for_every_spelling():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("torch.float16") is torch.float16
    assert parse_dtype("Float32") is torch.float32 and parse_dtype(torch.float64) is torch.float64


@pytest.mark.parametrize("path", ["/nonexistent/base-model", "./no-such-model", "weights/base.gguf"])
def test_missing_base_directory_is_one_clear_error(path):
    with pytest.raises(FileNotFoundError, match=f"base model '{path}' does not exist: pass an existing model"):
        DraftHeadsModel.from_pretrained(None, base_name_or_path=path)


@pytest.mark.parametrize("value,error", [(0, InputError), (-1, InputError), (2.0, InputTypeError), (True, InputTypeError)])
def test_counts_refuse_non_positive_and_non_integers(value, error):
    with pytest.raises(error, match="--limit must be"):
        check_count("--limit", value)


# -- arguments of the wrong type -----------------------------------------------------------------------
@pytest.mark.parametrize("drafts", [None, 42, ["heads", 42], ("heads", None), b"heads", {"heads"}, 1.5])
def test_drafts_of_the_wrong_type_name_the_argument(drafts):
    for call in (lambda: drafter().use_sources(drafts),
                 lambda: DraftHeadsModel.from_pretrained(None, base=MODEL, sources=drafts)):
        with pytest.raises(InputTypeError, match=rf"sources must be a str .* or a list/tuple of such names, got "
                                                 rf"{type(drafts).__name__}"):
            call()


@pytest.mark.parametrize("store", [42, 3.5, ["a.safetensors"], b"store.safetensors"])
def test_lookup_store_of_the_wrong_type_names_the_argument(store):
    for call in (lambda: drafter().use_sources("heads,context", lookup_store=store),
                 lambda: DraftHeadsModel.from_pretrained(None, base=MODEL, sources="context", lookup_store=store)):
        with pytest.raises(InputTypeError, match=rf"lookup_store must be a path .* got {type(store).__name__}"):
            call()


@pytest.mark.parametrize("drafts", ["heads", "heads,context"])
def test_a_named_lookup_store_is_checked_even_when_unused(tmp_path, drafts):
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(StoreError, match=rf"store file {missing} does not exist"):
        drafter().use_sources(drafts, lookup_store=missing)
    with pytest.raises(StoreError, match=rf"store file {missing} does not exist"):
        DraftHeadsModel.from_pretrained(None, base=MODEL, sources="context", lookup_store=missing)


@pytest.mark.parametrize("generator", [42, "seed", torch.tensor(3), object()])
def test_generator_must_be_a_torch_generator(generator):
    with pytest.raises(InputTypeError, match=rf"generator must be a torch.Generator .* got {type(generator).__name__}"):
        drafter().generate(torch.tensor([[3, 4]]), max_new_tokens=4, do_sample=True, generator=generator)


@pytest.mark.parametrize("shape", ["list", "1-d tensor", "0-d tensor"])
def test_eos_token_id_as_a_tensor_is_accepted_like_transformers(shape):
    ids = torch.tensor([[7, 3, 9, 4]])
    free = MODEL.generate(ids, max_new_tokens=12, do_sample=False)[0, 4:].tolist()
    stop = free[5]  # a token the answer reaches: it must end there
    eos = {"list": [2, stop], "1-d tensor": torch.tensor([2, stop]), "0-d tensor": torch.tensor(stop)}[shape]
    reference = MODEL.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    ours = drafter().generate(ids, max_new_tokens=12, eos_token_id=eos)
    assert ours.tolist() == reference.tolist() and ours.shape[1] < 16


def test_argument_errors_are_project_errors():
    assert issubclass(InputTypeError, DraftheadsError) and issubclass(InputTypeError, TypeError)
