"""The speculative loop and the drop-in ``generate()``.

    prefill → root token
    loop: tree ← policy ; tokens ← heads.propose ; hidden ← base.verify(tree) ;
          path ← accept ; cache.commit(path) ; emit path tokens + bonus ; stop finished rows
"""
from __future__ import annotations

import copy
import functools
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from ..heads import DraftHeads, load_heads
from .attention import use_packed_sdpa
from .base import cpu_has_bf16, dtype_name, fingerprint, forward_all, lm_logits, load_base, prefill, use_packed_linears
from .cache import KVState
from .context import HeadContext
from .limits import check_base_path, check_input_tensors, parse_dtype, parse_tree_option, warn_context_cut
from .sampling import Acceptor, Typical, check_sampling_config, resolve_acceptance
from .policy import AdaptivePolicy, CalibrationConfig, calibrate
from .step import PhaseTimer, decode_step
from .tree import Tree, chain_tree, tree_from_paths


class TreePolicy(Protocol):
    """Chooses the step's tree; the batch-adaptive policy and a pinned tree share this. A
    policy may also define ``observe(tree, accepted)``: the loop then reports, after every
    verification, the tree it ran and each live row's number of accepted drafts."""

    def choose(self, batch_size: int, context_length: int) -> Tree: ...


@dataclass
class FixedTree:
    """The pinned strategy: the same tree whatever the batch."""

    tree: Tree

    def choose(self, batch_size: int, context_length: int) -> Tree:
        return self.tree


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
        raise ValueError(f"generate() got arguments it does not understand: {sorted(unused)}.")
    for name, default in _UNSUPPORTED.items():
        value = getattr(config, name, default)
        if value not in (default, None):
            raise ValueError(f"generate(): `{name}={value!r}` is not supported by draftheads yet; "
                             f"leave it at {default!r} or use the base model's own generate().")
    check_sampling_config(config)
    return config


