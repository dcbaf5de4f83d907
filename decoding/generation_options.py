"""transformers' generation options, each one honoured by the tree loop or refused by name.

The set is read from the installed transformers — every attribute of ``GenerationConfig()`` and
every argument of ``GenerationMixin.generate`` (:func:`transformers_options`) — and every name is
classified here once. What changes the tokens runs through the loop as transformers applies it:
the logits processors transformers builds (:mod:`.processors` applies them at every tree node),
its stopping criteria (:class:`~.output.StopReplay`), the length, EOS and padding rules the loop
keeps itself. What the loop cannot reproduce is refused before any work, naming the option
(:func:`refuse_options`). An option a later transformers adds is not in any table: set to
anything but its default, it is refused as unknown (never dropped), and the enumeration test
(tests/decoding/test_generation_options.py) fails until it is classified here.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Iterable

import torch

from ..core.errors import InputError

#: the loop's own rules, as transformers' (length limits, EOS, padding, sampling, the prompt, streaming)
NATIVE = frozenset({"max_length", "max_new_tokens", "eos_token_id", "pad_token_id", "do_sample", "inputs",
                    "generation_config", "streamer"})
#: options transformers turns into logits processors (``_get_logits_processor``): the loop applies
#: the processors themselves at every tree node (:mod:`.processors`); one that cannot be applied so
#: is refused by :func:`~.processors.check_processors`
PROCESSORS = frozenset({"temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff",
                        "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "bad_words_ids",
                        "sequence_bias", "min_length", "min_new_tokens", "forced_bos_token_id",
                        "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
                        "suppress_tokens", "begin_suppress_tokens", "renormalize_logits", "watermarking_config",
                        "logits_processor", "prefix_allowed_tokens_fn"})
#: options transformers turns into stopping criteria (``_get_stopping_criteria``), called as its loop calls them
#: (:class:`~.output.StopReplay`)
CRITERIA = frozenset({"stopping_criteria", "max_time", "stop_strings"})
#: what is returned, not which tokens
OUTPUT = frozenset({"output_scores", "output_logits", "return_dict_in_generate", "use_cache"})
#: no effect on the tokens here: metadata, how transformers' own loop caches and compiles (the tree
#: loop keeps its own cache), and options of modes that are refused below (beam search, assisted
#: decoding) or do not apply to decoder-only models
NO_EFFECT = frozenset({"transformers_version", "_from_model_config", "cache_config", "max_cache_len", "compile_config",
                       "disable_compile", "prefill_chunk_size", "continuous_batching_config", "length_penalty",
                       "early_stopping", "num_assistant_tokens", "num_assistant_tokens_schedule",
                       "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
                       "max_matching_ngram_size", "assistant_ensemble_weight", "speculation_type",
                       "decoder_start_token_id", "bos_token_id", "custom_generate"})

_NO_DRAFTER = "the heads are the draft model"
_OWN_GENERATE = "call the model's own generate() without draftheads for it"
#: options that change the tokens in a way the tree loop does not reproduce → (values that leave
#: them without effect, besides None and transformers' default; the fix named in the refusal)
REFUSED: dict[str, tuple[tuple, str]] = {
    "num_beams": ((1,), f"draftheads decodes greedily or samples; leave it at 1 or {_OWN_GENERATE}"),
    "num_beam_groups": ((1,), f"group beam search is not implemented; leave it at 1 or {_OWN_GENERATE}"),
    "diversity_penalty": ((0.0,), f"it belongs to group beam search; drop it or {_OWN_GENERATE}"),
    "penalty_alpha": ((0, 0.0), f"contrastive search is not implemented; drop it or {_OWN_GENERATE}"),
    "low_memory": ((False,), f"it belongs to contrastive search; drop it or {_OWN_GENERATE}"),
    "dola_layers": ((), f"DoLa decoding is not implemented; drop it or {_OWN_GENERATE}"),
    "constraints": ((), f"constrained beam search is not implemented; drop it or {_OWN_GENERATE}"),
    "force_words_ids": ((), f"constrained beam search is not implemented; drop it or {_OWN_GENERATE}"),
    "guidance_scale": ((1, 1.0), f"classifier-free guidance runs a second model pass per step; drop it or "
                                 f"{_OWN_GENERATE}"),
    "negative_prompt_ids": ((), f"it belongs to classifier-free guidance; drop it or {_OWN_GENERATE}"),
    "negative_prompt_attention_mask": ((), f"it belongs to classifier-free guidance; drop it or {_OWN_GENERATE}"),
    "encoder_no_repeat_ngram_size": ((0,), f"it keeps per-batch-row state the tree loop cannot re-index; drop it or "
                                           f"{_OWN_GENERATE}"),
    "num_return_sequences": ((1,), "repeat the prompt in the batch instead (one row per answer)"),
    "output_attentions": ((False,), f"draftheads returns no attentions; drop it or {_OWN_GENERATE}"),
    "output_hidden_states": ((False,), f"draftheads returns no hidden states; drop it or {_OWN_GENERATE}"),
    "token_healing": ((False,), "heal the prompt's last token before the call instead"),
    "assistant_model": ((), f"{_NO_DRAFTER}; drop it, or {_OWN_GENERATE}"),
    "prompt_lookup_num_tokens": ((), f"{_NO_DRAFTER} and draftheads drafts lookups itself (sources='auto' or "
                                     "'heads,context'); drop it"),
    "assistant_early_exit": ((), f"{_NO_DRAFTER}; drop it, or {_OWN_GENERATE}"),
    "use_mtp": ((False,), f"{_NO_DRAFTER}; drop it, or {_OWN_GENERATE}"),
    "is_assistant": ((False,), "draftheads' decoding is not an assistant model's; drop it"),
    "synced_gpus": ((False,), "draftheads decodes in one process; drop it or call generate() on each rank without it"),
}
#: values of an option otherwise without effect on the tokens that do change them
REFUSED_VALUES: dict[str, dict[Any, str]] = {
    "cache_implementation": {"quantized": f"a quantized cache changes the logits; drop it or {_OWN_GENERATE}"},
}

CLASSIFIED = NATIVE | PROCESSORS | CRITERIA | OUTPUT | NO_EFFECT | set(REFUSED) | set(REFUSED_VALUES)


@functools.lru_cache(maxsize=None)
def generate_arguments() -> frozenset[str]:
    """The named arguments of the installed transformers' ``GenerationMixin.generate``."""
    from transformers.generation.utils import GenerationMixin

    return frozenset(name for name, p in inspect.signature(GenerationMixin.generate).parameters.items()
                     if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


@functools.lru_cache(maxsize=None)
def transformers_options() -> frozenset[str]:
    """Every generation option the installed transformers exposes: the attributes of a default
    ``GenerationConfig`` and the named arguments of ``GenerationMixin.generate``."""
    from transformers import GenerationConfig

    return frozenset(GenerationConfig().to_dict()) | generate_arguments()


def transformers_default(name: str) -> Any:
    """The value transformers fills in for an unset option (``_get_default_generation_params``)."""
    return _defaults().get(name)


@functools.lru_cache(maxsize=None)
def _defaults() -> dict[str, Any]:
    from transformers import GenerationConfig

    return GenerationConfig._get_default_generation_params()


def takes_effect(name: str, value: Any, inert: Iterable = ()) -> bool:
    """Whether ``value`` of option ``name`` does anything: not None, not transformers' default
    and not one of ``inert`` (a tensor always counts as set)."""
    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        return True
    return not any(_equal(value, quiet) for quiet in (transformers_default(name), *inert) if quiet is not None)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def refusal(name: str, value: Any) -> str | None:
    """The one line refusing option ``name`` set to ``value``, or None when it is honoured or
    without effect. An option of transformers' that no table here knows is refused when set:
    draftheads cannot tell whether it changes the tokens."""
    if name in REFUSED:
        inert, fix = REFUSED[name]
        if takes_effect(name, value, (False, *inert)):
            return f"{name}={_short(value)} is not supported by draftheads ({fix})."
        return None
    if name in REFUSED_VALUES:
        fix = REFUSED_VALUES[name].get(value) if isinstance(value, str) else None
        return f"{name}={value!r} is not supported by draftheads ({fix})." if fix else None
    if name in CLASSIFIED or not takes_effect(name, value):
        return None
    return (f"{name}={_short(value)} is a transformers generation option draftheads does not know yet, so it cannot "
            f"tell whether it changes the tokens; drop it or {_OWN_GENERATE}.")


def _short(value: Any) -> str:
    """A value as the refusal names it: plain values by their repr (cut at 60 characters), anything
    else (a model, a tensor, a config object) by its type."""
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    if not isinstance(value, (str, int, float, bool, list, tuple, dict)):
        return f"<{type(value).__name__}>"
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def refuse_options(config, arguments: dict[str, Any] | None = None) -> None:
    """Refuse, naming it, every transformers option set in the merged generation ``config`` or
    among ``generate``'s ``arguments`` that the tree loop would otherwise drop. Entries of a
    model's generation config that are not transformers options are left alone: transformers
    ignores them too."""
    values = {name: getattr(config, name) for name in transformers_options() if hasattr(config, name)}
    values.update(arguments or {})
    for name in sorted(values):
        line = refusal(name, values[name])
        if line:
            raise InputError(f"generate(): {line}")
