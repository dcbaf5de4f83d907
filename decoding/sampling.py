"""Sampling with draft trees: the base's processed distribution at every tree node, and the
acceptance rule that keeps the output distributed exactly as the base's own sampling.

The target distribution
-----------------------
``p(· | so far)`` is what transformers' ``generate(do_sample=True)`` samples from: the base's
logits (cast to float32, as transformers does) passed through the same processors in the same
order as ``GenerationMixin._get_logits_processor`` (transformers 5.x): repetition penalty first,
then temperature, top-k, top-p; then a softmax. At a tree node, "so far" is the prompt, every
token emitted before, the root and the node's own path, so the repetition penalty sees the
drafted tokens above the node exactly as it would see them had the base produced them.

The drafting scheme and its lossless rule
-----------------------------------------
The heads do not *sample* drafts: a node's children are the heads' top-k candidates (Medusa:
per depth, Cartesian; Hydra: per path). Given the context, the children x_1..x_m of a node are
fixed tokens, chosen independently of the acceptance randomness. So the draft "distribution"
of child i is a point mass q_i = δ(x_i), and the multi-draft residual rule of SpecInfer
(accept x_i with probability min(1, r(x_i)/q_i(x_i)); on rejection r ← norm(max(r − q_i, 0)))
becomes:

    r ← p at the node
    for each child x_i in order:  accept x_i with probability r(x_i) / Σr;
                                  on rejection set r(x_i) = 0 (the renormalization is implicit)
    if a child is accepted:       emit it, move to that child (r ← p at its slot) and repeat
    if all are rejected (or the node is a leaf):  emit a sample of r — the bonus token — and stop

Lossless: the token emitted at a node is distributed as p. Let S_i = 1 − Σ_{j<i} p(x_j)
(the children x_j distinct). By induction, trial i is reached with probability S_i, and there
r(x) / Σr = p(x) / S_i for every x not yet tried. Hence P(emit x_i) = S_i · p(x_i)/S_i = p(x_i),
and if all m trials fail (probability S_{m+1}) the residual sample gives any other x with
probability S_{m+1} · p(x)/S_{m+1} = p(x). A duplicated child has r(x) = 0 at its second trial
and is never accepted, which is again the residual rule, so distinctness is not even needed; a
child outside p's support (cut by top-k/top-p) is never accepted. Fresh uniforms per trial make
the trials independent of everything before. So at every node the next token is a draw from
p(· | so far); after an accepted child the walk continues with p at that child's slot, which the
tree-masked verification computed with exactly that context; after the bonus the next step
starts from it. By the chain rule the emitted sequence has the base's sampling distribution,
and EOS / max_new_tokens / stopping criteria cut it exactly where the base would stop, since
they depend on the prefix only. (The same argument covers any draft tokens, sampled or not, as
long as they are independent of the acceptance uniforms: condition on them.) The price of
point masses: a node accepts with probability Σ_i p(x_i), the mass its children cover.

Typical acceptance (``acceptance="typical"``) is Medusa-2's threshold rule and is **not
lossless**: see :func:`draftheads.decoding.accept.typical_accept`.

Randomness
----------
One ``torch.Generator`` per ``generate`` call: the caller's, or one seeded from the global torch
RNG (so ``transformers.set_seed`` / ``torch.manual_seed`` make runs reproducible and
consecutive calls differ). Every step draws a fixed-shape block of uniforms (rows × levels ×
children, plus one per row for the bonus) before the walk, so each row of a batch has its own
draws and the stream never depends on acceptance outcomes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .accept import Acceptance, children_table, greedy_accept, greedy_tokens, lossless_accept, sample_from, typical_accept

# Sampling warpers transformers would apply that draftheads does not build (yet): refused
# with their name instead of silently sampling from another distribution.
_UNSUPPORTED_WARPERS = {"top_h": None, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                        "watermarking_config": None}
ACCEPTANCE_MODES = ("lossless", "typical")


@dataclass(frozen=True)
class Typical:
    """Medusa-2 typical acceptance (lossy): accept x if p(x) > min(epsilon, delta·exp(−H(p)))."""

    epsilon: float = 0.09
    delta: float = 0.3


def check_sampling_config(config) -> None:
    """Refuse warpers that would change the distribution but are not implemented here."""
    if not config.do_sample:
        return
    for name, default in _UNSUPPORTED_WARPERS.items():
        value = getattr(config, name, default)
        if value not in (default, None):
            raise ValueError(f"generate(): `{name}={value!r}` is not supported with do_sample=True by draftheads yet "
                             f"(supported: temperature, top_k, top_p, repetition_penalty); leave it unset or use "
                             "the base model's own generate().")


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


def logits_processors(config):
    """The processors transformers' ``generate`` applies for ``config``, in its order
    (``GenerationMixin._get_logits_processor``, transformers 5.23): repetition penalty, then,
    when sampling, temperature, top-k, top-p. Built from the public classes.

    Left padding: transformers tells the repetition penalty to skip each row's pad prefix; we
    replace pad positions by an out-of-vocabulary id instead (see :func:`history_ids`), which
    the processor drops by design."""
    from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    processors = LogitsProcessorList()
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(float(config.repetition_penalty)))
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None and config.top_k != 0:
            processors.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
        if config.top_p is not None and config.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    return processors


def uses_history(processors) -> bool:
    """Whether a processor reads the tokens so far (only the repetition penalty here)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    return any(isinstance(p, RepetitionPenaltyLogitsProcessor) for p in processors)


