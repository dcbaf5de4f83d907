"""The contract, enumerated: every token-changing generation option and a family of a caller's own
stopping criteria and logits processors (stateless and stateful, per-row tensors, ``len(scores)``,
a ``prefix_allowed_tokens_fn`` that allows nothing or raises off its grammar) give transformers'
own ``generate`` answer through both doors — ``DraftHeadsModel.generate`` (drafts that know the
answer, so deep tree nodes are accepted and rows run ahead of each other) and
``model.generate(..., custom_generate=fn)`` — at batch size 1 and for a left-padded batch of 3,
on a tiny random float64 Llama; or are refused by name before any work.

The criteria are called as transformers calls them (decoding/output.py, ``StopReplay``); a batch
whose criterion is handed the scores decodes token by token with one warning
(decoding/request.py, ``token_by_token``); drafted prefixes a processor fails on are tolerated until
transformers itself would reach them (decoding/processors.py, ``NodeProcessors``), and the caller's
functions are asked about rows that finished at the steps transformers asks them (``call_finished``).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, StoppingCriteria, WatermarkingConfig

from draftheads import custom_generate
from draftheads.core.errors import InputError
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.decoding.processors import PrefixOnly
from helpers import Collect, OracleHeads, left_pad, saved_tree_heads, varied_llama

NEW = 8
PROMPTS = [[5, 17, 33, 8, 9, 5, 17], [40, 41, 42], [60, 61, 62, 63, 64]]
TREE = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)]
VOCAB, EOS, PAD = 96, 2, 0


@dataclass
class Setup:
    model: object
    fn: Callable  # the custom_generate callable
    theirs: dict = field(default_factory=dict)  # (case, batch) → transformers' sequences


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny model and its custom_generate callable; one torch thread while the module runs (a
    tiny model's many small products are several times slower on threads that share busy cores)."""
    folder, threads = tmp_path_factory.mktemp("contract"), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("DRAFTHEADS_CACHE", str(folder / "cache"))
            model = varied_llama()
            yield Setup(model, custom_generate(saved_tree_heads(folder / "heads", model), sources="heads,context",
                                               tree=3))
    finally:
        torch.set_num_threads(threads)


def prompt(batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (torch.tensor(PROMPTS[:1]), None) if batch == 1 else left_pad(PROMPTS, pad=PAD)


# -- a caller's own stopping criteria ---------------------------------------------------------------
class StopAfterSteps(StoppingCriteria):
    """Stateless, by ``len(scores)``: every row stops at step ``steps`` (the issue's first example)."""

    def __init__(self, steps: int):
        self.steps = steps

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), len(scores) >= self.steps, dtype=torch.bool)


class PerRowLength(StoppingCriteria):
    """Each row's own total length limit, as a tensor over the batch's rows (the issue's second example)."""

    def __init__(self, new: list[int], width: int):
        self.lengths = torch.tensor(new) + width

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] >= self.lengths


class StopAfterCalls(StoppingCriteria):
    """Stateful: stops every row at its ``calls``-th call."""

    def __init__(self, calls: int):
        self.calls, self.seen = calls, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.seen += 1
        return torch.full((input_ids.shape[0],), self.seen >= self.calls, dtype=torch.bool)


class StopOnSecondSighting(StoppingCriteria):
    """Stateful per row: a row stops at a token it was handed at an earlier call."""

    def __init__(self):
        self.seen: dict[int, set[int]] = {}

    def __call__(self, input_ids, scores, **kwargs):
        stop = []
        for row, token in enumerate(input_ids[:, -1].tolist()):
            stop.append(token in self.seen.setdefault(row, set()))
            self.seen[row].add(token)
        return torch.tensor(stop)


class Confident(StoppingCriteria):
    """Reads the last step's scores: a row stops once its top probability passes ``p``."""

    def __init__(self, p: float):
        self.p = p

    def __call__(self, input_ids, scores, **kwargs):
        return scores[-1].softmax(-1).max(-1).values > self.p


