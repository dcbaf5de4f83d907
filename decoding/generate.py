"""The speculative loop and the drop-in ``generate()``.

    prefill → root token
    loop: tree ← policy ; tokens ← heads.propose ; hidden ← base.verify(tree) ;
          path ← accept ; cache.commit(path) ; emit path tokens + bonus ; stop finished rows
"""
from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

import torch

from ..heads import DraftHeads, load_heads
from ..heads.hardware import bf16_native
from .attention import use_packed_sdpa
from .base import dtype_name, fingerprint, lm_logits, load_base, plan_packing, prefill, use_packed_linears
from .cache import KVState
from .head_context import HeadContext
from .limits import InputError, InputTypeError, check_base_path, check_generator, check_input_tensors, parse_dtype, parse_tree_option, warn_context_cut
from .accept import Acceptor, Typical, resolve_acceptance
from .processors import check_sampling_config
from .policy import AdaptivePolicy, CalibrationConfig, best_budget, calibrate
from .output import Emitter, generated_counts
from .drafters import STORE_NAME, Drafter, DraftState, HeadsDrafter, TableCost, build_drafter, check_review, parse_drafts
from .step import PhaseTimer, decode_step
from .tree import Tree, chain_tree, tree_from_paths


#: the quick calibration behind the defaults (:meth:`DraftHeadsModel.calibrate_defaults`):
#: batch size 1 at one context, the stored trees' sizes and the merged drafter's widths
QUICK_CONTEXT = 256
QUICK_CALIBRATION = CalibrationConfig(batch_sizes=(1,), contexts=(QUICK_CONTEXT,), reps=3,
                                      extra_nodes=(3, 5, 9, 17, 33))
#: the share of the checkpoint's expected drafted tokens that open-ended prompts reach (its τ
#: is measured on held-out self-distilled text; on MT-Bench the accepted part measured 0.66-0.88)
DEFAULT_TAU_SCALE = 0.75


class TreePolicy(Protocol):
    """Chooses each step's tree; the batch-adaptive policy and a pinned tree share this whole
    contract: ``choose`` the tree for the live batch (its size is the step's node budget; the
    drafter fills it), ``observe`` what the step accepted (the shape every row ran, None when
    rows ran different trees, and each live row's accepted drafts), and ``max_nodes`` the largest tree it may
    ask for (what the memory check prices)."""

    def choose(self, batch_size: int, context_length: int) -> Tree: ...

    def observe(self, tree: Tree | None, accepted: torch.Tensor) -> None: ...

    def max_nodes(self, batch_size: int, context_length: int) -> int: ...

    def prefers_plain(self, batch_size: int, context_length: int) -> bool: ...


@dataclass
class FixedTree:
    """The pinned strategy: the same tree whatever the batch."""

    tree: Tree

    def choose(self, batch_size: int, context_length: int) -> Tree:
        return self.tree

    def observe(self, tree: Tree | None, accepted: torch.Tensor) -> None:
        """A pinned tree learns nothing."""

    def max_nodes(self, batch_size: int, context_length: int) -> int:
        return self.tree.num_nodes

    def prefers_plain(self, batch_size: int, context_length: int) -> bool:
        return self.tree.num_nodes == 1


def as_policy(tree: Tree | TreePolicy) -> TreePolicy:
    """A Tree → :class:`FixedTree`; a policy must implement the whole :class:`TreePolicy`."""
    if isinstance(tree, Tree):
        return FixedTree(tree)
    missing = [name for name in ("choose", "observe", "max_nodes", "prefers_plain")
               if not callable(getattr(tree, name, None))]
    if missing:
        raise TypeError(f"tree={tree!r} is neither a Tree nor a TreePolicy: it lacks {', '.join(missing)} "
                        "(see draftheads.decoding.generate.TreePolicy).")
    return tree


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

    @property
    def tau(self) -> float:
        return (sum(self.accepted) + len(self.accepted)) / max(1, len(self.accepted))

    def record(self, nodes: int, accepted: torch.Tensor, rows: int) -> None:
        """One verification step: its slots per row, the live rows' accepted drafts (R,), rows verified."""
        self.steps += 1
        self.accepted.extend(accepted.tolist())
        self.tree_nodes.append(nodes)
        self.batch_sizes.append(rows)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "steps": self.steps, "tau": round(self.tau, 4),
                "seconds": round(self.seconds, 4), "tokens_per_second": round(self.tokens_per_second, 3),
                "mean_tree_nodes": round(sum(self.tree_nodes) / max(1, len(self.tree_nodes)), 2),
                "trees_by_batch_size": self.trees_by_batch_size(), "delegated": self.delegated}

    def trees_by_batch_size(self) -> dict[int, dict[int, int]]:
        """{rows verified: {tree nodes: steps}}: what the policy chose as the batch shrank."""
        table: dict[int, dict[int, int]] = {}
        for rows, nodes in zip(self.batch_sizes, self.tree_nodes):
            table.setdefault(rows, {}).setdefault(nodes, 0)
            table[rows][nodes] += 1
        return table


