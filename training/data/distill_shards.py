"""The self-distilled data set on disk: shards of token ids and the base's final hidden states,
each a folder written whole, checked before anything reads it.

A shard folder (``shard-00012/``) holds::

    manifest.json      kind, format, shard index, plan key, the prompts' ids, the base's
                       fingerprint, the dtype the base ran in, counts (sequences, tokens, answers)
    tokens.npy         (L,) uint16    every sequence's prompt + answer token ids, concatenated
    offsets.npy        (n+1,) int64   sequence k is tokens[offsets[k]:offsets[k+1]]
    answer_starts.npy  (n,) int32     index of sequence k's first answer token (its prompt length)
    finished.npy       (n,) bool      the answer ended with EOS (else it hit max_new_tokens)
    hidden.npy         (L, d) float16 hidden[i]: the base's final hidden state after tokens[i]
                                      (it predicts tokens[i+1]); a sequence's last row is zero
                                      (nothing follows its last token, so the decoder never ran it)
    layers.npy         (L, n·d) float16 only where the manifest names ``layers`` (e.g. [8, 22]): the
                                      residual stream after those decoder layers (transformers'
                                      ``output_hidden_states`` numbering), side by side in that
                                      order, rows as in hidden.npy (``distill_job --layers``)
    predicted.npy      (L,) int32     only where the manifest says ``"predicted": true``: the base's own
                                      choice after tokens[i] (argmax of its LM head over its final
                                      state there, in the dtype it ran in; −1 at a sequence's last
                                      row), what prompt positions are labelled with
                                      (``data.prompt_positions``)

Arrays are plain ``.npy`` files, read memory-mapped (``np.load(mmap_mode="r")``): a training run
sees millions of positions without holding them in RAM. A shard that exists is complete (it is
written in a staging folder and renamed in: :class:`~draftheads.core.atomic.atomic_directory`);
one that is truncated, from another base, another dtype or another plan, or without a layer
asked for, is named in one line and rebuilt, never read (:func:`shard_problem`). A shard without
``layers`` (every shard made before them) serves heads that read the final state only; one
without ``predicted`` (every shard made before it) serves answer-only training.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...core.atomic import atomic_directory
from ...core.errors import DraftheadsError, one_line
from ..features import layers_problem

SHARD_KIND = "draftheads-selfdistill-shard"
SHARD_FORMAT = 1
MANIFEST = "manifest.json"
#: the arrays of a shard and their dtypes (hidden is checked against the manifest's feature dtype)
ARRAYS = {"tokens": np.uint16, "offsets": np.int64, "answer_starts": np.int32, "finished": np.bool_}
FEATURE_DTYPES = {"float16": np.float16}
#: what ``predicted.npy`` holds, as messages name it
PREDICTED_TEXT = "the base's own prediction after every token, which prompt positions are labelled with"


class ShardError(DraftheadsError, ValueError):
    """A shard that cannot be trusted: one line naming the folder and the fix."""


@dataclass
class Shard:
    """One shard's sequences: ``tokens`` (L,), ``offsets`` (n+1,), ``answer_starts`` (n,),
    ``finished`` (n,), ``hidden`` (L, d) or None (token ids only, as committed), ``ids`` (n,);
    ``layers`` (L, n·d) the states of the base layers ``feature_layers`` names, or None;
    ``predicted`` (L,) int32 the base's own choice after each token, or None."""

    tokens: np.ndarray
    offsets: np.ndarray
    answer_starts: np.ndarray
    finished: np.ndarray
    ids: list[str]
    hidden: np.ndarray | None = None
    layers: np.ndarray | None = None
    feature_layers: list[int] = field(default_factory=list)
    predicted: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def sequence(self, k: int) -> np.ndarray:
        return self.tokens[self.offsets[k]: self.offsets[k + 1]]

    @property
    def answer_tokens(self) -> int:
        """Answer positions (each answer token is one position a head learns to predict)."""
        return int(self.offsets[-1] - self.offsets[0] - self.answer_starts.astype(np.int64).sum())

    @classmethod
    def from_sequences(cls, ids: list[str], prompts: list[list[int]], answers: list[list[int]], eos: set[int],
                       hidden: list[np.ndarray] | None = None) -> "Shard":
        """Concatenate per-sequence prompt and answer ids (and their (len, d) states)."""
        lengths = [len(p) + len(a) for p, a in zip(prompts, answers)]
        if max((t for p, a in zip(prompts, answers) for t in (*p, *a)), default=0) > np.iinfo(np.uint16).max:
            raise ShardError("a token id does not fit in uint16: this format holds vocabularies up to 65,536.")
        tokens = np.fromiter((t for p, a in zip(prompts, answers) for t in (*p, *a)), np.uint16, sum(lengths))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        starts = np.array([len(p) for p in prompts], np.int32)
        finished = np.array([bool(a) and a[-1] in eos for a in answers], np.bool_)
        states = np.concatenate(hidden).astype(np.float16) if hidden is not None else None
        return cls(tokens, offsets, starts, finished, list(ids), states)


