"""The target distribution: the base's logits through the logits processors transformers'
``generate`` builds for the call (``GenerationMixin._get_logits_processor``: the generation
config's options and the caller's own processors, in transformers' order), applied at every
tree node exactly as the base would apply them had it produced that node's prefix itself.

A processor transformers calls once per step with ``(input_ids, scores)`` is exact over a tree
when it is a function of each row's tokens so far and its scores alone: at node n it is given
the row's prompt (left padding included, as transformers passes it), every token emitted before
and the drafted path to n. By what they read, the classes draftheads knows (exact classes only:
a subclass may keep state) are applied in one of three ways (:data:`KINDS`):

- ``scores``: only the scores (temperature, top-k, top-p, ...): one call over every node;
- ``set``: the set of ids so far (the repetition penalty): one call over every node, each node's
  ids right-filled with an id past the vocabulary, which the processor drops by design;
- ``prefix``: the prefix itself, its length or its last tokens (n-gram bans, minimum lengths,
  forced tokens, watermarking, ...): one call per prefix length.

Processors holding one entry per batch row (the penalty's padding lengths, the encoder penalty's
prompt, a ``prefix_allowed_tokens_fn``'s batch index) are re-indexed to the rows each call sees
(:func:`for_rows`). Anything else — state kept across calls (SynthID watermarking, classifier-free
guidance) or a class draftheads does not know — is refused by name before any work
(:func:`check_processors`); a caller's own processor that is a function of the tokens so far
and the scores can say so by being wrapped in :class:`PrefixOnly`. A caller's function that raises
or allows nothing on a drafted prefix fails only that node (:class:`NodeProcessors`): its error is
raised where transformers would reach that prefix. transformers calls every processor on every row
at every step, rows that finished included (their tokens padded): the caller's functions among them
are called there too (:meth:`NodeProcessors.call_finished`), so what they raise there propagates
as it does in transformers. Acceptance (:mod:`.accept`)
compares drafts with the processed distribution; nothing here knows about caches or drafters.
"""
from __future__ import annotations

import copy
import functools
from contextlib import contextmanager
from typing import Iterator

import torch

from ..core.errors import InputError

SCORES, SET, PREFIX = "scores", "set", "prefix"


class PrefixOnly:
    """A caller's own logits processor, declared a function of each row's tokens so far and its
    scores alone (no state across calls, no batch index): draftheads then applies it at every
    tree node on that node's own prefix, as transformers would at that step. Pass
    ``logits_processor=[PrefixOnly(mine)]``; transformers' own ``generate`` runs it unchanged.
    On a finished row's padded tokens, where transformers calls it and discards what it returns,
    it is handed zeros for the scores (the base's scores there are not computed): what it raises
    there must follow from the tokens alone (:meth:`NodeProcessors.call_finished`)."""

    def __init__(self, processor):
        if not callable(processor):
            raise InputError(f"PrefixOnly({processor!r}): expected a logits processor (a callable taking input_ids "
                             "and scores).")
        self.processor = processor

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.processor(input_ids, scores)

    def __repr__(self) -> str:
        return f"PrefixOnly({self.processor!r})"


@functools.lru_cache(maxsize=None)
def kinds() -> dict[type, str]:
    """transformers' processor classes that are exact over a tree → how they are applied."""
    from transformers.generation import logits_process as lp

    by_kind = {
        SCORES: ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                 "TopHLogitsWarper", "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper",
                 "InfNanRemoveLogitsProcessor", "LogitNormalization", "SuppressTokensLogitsProcessor",
                 "EncoderRepetitionPenaltyLogitsProcessor"),
        SET: ("RepetitionPenaltyLogitsProcessor",),
        PREFIX: ("NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor", "SequenceBiasLogitsProcessor",
                 "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "ForcedBOSTokenLogitsProcessor",
                 "ForcedEOSTokenLogitsProcessor", "ExponentialDecayLengthPenalty",
                 "SuppressTokensAtBeginLogitsProcessor", "WatermarkLogitsProcessor",
                 "PrefixConstrainedLogitsProcessor"),
    }
    table = {getattr(lp, name): kind for kind, names in by_kind.items() for name in names if hasattr(lp, name)}
    table[PrefixOnly] = PREFIX
    return table


#: processors transformers builds that are not exact over a tree: the option that made each, and why
_REFUSED = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": ("guidance_scale", "it runs the model again with its own cache"),
    "SynthIDTextWatermarkLogitsProcessor": ("watermarking_config (SynthID)", "it keeps state from step to step"),
    "EncoderNoRepeatNGramLogitsProcessor": ("encoder_no_repeat_ngram_size", "it keeps per-batch-row state"),
}