@dataclass
class Request:
    """One ``generate`` call's arguments after merging and checking (see ``DraftHeadsModel._request``)."""

    config: object  # the merged transformers GenerationConfig
    mode: object  # "greedy" | "lossless" | Typical
    eos: list[int]
    pad: int
    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    limits: list[int]  # each row's max new tokens after the context cut
    want_scores: bool

    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1])

    def prompts(self) -> list[list[int]]:
        """Each row's prompt tokens without its padding."""
        return [ids[mask].tolist() for ids, mask in zip(self.input_ids.cpu(), self.attention_mask.cpu().bool())]


# Generation options whose non-default value changes the output and that the greedy tree
# decoder does not implement yet: refused with a clear message, never silently ignored.
_UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None,
    "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None, "force_words_ids": None,
    "min_length": 0, "min_new_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None, "guidance_scale": None,
    "num_return_sequences": 1, "output_attentions": False, "output_hidden_states": False,
    "prompt_lookup_num_tokens": None, "renormalize_logits": False, "exponential_decay_length_penalty": None,
    "max_time": None, "stop_strings": None, "constraints": None, "low_memory": None,
}
_CALL_ARGUMENTS = {"streamer", "stopping_criteria", "generation_config", "attention_mask", "input_ids", "tree",
                   "logits_processor", "use_cache"}


def resolve_generation_config(base_config, generation_config=None, **kwargs):
    """Merge like transformers does (explicit config, then keyword overrides) and refuse
    anything the decoder would otherwise silently ignore."""
    config = copy.deepcopy(generation_config if generation_config is not None else base_config)
    unused = config.update(**kwargs)
    if unused:
        raise InputError(f"generate() got arguments it does not understand: {sorted(unused)}.")
    for name, default in _UNSUPPORTED.items():
        value = getattr(config, name, default)
        if value not in (default, None):
            raise InputError(f"generate(): `{name}={value!r}` is not supported by draftheads yet; "
                             f"leave it at {default!r} or use the base model's own generate().")
    check_sampling_config(config)
    return config


def eos_token_ids(config) -> list[int]:
    """A generation config's EOS id(s) as a list (transformers allows an int or a list)."""
    eos = config.eos_token_id
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):  # transformers accepts a tensor of ids too
        return [int(e) for e in eos.flatten().tolist()]
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


