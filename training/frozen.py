"""The frozen base as training sees it: loading it (embedded GGUF, local folder, Hub cache),
unsharded across processes, and the parts the heads read from it (the LM head and the input
embeddings, with the fingerprints a checkpoint records).
"""
from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass, field
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


def base_depth(name: str) -> int | None:
    """The decoder layers (``num_hidden_layers``) of a recipe's base from its config alone, as
    :func:`base_dims` reads it (a GGUF's ``<arch>.block_count``); None when it cannot be read here."""
    from ..decoding.base.loading import embedded_gguf_path

    try:
        if name in ("embedded", "") or name.endswith(".gguf"):
            path = embedded_gguf_path() if name in ("embedded", "") else Path(name).expanduser()
            return gguf_values(path, (".block_count",)).get("block_count")
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(name, local_files_only=True).get_text_config().num_hidden_layers)
    except (OSError, ValueError, KeyError, AttributeError, TypeError, struct.error, MissingPathError):
        return None


def num_hidden_layers(base) -> int:
    """The decoder layers of a loaded base (its text config's ``num_hidden_layers``)."""
    return int(base.config.get_text_config().num_hidden_layers)


def feature_layers_for(recipe, base) -> list[int]:
    """The base layers the recipe's heads read beside the final state (``heads.feature_layers``
    resolved and checked for the loaded ``base``)."""
    from .recipe_checks import resolve_feature_layers

    return resolve_feature_layers(recipe.heads.feature_layers, num_hidden_layers(base))


#: GGUF metadata value types → their size in bytes (8: string and 9: array are read as they come)
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def gguf_dims(path: Path) -> tuple[int, int] | None:
    """(vocabulary size, hidden size) from a GGUF file's metadata (``<arch>.vocab_size`` or the
    tokenizer's token count, ``<arch>.embedding_length``), reading the header only: the gguf
    package's reader maps every tensor and token first (seconds for SmolLM2)."""
    values = gguf_values(path, (".vocab_size", ".embedding_length"), tokens=True)
    vocab = values.get("vocab_size", values.get("tokens"))
    return (vocab, values["embedding_length"]) if vocab and "embedding_length" in values else None


def gguf_values(path: Path, suffixes: tuple[str, ...], tokens: bool = False) -> dict[str, int]:
    """The integer metadata of a GGUF file whose keys end with ``suffixes`` ({last part of the key:
    value}), and with ``tokens`` the tokenizer's token count (``tokens``), reading the header only
    and stopping once all are found; {} for a file that is not a GGUF."""
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

        def done() -> bool:  # every value asked for is read (the token count stands in for the vocabulary size)
            return all(name in values or (name == "vocab_size" and "tokens" in values) for name in wanted)

        wanted = [suffix.lstrip(".") for suffix in suffixes]

        if handle.read(4) != b"GGUF":
            return {}
        read("<I"), read("<Q")  # version, tensor count
        for _ in range(read("<Q")):
            key, kind = string(), read("<I")
            if kind in _GGUF_INTS and key.endswith(suffixes):
                values[key.rpartition(".")[2]] = read(_GGUF_INTS[kind])
            elif tokens and kind == 9 and key == "tokenizer.ggml.tokens":
                position = handle.tell()
                read("<I")
                values.setdefault("tokens", read("<Q"))
                handle.seek(position)
                skip(9)
            else:
                skip(kind)
            if done():
                break
    return values


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
    """What the heads read from the base: the LM head and the input embedding table, and which
    of its layers' states beside the final one (``feature_layers``)."""

    lm_head: torch.Tensor
    embed: torch.Tensor
    fingerprint: dict  # keys the feature cache (unchanged across versions)
    checkpoint_fingerprint: dict | None = None  # + the dtype-independent sketch, recorded in the heads
    revision: str | None = None  # the Hub commit of a base loaded from the Hub (recorded in the checkpoint)
    feature_layers: list[int] = field(default_factory=list)  # heads.feature_layers resolved for this base


def frozen_parts(base, dtype: torch.dtype, feature_layers: list[int] | None = None) -> FrozenParts:
    fp = fingerprint(base)
    return FrozenParts(base.get_output_embeddings().weight.detach().to(dtype),
                       base.get_input_embeddings().weight.detach().to(dtype), fp.to_dict(), fp.with_sketch(base),
                       getattr(base.config, "_commit_hash", None), list(feature_layers or []))
