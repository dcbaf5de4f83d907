"""``DraftHeadsModel``: load a base and its heads, hold how they decode, and the drop-in
``generate()``. The rest lives in modules named for it: the options (:mod:`.config`), the
policy and the drafter built from them (:mod:`.builder`), the request and its checks
(:mod:`.request`, :mod:`.input_checks`, :mod:`.memory`), the loop (:mod:`.loop`, one step in :mod:`.step`), the tree
policies (:mod:`.policy`), the drafters (:mod:`.drafters`).
"""
from __future__ import annotations

import copy
import time
import warnings
import weakref
from pathlib import Path
from typing import Sequence

import torch

from ..heads import DraftHeads, load_heads
from ..heads.fusion import feature_layer_problem
from .accept import Typical
from .base.binding import wearing
from .base.hardware import bf16_native
from .base.loading import load_base
from .base.packing import base_weights, holding_packing, plan_packing, refresh_heads, refresh_packing, use_packed_heads
from .base.prepare import prepare_base
from .calibration import CalibrationConfig
from .builder import Decoding, StepCosts, Stores, build_decoding, measure_step_costs
from .config import AUTO, DecodingConfig, TreeOption, decoding_config, split_options
from .drafters import Drafter, parse_sources
from .base.fingerprint import fingerprint
from ..core.errors import CheckpointError, InputError
from .base.loading import check_base_path
from .input_checks import check_generator
from .base.dtypes import parse_dtype
from .loop import DecodingStats, plain_generate, speculate
from .output import loop_mode, released
from .policy import AdaptivePolicy, TreePolicy
from .request import Call, Request, check_own_loop, make_request, prepare_call, token_by_token
from .step import PhaseTimer