class TokenAt(StoppingCriteria):
    """Stateless on the prefix: stops a row whose last token is ``token``."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


# -- a caller's own processors ---------------------------------------------------------------------
class BanLast:
    """Never repeat the last token: a function of the prefix (declared with PrefixOnly)."""

    def __call__(self, input_ids, scores):
        return scores.index_fill(1, input_ids[:, -1], -float("inf"))


class Counting:
    """Keeps state across calls: unknown to draftheads, refused by name."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


def grammar(width: int, off: Callable[[], list[int]]):
    """A ``prefix_allowed_tokens_fn``: generated token k must lie in [10, 50) for even k and in
    [30, 80) for odd k (EOS allowed from the fourth on, pads after it); a prefix off the grammar
    gets ``off()`` ([] or an error). transformers' own decoding never leaves it."""
    def allowed(k: int) -> list[int]:
        return list(range(10, 50) if k % 2 == 0 else range(30, 80)) + ([EOS] if k >= 4 else [])

    def fn(batch_id: int, sent: torch.Tensor) -> list[int]:
        tail = sent[width:].tolist()
        if EOS in tail:
            return [PAD]
        if any(token not in allowed(k) for k, token in enumerate(tail)):
            return off()
        return allowed(len(tail))
    return fn


def raise_off_grammar() -> list[int]:
    raise KeyError("off the grammar")


