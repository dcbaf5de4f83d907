"""A head checkpoint folder written and read: ``config.json`` + ``model.safetensors`` + the
card, and the checks that refuse at load what would only fail (or mislead) at the first
``generate``: another base, weights that disagree with their config, damaged tensors.

:meth:`~draftheads.heads.protocol.DraftHeads.save_pretrained` and
:meth:`~draftheads.heads.protocol.DraftHeads.from_pretrained` are the pair users call; they run
:func:`save_heads` and :func:`load_heads`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..head_config import CARD_NAME, CONFIG_NAME, WEIGHTS_NAME, HeadConfig, build_heads, read_config
from ...core.errors import CheckpointError
from ...core.atomic import atomic_directory
from .card import basic_card
from .hub import resolve_checkpoint


#: how far two ``lm_head_sketch`` entries of the same LM head may differ: above dtype rounding
#: (≲2e-4), far below another model's (≳0.1)
SKETCH_TOLERANCE = 2e-3


def save_heads(heads: nn.Module, directory: str | Path, dtype: torch.dtype | None = torch.bfloat16,
               card: str | None = None, files: dict[str, str] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (heads only; float tensors in ``dtype``),
    the model card ``README.md`` (``card``; default: a short one from the config) and any
    further text ``files`` ({name: content}).

    Atomic: everything goes to a temporary sibling folder (config last) that is renamed into
    place, so an interrupted save never leaves a folder that loads as a valid checkpoint.
    Files of an existing checkpoint folder that this save does not write (a training report)
    are kept; an existing folder that is not a draftheads checkpoint is refused, never
    emptied (:class:`~.atomic.atomic_directory`)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
             for k, v in heads.state_dict().items()}
    if card is None:
        card = basic_card(heads.config)
    with atomic_directory(directory) as tmp:
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"family": heads.family})
        for name, text in {CARD_NAME: card, **(files or {})}.items():
            (tmp / name).write_text(text)
        (tmp / CONFIG_NAME).write_text(json.dumps(heads.config.to_dict(), indent=2) + "\n")
    return directory


def fingerprint_diffs(saved: dict, expected: dict) -> list[str]:
    """How a checkpoint's recorded base differs from this base. The LM head matches when its
    hash matches, or, for the same base loaded in another dtype (whose rounding changes the
    hash), when both record an ``lm_head_sketch`` and the sketches agree within tolerance."""
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs base {v!r}" for k, v in expected.items()
             if k not in ("lm_head_sha256", "lm_head_sketch") and saved.get(k) != v]
    sha, sketch = expected.get("lm_head_sha256"), expected.get("lm_head_sketch")
    if sha is not None and saved.get("lm_head_sha256") != sha and not _sketches_agree(saved.get("lm_head_sketch"), sketch):
        note = "" if saved.get("lm_head_sketch") else " (the checkpoint records no dtype-independent lm_head_sketch)"
        diffs.append(f"lm_head_sha256: checkpoint {saved.get('lm_head_sha256')!r} vs base {sha!r}{note}")
    return diffs


def _sketches_agree(a: list | None, b: list | None) -> bool:
    return bool(a) and bool(b) and len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= SKETCH_TOLERANCE


def check_state(weights: Path, config: HeadConfig, state: dict[str, torch.Tensor],
                expected: dict[str, torch.Tensor]) -> None:
    """Refuse, at load, weights that would only fail (or silently mislead) at the first
    ``generate``: a tensor whose shape disagrees with config.json, non-finite values, and draft
    vocabulary ids outside the base vocabulary."""
    for name, tensor in state.items():
        want = expected.get(name)
        if want is not None and tuple(tensor.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{weights}: tensor {name!r} has shape {tuple(tensor.shape)} but config.json (hidden_size="
                f"{config.hidden_size}, vocab_size={config.vocab_size}, draft_vocab_size={config.draft_vocab_size}, "
                f"num_heads={config.num_heads}) needs {tuple(want.shape)}; the config and the weights disagree: "
                "re-download or re-train the checkpoint.")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{weights}: tensor {name!r} holds NaN or infinite values; the file is damaged: "
                                  "re-download or re-train the checkpoint.")
    ids = state.get("vocab_ids")
    if ids is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size):
        raise CheckpointError(f"{weights}: vocab_ids holds token id {int(ids.max()) if int(ids.min()) >= 0 else int(ids.min())}"
                              f" outside the vocabulary [0, {config.vocab_size}); the file is damaged: re-download or "
                              "re-train the checkpoint.")


def check_heads_base(config: HeadConfig, expected_fingerprint: dict, base_name: str | None = None,
                     where: str | Path = "the checkpoint") -> None:
    """Refuse heads made for another base; the message names both bases and both fingerprints."""
    saved = config.base_fingerprint
    if saved is None:
        raise CheckpointError(f"{where} records no base fingerprint, so it cannot be checked against this base.")
    diffs = fingerprint_diffs(saved, expected_fingerprint)
    if diffs:
        def shown(fp: dict) -> dict:
            return {k: v for k, v in fp.items() if k != "lm_head_sketch"}

        raise CheckpointError(
            f"The heads in {where} were trained for another base model: checkpoint base "
            f"{config.base_name or 'unknown'} (fingerprint {shown(saved)}), loaded base {base_name or 'unknown'} "
            f"(fingerprint {shown(expected_fingerprint)}); differing: " + "; ".join(diffs)
            + ". Load the base they were made for, or train heads for this base.")


def load_heads(directory: str | Path, expected_fingerprint: dict | None = None,
               dtype: torch.dtype = torch.float32, base_name: str | None = None, **hub_kwargs) -> nn.Module:
    """Load a head checkpoint from a local folder or a Hub id (``hub_kwargs``: ``revision``,
    ``cache_dir``, ``token``, ``local_files_only``; see :func:`.hub.resolve_checkpoint`); with
    ``expected_fingerprint`` refuse one made for another base (``base_name`` names it in the
    message). The heads' ``checkpoint_dir`` is the local folder they were read from."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = resolve_checkpoint(directory, **hub_kwargs)
    config = read_config(directory)
    if expected_fingerprint is not None:
        check_heads_base(config, expected_fingerprint, base_name, directory)
    heads = build_heads(config)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointError(f"{weights} not found: the checkpoint is incomplete.")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{weights} is corrupt or truncated ({err}); re-download or re-train it.") from None
    check_state(weights, config, state, heads.state_dict())
    heads.to(dtype)  # before loading: a float64 checkpoint must not pass through float32 params
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{weights} does not match its config.json (missing {missing}, unexpected {unexpected}).")
    heads.checkpoint_dir = Path(directory)
    return heads.to(dtype).eval().requires_grad_(False)