class DraftHeadsModel:
    """A frozen base model plus draft heads, with a ``generate()`` that returns exactly what
    the base's greedy ``generate()`` returns, faster."""

    def __init__(self, base, heads: DraftHeads | None = None, tokenizer=None, tree: TreeOption = None,
                 decoding: DecodingConfig | None = None, machine_defaults: bool = False, **options):
        """``decoding`` (default: :class:`~.config.DecodingConfig`'s defaults) with ``tree`` and
        the keyword ``options`` (its fields: ``packed_attention=False``, ...) applied over it.
        The base is prepared once (:func:`~.base.prepare.prepare_base`), the heads bound to it,
        then the policy and the drafter built whole (:func:`~.builder.build_decoding`).
        ``machine_defaults`` (what :meth:`from_pretrained` passes): ``tree=None`` takes the stored
        tree this machine's quick calibration prices best (:func:`~.builder.measure_step_costs`)
        and ``sources="auto"`` every source there is data for; without it, the checkpoint's
        stored default tree and, for "auto", the heads alone."""
        if tree is not None:
            options["tree"] = tree
        config = decoding_config(decoding, **options)
        self.base = base
        prepare_base(base, config.packed_attention, config.packed_linears, config.direct_body)
        self.tokenizer = tokenizer
        self.heads = heads
        if heads is not None:
            attach_heads(heads, base, config.packed_linears)  # bound before a calibration drafts with them
        measure = machine_defaults and config.tree is None
        #: this machine's bs-1 step costs (empty: not measured), shared by :meth:`with_decoding`'s models
        self.step_costs: StepCosts = measure_step_costs(base, heads) if measure else StepCosts()
        self._auto_sources = machine_defaults
        self._stores = Stores()  # lookup_store argument → the opened store, shared by every build
        self._decoding: Decoding = self._build(config)
        self.last_stats = DecodingStats()

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, heads_path: str | Path | None = None, base=None, tokenizer=None,
                        base_name_or_path: str | None = None, dtype: torch.dtype | str | None = "auto",
                        decoding: DecodingConfig | None = None, **kwargs) -> "DraftHeadsModel":
        """Load heads from a local checkpoint directory or a Hub id and the base they were made
        for (default: the embedded SmolLM2), in ``dtype``: ``"auto"`` (default) is the base's
        native dtype where the hardware computes it natively (bf16 on CPUs with AVX512-BF16/AMX
        and on GPUs), else float32; an explicit dtype wins. The heads are cast to the base's dtype.

        ``decoding``: a :class:`~.config.DecodingConfig`; ``kwargs`` that name its fields are
        applied over it (``tree``, ``sources``, ``lookup_store``, ``review``, ``calibration``,
        ``packed_attention``, ``packed_linears``, ``direct_body``, ``finished_rows``, ``delegate_plain``,
        ``merged_offer_scale``, ``heads_offer_scale``, ``per_row_counts``; see :mod:`.config`), the
        others go to the Hub (``revision``, ``cache_dir``, ``token``, ``local_files_only``;
        ``HF_HUB_OFFLINE=1`` reads the cache only). ``sources="auto"`` (default): the heads and
        every lookup source there is data for (:func:`auto_sources`); ``tree=None`` (default): the
        stored tree this machine's quick calibration prices best (seconds, once per machine, cached)."""
        options, hub_kwargs = split_options(kwargs)
        config = decoding_config(decoding, **options)  # every option is checked before anything loads
        if base is None:
            check_base_path(base_name_or_path)
            parse_dtype(dtype)
            base, tokenizer = load_base(base_name_or_path, dtype=dtype)
        prepare_base(base, config.packed_attention, config.packed_linears, config.direct_body)  # refused before the heads load
        heads = None
        if heads_path is not None:
            heads = load_heads(heads_path, expected_fingerprint=fingerprint(base).with_sketch(base),
                               base_name=getattr(base, "name_or_path", None) or None, **hub_kwargs)
        return cls(base, heads, tokenizer, decoding=config, machine_defaults=True)

    # -- how it decodes: one home, built by decoding/builder.py ------------------------------
    @property
    def decoding(self) -> DecodingConfig:
        """The options this model decodes with (:mod:`.config`); another: :meth:`with_decoding`."""
        return self._decoding.config

    @property
    def policy(self) -> TreePolicy:
        """The tree policy: which tree each step verifies."""
        return self._decoding.policy

    @property
    def drafter(self) -> Drafter:
        """Who fills the trees (:class:`~.drafters.HeadsDrafter` for the heads alone)."""
        return self._decoding.drafter

    @property
    def sources(self) -> tuple[str, ...]:
        """The sources the drafter merges (("heads",) for the heads alone), named in reports."""
        return self._decoding.sources

    def max_nodes(self, batch_size: int, context_length: int) -> int:
        """The most slots a row's step may verify, root included (what the memory check prices)."""
        return self._decoding.max_nodes(batch_size, context_length)

    def drafting_summary(self) -> dict:
        """What fills the trees: the sources, the heads' tree, the widest step, and in merged
        drafting how often the heads proposed in the last call."""
        return self._decoding.summary()

    def with_decoding(self, decoding: DecodingConfig | None = None, drafter: Drafter | None = None,
                      **options) -> "DraftHeadsModel":
        """A light model over the same base, heads, stores and step costs that decodes with
        ``decoding`` (default: this model's) and the keyword ``options`` applied over it; this
        model is unchanged. ``drafter``: a drafter of your own (any :class:`~.drafters.Drafter`).
        The base's preparation is this model's: ``packed_attention`` / ``packed_linears`` /
        ``direct_body`` that differ from it are refused (build another model with :meth:`from_pretrained`)."""
        config = decoding_config(decoding if decoding is not None else self.decoding, **options)
        for name in ("packed_attention", "packed_linears", "direct_body"):
            if getattr(config, name) != getattr(self.decoding, name):
                raise InputError(f"with_decoding({name}={getattr(config, name)}): the base was prepared with "
                                 f"{name}={getattr(self.decoding, name)}; build another model "
                                 f"(DraftHeadsModel.from_pretrained(..., {name}=...)) to change it.")
        twin = copy.copy(self)
        twin._decoding, twin.last_stats = self._build(config, drafter=drafter), DecodingStats()
        return twin

    def calibrate_defaults(self, config: CalibrationConfig | None = None) -> None:
        """Price this machine's step again (:func:`~.builder.measure_step_costs`) and rebuild how
        this model decodes on it (the default tree for ``tree=None``, the merged drafter's width model)."""
        self.step_costs = measure_step_costs(self.base, self.heads, config)
        self._decoding = self._build(self.decoding)

    def use_sources(self, sources: str | Sequence[str], lookup_store: str | Path | None = None,
                    review: bool = False) -> None:
        """Choose who fills the trees: "heads" (the checkpoint's heads alone), or a mix of heads
        and lookup sources — "context" (suffix matches in the prompt and the answer so far),
        "store" (matches in the base's own answers, a file shipped beside the heads), "stats"
        (bigram chains from the store) — merged into one tree per row under the cost model
        (:class:`~.drafters.MergedDrafter`). ``lookup_store``: the store file (default:
        ``lookup_store.safetensors`` beside the heads). ``review=True`` (the vertical cascade): the
        heads rescore each lookup draft within their depth before it takes a verification slot
        (their probability of its token joins its calibrated hit rate). ``model.decoding`` records
        the choice; :meth:`with_decoding` leaves this model as it is instead."""
        if isinstance(sources, str) and sources.strip().lower() == AUTO:
            parse_sources(sources)  # "auto" is from_pretrained's choice, refused here as before
        config = self.decoding.replace(sources=sources, lookup_store=lookup_store, review=review)
        kept = self.policy if isinstance(self.policy, AdaptivePolicy) else None  # it keeps what it learned
        self._decoding = self._build(config, policy=kept)

    def _build(self, config: DecodingConfig, drafter: Drafter | None = None,
               policy: TreePolicy | None = None) -> Decoding:
        """How this model decodes under ``config``: the one builder over its base, heads, stores and step costs."""
        return build_decoding(config, self.base, self.heads, self.tokenizer, self.step_costs, self._stores,
                              auto=self._auto_sources, drafter=drafter, policy=policy)

    def use_drafts(self, drafts: str | Sequence[str], lookup_store: str | Path | None = None,
                   review: bool = False) -> None:
        """The old name of :meth:`use_sources` (a FutureWarning says so)."""
        warnings.warn("use_drafts() is now use_sources(); use_drafts() still works but will be removed.",
                      FutureWarning, stacklevel=2)
        self.use_sources(drafts, lookup_store, review)

    @property
    def base(self):
        """The base model (held weakly once :meth:`hold_base_weakly` was called)."""
        if self._base_ref is None:
            return self._base
        base = self._base_ref()
        if base is None:
            raise RuntimeError("This decoder's base model was deleted; build a new decoder with "
                               "DraftHeadsModel.from_pretrained.")
        return base

    @base.setter
    def base(self, model) -> None:
        self._base, self._base_ref = model, None

    def hold_base_weakly(self) -> None:
        """Keep only a weak reference to the base: for decoders cached per model (by
        ``custom_generate``, in a table keyed weakly by the model), which would otherwise keep
        their own key — the model — alive for ever."""
        self._base_ref, self._base = weakref.ref(self._base), None

    @property
    def config(self):
        return self.base.config

    @property
    def generation_config(self):
        return self.base.generation_config

    # -- the drop-in generate ----------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 generation_config=None, streamer=None, stopping_criteria=None, generator: torch.Generator | None = None,
                 acceptance: str | Typical | None = None, timer: PhaseTimer | None = None, logits_processor=None,
                 prefix_allowed_tokens_fn=None, tokenizer=None, **kwargs):
        """transformers' ``generate`` arguments; with ``do_sample=True`` also ``generator`` (seeded
        randomness; default: seeded from the global torch RNG) and ``acceptance``: "lossless"
        (default, exactly the base's sampling distribution) or "typical" / ``Typical(ε, δ)``
        (Medusa-2's rule, lossy). See ``draftheads.decoding.accept``. ``timer``: a
        :class:`~draftheads.decoding.step.PhaseTimer` that sums each step phase's time (profiling).

        Every generation option means what it means in transformers (the config is merged and the
        logits processors and stopping criteria are built by transformers' own methods, the
        caller's own included; :mod:`~draftheads.decoding.generation_options` lists what is honoured and
        what refused); stopping criteria are called as transformers' loop calls them
        (:class:`~draftheads.decoding.output.StopReplay`); a batch whose criteria are handed
        ``output_scores``, and a model carrying a forward hook or pre-hook (on itself, any of its
        modules, or every module), decode token by token with the model's own loop, with one
        warning (:func:`~draftheads.decoding.request.token_by_token`). Returns what transformers
        returns, with these documented edges:
        ``scores``/``logits`` are float32 as there; with ``return_dict_in_generate`` a batch's
        ``past_key_values`` and the scores of rows that finished early come from one extra forward
        over the output (equal up to float rounding); an answer that would pass
        ``max_position_embeddings`` stops there with a ``UserWarning`` (transformers continues).
        Bad inputs and options draftheads cannot honour raise
        :class:`~draftheads.core.errors.InputError` before any work."""
        check_generator(generator)
        if input_ids is None:  # transformers names the prompt ``inputs``
            input_ids = kwargs.pop("inputs", None)
        call = prepare_call(self.base, input_ids, attention_mask, generation_config, kwargs, logits_processor,
                            stopping_criteria, prefix_allowed_tokens_fn,
                            tokenizer if tokenizer is not None else self.tokenizer)
        return self.run(call, streamer, generator, acceptance, timer)

    @torch.no_grad()
    def run(self, call: Call, streamer=None, generator: torch.Generator | None = None,
            acceptance: str | Typical | None = None, timer: PhaseTimer | None = None):
        """Decode a prepared call (:func:`~.request.prepare_call`, or what transformers hands a
        ``custom_generate`` callable: :func:`~.request.prepared_call`); see :meth:`generate`."""
        decoding = self._decoding  # the policy, the drafter and the per-call switches, read once
        request = make_request(self.base, decoding.max_nodes, call, streamer, acceptance)
        started = time.perf_counter()
        reason = token_by_token(self.base, request)
        if reason is not None:  # the model's own loop, or a refusal where it cannot run as asked
            check_own_loop(reason, request, generator, acceptance)
            warnings.warn(reason.warning, UserWarning, stacklevel=3)
        if reason is not None or decoding.config.delegate_plain and self._delegates(request, generator):
            output, self.last_stats = plain_generate(self.base, request, started, streamer)
            return output
        self.refresh()
        with holding_packing(self.base), wearing(self.heads), loop_mode():
            output, self.last_stats = speculate(self.base, self.heads, decoding.policy, decoding.drafter, request,
                                                started, generator, streamer, timer,
                                                decoding.config.finished_rows == "shrink")
        return released(output)

    def refresh(self) -> None:
        """Before each call: decode with the weights as they are now. Every copy draftheads made
        of a weight (packed layers, the LM head's packed copy, the heads' draft rows) whose
        weight changed since — also through ``.data``, which no version counter sees — is made
        again, and heads whose shared LM head or embeddings were replaced by other tensors are
        bound to the base's current ones."""
        memo: dict = {}
        refresh_packing(self.base, memo)
        if self.heads is None:
            return
        if not shares_base_tensors(self.heads, self.base):
            attach_heads(self.heads, self.base, self.decoding.packed_linears)
        refresh_heads(self.heads, memo)

    def _delegates(self, request: Request, generator) -> bool:
        """With ``decoding.delegate_plain`` on, plain decoding by the base itself: the policy
        prefers it for this batch, and nothing asked for what only the loop provides (a
        ``torch.Generator`` for seeded sampling) or came prepared by transformers (its lists
        cannot be handed back to it)."""
        return bool(generator is None and request.plain is not None
                    and self.policy.prefers_plain(request.batch, request.prompt_len))



