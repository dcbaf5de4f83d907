"""What a ``generate`` call hands back, built in one place: emitting tokens row by row,
stopping exactly where transformers stops, streaming, the per-token scores, and the assembled
sequences / ``GenerateDecoderOnlyOutput``.

The loop only says "row b emitted these tokens (the first ``drafted`` were accepted drafts)";
:class:`Emitter` decides where each row stops, writes the tokens into the call's
:class:`~.sequences.Sequences` (their one writer) and keeps what the return value needs.

The loop runs under :data:`LOOP_MODE` (:func:`loop_mode`), and what it hands back leaves it
through :func:`released`.
"""
from __future__ import annotations

import functools

import torch

from ..core.kept import keeping
from .base.forward import forward_all, lm_logits
from .sequences import Sequences

#: the mode the decoder's loop runs in, and the calibration that times it: inference mode, no
#: autograd bookkeeping on a step's thousands of small ops; what the loop returns is released as
#: normal tensors (:func:`released`), what it keeps is made outside it
#: (:mod:`draftheads.core.kept`). evidence: results/loop/inference_mode
LOOP_MODE = torch.inference_mode


def loop_mode():
    """:data:`LOOP_MODE` entered (read at the call, so a bench can compare another mode)."""
    return LOOP_MODE()


def in_loop_mode(fn):
    """``fn`` runs inside :func:`loop_mode` (the calibration's timings: as the loop runs)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with loop_mode():
            return fn(*args, **kwargs)
    return run


class Emitter:
    """Per-row output of one ``generate`` call.

    ``sequences`` the call's prompts and generated tokens (this emitter appends to them);
    ``limits`` each row's ``max_new_tokens`` after the context cut; ``eos`` the EOS ids;
    ``want_scores``: keep one score row per token."""

    def __init__(self, sequences: Sequences, limits: list[int], eos: list[int], stopping_criteria=None,
                 streamer=None, want_scores: bool = False):
        batch = sequences.batch
        self.seqs = sequences
        self.limits = limits
        self.eos = set(eos)
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.want_scores = want_scores
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.done = torch.zeros(batch, dtype=torch.bool)
        if streamer is not None:
            streamer.put(sequences.input_ids.cpu())

    # -- during decoding -------------------------------------------------------------------------
    def running(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (R,) original row indices → (R,) bool: which still decode."""
        return ~self.done[rows]

    def room(self, rows: torch.Tensor) -> int:
        """Tokens the closest-to-its-limit of ``rows`` may still emit (bounds the tree depth)."""
        return min(self.rooms(rows))

    def rooms(self, rows: torch.Tensor) -> list[int]:
        """Tokens each of ``rows`` may still emit (0 for a finished row)."""
        return [0 if bool(self.done[b]) else self.limits[b] - self.seqs.count(b) for b in rows.tolist()]

    def emit(self, row: int, new: list[int], new_scores=None, drafted: int = 0) -> None:
        """Append tokens one by one, stopping exactly where transformers would: after an EOS,
        at the row's limit, or when a user stopping criterion fires. The first ``drafted`` of
        ``new`` are accepted drafts: a streamer with ``put_step`` is told so (colouring)."""
        if bool(self.done[row]):
            return
        emitted = []
        for i, token in enumerate(new):
            self.seqs.append(row, token)
            emitted.append(token)
            if new_scores is not None:
                self.scores[row].append(new_scores[i])
            if self._stops(row, token, new_scores[i] if new_scores is not None else None):
                self.done[row] = True
                break
        self._stream(emitted, drafted)

    def _stops(self, row: int, token: int, score: torch.Tensor | None) -> bool:
        if token in self.eos or self.seqs.count(row) >= self.limits[row]:
            return True
        if self.stopping_criteria is None:
            return False
        return bool(self.stopping_criteria(self.seqs.so_far(row), score[None] if score is not None else None).any())

    def _stream(self, emitted: list[int], drafted: int) -> None:
        if self.streamer is None or not emitted:
            return
        with keeping():  # the streamer may keep it
            tokens = torch.tensor(emitted)
        if hasattr(self.streamer, "put_step"):
            self.streamer.put_step(tokens, min(drafted, len(emitted)))
        else:
            self.streamer.put(tokens)

    def emit_first(self, roots: torch.Tensor, reported: torch.Tensor | None) -> None:
        """roots (B,) the token after each prompt; reported (B, V) its scores (or None)."""
        for b in range(roots.shape[0]):
            self.emit(b, [int(roots[b])], [reported[b]] if reported is not None else None)

    def emit_step(self, rows: torch.Tensor, tokens: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor,
                  bonus: torch.Tensor, reported: torch.Tensor | None) -> None:
        """One verification step: rows (R,) original indices; tokens (R, N) the tree; path (R, D+1)
        accepted slots root first; accepted (R,) drafts kept; bonus (R,); reported (R, N, V) or None."""
        for i, b in enumerate(rows.tolist()):
            a = int(accepted[i])
            new = tokens[i, path[i, 1: a + 1]].tolist() + [int(bonus[i])]
            scores = [reported[i, s] for s in path[i, : a + 1].tolist()] if reported is not None else None
            self.emit(b, new, scores, drafted=a)

    # -- after decoding --------------------------------------------------------------------------
    def finish(self, pad: int) -> torch.Tensor:
        """End the stream; (B, L + T) the assembled sequences (:meth:`Sequences.assembled`)."""
        if self.streamer is not None:
            self.streamer.end()
        return self.seqs.assembled(pad)

    def dict_output(self, base, sequences: torch.Tensor, attention_mask: torch.Tensor, config, kv, acceptor, vocab: int):
        """``GenerateDecoderOnlyOutput`` as transformers returns it: scores/logits float32, one
        (B, V) per generated position; the cache. A batch's own cache has per-row holes and rows
        that finished early have no scores after their end: one forward over the output, fed as
        transformers feeds it, gives both (equal up to float rounding)."""
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        prompt_len = self.seqs.prompt_len
        steps = sequences.shape[1] - prompt_len
        early = self.want_scores and any(len(row) < steps for row in self.scores)
        cache_out = None
        if early or (config.use_cache and sequences.shape[0] > 1):
            cache_out, hidden_all = forward_all(base, sequences[:, :-1], grown_mask(attention_mask, steps))
            if early:
                fill_finished_scores(self.scores, base, hidden_all, sequences, prompt_len, acceptor)
            cache_out = cache_out if config.use_cache else None
        elif config.use_cache:
            kv.crop_to(prompt_len + steps - 1)
            cache_out = kv.cache
        score_tuple = stack_scores(self.scores, steps, vocab) if self.want_scores else None
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=score_tuple if config.output_scores else None,
                                         logits=score_tuple if config.output_logits else None,
                                         past_key_values=cache_out)