def eos_token_ids(config) -> list[int]:
    """A generation config's EOS id(s) as a list (transformers allows an int or a list)."""
    eos = config.eos_token_id
    if eos is None:
        return []
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
            heads.bind(base.get_output_embeddings().weight, base.get_input_embeddings().weight)
            heads.to(base.dtype)
            heads.draft_dtype = drafting_dtype(base)
            if packed_linears:
                heads.use_packed_readout()
        if tree is None:
            tree = default_tree(heads, base.dtype)
        self.policy: TreePolicy = FixedTree(tree) if isinstance(tree, Tree) else tree
        self.last_stats = DecodingStats()

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, heads_path: str | Path | None = None, base=None, tokenizer=None,
                        base_name_or_path: str | None = None, dtype: torch.dtype | str | None = "auto", tree=None,
                        packed_attention: bool = True, packed_linears: bool = True, **hub_kwargs) -> "DraftHeadsModel":
        """Load heads from a local checkpoint directory or a Hub id (``hub_kwargs``: ``revision``,
        ``cache_dir``, ``token``, ``local_files_only``; ``HF_HUB_OFFLINE=1`` reads the cache only)
        and the base they were made for (default: the embedded SmolLM2), in ``dtype``:
        ``"auto"`` (default) is the base's native dtype where the hardware computes it natively
        (bf16 on CPUs with AVX512-BF16/AMX and on GPUs), else float32; an explicit dtype wins.
        The heads are cast to the base's dtype."""
        tree = parse_tree_option(tree)  # every argument is checked before anything loads
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
        if heads is not None and packed_linears:
            heads.use_packed_readout()  # the calibration drafts as the loop will
        return cls(base, heads, tokenizer, resolve_tree(tree, base, heads), packed_attention=packed_attention,
                   packed_linears=packed_linears)

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
        (Medusa-2's rule, lossy). See ``draftheads.decoding.sampling``. ``timer``: a
        :class:`~draftheads.decoding.step.PhaseTimer` that sums each step phase's time (profiling).

        Returns what transformers returns, with these documented edges: ``scores``/``logits``
        are float32 as there; with ``return_dict_in_generate`` a batch's ``past_key_values`` and
        the scores of rows that finished early come from one extra forward over the output
        (equal up to float rounding); an answer that would pass ``max_position_embeddings``
        stops there with a ``UserWarning`` (transformers continues). Bad inputs raise
        :class:`~draftheads.decoding.limits.InputError` before any work."""
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        config = resolve_generation_config(self.base.generation_config, generation_config, **kwargs)
        mode = resolve_acceptance(config, acceptance)
        eos = eos_token_ids(config)
        # transformers' fallback: no pad_token_id → the first EOS id (and no padding inference)
        pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
        input_ids, attention_mask = _check_inputs(input_ids, attention_mask, self.base, pad, eos,
                                                  pad_given=config.pad_token_id is not None)
        pad = 0 if pad is None else pad  # no pad and no EOS: no row ends early, the value never shows
        batch, prompt_len = input_ids.shape
        if streamer is not None and batch > 1:
            raise ValueError("generate(): a streamer needs batch size 1 (as in transformers).")
        wanted = _wanted_new_tokens(config, prompt_len)
        check_memory(self.base, batch, prompt_len, min(wanted, self.base.config.max_position_embeddings),
                     _largest_tree_nodes(self.policy, batch, prompt_len))
        context = self.base.config.max_position_embeddings
        limits = [min(wanted, context - int(n)) for n in attention_mask.sum(1)]
        warn_context_cut(wanted, limits, context)
        want_scores = bool(config.return_dict_in_generate and (config.output_scores or config.output_logits))
        device = input_ids.device

        started = time.perf_counter()
        if self._delegates(batch, prompt_len, generator):
            return self._plain_generate(input_ids, attention_mask, config, streamer, stopping_criteria, eos, started)
        stats = DecodingStats()
        if streamer is not None:
            streamer.put(input_ids.cpu())
        cache, hidden = prefill(self.base, input_ids, attention_mask)
        kv = KVState.after_prefill(cache, attention_mask)
        logits = lm_logits(self.base, hidden)  # (B, V)
        generated: list[list[int]] = [[] for _ in range(batch)]
        acceptor = Acceptor(config, mode, logits.shape[-1], input_ids, attention_mask, generated, generator)
        roots = acceptor.first(logits)
        scores: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        done = torch.zeros(batch, dtype=torch.bool)
        emit = functools.partial(self._emit, generated=generated, scores=scores, done=done, eos=set(eos),
                                 stopping_criteria=stopping_criteria, input_ids=input_ids, streamer=streamer)
        for b in range(batch):
            emit(b, [int(roots[b])], [acceptor.reported(logits)[b]] if want_scores else None, limits[b])
        context = HeadContext(self.heads, hidden)  # what the heads read (Hydra++: their own layer's state)
        live = torch.arange(batch)  # original row of each row still decoding
        observe = getattr(self.policy, "observe", None)

        while True:
            running = ~done[live]
            if not bool(running.any()):
                break
            if not bool(running.all()) and self.finished_rows == "shrink":
                keep = running.nonzero().squeeze(1)  # finished rows leave: no compute for their trees
                live, roots = live[keep], roots[keep]
                kv.select_rows(keep.to(device))
                context.select_rows(keep.to(device))
            active = ~done[live]  # all True when shrinking; finished rows are masked otherwise
            remaining = min(limits[b] - len(generated[b]) for b in live[active].tolist())
            tree = self.policy.choose(live.numel(), kv.length)
            if tree.max_depth > remaining - 1:
                tree = tree.truncated(remaining - 1)
            step = decode_step(self.base, self.heads, acceptor, kv, context, roots, tree, live, timer)
            tree, tokens, result = step.tree, step.tokens, step.acceptance
            if observe is not None:
                observe(tree, result.accepted[active.to(device)])
            stats.steps += 1
            stats.accepted.extend(result.accepted[active.to(device)].tolist())
            stats.tree_nodes.append(tree.num_nodes)
            stats.batch_sizes.append(live.numel())
            roots = result.bonus
            reported = acceptor.reported(step.logits) if want_scores else None
            for i, b in enumerate(live.tolist()):
                a = int(result.accepted[i])
                new = tokens[i, result.path[i, 1: a + 1]].tolist() + [int(result.bonus[i])]
                step_scores = [reported[i, s] for s in result.path[i, : a + 1].tolist()] if want_scores else None
                emit(b, new, step_scores, limits[b], drafted=a)
        if streamer is not None:
            streamer.end()
        stats.new_tokens = sum(len(g) for g in generated)
        stats.seconds = time.perf_counter() - started
        self.last_stats = stats
        sequences = _assemble(input_ids, generated, pad)
        if not config.return_dict_in_generate:
            return sequences
        steps = sequences.shape[1] - prompt_len
        early = want_scores and any(len(row) < steps for row in scores)
        cache_out = None
        if early or (config.use_cache and batch > 1):
            # a batch's own cache has per-row holes and rows that finished early have no scores after
            # their end: one forward over the output, fed as transformers feeds it, gives both
            cache_out, hidden_all = forward_all(self.base, sequences[:, :-1], _grown_mask(attention_mask, steps))
            if early:
                _fill_finished_scores(scores, self.base, hidden_all, sequences, prompt_len, acceptor)
            cache_out = cache_out if config.use_cache else None
        elif config.use_cache:
            kv.crop_to(prompt_len + steps - 1)
            cache_out = kv.cache
        score_tuple = _stack_scores(scores, steps, logits.shape[-1]) if want_scores else None
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=score_tuple if config.output_scores else None,
                                         logits=score_tuple if config.output_logits else None,
                                         past_key_values=cache_out)

    def _delegates(self, batch: int, prompt_len: int, generator) -> bool:
        """Plain decoding by the base itself: the policy prefers it for this batch, and nothing
        asked for what only the loop provides (a ``torch.Generator`` for seeded sampling)."""
        prefers = getattr(self.policy, "prefers_plain", None)
        return bool(self.delegate_plain and generator is None and prefers is not None and prefers(batch, prompt_len))

    def _plain_generate(self, input_ids, attention_mask, config, streamer, stopping_criteria, eos: list[int],
                        started: float):
        """The base's own ``generate`` with the same (already checked) arguments; its output is
        the reference itself, so greedy identity and sampling's distribution hold trivially."""
        output = self.base.generate(input_ids, attention_mask=attention_mask, generation_config=config,
                                    streamer=streamer, stopping_criteria=stopping_criteria)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        counts = generated_counts(sequences, input_ids.shape[1], set(eos))
        steps = max(counts, default=0)
        self.last_stats = DecodingStats(new_tokens=sum(counts), steps=steps, accepted=[0] * sum(counts),
                                        seconds=time.perf_counter() - started, tree_nodes=[1] * steps,
                                        batch_sizes=[input_ids.shape[0]] * steps, delegated=True)
        return output

    @staticmethod
    def _emit(row: int, new: list[int], new_scores, max_new: int, *, generated, scores, done, eos: set[int],
              stopping_criteria, input_ids, streamer, drafted: int = 0) -> None:
        """Append tokens one by one, stopping exactly where transformers would: after an EOS,
        at ``max_new`` tokens, or when a user stopping criterion fires. The first ``drafted``
        of ``new`` are accepted drafts: a streamer with ``put_step`` is told so (colouring)."""
        if bool(done[row]):
            return
        emitted = []
        for i, token in enumerate(new):
            generated[row].append(token)
            emitted.append(token)
            if new_scores is not None:
                scores[row].append(new_scores[i])
            stop = token in eos or len(generated[row]) >= max_new
            if not stop and stopping_criteria is not None:
                so_far = torch.cat([input_ids[row], torch.tensor(generated[row], dtype=input_ids.dtype)])[None]
                last = new_scores[i][None] if new_scores is not None else None
                stop = bool(stopping_criteria(so_far, last).any())
            if stop:
                done[row] = True
                break
        if streamer is not None and emitted:
            if hasattr(streamer, "put_step"):
                streamer.put_step(torch.tensor(emitted), min(drafted, len(emitted)))
            else:
                streamer.put(torch.tensor(emitted))


def drafting_dtype(base) -> torch.dtype | None:
    """The dtype heads read out their drafts in. A float32 base on a CPU with native bf16
    drafts in bf16: the draft readout (a (P, d) × (d, V_draft) product) is memory-bound and
    fp32 GEMMs with a few rows are slow here (measured 1.5–8.7 ms vs 1.1–1.5 ms for P = 1–8
    rows × 8,192 tokens, one thread). Drafts only propose: verification stays in the base's
    dtype, so outputs do not change. Other dtypes/devices draft in the base's dtype."""
    param = next(base.parameters())
    if param.dtype == torch.float32 and param.device.type == "cpu" and cpu_has_bf16():
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
                raise ValueError(f"tree={tree!r}: expected 'adaptive' or a node budget (an integer).") from None
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
    for that dtype (``extra.default_budget_by_dtype``, written by ``scripts/default_trees.py``
    from a calibration × the heads' expected τ), else its dtype-independent ``default_budget``."""
    by_dtype = heads.config.extra.get("default_budget_by_dtype") or {}
    if dtype is not None and dtype_name(dtype) in by_dtype:
        return int(by_dtype[dtype_name(dtype)]["budget"])
    return int(heads.config.extra.get("default_budget", 4))


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
            raise ValueError(f"No stored tree fits a budget of {budget} nodes; stored budgets: {sorted(map(int, trees))}.")
        tree = tree_from_paths(trees[str(max(fitting))])
    else:
        tree = chain_tree(min(budget, heads.num_heads))
    heads.check_tree(tree.spec)
    return tree


def _check_inputs(input_ids, attention_mask, base, pad: int | None, eos: list[int], pad_given: bool = True):
    input_ids, attention_mask = check_input_tensors(input_ids, attention_mask, base)
    if input_ids.shape[1] == 0:
        raise ValueError("generate(): the prompt is empty; pass at least one token.")
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
        raise ValueError(f"generate(): attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}.")
    if bool((attention_mask.sum(1) == 0).any()):
        raise ValueError("generate(): a prompt in the batch is empty (all padding).")
    if bool((attention_mask[:, -1] == 0).any()):
        raise ValueError("generate(): the batch is right-padded; decoder-only generation needs left padding "
                         "(tokenizer.padding_side = 'left').")
    limit = base.config.max_position_embeddings
    if int(attention_mask.sum(1).max()) >= limit:
        raise ValueError(f"generate(): the prompt has {int(attention_mask.sum(1).max())} tokens, at or over the "
                         f"model's context limit of {limit}; shorten it.")
    return input_ids, attention_mask


def _largest_tree_nodes(policy, batch: int, width: int) -> int:
    candidates = getattr(policy, "candidates", None)
    if candidates:
        return max(c.tree.num_nodes for c in candidates)
    return policy.choose(batch, width).num_nodes


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
            raise ValueError(f"generate(): max_new_tokens must be positive, got {config.max_new_tokens}.")
        return config.max_new_tokens
    wanted = config.max_length - prompt_len
    if wanted <= 0:
        raise ValueError(f"generate(): max_length={config.max_length} leaves no room after a {prompt_len}-token "
                         "prompt; set max_new_tokens.")
    return wanted


def generated_counts(sequences: torch.Tensor, width: int, eos: set[int]) -> list[int]:
    """New tokens per row (after the ``width`` prompt columns) up to and including its first
    EOS: the padding after it is not work."""
    counts = []
    for row in sequences[:, width:].tolist():
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        counts.append(len(row) if stop is None else stop + 1)
    return counts


def _grown_mask(attention_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """The mask transformers' ``generate`` has after ``steps`` tokens, over all but the last
    (every row, finished or not, gets a 1 per step)."""
    return torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], steps - 1)], dim=1)