def attach_heads(heads: DraftHeads, base, packed_linears: bool = True) -> None:
    """Bind heads to the base's frozen LM head and embeddings, in its dtype, drafting as the
    loop will (idempotent): done before anything drafts with them — the loop, and the
    calibration of ``tree="adaptive"``, which measures ``heads.propose``. Heads that read base
    layers it does not have are refused by name."""
    problem = feature_layer_problem(heads.feature_layers, getattr(base.config.get_text_config(), "num_hidden_layers", None))
    if problem is not None:
        raise CheckpointError(f"These heads cannot read this base: {problem}; load heads trained on this base.")
    heads.bind(base.get_output_embeddings().weight, base.get_input_embeddings().weight)
    heads.to(base.dtype)
    heads.draft_dtype = drafting_dtype(base)
    if packed_linears:
        use_packed_heads(heads)
        plan_packing([heads.draft_weight(heads.draft_dtype)] + [p for p in heads.parameters() if p.dim() == 2],
                     alongside=base_weights(base))



def shares_base_tensors(heads: DraftHeads, base) -> bool:
    """Whether the heads read the base's LM head and input embeddings as they are now (the same
    storage, shape and dtype): a parameter replaced since (``param.data = ...``, a cast) is not."""
    shared = heads._shared
    if shared is None:
        return False
    pairs = [(shared.lm_head_weight, base.get_output_embeddings().weight)]
    if shared.embed_weight is not None:
        pairs.append((shared.embed_weight, base.get_input_embeddings().weight))
    return all(a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
               for a, b in pairs)


def drafting_dtype(base) -> torch.dtype | None:
    """The dtype heads read out their drafts in. A float32 base on a CPU with native bf16
    drafts in bf16: the draft readout (a (P, d) × (d, V_draft) product) is memory-bound and
    fp32 GEMMs with a few rows are slower than bf16 ones there. Drafts only propose: verification stays in the base's
    dtype, so outputs do not change. Other dtypes/devices draft in the base's dtype."""
    param = next(base.parameters())
    if param.dtype == torch.float32 and param.device.type == "cpu" and bf16_native():
        return torch.bfloat16
    return None


