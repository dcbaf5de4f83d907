"""A draft source is one registration (decoding/drafters/registry.py): a toy source registered
here, in the test alone, drafts through the public API (``DraftHeadsModel.generate``, alone and
merged with heads) with output token-identical to transformers' greedy ``generate`` on a tiny
random Llama (float64), and every table that lists sources — ``sources=`` names, the CLI's
``--sources`` help and check, the hit-rate priors, ``sources="auto"`` — lists it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import pytest
import torch

from draftheads.cli import build_parser
from draftheads.decoding import DraftHeadsModel
from draftheads.decoding.drafters import (CandidateBatch, Candidates, HitRate, MergedDrafter, SourceSpec, auto_sources,
                                          count_trie, default_q, lookup_names, parse_sources, register, source_id,
                                          source_names, unregister)
from draftheads.arguments import sources_argument
from draftheads.core.errors import DraftheadsError, InputError
from helpers import OracleHeads, left_pad, tiny_llama

BUILT_IN = ("heads", "context", "store", "stats")


@dataclass(frozen=True)
class RepeatConfig:
    period: int = 1  # the chain repeats the row's last ``period`` tokens
    max_depth: int = 6
    eos_token_id: int | None = None


def repeat_prior(bucket: int) -> float:
    return 0.5


class RepeatSource:
    """One row: proposes its last ``period`` tokens repeated, as one chain."""

    def __init__(self, prompt: Sequence[int], config: RepeatConfig):
        self.history, self.config = [int(t) for t in prompt], config

    def extend(self, tokens: Sequence[int]) -> None:
        self.history.extend(int(t) for t in tokens)

    def propose(self, budget: int) -> Candidates:
        cfg = self.config
        tail = self.history[-cfg.period:]
        chain = [tail[i % len(tail)] for i in range(min(cfg.max_depth, budget))] if tail else []
        if cfg.eos_token_id in chain:
            chain = chain[: chain.index(cfg.eos_token_id) + 1]
        return count_trie([chain] if chain else [], source_id("repeat"), cfg.period, repeat_prior(cfg.period))

    @staticmethod
    def propose_rows(sources: Sequence["RepeatSource | None"], budget: int) -> CandidateBatch:
        return CandidateBatch.from_rows([Candidates.empty() if s is None else s.propose(budget) for s in sources])


@pytest.fixture
def repeat_source():
    """The toy source, registered for one test (the one line a new source takes)."""
    spec = register(SourceSpec("repeat", repeat_prior, RepeatConfig, start=lambda prompt, config, shared:
                               RepeatSource(prompt, config), propose_rows=RepeatSource.propose_rows))
    yield spec
    unregister("repeat")
    assert source_names() == BUILT_IN


def test_the_built_in_sources_keep_their_names_order_and_priors():
    assert source_names() == BUILT_IN and lookup_names() == BUILT_IN[1:]
    assert [source_id(name) for name in BUILT_IN] == [0, 1, 2, 3]  # the merge's tie-break order
    assert default_q(source_id("heads"), 5) == 1.0 and default_q(source_id("stats"), 1) == 0.4
    assert default_q(source_id("context"), 2) == pytest.approx(0.55) and default_q(source_id("context"), 9) == 0.9
    assert default_q(source_id("store"), 2) == pytest.approx(0.36) and default_q(source_id("store"), 9) == 0.8


def test_a_registered_source_joins_every_table(repeat_source, capsys):
    assert source_names() == BUILT_IN + ("repeat",) and source_id("repeat") == 4
    assert parse_sources("all") == BUILT_IN + ("repeat",)
    assert parse_sources("repeat, heads") == sources_argument("heads,repeat") == ("heads", "repeat")
    assert build_parser().parse_args(["generate", "--prompt", "hi", "--sources", "repeat"]).sources == ("repeat",)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    assert "heads,context,store,stats,repeat" in capsys.readouterr().out
    hitrate = HitRate()
    assert hitrate.q(source_id("repeat"), 3) == default_q(source_id("repeat"), 3) == 0.5
    assert auto_sources(None) == ("context", "repeat")  # it needs nothing loaded
    with pytest.raises(ValueError, match="registered already"):
        register(SourceSpec("repeat", repeat_prior))
    with pytest.raises(ValueError, match="comma-separated subset of heads, context, store, stats, repeat"):
        parse_sources("heads,echo")


def test_a_registered_source_drafts_through_generate_identically_to_greedy(repeat_source):
    """This tiny base answers one token repeated: the toy's chains are accepted, so the steps
    are fewer than the tokens, and every token is the base's own."""
    base = tiny_llama(3)
    prompt = torch.tensor([[7, 21, 40, 9, 12, 55, 3, 8] * 4])
    reference = base.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False)
    model = DraftHeadsModel(base, None)
    model.use_sources("repeat")
    assert isinstance(model.drafter, MergedDrafter) and model.drafter.lookup.sources == ("repeat",)
    assert model.generate(prompt, max_new_tokens=40).tolist() == reference.tolist()
    assert sum(model.last_stats.accepted) > 20 and model.last_stats.steps < 20

    ids, mask = left_pad([[5, 6, 7] * 5, [9, 10, 11, 12] * 3])
    batch_reference = base.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    continuations = batch_reference[:, ids.shape[1]:].tolist()
    merged = DraftHeadsModel(base, OracleHeads(continuations, vocab=96, error=0.3, seed=0))
    merged.use_sources("heads,repeat")
    assert merged.drafter.heads is merged.heads and merged.drafter.lookup.sources == ("repeat",)
    assert merged.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0).tolist() == \
        batch_reference.tolist()