class DraftHeadsModel:
    """A frozen base model plus draft heads, with a ``generate()`` that returns exactly what
    the base's greedy ``generate()`` returns, faster."""

    #: What happens to a row that finished while others decode: ``"shrink"`` drops it from the
    #: batch (cache rows included), ``"mask"`` keeps verifying its (ignored) tree. Shrinking
    #: measured faster (README, "Batched decoding"); ``"mask"`` stays for that comparison.
    finished_rows: str = "shrink"
    #: When the policy says at the start that speculation does not pay for this batch (large
    #: batches; see ``AdaptivePolicy.prefers_plain``), run the base's own ``generate`` instead of
    #: the tree loop with a 1-node tree (vLLM's ``speculative_disable_by_batch_size``). Off by
    #: default: the loop's plain step costs what the base's does (same forward, ~1-2 % of
    #: bookkeeping), and only the loop drops finished rows from the batch (the base's generate
    #: keeps computing them: MT-Bench at bs 16 and 128 tokens averaged 13.7 live rows of 16) and
    #: switches to trees again when the live batch has shrunk to where they pay.
    delegate_plain: bool = False

    def __init__(self, base, heads: DraftHeads | None = None, tokenizer=None, tree: Tree | TreePolicy | None = None,
                 packed_attention: bool = True, packed_linears: bool = True):
        self.base = base
        if packed_attention:  # grouped-query SDPA without copying the KV cache (decoding/attention.py)
            use_packed_sdpa(base)
        if packed_linears:  # oneDNN-packed weights for our forwards only (heads/linear.py)
            use_packed_linears(base)
        self.tokenizer = tokenizer
        self.heads = heads
        if heads is not None:
            attach_heads(heads, base, packed_linears)
        if tree is None:
            tree = default_tree(heads, base.dtype)
        self.policy: TreePolicy = as_policy(tree)
        #: who fills the trees; None: the heads alone (:class:`~.drafter.HeadsDrafter` over ``self.heads``)
        self.drafter: Drafter | None = None
        #: the sources ``drafter`` merges (("heads",) for the heads alone), named in reports
        self.draft_sources: tuple[str, ...] = ("heads",) if heads is not None else ()
        #: this machine's bs-1 step times (:meth:`calibrate_defaults`); None: not measured
        self.step_table: TableCost | None = None
        self._stores: dict = {}  # lookup_store argument → the opened (read-only, mapped) store
        self.last_stats = DecodingStats()

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, heads_path: str | Path | None = None, base=None, tokenizer=None,
                        base_name_or_path: str | None = None, dtype: torch.dtype | str | None = "auto", tree=None,
                        packed_attention: bool = True, packed_linears: bool = True,
                        drafts: str | Sequence[str] = "auto", lookup_store: str | Path | None = None,
                        review: bool = False, calibration: CalibrationConfig | None = None,
                        **hub_kwargs) -> "DraftHeadsModel":
        """Load heads from a local checkpoint directory or a Hub id (``hub_kwargs``: ``revision``,
        ``cache_dir``, ``token``, ``local_files_only``; ``HF_HUB_OFFLINE=1`` reads the cache only)
        and the base they were made for (default: the embedded SmolLM2), in ``dtype``:
        ``"auto"`` (default) is the base's native dtype where the hardware computes it natively
        (bf16 on CPUs with AVX512-BF16/AMX and on GPUs), else float32; an explicit dtype wins.
        The heads are cast to the base's dtype. ``drafts``: who fills the trees — "auto"
        (default: the heads and every lookup source there is data for, see :func:`auto_drafts`),
        "heads" (the heads alone), or any comma-separated mix of heads, context, store, stats (see
        :meth:`use_drafts`); ``lookup_store``: the model store for "store"/"stats" (default: the
        one shipped beside the heads; a store named is opened and checked even when unused);
        ``review``: the heads review lookup drafts (see :meth:`use_drafts`); ``calibration``: the
        grid ``tree="adaptive"`` measures on first use (default: :class:`~.policy.CalibrationConfig`).
        ``tree=None`` (default): the stored tree this machine's quick calibration prices best
        (:meth:`calibrate_defaults`; seconds, once per machine, cached)."""
        tree = parse_tree_option(tree)  # every argument is checked before anything loads
        auto = isinstance(drafts, str) and drafts.strip().lower() == "auto"
        sources = None if auto else parse_drafts(drafts)
        if sources is not None:
            check_review(review, sources)
        check_store_argument(lookup_store)
        if base is None:
            check_base_path(base_name_or_path)
            parse_dtype(dtype)
            base, tokenizer = load_base(base_name_or_path, dtype=dtype)
        if packed_attention:  # before an adaptive tree's calibration, which measures the loop's forward
            use_packed_sdpa(base)
        if packed_linears:
            use_packed_linears(base)
        heads = None
        if heads_path is not None:
            heads = load_heads(heads_path, expected_fingerprint=fingerprint(base).with_sketch(base),
                               base_name=getattr(base, "name_or_path", None) or None, **hub_kwargs)
            attach_heads(heads, base, packed_linears)  # bound before an adaptive tree's calibration drafts with them
        model = cls(base, heads, tokenizer, resolve_tree(tree, base, heads, calibration),
                    packed_attention=packed_attention, packed_linears=packed_linears)
        if tree is None:
            model.calibrate_defaults()
        if auto:
            sources = auto_drafts(heads, lookup_store)
            check_review(review, sources)
        model.use_drafts(sources, lookup_store, review)
        return model

    def calibrate_defaults(self, config: CalibrationConfig | None = None) -> None:
        """Price this machine's step (a quick bs-1 calibration of the verify forward, the loop's
        overhead and the heads' drafting: seconds, once per machine/dtype/torch, cached) and
        take the stored tree it ranks best (step time × the checkpoint's expected τ, its drafted
        part scaled by ``DEFAULT_TAU_SCALE``) as the default, and the same table as the merged
        drafter's width model. Without heads, or with stored trees lacking an expected τ, the
        checkpoint's stored default stays."""
        cost = calibrate(self.base, self.heads, config or QUICK_CALIBRATION)
        self.step_table = TableCost.from_cost_model(cost, QUICK_CONTEXT)
        if self.heads is not None and self.heads.config.trees and self.heads.config.expected_tau:
            budget = best_budget(self.heads, cost, 1, QUICK_CONTEXT, DEFAULT_TAU_SCALE)[0].budget
            self.policy = FixedTree(tree_for_budget(self.heads, budget))

    def use_drafts(self, drafts: str | Sequence[str], lookup_store: str | Path | None = None,
                   review: bool = False) -> None:
        """Choose who fills the trees: "heads" (the checkpoint's heads alone), or a mix of heads
        and lookup sources — "context" (suffix matches in the prompt and the answer so far),
        "store" (matches in the base's own answers, a file shipped beside the heads), "stats"
        (bigram chains from the store) — merged into one tree per row under the cost model
        (:class:`~.drafter.MergedDrafter`). ``lookup_store``: the store file (default:
        ``lookup_store.safetensors`` beside the heads). ``review=True`` (the vertical cascade): the
        heads rescore each lookup draft within their depth before it takes a verification slot
        (their probability of its token joins its calibrated hit rate)."""
        sources = parse_drafts(drafts)
        check_review(review, sources)  # before the store is opened
        check_store_argument(lookup_store)
        self.draft_sources = sources
        store = None
        uses_store = "store" in sources or "stats" in sources
        if uses_store or lookup_store is not None:  # a store named is checked even when these drafts skip it
            key = None if lookup_store is None else str(Path(lookup_store).resolve())
            if key not in self._stores:  # opened and checked once per file, shared by every drafter
                self._stores[key] = open_store(lookup_store, self.heads, self.tokenizer,
                                               self.base.get_input_embeddings().num_embeddings)
            store = self._stores[key] if uses_store else None
        eos = eos_token_ids(self.base.generation_config)
        self.drafter = build_drafter(sources, self.heads, store, self.step_cost(), eos[0] if eos else None, review)

    def step_cost(self):
        """The step-time model the merged drafter sizes trees with: the adaptive policy's
        calibration, else this machine's quick calibration (:meth:`calibrate_defaults`), else the
        checkpoint's stored bs-1 table for this dtype (measured elsewhere), else a linear guess."""
        if isinstance(self.policy, AdaptivePolicy):
            return self.policy.cost
        if self.step_table is not None:
            return self.step_table
        by_dtype = self.heads.config.default_budget_by_dtype if self.heads is not None else {}
        ranked = by_dtype.get(dtype_name(self.base.dtype), {}).get("ranked")
        return TableCost.from_ranked(ranked) if ranked else None

    @property
    def config(self):
        return self.base.config

    @property
    def generation_config(self):
        return self.base.generation_config

    # -- the drop-in generate ----------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, generation_config=None,
                 streamer=None, stopping_criteria=None, generator: torch.Generator | None = None,
                 acceptance: str | Typical | None = None, timer: PhaseTimer | None = None, **kwargs):
        """transformers' ``generate`` arguments; with ``do_sample=True`` also ``generator`` (seeded
        randomness; default: seeded from the global torch RNG) and ``acceptance``: "lossless"
        (default, exactly the base's sampling distribution) or "typical" / ``Typical(ε, δ)``
        (Medusa-2's rule, lossy). See ``draftheads.decoding.accept``. ``timer``: a
        :class:`~draftheads.decoding.step.PhaseTimer` that sums each step phase's time (profiling).

        Returns what transformers returns, with these documented edges: ``scores``/``logits``
        are float32 as there; with ``return_dict_in_generate`` a batch's ``past_key_values`` and
        the scores of rows that finished early come from one extra forward over the output
        (equal up to float rounding); an answer that would pass ``max_position_embeddings``
        stops there with a ``UserWarning`` (transformers continues). Bad inputs raise
        :class:`~draftheads.decoding.limits.InputError` before any work."""
        check_generator(generator)
        request = self._request(input_ids, attention_mask, generation_config, streamer, acceptance, kwargs)
        started = time.perf_counter()
        if self._delegates(request.batch, request.prompt_len, generator):
            return self._plain_generate(request, streamer, stopping_criteria, started)
        out = Emitter(request.input_ids, request.limits, request.eos, stopping_criteria, streamer, request.want_scores)
        cache, hidden = prefill(self.base, request.input_ids, request.attention_mask)
        kv = KVState.after_prefill(cache, request.attention_mask)
        logits = lm_logits(self.base, hidden)  # (B, V)
        acceptor = Acceptor(request.config, request.mode, logits.shape[-1], request.input_ids, request.attention_mask,
                            out.generated, generator)
        roots = acceptor.first(logits)
        out.emit_first(roots, acceptor.reported(logits) if request.want_scores else None)
        drafter = self.drafter if self.drafter is not None else HeadsDrafter(self.heads)
        drafter.start(request.prompts())
        stats = self._decode(out, acceptor, drafter, kv, HeadContext(self.heads, hidden), roots, timer)
        stats.new_tokens, stats.seconds = out.new_tokens, time.perf_counter() - started
        self.last_stats = stats
        sequences = out.sequences(request.pad)
        if not request.config.return_dict_in_generate:
            return sequences
        return out.dict_output(self.base, sequences, request.attention_mask, request.config, kv, acceptor,
                               logits.shape[-1])

    def _decode(self, out: Emitter, acceptor: Acceptor, drafter: Drafter, kv: KVState, context: HeadContext,
                roots: torch.Tensor, timer: PhaseTimer | None) -> DecodingStats:
        """The loop: choose a tree for the live rows, run one :func:`decode_step`, emit what each
        row accepted; finished rows leave the batch (``finished_rows="shrink"``). roots (B,)."""
        stats, live, device = DecodingStats(), torch.arange(roots.shape[0]), roots.device
        while bool((running := out.running(live)).any()):
            if not bool(running.all()) and self.finished_rows == "shrink":
                keep = running.nonzero().squeeze(1)  # finished rows leave: no compute for their trees
                live, roots = live[keep], roots[keep]
                kv.select_rows(keep.to(device))
                context.select_rows(keep.to(device))
            active = out.running(live).to(device)  # all True when shrinking; finished rows masked otherwise
            tree = self.policy.choose(live.numel(), kv.length)
            state = DraftState(roots, context.hidden, live.tolist(), _rooms(out, live), kv.length, out.generated)
            step = decode_step(self.base, drafter, acceptor, kv, context, state, tree, timer)
            result = step.acceptance
            self.policy.observe(step.drafts.shape, result.accepted[active])
            stats.record(step.drafts.num_nodes, result.accepted[active], live.numel())
            out.emit_step(live, step.tokens, result.path, result.accepted, result.bonus,
                          acceptor.reported(step.logits) if out.want_scores else None)
            roots = result.bonus
        return stats

    def _request(self, input_ids, attention_mask, generation_config, streamer, acceptance, kwargs) -> "Request":
        """Every argument merged and checked, before any work."""
        config = resolve_generation_config(self.base.generation_config, generation_config, **kwargs)
        mode = resolve_acceptance(config, acceptance)
        eos = eos_token_ids(config)
        # transformers' fallback: no pad_token_id → the first EOS id (and no padding inference)
        pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
        input_ids, attention_mask = _check_inputs(input_ids, attention_mask, self.base, pad, eos,
                                                  pad_given=config.pad_token_id is not None)
        batch, prompt_len = input_ids.shape
        if streamer is not None and batch > 1:
            raise InputError("generate(): a streamer needs batch size 1 (as in transformers).")
        wanted = _wanted_new_tokens(config, prompt_len)
        check_memory(self.base, batch, prompt_len, min(wanted, self.base.config.max_position_embeddings),
                     self.policy.max_nodes(batch, prompt_len))
        context = self.base.config.max_position_embeddings
        limits = [min(wanted, context - int(n)) for n in attention_mask.sum(1)]
        warn_context_cut(wanted, limits, context)
        want_scores = bool(config.return_dict_in_generate and (config.output_scores or config.output_logits))
        # no pad and no EOS: no row ends early, the pad value never shows
        return Request(config, mode, eos, 0 if pad is None else pad, input_ids, attention_mask, limits, want_scores)

    def _delegates(self, batch: int, prompt_len: int, generator) -> bool:
        """Plain decoding by the base itself: the policy prefers it for this batch, and nothing
        asked for what only the loop provides (a ``torch.Generator`` for seeded sampling)."""
        return bool(self.delegate_plain and generator is None and self.policy.prefers_plain(batch, prompt_len))

    def _plain_generate(self, request: "Request", streamer, stopping_criteria, started: float):
        """The base's own ``generate`` with the same (already checked) arguments; its output is
        the reference itself, so greedy identity and sampling's distribution hold trivially."""
        output = self.base.generate(request.input_ids, attention_mask=request.attention_mask,
                                    generation_config=request.config, streamer=streamer,
                                    stopping_criteria=stopping_criteria)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        counts = generated_counts(sequences, request.prompt_len, set(request.eos))
        steps = max(counts, default=0)
        self.last_stats = DecodingStats(new_tokens=sum(counts), steps=steps, accepted=[0] * sum(counts),
                                        seconds=time.perf_counter() - started, tree_nodes=[1] * steps,
                                        batch_sizes=[request.batch] * steps, delegated=True)
        return output


