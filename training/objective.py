"""What the heads minimize: labels per head, the supervised loss (cross-entropy / teacher KL,
weighted per head), KOALA's adversarial term and the LR schedule.
"""
from __future__ import annotations

import contextlib
import math

import torch

from ..heads import DraftHeads
from .adversarial import Adversary, expected_embedding
from .features import Features
from .losses import (distill_loss, generator_objective, head_targets, label_counts, mask_labels,
                     teacher_logits)
from .recipe_sections import Recipe
from .head_forward import head_logits


def head_labels(table: Features, rows: torch.Tensor, heads: DraftHeads, source: str) -> torch.Tensor:
    """Draft-vocabulary labels (P, K): column k+1 of the text or of the base's own predictions,
    IGNORE where the path runs past the end of the text or the token cannot be drafted."""
    k = heads.num_heads
    ids = (table.teacher if source == "teacher" else table.targets)[rows, 1: k + 1]
    labels = head_targets(ids, heads.vocab_ids.cpu(), heads.config.vocab_size, k)
    return mask_labels(labels, table.targets[rows, 1: k + 1] >= 0)


def compute_loss(model, heads: DraftHeads, table: Features, rows: torch.Tensor, next_rows: torch.Tensor,
                 recipe: Recipe, weights: torch.Tensor, dtype: torch.dtype, accelerator,
                 adversary: Adversary | None = None, step: int = 0) -> tuple[torch.Tensor, dict]:
    """The recipe's objective on one micro-batch, normalized by the global label count. With an
    ``adversary`` (KOALA), its discriminator first takes its steps on this batch (REAL = the
    base's distribution, FAKE = the heads', detached), then the heads' loss adds λ(step)·(−log D)."""
    device = accelerator.device
    logits, rows = head_logits(model, table, rows, heads.num_heads, device, dtype, recipe.loss.noise_alpha)
    labels = head_labels(table, rows, heads, recipe.loss.labels).to(device)
    counts = accelerator.reduce(label_counts(labels), reduction="sum")
    scale = accelerator.num_processes  # DDP averages gradients over processes
    loss = torch.zeros((), dtype=torch.promote_types(dtype, torch.float32), device=device)
    metrics = {}
    target = None
    if recipe.loss.kl_weight or adversary is not None:
        with torch.no_grad():
            nxt = table.hidden[next_rows.clamp(min=0)].to(device, dtype)  # (P, K, d); masked rows unused
            with accelerator.autocast():
                target = teacher_logits(nxt, heads.draft_weight())
    if recipe.loss.ce_weight or recipe.loss.kl_weight:
        supervised, per_head = distill_loss(logits, labels, weights, counts, recipe.loss.ce_weight,
                                            recipe.loss.kl_weight, target, recipe.loss.temperature,
                                            recipe.loss.kl_topk)
        loss = loss + supervised * scale
        metrics.update({name: per_head[name].detach() * scale
                        for name, weight in (("ce", recipe.loss.ce_weight), ("kl", recipe.loss.kl_weight)) if weight})
    if adversary is not None:
        loss = adversarial_term(adversary, heads, table, rows, logits, target, labels, counts, weights, step, loss,
                                metrics, accelerator)
    return loss, metrics


def adversarial_term(adversary: Adversary, heads: DraftHeads, table: Features, rows: torch.Tensor,
                     logits: torch.Tensor, target: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor,
                     weights: torch.Tensor, step: int, loss: torch.Tensor, metrics: dict, accelerator) -> torch.Tensor:
    """Train the discriminator on this batch, then return ``loss`` + λ·adversarial (``loss``
    itself when λ = 0: the heads' graph is then exactly the supervised one)."""
    device, scale = accelerator.device, accelerator.num_processes
    draft = heads.draft_weight()
    context = table.hidden[rows.clamp(min=0)].to(device, draft.dtype)  # h_t as cached (no input noise)
    with accelerator.autocast():
        with torch.no_grad():
            real = expected_embedding(target, draft)
        fake = expected_embedding(logits, draft)
    d_metrics = adversary.train_discriminator(real, fake.detach(), context, labels, counts,
                                              lambda grad: accelerator.reduce(grad, "sum"))
    metrics.update({name: value * scale for name, value in d_metrics.items()})  # global means, like ce/kl
    lam = adversary.weight(step)
    with contextlib.nullcontext() if lam else torch.no_grad():  # λ = 0: measured, not trained on
        adv, per_head = adversary.generator_loss(fake, context, labels, weights, counts)
    metrics["adv"] = per_head.detach() * scale
    metrics["adv_weight"] = torch.tensor(float(lam), dtype=torch.float64, device=device)
    return generator_objective(loss, adv * scale, lam)


def lr_lambda(total: int, warmup_ratio: float, min_ratio: float):
    """Linear warmup, then cosine from 1 to ``min_ratio``."""
    warmup = max(1, int(total * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
