"""Whether a weight's content changed: a cheap fingerprint of a tensor's bytes. Heads use it for
the draft rows they gather from the shared LM head, the decoder for its packed copies of the
base's weights (:mod:`draftheads.decoding.base.packed`); it lives here, on the ground floor, so
both read the same one."""
from __future__ import annotations

import torch

#: one refresh's fingerprints, by tensor (storage, dtype, shape, strides, device): a weight shared
#: by two owners (a tied LM head, the heads' readout) is read once
FingerprintMemo = dict


def content_fingerprint(weight: torch.Tensor) -> torch.Tensor:
    """Per row of ``weight``, the wrapping int64 sum of its bytes read as 64-bit words (narrower
    words where a row does not split into them). Why the content: a write through ``.data``
    (peft's LoRA ``merge()``, an EMA update, FSDP copying parameters in) changes neither the
    tensor's storage nor its ``_version``, so nothing but the bytes shows it. Any changed word
    changes its row's sum, and rows that trade places trade sums. An integer sum of the weight's
    own bytes needs no conversion, so it runs at memory speed (about what one verification step
    spends reading the same weight)."""
    w = weight.detach()
    rows = w.reshape(w.shape[0] if w.dim() else 1, -1)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    raw = rows.view(torch.uint8)
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if raw.shape[1] % size == 0 and raw.storage_offset() % size == 0:
            return raw.view(word).sum(1, dtype=torch.int64)
    return raw.sum(1, dtype=torch.int64)


def fingerprint_of(weight: torch.Tensor, memo: FingerprintMemo | None = None) -> torch.Tensor:
    """:func:`content_fingerprint`, read once per tensor within one ``memo``."""
    if memo is None:
        return content_fingerprint(weight)
    key = (weight.data_ptr(), weight.dtype, tuple(weight.shape), weight.stride(), weight.device)
    found = memo.get(key)
    if found is None:
        found = memo[key] = content_fingerprint(weight)
    return found

