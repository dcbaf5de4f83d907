"""What every bench shares: timed runs of transformers and of draftheads, and the drafting
configurations, each a light model over the same base and heads
(:meth:`~draftheads.decoding.DraftHeadsModel.with_decoding`): a bench never changes the model it is given."""
from __future__ import annotations

import platform
import time

import torch

from ..decoding.guarantee import first_divergence as divergence

#: transformers' prompt lookup: the control for identity and the one-line peer for speed
PROMPT_LOOKUP_TOKENS = 10


def timed(fn):
    """Run ``fn`` and return (its result, wall seconds)."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def hf_greedy(base, ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """The baseline every speedup is measured against: transformers' own greedy ``generate``
    (``kwargs``: e.g. ``prompt_lookup_num_tokens`` for its prompt-lookup mode)."""
    return base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         **kwargs)


#: what :func:`warm_up_paths` answers, and how many tokens of it
WARM_UP_PROMPT, WARM_UP_TOKENS = "Hello! What can you do?", 32


def warm_up_paths(model, baseline: bool = True, tokens: int = WARM_UP_TOKENS) -> None:
    """Answer :data:`WARM_UP_PROMPT` for ``tokens`` tokens through draftheads and (``baseline``)
    transformers' plain ``generate``, so what a user times next compares steady states: first
    calls allocate, and oneDNN builds a kernel per new row count, which tree steps meet by the
    dozen (``draftheads generate`` and ``draftheads demo`` call it before they time anything)."""
    from ..prompts import chat_input

    warm = chat_input(model.tokenizer, WARM_UP_PROMPT).to(model.base.device)
    if baseline:
        hf_greedy(model.base, warm, tokens)
    model.generate(warm, max_new_tokens=tokens)


def run_timing(new_tokens: int, seconds: float) -> dict:
    return {"new_tokens": new_tokens, "seconds": round(seconds, 4), "tokens_per_second": round(new_tokens / seconds, 3)}


def timed_hf(base, ids: torch.Tensor, max_new_tokens: int, **kwargs) -> tuple[torch.Tensor, dict]:
    """HF greedy on one prompt: (its output, new tokens / seconds / tokens per second)."""
    plain, seconds = timed(lambda: hf_greedy(base, ids, max_new_tokens, **kwargs))
    return plain, run_timing(plain.shape[1] - ids.shape[1], seconds)


def draftheads_run(model, ids: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, float, tuple[float, int, float]]:
    """draftheads' answer to one prompt: (its output, wall seconds, (τ, verify steps, seconds to
    the first token) of that very run)."""
    ours, seconds = timed(lambda: model.generate(ids, max_new_tokens=max_new_tokens))
    stats = model.last_stats
    return ours, seconds, (stats.tau, stats.steps, stats.prefill_seconds)


def draftheads_timing(base, run: tuple, ids: torch.Tensor, plain: torch.Tensor, hf: dict) -> dict:
    """A :func:`draftheads_run` against HF's answer (``plain``, timed in ``hf``): its timing, τ,
    verify steps, speedup over HF and the first divergence from HF's tokens (None when identical)."""
    ours, seconds, (tau, steps, prefill) = run
    new = ours.shape[1] - ids.shape[1]
    return {**run_timing(new, seconds), "tau": round(tau, 4), "verify_steps": steps, "prefill_seconds": round(prefill, 4),
            "speedup": round((new / seconds) / (hf["new_tokens"] / hf["seconds"]), 4),
            "mismatch": divergence(base, plain, ours, ids.shape[1])}


def timed_draftheads(model, ids: torch.Tensor, plain: torch.Tensor, hf: dict, max_new_tokens: int) -> dict:
    """draftheads on the prompt HF just answered (``plain``, timed in ``hf``), see :func:`draftheads_timing`."""
    return draftheads_timing(model.base, draftheads_run(model, ids, max_new_tokens), ids, plain, hf)


def eos_ids(base) -> list[int]:
    from ..decoding.request import eos_token_ids

    return eos_token_ids(base.generation_config)


def draft_configs(model, sources: tuple[str, ...], review: bool = False) -> dict[str, object]:
    """The bench's drafting configurations for ``sources`` (``--sources``): each source alone, the
    lookups together (the Hierarchy Drafting hierarchy), with ``review`` every source merged
    under the vertical cascade, and every source merged (last: the headline). name → a light
    model drafting that way (:func:`config_model`)."""
    from ..decoding.drafters import parse_sources

    sources = parse_sources(sources)
    lookups = tuple(s for s in sources if s != "heads")
    wanted = [(s,) for s in sources]
    if len(lookups) > 1:
        wanted.append(lookups)
    if len(sources) > 1:
        wanted.append(sources)
    if review:
        wanted.insert(len(wanted) - 1, sources + ("review",))
    return {"+".join(combo): config_model(model, combo) for combo in wanted}


#: the name ``--parts`` gives the model's own drafting (the summary compares it with the others)
DEFAULT_CONFIG = "default"
#: ``--twin``: a second drafter of the default's sources, built apart (an A/A control)
TWIN_CONFIG = "twin"


def part_configs(model, twin: bool = False) -> dict[str, object]:
    """The default drafting beside its parts (``--parts``): the heads alone, the lookups alone
    (together) and the model itself, last (the headline). What the default must show: it is
    never much slower than the better of its parts. ``twin``: also a second model of the
    default's very sources and settings, whose drafter learns on its own: how far two identical
    configurations read apart in the same run is the noise floor of that comparison."""
    sources = tuple(model.sources)
    lookups = tuple(s for s in sources if s != "heads")
    configs = {"+".join(combo): config_model(model, combo) for combo in (("heads",), lookups)
               if combo and combo != sources}
    if twin:
        configs[TWIN_CONFIG] = config_model(model, sources)
    return {**configs, DEFAULT_CONFIG: model}


def config_model(model, combo: tuple[str, ...], **options):
    """A light model over ``model``'s base and heads drafting with one bench configuration: source
    names, a trailing "review" for the vertical cascade; ``options``: more decoding options."""
    reviewed = combo[-1] == "review"
    return model.with_decoding(sources=combo[:-1] if reviewed else combo, review=reviewed, **options)


def rotated(names: list[str], shift: int) -> list[str]:
    """The strategies in batch ``shift``'s order: each batch starts one strategy later, so a slow
    spell of a shared machine (tens of seconds) does not always hit the same strategy.
    evidence: results/attention/ragged_verify/bf16_run1 and bf16_run2 (one step, timed in two runs)."""
    k = shift % len(names)
    return names[k:] + names[:k]


def keep_fastest(best: dict, name: str, result: tuple) -> None:
    """Keep ``name``'s fastest (output, seconds) run. Greedy output does not depend on timing, so
    repeating a batch only filters the host's slow spells: the fastest run is the estimate least
    disturbed by other load (timeit's rule)."""
    if name not in best or result[1] < best[name][1]:
        best[name] = result




def run_meta(meta: dict | None, base, **fields) -> dict:
    """A results file's ``meta``: the caller's (anything not JSON-plain as its string), then
    ``fields``, then the machine: torch, threads, CPU, the base's dtype."""
    plain = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in (meta or {}).items()}
    return {**plain, **fields, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(), "dtype": str(base.dtype)}
