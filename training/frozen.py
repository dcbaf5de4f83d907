"""The frozen base as training sees it: loading it (embedded GGUF, local folder, Hub cache),
unsharded across processes, and the parts the heads read from it (the LM head and the input
embeddings, with the fingerprints a checkpoint records).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..heads.errors import MissingPathError
from ..decoding.base import load_base
from ..decoding.fingerprint import fingerprint
from ..decoding.limits import DTYPES


def load_frozen_base(name: str, dtype: str):
    """The base model (frozen) and its tokenizer; a local model directory without a tokenizer
    is fine for pre-tokenized data."""
    if name in ("embedded", "") or name.endswith(".gguf"):
        return load_base(None if name in ("embedded", "") else name, dtype=DTYPES[dtype])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[dtype]).eval().requires_grad_(False)
    except OSError as err:  # not a model dir / not in the local Hub cache: one line for main()
        raise MissingPathError(f"Recipe key base={name!r} could not be loaded: {str(err).splitlines()[0]}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


@contextlib.contextmanager
def unsharded_loading(accelerator):
    """The frozen base is never sharded: under ZeRO-3, transformers would partition its weights
    at load time (it follows the global HF DeepSpeed config), and the base runs outside DeepSpeed."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or getattr(plugin, "dschf", None) is None:
        yield
        return
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(plugin.dschf)


@dataclass
class FrozenParts:
    """What the heads read from the base: the LM head and the input embedding table."""

    lm_head: torch.Tensor
    embed: torch.Tensor
    fingerprint: dict  # keys the feature cache (unchanged across versions)
    checkpoint_fingerprint: dict | None = None  # + the dtype-independent sketch, recorded in the heads
    revision: str | None = None  # the Hub commit of a base loaded from the Hub (recorded in the checkpoint)


def frozen_parts(base, dtype: torch.dtype) -> FrozenParts:
    fp = fingerprint(base)
    return FrozenParts(base.get_output_embeddings().weight.detach().to(dtype),
                       base.get_input_embeddings().weight.detach().to(dtype), fp.to_dict(), fp.with_sketch(base),
                       getattr(base.config, "_commit_hash", None))