#: case → (batch → generate() keyword arguments, made afresh for every run: criteria keep state)
CASES: dict[str, Callable[[int, int], dict]] = {
    # token-changing options
    "greedy": lambda b, w: {},
    "max_length": lambda b, w: {"max_length": w + 5, "max_new_tokens": None},
    "eos_token_id": lambda b, w: {"eos_token_id": [41, 57, EOS]},
    "min_new_tokens": lambda b, w: {"min_new_tokens": 5, "eos_token_id": [41, 57, EOS]},
    "min_length": lambda b, w: {"min_length": w + 4, "eos_token_id": [41, 57, EOS]},
    "repetition_penalty": lambda b, w: {"repetition_penalty": 1.5},
    "encoder_repetition_penalty": lambda b, w: {"encoder_repetition_penalty": 1.5},
    "no_repeat_ngram_size": lambda b, w: {"no_repeat_ngram_size": 2},
    "bad_words_ids": lambda b, w: {"bad_words_ids": [[41], [57, 41]]},
    "sequence_bias": lambda b, w: {"sequence_bias": {(41,): -10.0, (57, 41): 3.0}},
    "suppress_tokens": lambda b, w: {"suppress_tokens": [41, 57]},
    "begin_suppress_tokens": lambda b, w: {"begin_suppress_tokens": [41, 57]},
    "forced_bos_token_id": lambda b, w: {"forced_bos_token_id": 7},
    "forced_eos_token_id": lambda b, w: {"forced_eos_token_id": 9},
    "exponential_decay_length_penalty": lambda b, w: {"exponential_decay_length_penalty": (2, 3.0),
                                                      "eos_token_id": 41},
    "renormalize_logits": lambda b, w: {"renormalize_logits": True, "repetition_penalty": 1.3},
    "remove_invalid_values": lambda b, w: {"remove_invalid_values": True},
    "watermarking_config": lambda b, w: {"watermarking_config": WatermarkingConfig(bias=4.0)},
    "top_k": lambda b, w: {"do_sample": True, "top_k": 1},
    "temperature": lambda b, w: {"do_sample": True, "temperature": 0.7, "top_k": 1},
    "top_p": lambda b, w: {"do_sample": True, "top_p": 1e-6},
    "min_p": lambda b, w: {"do_sample": True, "min_p": 1.0},
    "typical_p": lambda b, w: {"do_sample": True, "typical_p": 1e-6},
    "epsilon_cutoff": lambda b, w: {"do_sample": True, "epsilon_cutoff": 0.5},
    "eta_cutoff": lambda b, w: {"do_sample": True, "eta_cutoff": 0.5, "top_k": 1},
    "top_h": lambda b, w: {"do_sample": True, "top_h": 0.5, "top_k": 1},
    "max_time": lambda b, w: {"max_time": 600.0},
    "output_scores": lambda b, w: {"output_scores": True, "return_dict_in_generate": True},
    "output_logits": lambda b, w: {"output_logits": True, "return_dict_in_generate": True},
    # a caller's own stopping criteria
    "criterion len(scores)": lambda b, w: {"stopping_criteria": [StopAfterSteps(5)], "output_scores": True,
                                           "return_dict_in_generate": True},
    "criterion len(scores), processed": lambda b, w: {"stopping_criteria": [StopAfterSteps(4)], "output_scores": True,
                                                      "return_dict_in_generate": True, "repetition_penalty": 1.5},
    "criterion per-row lengths": lambda b, w: {"stopping_criteria": [PerRowLength([3, 6, 4][:b], w)]},
    "criterion per-row lengths, eos": lambda b, w: {"stopping_criteria": [PerRowLength([7, 2, 5][:b], w)],
                                                    "eos_token_id": [41, 57, EOS]},
    "criterion stateful calls": lambda b, w: {"stopping_criteria": [StopAfterCalls(4)]},
    "criterion stateful per row": lambda b, w: {"stopping_criteria": [StopOnSecondSighting()],
                                                "max_new_tokens": 12},
    "criterion on scores": lambda b, w: {"stopping_criteria": [Confident(0.2)], "output_scores": True,
                                         "return_dict_in_generate": True},
    "criterion on a token, sampled": lambda b, w: {"stopping_criteria": [TokenAt(57)], "do_sample": True,
                                                   "top_k": 1},
    "criterion without eos": lambda b, w: {"stopping_criteria": [PerRowLength([3, 6, 4][:b], w)],
                                           "eos_token_id": None},
    # a caller's own processors
    "processor known": lambda b, w: {"logits_processor": [RepetitionPenaltyLogitsProcessor(2.0)]},
    "processor PrefixOnly": lambda b, w: {"logits_processor": [PrefixOnly(BanLast())]},
    "prefix_allowed_tokens_fn []": lambda b, w: {"prefix_allowed_tokens_fn": grammar(w, lambda: [])},
    "prefix_allowed_tokens_fn raises": lambda b, w: {"prefix_allowed_tokens_fn": grammar(w, raise_off_grammar)},
    "prefix_allowed_tokens_fn, criterion": lambda b, w: {"prefix_allowed_tokens_fn": grammar(w, lambda: []),
                                                         "stopping_criteria": [StopAfterCalls(5)],
                                                         "eos_token_id": [41, 57, EOS]},
}
#: the cases whose batch decodes token by token (a criterion handed the scores), with the warning's words
TOKEN_BY_TOKEN = {"criterion len(scores)": "StopAfterSteps", "criterion len(scores), processed": "StopAfterSteps",
                  "criterion on scores": "Confident"}
