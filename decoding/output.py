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
from typing import Callable

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
    ``criteria`` the call's other stopping criteria, called as transformers calls them
    (:class:`StopReplay`); ``want_scores``: keep one score row per token."""

    def __init__(self, sequences: Sequences, limits: list[int], eos: list[int], criteria: "StopReplay | None" = None,
                 streamer=None, want_scores: bool = False):
        batch = sequences.batch
        self.seqs = sequences
        self.limits = limits
        self.eos = set(eos)
        self.criteria = criteria
        self.streamer = streamer
        self.want_scores = want_scores
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.done = torch.zeros(batch, dtype=torch.bool)
        #: row → the error transformers raises at that row's next step (its processors failed on its
        #: tokens so far): the row decodes no further, and the error is raised unless the row stops first
        self.blocked: dict[int, BaseException] = {}
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

    def emit(self, row: int, new: list[int], new_scores=None, drafted: int = 0,
             error: BaseException | None = None) -> None:
        """Append tokens one by one, stopping exactly where transformers would: after an EOS,
        at the row's limit, or when the call's stopping criteria stop it (:class:`StopReplay`,
        which may cut tokens appended before). The first ``drafted`` of ``new`` are accepted
        drafts: a streamer with ``put_step`` is told so (colouring). ``error``: what computing
        the token after ``new`` raised (:class:`~.processors.NodeProcessors`), raised where
        transformers would raise it — unless the row stops first."""
        if bool(self.done[row]):
            return
        before = self.seqs.count(row)
        for i, token in enumerate(new):
            self.seqs.append(row, token)
            if new_scores is not None:
                self.scores[row].append(new_scores[i])
            if token in self.eos or self.seqs.count(row) >= self.limits[row]:
                self.done[row] = True
                break
        if error is not None and not bool(self.done[row]):
            self.blocked[row], self.done[row] = error, True
        if self.criteria is not None:
            self.criteria.advance(self)
        elif self.blocked:
            raise next(iter(self.blocked.values()))
        if self.streamer is not None:
            self._stream(self.seqs.generated[row][before:], drafted)

    def cut(self, row: int, length: int) -> None:
        """Row ``row`` ends after its first ``length`` tokens (a stopping criterion fired there)."""
        self.seqs.truncate(row, length)
        del self.scores[row][length:]
        self.done[row] = True
        self.blocked.pop(row, None)

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
                  bonus: torch.Tensor, reported: torch.Tensor | None,
                  failed: dict[tuple[int, int], BaseException] | None = None) -> None:
        """One verification step: rows (R,) original indices; tokens (R, N) the tree; path (R, D+1)
        accepted slots root first; accepted (R,) drafts kept; bonus (R,); reported (R, N, V) or None;
        ``failed``: {(i, slot): error} the slots whose processors raised — the token after such a
        slot is unknown, so a row's output stops at the first of them on its path, with that error."""
        for i, b in enumerate(rows.tolist()):
            a = int(accepted[i])
            slots = path[i, : a + 1].tolist()
            cut = next((j for j, slot in enumerate(slots) if (i, slot) in failed), None) if failed else None
            if cut is None:
                new, error = tokens[i, path[i, 1: a + 1]].tolist() + [int(bonus[i])], None
            else:
                new, error = tokens[i, path[i, 1: cut + 1]].tolist(), failed[(i, slots[cut])]
            scores = [reported[i, s] for s in slots[: len(new)]] if reported is not None else None
            self.emit(b, new, scores, drafted=a if cut is None else cut, error=error)

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


