"""The packing of the base's weights: which of its linear layers and its LM head run through
packed copies (:func:`use_packed_linears`), the plan measured for their shapes on this machine
and cached (:func:`plan_packing`), refreshed before each decoding call (:func:`refresh_packing`),
and the context the decoder's forwards run in (:func:`forward_context`)."""
from __future__ import annotations

import hashlib
import json
import warnings
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ...core.atomic import write_text_atomic
from ...core.content import FingerprintMemo
from ...core.errors import UnwritablePathError
from .fingerprint import lm_head_weight
from .architecture import decoder_body
from .attention import packed_attention
from .binding import binding, fuse_siblings, packed_forward, packed_linears, refresh_linears, release_linears, wearing
from .binding import use_packed_linears as wrap_linears
from .fewrow import load_kernel
from .gguf_blocks import attach_gguf_blocks
from .hardware import cpu_key
from .loading import cache_root
from .blocks import KINDS
from .packed import PackedReadout, PackedWeight, block_kind
from .plan import FOOTPRINT_RULE, PLAN, STREAM_BYTES, can_pack, measure_shape, shape_key, valid_shape_key, valid_timings


_PACKED_BASES: "weakref.WeakKeyDictionary[torch.nn.Module, PackedWeight]" = weakref.WeakKeyDictionary()


def use_packed_linears(model) -> bool:
    """Let the decoder's own forwards (:func:`~.forward.prefill`, :func:`~.forward.verify`,
    :func:`~.forward.lm_logits`) run
    the base's linear layers and LM head through oneDNN-packed weights or the few-row kernel,
    whichever measured fastest per shape (see :mod:`.plan`: packed bfloat16 bit-identical, the
    kernel within one bf16 rounding; float32 within float32 rounding), and the weights (LM head
    included) that are the GGUF the base was converted from through its blocks
    (:mod:`.gguf_blocks`: the few-row kernel's results bit for bit). The copies are kept beside
    the model, which is left as it is: its own ``generate``, ``deepcopy``, ``pickle`` and
    quantizers see plain ``nn.Linear`` layers.
    Returns whether packing is available here."""
    if model in _PACKED_BASES:
        return True
    if not can_pack(lm_head_weight(model)):
        return False
    wrap_linears(decoder_body(model))
    _PACKED_BASES[model] = PackedWeight()
    fuse_siblings(decoder_body(model))
    load_kernel(cache_root() / "kernels")
    attach_gguf_blocks(model, _PACKED_BASES[model])  # before the plan: it times the kinds the weights have
    _plan_base(model)
    return True


def base_weights(model) -> list[torch.Tensor]:
    """The base's weights a decoding forward streams: the LM head and its body's matrices."""
    return [lm_head_weight(model)] + [p for p in decoder_body(model).parameters() if p.dim() == 2]


def _plan_base(model) -> None:
    """Measure (or read) the packing plan for every weight shape of the base, the LM head and the
    stacked sibling products included."""
    products = fuse_siblings(decoder_body(model))
    plan_packing(base_weights(model) + [product.shape for product in products], blocks=base_block_kinds(model))


def base_block_kinds(model) -> dict[tuple[torch.dtype, int, int], set[str]]:
    """Per (dtype, out, in) shape, the kinds of GGUF blocks the base's weights of that shape have
    (:mod:`.gguf_blocks`): the block products the plan must time."""
    found: dict[tuple[torch.dtype, int, int], set[str]] = {}
    bound = binding(decoder_body(model))
    pairs = [(b.copies, b.module.weight) for b in bound.linears.values()] if bound is not None else []
    pairs += [(p.copies, p.shape) for p in (bound.products if bound is not None else [])]
    pairs.append((_PACKED_BASES[model], lm_head_weight(model)))
    for copies, weight in pairs:
        kind = block_kind(copies, weight)
        if kind is not None:
            found.setdefault((weight.dtype, int(weight.shape[0]), int(weight.shape[1])), set()).add(kind)
    return found


def block_summary(model) -> list[str]:
    """The base's products through GGUF blocks now, as sorted ``dtype:out×in:kind`` (empty: none, or
    not packed): what a step's measured cost depends on (the calibration's key)."""
    if model not in _PACKED_BASES:
        return []
    return sorted(f"{str(dtype).removeprefix('torch.')}:{out}x{inn}:{kind}"
                  for (dtype, out, inn), kinds in base_block_kinds(model).items() for kind in kinds)


def refresh_packing(model, memo: FingerprintMemo | None = None) -> None:
    """Before each decoding call: every packed copy of the base's weights made from content its
    weight no longer has — changed by an optimizer, ``load_state_dict``, or a write through
    ``.data`` (peft's LoRA ``merge()``, EMA, FSDP copies) — is dropped and made again from the
    weight as it is on its next use; layers the user replaced, wrapped or added since are
    followed. ``memo``: fingerprints already read in this refresh (a tied LM head is read once)."""
    packed = _PACKED_BASES.get(model)
    if packed is None:
        return
    memo = {} if memo is None else memo
    weight = getattr(model.get_output_embeddings(), "weight", None)  # an adapter swapped in may have none
    if isinstance(weight, torch.Tensor):
        packed.drop_stale(weight, memo)
    else:
        packed.clear()
    if refresh_linears(decoder_body(model), memo):
        _plan_base(model)


def release_packing(model) -> None:
    """Forget every packed copy and sibling product kept for ``model`` (its next decoder packs again)."""
    if _PACKED_BASES.pop(model, None) is not None:
        release_linears(decoder_body(model))


def packing_cache_path() -> Path:
    """This machine's packing measurements (keyed by :func:`~.hardware.cpu_key` and how much of a
    weight's copies a product is timed over, :data:`~.plan.STREAM_BYTES` and :data:`~.plan.FOOTPRINT_RULE`)."""
    key = {"cpu": cpu_key(), "stream_bytes": STREAM_BYTES, "footprint": FOOTPRINT_RULE}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "packing" / f"{digest}.json"


def read_packing_cache(path: Path) -> dict:
    """The measured shapes cached at ``path``, each entry checked; an unreadable file or entry is
    dropped with one warning naming the file (and measured again), never trusted."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("key") != json.loads(json.dumps(cpu_key())) \
                or not isinstance(data.get("shapes"), dict):
            raise ValueError("not a packing cache of this machine")
    except (OSError, ValueError, UnicodeDecodeError) as err:
        warnings.warn(f"Ignoring the packing cache {path} ({err}); measuring again.", UserWarning, stacklevel=3)
        return {}
    good = {k: v for k, v in data["shapes"].items() if valid_shape_key(k) and valid_timings(v)}
    if len(good) != len(data["shapes"]):
        warnings.warn(f"Ignoring {len(data['shapes']) - len(good)} malformed entries of the packing cache {path}; "
                      "measuring them again.", UserWarning, stacklevel=3)
    return good


def plan_packing(weights, alongside: Iterable[torch.Tensor] = (),
                 blocks: dict[tuple[torch.dtype, int, int], set[str]] | None = None) -> None:
    """Decide, for every shape among ``weights`` that packs here, at which row counts the packed
    path is faster (:class:`~.plan.PackingPlan`): from this machine's cache,
    else measured now (a few timings a shape, once per machine) and cached. A shape is timed over
    the footprint decoding streams: ``weights`` and the weights read ``alongside`` them between
    two uses (the base's, for the heads: :func:`~.plan.stream_copies`). An unwritable
    cache keeps the measurement in memory, with a warning. Float32 weights, and bfloat16 ones
    where bf16 is native, also get the few-row kernel as a candidate
    (:mod:`.fewrow`, compiled once per machine)."""
    weights = list(weights)
    if any(w.dtype in (torch.float32, torch.bfloat16) and w.device.type == "cpu" for w in weights):
        load_kernel(cache_root() / "kernels")
    path = packing_cache_path()
    if not PLAN.timings:
        for key, entry in read_packing_cache(path).items():
            PLAN.add(key, entry)
    missing = PLAN.missing(weights, blocks)
    if not missing:
        return
    footprint = sum(w.numel() * w.element_size() for w in [*weights, *alongside])
    for dtype, out_features, in_features in missing:
        PLAN.add(shape_key(dtype, out_features, in_features),
                 measure_shape(dtype, out_features, in_features, footprint=footprint,
                               kinds=_kinds_to_time(shape_key(dtype, out_features, in_features),
                                                    (blocks or {}).get((dtype, out_features, in_features), set()))))
    try:
        write_text_atomic(path, json.dumps({"key": cpu_key(), "shapes": PLAN.timings}, indent=1))
    except UnwritablePathError as err:
        warnings.warn(f"Cannot write the packing cache {path} ({err}); the measurement is kept for this process only "
                      "(set DRAFTHEADS_CACHE to a writable folder).", UserWarning, stacklevel=3)


def _kinds_to_time(key: str, needed: set[str]) -> set[str]:
    """The block kinds a shape is measured with: those its weights need, and those already measured
    for it (a measurement replaces the entry whole)."""
    measured = {name.removesuffix("_ms") for name in PLAN.timings.get(key, {})}
    return set(needed) | (measured & set(KINDS))


@contextmanager
def forward_context(model) -> Iterator[None]:
    """The context the decoder's forwards run in: packed linears and grouped-query packed
    attention where the base was prepared for them."""
    with packed_attention(model), (packed_forward(decoder_body(model)) if model in _PACKED_BASES
                                   else packed_linears(False)):
        yield


def holding_packing(model):
    """A decoding call's context: the base's layers wear the packed class for all its forwards
    (each forward's :func:`forward_context` is then a refcount) and are plain again when it ends; the
    packed path is still taken only inside those forwards."""
    return wearing(decoder_body(model) if model in _PACKED_BASES else None)



def packed_lm_head(model) -> PackedWeight | None:
    """The packed copies of the base's LM head, kept where :func:`use_packed_linears` prepared the
    base (None: the LM head runs as transformers' own layer)."""
    return _PACKED_BASES.get(model)


def use_packed_heads(heads: torch.nn.Module) -> None:
    """Decoding only: the heads read drafts out through packed LM-head rows (handed to them as a
    :class:`~.packed.PackedReadout`, since heads import nothing from ``decoding``) and run their
    own linear layers packed inside the decoder's :func:`~.binding.packed_forward` blocks. Drafts
    only propose, so their rounding never changes an output. The copies are kept beside the heads
    (nothing in them changes)."""
    heads.use_readout(PackedReadout())
    wrap_linears(heads)


def refresh_heads(heads: torch.nn.Module, memo: FingerprintMemo | None = None) -> None:
    """Before a decoding call: the heads' draft rows and readout copy
    (:meth:`~draftheads.heads.protocol.DraftHeads.drop_stale_copies`) and their own layers' packed
    copies are made again where the weight they came from changed since (``memo``: fingerprints
    already read in this refresh)."""
    heads.drop_stale_copies(memo)
    refresh_linears(heads, memo)