def generated_counts(sequences: torch.Tensor, width: int, eos: set[int]) -> list[int]:
    """New tokens per row (after the ``width`` prompt columns) up to and including its first
    EOS: the padding after it is not work."""
    counts = []
    for row in sequences[:, width:].tolist():
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        counts.append(len(row) if stop is None else stop + 1)
    return counts


def grown_mask(attention_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """The mask transformers' ``generate`` has after ``steps`` tokens, over all but the last
    (every row, finished or not, gets a 1 per step)."""
    return torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], steps - 1)], dim=1)


def fill_finished_scores(scores: list[list[torch.Tensor]], base, hidden: torch.Tensor, sequences: torch.Tensor,
                         prompt_len: int, acceptor) -> None:
    """Scores of rows after they finished, as transformers records them: it keeps feeding such a
    row the pad token and reports the base's (processed) logits at every step."""
    steps = sequences.shape[1] - prompt_len
    for row, row_scores in enumerate(scores):
        for step in range(len(row_scores), steps):
            logits = lm_logits(base, hidden[row, prompt_len - 1 + step][None, None])[0, 0]
            if acceptor.report_processed:
                ids = sequences[row: row + 1, : prompt_len + step]
                logits = acceptor.processors(ids, logits.float()[None], rows=torch.tensor([row]))[0].to(logits.dtype)
            row_scores.append(logits)


def stack_scores(scores: list[list[torch.Tensor]], steps: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """Per-token logits as transformers returns them: one (B, V) float32 tensor per generated
    position, whatever the model's dtype (every row has one by now: see :func:`fill_finished_scores`)."""
    zero = torch.zeros(vocab, dtype=torch.float32)
    return tuple(torch.stack([(row[i] if i < len(row) else zero).float() for row in scores]) for i in range(steps))


def released(value):
    """What a ``generate`` call returns, as the caller may use it: every tensor the decoder made
    under inference mode (its loop runs there: :meth:`~.generate.DraftHeadsModel.run`) cloned
    into a normal tensor — in a tensor, a tuple or list, a ``ModelOutput`` or a cache's layers (a
    layer's ``SCRATCH`` buffers dropped) — so in-place writes and autograd work on it as on
    transformers' own output."""
    if isinstance(value, torch.Tensor):
        if not value.is_inference():
            return value
        with keeping():
            return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(released(item) for item in value)
    if isinstance(value, dict):  # ModelOutput too: setting a key sets its attribute
        for key in list(value.keys()):
            value[key] = released(value[key])
        return value
    for layer in getattr(value, "layers", None) or ():  # a transformers Cache
        for name in getattr(layer, "SCRATCH", ()):
            setattr(layer, name, None)
        for name, item in list(vars(layer).items()):
            if isinstance(item, torch.Tensor):
                setattr(layer, name, released(item))
    return value
