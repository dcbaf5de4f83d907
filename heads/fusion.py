"""Heads that read several layers of the base: its final state (what its LM head reads) and the
residual stream after named decoder layers, fused into one state of the base's width by a
learned projection all heads share — EAGLE-3's low/middle/high features and its ``fc``
(arXiv 2503.01840, §3.2). The last layer is specialised for the base's own next token; the
lower ones keep more of what comes after it.

Layer numbers are those of transformers' ``output_hidden_states``: ``i`` is the residual stream
after ``i`` decoder layers (0 = the token embeddings), so ``0 .. num_hidden_layers − 1`` are the
layers a head may name beside the final state (the base's ``num_hidden_layers``-th entry is its
final state already, read always). A head's input is then ``(..., d · (1 + n))``: the final
state first, then each named layer's state in the order named (:func:`feature_width`).
"""
from __future__ import annotations

import torch
from torch import nn


def default_feature_layers(num_hidden_layers: int) -> list[int]:
    """The layers a quarter and three quarters of the way up a base of ``num_hidden_layers`` layers
    (SmolLM2's 30 → [8, 22]), read beside the final state: of the sets probed on SmolLM2 (EAGLE-3's
    low/middle/high, low-middle-final, middle-final, quartiles-final) the quartiles drafted best
    (evidence: results/heads/probe_layers). The final state stays the high one, so heads that start
    as last-layer heads lose nothing (:class:`FeatureFusion` starts as the identity on it). Bases too
    shallow for both: fewer."""
    low, high = num_hidden_layers // 4 + 1, 3 * num_hidden_layers // 4
    return sorted({layer for layer in (low, high) if 1 <= layer < num_hidden_layers})


def feature_width(hidden_size: int, feature_layers: list[int] | tuple[int, ...]) -> int:
    """Width of the heads' input: the final state and each named layer's."""
    return hidden_size * (1 + len(feature_layers))


def feature_layer_problem(feature_layers, num_hidden_layers: int | None = None) -> str | None:
    """Why ``feature_layers`` cannot be read (from a base of ``num_hidden_layers``, when given), or None."""
    if not isinstance(feature_layers, (list, tuple)) or any(
            isinstance(layer, bool) or not isinstance(layer, int) for layer in feature_layers):
        return f"feature_layers must be a list of layer numbers such as [8, 22], got {feature_layers!r}"
    if len(set(feature_layers)) != len(feature_layers) or list(feature_layers) != sorted(feature_layers):
        return f"feature_layers must name distinct layers in ascending order, got {list(feature_layers)}"
    if any(layer < 0 for layer in feature_layers):
        return f"feature_layers {list(feature_layers)} names a negative layer; layers count from 0 (the embeddings)"
    if num_hidden_layers is not None and any(layer >= num_hidden_layers for layer in feature_layers):
        return (f"feature_layers {list(feature_layers)} names a layer the base does not have: it has "
                f"{num_hidden_layers} layers, so 0-{num_hidden_layers - 1} (its final state is read always)")
    return None


def resolve_feature_layers(value, num_hidden_layers: int | None = None) -> list[int]:
    """The layers a configuration names, for a base of ``num_hidden_layers`` layers (None: not known
    yet, only the form is checked): ``"default"`` (or ``["default"]``, as a command line gives it) is
    :func:`default_feature_layers` ([] until the base is known), a list of layer numbers is itself.
    Anything else raises ``ValueError`` with :func:`feature_layer_problem`'s words; each caller
    names its own key or option before them."""
    if value == "default" or (isinstance(value, (list, tuple)) and list(value) == ["default"]):
        return default_feature_layers(num_hidden_layers) if num_hidden_layers is not None else []
    if isinstance(value, str):
        raise ValueError(f"feature_layers must be a list of layer numbers such as [8, 22], or default, got {value!r}")
    problem = feature_layer_problem(value, num_hidden_layers)
    if problem:
        raise ValueError(problem)
    return list(value)


class FeatureFusion(nn.Module):
    """(..., d · (1 + n)) → (..., d): each named layer's state RMS-normed (a residual stream's scale
    differs from layer to layer and from the final, normed state), then one ``Linear`` over the
    concatenation, shared by all heads. It starts as the identity on the final state (the named
    layers' columns zero), so fresh heads start as last-layer heads and a last-layer checkpoint
    warm-starts them exactly."""

    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.norms = nn.ModuleList(nn.RMSNorm(hidden_size, eps=1e-6) for _ in range(num_layers))
        self.fc = nn.Linear(hidden_size * (1 + num_layers), hidden_size, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden_size].copy_(torch.eye(hidden_size))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        final, *layers = features.split(self.hidden_size, dim=-1)
        return self.fc(torch.cat([final, *(norm(x) for norm, x in zip(self.norms, layers))], dim=-1))
