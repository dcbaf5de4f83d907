"""transformers' generation options, every one of them: honoured by draftheads (the model's own
tokens) or refused by name before any work (decoding/generation_options.py, decoding/processors.py).

The options are read from the installed transformers when the tests are collected — every
attribute of ``GenerationConfig()`` and every argument of ``generate()`` — so an option a later
transformers adds has no entry in ``SAMPLES`` and fails here until it is classified in
decoding/generation_options.py and given a sample. Each sample sets the option on a left-padded
batch of a tiny random Llama (float64, greedy unless the sample samples deterministically) through both
doors: ``model.generate(..., custom_generate=fn)`` and ``DraftHeadsModel.generate`` (with drafts
that know the answer, so deep tree nodes are accepted and their processors matter).
"""
from __future__ import annotations

import importlib.util
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from transformers import (GenerationConfig, MaxLengthCriteria, RepetitionPenaltyLogitsProcessor, StoppingCriteria,
                          StoppingCriteriaList, WatermarkingConfig)

from draftheads import custom_generate
from draftheads.decoding import DraftHeadsModel, tree_from_paths
from draftheads.core.errors import InputError
from draftheads.decoding.generation_options import CLASSIFIED, transformers_options
from draftheads.decoding.processors import NodeProcessors, PrefixOnly, node_prefixes
from helpers import Collect, OracleHeads, left_pad, saved_tree_heads, tiny_llama, varied_llama

NEW = 10
PROMPTS = [[5, 17, 33, 8, 9, 5, 17], [40, 41, 42]]
TREE = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)]


@dataclass
class Context:
    model: object
    fn: Callable  # the custom_generate callable
    ids: torch.Tensor
    mask: torch.Tensor
    greedy: list[int]  # row 0's greedy answer without options
    plain: list  # the batch's greedy output without options
    other: object  # another model (an assistant)
    tokenizer: object
    theirs: dict = field(default_factory=dict)  # option → the model's own tokens for its sample (both doors share it)


