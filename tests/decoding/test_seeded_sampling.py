"""Seeded sampling is reproducible (decoding/accept.py, :class:`PositionUniforms`): the same seed
and call give the same tokens, bs 1 and a left-padded batch, through ``DraftHeadsModel.generate``
and ``custom_generate`` — also on the first call, which builds the decoder, and while the
drafters and the policy carry what earlier calls taught them. A row's t-th token is decided by
its own uniform, so the tokens do not depend on the trees at all."""
from __future__ import annotations

import pytest
import torch

from draftheads import custom_generate
from draftheads.decoding import DraftHeadsModel
from helpers import left_pad, saved_tree_heads, tiny_llama

PROMPTS = {"bs1": [[5, 17, 33, 8, 9, 5, 17, 33]], "bs3": [[3, 5, 9, 13, 21, 3, 5], [7, 8], [40, 41, 42, 40, 41]]}
SAMPLING = dict(do_sample=True, temperature=0.7, top_k=20, max_new_tokens=24, pad_token_id=0)


@pytest.fixture()
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))
    model = tiny_llama(0)
    with torch.no_grad():
        model.model.norm.weight.mul_(4)  # peaked enough that drafts are accepted, still random
    return model, saved_tree_heads(tmp_path / "heads", model)


def _seeded(generate, repeats: int) -> set[str]:
    """The distinct answers of ``repeats`` calls, each after ``torch.manual_seed(5)``."""
    answers = set()
    for _ in range(repeats):
        torch.manual_seed(5)
        answers.add(str(generate().tolist()))
    return answers


@pytest.mark.parametrize("batch", ["bs1", "bs3"])
def test_one_seeded_custom_generate_call_repeated_gives_one_answer(setup, batch):
    """20 repeats (the first builds the decoder and loads the heads) of one seeded call."""
    model, heads = setup
    fn = custom_generate(heads, sources="heads,context", tree=3)
    ids, mask = left_pad(PROMPTS[batch])
    answers = _seeded(lambda: model.generate(ids, attention_mask=mask, custom_generate=fn, **SAMPLING), 20)
    assert len(answers) == 1


@pytest.mark.parametrize("batch", ["bs1", "bs3"])
def test_one_seeded_api_call_repeated_gives_one_answer(setup, batch):
    model, heads = setup
    decoder = DraftHeadsModel.from_pretrained(heads, base=model, sources="heads,context", tree=3)
    ids, mask = left_pad(PROMPTS[batch])
    answers = _seeded(lambda: decoder.generate(ids, attention_mask=mask, **SAMPLING), 20)
    assert len(answers) == 1


def test_the_tokens_do_not_depend_on_the_trees(setup):
    """One generator seed, three ways of drafting (plain steps, a 3-node tree, merged lookups and
    heads): the same tokens — the trees decide how many tokens a step emits, never which."""
    model, heads = setup
    ids, mask = left_pad(PROMPTS["bs3"])
    answers, taus = set(), []
    for options in (dict(tree=0, sources="heads"), dict(tree=3, sources="heads"), dict(tree=3, sources="heads,context")):
        decoder = DraftHeadsModel.from_pretrained(heads, base=model, **options)
        out = decoder.generate(ids, attention_mask=mask, generator=torch.Generator().manual_seed(3), **SAMPLING)
        answers.add(str(out.tolist()))
        taus.append(decoder.last_stats.tau)
    assert len(answers) == 1
    assert taus[0] == 1.0 and min(taus[1:]) > 1.0  # plain steps, then trees whose drafts were accepted


def test_consecutive_unseeded_calls_still_differ(setup):
    model, heads = setup
    decoder = DraftHeadsModel.from_pretrained(heads, base=model, tree=3, sources="heads")
    ids, mask = left_pad(PROMPTS["bs3"])
    torch.manual_seed(5)
    first, second = (decoder.generate(ids, attention_mask=mask, **SAMPLING).tolist() for _ in range(2))
    assert first != second
