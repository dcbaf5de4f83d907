"""The heads a run starts from: fresh heads of the recipe's family and shape, bound to the frozen
LM head and embeddings, with the draft vocabulary the training labels choose — or the weights of
the checkpoint ``heads.init_from`` names, when they fit the recipe's heads (heads that read the
final state only may start heads that read base layers too: their fusion starts as the identity).
"""
from __future__ import annotations

import torch

from ..core.errors import one_line
from ..heads import DraftHeads, HeadConfig, build_heads
from .adversarial import koala_info
from .frozen import FrozenParts
from .losses import draft_vocab
from .recipe_sections import Recipe, RecipeError


def new_heads(recipe: Recipe, parts: FrozenParts, label_ids: torch.Tensor, dtype: torch.dtype,
              prompt_ids: torch.Tensor | None = None) -> DraftHeads:
    """Fresh heads of the recipe's family, bound to the frozen LM head and embeddings, reading the
    base layers ``parts.feature_layers`` beside its final state; the draft vocabulary is the most
    frequent of the training labels (ties: of ``prompt_ids``)."""
    vocab_size, d = parts.lm_head.shape
    extra = dict(recipe.heads.extra)
    if recipe.adversarial.enabled:  # a KOALA checkpoint says so (reports label it KOALA-<family>)
        extra["koala"] = koala_info(recipe.heads.family, recipe.heads.num_layers, recipe.adversarial)
    config = HeadConfig(family=recipe.heads.family, num_heads=recipe.heads.num_heads,
                        num_layers=recipe.heads.num_layers, hidden_size=d, vocab_size=vocab_size,
                        draft_vocab_size=recipe.heads.draft_vocab_size, extra=extra,
                        feature_layers=list(parts.feature_layers))
    heads = build_heads(config).to(dtype)
    if recipe.heads.init_from:
        try:
            heads.load_state_dict(start_weights(recipe.heads.init_from, config, parts.fingerprint, heads, dtype))
        except RuntimeError as err:  # shapes set by the family's options (heads.extra)
            raise RecipeError(f"heads.init_from {recipe.heads.init_from}: its weights do not fit the recipe's heads "
                              f"({one_line(err)[:200]}); set heads.extra as the checkpoint's config.json has it.") from None
    else:
        heads.vocab_ids.copy_(draft_vocab(label_ids, recipe.heads.draft_vocab_size, vocab_size, prompt_ids))
    return heads.bind(parts.lm_head, parts.embed)


#: what a starting checkpoint must share with the recipe's heads (the weights' shapes follow from them)
SAME_SHAPE = ("family", "num_heads", "num_layers", "hidden_size", "vocab_size", "draft_vocab_size")


def start_weights(path: str, config: HeadConfig, fingerprint: dict, fresh: DraftHeads | None = None,
                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The weights (draft vocabulary included) of the checkpoint ``heads.init_from`` names, for
    heads of ``config``: one made for another base, or of another family or shape, is one line.
    A checkpoint that reads the final state only starts heads that read base layers too: the
    fusion's weights are then ``fresh``'s (the identity on the final state, so the heads draft
    as the checkpoint's did); one that reads other layers than the recipe's is one line. The
    weights are read in ``dtype`` (the heads' own: a float64 checkpoint stays exact)."""
    from ..heads.checkpoint.io import load_heads

    start = load_heads(path, expected_fingerprint=fingerprint, dtype=dtype)
    differing = [f"{key} {getattr(start.config, key)!r} (recipe: {getattr(config, key)!r})" for key in SAME_SHAPE
                 if getattr(start.config, key) != getattr(config, key)]
    if start.config.feature_layers and start.config.feature_layers != config.feature_layers:
        differing.append(f"feature_layers {start.config.feature_layers} (recipe: {config.feature_layers})")
    if differing:
        raise RecipeError(f"heads.init_from {path} holds other heads than the recipe trains: " + ", ".join(differing)
                          + "; set the recipe's heads.* to match, or drop heads.init_from.")
    weights = {name: tensor.detach().clone() for name, tensor in start.state_dict().items()}
    if not start.config.feature_layers and config.feature_layers and fresh is not None:
        weights.update({name: tensor.detach().clone() for name, tensor in fresh.state_dict().items()
                        if name.startswith("fusion.")})
    return weights