def history_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor, generated: Sequence[Sequence[int]],
                rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, L) the tokens so far of the given original rows: prompt (pad positions → ``vocab``,
    an id every processor ignores) then the generated tokens, right-filled with ``vocab``."""
    rows_list = rows.tolist()
    prompt = input_ids[rows].masked_fill(attention_mask[rows] == 0, vocab)
    width = max((len(generated[r]) for r in rows_list), default=0)
    tail = torch.full((len(rows_list), width), vocab, dtype=prompt.dtype)
    for i, r in enumerate(rows_list):
        tail[i, : len(generated[r])] = torch.tensor(generated[r], dtype=prompt.dtype)
    return torch.cat([prompt, tail.to(prompt.device)], dim=1)


def processed_scores(processors, logits: torch.Tensor, history: torch.Tensor | None = None,
                     tokens: torch.Tensor | None = None, path_slots: torch.Tensor | None = None) -> torch.Tensor:
    """logits (B, N, V) at the tree slots → processed float32 scores (B, N, V). The ids the
    processors see at slot n are ``history`` + the root→n path (the root is also the last
    history token; repeats do not matter to the set-based repetition penalty)."""
    batch, nodes, vocab = logits.shape
    scores = logits.to(dtype=torch.float32, copy=True).reshape(batch * nodes, vocab)
    if len(processors) == 0:
        return scores.view(batch, nodes, vocab)
    if history is None:
        ids = torch.full((batch * nodes, 1), vocab, dtype=torch.long, device=logits.device)
    else:
        path_slots = path_slots.to(logits.device)
        path = tokens.gather(1, path_slots.reshape(1, -1).expand(batch, -1)).view(batch, nodes, -1)
        ids = torch.cat([history.to(logits.device)[:, None, :].expand(batch, nodes, -1), path], dim=2)
        ids = ids.reshape(batch * nodes, -1)
    return processors(ids, scores).view(batch, nodes, vocab)


def default_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from the global torch RNG: ``set_seed(s)`` makes a call reproducible,
    and (as with transformers) consecutive calls without reseeding draw different samples."""
    seed = int(torch.randint(0, 2**62, (1,)))
    return torch.Generator(device=device).manual_seed(seed)


class Acceptor:
    """What ``generate`` asks at each step: the first token after the prompt, then which tree
    path each row keeps plus its bonus token. Holds the processors, the generator and (for the
    repetition penalty) references to the prompt and the per-row generated lists."""

    def __init__(self, config, mode: str | Typical, vocab: int, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor, generated: list[list[int]], generator: torch.Generator | None = None):
        self.mode = mode
        self.vocab = vocab
        self.processors = logits_processors(config)
        self.history = uses_history(self.processors)
        self.input_ids, self.attention_mask, self.generated = input_ids, attention_mask, generated
        self.generator = None
        if mode != "greedy":
            self.generator = generator if generator is not None else default_generator()
        # transformers returns processed scores as ``scores`` and raw ones as ``logits``
        self.report_processed = bool(config.output_scores) and len(self.processors) > 0
        if self.report_processed and config.output_logits and config.return_dict_in_generate:
            raise ValueError("generate(): output_scores and output_logits together are not supported with sampling or "
                             "a repetition penalty yet (they differ there); ask for one of them.")
        self.last_scores: torch.Tensor | None = None

    def _scores(self, logits: torch.Tensor, rows: torch.Tensor, tokens=None, path_slots=None) -> torch.Tensor:
        history = None
        if self.history:
            history = history_ids(self.input_ids, self.attention_mask, self.generated, rows.cpu(), self.vocab)
            if tokens is None:  # the first token: "so far" is the prompt itself
                tokens = torch.full((rows.numel(), 1), self.vocab, dtype=torch.long, device=logits.device)
                path_slots = torch.zeros(1, 1, dtype=torch.long)
        self.last_scores = processed_scores(self.processors, logits, history, tokens, path_slots)
        return self.last_scores

    def reported(self, logits: torch.Tensor) -> torch.Tensor:
        """What ``output_scores``/``output_logits`` record for the last step: the processed
        scores when asked for ``scores`` under processors (as transformers), else the logits."""
        return self.last_scores.view(logits.shape).to(logits.dtype) if self.report_processed else logits

    def _uniform(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.generator, dtype=torch.float64,
                          device=self.generator.device)

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (B, V) after the prompt → the first generated token per row."""
        rows = torch.arange(logits.shape[0])
        if self.mode == "greedy" and len(self.processors) == 0:
            return greedy_tokens(logits)
        scores = self._scores(logits[:, None], rows)[:, 0]
        if self.mode == "greedy":
            return greedy_tokens(scores)
        return sample_from(scores.softmax(-1), self._uniform(logits.shape[0])).to(logits.device)

    def accept(self, tokens: torch.Tensor, tree, logits: torch.Tensor, rows: torch.Tensor) -> Acceptance:
        """tokens (B, N), logits (B, N, V) of the verified tree; rows (B,) the original batch
        rows still decoding (for their tokens so far)."""
        device = tokens.device
        parent, depth, path_slots = tree.parent.to(device), tree.depth.to(device), tree.path_slots.to(device)
        if self.mode == "greedy" and len(self.processors) == 0:
            return greedy_accept(tokens, parent, depth, path_slots, greedy_tokens(logits))
        scores = self._scores(logits, rows, tokens, path_slots)
        if self.mode == "greedy":  # greedy with a repetition penalty: argmax of the penalized scores
            return greedy_accept(tokens, parent, depth, path_slots, greedy_tokens(scores))
        probs = scores.softmax(-1)
        batch = tokens.shape[0]
        if isinstance(self.mode, Typical):
            return typical_accept(tokens, probs, parent, depth, path_slots, self._uniform(batch),
                                  self.mode.epsilon, self.mode.delta)
        width = children_table(tree.parent).shape[1]
        uniforms = self._uniform(batch, tree.path_slots.shape[1] - 1, width)
        return lossless_accept(tokens, probs, parent, depth, path_slots, uniforms, self._uniform(batch))
