"""One ``generate`` call's arguments, merged and prepared as transformers' ``generate`` prepares
them for its decoding loop, and checked before any work: the generation config, the logits
processors and stopping criteria (:class:`Call`: :func:`prepare_call` for draftheads' own
``generate``, :func:`prepared_call` for what transformers hands a ``custom_generate``), then the
acceptance rule, EOS and pad ids, the checked input tensors and each row's token limit
(:class:`Request`, :func:`make_request`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .accept import resolve_acceptance
from .base.forward import hook_site
from ..core.errors import InputError, InputTypeError
from .input_checks import check_inputs, wanted_new_tokens, warn_context_cut
from .memory import check_memory
from .generation_options import generate_arguments, refuse_options
from .processors import NodeProcessors


@dataclass
class Call:
    """A call's generation arguments as transformers' ``generate`` hands them to a decoding loop:
    the merged config, the checked prompt, the logits processors and stopping criteria built from
    both (the caller's own merged in, in transformers' order). ``plain``: the caller's own
    arguments, for running the base's own ``generate`` instead (None where the lists came
    prepared and cannot be handed back without doubling transformers' defaults); ``own_loop``:
    there, transformers' own decoding loop over what it handed over (``own_loop(extra
    processors)`` → its output), for a call the tree loop cannot decode as transformers would."""

    config: Any  # the prepared transformers GenerationConfig
    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    processors: list
    criteria: list
    plain: dict | None
    own_loop: Callable[[list], Any] | None = None


@dataclass
class Request:
    """One ``generate`` call's arguments after merging and checking (:func:`make_request`)."""

    config: object  # the merged transformers GenerationConfig
    mode: object  # "greedy" | "lossless" | Typical
    eos: list[int]  # the ids that end a row (transformers' EosTokenCriteria)
    pad: int
    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    limits: list[int]  # each row's max new tokens after the context cut
    want_scores: bool
    processors: NodeProcessors  # applied at every tree node
    criteria: list  # stopping criteria besides length and EOS, called as transformers calls them (.output.StopReplay)
    plain: dict | None  # see :class:`Call`
    own_loop: Callable[[list], Any] | None  # see :class:`Call`

    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1])


def eos_token_ids(config) -> list[int]:
    """A generation config's EOS id(s) as a list (transformers allows an int or a list)."""
    eos = config.eos_token_id
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):  # transformers accepts a tensor of ids too
        return [int(e) for e in eos.flatten().tolist()]
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def pad_token_id(config) -> int | None:
    """transformers' fallback: no pad_token_id → the first EOS id (and no padding inference)."""
    eos = eos_token_ids(config)
    return config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)


def as_list(value, name: str) -> list:
    """``logits_processor`` / ``stopping_criteria``: None, or a list (transformers' own list
    classes, a plain list or tuple) of callables."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InputTypeError(f"generate(): {name} must be a list of callables (e.g. [{type(value).__name__}(...)]), "
                             f"got {type(value).__name__}.")
    for item in value:
        if not callable(item):
            raise InputTypeError(f"generate(): every entry of {name} must be callable (input_ids, scores), got "
                                 f"{type(item).__name__} {item!r}.")
    return list(value)


def checked_prompt(base, config, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's tensors checked, and its mask inferred from the pad id where it is missing (transformers' rule)."""
    eos = eos_token_ids(config)
    return check_inputs(input_ids, attention_mask, base, pad_token_id(config), eos,
                        pad_given=config.pad_token_id is not None)


def left_unset(name: str, kwargs: dict, generation_config, model_config) -> bool:
    """Whether option ``name`` is set by none of the call, its config and the model's (transformers'
    ``has_default_max_length``)."""
    return kwargs.get(name) is None and getattr(model_config, name) is None and (
        generation_config is None or getattr(generation_config, name) is None)


def merged_config(base, generation_config, kwargs: dict):
    """transformers' merge (the call's config or the model's, its defaults, then the keyword
    arguments), every option draftheads cannot honour refused by name; ``kwargs`` may also hold
    ``generate()``'s own arguments. → (the config, whether max_length / min_length were left at
    transformers' defaults, as ``_prepare_generated_length`` needs to know)."""
    arguments = {name: kwargs.pop(name) for name in list(kwargs) if name in generate_arguments()}
    defaults = tuple(left_unset(name, kwargs, generation_config, base.generation_config)
                     for name in ("max_length", "min_length"))
    try:
        config, unknown = base._prepare_generation_config(generation_config, **kwargs)
    except ValueError as err:
        raise InputError(f"generate(): {err}") from err
    refuse_options(config, arguments)
    unknown = sorted(set(unknown) - {"output_attentions", "output_hidden_states"})
    if unknown:
        raise InputError(f"generate() got arguments it does not understand: {unknown}.")
    return config, defaults


def prepare_call(base, input_ids, attention_mask, generation_config, kwargs: dict, logits_processor=None,
                 stopping_criteria=None, prefix_allowed_tokens_fn=None, tokenizer=None) -> Call:
    """What transformers' ``generate`` does before its decoding loop, for draftheads' own
    ``generate``: merge the config (:func:`merged_config`), prepare the special tokens and
    lengths, and build the logits processors and stopping criteria — with transformers' own
    methods, so every option means what it means there."""
    logits_processor = as_list(logits_processor, "logits_processor")
    stopping_criteria = as_list(stopping_criteria, "stopping_criteria")
    config, (default_max, default_min) = merged_config(base, generation_config, kwargs)
    input_ids, attention_mask = checked_prompt(base, config, input_ids, attention_mask)
    length = input_ids.shape[1]
    base._prepare_special_tokens(config, True, device=input_ids.device)
    base._prepare_generated_length(config, default_max, default_min, "input_ids", length, input_ids)
    padded = None if bool(attention_mask.all()) else attention_mask  # transformers drops an all-ones mask
    try:
        processors = base._get_logits_processor(
            config, input_ids_seq_length=length, encoder_input_ids=input_ids,
            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, logits_processor=logits_processor,
            device=input_ids.device, model_kwargs={"attention_mask": padded})
        criteria = base._get_stopping_criteria(config, stopping_criteria, tokenizer=tokenizer)
    except ValueError as err:
        raise InputError(f"generate(): {err}") from err
    plain = {"logits_processor": logits_processor, "stopping_criteria": stopping_criteria,
             "prefix_allowed_tokens_fn": prefix_allowed_tokens_fn, "tokenizer": tokenizer}
    return Call(config, input_ids, attention_mask, list(processors), list(criteria), plain)


def prepared_call(base, input_ids, attention_mask, config, logits_processor, stopping_criteria,
                  arguments: dict | None = None, own_loop: Callable[[list], Any] | None = None) -> Call:
    """What transformers' ``generate`` hands a ``custom_generate`` callable — its prepared
    config, processors and criteria; ``arguments``: those of its ``generate`` call it does not
    hand over — checked like :func:`prepare_call`'s; ``own_loop``: see :class:`Call`."""
    refuse_options(config, arguments)
    input_ids, attention_mask = checked_prompt(base, config, input_ids, attention_mask)
    return Call(config, input_ids, attention_mask, as_list(logits_processor, "logits_processor"),
                as_list(stopping_criteria, "stopping_criteria"), None, own_loop)


