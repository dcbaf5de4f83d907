"""Read FasterDecoding Medusa head checkpoints into draftheads :class:`MedusaHeads`.

Two published layouts (github.com/FasterDecoding/Medusa, ``medusa/model``), both a
``config.json`` (``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``)
next to ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt`` holding the state dict of a
``ModuleList`` of heads:

* **Medusa-1** (``medusa_model.py``): head i = ``Sequential(ResBlock × L, Linear(d, V, bias=False))``
  → keys ``{i}.{j}.linear.weight`` (d, d), ``{i}.{j}.linear.bias`` (d,), ``{i}.{L}.weight`` (V, d).
  Imported with ``owns_lm_head=True``: each head keeps its projection.
* **shared LM head, "v2"** (``medusa_model_legacy.py``; its trainer ``train_legacy.py`` writes
  ``version: "2"`` into config.json): head i = ``Sequential(ResBlock × L)`` read out through the
  base's LM head → only the ResBlock keys. Imported as ordinary heads (the draftheads default).

The variant is read from the tensors (a ``{i}.{L}.weight`` projection or not), not from ``version``.

``ResBlock`` is ``x + SiLU(W x + b)`` in both, as here. Medusa builds ``[ResBlock(d)] * L``, one
module repeated (tied weights; Medusa PR #133): the state dict then repeats the same tensor
under every j, and the import copies it into L separate blocks, which computes the same function.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ...core.errors import CheckpointError
from ..head_config import HeadConfig, read_json_object
from ..medusa import MedusaHeads

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


@dataclass(frozen=True)
class MedusaLayout:
    """What a Medusa checkpoint's tensors say about it."""

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int | None  # rows of the per-head projection; None = shared LM head layout

    @property
    def owns_lm_head(self) -> bool:
        return self.vocab_size is not None


def read_medusa_state(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The heads' state dict (``medusa_head.`` prefixes of whole-model saves stripped) and its file."""
    for name in WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            break
    else:
        raise CheckpointError(f"{folder} has neither of {list(WEIGHT_FILES)}: not a Medusa head checkpoint.")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any reader failure means the file is unusable
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err}); re-download it.") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict of tensors; re-download it.")
    odd = sorted(str(k) for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor))
    if odd:
        raise CheckpointError(f"{path}: entries {odd[:5]} are not named tensors; re-download it.")
    return {k.removeprefix("medusa_head."): v for k, v in state.items()}, path


def infer_layout(state: dict[str, torch.Tensor], where: Path) -> MedusaLayout:
    """Heads, layers, sizes and variant from the tensor names and shapes; refuses anything else."""
    if not state:
        raise CheckpointError(f"{where} holds no tensors.")
    unknown = sorted(k for k in state if not _KEY.match(k))
    if unknown:
        raise CheckpointError(f"{where} has tensors that are not Medusa head weights: {unknown[:5]}.")
    heads: dict[int, dict[int, set[str]]] = {}
    for key in state:
        i, j, kind = _KEY.match(key).groups()
        heads.setdefault(int(i), {}).setdefault(int(j), set()).add(kind)
    if sorted(heads) != list(range(len(heads))):
        raise CheckpointError(f"{where}: head indices {sorted(heads)} are not 0..K-1.")
    layers = {i: sorted(j for j, kinds in blocks.items() if "linear.weight" in kinds) for i, blocks in heads.items()}
    num_layers = len(layers[0])
    if any(ls != list(range(num_layers)) for ls in layers.values()):
        raise CheckpointError(f"{where}: heads have different ResBlock counts {layers}; Medusa heads share one depth.")
    projections = [f"{i}.{num_layers}.weight" in state for i in heads]
    if any(projections) != all(projections):
        raise CheckpointError(f"{where}: only some heads have a vocabulary projection ({projections}).")
    if num_layers == 0:
        raise CheckpointError(f"{where}: heads without ResBlocks are not supported (draftheads Medusa heads have ≥ 1).")
    first = state["0.0.linear.weight"]
    hidden = int(first.shape[0]) if first.dim() == 2 else 0
    last = state.get(f"0.{num_layers}.weight")
    vocab = int(last.shape[0]) if all(projections) and last.dim() == 2 else None
    layout = MedusaLayout(len(heads), num_layers, hidden, vocab)
    check_tensors(state, layout, where)
    return layout


def expected_shape(key: str, layout: MedusaLayout) -> tuple[int, ...]:
    """The shape a Medusa tensor must have for ``layout`` (d = hidden size, V = vocabulary)."""
    kind = _KEY.match(key).group(3)
    d = layout.hidden_size
    return {"linear.weight": (d, d), "linear.bias": (d,), "weight": (layout.vocab_size or 0, d)}[kind]


def check_tensors(state: dict[str, torch.Tensor], layout: MedusaLayout, where: Path) -> None:
    """Every tensor is what the layout says (shape), a floating dtype, and finite: a checkpoint
    that fails here would convert into heads that ``load_heads`` refuses or that draft garbage."""
    if layout.hidden_size < 1:
        raise CheckpointError(f"{where}: tensor '0.0.linear.weight' has shape {tuple(state['0.0.linear.weight'].shape)}, "
                              "not (d, d); not a Medusa checkpoint, or a damaged one: re-download it.")
    for key, tensor in sorted(state.items()):
        want = expected_shape(key, layout)
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{where}: tensor {key!r} has shape {tuple(tensor.shape)} but the heads' hidden size "
                                  f"{layout.hidden_size} needs {want}; the checkpoint is damaged: re-download it.")
        if not tensor.is_floating_point():
            raise CheckpointError(f"{where}: tensor {key!r} is {tensor.dtype}; Medusa weights are floating point "
                                  "(float32/bfloat16/float16): the checkpoint is damaged or not Medusa heads.")
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{where}: tensor {key!r} holds NaN or infinite values; the checkpoint is damaged "
                                  "(or diverged in training): re-download it.")


#: config.json fields import reads, each a positive integer when present
INT_FIELDS = ("medusa_num_heads", "medusa_num_layers")


def read_medusa_config(folder: Path) -> dict:
    """The Medusa ``config.json`` through the one JSON-object reader, its numeric fields checked."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a Medusa checkpoint has a config.json with medusa_num_heads.")
    config = read_json_object(path, "a Medusa config", "re-download the Medusa checkpoint.")
    for name in INT_FIELDS:
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CheckpointError(f"{path}: {name} must be a positive integer, got {value!r}; fix the field or "
                                  "re-download the Medusa checkpoint.")
    return config


def import_medusa(folder: str | Path, base_fingerprint: dict, base_name: str | None = None,
                  base_revision: str | None = None) -> MedusaHeads:
    """A Medusa checkpoint folder → :class:`MedusaHeads` for the base with ``base_fingerprint``
    (its ``hidden_size``/``vocab_size`` must match the checkpoint's), in the checkpoint's dtype."""
    folder = Path(folder)
    config = read_medusa_config(folder)
    state, path = read_medusa_state(folder)
    layout = infer_layout(state, path)
    for name, held in (("medusa_num_layers", layout.num_layers), ("medusa_num_heads", layout.num_heads)):
        recorded = config.get(name)
        if recorded is not None and recorded != held:
            raise CheckpointError(f"{folder}/config.json says {name}={recorded} but {path.name} holds {held} "
                                  f"({'ResBlocks per head' if name.endswith('layers') else 'heads'}); the checkpoint "
                                  "is inconsistent: re-download it.")
    if layout.hidden_size != base_fingerprint["hidden_size"]:
        raise CheckpointError(f"The Medusa heads in {folder} read hidden states of size {layout.hidden_size} but "
                              f"the base has hidden_size {base_fingerprint['hidden_size']}: load the base they were "
                              f"trained for ({config.get('base_model_name_or_path', 'unknown')}).")
    if layout.owns_lm_head and layout.vocab_size != base_fingerprint["vocab_size"]:
        raise CheckpointError(f"Vocabulary-size mismatch: the Medusa heads in {folder} project to "
                              f"{layout.vocab_size} tokens but the base has {base_fingerprint['vocab_size']}: load "
                              f"the base they were trained for ({config.get('base_model_name_or_path', 'unknown')}).")
    heads = MedusaHeads(HeadConfig(
        family="medusa", num_heads=layout.num_heads, num_layers=layout.num_layers,
        hidden_size=layout.hidden_size, vocab_size=base_fingerprint["vocab_size"], base_fingerprint=base_fingerprint,
        base_name=base_name or config.get("base_model_name_or_path"), base_revision=base_revision,
        owns_lm_head=layout.owns_lm_head,
        extra={"imported_from": {"format": "medusa-1" if layout.owns_lm_head else "medusa-shared-lm-head",
                                 "path": str(folder), "file": path.name, "version": config.get("version"),
                                 "base_model_name_or_path": config.get("base_model_name_or_path")}}))
    ours = {f"heads.{key}": value for key, value in state.items() if not key.endswith(f".{layout.num_layers}.weight")}
    ours.update({f"lm_heads.{i}.weight": state[f"{i}.{layout.num_layers}.weight"]
                 for i in range(layout.num_heads) if layout.owns_lm_head})
    heads.to(state["0.0.linear.weight"].dtype)  # keep the source precision (float64 tests compare exactly)
    ours["vocab_ids"] = heads.vocab_ids
    missing, unexpected = heads.load_state_dict(ours, strict=False)
    if missing or unexpected:  # pragma: no cover - infer_layout guarantees the shapes of the names
        raise CheckpointError(f"{path} does not map onto Medusa heads (missing {missing}, unexpected {unexpected}).")
    return heads.eval().requires_grad_(False)
