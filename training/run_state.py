"""Checkpoint state that resuming can load without running any code from the checkpoint.

accelerate's ``register_for_checkpointing`` pickles the registered objects and loads them back
with ``torch.load(weights_only=False)``: whoever can write a checkpoint directory could then run
code on resume. draftheads therefore keeps its own state (LR scheduler, progress, KOALA's
discriminator and its optimizer) in a safetensors file (tensors) plus a JSON file (everything
else), written and read by the pure functions below, and checks every other file of a
checkpoint before accelerate opens it: JSON and safetensors are data only; anything else must
load with ``torch.load(weights_only=True)`` (which builds tensors and plain containers, never
calls arbitrary code) or the checkpoint is refused.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ..heads import CheckpointError

STATE_JSON = "draftheads_state.json"
STATE_TENSORS = "draftheads_state.safetensors"
_TENSOR = "__tensor__"
# not read on resume: DeepSpeed's pointer file and the script it copies next to its shards
_NEVER_LOADED = {"latest", "zero_to_fp32.py"}
_DATA_SUFFIXES = {".json", ".safetensors"}
CHECKPOINT_NAME = re.compile(r"step-\d{7}(\.partial)?")


def split_state(state: Any, tensors: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """A state dict as JSON-able data, with every tensor moved into ``tensors`` under its key
    path (a placeholder records where it goes back). Tuples become lists, int dict keys are
    kept as such via a marker, so :func:`join_state` restores what ``load_state_dict`` expects."""
    if isinstance(state, torch.Tensor):
        tensors[prefix] = state.detach().cpu().contiguous()
        return {_TENSOR: prefix}
    if isinstance(state, dict):
        return {"__dict__": [[key, split_state(value, tensors, f"{prefix}/{key}")] for key, value in state.items()]}
    if isinstance(state, (list, tuple)):
        return [split_state(value, tensors, f"{prefix}/{i}") for i, value in enumerate(state)]
    if state is None or isinstance(state, (bool, int, float, str)):
        return state
    raise TypeError(f"checkpoint state at {prefix or '/'} holds a {type(state).__name__}, which draftheads does not "
                    "save (only tensors, numbers, strings, lists and dicts).")


def join_state(data: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`split_state`."""
    if isinstance(data, dict) and _TENSOR in data:
        return tensors[data[_TENSOR]]
    if isinstance(data, dict):
        return {key: join_state(value, tensors) for key, value in data["__dict__"]}
    if isinstance(data, list):
        return [join_state(value, tensors) for value in data]
    return data


def save_run_state(directory: Path, objects: dict[str, Any]) -> None:
    """Write each object's ``state_dict()`` into STATE_JSON + STATE_TENSORS in ``directory``."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    data = {name: split_state(obj.state_dict(), tensors, name) for name, obj in objects.items()}
    save_file(tensors, str(directory / STATE_TENSORS))
    (directory / STATE_JSON).write_text(json.dumps(data) + "\n")


def load_run_state(directory: Path, objects: dict[str, Any], optional: tuple[str, ...] = ()) -> None:
    """Restore each object from STATE_JSON + STATE_TENSORS (or, for a checkpoint written before
    they existed, from accelerate's ``custom_checkpoint_<i>.pkl`` in registration order, loaded
    with ``weights_only=True``). Objects named in ``optional`` came after older checkpoints were
    written: absent there, they keep their fresh state (they are registered after the others)."""
    json_path = directory / STATE_JSON
    if not json_path.is_file():
        for index, obj in enumerate(obj for name, obj in objects.items() if name not in optional):
            obj.load_state_dict(_weights_only(directory / f"custom_checkpoint_{index}.pkl"))
        return
    from safetensors.torch import load_file

    try:
        data = json.loads(json_path.read_text())
        tensors = load_file(str(directory / STATE_TENSORS))
        objects = {name: obj for name, obj in objects.items() if name in data or name not in optional}
        states = {name: join_state(data[name], tensors) for name in objects}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{directory}: {STATE_JSON}/{STATE_TENSORS} are damaged or incomplete ({err}); resume "
                              "from another checkpoint or start over with run.resume=never.") from None
    for name, obj in objects.items():
        obj.load_state_dict(states[name])


def _weights_only(path: Path) -> Any:
    """``torch.load(weights_only=True)`` with accelerate's numpy allowances (its RNG files);
    a file that needs more (arbitrary classes or callables) is refused, never unpickled."""
    from accelerate.utils.other import load

    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; resume from another checkpoint or "
                              "start over with run.resume=never.")
    try:
        return load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure means "not plain tensor data"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"Refusing to resume from {path.parent}: {path.name} is not plain tensor data ({first[:200]}). "
            "Resuming never unpickles code; if you did not write this file, someone else may have: delete the "
            "checkpoint, or start over with run.resume=never.") from None


def check_checkpoint_files(directory: Path) -> None:
    """Before anything is loaded: every file in the checkpoint must be data. JSON and
    safetensors are; any other file must load with ``weights_only=True``."""
    for path in sorted(p for p in directory.rglob("*") if not p.is_dir()):
        if path.suffix in _DATA_SUFFIXES or path.name in _NEVER_LOADED:
            continue
        _weights_only(path)


def foreign_entries(checkpoints: Path) -> list[str]:
    """Entries of ``<output_dir>/checkpoints`` that draftheads did not write (``step-NNNNNNN``
    directories, complete or ``.partial``): ``run.resume=never`` must not delete them."""
    if not checkpoints.exists():
        return []
    if not checkpoints.is_dir() or checkpoints.is_symlink():
        return [checkpoints.name]
    return sorted(p.name for p in checkpoints.iterdir()
                  if not (p.is_dir() and not p.is_symlink() and CHECKPOINT_NAME.fullmatch(p.name)))
