"""A recipe's values checked before anything runs: finite numbers, ranges, the family's options,
column mappings and the adversarial section; each error names the key (``train.lr``)."""
from __future__ import annotations

import math
from dataclasses import fields, is_dataclass
from typing import Any

from .features import MAX_TARGETS
from .recipe_sections import AdversarialSection, Recipe, RecipeError


def check_finite(section: Any, prefix: str = "") -> None:
    """Every float of the recipe (every section, every field) is a finite number: a NaN passes
    every range check (``nan <= 0`` is False) and would train to NaN weights, an infinity would
    never end (epochs) or blow up at the first step (lr)."""
    for f in fields(section):
        value, key = getattr(section, f.name), prefix + f.name
        if is_dataclass(value):
            check_finite(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise RecipeError(f"Recipe key {key} must be a finite number, got {value}.")


def check_values(recipe: Recipe) -> None:
    """Value ranges that types cannot express."""
    check_finite(recipe)
    positive = {"heads.num_heads": recipe.heads.num_heads, "heads.num_layers": recipe.heads.num_layers,
                "train.batch_size": recipe.train.batch_size, "train.grad_accum": recipe.train.grad_accum,
                "run.checkpoint_every": recipe.run.checkpoint_every, "run.eval_every": recipe.run.eval_every,
                "run.log_every": recipe.run.log_every, "data.max_length": recipe.data.max_length}
    for key, value in positive.items():
        if value < 1:
            raise RecipeError(f"Recipe key {key} must be ≥ 1, got {value}.")
    if recipe.train.chunk_length < 0:
        raise RecipeError(f"Recipe key train.chunk_length must be ≥ 1, or 0 for whole sequences; got "
                          f"{recipe.train.chunk_length}.")
    for prefix, cap in recipe.data.source_caps.items():
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
            raise RecipeError(f"Recipe key data.source_caps.{prefix} must be a count ≥ 0, got {cap!r}.")
    if recipe.train.lr <= 0:
        raise RecipeError(f"Recipe key train.lr must be > 0, got {recipe.train.lr}.")
    if recipe.loss.ce_weight == 0 and recipe.loss.kl_weight == 0:
        raise RecipeError("Recipe keys loss.ce_weight and loss.kl_weight are both 0: nothing to train on.")
    if recipe.train.epochs <= 0 and recipe.train.max_steps <= 0:
        raise RecipeError("Set train.epochs > 0 or train.max_steps > 0.")
    if recipe.heads.num_heads + 1 > MAX_TARGETS:
        raise RecipeError(f"Recipe key heads.num_heads={recipe.heads.num_heads}: feature shards store {MAX_TARGETS} "
                          f"tokens ahead, enough for at most {MAX_TARGETS - 1} heads.")
    check_adversarial(recipe.adversarial)
    check_ranges(recipe)


def check_ranges(recipe: Recipe) -> None:
    """The rest of the recipe, so that a typo fails now and not after an hour of feature
    extraction: the head family, and every number that has a valid range."""
    from ..heads import REGISTRY

    if recipe.heads.family not in REGISTRY:
        raise RecipeError(f"Recipe key heads.family={recipe.heads.family!r} is not a known head family; use one of "
                          f"{sorted(REGISTRY)}.")
    check_family_options(recipe.heads.family, recipe.heads.extra, REGISTRY[recipe.heads.family].options_class)
    resolve_feature_layers(recipe.heads.feature_layers)
    check_columns(recipe.data.columns)
    at_least = {("heads.draft_vocab_size", 0): recipe.heads.draft_vocab_size, ("data.limit", 0): recipe.data.limit,
                ("data.eval_examples", 1): recipe.data.eval_examples, ("train.max_steps", 0): recipe.train.max_steps,
                ("train.weight_decay", 0): recipe.train.weight_decay, ("train.max_grad_norm", 0): recipe.train.max_grad_norm,
                ("run.keep_checkpoints", 1): recipe.run.keep_checkpoints, ("run.eval_positions", 0): recipe.run.eval_positions,
                ("run.default_budget", 0): recipe.run.default_budget, ("loss.ce_weight", 0): recipe.loss.ce_weight,
                ("loss.kl_weight", 0): recipe.loss.kl_weight, ("loss.noise_alpha", 0): recipe.loss.noise_alpha,
                ("loss.kl_topk", 0): recipe.loss.kl_topk}
    for (key, low), value in at_least.items():
        if value < low:
            raise RecipeError(f"Recipe key {key} must be ≥ {low}, got {value}.")
    for key, value in {"train.warmup_ratio": recipe.train.warmup_ratio,
                       "train.min_lr_ratio": recipe.train.min_lr_ratio}.items():
        if not 0 <= value <= 1:
            raise RecipeError(f"Recipe key {key} must be in [0, 1], got {value}.")
    for key, value in {"loss.temperature": recipe.loss.temperature, "loss.head_decay": recipe.loss.head_decay}.items():
        if value <= 0:
            raise RecipeError(f"Recipe key {key} must be > 0, got {value}.")
    if recipe.run.trees_from == "dev" and not recipe.data.eval_path:
        raise RecipeError("Recipe key run.trees_from: dev fits the trees on data.eval_path, which is not set: set "
                          "data.eval_path (an evaluation job's folder) or run.trees_from: held_out.")
    if recipe.run.keep_best and not recipe.run.eval_each_epoch:
        raise RecipeError("Recipe key run.keep_best picks the best of the per-epoch evaluations, which "
                          "run.eval_each_epoch: false switches off: set run.keep_best: false to keep the last heads.")
    if not recipe.run.tree_budgets or min(recipe.run.tree_budgets) < 1:
        raise RecipeError(f"Recipe key run.tree_budgets must be a non-empty list of node budgets ≥ 1, got "
                          f"{recipe.run.tree_budgets}.")
    check_distillation(recipe)


def check_distillation(recipe: Recipe) -> None:
    """``data.prompt_positions`` and ``loss.kl_topk`` against the rest of the recipe: prompt
    positions are labelled with the base's own predictions, which a job folder keeps (the text
    there is the user's, never a label), and only for heads that read the prompt when they decode
    or read no context at all; a top-K KL needs the KL term on and a K the draft vocabulary has."""
    from ..heads import REGISTRY

    family = REGISTRY.get(recipe.heads.family)
    if getattr(family, "requires_feature_layers", False) and not recipe.heads.feature_layers:
        raise RecipeError(f"Recipe key heads.feature_layers: {recipe.heads.family} heads read base layers, not the final "
                          "state alone: name them (EAGLE-3's low, middle and high layer, e.g. [2, 15, 27] of a "
                          "30-layer base), or default.")
    if getattr(family, "reads_next_tokens", False) and recipe.data.kind != "job":
        raise RecipeError(f"Recipe key data.kind={recipe.data.kind!r}: {recipe.heads.family} heads read whole "
                          "sequences, the prompt's positions too, which a self-distillation job folder keeps: train on "
                          "a job folder (data.kind: job).")
    if recipe.data.prompt_positions:
        if recipe.data.kind != "job":
            raise RecipeError(f"Recipe key data.prompt_positions: true labels prompt positions with the base's own "
                              f"predictions, which a self-distillation job folder keeps (predicted.npy), not data.kind "
                              f"{recipe.data.kind}: train on a job folder (data.kind: job), or set "
                              "data.prompt_positions: false.")
        if recipe.loss.labels != "teacher":
            raise RecipeError("Recipe keys data.prompt_positions: true and loss.labels: text do not go together: on "
                              "prompt positions the text is the user's, not the base's distribution; set loss.labels: "
                              "teacher (the base's own predictions), or data.prompt_positions: false.")
        family = REGISTRY[recipe.heads.family]
        if getattr(family, "contextual", False) and not getattr(family, "reads_next_tokens", False) \
                and recipe.heads.extra.get("prefix_context") != "sequence":
            raise RecipeError(f"Recipe key data.prompt_positions: {recipe.heads.family} heads whose context layer "
                              "reads the answer only (heads.extra.prefix_context: answer) never see the prompt when "
                              "they decode; set heads.extra.prefix_context: sequence, or data.prompt_positions: false.")
    if recipe.loss.kl_topk:
        if not recipe.loss.kl_weight:
            raise RecipeError(f"Recipe key loss.kl_topk={recipe.loss.kl_topk} restricts the KL term, which "
                              "loss.kl_weight: 0 switches off: set loss.kl_weight > 0, or loss.kl_topk: 0.")
        if 0 < recipe.heads.draft_vocab_size < recipe.loss.kl_topk:
            raise RecipeError(f"Recipe key loss.kl_topk={recipe.loss.kl_topk} is larger than the draft vocabulary "
                              f"(heads.draft_vocab_size={recipe.heads.draft_vocab_size}) the teacher's top-K is taken "
                              f"over: use at most {recipe.heads.draft_vocab_size}, or 0 for the full KL.")


def resolve_feature_layers(value, num_hidden_layers: int | None = None) -> list[int]:
    """``heads.feature_layers`` as layer numbers (:func:`draftheads.heads.fusion.resolve_feature_layers`),
    a bad value one line naming the key."""
    from ..heads.fusion import resolve_feature_layers as resolve

    try:
        return resolve(value, num_hidden_layers)
    except ValueError as err:
        fix = (f"name layers below {num_hidden_layers}, or default" if num_hidden_layers is not None
               and "does not have" in str(err) else "e.g. [8, 22], or default")
        raise RecipeError(f"Recipe key heads.feature_layers: {err}; {fix}.") from None


#: what draftheads itself writes into a checkpoint's ``extra``: set by other recipe keys, never by hand
DERIVED_EXTRA = {"koala": "adversarial.enabled", "imported_from": "draftheads import-medusa"}


def check_family_options(family: str, extra: dict, options_class: type) -> None:
    """``heads.extra`` holds only the family's own options (the fields of its ``options_class``,
    which types them when the heads config is built), each of its type: a misspelt key would
    otherwise train with the default without a word."""
    import difflib

    from ..heads.family_options import OptionError, check_value

    options = options_class.kinds()
    for key, value in extra.items():
        if not isinstance(key, str) or key not in options:
            if key in DERIVED_EXTRA:
                raise RecipeError(f"Recipe key heads.extra.{key} is written by draftheads ({DERIVED_EXTRA[key]}), not "
                                  "set by hand: remove it.")
            close = difflib.get_close_matches(str(key), list(options), n=1)
            known = f"its options are {', '.join(sorted(options))}" if options else "it has no options"
            fix = f"did you mean {close[0]}?" if close else "remove it or fix its spelling."
            raise RecipeError(f"Recipe key heads.extra.{key} is not an option of {family} heads ({known}): {fix}")
        try:
            check_value(family, key, value, options[key])
        except OptionError as err:
            raise RecipeError(f"Recipe key heads.extra.{key} must be {err.expected}, got {value!r}.") from None


def check_columns(columns: dict) -> None:
    """``data.columns`` maps a column of the data to the column draftheads reads: both names,
    each target once (two columns renamed to one would make one of them disappear)."""
    usage = "write {column in the data: column draftheads reads}, e.g. {question: prompt}"
    for old, new in columns.items():
        if not isinstance(old, str) or not old.strip():
            raise RecipeError(f"Recipe key data.columns: the key {old!r} is not a column name; {usage}.")
        if not isinstance(new, str) or not new.strip():
            raise RecipeError(f"Recipe key data.columns.{old}: {new!r} is not a column name; {usage}.")
    targets = list(columns.values())
    twice = next((t for t in targets if targets.count(t) > 1), None)
    if twice is not None:
        sources = [old for old, new in columns.items() if new == twice]
        raise RecipeError(f"Recipe key data.columns renames {' and '.join(map(repr, sources))} both to {twice!r}: "
                          "map one column of the data to each column draftheads reads.")


def check_adversarial(adv: AdversarialSection) -> None:
    """The adversarial section's ranges (checked even when it is off, so a typo'd value never
    waits for the day it is switched on)."""
    for key, value in {"weight": adv.weight, "warmup_steps": adv.warmup_steps, "ramp_steps": adv.ramp_steps,
                       "grad_penalty": adv.grad_penalty}.items():
        if value < 0:
            raise RecipeError(f"Recipe key adversarial.{key} must be ≥ 0, got {value}.")
    for key, value in {"disc_hidden": adv.disc_hidden, "disc_steps": adv.disc_steps}.items():
        if value < 1:
            raise RecipeError(f"Recipe key adversarial.{key} must be ≥ 1, got {value}.")
    if adv.disc_lr <= 0:
        raise RecipeError(f"Recipe key adversarial.disc_lr must be > 0, got {adv.disc_lr}.")
    if not 0 <= adv.label_smoothing < 0.5:
        raise RecipeError(f"Recipe key adversarial.label_smoothing must be in [0, 0.5) (REAL targets become "
                          f"1 − s), got {adv.label_smoothing}.")
    if adv.schedule == "linear" and adv.ramp_steps < 1:
        raise RecipeError("Recipe key adversarial.schedule=linear needs adversarial.ramp_steps ≥ 1 (the steps over "
                          "which λ grows to adversarial.weight); use schedule: constant for a fixed λ.")
    if adv.schedule == "constant" and adv.ramp_steps:
        raise RecipeError(f"Recipe key adversarial.ramp_steps={adv.ramp_steps} only applies to schedule: linear "
                          "(the schedule is constant).")
