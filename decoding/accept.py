"""Acceptance rules: which drafted tree path each sequence keeps.

Greedy: a child is accepted when its token equals the base's argmax at its parent slot and its
parent was accepted; each row keeps its deepest accepted node. The token after it (the
*bonus*) is the base's argmax there, so every emitted token is the base's own greedy choice.

Sampling (``do_sample=True``): :func:`lossless_accept` walks the tree drawing each position's
token from the base's processed distribution with that position's own uniform and following the
drafted child that equals it (lossless; the proof is below); :func:`typical_accept` is Medusa-2's
lossy threshold rule. :class:`Acceptor` is what the loop calls: the rule for the call's mode
(greedy, lossless, typical), with its state explicit (the rows' tokens so far in, accepted path,
bonus and scores out).

The drafting scheme and its lossless rule
-----------------------------------------
The heads do not *sample* drafts: a node's children are the heads' top-k candidates (Medusa:
per depth, Cartesian; Hydra: per path). Given the context, the children x_1..x_m of a node are
fixed tokens, chosen independently of the acceptance randomness (point masses q_i = δ(x_i)).
The rule couples the drafts with the base's own draw:

    at a node u whose next token is row r's t-th new token:
        s ← the inverse-CDF sample of p_u with U[r, t]       (:func:`sample_from`)
        if a child of u carries s:  emit s, move to that child (t ← t + 1) and repeat
        else (no such child, or u is a leaf):  emit s — the bonus token — and stop

Lossless: the token emitted at position t is s, an inverse-CDF draw of p(· | the row's tokens
so far) with U[r, t]; U[r, t] decides position t and nothing else, and the drafts and the prefix
depend only on earlier positions' uniforms, so conditioned on everything before it, U[r, t] is
still uniform and the token is distributed exactly as p. By the chain rule the emitted sequence
has the base's sampling distribution, and EOS / max_new_tokens / stopping criteria cut it exactly
where the base would stop, since they depend on the prefix only. A child outside p's support
(cut by top-k/top-p) is never drawn, so never accepted; a duplicated child changes nothing. The
node accepts with probability Σ_i p(x_i), the mass its children cover: the most any rule over
point-mass drafts accepts (SpecInfer's residual rule reaches the same).

Trees that mix head drafts and lookup drafts (:class:`~.drafters.MergedDrafter`), or rows with
different trees, change nothing: the rule never asks who proposed a child. The drafts (and the
policy, the hit-rate calibration, the widths) may depend on earlier steps' and earlier calls'
outcomes; they decide only how many tokens a step emits, never which: the tokens are a function
of the uniforms and the base's distributions alone.

Typical acceptance (``acceptance="typical"``) is Medusa-2's threshold rule and is **not
lossless**: see :func:`draftheads.decoding.accept.typical_accept`.

Randomness
----------
One ``torch.Generator`` per ``generate`` call: the caller's, or one seeded from the global torch
RNG (so ``transformers.set_seed`` / ``torch.manual_seed`` make runs reproducible and
consecutive calls differ). Row r's t-th new token is decided by one uniform U[r, t]
(:class:`PositionUniforms`), drawn from it in blocks of positions for every row, in order: the
same seed and call give the same tokens, whatever the trees, the live rows, timing or the state
earlier calls left in the policy and the drafters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .step_trees import StepTrees, children_table
from .processors import NodeProcessors, node_prefixes
from .sequences import Sequences


@dataclass
class Acceptance:
    best: torch.Tensor  # (B,) slot of the deepest accepted node per row
    accepted: torch.Tensor  # (B,) number of accepted draft tokens (depth of ``best``)
    path: torch.Tensor  # (B, D+1) slots root→best, padded with ``best``
    bonus: torch.Tensor  # (B,) the base's token after ``best``


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., V) → the argmax token (...,), the first maximal index on ties as
    ``torch.argmax`` (and so transformers' greedy choice). ``max(-1).indices``, not ``argmax``:
    on CPU argmax over bfloat16 is several times slower (docs/measurements.md, "Figures behind the code's rules")."""
    return logits.max(-1).indices


def _per_row(batch: int, nodes: int, parent: torch.Tensor, depth: torch.Tensor, path_slots: torch.Tensor):
    """A shared tree's (N,) / (N, D+1) buffers as (B, N) / (B, N, D+1) views; per-row ones pass."""
    return (parent.expand(batch, nodes), depth.expand(batch, nodes),
            path_slots.expand(batch, *path_slots.shape[-2:]))