def manifest_for(shard: Shard, index: int, expected: dict, extra: dict | None = None) -> dict:
    """What a shard records of itself: ``expected`` (plan key, fingerprint, dtype, feature
    dtype, prompt key — what :func:`shard_problem` compares) + its counts; ``"predicted": true``
    exactly when the shard holds the base's predictions (``predicted.npy``)."""
    manifest = {"kind": SHARD_KIND, "format": SHARD_FORMAT, "shard": index, **expected,
                "sequences": len(shard), "tokens": int(shard.offsets[-1]), "answer_tokens": shard.answer_tokens,
                "hidden_size": None if shard.hidden is None else int(shard.hidden.shape[1]), "ids": shard.ids,
                **(extra or {})}
    manifest.pop("predicted", None)
    if shard.predicted is not None:
        manifest["predicted"] = True
    return manifest


def is_shard_folder(folder: Path) -> bool:
    """Whether ``folder`` is one this module wrote (its manifest says so): only such a folder is
    ever replaced or removed."""
    try:
        return json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("kind") == SHARD_KIND
    except (OSError, ValueError, AttributeError):
        return False


def write_shard(folder: Path, shard: Shard, manifest: dict) -> None:
    """Write the shard whole (staging folder, then one rename): a shard folder that exists is complete."""
    with atomic_directory(folder, ours=is_shard_folder) as tmp:
        for name in ARRAYS:
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(getattr(shard, name), ARRAYS[name]))
        if shard.hidden is not None:
            np.save(tmp / "hidden.npy", np.ascontiguousarray(shard.hidden))
        if shard.layers is not None:
            np.save(tmp / "layers.npy", np.ascontiguousarray(shard.layers))
        if shard.predicted is not None:
            np.save(tmp / "predicted.npy", np.ascontiguousarray(shard.predicted, np.int32))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def _load(folder: Path, name: str) -> np.ndarray:
    return np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False)


def shard_problem(folder: Path, expected: dict, with_hidden: bool = True) -> str | None:
    """What is wrong with ``folder`` as the shard ``expected`` describes (its plan, base
    fingerprint, dtype, prompts; ``layers``: the base layers whose states it must hold, beside
    the final state; ``predicted``: true where it must hold the base's predictions), or None: a
    missing or unreadable manifest or array (a truncated ``.npy`` does not map), other settings,
    or arrays whose sizes disagree."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "it has no manifest.json (an unfinished or foreign folder)"
    except (OSError, ValueError) as err:
        return f"its manifest.json cannot be read ({one_line(err)})"
    if not isinstance(manifest, dict) or manifest.get("kind") != SHARD_KIND or manifest.get("format") != SHARD_FORMAT:
        return f"it is not a format-{SHARD_FORMAT} self-distillation shard"
    expected = dict(expected)
    asked = expected.pop("layers", [])
    asked_predicted = bool(expected.pop("predicted", False))
    for key, want in expected.items():
        if manifest.get(key) != want:
            what = {"base_fingerprint": "another base", "dtype": "another dtype", "feature_dtype": "another feature dtype",
                    "plan_key": "another plan", "prompt_key": "other prompts"}.get(key, f"another {key}")
            shown = want if key != "base_fingerprint" else (want or {}).get("lm_head_sha256", "")[:12]
            got = manifest.get(key) if key != "base_fingerprint" else (manifest.get(key) or {}).get("lm_head_sha256", "")[:12]
            return f"it was made with {what} ({key} {got!r}, this run {shown!r})"
    recorded = manifest.get("layers", [])
    if not isinstance(recorded, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in recorded):
        return f"its manifest.json's layers {recorded!r} is not a list of layer numbers"
    if with_hidden and (problem := layers_problem(recorded, asked)):
        return problem
    predicted = manifest.get("predicted", False)
    if not isinstance(predicted, bool):
        return f"its manifest.json's predicted {predicted!r} is not true or false"
    if with_hidden and asked_predicted and not predicted:
        return f"it holds no predicted.npy ({PREDICTED_TEXT})"
    names = list(ARRAYS) + (["hidden"] + (["layers"] if recorded else []) + (["predicted"] if predicted else [])
                            if with_hidden else [])
    arrays = {}
    for name in names:
        try:
            arrays[name] = _load(folder, name)
        except FileNotFoundError:
            return f"{name}.npy is missing"
        except (OSError, ValueError) as err:
            return f"{name}.npy is truncated or unreadable ({one_line(err)})"
    n, length = manifest.get("sequences"), manifest.get("tokens")
    if not isinstance(n, int) or not isinstance(length, int):
        return "its manifest.json lacks the sequence and token counts"
    sizes = {"tokens": (length,), "offsets": (n + 1,), "answer_starts": (n,), "finished": (n,)}
    if with_hidden:
        sizes["hidden"] = (length, manifest.get("hidden_size"))
        if recorded:
            sizes["layers"] = (length, (manifest.get("hidden_size") or 0) * len(recorded))
        if predicted:
            sizes["predicted"] = (length,)
    for name, shape in sizes.items():
        if tuple(arrays[name].shape) != shape:
            return f"{name}.npy has shape {tuple(arrays[name].shape)}, the manifest says {shape}"
    feature = FEATURE_DTYPES.get(manifest.get("feature_dtype"), np.float16)
    wanted = {**ARRAYS, "hidden": feature, "layers": feature, "predicted": np.int32}
    for name, array in arrays.items():
        if array.dtype != wanted[name]:
            return f"{name}.npy holds {array.dtype}, not {np.dtype(wanted[name])}"
    if int(arrays["offsets"][-1]) != length:
        return f"offsets.npy ends at {int(arrays['offsets'][-1])}, not at the {length} tokens"
    return None


def open_shard(folder: str | Path, expected: dict, rebuild: str, with_hidden: bool = True) -> Shard:
    """A checked shard, memory-mapped; anything wrong is one :class:`ShardError` naming the
    folder and the fix (``rebuild``: the command that rebuilds bad shards)."""
    folder = Path(folder)
    problem = shard_problem(folder, expected, with_hidden)
    if problem:
        raise ShardError(f"{folder}: {problem}; rebuild it: `{rebuild}` (it rebuilds every bad shard).")
    manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    arrays = {name: _load(folder, name) for name in ARRAYS}
    hidden = _load(folder, "hidden") if with_hidden else None
    recorded = list(manifest.get("layers") or []) if with_hidden else []
    layers = _load(folder, "layers") if recorded else None
    predicted = _load(folder, "predicted") if with_hidden and manifest.get("predicted") is True else None
    return Shard(ids=list(manifest["ids"]), hidden=hidden, layers=layers, feature_layers=recorded,
                 predicted=predicted, **arrays)


def discard(folder: Path) -> None:
    """Remove a bad shard (a ``shard-NNNNN`` folder of the job's own output), renamed aside first
    so no reader sees half of it."""
    if folder.exists():
        aside = folder.with_name(f".{folder.name}.bad-{os.getpid()}")
        os.replace(folder, aside)
        shutil.rmtree(aside, ignore_errors=True)


# -- token ids as committed (compressed, no features) ------------------------------------------------
def save_token_ids(path: Path, shard: Shard) -> None:
    """One shard's token ids, compressed (``.npz``: tokens uint16, offsets, answer_starts,
    finished); its prompt ids go in the folder's index."""
    from ...core.atomic import atomic_file

    with atomic_file(path) as tmp:
        with open(tmp, "wb") as handle:
            np.savez_compressed(handle, tokens=shard.tokens, offsets=shard.offsets.astype(np.int64),
                                answer_starts=shard.answer_starts, finished=shard.finished)