def attach_heads(heads: DraftHeads, base, packed_linears: bool = True) -> None:
    """Bind heads to the base's frozen LM head and embeddings, in its dtype, drafting as the
    loop will (idempotent): done before anything drafts with them — the loop, and the
    calibration of ``tree="adaptive"``, which measures ``heads.propose``."""
    heads.bind(base.get_output_embeddings().weight, base.get_input_embeddings().weight)
    heads.to(base.dtype)
    heads.draft_dtype = drafting_dtype(base)
    if packed_linears:
        heads.use_packed_readout()
        plan_packing([heads.draft_weight(heads.draft_dtype)] + [p for p in heads.parameters() if p.dim() == 2])


def check_store_argument(lookup_store) -> None:
    """``lookup_store=``: None (the store shipped beside the heads) or a path."""
    if lookup_store is not None and not isinstance(lookup_store, (str, Path)):
        raise InputTypeError(f"lookup_store must be a path to a lookup store file (str or Path) or None (the one "
                             f"shipped beside the heads), got {type(lookup_store).__name__} {lookup_store!r}.")


def open_store(path: str | Path | None, heads: DraftHeads | None, tokenizer, vocab: int | None = None):
    """The model store at ``path`` (default: beside the heads), checked against the tokenizer
    and every id against ``vocab`` (the base's embedding rows)."""
    from .drafters import ModelStore, StoreError, tokenizer_identity

    if path is None:
        folder = getattr(heads, "source_dir", None)
        if folder is None or not (Path(folder) / STORE_NAME).is_file():
            raise StoreError(f"No {STORE_NAME} beside the heads ({folder}): build one with `python scripts/build_store.py "
                             f"--data <the base's answers.jsonl> --out <heads dir>/{STORE_NAME}` or pass lookup_store=.")
        path = Path(folder) / STORE_NAME
    return ModelStore.open(path, expect=tokenizer_identity(tokenizer) if tokenizer is not None else None,
                           vocab_limit=vocab)