def callers_functions(processors) -> list:
    """The processors that run a caller's own function on the tokens so far — a
    ``prefix_allowed_tokens_fn`` (``PrefixConstrainedLogitsProcessor``), a :class:`PrefixOnly` — which
    may raise or allow nothing where transformers' own processors cannot (exact classes)."""
    from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

    return [p for p in processors if type(p) in (PrefixConstrainedLogitsProcessor, PrefixOnly)]


def kind_of(processor) -> str | None:
    """How ``processor`` is applied over a tree (:data:`SCORES`, :data:`SET`, :data:`PREFIX`), or
    None when it cannot be applied exactly."""
    return kinds().get(type(processor))


def check_processors(processors) -> None:
    """Refuse, naming its option or class, each processor that is not exact over a tree."""
    for processor in processors:
        if kind_of(processor) is not None:
            continue
        name = type(processor).__name__
        if name in _REFUSED:
            option, why = _REFUSED[name]
            raise InputError(f"generate(): {option} is not supported by draftheads ({why}, which draft trees cannot "
                             "reproduce); drop it or call the model's own generate() without draftheads.")
        raise InputError(f"generate(): logits_processor {name} is not one draftheads can apply at every draft-tree "
                         "node as transformers applies it per step; if it depends only on each row's tokens so far "
                         "and the scores, pass draftheads.PrefixOnly(it), else call generate() without draftheads.")


def for_rows(processor, rows: torch.Tensor):
    """``processor`` as seen by a batch whose i-th entry is the call's row ``rows[i]``: processors
    that hold an entry per batch row get a copy holding those rows' entries."""
    from transformers.generation import logits_process as lp

    kind = type(processor)
    if kind is lp.RepetitionPenaltyLogitsProcessor and isinstance(processor.prompt_ignore_length, torch.Tensor):
        view = copy.copy(processor)
        view.prompt_ignore_length = processor.prompt_ignore_length[rows.to(processor.prompt_ignore_length.device)]
        return view
    if kind is lp.EncoderRepetitionPenaltyLogitsProcessor:
        view = copy.copy(processor)
        view.encoder_input_ids = processor.encoder_input_ids[rows.to(processor.encoder_input_ids.device)]
        return view
    if kind is lp.PrefixConstrainedLogitsProcessor:
        view, allowed, index = copy.copy(processor), processor._prefix_allowed_tokens_fn, rows.tolist()
        view._prefix_allowed_tokens_fn = lambda batch_id, sent: allowed(index[batch_id], sent)
        return view
    return processor


def by_length(ids: torch.Tensor, lengths: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ids (M, W) → [(entries (k,), their ids (k, length))], one group per prefix length (one
    group of all W columns without ``lengths``)."""
    if lengths is None:
        return [(torch.arange(ids.shape[0], device=ids.device), ids)]
    groups = []
    for length in torch.unique(lengths).tolist():
        pick = (lengths == length).nonzero().squeeze(1)
        groups.append((pick, ids[pick, :length]))
    return groups


def _apply(processors, ids: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    for processor in processors:
        scores = for_rows(processor, rows)(ids, scores)
    return scores


class NodeProcessors:
    """One call's processors, applied at tree nodes (see the module docstring).

    A processor that reads the prefix is asked about drafted prefixes transformers may never
    reach, where a caller's function (a ``prefix_allowed_tokens_fn`` off its grammar, a
    :class:`PrefixOnly`) may raise or allow nothing. While :attr:`tolerant` (the loop's tree
    steps), such an entry is recorded in :attr:`failed` (entry → error) and its scores left
    unprocessed by that processor: the loop emits no token chosen from them and raises the error
    only where transformers would (:meth:`~.output.Emitter.emit`). Otherwise errors propagate."""

    def __init__(self, processors=()):
        self.processors = list(processors)
        check_processors(self.processors)
        found = [kind_of(p) for p in self.processors]
        #: the processors up to the last that reads the exact prefix run once per prefix length
        self.cut = max((i + 1 for i, kind in enumerate(found) if kind == PREFIX), default=0)
        #: whether any processor reads the ids at all (else they are not built)
        self.reads_ids = any(kind != SCORES for kind in found)
        self.tolerant = False
        self.failed: dict[int, BaseException] = {}
        #: the caller's functions, called on finished rows too (:meth:`call_finished`)
        self.callers = callers_functions(self.processors)

    def __len__(self) -> int:
        return len(self.processors)

    @contextmanager
    def tolerating(self) -> Iterator[None]:
        """The loop's tree steps: prefix-reading processors (:attr:`cut`) may fail on drafted
        prefixes inside the block; after it, whatever ended it, errors propagate again (a finished
        row's scores raise as transformers would)."""
        self.tolerant = bool(self.cut)
        try:
            yield
        finally:
            self.tolerant = False

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor | None = None,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        """scores (M, V) float32 → processed (M, V). ``ids`` (M, W): entry m's tokens so far in its
        first ``lengths[m]`` columns (default: all W), the rest an id ≥ V; ``rows`` (M,): the call's
        batch row of each entry (default: 0..M-1)."""
        if not self.processors:
            return scores
        rows = torch.arange(scores.shape[0]) if rows is None else rows.cpu()
        if self.cut:
            self.failed = {}
            out = scores.clone()
            for pick, group_ids in by_length(ids, lengths):
                out[pick] = self._exact(group_ids, scores, pick, rows)
            scores = out
        return _apply(self.processors[self.cut:], ids, scores, rows)

    def _exact(self, ids: torch.Tensor, scores: torch.Tensor, pick: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The prefix-reading processors over the entries ``pick`` of ``scores`` (ids: theirs);
        when tolerant and they raise, entry by entry, the failing ones recorded and left as given."""
        exact, picked_rows = self.processors[: self.cut], rows[pick.cpu()]
        try:
            return _apply(exact, ids, scores[pick], picked_rows)
        except Exception:
            if not self.tolerant:
                raise
        out = scores[pick]
        for i, entry in enumerate(pick.tolist()):
            try:
                out[i: i + 1] = _apply(exact, ids[i: i + 1], scores[entry: entry + 1], picked_rows[i: i + 1])
            except Exception as err:  # noqa: BLE001 (the caller's function: any error is its answer)
                self.failed[entry] = err
        return out

    def call_finished(self, ids: torch.Tensor, row: int, vocab: int) -> None:
        """What transformers' step does on batch row ``row`` after it finished: it calls every
        processor on the row's tokens so far, padded (``ids`` (1, W)), and discards the scores. The
        caller's functions among them (:attr:`callers`) are called here, in order, with zero scores
        (V = ``vocab``), so what they raise there — ``prefix_allowed_tokens_fn``'s empty list
        included — propagates as in transformers; transformers' own processors cannot fail there."""
        scores = torch.zeros(1, vocab, device=ids.device)
        for processor in self.callers:
            for_rows(processor, torch.tensor([row]))(ids, scores)

    def take_failed(self, nodes: int) -> dict[tuple[int, int], BaseException]:
        """The last call's failed entries as {(row, slot): error} for trees of ``nodes`` slots."""
        failed, self.failed = self.failed, {}
        return {(entry // nodes, entry % nodes): err for entry, err in failed.items()}


def node_prefixes(history: torch.Tensor, ends: torch.Tensor, tokens: torch.Tensor, path_slots: torch.Tensor,
                  depth: torch.Tensor, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tree node's tokens so far: its row's ``history`` (R, W) — the first ``ends`` (R,)
    columns, the rest ``fill`` — then the drafted path below the root (the root, the last token
    emitted, is already in the history). tokens (R, N); path_slots (N, D+1) or (R, N, D+1);
    depth (N,) or (R, N). → ids (R·N, W + D), right-filled with ``fill``, and their lengths (R·N,)."""
    batch, width = history.shape
    nodes = tokens.shape[1]
    levels = path_slots.shape[-1] - 1
    path_slots = path_slots.to(tokens.device).expand(batch, nodes, levels + 1)
    depth = depth.to(tokens.device).expand(batch, nodes)
    ids = torch.cat([history[:, None, :].expand(batch, nodes, width),
                     history.new_full((batch, nodes, levels), fill)], dim=2)
    if levels:
        path = tokens.gather(1, path_slots[..., 1:].reshape(batch, -1)).view(batch, nodes, levels)
        steps = torch.arange(levels, device=tokens.device)
        below = torch.where(steps < depth[..., None], path.to(ids.dtype), fill)
        ids.scatter_(2, (ends.to(tokens.device)[:, None, None] + steps).expand(batch, nodes, levels), below)
    lengths = ends.to(tokens.device)[:, None] + depth
    return ids.reshape(batch * nodes, -1), lengths.reshape(-1)
