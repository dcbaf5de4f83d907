"""Training objectives for draft heads, as small pure functions (tensors in, tensors out).

Conventions: ``logits`` (P, K, V) = the K heads' draft logits at P positions; ``labels``
(P, K) = draft-vocabulary indices, :data:`IGNORE` where a head has nothing to learn (prompt
token, past the end of the text, token outside the draft vocabulary). Every loss returns
``(scalar loss, per-head value (K,))`` so the trainer can log heads separately.

``counts`` (K,) is the number of valid labels each head's mean divides by. By default it is
this batch's; the trainer passes the count summed over all processes, so that data-parallel
training (which averages gradients over processes) optimizes exactly the same objective as
one process with the whole global batch, whatever the IGNORE pattern of each shard.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE = -100


def head_weights(num_heads: int, decay: float) -> torch.Tensor:
    """λ_k = decay^k (Medusa-1: 0.8^k): later heads are less accurate and matter less, since a
    tree path only reaches them after every earlier head was right. decay = 1 → plain sum
    (Hydra)."""
    return decay ** torch.arange(num_heads, dtype=torch.float32)


def draft_vocab(token_ids: torch.Tensor, size: int, vocab_size: int, then_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
    """The ``size`` most frequent ids in ``token_ids`` (negative = none), sorted; 0 = the whole
    vocabulary. Heads then draft over a row subset of the frozen LM head (cheaper; a token
    outside it simply cannot be drafted, verification stays exact). Ties — above all the ids
    the labels never use, once ``size`` exceeds the labels' distinct ids — go to the most
    frequent in ``then_ids`` (e.g. the prompts' tokens, which answers copy), then the lowest id."""
    if not size:
        return torch.arange(vocab_size)
    counts = torch.bincount(token_ids[token_ids >= 0].flatten(), minlength=vocab_size).double()
    if then_ids is not None:
        seconds = torch.bincount(then_ids[then_ids >= 0].flatten(), minlength=vocab_size).double()
        counts = counts * (float(seconds.max()) + 1.0) + seconds  # exact in float64 at these counts
    order = torch.sort(-counts, stable=True).indices  # stable: equal keys keep the lower id first
    return order[:size].sort().values


def head_targets(targets: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int, num_heads: int) -> torch.Tensor:
    """Base token ids (P, ≥K), column k = head k's label → draft-vocabulary indices (P, K);
    IGNORE where undraftable or past the end (negative id)."""
    lookup = torch.full((vocab_size + 1,), IGNORE, dtype=torch.long, device=targets.device)
    lookup[vocab_ids.to(targets.device)] = torch.arange(vocab_ids.numel(), device=targets.device)
    ids = targets[:, :num_heads].clone().long()
    ids[ids < 0] = vocab_size
    return lookup[ids]


def mask_labels(labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """IGNORE every label where ``keep`` is False (prompt tokens, padding, a path that runs
    past the end of the text): those positions then add nothing to any loss or count."""
    return labels.masked_fill(~keep.bool(), IGNORE)


def label_counts(labels: torch.Tensor) -> torch.Tensor:
    """Valid labels per head (K,), as float (the denominator of each head's mean)."""
    return (labels != IGNORE).sum(0).to(torch.float32)


def _loss_dtype(t: torch.Tensor) -> torch.dtype:
    """Losses are computed in at least float32 (bf16 autocast logits are upcast), float64 kept."""
    return torch.promote_types(t.dtype, torch.float32)


def _weighted(per_head: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (per_head * weights.to(per_head)).sum(), per_head


def head_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                       counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_k w_k · CE_k with CE_k = (sum of token CE of head k) / counts[k]: cross-entropy on the
    base's own tokens (Medusa-1). A head with no valid label contributes 0."""
    loss, per_head = distill_loss(logits, labels, weights, counts, ce_weight=1.0, kl_weight=0.0)
    return loss, per_head["ce"]


def teacher_kl(logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               counts: torch.Tensor | None = None, temperature: float = 1.0,
               topk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_k w_k · mean KL(p_teacher ‖ p_head) over positions whose label is valid (Hydra++).

    ``teacher_logits`` (P, K, V) are the frozen base's own next-token logits for the token each
    head drafts, i.e. lm_head(h_{t+k+1}) for head k at position t (see :func:`shifted_rows`);
    soft targets carry the base's whole ranking, not just its argmax, which is what tree
    drafting with top-k children needs. ``temperature`` softens both sides (scaled by T² so
    gradients keep their size, as in Hinton et al.). ``topk`` > 0: the teacher's top-``topk``
    tokens only (:func:`distill_loss`)."""
    loss, per_head = distill_loss(logits, labels, weights, counts, ce_weight=0.0, kl_weight=1.0,
                                  teacher_logits=teacher_logits, temperature=temperature, kl_topk=topk)
    return loss, per_head["kl"]


def distill_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor | None,
                 ce_weight: float, kl_weight: float, teacher_logits: torch.Tensor | None = None,
                 temperature: float = 1.0, kl_topk: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ce_weight · Σ_k w_k CE_k + kl_weight · Σ_k w_k KL_k (the two losses above) and each one's
    per-head means ({"ce": (K,), "kl": (K,)}, for the heads' logs).

    ``kl_topk`` = N > 0 (HASS's top-K distillation, arXiv 2408.15766): KL_k is taken over the
    teacher's N most probable draft-vocabulary tokens only, its probabilities renormalized over
    them (p_N, zero elsewhere), the heads' log-probabilities over the whole draft vocabulary:
    Σ_{i ∈ top-N} p_N(i) (log p_N(i) − log q(i)); its gradient is the same closed form with p_N
    for p_teacher. N = the draft vocabulary's size is the full KL; 0 (the default) is the full KL.

    One pass over row blocks of the (P, K, V) logits, in float32 (float64 kept), that also writes
    the gradient, a (P, K, V) tensor of the logits' dtype, in closed form:
    a_k (softmax(s) − onehot(y)) + b_k · T (softmax(s/T) − p_teacher), a_k and b_k each weight
    over its head's count. Autograd through the same formulas would keep about ten (P, K, V)
    float32 intermediates: at Hydra++'s 1,200 positions × 4 heads × 8,192 tokens a step, those
    passes cost more than the heads themselves."""
    if kl_weight and teacher_logits is None:
        raise ValueError("distill_loss: kl_weight > 0 needs teacher_logits")
    if not 0 <= kl_topk <= logits.shape[-1]:
        raise ValueError(f"distill_loss: kl_topk={kl_topk} must be in 0..{logits.shape[-1]} (the draft vocabulary)")
    counts = label_counts(labels) if counts is None else counts
    dtype = _loss_dtype(logits)
    per_label = 1.0 / counts.to(logits.device, dtype).clamp(min=1)  # (K,) each head's mean
    loss, ce, kl = _DistillLoss.apply(logits, labels, weights.to(logits.device, dtype), per_label, float(ce_weight),
                                      float(kl_weight), teacher_logits if kl_weight else None, float(temperature),
                                      int(kl_topk))
    return loss, {"ce": ce, "kl": kl}


#: rows of (P, K, V) logits per block of :func:`distill_loss` (a block's float32 temporaries stay
#: a few MB at K = 4, V = 8,192)
LOSS_BLOCK_ROWS = 32


class _DistillLoss(torch.autograd.Function):
    """:func:`distill_loss`: the loss and its per-head means forward, the saved closed-form
    gradient times the incoming scalar backward (``logits`` is the only input that gets one)."""

    @staticmethod
    def forward(ctx, logits, labels, weights, per_label, ce_weight, kl_weight, teacher, temperature, topk=0):
        dtype = _loss_dtype(logits)
        grad = torch.empty_like(logits) if logits.requires_grad else None
        ce_sum = torch.zeros_like(weights)  # (K,) token sums per head
        kl_sum = torch.zeros_like(weights)
        a = ce_weight * weights * per_label  # (K,) d loss / d CE of one label of head k
        b = kl_weight * temperature * weights * per_label  # (K,) the same for KL, over T² · 1/T
        for start in range(0, logits.shape[0], LOSS_BLOCK_ROWS):
            rows = slice(start, start + LOSS_BLOCK_ROWS)
            s = logits[rows].to(dtype)  # (p, K, V)
            keep = (labels[rows] != IGNORE).to(dtype)  # (p, K)
            g = None  # (p, K, V) this block's gradient, once a term adds to it
            log_p = torch.log_softmax(s, dim=-1)
            if ce_weight:
                y = labels[rows].clamp(min=0).unsqueeze(-1)  # (p, K, 1)
                ce_sum += (-log_p.gather(-1, y).squeeze(-1) * keep).sum(0)
                if grad is not None:
                    coef = (a * keep).unsqueeze(-1)  # (p, K, 1)
                    g = log_p.exp().mul_(coef).scatter_add_(-1, y, -coef)
            if kl_weight:
                log_q = log_p if temperature == 1.0 else torch.log_softmax(s / temperature, dim=-1)
                if topk:  # p_t is zero outside the teacher's top-K, where its terms are 0
                    log_t = top_k_log_softmax(teacher[rows].to(dtype) / temperature, topk)
                    p_t = log_t.exp()
                    kl_sum += ((torch.where(p_t > 0, p_t * (log_t - log_q), 0.0)).sum(-1) * keep).sum(0) \
                        * temperature ** 2
                else:
                    log_t = torch.log_softmax(teacher[rows].to(dtype) / temperature, dim=-1)
                    p_t = log_t.exp()
                    kl_sum += ((p_t * (log_t - log_q)).sum(-1) * keep).sum(0) * temperature ** 2
                if grad is not None:
                    term = log_q.exp().sub_(p_t).mul_((b * keep).unsqueeze(-1))
                    g = term if g is None else g.add_(term)
            if grad is not None:
                grad[rows] = g if g is not None else 0.0
        ce, kl = ce_sum * per_label, kl_sum * per_label  # (K,) each head's mean
        loss = ce_weight * (ce * weights).sum() + kl_weight * (kl * weights).sum()
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(ce, kl)
        return loss, ce, kl

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_kl):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None, None, None, None


def top_k_log_softmax(scores: torch.Tensor, k: int) -> torch.Tensor:
    """log softmax of ``scores`` (..., V) over each row's ``k`` largest entries only, −inf
    elsewhere: the log of the distribution renormalized over its top-k (k = V: log_softmax)."""
    top = scores.topk(k, dim=-1)
    return torch.log_softmax(torch.full_like(scores, float("-inf")).scatter_(-1, top.indices, top.values), dim=-1)


def teacher_logits(next_hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """The base's own logits from its cached last hidden states: (P, K, d) hidden at the
    positions t+k+1 → (P, K, V') through the frozen LM head (rows of the draft vocabulary:
    the teacher is renormalized over the tokens the heads can draft)."""
    return next_hidden @ lm_head_weight.to(next_hidden.dtype).t()


def input_noise(hidden: torch.Tensor, alpha: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """NEFTune-style augmentation: add U(-1, 1) · alpha / sqrt(d) per element (Hydra's
    ``noise_alpha``; the sequence-length factor of NEFTune is 1 because positions are drawn
    independently). alpha = 0 returns ``hidden`` unchanged. Draws from ``generator`` or the
    global torch RNG (whose state a resumed run restores)."""
    if alpha <= 0:
        return hidden
    noise = torch.rand(hidden.shape, generator=generator, dtype=hidden.dtype, device=hidden.device) * 2 - 1
    return hidden + noise * (alpha / math.sqrt(hidden.shape[-1]))


def label_ranks(logits: torch.Tensor, labels: torch.Tensor, cap: int) -> torch.Tensor:
    """Rank of each label in its head's distribution (P, K), capped at ``cap`` (= not in the
    top-``cap``, or IGNORE). Ranks feed top-k accuracy and the tree search."""
    top = logits.topk(min(cap, logits.shape[-1]), dim=-1).indices
    hit = top == labels[..., None]
    return torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(labels, cap))


def topk_accuracy(ranks: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> dict[str, list[float]]:
    """Per-head share of positions whose label is in the top-k: {"top1": [...], "top5": [...]}."""
    return {f"top{k}": [round(float((ranks[:, h] < k).float().mean()), 4) for h in range(ranks.shape[1])] for k in ks}


# -- adversarial (KOALA) ------------------------------------------------------------------------------
# ``real``/``fake`` (P, K) are discriminator logits (scores before the sigmoid) for the base's
# and the heads' distribution of each head's token; positions whose label is IGNORE add nothing.
def _masked_per_head(token_loss: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
    valid = labels != IGNORE
    token_loss = torch.where(valid, token_loss, torch.zeros_like(token_loss))
    counts = label_counts(labels) if counts is None else counts
    return token_loss.sum(0) / counts.to(token_loss).clamp(min=1)


def discriminator_bce(real: torch.Tensor, fake: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                      counts: torch.Tensor | None = None, smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The discriminator's loss Σ_k w_k · mean[BCE(D(real), 1 − s) + BCE(D(fake), 0)]: REAL is the
    base's distribution, FAKE the heads' (pass it detached: this loss trains the discriminator
    only). ``smoothing`` s is one-sided label smoothing (Salimans et al. 2016): 2·log 2 per head
    at chance, → 0 for a perfect discriminator (s = 0)."""
    dtype = _loss_dtype(real)
    real, fake = real.to(dtype), fake.to(dtype)
    token = (F.binary_cross_entropy_with_logits(real, torch.full_like(real, 1.0 - smoothing), reduction="none")
             + F.binary_cross_entropy_with_logits(fake, torch.zeros_like(fake), reduction="none"))
    return _weighted(_masked_per_head(token, labels, counts), weights)


def generator_adversarial(fake: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                          counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The heads' non-saturating adversarial loss Σ_k w_k · mean(−log D(fake)) = mean softplus(−fake)
    (Goodfellow et al. 2014): strong gradients exactly when the discriminator wins."""
    fake = fake.to(_loss_dtype(fake))
    return _weighted(_masked_per_head(F.softplus(-fake), labels, counts), weights)


def generator_objective(supervised: torch.Tensor, adversarial: torch.Tensor | None, weight: float) -> torch.Tensor:
    """supervised + λ · adversarial; λ = 0 (or no adversarial term) returns ``supervised`` itself,
    so a run with λ = 0 optimizes the very same graph as a plain supervised run."""
    if not weight or adversarial is None:
        return supervised
    return supervised + weight * adversarial


def r1_penalty(real: torch.Tensor, real_inputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """R1 gradient penalty (Mescheder et al. 2018) Σ_k w_k · mean ½‖∂D(real)/∂x‖² over the REAL
    inputs x (P, K, …) that produced ``real`` (P, K) (x must require grad; the graph is kept so the
    penalty trains the discriminator). It keeps the discriminator smooth around the data, the usual
    stabilizer of non-saturating GANs."""
    valid = labels != IGNORE
    (grad,) = torch.autograd.grad(real.masked_fill(~valid, 0).sum(), real_inputs, create_graph=True)
    token = 0.5 * grad.to(_loss_dtype(grad)).pow(2).flatten(2).sum(-1)
    return _weighted(_masked_per_head(token, labels, counts), weights)