def auto_drafts(heads: DraftHeads | None, lookup_store: str | Path | None = None) -> tuple[str, ...]:
    """``drafts="auto"``: the heads (when loaded), the context, and the store and its bigram
    statistics when there is a store (``lookup_store``, or one shipped beside the heads).
    Measured faster than the heads alone on every Spec-Bench category (README, Figures): the
    merged tree spends each step's slots on whichever source is likelier to be accepted."""
    has_store = lookup_store is not None or (
        getattr(heads, "source_dir", None) is not None and (Path(heads.source_dir) / STORE_NAME).is_file())
    return (("heads",) if heads is not None else ()) + ("context",) + (("store", "stats") if has_store else ())


def _rooms(out: Emitter, live: torch.Tensor) -> list[int]:
    """Each live row's deepest usable draft (tokens it may still emit − 1); a finished row kept
    in the batch (``finished_rows="mask"``) gets the live rows' smallest, so it never shrinks
    their tree."""
    rooms = out.rooms(live)
    floor = min((r for r in rooms if r > 0), default=1)
    return [max(r, floor) - 1 for r in rooms]


def drafting_dtype(base) -> torch.dtype | None:
    """The dtype heads read out their drafts in. A float32 base on a CPU with native bf16
    drafts in bf16: the draft readout (a (P, d) × (d, V_draft) product) is memory-bound and
    fp32 GEMMs with a few rows are slow here (measured 1.5–8.7 ms vs 1.1–1.5 ms for P = 1–8
    rows × 8,192 tokens, one thread). Drafts only propose: verification stays in the base's
    dtype, so outputs do not change. Other dtypes/devices draft in the base's dtype."""
    param = next(base.parameters())
    if param.dtype == torch.float32 and param.device.type == "cpu" and bf16_native():
        return torch.bfloat16
    return None


def resolve_tree(tree, base, heads: DraftHeads | None, calibration: CalibrationConfig | None = None):
    """``from_pretrained``'s ``tree``: None (the checkpoint's default budget), an int node
    budget, ``"adaptive"`` (the batch-size-adaptive policy on this machine's calibrated cost
    model: measured once, ~1-2 min on 2 CPU cores, then cached), a Tree or any TreePolicy."""
    if isinstance(tree, str):
        if tree.strip().lower() != "adaptive":
            try:
                tree = int(tree)
            except ValueError:
                raise InputError(f"tree={tree!r}: expected 'adaptive' or a node budget (an integer).") from None
        elif heads is None:
            return chain_tree(0)
        else:
            cost = calibrate(base, heads, calibration or CalibrationConfig())
            return AdaptivePolicy.from_heads(heads, cost)
    if isinstance(tree, int) and not isinstance(tree, bool):
        return tree_for_budget(heads, tree)
    return tree


def default_budget(heads: DraftHeads, dtype: torch.dtype | None = None) -> int:
    """The checkpoint's default node budget for a base in ``dtype``: the one the cost model chose
    for that dtype (``default_budget_by_dtype``, written by ``scripts/default_trees.py`` from a
    calibration × the heads' expected τ), else its dtype-independent ``default_budget``."""
    by_dtype = heads.config.default_budget_by_dtype
    if dtype is not None and dtype_name(dtype) in by_dtype:
        return int(by_dtype[dtype_name(dtype)]["budget"])
    return int(heads.config.default_budget)


def default_tree(heads: DraftHeads | None, dtype: torch.dtype | None = None) -> Tree:
    """The checkpoint's tree for the default budget in ``dtype``, or plain decoding without heads."""
    if heads is None:
        return chain_tree(0)
    return tree_for_budget(heads, default_budget(heads, dtype))


def tree_for_budget(heads: DraftHeads | None, budget: int) -> Tree:
    if heads is None or budget <= 0:
        return chain_tree(0)
    trees = heads.config.trees
    if trees:
        fitting = [int(k) for k in trees if int(k) <= budget]
        if not fitting:
            raise InputError(f"No stored tree fits a budget of {budget} nodes; stored budgets: {sorted(map(int, trees))}.")
        tree = tree_from_paths(trees[str(max(fitting))])
    else:
        tree = chain_tree(min(budget, heads.num_heads))
    heads.check_tree(tree.spec)
    return tree


def _check_inputs(input_ids, attention_mask, base, pad: int | None, eos: list[int], pad_given: bool = True):
    input_ids, attention_mask = check_input_tensors(input_ids, attention_mask, base)
    if input_ids.shape[1] == 0:
        raise InputError("generate(): the prompt is empty; pass at least one token.")
    batched = input_ids.shape[0] > 1
    if attention_mask is None and batched and not pad_given and eos:
        warnings.warn("generate(): the attention mask and the pad token id were not set, with a batched input; "
                      f"padding falls back to EOS id {pad} as in transformers, so padding cannot be told from text. "
                      "Pass the tokenizer's attention_mask.", UserWarning, stacklevel=3)
    if attention_mask is None and batched and pad is not None and bool((input_ids[:, -1] == pad).any()):
        # the same warning transformers gives (the pad id may equal EOS, so it cannot be sure)
        warnings.warn("generate(): a decoder-only architecture is being used, but right-padding was detected! "
                      "For correct generation results, please set `padding_side='left'` when initializing the "
                      "tokenizer (and pass its attention_mask).", UserWarning, stacklevel=3)
    if attention_mask is None:
        # transformers' rule: infer padding from pad_token_id unless pad is also an EOS token
        infer = pad is not None and bool((input_ids == pad).any()) and pad not in eos
        attention_mask = (input_ids != pad).long() if infer else torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise InputError(f"generate(): attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}.")
    if bool((attention_mask.sum(1) == 0).any()):
        raise InputError("generate(): a prompt in the batch is empty (all padding).")
    if bool((attention_mask[:, -1] == 0).any()):
        raise InputError("generate(): the batch is right-padded; decoder-only generation needs left padding "
                         "(tokenizer.padding_side = 'left').")
    limit = base.config.max_position_embeddings
    if int(attention_mask.sum(1).max()) >= limit:
        raise InputError(f"generate(): the prompt has {int(attention_mask.sum(1).max())} tokens, at or over the "
                         f"model's context limit of {limit}; shorten it.")
    return input_ids, attention_mask


def _available_memory_bytes(device: torch.device) -> int | None:
    """Free memory where the cache will live (None when it cannot be told)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            with open("/proc/meminfo", encoding="ascii") as handle:
                for line in handle:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def decode_memory_bytes(config, batch: int, width: int, new_tokens: int, tree_nodes: int,
                        bytes_per_value: int) -> dict[str, int]:
    """Upper estimate of what decoding a batch allocates, from the model config alone: the KV
    cache at its longest (prompt + new tokens + one tree per row), the prefill's activations
    (hidden states, MLP, the 4D mask and attention scores of a width × width prompt) and the
    verification logits (tree nodes × vocabulary per row)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    inter = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    kv = 2 * config.num_hidden_layers * kv_heads * head_dim * batch * (width + new_tokens + tree_nodes) * bytes_per_value
    prefill_act = batch * width * (4 * config.hidden_size + 3 * inter) * bytes_per_value \
        + batch * (heads + 1) * width * width * bytes_per_value
    verify_act = batch * tree_nodes * (config.vocab_size + 4 * config.hidden_size + 3 * inter) * bytes_per_value
    return {"kv_cache": kv, "activations": max(prefill_act, verify_act), "total": kv + max(prefill_act, verify_act)}


def check_memory(base, batch: int, width: int, new_tokens: int, tree_nodes: int) -> None:
    """Refuse, before any work, a batch whose estimated footprint exceeds the free memory."""
    param = next(base.parameters())
    free = _available_memory_bytes(param.device)
    if free is None:
        return
    need = decode_memory_bytes(base.config, batch, width, new_tokens, tree_nodes, param.element_size())
    if need["total"] > 0.9 * free:
        per_row = max(1, need["total"] // batch)
        gib = 1 << 30
        raise MemoryError(
            f"generate(): a batch of {batch} × {width}-token prompts with {new_tokens} new tokens needs about "
            f"{need['total'] / gib:.1f} GiB (KV cache {need['kv_cache'] / gib:.1f} GiB + activations "
            f"{need['activations'] / gib:.1f} GiB) but only {free / gib:.1f} GiB is free on {param.device}; "
            f"split it into batches of at most {max(1, int(0.9 * free) // per_row)} rows or lower max_new_tokens.")


def _wanted_new_tokens(config, prompt_len: int) -> int:
    """``max_new_tokens``, else ``max_length`` minus the (padded) prompt width, as transformers."""
    if config.max_new_tokens is not None:
        if config.max_new_tokens <= 0:
            raise InputError(f"generate(): max_new_tokens must be positive, got {config.max_new_tokens}.")
        return config.max_new_tokens
    wanted = config.max_length - prompt_len
    if wanted <= 0:
        raise InputError(f"generate(): max_length={config.max_length} leaves no room after a {prompt_len}-token "
                         "prompt; set max_new_tokens.")
    return wanted


