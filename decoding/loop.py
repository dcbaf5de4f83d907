"""The speculative loop, from a checked :class:`~.request.Request` to what ``generate`` returns:

    prefill → root token per row
    loop: tree ← policy ; decode_step (drafter.propose → base.verify → accept → cache.commit →
          heads' state, drafter.observe) ; emit path + bonus per row ; finished rows leave
    assemble the output

and the plain path where the policy hands the whole call to the base's own ``generate``.
What one call did is a :class:`DecodingStats` (τ, steps, trees by batch size).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from .accept import Acceptor
from .base.forward import final_states, lm_logits, prefill
from .base.cache import KVState
from .base.key_blocks import grouped_order
from .drafters import Drafter, DraftState
from .head_state import HeadState, taps_of
from .output import Emitter, StopReplay, generated_counts
from .request import Request, score_readers
from .sequences import Sequences
from .step import PhaseTimer, decode_step


def tau(accepted: int, steps: int) -> float:
    """τ: the mean number of tokens a row's verification step emits — its accepted drafts + the
    bonus token — from the accepted drafts summed over ``steps`` (row, step) pairs. The one
    formula every report uses (a whole run's output-side count is ``bench.summary.run_tau``)."""
    return (accepted + steps) / max(1, steps)


def decode_rate(new_tokens: int, first_tokens: int, seconds: float, prefill_seconds: float) -> float:
    """Decode-phase tokens per second: the tokens after each row's first, over the time after
    the prefill. Every strategy and transformers pay the same prefill, which on long prompts in
    a batch is most of a run, so end-to-end rates hide what decoding gains; 0 without a decode
    phase. evidence: results/batch/batch_phases_bf16"""
    decode_seconds = seconds - prefill_seconds
    return (new_tokens - first_tokens) / decode_seconds if decode_seconds > 0 else 0.0


class FirstTokenClock:
    """A transformers logits processor that changes nothing and notes when ``generate`` first
    calls it — right after the prompt's forward — so the base's own ``generate`` reports its
    prefill time like the loop does (``generate(..., logits_processor=[clock])``)."""

    def __init__(self):
        self.first: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first is None:
            self.first = time.perf_counter()
        return scores

    def since(self, started: float) -> float:
        """Seconds from ``started`` to the first call (0 when it never came)."""
        return self.first - started if self.first is not None else 0.0


def ms_per_step(seconds: float, steps: int) -> float:
    """Milliseconds a step (0 without steps)."""
    return 1e3 * seconds / steps if steps else 0.0


@dataclass
class DecodingStats:
    """What one ``generate`` call did: τ is the mean number of tokens emitted per base
    verification forward (accepted drafts + the bonus token)."""

    new_tokens: int = 0
    steps: int = 0
    accepted: list[int] = field(default_factory=list)
    seconds: float = 0.0
    tree_nodes: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)  # rows verified per step (the policy's input)
    delegated: bool = False  # the policy chose plain decoding and the base's own generate ran
    #: seconds from the call's start to every row's first token (checks, the prompt's forward,
    #: its LM head): the compute-bound phase every strategy and transformers pay alike
    prefill_seconds: float = 0.0
    #: tokens that phase produced (one per row); the rest came from decoding steps
    first_tokens: int = 0
    #: seconds the drafter spent proposing, over all steps (what drafting costs beside the forward)
    drafting_seconds: float = 0.0

    @property
    def tau(self) -> float:
        return tau(sum(self.accepted), len(self.accepted))

    def record(self, nodes: int, accepted: torch.Tensor, rows: int) -> None:
        """One verification step: its slots per row, the live rows' accepted drafts (R,), rows verified."""
        self.steps += 1
        self.accepted.extend(accepted.tolist())
        self.tree_nodes.append(nodes)
        self.batch_sizes.append(rows)

    @property
    def drafting_ms_per_step(self) -> float:
        return ms_per_step(self.drafting_seconds, self.steps)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second after the prefill: what drafting can speed up (see :func:`decode_rate`)."""
        return decode_rate(self.new_tokens, self.first_tokens, self.seconds, self.prefill_seconds)

    def to_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "steps": self.steps, "tau": round(self.tau, 4),
                "seconds": round(self.seconds, 4), "tokens_per_second": round(self.tokens_per_second, 3),
                "prefill_seconds": round(self.prefill_seconds, 4),
                "drafting_ms_per_step": round(self.drafting_ms_per_step, 3),
                "decode_tokens_per_second": round(self.decode_tokens_per_second, 3),
                "mean_tree_nodes": round(sum(self.tree_nodes) / max(1, len(self.tree_nodes)), 2),
                "trees_by_batch_size": self.trees_by_batch_size(), "delegated": self.delegated}

    def trees_by_batch_size(self) -> dict[int, dict[int, int]]:
        """{rows verified: {tree nodes: steps}}: what the policy chose as the batch shrank."""
        table: dict[int, dict[int, int]] = {}
        for rows, nodes in zip(self.batch_sizes, self.tree_nodes):
            table.setdefault(rows, {}).setdefault(nodes, 0)
            table[rows][nodes] += 1
        return table


def _rooms(out: Emitter, live: torch.Tensor) -> list[int]:
    """Each live row's deepest usable draft (tokens it may still emit − 1); a finished row kept
    in the batch (``finished_rows="mask"``) gets the live rows' smallest, so it never shrinks
    their tree."""
    rooms = out.rooms(live)
    floor = min((r for r in rooms if r > 0), default=1)
    return [max(r, floor) - 1 for r in rooms]


def speculate(base, heads, policy, drafter: Drafter, request: Request, started: float, generator=None,
              streamer=None, timer: PhaseTimer | None = None, shrink: bool = True):
    """Prefill, the loop, the output: ``(what generate returns, DecodingStats)``. ``shrink``:
    finished rows leave the batch (else their trees are verified and ignored)."""
    sequences = Sequences(request.input_ids, request.attention_mask)  # the one owner of the tokens
    vocab = base.get_output_embeddings().weight.shape[0]
    out = Emitter(sequences, request.limits, request.eos, stop_replay(request, vocab), streamer, request.want_scores)
    # every prompt position's state (B, T, d), computed by the forward anyway: heads that read the
    # prompt and a listener (training's capture) take them; the rest only the last one's
    # (with the layers multi-layer heads read beside the final state: features, :func:`with_taps`)
    taps = taps_of(heads)
    cache, states = prefill(base, request.input_ids, request.attention_mask, all_states=True, taps=taps)
    hidden = final_states(states[:, -1], states.shape[-1] // (1 + len(taps)))  # (B, d)
    kv = KVState.after_prefill(cache, request.attention_mask)
    logits = lm_logits(base, hidden)  # (B, V)
    acceptor = Acceptor(request.config, request.mode, logits.shape[-1], sequences, generator, request.processors)
    roots = acceptor.first(logits)
    # after the first tokens: heads that pair each state with the token after it read them (EAGLE-3)
    heads_state = HeadState(heads, states[:, -1].clone(), states, request.attention_mask, request.input_ids, roots)
    del states  # not kept past the prefill
    out.emit_first(roots, acceptor.reported(logits) if request.want_scores else None)
    prefilled = time.perf_counter()
    drafter.start(sequences.prompts())
    with acceptor.processors.tolerating():  # drafted prefixes may fail (NodeProcessors)
        stats = decode(base, policy, sequences, out, acceptor, drafter, kv, heads_state, roots, timer, shrink)
    stats.prefill_seconds, stats.first_tokens = prefilled - started, request.batch
    stats.new_tokens, stats.seconds = sequences.new_tokens, time.perf_counter() - started
    assembled = out.finish(request.pad)
    if not request.config.return_dict_in_generate:
        return assembled, stats
    return out.dict_output(base, assembled, request.attention_mask, request.config, kv, acceptor,
                           logits.shape[-1]), stats


def stop_replay(request: Request, vocab: int) -> StopReplay | None:
    """transformers' steps as the tree loop replays them (:class:`~.output.StopReplay`): the
    call's stopping criteria besides length and EOS, and in a batch the caller's processor
    functions on rows that finished (over ``vocab`` ids), called as transformers calls them
    (None: nothing to call). transformers pads rows that finished when any of its criteria has an
    ``eos_token_id`` (``has_eos_stopping_criteria``)."""
    callers = request.processors.callers if request.batch > 1 else []
    if not request.criteria and not callers:
        return None
    pads = bool(request.eos) or any(hasattr(c, "eos_token_id") for c in request.criteria)
    finished_calls = functools.partial(request.processors.call_finished, vocab=vocab) if callers else None
    return StopReplay(request.criteria, request.input_ids, request.pad, pads,
                      bool(score_readers(request.criteria, request.config)), finished_calls)


def decode(base, policy, sequences: Sequences, out: Emitter, acceptor: Acceptor, drafter: Drafter, kv: KVState, heads_state: HeadState,
           roots: torch.Tensor, timer: PhaseTimer | None = None, shrink: bool = True) -> DecodingStats:
    """The loop: choose a tree for the live rows, run one :func:`decode_step`, emit what each
    row accepted; finished rows leave the batch when ``shrink``. roots (B,)."""
    stats, live, device = DecodingStats(), torch.arange(roots.shape[0]), roots.device
    order = grouped_order(kv.valid)  # rows hiding the same leading key blocks side by side (.base.key_blocks)
    if order is not None:  # (a CPU cache only)
        live, roots = live[order], roots[order]
        kv.select_rows(order)
        heads_state.select_rows(order)
    while bool((running := out.running(live)).any()):
        if not bool(running.all()) and shrink:
            keep = running.nonzero().squeeze(1)  # finished rows leave: no compute for their trees
            live, roots = live[keep], roots[keep]
            kv.select_rows(keep.to(device))
            heads_state.select_rows(keep.to(device))
        active = out.running(live).to(device)  # all True when shrinking; finished rows masked otherwise
        tree = policy.choose(live.numel(), kv.length)
        state = DraftState(roots, heads_state.hidden, live.tolist(), _rooms(out, live), kv.length,
                           sequences.generated, heads_state.draft_context())
        step = decode_step(base, drafter, acceptor, kv, heads_state, state, tree, timer)
        result = step.acceptance
        policy.observe(step.trees.chosen, result.accepted[active])
        stats.record(step.trees.num_nodes, result.accepted[active], live.numel())
        stats.drafting_seconds += step.drafting_seconds
        failed = acceptor.processors.take_failed(step.tokens.shape[1]) if acceptor.processors.tolerant else None
        out.emit_step(live, step.tokens, result.path, result.accepted, result.bonus,
                      acceptor.reported(step.logits) if out.want_scores else None, failed)
        roots = result.bonus
    return stats


def plain_generate(base, request: Request, started: float, streamer=None):
    """The base's own ``generate`` with the same (already checked) arguments — the caller's own
    processors and criteria included (``request.plain``), or, for what transformers handed a
    ``custom_generate``, its own decoding loop over them (``request.own_loop``) — its output is
    the reference itself, so greedy identity and sampling's distribution hold trivially.
    ``(what generate returns, DecodingStats)``."""
    clock = FirstTokenClock()
    if request.plain is None:
        output = request.own_loop([clock])
    else:
        own = dict(request.plain)
        own["logits_processor"] = [*own["logits_processor"], clock]
        output = base.generate(request.input_ids, attention_mask=request.attention_mask,
                               generation_config=request.config, streamer=streamer, **own)
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    counts = generated_counts(sequences, request.prompt_len, set(request.eos))
    steps = max(counts, default=0)
    stats = DecodingStats(new_tokens=sum(counts), steps=steps, accepted=[0] * sum(counts),
                          seconds=time.perf_counter() - started, tree_nodes=[1] * steps,
                          batch_sizes=[request.batch] * steps, delegated=True, prefill_seconds=clock.since(started),
                          first_tokens=request.batch if steps else 0)
    return output, stats
