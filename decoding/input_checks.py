"""Every argument and input check of the public API in one place, so the Python API and the
CLI refuse the same things with the same words, before any work (no model load, no forward).

Each check raises :class:`~draftheads.core.errors.InputError` (a ``ValueError``) or
:class:`~draftheads.core.errors.InputTypeError` (also a ``TypeError``) whose message names the
argument, what was given, and what to pass instead. The dtypes live in :mod:`.base.dtypes`, a
base's path in :mod:`.base.loading`, the memory estimate in :mod:`.memory`.
"""
from __future__ import annotations

import re
import warnings
from typing import Any

import torch

from ..core.errors import InputError, InputTypeError
from .tree import Tree


def check_count(name: str, value: Any, minimum: int = 1) -> int:
    """An integer option (``max_new_tokens``, ``--limit``, a tree budget...) that must be at
    least ``minimum``; bools and floats are refused rather than truncated."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{name} must be an integer ≥ {minimum}, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise InputError(f"{name} must be ≥ {minimum}, got {value}.")
    return value


def parse_tree_option(tree: Any) -> Any:
    """``tree=`` of ``from_pretrained`` and ``--tree`` of the CLI: None, ``"adaptive"``, a node
    budget ≥ 0 (int or its string), a Tree or any object with ``choose(batch, context)``."""
    if tree is None or isinstance(tree, Tree) or hasattr(tree, "choose"):
        return tree
    if isinstance(tree, str):
        text = tree.strip().lower()
        if text == "adaptive":
            return "adaptive"
        if not re.fullmatch(r"[+-]?\d+", text):
            raise InputError(f"tree={tree!r}: expected 'adaptive' or a node budget (an integer ≥ 0).")
        tree = int(text)
    if isinstance(tree, bool) or not isinstance(tree, int):
        raise InputTypeError(f"tree={tree!r} ({type(tree).__name__}): pass None (the checkpoint's default), "
                             "'adaptive', a node budget (an integer ≥ 0), a Tree or a policy with choose().")
    return check_count("tree (a node budget)", tree, 0)


def check_generator(generator: Any) -> None:
    """``generate(generator=...)``: None (seeded from the global RNG) or a ``torch.Generator``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise InputTypeError(f"generate(): generator must be a torch.Generator (e.g. "
                             f"torch.Generator().manual_seed(0)) or None, got {type(generator).__name__} {generator!r}.")


def base_device(base) -> torch.device:
    return next(base.parameters()).device


