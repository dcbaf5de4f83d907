"""One ``generate`` call's arguments, merged like transformers merges them and checked before
any work: the generation config, the acceptance rule, EOS and pad ids, the checked input
tensors and each row's token limit (:class:`Request`, :func:`make_request`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .accept import resolve_acceptance
from .limits import InputError, check_inputs, check_memory, wanted_new_tokens, warn_context_cut
from .processors import check_sampling_config


@dataclass
class Request:
    """One ``generate`` call's arguments after merging and checking (:func:`make_request`)."""

    config: object  # the merged transformers GenerationConfig
    mode: object  # "greedy" | "lossless" | Typical
    eos: list[int]
    pad: int
    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    limits: list[int]  # each row's max new tokens after the context cut
    want_scores: bool

    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1])


# Generation options whose non-default value changes the output and that the greedy tree
# decoder does not implement yet: refused with a clear message, never silently ignored.
_UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None,
    "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None, "force_words_ids": None,
    "min_length": 0, "min_new_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None, "guidance_scale": None,
    "num_return_sequences": 1, "output_attentions": False, "output_hidden_states": False,
    "prompt_lookup_num_tokens": None, "renormalize_logits": False, "exponential_decay_length_penalty": None,
    "max_time": None, "stop_strings": None, "constraints": None, "low_memory": None,
}
_CALL_ARGUMENTS = {"streamer", "stopping_criteria", "generation_config", "attention_mask", "input_ids", "tree",
                   "logits_processor", "use_cache"}


def resolve_generation_config(base_config, generation_config=None, **kwargs):
    """Merge like transformers does (explicit config, then keyword overrides) and refuse
    anything the decoder would otherwise silently ignore."""
    config = copy.deepcopy(generation_config if generation_config is not None else base_config)
    unused = config.update(**kwargs)
    if unused:
        raise InputError(f"generate() got arguments it does not understand: {sorted(unused)}.")
    for name, default in _UNSUPPORTED.items():
        value = getattr(config, name, default)
        if value not in (default, None):
            raise InputError(f"generate(): `{name}={value!r}` is not supported by draftheads yet; "
                             f"leave it at {default!r} or use the base model's own generate().")
    check_sampling_config(config)
    return config


def eos_token_ids(config) -> list[int]:
    """A generation config's EOS id(s) as a list (transformers allows an int or a list)."""
    eos = config.eos_token_id
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):  # transformers accepts a tensor of ids too
        return [int(e) for e in eos.flatten().tolist()]
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def make_request(base, max_nodes, input_ids, attention_mask, generation_config, streamer, acceptance,
                 kwargs) -> Request:
    """Every argument of ``generate`` merged and checked, before any work; ``max_nodes(batch,
    prompt_len)``: the largest tree the policy may ask for (what the memory check prices)."""
    config = resolve_generation_config(base.generation_config, generation_config, **kwargs)
    mode = resolve_acceptance(config, acceptance)
    eos = eos_token_ids(config)
    # transformers' fallback: no pad_token_id → the first EOS id (and no padding inference)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    input_ids, attention_mask = check_inputs(input_ids, attention_mask, base, pad, eos,
                                              pad_given=config.pad_token_id is not None)
    batch, prompt_len = input_ids.shape
    if streamer is not None and batch > 1:
        raise InputError("generate(): a streamer needs batch size 1 (as in transformers).")
    wanted = wanted_new_tokens(config, prompt_len)
    check_memory(base, batch, prompt_len, min(wanted, base.config.max_position_embeddings),
                 max_nodes(batch, prompt_len))
    context = base.config.max_position_embeddings
    limits = [min(wanted, context - int(n)) for n in attention_mask.sum(1)]
    warn_context_cut(wanted, limits, context)
    want_scores = bool(config.return_dict_in_generate and (config.output_scores or config.output_logits))
    # no pad and no EOS: no row ends early, the pad value never shows
    return Request(config, mode, eos, 0 if pad is None else pad, input_ids, attention_mask, limits, want_scores)


def left_pad(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids + attention mask, as a tokenizer with ``padding_side='left'`` gives."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask
