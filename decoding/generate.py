"""``DraftHeadsModel``: load a base and its heads, configure the drafting and the tree policy,
and the drop-in ``generate()``. The rest lives in modules named for it: the options
(:mod:`.config`), the request and its checks (:mod:`.request`, :mod:`.limits`), the loop
(:mod:`.loop`, one step in :mod:`.step`), the tree policies (:mod:`.policy`), the drafters
(:mod:`.drafters`).
"""
from __future__ import annotations

import time
import warnings
import weakref
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..heads import DraftHeads, load_heads
from .base.binding import wearing
from .base.hardware import bf16_native
from .accept import Typical
from .base.attention import use_packed_sdpa
from .base.check import check_base
from .base.forward import ragged_capable
from .base.loading import dtype_name, load_base
from .base.packing import base_weights, holding_packing, plan_packing, refresh_heads, refresh_packing, use_packed_heads
from .base.packing import use_packed_linears
from .fingerprint import fingerprint
from .calibration import CalibrationConfig, calibrate
from .config import AUTO, DecodingConfig, TreeOption, decoding_config, split_options
from .cost import CostModel
from .drafters import Drafter, HeadsDrafter, MergedDrafter, auto_sources, build_drafter, check_review, open_store, parse_sources
from .drafters import needing
from .limits import check_base_path, check_generator, parse_dtype
from .loop import DecodingStats, plain_generate, speculate
from .output import loop_mode, released
from .policy import (AdaptivePolicy, FixedTree, TreePolicy, as_policy, best_budget, default_tree, expected_tau_scale,
                     resolve_tree, tree_for_budget)
from .request import Call, Request, eos_token_ids, make_request, prepare_call
from .step import PhaseTimer
from .tree import Tree


#: the quick calibration behind the defaults (:meth:`DraftHeadsModel.calibrate_defaults`):
#: batch size 1, the stored trees' sizes and the merged drafter's widths, at a short context
#: (where the default tree is chosen) and a long one (so the width chooser prices the nodes of
#: a long prompt by its KV length, :meth:`~.cost.CostModel.per_token_table`)
QUICK_CONTEXT = 256
QUICK_CONTEXTS = (QUICK_CONTEXT, 1024)
QUICK_CALIBRATION = CalibrationConfig(batch_sizes=(1,), contexts=QUICK_CONTEXTS, reps=3,
                                      extra_nodes=(3, 5, 9, 17, 33))


