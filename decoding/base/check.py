"""Refuse, before any work, a base the decoder cannot verify a tree on exactly as its own forward
computes (:func:`check_decodable`, probing one tree through :func:`probe_tree_logits`), and report
what of the base's architecture the decoder honours (:func:`base_report`)."""
from __future__ import annotations

import torch

from .architecture import architecture_name, attention_layout, check_forwards, check_structure
from .architecture import checked, logit_settings
from .attention import uses_packed_sdpa
from .direct import direct_body_report
from .cache import KVState
from .forward import lm_logits, prefill, ragged_capable, verify
from .packing import packed_lm_head


def check_decodable(model, probe: bool = True) -> None:
    """Refuse, before any work, a base the decoder cannot verify a tree on exactly as its own
    forward computes (:func:`~.architecture.check_forwards`: once per model object); ``probe=False``:
    only what needs no forward (:func:`~.architecture.check_structure`), before the fast paths
    are set up."""
    if probe:
        check_forwards(model, lm_logits, probe_tree_logits)
    else:
        check_structure(model)


@torch.no_grad()
def probe_tree_logits(model, prompt: torch.Tensor, tokens: torch.Tensor, parents: list[int]) -> torch.Tensor:
    """The decoder's logits (1, N, V) at the nodes of one tree (``tokens`` (N,), ``parents``: each
    node's parent index, -1 for the root) after ``prompt`` (1, T): its prefill, one
    :func:`verify` through its cache and its LM head, as a decoding step runs them."""
    attention_mask = torch.ones_like(prompt)
    cache, _ = prefill(model, prompt, attention_mask)
    kv = KVState.after_prefill(cache, attention_mask)
    nodes = len(parents)
    ancestor = torch.eye(nodes, dtype=torch.bool)
    depth = torch.zeros(nodes, dtype=torch.long)
    for node, parent in enumerate(parents):
        if parent >= 0:
            ancestor[node] |= ancestor[parent]
            depth[node] = depth[parent] + 1
    mask, positions, _ = kv.tree_inputs(ancestor, depth)
    states = verify(model, tokens[None].to(prompt.device), positions, mask, kv.cache)
    return lm_logits(model, states)


def base_report(model) -> dict[str, str]:
    """What of the base's architecture the decoder honours and which fast paths it runs for it
    (``draftheads env --base``): each path that cannot serve this base is named off, with why."""
    config = model.config
    layout = attention_layout(config)
    implementation = getattr(config, "_attn_implementation", None)
    groups = config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head = model.get_output_embeddings()
    windows = ", ".join(f"{kind}: {window or 'whole past'}" for kind, window in layout.windows)
    return {
        "architecture": architecture_name(model),
        "attention": f"{implementation}; windows per layer type: {windows}",
        "logits after the LM head": ", ".join(f"{n}={v:g}" for n, v in logit_settings(config).items()) or "none",
        "grouped-query packed attention": "on" if uses_packed_sdpa(model) else _packed_attention_off(implementation, groups),
        "ragged steps verified packed": "on" if ragged_capable(model) else "off (needs the packed attention above)",
        "packed LM head": "off (the LM head has a bias: transformers' own Linear)" if getattr(head, "bias", None)
        is not None else ("on" if packed_lm_head(model) is not None else "available where the dtype packs (at binding)"),
        "direct forward of tree steps": direct_body_report(model),
        "check against the model's own forward": "passed" if checked(model) else "not run",
    }


def _packed_attention_off(implementation: str | None, groups: int) -> str:
    if implementation != "sdpa":
        return f"off (the base attends with {implementation}, not sdpa)"
    return "off (no grouped key/value heads)" if groups <= 1 else "available (switched on when the decoder binds)"
