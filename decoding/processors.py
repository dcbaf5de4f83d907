"""The target distribution: the base's logits through the processors transformers' sampling
applies, in transformers' order (``GenerationMixin._get_logits_processor``, transformers 5.x):
repetition penalty first, then temperature, top-k, top-p. At a tree node "so far" is the prompt,
every token emitted before, the root and the node's own path, so the repetition penalty sees
the drafted tokens above the node exactly as it would had the base produced them. Acceptance
(:mod:`.accept`) compares drafts with this distribution; nothing here knows about trees'
acceptance, caches or drafters.
"""
from __future__ import annotations


import torch

# Sampling warpers transformers would apply that draftheads does not build (yet): refused
# with their name instead of silently sampling from another distribution.
_UNSUPPORTED_WARPERS = {"top_h": None, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                        "watermarking_config": None}


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


def logits_processors(config):
    """The processors transformers' ``generate`` applies for ``config``, in its order
    (``GenerationMixin._get_logits_processor``, transformers 5.23): repetition penalty, then,
    when sampling, temperature, top-k, top-p. Built from the public classes.

    Left padding: transformers tells the repetition penalty to skip each row's pad prefix; we
    replace pad positions by an out-of-vocabulary id instead (see :meth:`~.sequences.Sequences.history`), which
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
        path_slots = path_slots.to(logits.device).expand(batch, nodes, -1)  # (N, D+1) or (B, N, D+1)
        path = tokens.gather(1, path_slots.reshape(batch, -1)).view(batch, nodes, -1)
        ids = torch.cat([history.to(logits.device)[:, None, :].expand(batch, nodes, -1), path], dim=2)
        ids = ids.reshape(batch * nodes, -1)
    return processors(ids, scores).view(batch, nodes, vocab)
