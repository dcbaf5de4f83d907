"""The frozen base as training sees it: loading it (embedded GGUF, local folder, Hub cache),
unsharded across processes, and the parts the heads read from it (the LM head and the input
embeddings, with the fingerprints a checkpoint records).
"""
from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.errors import MissingPathError
from ..decoding.base.loading import load_base
from ..decoding.base.fingerprint import fingerprint
from ..decoding.base.dtypes import DTYPES


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


def base_dims(name: str) -> tuple[int, int] | None:
    """(vocabulary size, hidden size) of a recipe's base from its config alone — a model
    folder's or cached Hub id's ``config.json``, a GGUF file's header — without loading a
    weight, so training data and head options are checked against it before the base loads.
    None when the config cannot be read here (loading the base then reports why)."""
    from ..decoding.base.loading import embedded_gguf_path

    try:
        if name in ("embedded", "") or name.endswith(".gguf"):
            return gguf_dims(embedded_gguf_path() if name in ("embedded", "") else Path(name).expanduser())
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(name, local_files_only=True).get_text_config()
        return int(config.vocab_size), int(config.hidden_size)
    except (OSError, ValueError, KeyError, AttributeError, TypeError, struct.error, MissingPathError):
        return None


#: GGUF metadata value types → their size in bytes (8: string and 9: array are read as they come)
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def gguf_dims(path: Path) -> tuple[int, int] | None:
    """(vocabulary size, hidden size) from a GGUF file's metadata (``<arch>.vocab_size`` or the
    tokenizer's token count, ``<arch>.embedding_length``), reading the header only: the gguf
    package's reader maps every tensor and token first (seconds for SmolLM2)."""
    values: dict[str, int] = {}
    with open(path, "rb") as handle:
        def read(fmt: str):
            return struct.unpack(fmt, handle.read(struct.calcsize(fmt)))[0]

        def string() -> str:
            return handle.read(read("<Q")).decode("utf-8", "replace")

        def skip(kind: int) -> None:
            if kind == 8:
                handle.seek(read("<Q"), 1)
            elif kind == 9:
                item, count = read("<I"), read("<Q")
                if item == 8:
                    for _ in range(count):
                        skip(8)
                elif item in _GGUF_SIZES:
                    handle.seek(_GGUF_SIZES[item] * count, 1)
                else:
                    for _ in range(count):
                        skip(item)
            else:
                handle.seek(_GGUF_SIZES[kind], 1)

        if handle.read(4) != b"GGUF":
            return None
        read("<I"), read("<Q")  # version, tensor count
        for _ in range(read("<Q")):
            key, kind = string(), read("<I")
            if kind in _GGUF_INTS and key.endswith((".vocab_size", ".embedding_length")):
                values[key.rpartition(".")[2]] = read(_GGUF_INTS[kind])
            elif kind == 9 and key == "tokenizer.ggml.tokens":
                position = handle.tell()
                read("<I")
                values.setdefault("tokens", read("<Q"))
                handle.seek(position)
                skip(9)
            else:
                skip(kind)
            if "embedding_length" in values and ("vocab_size" in values or "tokens" in values):
                break
    vocab = values.get("vocab_size", values.get("tokens"))
    return (vocab, values["embedding_length"]) if vocab and "embedding_length" in values else None


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