def _fill_finished_scores(scores: list[list[torch.Tensor]], base, hidden: torch.Tensor, sequences: torch.Tensor,
                          prompt_len: int, acceptor: Acceptor) -> None:
    """Scores of rows after they finished, as transformers records them: it keeps feeding such a
    row the pad token and reports the base's (processed) logits at every step."""
    steps = sequences.shape[1] - prompt_len
    for row, row_scores in enumerate(scores):
        for step in range(len(row_scores), steps):
            logits = base.lm_head(hidden[row, prompt_len - 1 + step])
            if acceptor.report_processed:
                ids = sequences[row: row + 1, : prompt_len + step]
                logits = acceptor.processors(ids, logits.float()[None])[0].to(logits.dtype)
            row_scores.append(logits)


def _stack_scores(scores: list[list[torch.Tensor]], steps: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """Per-token logits as transformers returns them: one (B, V) float32 tensor per generated
    position, whatever the model's dtype (every row has one by now: see :func:`_fill_finished_scores`)."""
    zero = torch.zeros(vocab, dtype=torch.float32)
    return tuple(torch.stack([(row[i] if i < len(row) else zero).float() for row in scores]) for i in range(steps))


def _assemble(input_ids: torch.Tensor, generated: list[list[int]], pad: int) -> torch.Tensor:
    width = max(len(g) for g in generated)
    out = torch.full((input_ids.shape[0], width), pad, dtype=input_ids.dtype)
    for row, tokens in enumerate(generated):
        out[row, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, out.to(input_ids.device)], dim=1)