class DraftHeadsModel:
    """A frozen base model plus draft heads, with a ``generate()`` that returns exactly what
    the base's greedy ``generate()`` returns, faster."""

    def __init__(self, base, heads: DraftHeads | None = None, tokenizer=None, tree: TreeOption = None,
                 decoding: DecodingConfig | None = None, **options):
        """``decoding`` (default: :class:`~.config.DecodingConfig`'s defaults) with ``tree`` and
        the keyword ``options`` (its fields: ``packed_attention=False``, ...) applied over it.
        Built here: the packing, the heads' binding and the tree (``tree=None``: the checkpoint's
        default tree; :meth:`from_pretrained` also prices it on this machine); the drafting is
        chosen by :meth:`from_pretrained` or :meth:`use_sources` (until then: the heads alone)."""
        if tree is not None:
            options["tree"] = tree
        #: the options this model decodes with (:mod:`.config`)
        self.decoding: DecodingConfig = decoding_config(decoding, **options)
        packed_attention, packed_linears = self.decoding.packed_attention, self.decoding.packed_linears
        self.base = base
        self.packed_linears = packed_linears
        check_base(base, probe=False)  # an architecture the loop cannot run is refused before anything
        if packed_attention:  # grouped-query SDPA without copying the KV cache (decoding/base/attention.py)
            use_packed_sdpa(base)
        if packed_linears:  # oneDNN-packed weights for our forwards only (decoding/base/packing.py)
            use_packed_linears(base)
        check_base(base)  # the decoder's forwards, fast paths included, against the model's own (once)
        self.tokenizer = tokenizer
        self.heads = heads
        if heads is not None:
            attach_heads(heads, base, packed_linears)
        tree = resolve_tree(self.decoding.tree, base, heads, self.decoding.calibration)
        if tree is None:
            tree = default_tree(heads, base.dtype)
        self.policy: TreePolicy = as_policy(tree)
        #: who fills the trees; None: the heads alone (:class:`~.drafters.HeadsDrafter` over ``self.heads``)
        self.drafter: Drafter | None = None
        #: the sources ``drafter`` merges (("heads",) for the heads alone), named in reports
        self.sources: tuple[str, ...] = ("heads",) if heads is not None else ()
        #: this machine's bs-1 step times (:meth:`calibrate_defaults`); None: not measured
        self.step_table: CostModel | None = None
        #: the heads-alone node budget this machine's quick calibration chose (None: the tree was
        #: given); :meth:`use_sources` offers ``decoding.merged_offer_scale`` times it when lookups join
        self.default_budget: int | None = None
        self._default_policy: TreePolicy | None = None
        self._stores: dict = {}  # lookup_store argument → the opened (read-only, mapped) store
        self._heads_alone: HeadsDrafter | None = None  # the drafter while ``drafter`` is None
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
        ``packed_attention``, ``packed_linears``, ``finished_rows``, ``delegate_plain``,
        ``merged_offer_scale``, ``heads_offer_scale``; see :mod:`.config`), the others go to the Hub (``revision``,
        ``cache_dir``, ``token``, ``local_files_only``; ``HF_HUB_OFFLINE=1`` reads the cache only).
        ``sources="auto"`` (default): the heads and every lookup source there is data for
        (:func:`auto_sources`); ``tree=None`` (default): the stored tree this machine's quick
        calibration prices best (:meth:`calibrate_defaults`; seconds, once per machine, cached)."""
        options, hub_kwargs = split_options(kwargs)
        config = decoding_config(decoding, **options)  # every option is checked before anything loads
        if base is None:
            check_base_path(base_name_or_path)
            parse_dtype(dtype)
            base, tokenizer = load_base(base_name_or_path, dtype=dtype)
        check_base(base, probe=False)
        if config.packed_attention:  # before an adaptive tree's calibration, which measures the loop's forward
            use_packed_sdpa(base)
        if config.packed_linears:
            use_packed_linears(base)
        check_base(base)  # before anything measures or binds heads to a base it would refuse
        heads = None
        if heads_path is not None:
            heads = load_heads(heads_path, expected_fingerprint=fingerprint(base).with_sketch(base),
                               base_name=getattr(base, "name_or_path", None) or None, **hub_kwargs)
            attach_heads(heads, base, config.packed_linears)  # bound before an adaptive tree's calibration drafts with them
        model = cls(base, heads, tokenizer, decoding=config)
        if config.tree is None:
            model.calibrate_defaults()
        sources = auto_sources(heads, config.lookup_store) if config.sources == AUTO else config.sources
        check_review(config.review, sources)
        model._build_drafter(sources, config.lookup_store, config.review)
        return model

    def calibrate_defaults(self, config: CalibrationConfig | None = None) -> None:
        """Price this machine's step (a quick bs-1 calibration of the verify forward, the loop's
        overhead and the heads' drafting: seconds, once per machine/dtype/torch, cached) and
        take the stored tree it ranks best (step time × the checkpoint's expected τ, its drafted
        part scaled by :func:`~.policy.expected_tau_scale`) as the default, and the same table as the merged
        drafter's width model. Without heads, or with stored trees lacking an expected τ, the
        checkpoint's stored default stays."""
        cost = calibrate(self.base, self.heads, config or QUICK_CALIBRATION)
        self.step_table = cost.per_token_table(sorted({int(r['ctx']) for r in cost.forward.rows()}))
        if self.heads is not None and self.heads.config.trees and self.heads.config.expected_tau:
            scale = expected_tau_scale(self.heads)
            self.default_budget = best_budget(self.heads, cost, 1, QUICK_CONTEXT, scale)[0].budget
            self.policy = self._default_policy = FixedTree(tree_for_budget(self.heads, self.default_budget))

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
        the choice."""
        if isinstance(sources, str) and sources.strip().lower() == AUTO:
            parse_sources(sources)  # "auto" is from_pretrained's choice, refused here as before
        config = self.decoding.replace(sources=sources, lookup_store=lookup_store, review=review)  # before the store opens
        self._build_drafter(config.sources, lookup_store, review)
        self.decoding = config

    def use_drafts(self, drafts: str | Sequence[str], lookup_store: str | Path | None = None,
                   review: bool = False) -> None:
        """The old name of :meth:`use_sources` (a FutureWarning says so)."""
        warnings.warn("use_drafts() is now use_sources(); use_drafts() still works but will be removed.",
                      FutureWarning, stacklevel=2)
        self.use_sources(drafts, lookup_store, review)

    def _build_drafter(self, sources: tuple[str, ...], lookup_store: str | Path | None, review: bool) -> None:
        """The drafter of checked ``sources`` (:meth:`use_sources`), the store opened once per file."""
        self.sources = sources
        store = None
        uses_store = bool(needing("store", sources))
        if uses_store or lookup_store is not None:  # a store named is checked even when these sources skip it
            key = None if lookup_store is None else str(Path(lookup_store).resolve())
            if key not in self._stores:  # opened and checked once per file, shared by every drafter
                self._stores[key] = open_store(lookup_store, self.heads, self.tokenizer,
                                               self.base.get_input_embeddings().num_embeddings)
            store = self._stores[key] if uses_store else None
        eos = eos_token_ids(self.base.generation_config)
        self.drafter = build_drafter(sources, self.heads, store, self.step_cost(), eos[0] if eos else None, review,
                                     ragged_capable(self.base))
        if self.offers_larger_tree() and isinstance(self.drafter, MergedDrafter) and self.drafter.heads is not None:
            offer = self.default_budget * self.decoding.merged_offer_scale
            self.drafter.heads_tree = tree_for_budget(self.heads, offer)
        if isinstance(self.drafter, HeadsDrafter):
            self.drafter.offer = self.heads_offer()

    def heads_offer(self) -> Callable[[Tree], Tree] | None:
        """What the heads alone fill for a tree of the policy (:data:`~.config.HEADS_OFFER_SCALE`):
        the stored tree of ``decoding.heads_offer_scale`` times its node budget. None (the policy's
        trees verified as they are): at scale 1, for heads that store no trees, or for a tree
        given as a Tree or a policy (its shape is the caller's choice)."""
        heads, scale, given = self.heads, self.decoding.heads_offer_scale, self.decoding.tree
        if heads is None or scale == 1 or not heads.config.trees or not (given is None or isinstance(given, (int, str))):
            return None
        offers: dict[int, Tree] = {}

        def offer(tree: Tree) -> Tree:
            budget = tree.num_nodes - 1
            if budget not in offers:
                offers[budget] = tree_for_budget(heads, budget * scale)
            return offers[budget]

        return offer

    def offers_larger_tree(self) -> bool:
        """Whether merged drafting offers the heads' larger tree (``decoding.merged_offer_scale``): only
        while the policy is the default fixed tree this machine's calibration chose — a pinned
        tree or an adaptive policy (which sizes trees per batch) is followed as it is."""
        return bool(self.default_budget) and self.policy is self._default_policy

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
        return CostModel.from_ranked(ranked) if ranked else None

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
        caller's own included; :mod:`~draftheads.decoding.options` lists what is honoured and
        what refused). Returns what transformers returns, with these documented edges:
        ``scores``/``logits`` are float32 as there; with ``return_dict_in_generate`` a batch's
        ``past_key_values`` and the scores of rows that finished early come from one extra forward
        over the output (equal up to float rounding); an answer that would pass
        ``max_position_embeddings`` stops there with a ``UserWarning`` (transformers continues).
        Bad inputs and options draftheads cannot honour raise
        :class:`~draftheads.decoding.limits.InputError` before any work."""
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
        decoding = self.decoding  # the per-call switches, read once
        request = make_request(self.base, self.policy.max_nodes, call, streamer, acceptance)
        started = time.perf_counter()
        if decoding.delegate_plain and self._delegates(request, generator):
            output, self.last_stats = plain_generate(self.base, request, started, streamer)
            return output
        self.refresh()
        drafter = self.drafter if self.drafter is not None else self.heads_alone()
        with holding_packing(self.base), wearing(self.heads), loop_mode():
            output, self.last_stats = speculate(self.base, self.heads, self.policy, drafter, request, started,
                                                generator, streamer, timer, decoding.finished_rows == "shrink")
        return released(output)

    def heads_alone(self) -> HeadsDrafter:
        """The drafter while :attr:`drafter` is None: the heads alone, kept across calls (its hit
        rates learn) while the heads are the same object."""
        if self._heads_alone is None or self._heads_alone.heads is not self.heads:
            self._heads_alone = HeadsDrafter(self.heads, self.heads_offer())
        return self._heads_alone

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
            attach_heads(self.heads, self.base, self.packed_linears)
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
    calibration of ``tree="adaptive"``, which measures ``heads.propose``."""
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


