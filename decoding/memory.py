"""What decoding a batch needs in memory, estimated from the model config alone, and the check
that refuses a batch the free memory cannot hold, before any work (:func:`check_memory`). The
tree size it prices is the widest step the drafter declares (``Drafter.max_nodes``), not the
policy's tree: a merged step verifies the lookups' nodes beside it."""
from __future__ import annotations

import torch

from .base.cache import RESERVE_FRACTION, RESERVE_SLOTS
from .base.hardware import available_ram_bytes


def available_memory_bytes(device: torch.device) -> int | None:
    """Free memory where the cache will live (None when it cannot be told)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        return available_ram_bytes()
    return None


def decode_memory_bytes(config, batch: int, width: int, new_tokens: int, tree_nodes: int,
                        bytes_per_value: int) -> dict[str, int]:
    """Upper estimate of what decoding a batch allocates, from the model config alone: the KV
    cache at its longest (prompt + new tokens + one tree per row), the prefill's activations
    (hidden states, MLP, the 4D mask and attention scores of a width × width prompt) and the
    verification logits (tree nodes × vocabulary per row). The cache keeps room ahead
    (:func:`~draftheads.decoding.base.cache.reserved_layer_class`), and a layer that outgrows its
    room holds its old buffer until the copy is done."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    inter = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    longest = width + new_tokens + tree_nodes
    per_slot = 2 * kv_heads * head_dim * batch * bytes_per_value
    kv = per_slot * (config.num_hidden_layers * (longest + max(RESERVE_SLOTS, int(longest * RESERVE_FRACTION))) + longest)
    prefill_act = batch * width * (4 * config.hidden_size + 3 * inter) * bytes_per_value \
        + batch * (heads + 1) * width * width * bytes_per_value
    verify_act = batch * tree_nodes * (config.vocab_size + 4 * config.hidden_size + 3 * inter) * bytes_per_value
    return {"kv_cache": kv, "activations": max(prefill_act, verify_act), "total": kv + max(prefill_act, verify_act)}


def check_memory(base, batch: int, width: int, new_tokens: int, tree_nodes: int) -> None:
    """Refuse, before any work, a batch whose estimated footprint exceeds the free memory."""
    param = next(base.parameters())
    free = available_memory_bytes(param.device)
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
