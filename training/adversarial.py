"""KOALA: adversarial learning for draft heads (arXiv 2408.08146).

What it is
----------
KOALA ("K-layer Optimized Adversarial Learning Architecture") is not a head family but two
changes on top of one (Medusa, Hydra, ...):

1. **K-layer heads**: ``heads.num_layers`` = K stacked, distinct ResBlocks per head (the
   families already build them; nothing here).
2. **Adversarial learning**: besides the supervised loss (CE on the base's tokens and/or KL to
   its distribution), the heads are trained to fool a *discriminator* that tells the base
   model's next-token distribution (REAL) from the heads' (FAKE).

Why
---
Token-level CE/KL treats every position independently and mostly pulls the head's top-1 toward
the label. The discriminator looks at the whole predicted distribution in its context and
learns *any* systematic difference from the base's (too flat where the base is sure, wrong
mass on the runner-ups that tree drafting uses as children, ...); its gradient is an extra,
learned signal that pushes the heads' distribution toward the base's own — which is what
decides acceptance in speculative decoding.

How (this module)
-----------------
* REAL for head k at position t: the base's distribution of the token head k drafts, i.e. its
  LM head on the hidden state at t+k+1 over the draft vocabulary (the very ``teacher_logits``
  the KL loss uses, computed whenever the adversarial section is on). FAKE: the head's logits.
* Discriminator input (cheap and informative): the distribution's *expected output embedding*
  ``softmax(logits) @ W_draft`` (d-dim; centered on the mean row of W and scaled by the RMS of
  the centered rows, so a flat distribution sits near 0 and a sure one at unit scale),
  concatenated with the head's input context h_t (layer-normalized, detached) and a learned
  embedding of the head index; a small LeakyReLU MLP gives one logit.
* Losses (training/losses.py): discriminator BCE (FAKE detached, optional one-sided label
  smoothing and R1 gradient penalty), non-saturating generator loss −log D(FAKE), and the heads'
  objective supervised + λ·adversarial with λ from the schedule (0 during ``warmup_steps``,
  then constant or a linear ramp).
* The discriminator has its own Adam (betas 0.5, 0.999) and steps ``disc_steps`` times per
  micro-batch on that batch, before the heads' loss reads it (frozen) — the usual D-then-G
  alternation. Its gradients are summed over processes (losses are normalized by the global
  label count, as the heads' are), so data-parallel runs train it like one process.
* Exactness: it is initialized from its own ``torch.Generator`` (never the global RNG), has no
  dropout, and never changes the data order or what the heads see; with λ = 0 the heads'
  graph is the plain supervised one, so such a run reproduces the plain run bit for bit.
  The trainer registers discriminator and optimizer for ``accelerator.save_state``, so a
  resumed run continues exactly. The discriminator is not part of the saved head checkpoint;
  the checkpoint's ``config.extra["koala"]`` records the KOALA settings instead.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..heads import display_name
from .losses import IGNORE, discriminator_bce, generator_adversarial, label_counts, r1_penalty

DISC_SEED_OFFSET = 0x6B6F616C  # "koal": the discriminator's generator seed = train.seed + this
HEAD_EMBEDDING = 16  # size of the head-index embedding


def koala_label(family: str) -> str:
    """"KOALA-Medusa", "KOALA-Hydra", ... (what reports call a checkpoint trained with KOALA)."""
    return f"KOALA-{display_name(family)}"


def koala_info(family: str, num_layers: int, section) -> dict:
    """What ``HeadConfig.extra["koala"]`` records about a KOALA checkpoint."""
    return {"label": koala_label(family), "layers": num_layers, "adversarial_weight": section.weight,
            "schedule": section.schedule, "warmup_steps": section.warmup_steps, "ramp_steps": section.ramp_steps,
            "disc_hidden": section.disc_hidden, "disc_steps": section.disc_steps, "disc_lr": section.disc_lr,
            "label_smoothing": section.label_smoothing, "grad_penalty": section.grad_penalty,
            "paper": "arXiv:2408.08146"}


def adversarial_weight(step: int, weight: float, warmup_steps: int = 0, schedule: str = "constant",
                       ramp_steps: int = 0) -> float:
    """λ at optimizer step ``step`` (0-based): 0 for the first ``warmup_steps`` steps, then
    ``weight`` (constant) or ``weight · min(1, (step − warmup + 1) / ramp_steps)`` (linear)."""
    if step < warmup_steps or not weight:
        return 0.0
    if schedule == "linear":
        return weight * min(1.0, (step - warmup_steps + 1) / max(1, ramp_steps))
    return weight


def expected_embedding(logits: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """softmax(logits) @ W: the distribution's mean output embedding (..., V') → (..., d). Two
    distributions with the same top-1 but different spread land at different points (a sure
    prediction sits near its token's row of W, a flat one near the mean of the rows)."""
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return probs.to(logits.dtype) @ weight.to(logits.dtype)


class Discriminator(nn.Module):
    """D(distribution embedding e (P, K, d), context h_t (P, d)) → logits (P, K) (REAL > 0).

    Built on the meta device and initialized from its own ``torch.Generator`` (PyTorch's
    default U(±1/√fan_in) for the linear layers, N(0, 1) for the head embedding): building it
    never draws from the global RNG."""

    def __init__(self, hidden_size: int, num_heads: int, width: int = 256, embedding_scale: float = 1.0,
                 seed: int = 0, embedding_center: torch.Tensor | None = None):
        super().__init__()
        meta = {"device": "meta"}
        self.head_embedding = nn.Embedding(num_heads, HEAD_EMBEDDING, **meta)
        self.net = nn.Sequential(nn.Linear(2 * hidden_size + HEAD_EMBEDDING, width, **meta), nn.LeakyReLU(0.2),
                                 nn.Linear(width, width, **meta), nn.LeakyReLU(0.2), nn.Linear(width, 1, **meta))
        self.to_empty(device="cpu")
        # input normalization: constants of the frozen base (mean row of W_draft, RMS of its centered
        # rows), recomputed from it at every start, so not part of the state dict
        self.embedding_scale = float(embedding_scale)
        center = torch.zeros(hidden_size) if embedding_center is None else embedding_center.detach().cpu()
        self.register_buffer("embedding_center", center.clone(), persistent=False)
        self.reset_parameters(torch.Generator().manual_seed(seed))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        self.head_embedding.weight.normal_(0.0, 1.0, generator=generator)
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                bound = 1.0 / math.sqrt(layer.in_features)
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)

    def forward(self, embedding: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        batch, num_heads, _ = embedding.shape
        dtype = self.head_embedding.weight.dtype
        e = (embedding.to(dtype) - self.embedding_center.to(dtype)) / self.embedding_scale
        h = F.layer_norm(context.to(dtype), context.shape[-1:])[:, None, :].expand(-1, num_heads, -1)
        k = self.head_embedding.weight[None, :num_heads].expand(batch, -1, -1)
        return self.net(torch.cat([e, h, k], dim=-1)).squeeze(-1)


class Adversary:
    """The discriminator, its optimizer and the adversarial settings, as the trainer uses them."""

    def __init__(self, section, hidden_size: int, num_heads: int, draft_weight: torch.Tensor, seed: int,
                 device, dtype: torch.dtype):
        self.section = section
        weight = draft_weight.detach().double()
        center = weight.mean(0)
        scale = float((weight - center).pow(2).mean().sqrt()) or 1.0
        self.discriminator = Discriminator(hidden_size, num_heads, section.disc_hidden, scale,
                                           seed + DISC_SEED_OFFSET, center).to(device, dtype)
        self.optimizer = torch.optim.Adam(self.discriminator.parameters(), lr=section.disc_lr, betas=(0.5, 0.999))
        self.head_weights = torch.full((num_heads,), 1.0 / num_heads, device=device)  # D: every head alike

    def weight(self, step: int) -> float:
        s = self.section
        return adversarial_weight(step, s.weight, s.warmup_steps, s.schedule, s.ramp_steps)

    def train_discriminator(self, real: torch.Tensor, fake: torch.Tensor, context: torch.Tensor,
                            labels: torch.Tensor, counts: torch.Tensor | None = None,
                            all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
        """``disc_steps`` Adam steps on BCE(REAL, FAKE) (+ R1) for this batch; ``real``/``fake``
        are distribution embeddings (P, K, d), ``context`` h_t (P, d), all detached here.
        ``counts`` are global label counts and ``all_reduce`` sums a gradient over processes.
        Returns per-head metrics (K,) of the last step: loss and accuracy."""
        disc, s = self.discriminator, self.section
        dtype = disc.head_embedding.weight.dtype
        real, fake, context = (t.detach().to(dtype) for t in (real, fake, context))
        if s.grad_penalty:
            real.requires_grad_(True)
        counts = label_counts(labels) if counts is None else counts
        for _ in range(s.disc_steps):
            real_scores, fake_scores = disc(real, context), disc(fake, context)
            loss, per_head = discriminator_bce(real_scores, fake_scores, labels, self.head_weights, counts,
                                               s.label_smoothing)
            if s.grad_penalty:
                penalty, _ = r1_penalty(real_scores, real, labels, self.head_weights, counts)
                loss = loss + s.grad_penalty * penalty
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if all_reduce is not None:
                for p in disc.parameters():
                    if p.grad is not None:
                        p.grad = all_reduce(p.grad)
            self.optimizer.step()
        with torch.no_grad():
            valid = labels != IGNORE
            right = ((real_scores > 0).to(dtype) + (fake_scores < 0).to(dtype)) / 2
            accuracy = torch.where(valid, right, torch.zeros_like(right)).sum(0) / counts.to(right).clamp(min=1)
        return {"d_loss": per_head.detach(), "d_acc": accuracy}

    def generator_loss(self, fake: torch.Tensor, context: torch.Tensor, labels: torch.Tensor,
                       weights: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-saturating −log D(FAKE) for the heads (gradient flows into ``fake`` only: the
        discriminator's parameters are frozen while its graph is built)."""
        disc = self.discriminator
        disc.requires_grad_(False)
        try:
            scores = disc(fake, context.detach())
        finally:
            disc.requires_grad_(True)
        return generator_adversarial(scores, labels, weights, counts)
