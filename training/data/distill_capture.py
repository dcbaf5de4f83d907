"""Training features from the decoder's own forwards: while draftheads' batched greedy decoder
answers a batch, keep the base's final hidden states it computes anyway — every prompt token's
from the prefill, every kept token's from the verification forward that accepted it — so
self-distilled data needs no second pass over the base. Token ids that come from elsewhere
(shared answers, committed ids) get theirs from one plain forward (:func:`forward_states`), the
same function the decoder's prefill runs.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from ...decoding.accept import Acceptance
from ...decoding.base.forward import forward_all
from ...decoding.head_state import listening
from ...decoding.output import generated_counts
from ...decoding.request import eos_token_ids, left_pad


@dataclass
class StateCapture:
    """One ``generate`` call's states, by the caller's row: ``prompt`` (B, T, d) from the
    prefill (left-padded like the prompt), ``kept[b]``: (k, d) blocks of row b's kept tokens'
    states in order (the token each step started from, then its accepted drafts)."""

    prompt_ids: torch.Tensor  # (B, T) the prompt as passed to generate
    prompt: torch.Tensor | None = None
    kept: list[list[torch.Tensor]] = field(default_factory=list)

    def __post_init__(self):
        self.kept = [[] for _ in range(self.prompt_ids.shape[0])]

    def prefilled(self, states: torch.Tensor) -> None:
        """states (B, T, d): the prefill's, laid out as the prompt."""
        if self.prompt is None:
            self.prompt = states.detach().cpu()

    def verified(self, rows: torch.Tensor, states: torch.Tensor, result: Acceptance) -> None:
        """states (R, N, d); ``result.path`` (R, D+1) the kept slots root first."""
        path = result.path.to(states.device)
        kept = states.gather(1, path[..., None].expand(-1, -1, states.shape[-1])).cpu()  # (R, D+1, d)
        for i, row in enumerate(rows.tolist()):
            self.kept[row].append(kept[i, : int(result.accepted[i]) + 1])


@contextmanager
def capturing(input_ids: torch.Tensor) -> Iterator[StateCapture]:
    """Decoding calls inside the block over ``input_ids`` (B, T) fill the returned capture."""
    capture = StateCapture(input_ids.cpu())
    with listening(capture):
        yield capture


@dataclass
class Answered:
    """One prompt answered: its answer ids and the states of prompt + answer (L, d), in the
    base's dtype; row i predicts token i+1, the last row is zero (nothing follows the last token)."""

    answer: list[int]
    states: torch.Tensor


@torch.no_grad()
def answer_with_states(decoder, prompts: list[list[int]], max_new_tokens: int, pad: int) -> list[Answered]:
    """Greedy answers of ``decoder`` (a :class:`~draftheads.decoding.DraftHeadsModel`) to a batch
    of tokenized prompts (left-padded here), each with the states its forwards computed."""
    ids, mask = left_pad(prompts, pad)
    device = next(decoder.base.parameters()).device
    with capturing(ids) as capture:
        out = decoder.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=pad)
    if capture.prompt is None:
        raise RuntimeError("the decoder's prefill was not heard: the call did not run the decoder's own prefill.")
    width = ids.shape[1]
    counts = generated_counts(out.cpu(), width, set(eos_token_ids(decoder.base.generation_config)))
    answered = []
    for b, (prompt, count) in enumerate(zip(prompts, counts)):
        kept = torch.cat(capture.kept[b]) if capture.kept[b] else capture.prompt.new_zeros(0, capture.prompt.shape[-1])
        if kept.shape[0] < count - 1:
            raise RuntimeError(f"row {b}: {kept.shape[0]} states kept for {count} answer tokens.")
        zero = capture.prompt.new_zeros(1, capture.prompt.shape[-1])
        states = torch.cat([capture.prompt[b, width - len(prompt):], kept[: count - 1], zero])  # (L, d)
        answered.append(Answered(out[b, width: width + count].tolist(), states))
    return answered


@torch.no_grad()
def forward_states(base, sequences: list[list[int]], max_tokens: int = 8192,
                   layers: list[int] | tuple[int, ...] = ()) -> list[torch.Tensor]:
    """The base's final hidden states over whole sequences, one plain forward each batch
    (length-sorted, left-padded, under ``max_tokens`` padded tokens): (L, d) per sequence, the
    last row zero like :func:`answer_with_states`. ``layers``: the states after those decoder
    layers too, from the same forward (``output_hidden_states``: the decoder's ``taps``), beside
    the final state: (L, d · (1 + n)), the heads' input layout (:mod:`draftheads.heads.fusion`)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    device = next(base.parameters()).device
    result: list[torch.Tensor | None] = [None] * len(sequences)
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and (stop + 1 - start) * len(sequences[order[stop]]) <= max_tokens:
            stop += 1
        batch = order[start:stop]
        ids, mask = left_pad([sequences[i] for i in batch])
        _, states = forward_all(base, ids.to(device), mask.to(device), layers)  # (B, T, d · (1 + n))
        states = states.cpu()
        for row, i in enumerate(batch):
            length = len(sequences[i])
            kept = states[row, ids.shape[1] - length:].clone()
            kept[-1] = 0
            result[i] = kept
        start = stop
    return result  # type: ignore[return-value]


#: rows of states per LM-head chunk of :func:`base_predictions` (its logits: these rows × the vocabulary)
PREDICT_ROWS = 1024


@torch.no_grad()
def base_predictions(base, states: list[torch.Tensor]) -> np.ndarray:
    """The base's own choice after every token of each sequence, from the final (normed) states
    its forward already computed, (L, d) per sequence as :func:`forward_states` and
    :func:`answer_with_states` return them: argmax of its LM head, ``PREDICT_ROWS`` rows at a time
    on the head's device and in its dtype (no second forward). int32 (Σ L,), the sequences
    concatenated; −1 at each sequence's last row (a zero state: nothing follows its last token)."""
    head = base.get_output_embeddings()
    weight = head.weight
    rows = torch.cat(states) if states else torch.zeros(0, weight.shape[1])
    out = torch.empty(rows.shape[0], dtype=torch.int32)
    for start in range(0, rows.shape[0], PREDICT_ROWS):
        chunk = rows[start: start + PREDICT_ROWS].to(weight.device, weight.dtype)
        out[start: start + chunk.shape[0]] = head(chunk).argmax(-1).to("cpu", torch.int32)
    ends = torch.tensor([len(s) for s in states], dtype=torch.long).cumsum(0) - 1
    out[ends[ends >= 0]] = -1
    return out.numpy()