def stop_rules(criteria: list) -> tuple[int | None, list[int], list]:
    """transformers' stopping criteria as the loop applies them: the shortest ``MaxLengthCriteria``
    (None: no length limit but the context), the ids of every ``EosTokenCriteria`` (the caller's
    own replace the config's, as in transformers), and the rest, checked after each token."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    lengths = [int(c.max_length) for c in criteria if type(c) is MaxLengthCriteria]
    eos = [int(e) for c in criteria if type(c) is EosTokenCriteria for e in torch.as_tensor(c.eos_token_id).flatten()]
    rest = [c for c in criteria if type(c) not in (MaxLengthCriteria, EosTokenCriteria)]
    return (min(lengths) if lengths else None), sorted(set(eos)), rest


def score_readers(criteria: list, config) -> list:
    """The stopping criteria transformers hands ``scores`` (``return_dict_in_generate`` and
    ``output_scores``) that may read them: all but its own classes that never do (exact classes)."""
    from transformers.generation import stopping_criteria as sc

    if not (config.return_dict_in_generate and config.output_scores):
        return []
    scoreless = (sc.MaxLengthCriteria, sc.EosTokenCriteria, sc.MaxTimeCriteria, sc.StopStringCriteria)
    return [c for c in criteria if type(c) not in scoreless]


@dataclass(frozen=True)
class OwnLoop:
    """Why a call decodes token by token with the model's own loop (:func:`token_by_token`):
    ``culprit`` names what the caller gave (a stopping criterion, a hooked module), ``why`` what
    the tree loop cannot do with it, ``keeps`` what would keep the draft trees, ``drop`` what to
    drop where the own loop cannot run as asked. The warning and the refusal are each written
    whole from these (:attr:`warning`, :meth:`refusal`)."""

    culprit: str
    why: str
    keeps: str
    drop: str

    @property
    def warning(self) -> str:
        return (f"generate(): {self.culprit} {self.why}; this call decodes token by token with the model's own loop "
                f"({self.keeps}).")

    def refusal(self, blocker: str, fix: str) -> str:
        """The one line refusing a call whose own loop cannot ``blocker`` ("honour generator=", ...)
        unless the caller does ``fix``."""
        return (f"generate(): {self.culprit} {self.why}, so this call must decode token by token with the model's own "
                f"loop, which cannot {blocker}: {fix}, {self.drop}.")


def token_by_token(base, request: Request) -> OwnLoop | None:
    """Why the tree loop cannot give transformers' answer for this call, so that it decodes token
    by token with the model's own loop (None: it can), checked at every call. A forward hook or
    pre-hook on the model or any module of it, or one registered for every module
    (:func:`~.base.forward.hook_site`), would see several positions, tree slots and packed rows
    at once where transformers' loop hands it one token per row (and draftheads never runs the
    model's own forward). A stopping criterion handed ``scores`` in a batch reads every row's
    scores at every step, rows that finished included, which draft trees do not compute at that step."""
    site = hook_site(base)
    if site is not None:
        return OwnLoop(site, "would see other calls in draftheads' tree steps than in transformers' token-by-token "
                       "loop (several positions, tree slots and packed rows at once; never the model's own forward)",
                       "remove the hook to decode with draft trees", "or remove the hook")
    reading = score_readers(request.criteria, request.config) if request.batch > 1 else []
    if not reading:
        return None
    return OwnLoop(f"stopping criterion {type(reading[0]).__name__}",
                   "is handed every row's scores at every step (output_scores=True in a batch), which draft trees do "
                   "not hold for rows that finished", "batch size 1, or output_scores=False, keeps the trees",
                   "or drop output_scores or the criterion")


def check_own_loop(reason: OwnLoop, request: Request, generator, acceptance) -> None:
    """A call that must decode with the model's own loop (``reason``) where that loop cannot
    honour it — a ``torch.Generator`` or an ``acceptance`` rule given (the loop samples from the
    global RNG, exactly from the model), or a call prepared without the loop (neither
    ``request.plain`` nor ``request.own_loop``) — is refused by name before any work."""
    if generator is not None:
        raise InputError(reason.refusal("honour generator= (it samples from the global torch RNG)",
                                        "drop generator= (seed with torch.manual_seed)"))
    if acceptance is not None:
        raise InputError(reason.refusal("honour acceptance= (it samples exactly from the model)", "drop acceptance="))
    if request.plain is None and request.own_loop is None:
        raise InputError(reason.refusal("run here (this call came prepared without it)",
                                        "prepare it with prepare_call, or give prepared_call the loop (own_loop=)"))


def make_request(base, max_nodes, call: Call, streamer, acceptance) -> Request:
    """A prepared call checked before any work: the acceptance rule, the processors (each one
    exact over a tree, else refused by name), the stopping rules, each row's token limit, the
    memory; ``max_nodes(batch, prompt_len)``: the largest tree the policy may ask for."""
    config, input_ids, attention_mask = call.config, call.input_ids, call.attention_mask
    mode = resolve_acceptance(config, acceptance)
    processors = NodeProcessors(call.processors)
    max_length, eos, criteria = stop_rules(call.criteria)
    batch, prompt_len = input_ids.shape
    if streamer is not None and batch > 1:
        raise InputError("generate(): a streamer needs batch size 1 (as in transformers).")
    context = base.config.max_position_embeddings
    wanted = wanted_new_tokens(config, prompt_len)  # checks max_new_tokens / max_length as given
    if max_length is not None:  # the MaxLengthCriteria in force: the config's, or the caller's own in its place
        wanted = max(1, max_length - prompt_len)
    check_memory(base, batch, prompt_len, min(wanted, context), max_nodes(batch, prompt_len))
    limits = [min(wanted, context - int(n)) for n in attention_mask.sum(1)]
    warn_context_cut(wanted, limits, context)
    want_scores = bool(config.return_dict_in_generate and (config.output_scores or config.output_logits))
    pad = pad_token_id(config)
    # no pad and no EOS: no row ends early, the pad value never shows
    return Request(config, mode, eos, 0 if pad is None else pad, input_ids, attention_mask, limits, want_scores,
                   processors, criteria, call.plain, call.own_loop)


def left_pad(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids + attention mask, as a tokenizer with ``padding_side='left'`` gives."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask
