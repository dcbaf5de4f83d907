"""What "the same output as the base" means in each dtype, and how a divergence is judged.

A tree verification computes the base's logits for several tokens in one forward; the base's
own ``generate`` computes them one token at a time. Both are the same function evaluated in a
different order of floating-point operations, so they agree exactly only where rounding
cannot reach the decision:

* float64: token-identical (rounding is far below any logit gap that occurs).
* float32: identical, or the first divergence sits at a near-tie of the base's logits
  (top-1/top-2 gap < :data:`NEAR_TIE`).
* bfloat16 / float16: every computation order rounds differently (transformers' own prompt
  lookup differs from its plain ``generate`` on most prompts), so the first divergence must
  sit where the top-1/top-2 gap is within the dtype's rounding at the logits' magnitude —
  ≤ :data:`BAND_ULPS` units in the last place at the row's largest |logit| — and divergences
  may be no more frequent than transformers shows against itself (the bench's controls).

Why the row's largest |logit| and not the top-1 logit: a logit's rounding error comes from the
products that form it (hidden state × LM-head row, accumulated over 30 layers), whose scale is
that of the row's logits, not of the one value that happens to win; a top-1 logit near 0
(measured: −0.35 in a row whose logits reach ±10) would otherwise count a 0.07 gap as 37 ulps.

Sampling is exact in distribution in every dtype (the χ² tests in ``tests/properties/test_sampling.py``).
"""
from __future__ import annotations

import math

import torch

#: float32's near-tie: a top-1/top-2 logit gap below this is decided by rounding.
NEAR_TIE = 1e-3
#: 16-bit dtypes: a first divergence is within rounding when the gap is ≤ this many ulps.
BAND_ULPS = 2.0


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of ``dtype``'s floats at ``magnitude`` (one unit in the last place)."""
    magnitude = abs(float(magnitude))
    if magnitude == 0.0 or not math.isfinite(magnitude):
        return float(torch.finfo(dtype).tiny)
    return float(torch.finfo(dtype).eps) * 2.0 ** math.floor(math.log2(magnitude))


def within_band(dtype: torch.dtype, gap: float, scale: float) -> bool:
    """Whether a first divergence at a top-1/top-2 logit ``gap`` in a row whose largest |logit|
    is ``scale`` is one rounding may decide in ``dtype`` (the per-dtype rule above)."""
    if dtype in (torch.bfloat16, torch.float16):
        return gap <= BAND_ULPS * ulp(dtype, scale)
    if dtype == torch.float32:
        return gap < NEAR_TIE
    return gap <= BAND_ULPS * ulp(dtype, scale)


@torch.no_grad()
def first_divergence(base, reference: torch.Tensor, ours: torch.Tensor, prompt_len: int) -> dict | None:
    """reference, ours (1, L) full sequences; None when the generated tokens are identical.
    Otherwise the first differing generated position and the base's own top-1/top-2 logit gap
    there (a plain forward of the reference prefix, in the base's dtype), in logits and in
    ulps of the dtype at the row's largest |logit|, and whether it lies within the dtype's band."""
    ref, got = reference[0, prompt_len:].tolist(), ours[0, prompt_len:].tolist()
    if ref == got:
        return None
    index = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    prefix = reference[:, : prompt_len + index]
    logits = base(prefix, attention_mask=torch.ones_like(prefix)).logits[0, -1]
    top = logits.float().topk(2).values
    gap, top1, scale = float(top[0] - top[1]), float(top[0]), float(logits.float().abs().max())
    dtype = logits.dtype
    return {"position": index, "reference_token": ref[index] if index < len(ref) else None,
            "our_token": got[index] if index < len(got) else None, "top1_top2_gap": gap,
            "gap_ulps": round(gap / ulp(dtype, scale), 3), "top1_logit": top1, "logit_scale": scale,
            "dtype": str(dtype).removeprefix("torch."), "within_band": within_band(dtype, gap, scale)}