def load_token_ids(path: Path, ids: list[str]) -> Shard:
    """A committed shard's token ids (no features); a damaged file, or arrays that do not describe
    ``len(ids)`` whole sequences of uint16 ids, is one line naming it."""
    import zipfile
    import zlib

    try:
        with np.load(path, allow_pickle=False) as data:
            raw = {name: np.asarray(data[name]) for name in ARRAYS}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        raise ShardError(f"{path} cannot be read ({one_line(err)}); restore it from git "
                         f"(`git checkout -- {path}`).") from None
    problem = token_ids_problem(raw, len(ids))
    if problem:
        raise ShardError(f"{path}: {problem}; restore it from git (`git checkout -- {path}`) or export it again.")
    return Shard(ids=list(ids), **{name: raw[name].astype(ARRAYS[name]) for name in ARRAYS})


def token_ids_problem(raw: dict[str, np.ndarray], n: int) -> str | None:
    """What keeps ``raw`` (tokens, offsets, answer_starts, finished as stored) from being ``n``
    sequences in this format, or None: checked before any cast, so nothing wraps."""
    for name, array in raw.items():
        if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_):
            return f"{name} is a {array.ndim}-d {array.dtype} array, not a 1-d integer one"
    tokens, offsets, starts = raw["tokens"], raw["offsets"].astype(np.int64), raw["answer_starts"].astype(np.int64)
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) > np.iinfo(np.uint16).max):
        return (f"it holds token id {int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())}, outside "
                "0..65535 (this format holds vocabularies up to 65,536)")
    if offsets.shape != (n + 1,) or starts.shape != (n,) or raw["finished"].shape != (n,):
        return f"it does not hold the {n} sequences its index lists"
    if offsets[0] != 0 or offsets[-1] != len(tokens) or (np.diff(offsets) < 0).any():
        return f"its offsets do not rise from 0 to its {len(tokens)} tokens"
    if (starts < 0).any() or (starts > np.diff(offsets)).any():
        return "an answer_starts entry lies outside its sequence"
    if not np.isin(raw["finished"], (0, 1)).all():
        return "finished holds values other than true and false"
    return None