class StopReplay:
    """transformers' loop step by step, as far as a tree loop must replay it: the call's stopping
    criteria besides length and EOS, and the caller's logits-processor functions on rows that
    finished (``finished_calls``: (a row's tokens so far (1, L + t - 1), its batch row) → None,
    raising what transformers' step would; :meth:`~.processors.NodeProcessors.call_finished`).
    Each is called exactly as transformers' loop calls it: once per step for the whole batch,
    with ``input_ids`` (B, L + t) — every row's prompt and first t tokens, a row that finished
    already continued with the pad token when an EOS criterion is in force (else with its own
    tokens, which it keeps) — and ``scores`` the tuple of the t processed (B, V) float32 scores
    (``return_dict_in_generate`` and ``output_scores``; else None). Rows of a tree loop advance
    unevenly, so step t is called once every row has its t-th token; a row a criterion stops at
    step t is cut to t tokens. The calls, their order and their arguments are transformers' own,
    so criteria with state see what they would see there (the wall clock aside), and an error a
    row's processors raise at step t — a live row's on its tokens (:attr:`Emitter.blocked`), a
    finished row's on its padded ones — is raised at step t, rows in batch order."""

    def __init__(self, criteria: list, input_ids: torch.Tensor, pad: int, pads_finished: bool, pass_scores: bool,
                 finished_calls: Callable[[torch.Tensor, int], None] | None = None):
        from transformers import StoppingCriteriaList

        self.criteria = StoppingCriteriaList(criteria)
        self.ids = input_ids  # (B, L + t): what the criteria were last handed
        self.prompt_len = int(input_ids.shape[1])
        self.finished = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        self.pad, self.pads_finished, self.pass_scores = pad, pads_finished, pass_scores
        self.finished_calls = finished_calls
        self.scores: tuple[torch.Tensor, ...] = ()

    @property
    def steps(self) -> int:
        return int(self.ids.shape[1]) - self.prompt_len

    def _padded(self, row: int) -> bool:
        """Whether ``row`` finished and transformers now feeds it the pad token."""
        return bool(self.finished[row]) and self.pads_finished

    def _ready(self, out: Emitter, t: int) -> bool:
        """Whether step t's inputs are known for every row up to the first whose processors fail
        at step t (transformers' step raises there, the rows after it do not matter)."""
        for row in range(self.finished.shape[0]):
            if self._padded(row) or out.seqs.count(row) >= t:
                continue
            if row in out.blocked:
                return True
            if not bool(out.done[row]):
                return False  # still decoding: its t-th token is to come
        return True

    def _process(self, out: Emitter, t: int) -> None:
        """Step t's logits processors, as far as they can fail: rows in batch order, a finished
        row's padded tokens through ``finished_calls``, a live row's error raised where it fell."""
        for row in range(self.finished.shape[0]):
            if self._padded(row):
                if self.finished_calls is not None:
                    self.finished_calls(self.ids[row: row + 1], row)
            elif out.seqs.count(row) < t and row in out.blocked:
                raise out.blocked[row]

    def advance(self, out: Emitter) -> None:
        """Call every step whose inputs are known, in order; stop and cut rows as transformers does."""
        while not bool(self.finished.all()) and self._ready(out, self.steps + 1):
            t = self.steps + 1
            self._process(out, t)
            column = [self.pad if (bool(self.finished[row]) and self.pads_finished) or out.seqs.count(row) < t
                      else out.seqs.generated[row][t - 1] for row in range(self.finished.shape[0])]
            self.ids = torch.cat([self.ids, self.ids.new_tensor(column)[:, None]], dim=1)
            if self.pass_scores:  # one row (batches with such criteria decode token by token: request.token_by_token)
                self.scores += (torch.stack([out.scores[row][t - 1].float() for row in range(len(column))]),)
            stops = self.criteria(self.ids, self.scores if self.pass_scores else None).to("cpu")
            ends = torch.tensor([column[row] in out.eos or t >= out.limits[row] for row in range(len(column))])
            newly = ~self.finished & (stops | ends)
            self.finished |= newly
            self._end(out, newly, t)

    def _end(self, out: Emitter, newly: torch.Tensor, t: int) -> None:
        """Rows that finished at step t: each cut there (pads follow); without an EOS criterion a
        finished row decodes on (transformers keeps its tokens) until every row has finished."""
        if self.pads_finished:
            for row in newly.nonzero().flatten().tolist():
                out.cut(row, min(t, out.seqs.count(row)))
        elif bool(self.finished.all()):
            for row in range(self.finished.shape[0]):
                out.cut(row, min(t, out.seqs.count(row)))


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