def check_input_tensors(input_ids: Any, attention_mask: Any, base) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``generate()``'s tensors: integer ids in [0, vocab) on the base's device, a non-empty
    batch, and a 0/1 mask of the same kind (returned as long). Shapes and padding are checked
    after this by the decoder itself."""
    if not isinstance(input_ids, torch.Tensor):
        raise InputTypeError(f"generate(): input_ids must be a torch.Tensor of token ids (batch, length), got "
                             f"{type(input_ids).__name__}; use tokenizer(..., return_tensors='pt').")
    if input_ids.dim() != 2:
        raise InputError(f"generate(): input_ids must be a 2-D tensor of token ids (batch, length), got shape "
                         f"{tuple(input_ids.shape)}; add a batch dimension with input_ids[None].")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise InputTypeError(f"generate(): input_ids must hold integer token ids, got dtype {input_ids.dtype}; "
                             "use input_ids.long().")
    if input_ids.shape[0] == 0:
        raise InputError(f"generate(): the batch is empty (input_ids shape {tuple(input_ids.shape)}); pass at least "
                         "one prompt.")
    device = base_device(base)
    if input_ids.device != device:
        raise InputError(f"generate(): input_ids is on {input_ids.device} but the base model is on {device}; "
                         f"move it with input_ids.to('{device}').")
    vocab = base.get_input_embeddings().num_embeddings
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        bad = int(input_ids.min()) if int(input_ids.min()) < 0 else int(input_ids.max())
        raise InputError(f"generate(): token id {bad} is outside the vocabulary [0, {vocab}); the ids come from "
                         "another tokenizer or were padded with a negative value (use the tokenizer's pad id).")
    if attention_mask is None:
        return input_ids, None
    if not isinstance(attention_mask, torch.Tensor):
        raise InputTypeError(f"generate(): attention_mask must be a torch.Tensor like input_ids, got "
                             f"{type(attention_mask).__name__}; use torch.tensor(mask) or the tokenizer's output.")
    if attention_mask.device != device:
        raise InputError(f"generate(): attention_mask is on {attention_mask.device} but the base model is on "
                         f"{device}; move it with attention_mask.to('{device}').")
    if attention_mask.shape != input_ids.shape:
        raise InputError(f"generate(): attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}.")
    values = torch.unique(attention_mask).tolist() if attention_mask.numel() else []
    if any(v not in (0, 1) for v in values):
        raise InputError(f"generate(): attention_mask must hold only 0 (padding) and 1 (token), got values "
                         f"{sorted(v for v in values if v not in (0, 1))[:5]}; pass the tokenizer's mask "
                         "(other values would silently shift positions).")
    return input_ids, attention_mask.long()


def warn_context_cut(wanted: int, limits: list[int], context: int) -> None:
    """Say so when a row gets fewer new tokens than asked because its prompt plus them would
    pass the model's context limit. transformers' ``generate`` (with ``max_new_tokens``) goes on
    past ``max_position_embeddings``, into positions the model was never trained on; draftheads
    stops there instead, and warns rather than return a shorter answer without a word."""
    short = min(limits)
    if short < wanted:
        warnings.warn(f"generate(): max_new_tokens={wanted} was cut to {short} new tokens: the prompt plus them "
                      f"would pass the model's context limit (max_position_embeddings={context}), and draftheads "
                      "stops there (transformers would go on past it). Shorten the prompt to get all of them.",
                      UserWarning, stacklevel=4)  # → generate → torch.no_grad's wrapper → the caller


def check_inputs(input_ids, attention_mask, base, pad: int | None, eos: list[int], pad_given: bool = True):
    input_ids, attention_mask = check_input_tensors(input_ids, attention_mask, base)
    if input_ids.shape[1] == 0:
        raise InputError("generate(): the prompt is empty; pass at least one token.")
    batched = input_ids.shape[0] > 1
    if attention_mask is None and batched and not pad_given and eos:
        warnings.warn("generate(): the attention mask and the pad token id were not set, with a batched input; "
                      f"padding falls back to EOS id {pad} as in transformers, so padding cannot be told from text. "
                      "Pass the tokenizer's attention_mask.", UserWarning, stacklevel=3)
    if attention_mask is None and batched and pad is not None and bool((input_ids[:, -1] == pad).any()):
        # the same warning transformers gives (the pad id may equal EOS, so it cannot be sure)
        warnings.warn("generate(): a decoder-only architecture is being used, but right-padding was detected! "
                      "For correct generation results, please set `padding_side='left'` when initializing the "
                      "tokenizer (and pass its attention_mask).", UserWarning, stacklevel=3)
    if attention_mask is None:
        # transformers' rule: infer padding from pad_token_id unless pad is also an EOS token
        infer = pad is not None and bool((input_ids == pad).any()) and pad not in eos
        attention_mask = (input_ids != pad).long() if infer else torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise InputError(f"generate(): attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}.")
    if bool((attention_mask.sum(1) == 0).any()):
        raise InputError("generate(): a prompt in the batch is empty (all padding).")
    if bool((attention_mask[:, -1] == 0).any()):
        raise InputError("generate(): the batch is right-padded; decoder-only generation needs left padding "
                         "(tokenizer.padding_side = 'left').")
    limit = base.config.max_position_embeddings
    if int(attention_mask.sum(1).max()) >= limit:
        raise InputError(f"generate(): the prompt has {int(attention_mask.sum(1).max())} tokens, at or over the "
                         f"model's context limit of {limit}; shorten it.")
    return input_ids, attention_mask


def wanted_new_tokens(config, prompt_len: int) -> int:
    """``max_new_tokens``, else ``max_length`` minus the (padded) prompt width, as transformers."""
    if config.max_new_tokens is not None:
        if config.max_new_tokens <= 0:
            raise InputError(f"generate(): max_new_tokens must be positive, got {config.max_new_tokens}.")
        return config.max_new_tokens
    wanted = config.max_length - prompt_len
    if wanted <= 0:
        raise InputError(f"generate(): max_length={config.max_length} leaves no room after a {prompt_len}-token "
                         "prompt; set max_new_tokens.")
    return wanted