#: case → (generate() keyword arguments, the refusal's words): refused by name before any work
REFUSED: dict[str, tuple[Callable[[], dict], str]] = {
    "num_beams": (lambda: {"num_beams": 2}, "num_beams=2 is not supported"),
    "guidance_scale": (lambda: {"guidance_scale": 1.5}, "guidance_scale=1.5 is not supported"),
    "penalty_alpha": (lambda: {"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha=0.6 is not supported"),
    "num_return_sequences": (lambda: {"num_return_sequences": 2, "do_sample": True}, "num_return_sequences=2"),
    "processor with state": (lambda: {"logits_processor": [Counting()]},
                             "logits_processor Counting is not one draftheads can apply"),
}


def kwargs_for(case: str, batch: int) -> tuple[torch.Tensor, dict]:
    ids, mask = prompt(batch)
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": PAD, **CASES[case](batch, ids.shape[1])}
    # a case's None drops a default (max_new_tokens for max_length); eos_token_id=None means no EOS
    kwargs = {name: value for name, value in kwargs.items() if value is not None or name == "eos_token_id"}
    if mask is not None:
        kwargs["attention_mask"] = mask
    return ids, kwargs


def sequences(output) -> list[list[int]]:
    return (output if isinstance(output, torch.Tensor) else output.sequences).tolist()


def run(setup: Setup, form: str, ids: torch.Tensor, kwargs: dict, answer: list[list[int]] | None = None):
    """One call through a door: custom_generate, or a DraftHeadsModel whose drafts know ``answer``
    (each row's expected tokens, 10 % of them wrong). → (the output, the decoder's stats or None)."""
    if form == "custom_generate":
        return setup.model.generate(ids, custom_generate=setup.fn, **kwargs), None
    decoder = DraftHeadsModel(setup.model, OracleHeads(answer or [[]] * ids.shape[0], vocab=VOCAB, error=0.1, seed=1),
                              tree=tree_from_paths(TREE))
    return decoder.generate(ids, **kwargs), decoder.last_stats


def theirs(setup: Setup, case: str, batch: int) -> list[list[int]]:
    """transformers' own answer for a case (seeded as draftheads' run is), computed once."""
    if (case, batch) not in setup.theirs:
        ids, kwargs = kwargs_for(case, batch)
        torch.manual_seed(0)
        setup.theirs[case, batch] = sequences(setup.model.generate(ids, **kwargs))
    return setup.theirs[case, batch]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("form", ["api", "custom_generate"])
def test_every_case_gives_transformers_answer(setup, form, batch):
    """Every case of :data:`CASES` equals transformers' ``generate`` (sampling cases keep one token)."""
    wrong = []  # every case that differs, each on one line
    for case in CASES:
        expected = theirs(setup, case, batch)
        ids, kwargs = kwargs_for(case, batch)  # fresh criteria and processors: they keep state
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(0)
            try:
                output, stats = run(setup, form, ids, kwargs, [row[ids.shape[1]:] for row in expected])
            except Exception as err:  # noqa: BLE001 (transformers answered: any error is a difference)
                wrong.append(f"{case}: transformers answered, draftheads raised {err!r}")
                continue
        said = [str(w.message) for w in caught if "token by token" in str(w.message)]
        if sequences(output) != expected:
            wrong.append(f"{case}: transformers {expected}, draftheads {sequences(output)}")
        if batch > 1 and case in TOKEN_BY_TOKEN:
            if len(said) != 1 or f"stopping criterion {TOKEN_BY_TOKEN[case]}" not in said[0]:
                wrong.append(f"{case}: expected one line saying why it decodes token by token, got {said}")
        elif said:
            wrong.append(f"{case}: decoded token by token without need: {said}")
        elif stats is not None and (stats.delegated or sum(stats.accepted) == 0):
            wrong.append(f"{case}: the tree loop did not run with accepted drafts")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("form", ["api", "custom_generate"])
def test_refused_cases_name_the_option_before_any_work(setup, form, batch):
    calls: list = []
    handle = setup.model.get_input_embeddings().register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        for case, (make, words) in REFUSED.items():
            ids, mask = prompt(batch)
            kwargs = {"max_new_tokens": NEW, "pad_token_id": PAD, **({} if mask is None else {"attention_mask": mask}),
                      **make()}
            with pytest.raises((InputError, ValueError), match=words) as err:
                run(setup, form, ids, kwargs)
            assert "\n" not in str(err.value), case
            assert not calls, f"{case}: {len(calls)} forwards ran before the refusal"
    finally:
        handle.remove()


def test_the_issues_examples_stop_where_transformers_stops(setup):
    """The issue's two failing examples, one by one: a ``len(scores)`` criterion (batch of 1) and
    per-row lengths as a tensor over a batch of 3, through both doors; each criterion changes the answer."""
    for batch, case in ((1, "criterion len(scores)"), (3, "criterion per-row lengths")):
        expected = theirs(setup, case, batch)
        assert expected != theirs(setup, "greedy", batch), case
        for form in ("api", "custom_generate"):
            ids, kwargs = kwargs_for(case, batch)
            output, _ = run(setup, form, ids, kwargs, [row[ids.shape[1]:] for row in expected])
            assert sequences(output) == expected, (case, form)


@pytest.mark.parametrize("form", ["api", "custom_generate"])
def test_a_grammar_with_no_way_on_raises_as_transformers_raises(setup, form):
    """A ``prefix_allowed_tokens_fn`` that allows nothing on the path transformers takes: both raise."""
    ids, _ = prompt(1)
    fn = lambda batch_id, sent: [] if sent.shape[0] >= ids.shape[1] + 3 else list(range(10, 50))  # noqa: E731
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": PAD, "prefix_allowed_tokens_fn": fn}
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn` returned an empty list"):
        setup.model.generate(ids, **kwargs)
    reached = sequences(setup.model.generate(ids, **{**kwargs, "max_new_tokens": 3}))[0][ids.shape[1]:]
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn` returned an empty list"):
        run(setup, form, ids, kwargs, [reached + [11] * 5])


def past_the_end(ends: set[int], off: Callable[[], list[int]]):
    """A ``prefix_allowed_tokens_fn`` that allows every id until its row ended (its last token one
    of ``ends``), then answers ``off()``: transformers asks it about rows that finished, every step."""
    return lambda batch_id, sent: off() if int(sent[-1]) in ends else list(range(VOCAB))


@pytest.mark.parametrize("form", ["api", "custom_generate"])
@pytest.mark.parametrize("off", ["raises", "[]"])
def test_a_grammar_asked_about_a_finished_row_fails_as_in_transformers(setup, form, off):
    """Batch of 3: row 1 ends at its second token while the others decode on; transformers then
    calls the function on row 1's ended tokens, which raises (or allows nothing): so does draftheads."""
    ids, mask = prompt(3)
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": PAD, "attention_mask": mask,
              "eos_token_id": [55, EOS]}
    plain = sequences(setup.model.generate(ids, **kwargs))
    assert [row[ids.shape[1]:][1] for row in plain] == [53, 55, 86]  # row 1 ends early, the others go on
    fn = past_the_end({55, EOS, PAD}, raise_off_grammar if off == "raises" else list)
    error, words = (KeyError, "off the grammar") if off == "raises" else (ValueError, "returned an empty list")
    with pytest.raises(error, match=words):
        setup.model.generate(ids, prefix_allowed_tokens_fn=fn, **kwargs)
    with pytest.raises(error, match=words):
        run(setup, form, ids, {**kwargs, "prefix_allowed_tokens_fn": fn}, [row[ids.shape[1]:] for row in plain])


def test_a_stopped_row_streams_what_transformers_streams(setup):
    """Batch of 1 with a streamer: tokens drafted past the criterion's stop are never streamed."""
    streamed = []
    for form in ("transformers", "api"):
        ids, kwargs = kwargs_for("criterion len(scores)", 1)
        collect = Collect()
        if form == "transformers":
            output = setup.model.generate(ids, streamer=collect, **kwargs)
        else:
            output, _ = run(setup, form, ids, {**kwargs, "streamer": collect}, [streamed[0][ids.shape[1]:-1]])
        assert collect.tokens[:-1] == sequences(output)[0] and collect.tokens[-1] == "end", form
        streamed.append(collect.tokens)
    assert streamed[0] == streamed[1]


@pytest.mark.parametrize("given", ["generator", "acceptance"])
def test_what_the_own_loop_cannot_honour_is_refused_by_name(setup, given):
    """A batch that must decode token by token (a criterion handed the scores) given what the
    model's own loop cannot honour: one line naming the criterion and that argument alone."""
    ids, kwargs = kwargs_for("criterion len(scores)", 3)
    decoder = DraftHeadsModel(setup.model, OracleHeads([[]] * 3, vocab=VOCAB), tree=tree_from_paths(TREE))
    extra = {"generator": torch.Generator().manual_seed(0)} if given == "generator" else {"acceptance": "typical"}
    with pytest.raises(InputError, match=f"stopping criterion StopAfterSteps is handed every row's scores.*{given}=") as err:
        decoder.generate(ids, **{**kwargs, "do_sample": True}, **extra)
    other = "acceptance=" if given == "generator" else "generator="
    assert other not in str(err.value) and "\n" not in str(err.value)