def greedy_accept(tokens: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor, path_slots: torch.Tensor,
                  predicted: torch.Tensor, valid: torch.Tensor | None = None) -> Acceptance:
    """tokens, predicted (B, N): drafted tokens and the base's argmax per slot; parent, depth
    (N,) or (B, N); path_slots (N, D+1) or (B, N, D+1); valid (B, N) masks the padding slots of
    per-row trees (:class:`~.step_trees.StepTrees`)."""
    batch, nodes = tokens.shape
    parent, depth, path_slots = _per_row(batch, nodes, parent, depth, path_slots)
    parent_safe = parent.clamp(min=0)
    match = (tokens == predicted.gather(1, parent_safe)) & (parent >= 0)
    if valid is not None:
        match &= valid
    accepted = torch.zeros_like(match)
    accepted[:, 0] = True  # the root
    for level in range(1, int(depth.max()) + 1):
        at_level = depth == level
        accepted = accepted | (at_level & match & accepted.gather(1, parent_safe))
    score = torch.where(accepted, depth, torch.full_like(depth, -1))
    best = score.argmax(1)
    rows = torch.arange(batch, device=tokens.device)
    return Acceptance(best, depth[rows, best], path_slots[rows, best], predicted[rows, best])


# -- sampling: lossless rejection walk and the lossy typical rule -----------------------------
# The derivation and the proof are in this module's docstring.

