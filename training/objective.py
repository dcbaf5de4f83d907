"""What the heads minimize: labels per head, the supervised loss (cross-entropy / teacher KL,
weighted per head), KOALA's adversarial term, the LR schedule, and fresh heads for a recipe.
"""
from __future__ import annotations

import contextlib
import math

import torch

from ..heads import DraftHeads, HeadConfig, build_heads
from ..heads.errors import one_line
from .adversarial import Adversary, expected_embedding, koala_info
from .features import Features
from .frozen import FrozenParts
from .losses import (distill_loss, draft_vocab, generator_objective, head_targets, label_counts, mask_labels,
                     teacher_logits)
from .recipe_sections import Recipe, RecipeError
from .batches import head_logits


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
                                            recipe.loss.kl_weight, target, recipe.loss.temperature)
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


def new_heads(recipe: Recipe, parts: FrozenParts, label_ids: torch.Tensor, dtype: torch.dtype,
              prompt_ids: torch.Tensor | None = None) -> DraftHeads:
    """Fresh heads of the recipe's family, bound to the frozen LM head and embeddings; the draft
    vocabulary is the most frequent of the training labels (ties: of ``prompt_ids``)."""
    vocab_size, d = parts.lm_head.shape
    extra = dict(recipe.heads.extra)
    if recipe.adversarial.enabled:  # a KOALA checkpoint says so (reports label it KOALA-<family>)
        extra["koala"] = koala_info(recipe.heads.family, recipe.heads.num_layers, recipe.adversarial)
    config = HeadConfig(family=recipe.heads.family, num_heads=recipe.heads.num_heads,
                        num_layers=recipe.heads.num_layers, hidden_size=d, vocab_size=vocab_size,
                        draft_vocab_size=recipe.heads.draft_vocab_size, extra=extra)
    heads = build_heads(config).to(dtype)
    if recipe.heads.init_from:
        try:
            heads.load_state_dict(start_weights(recipe.heads.init_from, config, parts.fingerprint))
        except RuntimeError as err:  # shapes set by the family's options (heads.extra)
            raise RecipeError(f"heads.init_from {recipe.heads.init_from}: its weights do not fit the recipe's heads "
                              f"({one_line(err)[:200]}); set heads.extra as the checkpoint's config.json has it.") from None
    else:
        heads.vocab_ids.copy_(draft_vocab(label_ids, recipe.heads.draft_vocab_size, vocab_size, prompt_ids))
    return heads.bind(parts.lm_head, parts.embed)


#: what a starting checkpoint must share with the recipe's heads (the weights' shapes follow from them)
SAME_SHAPE = ("family", "num_heads", "num_layers", "hidden_size", "vocab_size", "draft_vocab_size")


def start_weights(path: str, config: HeadConfig, fingerprint: dict) -> dict[str, torch.Tensor]:
    """The weights (draft vocabulary included) of the checkpoint ``heads.init_from`` names, for
    heads of ``config``: one made for another base, or of another family or shape, is one line."""
    from ..heads.checkpoint.io import load_heads

    start = load_heads(path, expected_fingerprint=fingerprint)
    differing = [f"{key} {getattr(start.config, key)!r} (recipe: {getattr(config, key)!r})" for key in SAME_SHAPE
                 if getattr(start.config, key) != getattr(config, key)]
    if differing:
        raise RecipeError(f"heads.init_from {path} holds other heads than the recipe trains: " + ", ".join(differing)
                          + "; set the recipe's heads.* to match, or drop heads.init_from.")
    return {name: tensor.detach().clone() for name, tensor in start.state_dict().items()}