def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary ("w0".."w95"), for stop_strings (plus the
    probe word transformers' StopStringCriteria decodes every token after)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(vocab={**{f"w{i}": i for i in range(96)}, "abcdef": 96}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", pad_token="w0", eos_token="w2")


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    folder = tmp_path_factory.mktemp("options")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTHEADS_CACHE", str(folder / "cache"))
        model = varied_llama()
        fn = custom_generate(saved_tree_heads(folder / "heads", model), sources="heads,context", tree=3)
        ids, mask = left_pad(PROMPTS)
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        yield Context(model, fn, ids, mask, plain[0, ids.shape[1]:].tolist(), plain.tolist(), tiny_llama(1),
                      word_tokenizer())


def first(ctx: Context, n: int = 3) -> list[int]:
    """The first distinct tokens of the plain greedy answer: options that ban or bias them change it."""
    return list(dict.fromkeys(ctx.greedy))[:n]


#: every option → (what draftheads does with it, the generate() arguments that set it). Sampling
#: samples are deterministic (one token survives the warper) so that tokens can be compared; the
#: distributions themselves are tested in properties/test_sampling.py and below, processor by processor.
H, R = "honoured", "refused"
SAMPLING = dict(do_sample=True)
SAMPLES: dict[str, tuple[str, Callable[[Context], dict]]] = {
    # the prompt, the config, lengths, EOS, padding, streaming
    "inputs": (H, lambda c: {"inputs": c.ids}),
    "generation_config": (H, lambda c: {"generation_config": GenerationConfig(max_new_tokens=6, repetition_penalty=1.4,
                                                                               pad_token_id=0, do_sample=False)}),
    "max_length": (H, lambda c: {"max_length": c.ids.shape[1] + 4, "max_new_tokens": None}),
    "max_new_tokens": (H, lambda c: {"max_new_tokens": 5}),
    "eos_token_id": (H, lambda c: {"eos_token_id": [c.greedy[3], 2]}),
    "pad_token_id": (H, lambda c: {"pad_token_id": 7, "eos_token_id": c.greedy[2]}),
    "do_sample": (H, lambda c: {"do_sample": True, "top_k": 1}),
    "streamer": (H, lambda c: {"streamer": Collect(), "batch1": True}),
    # logits processors
    "temperature": (H, lambda c: {**SAMPLING, "temperature": 0.7, "top_k": 1}),
    "top_k": (H, lambda c: {**SAMPLING, "top_k": 1}),
    "top_p": (H, lambda c: {**SAMPLING, "top_p": 1e-6}),
    "min_p": (H, lambda c: {**SAMPLING, "min_p": 1.0}),
    "top_h": (H, lambda c: {**SAMPLING, "top_h": 0.5, "top_k": 1}),
    "typical_p": (H, lambda c: {**SAMPLING, "typical_p": 1e-6}),
    "epsilon_cutoff": (H, lambda c: {**SAMPLING, "epsilon_cutoff": 0.5}),
    "eta_cutoff": (H, lambda c: {**SAMPLING, "eta_cutoff": 0.5, "top_k": 1}),
    "repetition_penalty": (H, lambda c: {"repetition_penalty": 1.5}),
    "encoder_repetition_penalty": (H, lambda c: {"encoder_repetition_penalty": 1.5}),
    "no_repeat_ngram_size": (H, lambda c: {"no_repeat_ngram_size": 2}),
    "bad_words_ids": (H, lambda c: {"bad_words_ids": [[first(c)[0]], [first(c)[1], first(c)[2]]]}),
    "sequence_bias": (H, lambda c: {"sequence_bias": {(first(c)[0],): -10.0, (first(c)[1], first(c)[2]): 3.0}}),
    "min_length": (H, lambda c: {"min_length": c.ids.shape[1] + 6, "eos_token_id": first(c, 4)}),
    "min_new_tokens": (H, lambda c: {"min_new_tokens": 6, "eos_token_id": first(c, 4)}),
    "forced_bos_token_id": (H, lambda c: {"forced_bos_token_id": 7}),
    "forced_eos_token_id": (H, lambda c: {"forced_eos_token_id": 9}),
    "remove_invalid_values": (H, lambda c: {"remove_invalid_values": True}),
    "exponential_decay_length_penalty": (H, lambda c: {"exponential_decay_length_penalty": (2, 3.0),
                                                       "eos_token_id": first(c, 4)[3]}),
    "suppress_tokens": (H, lambda c: {"suppress_tokens": first(c)}),
    "begin_suppress_tokens": (H, lambda c: {"begin_suppress_tokens": first(c, 1)}),
    "renormalize_logits": (H, lambda c: {"renormalize_logits": True, "repetition_penalty": 1.3}),
    "watermarking_config": (H, lambda c: {"watermarking_config": WatermarkingConfig(bias=4.0)}),
    "logits_processor": (H, lambda c: {"logits_processor": [RepetitionPenaltyLogitsProcessor(1.5)]}),
    "prefix_allowed_tokens_fn": (H, lambda c: {"prefix_allowed_tokens_fn": lambda row, ids: list(range(20 * row,
                                                                                                  50 + 20 * row))}),
    # stopping criteria
    "stopping_criteria": (H, lambda c: {"stopping_criteria": [MaxLengthCriteria(c.ids.shape[1] + 4)]}),
    "max_time": (H, lambda c: {"max_time": 600.0}),
    "stop_strings": (H, lambda c: {"stop_strings": f"w{c.greedy[3]}", "tokenizer": c.tokenizer}),
    # what is returned
    "output_scores": (H, lambda c: {"output_scores": True, "return_dict_in_generate": True}),
    "output_logits": (H, lambda c: {"output_logits": True, "return_dict_in_generate": True}),
    "return_dict_in_generate": (H, lambda c: {"return_dict_in_generate": True}),
    "use_cache": (H, lambda c: {"use_cache": False}),
    # no effect on the tokens (metadata, transformers' own cache and compilation, other modes' options)
    "transformers_version": (H, lambda c: {"transformers_version": "0.0.1"}),
    "_from_model_config": (H, lambda c: {"_from_model_config": True}),
    "cache_implementation": (H, lambda c: {"cache_implementation": "static"}),
    "cache_config": (H, lambda c: {"cache_config": {"backend": "quanto", "nbits": 4}}),
    "max_cache_len": (H, lambda c: {"max_cache_len": 64}),
    "compile_config": (H, lambda c: {"disable_compile": True}),
    "disable_compile": (H, lambda c: {"disable_compile": True}),
    "prefill_chunk_size": (H, lambda c: {"prefill_chunk_size": 4}),
    "continuous_batching_config": (H, lambda c: {}),
    "length_penalty": (H, lambda c: {"length_penalty": 2.0}),
    "early_stopping": (H, lambda c: {"early_stopping": True}),
    "num_assistant_tokens": (H, lambda c: {"num_assistant_tokens": 5}),
    "num_assistant_tokens_schedule": (H, lambda c: {"num_assistant_tokens_schedule": "heuristic"}),
    "assistant_confidence_threshold": (H, lambda c: {"assistant_confidence_threshold": 0.3}),
    "assistant_lookbehind": (H, lambda c: {"assistant_lookbehind": 5}),
    "target_lookbehind": (H, lambda c: {"target_lookbehind": 5}),
    "max_matching_ngram_size": (H, lambda c: {"max_matching_ngram_size": 3}),
    "assistant_ensemble_weight": (H, lambda c: {"assistant_ensemble_weight": 0.5}),
    "speculation_type": (H, lambda c: {"speculation_type": "dflash"}),
    "decoder_start_token_id": (H, lambda c: {"decoder_start_token_id": 1}),
    "bos_token_id": (H, lambda c: {"bos_token_id": 3}),
    "custom_generate": (H, lambda c: {"custom_generate": c.fn}),
    # refused: beams and other decoding modes, guidance, extra outputs, other drafters
    "num_beams": (R, lambda c: {"num_beams": 2}),
    "num_beam_groups": (R, lambda c: {"num_beam_groups": 2, "num_beams": 2}),
    "diversity_penalty": (R, lambda c: {"diversity_penalty": 0.5}),
    "penalty_alpha": (R, lambda c: {"penalty_alpha": 0.6, "top_k": 4}),
    "low_memory": (R, lambda c: {"low_memory": True}),
    "dola_layers": (R, lambda c: {"dola_layers": "high"}),
    "constraints": (R, lambda c: {"constraints": ["w5"]}),
    "force_words_ids": (R, lambda c: {"force_words_ids": [[5]]}),
    "guidance_scale": (R, lambda c: {"guidance_scale": 1.5}),
    "negative_prompt_ids": (R, lambda c: {"negative_prompt_ids": c.ids}),
    "negative_prompt_attention_mask": (R, lambda c: {"negative_prompt_attention_mask": c.mask}),
    "encoder_no_repeat_ngram_size": (R, lambda c: {"encoder_no_repeat_ngram_size": 2}),
    "num_return_sequences": (R, lambda c: {"num_return_sequences": 2, **SAMPLING}),
    "output_attentions": (R, lambda c: {"output_attentions": True, "return_dict_in_generate": True}),
    "output_hidden_states": (R, lambda c: {"output_hidden_states": True, "return_dict_in_generate": True}),
    "token_healing": (R, lambda c: {"token_healing": True}),
    "assistant_model": (R, lambda c: {"assistant_model": c.other}),
    "prompt_lookup_num_tokens": (R, lambda c: {"prompt_lookup_num_tokens": 3}),
    "assistant_early_exit": (R, lambda c: {"assistant_early_exit": 1}),
    "use_mtp": (R, lambda c: {"use_mtp": True}),
    "is_assistant": (R, lambda c: {"is_assistant": True}),
    "synced_gpus": (R, lambda c: {"synced_gpus": True}),
}
#: honoured options whose sample changes the tokens (so that the comparison shows the option applied)
CHANGES = {"bad_words_ids", "begin_suppress_tokens", "encoder_repetition_penalty", "eos_token_id",
           "exponential_decay_length_penalty", "forced_eos_token_id", "generation_config", "logits_processor",
           "max_length", "max_new_tokens", "min_length", "min_new_tokens", "no_repeat_ngram_size", "pad_token_id",
           "prefix_allowed_tokens_fn", "renormalize_logits", "repetition_penalty", "sequence_bias", "stop_strings",
           "stopping_criteria", "suppress_tokens", "typical_p", "watermarking_config"}
#: refused for one value, honoured for the others
REFUSED_VALUES = {"cache_implementation": {"cache_implementation": "quantized"}}
#: refused by transformers itself before it calls a custom_generate callable: 5.24 pops the
#: ``tokenizer`` argument before it builds the stop strings' criterion, for callables only
REFUSED_BY_TRANSFORMERS = {("stop_strings", "callable")}


def has_quanto() -> bool:
    """Whether optimum-quanto (a quantized cache's backend) is installed."""
    return importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None


def test_every_transformers_option_is_classified_and_has_a_sample():
    options = transformers_options()
    assert {"temperature", "stopping_criteria", "watermarking_config", "dola_layers"} <= options  # read, not listed
    assert options <= CLASSIFIED, f"classify in decoding/generation_options.py: {sorted(options - CLASSIFIED)}"
    assert options <= set(SAMPLES), f"give these a sample here: {sorted(options - set(SAMPLES))}"


@contextmanager
def no_forward(model):
    """Asserts that ``model`` runs no forward (none reaches its embeddings) inside the block."""
    calls: list = []
    handle = model.get_input_embeddings().register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        yield
    finally:
        handle.remove()
    assert not calls, f"{len(calls)} forwards ran before the refusal"


def tokens(output) -> list:
    return (output if isinstance(output, torch.Tensor) else output.sequences).tolist()


def arguments(ctx: Context, sample: dict) -> tuple[dict, torch.Tensor | None]:
    """The generate() keyword arguments of a sample on the test batch (or its first row), and
    the prompt to pass positionally (None when the sample passes ``inputs``)."""
    batch1 = sample.pop("batch1", False)
    ids, mask = (ctx.ids[:1, -len(PROMPTS[0]):], None) if batch1 else (ctx.ids, ctx.mask)
    if "generation_config" in sample:
        return {"attention_mask": mask, **sample}, ids
    kwargs = {"attention_mask": mask, "max_new_tokens": NEW, "do_sample": False, "pad_token_id": 0, **sample}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return kwargs, (None if "inputs" in sample else ids)


def door(ctx: Context, form: str, answer: list[list[int]] | None = None) -> Callable:
    """``generate(ids, **kwargs)`` through custom_generate, or through a DraftHeadsModel whose
    drafts know ``answer`` (each row's expected tokens; 10 % of them wrong)."""
    prompt = lambda ids: () if ids is None else (ids,)  # noqa: E731 (None: the sample passes inputs=)
    if form == "callable":
        return lambda ids, **kwargs: ctx.model.generate(*prompt(ids), **{"custom_generate": ctx.fn, **kwargs})
    rows = answer or [[]] * ctx.ids.shape[0]
    decoder = DraftHeadsModel(ctx.model, OracleHeads(rows, vocab=96, error=0.1, seed=1), tree=tree_from_paths(TREE))
    return lambda ids, **kwargs: decoder.generate(*prompt(ids), **{k: v for k, v in kwargs.items()
                                                                   if k != "custom_generate"})


@pytest.mark.parametrize("form", ["callable", "decoder"])
@pytest.mark.parametrize("name", sorted(transformers_options()))
def test_every_option_is_honoured_or_refused_by_name_before_any_work(ctx, name, form):
    if name not in SAMPLES:
        pytest.fail(f"{name}: a transformers option without a sample; classify it in decoding/generation_options.py, "
                    "add it here")
    cases = [SAMPLES[name] if (name, form) not in REFUSED_BY_TRANSFORMERS else (R, SAMPLES[name][1])]
    if name in REFUSED_VALUES and (form == "decoder" or has_quanto()):
        # transformers builds the quantized cache before it calls a custom_generate (without optimum-quanto it fails)
        cases.append((R, lambda c: dict(REFUSED_VALUES[name])))
    for outcome, make in cases:
        kwargs, ids = arguments(ctx, make(ctx))
        if outcome == R:  # draftheads' refusal, or transformers' own where it refuses first (naming the option)
            generate = door(ctx, form)
            named = re.escape(name).replace("_", "[_ ]")
            with no_forward(ctx.model), pytest.raises((InputError, ValueError), match=named) as err:
                generate(ids, **kwargs)
            assert "\n" not in str(err.value), str(err.value)
            continue
        prompt = ids if ids is not None else kwargs["inputs"]
        if name not in ctx.theirs:  # fresh streamers and processors for the model's own run
            own, _ = arguments(ctx, make(ctx))
            ctx.theirs[name] = tokens(ctx.model.generate(*(() if ids is None else (ids,)), **own))
        theirs = ctx.theirs[name]
        if prompt.shape == ctx.ids.shape:
            assert (theirs != ctx.plain) == (name in CHANGES), f"{name}: whether the sample changes the tokens"
        answer = [row[prompt.shape[1]:] for row in theirs]
        assert tokens(door(ctx, form, answer)(ids, **kwargs)) == theirs, name


# -- the sub-cases one by one ------------------------------------------------------------------------
def test_watermarking_under_greedy_decoding_is_honoured_and_synthid_refused(ctx):
    """transformers watermarks greedy decoding too (the green list shifts the argmax); SynthID
    keeps state from step to step and is refused by name."""
    from transformers import SynthIDTextWatermarkingConfig

    kwargs = dict(attention_mask=ctx.mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    for scheme in ("lefthash", "selfhash"):
        config = WatermarkingConfig(bias=4.0, seeding_scheme=scheme)
        theirs = ctx.model.generate(ctx.ids, watermarking_config=config, **kwargs)
        assert tokens(theirs) != tokens(ctx.model.generate(ctx.ids, **kwargs))  # the watermark changes the tokens
        assert tokens(ctx.model.generate(ctx.ids, watermarking_config=config, custom_generate=ctx.fn, **kwargs)) == \
            tokens(theirs)
    synthid = SynthIDTextWatermarkingConfig(keys=[1, 2, 3], ngram_len=2)
    with pytest.raises(InputError, match=r"watermarking_config \(SynthID\) is not supported"):
        ctx.model.generate(ctx.ids, watermarking_config=synthid, custom_generate=ctx.fn, **kwargs)


def test_dola_is_refused_by_name(ctx):
    for form in ("callable", "decoder"):
        generate = door(ctx, form)
        with no_forward(ctx.model), pytest.raises(InputError, match="dola_layers='high' is not supported"):
            generate(ctx.ids, attention_mask=ctx.mask, max_new_tokens=4, dola_layers="high")


def test_the_callers_own_repetition_penalty_replaces_the_configs_as_in_transformers(ctx):
    """A caller's RepetitionPenaltyLogitsProcessor takes the place of the config's (transformers
    merges by type): its penalty, not the config's, decides the tokens."""
    kwargs = dict(attention_mask=ctx.mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, repetition_penalty=1.1)
    own = [RepetitionPenaltyLogitsProcessor(3.0)]
    theirs = ctx.model.generate(ctx.ids, logits_processor=own, **kwargs)
    assert tokens(theirs) != tokens(ctx.model.generate(ctx.ids, **kwargs))
    answer = [row[ctx.ids.shape[1]:] for row in tokens(theirs)]
    for form in ("callable", "decoder"):
        assert tokens(door(ctx, form, answer)(ctx.ids, logits_processor=own, **kwargs)) == tokens(theirs), form


class StopAfter(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_the_callers_own_length_and_eos_criteria_and_a_plain_list_are_honoured(ctx):
    """A caller's MaxLengthCriteria / EosTokenCriteria replace the config's (longer or shorter),
    any other criterion joins them, and a plain list works as transformers' list does."""
    from transformers.generation.stopping_criteria import EosTokenCriteria

    width = ctx.ids.shape[1]
    kwargs = dict(attention_mask=ctx.mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    cases = {
        "longer": [MaxLengthCriteria(width + 9)],
        "shorter": StoppingCriteriaList([MaxLengthCriteria(width + 3)]),
        "eos": [EosTokenCriteria(torch.tensor([ctx.greedy[2]]))],
        "own": [StopAfter(ctx.greedy[1])],
    }
    for case, criteria in cases.items():
        theirs = ctx.model.generate(ctx.ids, stopping_criteria=criteria, **kwargs)
        answer = [row[width:] for row in tokens(theirs)]
        for form in ("callable", "decoder"):
            assert tokens(door(ctx, form, answer)(ctx.ids, stopping_criteria=criteria, **kwargs)) == tokens(theirs), \
                (case, form)
    assert len(tokens(ctx.model.generate(ctx.ids, stopping_criteria=cases["longer"], **kwargs))[0]) == width + 9
    with pytest.raises(InputError, match="stopping_criteria must be a list"):
        door(ctx, "decoder")(ctx.ids, stopping_criteria=StopAfter(3), **kwargs)


def test_a_processor_of_unknown_kind_is_refused_unless_declared_prefix_only(ctx):
    class BanToken:
        def __call__(self, input_ids, scores):
            return scores.index_fill(1, input_ids[:, -1], -float("inf"))  # never repeat the last token

    kwargs = dict(attention_mask=ctx.mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    for form in ("callable", "decoder"):
        generate = door(ctx, form)
        with no_forward(ctx.model), pytest.raises(InputError, match="logits_processor BanToken is not one draftheads "
                                                                    "can apply.*PrefixOnly"):
            generate(ctx.ids, logits_processor=[BanToken()], **kwargs)
    theirs = ctx.model.generate(ctx.ids, logits_processor=[BanToken()], **kwargs)
    answer = [row[ctx.ids.shape[1]:] for row in tokens(theirs)]
    for form in ("callable", "decoder"):
        own = [PrefixOnly(BanToken())]
        assert tokens(door(ctx, form, answer)(ctx.ids, logits_processor=own, **kwargs)) == tokens(theirs), form


def test_custom_generate_with_empty_heads_fails_at_once_naming_heads():
    for empty in ("", "  "):
        with pytest.raises(InputError, match=r"custom_generate\(heads=.*\): heads is empty; pass a head checkpoint"):
            custom_generate(empty)


# -- every honoured processor, node by node ---------------------------------------------------------
PROCESSOR_OPTIONS = [
    dict(repetition_penalty=1.7), dict(encoder_repetition_penalty=1.5), dict(no_repeat_ngram_size=2),
    dict(bad_words_ids=[[7], [8, 9]]), dict(sequence_bias={(4,): 2.0, (5, 6): -3.0}), dict(min_length=13),
    dict(min_new_tokens=5), dict(forced_bos_token_id=3), dict(forced_eos_token_id=4, max_length=12),
    dict(remove_invalid_values=True), dict(exponential_decay_length_penalty=(1, 1.3)), dict(suppress_tokens=[3, 4]),
    dict(begin_suppress_tokens=[5]), dict(renormalize_logits=True),
    dict(watermarking_config=WatermarkingConfig(seeding_scheme="selfhash")),
    dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, typical_p=0.95, epsilon_cutoff=1e-3,
         eta_cutoff=1e-3, top_h=0.9),
]


@pytest.mark.parametrize("options", PROCESSOR_OPTIONS, ids=lambda o: ",".join(o))
def test_processors_at_tree_nodes_equal_transformers_on_each_nodes_own_prefix(options):
    """Every processor transformers builds for an honoured option, applied at the nodes of a
    ragged batch of trees (rows with different counts of tokens so far, nodes at every depth),
    equals transformers' processor list applied to each node's own prefix as a batch of one."""
    model = tiny_llama(2)
    ids, mask = left_pad([[5, 6, 7, 5, 6], [9, 4]])
    config = GenerationConfig(**{"eos_token_id": [2, 4], "pad_token_id": 0, "max_length": 20, **options})
    model._prepare_special_tokens(config, True, device="cpu")
    built = lambda: model._get_logits_processor(config, input_ids_seq_length=ids.shape[1], encoder_input_ids=ids,
                                                device="cpu", model_kwargs={"attention_mask": mask})
    generated = [[8, 5, 6], [4]]
    history = torch.cat([ids, torch.tensor([generated[0], generated[1] + [96, 96]])], dim=1)
    ends = torch.tensor([ids.shape[1] + 3, ids.shape[1] + 1])
    tree = tree_from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    drafts = torch.tensor([[6, 5, 7, 6, 5, 7], [4, 4, 9, 5, 4, 2]])
    node_ids, lengths = node_prefixes(history, ends, drafts, tree.path_slots, tree.depth, 96)
    scores = torch.randn(len(lengths), 96, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float()
    rows = torch.tensor([0, 1]).repeat_interleave(tree.num_nodes)
    processed = NodeProcessors(built())(node_ids, scores.clone(), lengths, rows)
    for m in range(len(lengths)):
        row, prefix = int(rows[m]), node_ids[m, : int(lengths[m])]
        node = m % tree.num_nodes
        path = [int(drafts[row, s]) for s in tree.path_slots[node, 1: int(tree.depth[node]) + 1]]
        assert prefix.tolist() == history[row, : int(ends[row])].tolist() + path
        single = built()  # one row of the batch: its per-row state re-indexed by hand
        for p in single:
            if isinstance(getattr(p, "prompt_ignore_length", None), torch.Tensor):
                p.prompt_ignore_length = p.prompt_ignore_length[row: row + 1]
            if hasattr(p, "encoder_input_ids"):
                p.encoder_input_ids = p.encoder_input_ids[row: row + 1]
        expected = single(prefix[None], scores[m: m + 1].clone())
        torch.testing.assert_close(processed[m: m + 1], expected, rtol=0, atol=0, equal_nan=True)


def test_an_option_draftheads_does_not_know_is_refused_when_set(monkeypatch):
    """What a later transformers adds: set, it is refused by name (never dropped); unset, nothing happens."""
    from draftheads.decoding import generation_options as options

    monkeypatch.setattr(options, "transformers_options", lambda: frozenset({"temperature", "future_option"}))
    config = GenerationConfig()
    options.refuse_options(config)
    config.future_option = 3
    with pytest.raises(InputError, match="future_option=3 is a transformers generation option draftheads does not "
                                         "know yet"):
        options.refuse_options(config)