def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample per row of (B, V) non-negative weights (need not sum to 1) with
    (B,) uniforms in [0, 1). A token of zero weight is never returned, even when rounding
    pushes the threshold to the end of the CDF."""
    cdf = probs.double().cumsum(-1)
    threshold = uniform.double().to(cdf.device) * cdf[:, -1]
    index = torch.searchsorted(cdf, threshold[:, None], right=True).squeeze(1)
    vocab = torch.arange(probs.shape[-1], device=probs.device)
    last_positive = torch.where(probs > 0, vocab, torch.zeros_like(vocab)).amax(-1)
    return torch.minimum(index, last_positive)


def lossless_accept(tokens: torch.Tensor, probs: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor,
                    path_slots: torch.Tensor, uniforms: torch.Tensor,
                    children: torch.Tensor | None = None) -> Acceptance:
    """The lossless walk over a tree of deterministic (point-mass) drafts (the rule and its
    proof: this module's docstring).

    tokens (B, N) tree tokens (column 0 = the root, already emitted); probs (B, N, V) the
    base's *processed* next-token distribution at every slot; parent, depth (N,) or (B, N);
    path_slots (N, D+1) or (B, N, D+1); uniforms (B, D+1) in [0, 1): ``uniforms[b, d]`` decides
    row b's token after a node at depth d (:class:`PositionUniforms`); children (B, N, W) each
    slot's children (default: from ``parent`` by :func:`~.step_trees.children_table`; padding
    slots are nobody's child).

    Per row, from the root: draw the node's token from p at its slot with its depth's uniform;
    where a child carries it, that child becomes the node, else the drawn token is the bonus and
    the walk stops. Every row is walked at once (vectorized over B)."""
    batch, nodes = tokens.shape
    device = tokens.device
    if children is None:
        children = children_table(parent.to(device)).expand(batch, nodes, -1)
    parent, depth, path_slots = _per_row(batch, nodes, parent.to(device), depth.to(device), path_slots.to(device))
    uniforms = uniforms.to(device)
    rows = torch.arange(batch, device=device)
    node = torch.zeros(batch, dtype=torch.long, device=device)
    bonus = torch.zeros(batch, dtype=torch.long, device=device)
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    for level in range(path_slots.shape[-1]):
        drawn = sample_from(probs[rows, node], uniforms[:, level])  # (B,)
        kids = children[rows, node]  # (B, W)
        carries = (tokens.gather(1, kids.clamp(min=0)) == drawn[:, None]) & (kids >= 0)  # (B, W)
        stop = walking & ~carries.any(1)
        bonus = torch.where(stop, drawn, bonus)
        walking = walking & ~stop
        if not bool(walking.any()):
            break
        taken = kids.gather(1, carries.long().argmax(1, keepdim=True)).squeeze(1)  # the first child carrying it
        node = torch.where(walking, taken, node)
    return Acceptance(node, depth[rows, node], path_slots[rows, node], bonus)


def typical_accept(tokens: torch.Tensor, probs: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor,
                   path_slots: torch.Tensor, bonus_uniform: torch.Tensor, epsilon: float = 0.09,
                   delta: float = 0.3, valid: torch.Tensor | None = None) -> Acceptance:
    """Medusa-2's typical acceptance (LOSSY): a child x of node u is accepted when
    p_u(x) > min(ε, δ·exp(−H(p_u))) and u is accepted (H with log(p + 1e-5), as Medusa).
    Each row keeps its deepest accepted node, ties broken by the highest Σ log p along the
    path; the bonus token is then *sampled* from p at that node (Medusa's ``fast`` mode
    takes the argmax instead, which would make the whole output deterministic).

    The emitted text is no longer distributed as the base's: low-probability-but-typical
    tokens are accepted with certainty. It trades fidelity for acceptance length."""
    batch, nodes = tokens.shape
    device = tokens.device
    parent, depth, path_slots = _per_row(batch, nodes, parent.to(device), depth.to(device), path_slots.to(device))
    parent_safe = parent.clamp(min=0)
    entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)  # (B, N)
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)
    at_parent = probs.gather(1, parent_safe[:, :, None].expand(-1, -1, probs.shape[-1]))  # (B, N, V)
    candidate = at_parent.gather(-1, tokens[:, :, None]).squeeze(-1)  # p at the parent of each slot's token
    ok = (candidate > threshold.gather(1, parent_safe)) & (parent >= 0)
    if valid is not None:
        ok &= valid
    accepted = torch.zeros_like(ok)
    accepted[:, 0] = True
    loglik = torch.zeros(batch, nodes, dtype=probs.dtype, device=device)
    for level in range(1, int(depth.max()) + 1):
        at = depth == level
        accepted = accepted | (at & ok & accepted.gather(1, parent_safe))
        loglik = torch.where(at, loglik.gather(1, parent_safe) + torch.log(candidate.clamp_min(1e-30)), loglik)
    deepest = torch.where(accepted, depth, torch.full_like(depth, -1)).amax(-1)
    score = torch.where(accepted & (depth == deepest[:, None]), loglik, torch.full_like(loglik, -torch.inf))
    best = score.argmax(-1)
    rows = torch.arange(batch, device=device)
    return Acceptance(best, depth[rows, best], path_slots[rows, best], sample_from(probs[rows, best], bonus_uniform))


ACCEPTANCE_MODES = ("lossless", "typical")


@dataclass(frozen=True)
class Typical:
    """Medusa-2 typical acceptance (lossy): accept x if p(x) > min(epsilon, delta·exp(−H(p)))."""

    epsilon: float = 0.09
    delta: float = 0.3


def resolve_acceptance(config, acceptance: str | Typical | None) -> str | Typical:
    """``None`` → "greedy" or "lossless" by ``do_sample``; "typical" → ``Typical()``."""
    if acceptance is None:
        return "lossless" if config.do_sample else "greedy"
    if acceptance == "typical":
        acceptance = Typical()
    if not isinstance(acceptance, Typical) and acceptance not in ACCEPTANCE_MODES:
        raise ValueError(f"generate(): acceptance={acceptance!r} is unknown; use 'lossless' (default with "
                         "do_sample=True), 'typical' (lossy, faster) or Typical(epsilon, delta).")
    if not config.do_sample:
        raise ValueError(f"generate(): acceptance={acceptance!r} is a sampling rule; pass do_sample=True "
                         "(greedy decoding always accepts by exact match).")
    return acceptance


def default_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from the global torch RNG: ``set_seed(s)`` makes a call reproducible,
    and (as with transformers) consecutive calls without reseeding draw different samples."""
    seed = int(torch.randint(0, 2**62, (1,)))
    return torch.Generator(device=device).manual_seed(seed)


#: positions drawn at once for every row of a call (:class:`PositionUniforms`)
UNIFORM_BLOCK = 64


class PositionUniforms:
    """U[r, t] in [0, 1): the uniform that decides row r's t-th new token. Drawn from the call's
    generator in blocks of :data:`UNIFORM_BLOCK` positions for all ``batch`` rows, block after
    block, whenever a position is first asked for: U depends on the seed, the row and the
    position alone — never on which trees a step verified, which rows are still live, timing, or
    what earlier calls left in the policy and the drafters."""

    def __init__(self, generator: torch.Generator, batch: int):
        self.generator, self.batch = generator, batch
        self.table = torch.empty(batch, 0, dtype=torch.float64, device=generator.device)  # (B, drawn positions)

    def at(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """rows (R,), positions (R, L) → U (R, L), on the generator's device."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        while self.table.shape[1] < needed:
            block = torch.rand(self.batch, UNIFORM_BLOCK, generator=self.generator, dtype=torch.float64,
                               device=self.generator.device)
            self.table = torch.cat([self.table, block], dim=1)
        device = self.table.device
        return self.table[rows.to(device)[:, None], positions.to(device)]


class Acceptor:
    """What ``generate`` asks at each step: the first token after the prompt, then which tree
    path each row keeps plus its bonus token. Holds the call's logits processors (applied at
    every node, :class:`~.processors.NodeProcessors`), the generator and the call's
    :class:`~.sequences.Sequences` (the processors' tokens so far), which it only reads."""

    def __init__(self, config, mode: str | Typical, vocab: int, sequences: Sequences,
                 generator: torch.Generator | None = None, processors=()):
        self.mode = mode
        self.vocab = vocab
        #: the processors transformers built for the call (none: the raw logits are the target)
        self.processors = processors if isinstance(processors, NodeProcessors) else NodeProcessors(processors)
        self.sequences = sequences
        self.generator = None
        if mode != "greedy":
            self.generator = generator if generator is not None else default_generator()
            self.uniforms = PositionUniforms(self.generator, sequences.batch)
        # transformers returns processed scores as ``scores`` and raw ones as ``logits``
        self.report_processed = bool(config.output_scores) and len(self.processors) > 0
        if self.report_processed and config.output_logits and config.return_dict_in_generate:
            raise ValueError("generate(): output_scores and output_logits together are not supported with sampling or "
                             "logits processors yet (they differ there); ask for one of them.")
        self.last_scores: torch.Tensor | None = None

    def _scores(self, logits: torch.Tensor, rows: torch.Tensor, trees: StepTrees | None = None) -> torch.Tensor:
        """logits (B, N, V) at the rows' tree slots (N = 1 and no trees: after the prompt) → the
        processed float32 scores, each slot's processors given that slot's own tokens so far."""
        batch, nodes, vocab = logits.shape
        scores = logits.to(dtype=torch.float32, copy=True).reshape(batch * nodes, vocab)
        entry_rows = rows.cpu().repeat_interleave(nodes)
        if not self.processors.reads_ids:
            ids, lengths = torch.full((batch * nodes, 1), vocab, dtype=torch.long, device=logits.device), None
        else:
            history, ends = self.sequences.history(rows.cpu(), vocab)
            if trees is None:
                ids, lengths = history, ends
            else:
                ids, lengths = node_prefixes(history, ends, trees.tokens, trees.path_slots, trees.depth, vocab)
        self.last_scores = self.processors(ids, scores, lengths, entry_rows).view(batch, nodes, vocab)
        return self.last_scores

    def reported(self, logits: torch.Tensor) -> torch.Tensor:
        """What ``output_scores``/``output_logits`` record for the last step: the processed
        scores when asked for ``scores`` under processors (as transformers), else the logits."""
        return self.last_scores.view(logits.shape).to(logits.dtype) if self.report_processed else logits

    def _uniforms(self, rows: torch.Tensor, levels: int) -> torch.Tensor:
        """rows (R,) → (R, levels): each row's uniforms for its next ``levels`` new tokens."""
        emitted = torch.tensor([self.sequences.count(r) for r in rows.tolist()], dtype=torch.long)
        return self.uniforms.at(rows.cpu(), emitted[:, None] + torch.arange(levels))

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (B, V) after the prompt → the first generated token per row."""
        rows = torch.arange(logits.shape[0])
        if self.mode == "greedy" and len(self.processors) == 0:
            return greedy_tokens(logits)
        scores = self._scores(logits[:, None], rows)[:, 0]
        if self.mode == "greedy":
            return greedy_tokens(scores)
        return sample_from(scores.softmax(-1), self._uniforms(rows, 1)[:, 0]).to(logits.device)

    def accept(self, trees: StepTrees, logits: torch.Tensor, rows: torch.Tensor) -> Acceptance:
        """The verified trees (one per row), logits (B, N, V) at their slots; rows (B,)
        the original batch rows still decoding (for their tokens so far)."""
        tokens, parent, depth, path_slots, valid = (trees.tokens, trees.parent, trees.depth, trees.path_slots, trees.valid)
        if self.mode == "greedy" and len(self.processors) == 0:
            return greedy_accept(tokens, parent, depth, path_slots, greedy_tokens(logits), valid)
        scores = self._scores(logits, rows, trees)
        if self.mode == "greedy":  # greedy with processors: argmax of the processed scores
            return greedy_accept(tokens, parent, depth, path_slots, greedy_tokens(scores), valid)
        probs = scores.softmax(-1)
        uniforms = self._uniforms(rows, path_slots.shape[-1])  # (B, D+1)
        if isinstance(self.mode, Typical):  # its bonus drawn with the step's first position's uniform (no other reads it)
            return typical_accept(tokens, probs, parent, depth, path_slots, uniforms[:, 0],
                                  self.mode.epsilon, self.mode.delta, valid)
        return lossless_accept(tokens, probs, parent, depth, path_slots, uniforms, trees.children())