def repeat_start(prompt, config, shared):
    return RepeatSource(prompt, config)


@pytest.mark.parametrize("spec,error,line", [
    ("heads", TypeError, "register() takes a SourceSpec, got str 'heads': build one with "
     "draftheads.decoding.drafters.SourceSpec(name, prior, config, start=..., propose_rows=...)."),
    (SourceSpec(3, repeat_prior, RepeatConfig, repeat_start, RepeatSource.propose_rows), TypeError,
     "Draft source name 3 (int): a source's name is a str, a lowercase word such as 'repeat'."),
    (SourceSpec("echo", 0.5, RepeatConfig, repeat_start, RepeatSource.propose_rows), TypeError,
     "Draft source 'echo': prior=0.5 is not callable; pass a function (see SourceSpec's docstring for its arguments)."),
    (SourceSpec("echo", repeat_prior, RepeatConfig, repeat_start, RepeatSource.propose_rows, needs="store"),
     ValueError, "Draft source 'echo' needs 'store'; a source needs a tuple of ['heads', 'store'] (or () for nothing)."),
    (SourceSpec("echo", repeat_prior, RepeatConfig, repeat_start, RepeatSource.propose_rows, static=1), TypeError,
     "Draft source 'echo': static=1: expected True or False."),
    (SourceSpec("echo", repeat_prior), ValueError, "Draft source 'echo' has no start(): only the heads draft without "
     "one; a new source drafts from each row's text, so give it start, propose_rows and a config dataclass."),
])
def test_a_bad_registration_is_one_line_naming_the_source(spec, error, line):
    with pytest.raises(error) as raised:
        register(spec)
    assert str(raised.value) == line and isinstance(raised.value, DraftheadsError)
    assert source_names() == BUILT_IN  # nothing registered


def wild_rows(token: int):
    """A propose_rows whose every row proposes ``token`` (a source with a bug in its ids)."""
    def propose_rows(sources, budget):
        return CandidateBatch.from_rows([Candidates.empty() if s is None else
                                         count_trie([[token]], source_id("wild"), 1, 0.5) for s in sources])
    return propose_rows


@pytest.mark.parametrize("token", [96, 10**6, -1])
def test_a_source_proposing_ids_outside_the_vocabulary_is_one_line_naming_it(token):
    """The tiny base has 96 embedding rows: a proposed id 96 used to end in the verify forward's
    IndexError; it is refused where the proposals enter the tree, and the model decodes after."""
    register(SourceSpec("wild", repeat_prior, RepeatConfig, start=repeat_start, propose_rows=wild_rows(token)))
    try:
        base = tiny_llama(3)
        prompt = torch.tensor([[7, 21, 40, 9, 12, 55, 3, 8]])
        model = DraftHeadsModel(base, None)
        model.use_sources("wild")
        with pytest.raises(InputError) as raised:
            model.generate(prompt, max_new_tokens=8)
        assert str(raised.value) == (f"draft source 'wild' proposed token id {token}, outside the base's vocabulary "
                                     "[0, 96): fix its propose_rows to draft ids of the base's tokenizer (or "
                                     "unregister it).")
        model.use_sources("context")
        reference = base.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
        assert model.generate(prompt, max_new_tokens=8).tolist() == reference.tolist()
    finally:
        unregister("wild")


def test_a_source_returning_no_candidate_batch_is_one_line():
    register(SourceSpec("wild", repeat_prior, RepeatConfig, start=repeat_start,
                        propose_rows=lambda sources, budget: [None for _ in sources]))
    try:
        model = DraftHeadsModel(tiny_llama(3), None)
        model.use_sources("wild")
        with pytest.raises(InputError, match=r"^draft source 'wild': propose_rows returned list for 1 row\(s\); it must "
                                             r"return a CandidateBatch with one row per source"):
            model.generate(torch.tensor([[7, 21, 40, 9]]), max_new_tokens=4)
    finally:
        unregister("wild")
