"""Training recipes: one YAML file → nested dataclasses, validated before anything runs.

An unknown key or a value of the wrong type is an error that names the key (``train.lr``),
so a typo never silently trains with a default. Command-line overrides use the same dotted
names (``--train.lr 5e-4``) or, when unambiguous, the bare field name (``--lr 5e-4``);
their values are parsed as YAML scalars and checked like the file.
"""
from __future__ import annotations

import hashlib
import json
import math
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from ..heads.errors import DraftheadsError, one_line
from .data import HUB_DEFAULTS
from .features import MAX_TARGETS


class RecipeError(DraftheadsError, ValueError):
    """A recipe that cannot be used: unknown key, wrong type, bad value, wrong resume dir."""


@dataclass
class HeadsSection:
    family: str = "medusa"  # any registered family: medusa, hydra, ...
    num_heads: int = 4
    num_layers: int = 1
    draft_vocab_size: int = 8192  # 0 = full vocabulary
    extra: dict[str, Any] = field(default_factory=dict)  # the family's options (typed: HeadConfig.options)


@dataclass
class DataSection:
    kind: str = "selfdistill"  # selfdistill (prompt + response_ids) | conversations (messages) | tokens (input_ids)
    # a local file, datasets dir or self-distillation output dir, or a Hub dataset id, or a list of them
    # (concatenated in order); no default: a clone carries no training set (training/data.py:load_records)
    path: str | list[str] = ""
    name: str | None = None  # Hub datasets: the configuration (load_dataset's name), e.g. main for openai/gsm8k
    split: str = "train"  # Hub datasets: the split to read
    columns: dict[str, str] = field(default_factory=dict)  # {column in the data: column read}, e.g. {question: prompt}
    features_dir: str | None = "data_cache/features-smollm2"  # fp16 hidden-state cache; null = base forward each step
    eval_examples: int = 256  # held-out examples, taken from the end of the (last) data
    limit: int = 0  # use only the first N examples (0 = all)
    max_length: int = 1024  # tokens per example (prompt + answer)
    sources: list[str] = field(default_factory=list)  # keep records whose 'source' starts with one of these
    source_caps: dict[str, int] = field(default_factory=dict)  # at most N records per 'source' prefix


@dataclass
class LossSection:
    labels: str = "teacher"  # teacher: the base's own argmax (= text when self-distilled) | text
    ce_weight: float = 1.0  # cross-entropy on the labels
    kl_weight: float = 0.0  # KL to the base's next-token distribution (Hydra++ teacher distillation)
    temperature: float = 1.0
    head_decay: float = 0.8  # head k weighted decay^k (1.0 = plain sum)
    noise_alpha: float = 0.0  # NEFTune-style uniform noise on the input hidden states


@dataclass
class TrainSection:
    epochs: float = 3.0
    max_steps: int = 0  # > 0: stop after this many optimizer steps (overrides epochs)
    batch_size: int = 512  # per process and micro-step: positions (features) or sequences (on the fly)
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.0  # cosine decays to lr · min_lr_ratio
    max_grad_norm: float = 0.0  # 0 = no clipping
    seed: int = 0
    chunk_length: int = 256  # contextual families (Hydra++): positions per sequence chunk; batch_size counts chunks
    mixed_precision: str = "bf16"  # no | bf16 | fp16 (accelerate); bf16 autocast makes CPU LM-head matmuls 2x faster
    dtype: str = "float32"  # parameter dtype of the heads (float64 for exactness tests)


@dataclass
class RunSection:
    output_dir: str = "runs/medusa-smollm2"  # checkpoints/, log.jsonl, wandb/
    final_dir: str | None = None  # save_pretrained target; default <output_dir>/final
    # auto (latest checkpoint in output_dir) | a checkpoint directory | never (starts over and DELETES
    # <output_dir>/checkpoints; refused if that folder holds anything but draftheads' step-* dirs).
    # Resuming loads data only (safetensors, JSON, weights_only torch files): see training/run_state.py
    resume: str = "auto"
    checkpoint_every: int = 200  # optimizer steps between accelerate save_state checkpoints
    keep_checkpoints: int = 2
    eval_every: int = 200
    eval_positions: int = 20000  # cap on held-out positions per evaluation
    log_every: int = 10
    wandb: bool = True  # offline unless WANDB_API_KEY is set; skipped if wandb is not installed
    wandb_project: str = "draftheads"
    tree_budgets: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64])
    default_budget: int = 4
    save_dtype: str = "bfloat16"  # dtype of the final head weights (float32/float64 keep precision)


@dataclass
class AdversarialSection:
    """KOALA's adversarial learning (arXiv 2408.08146) on top of any head family: a small
    discriminator (training/adversarial.py) tells the base's next-token distribution from the
    heads' and the heads also learn to fool it. ``enabled`` builds and trains the discriminator;
    ``weight`` = λ is how much the heads see of it (0 = they never do: the run trains exactly
    like the plain supervised one)."""

    enabled: bool = False
    weight: float = 0.1  # λ: generator loss = supervised + λ · (−log D(fake))
    schedule: str = "constant"  # constant | linear (λ ramps 0 → weight over ramp_steps after warmup)
    warmup_steps: int = 0  # optimizer steps with supervised loss only (the discriminator already trains)
    ramp_steps: int = 0  # linear schedule: steps from 0 to the full weight
    disc_lr: float = 1e-4  # the discriminator's own Adam (betas 0.5, 0.999)
    disc_hidden: int = 256  # MLP width
    disc_steps: int = 1  # discriminator updates per micro-batch (on the same batch)
    label_smoothing: float = 0.0  # one-sided: REAL targets are 1 − s
    grad_penalty: float = 0.0  # γ of the R1 penalty γ/2·‖∇D(real)‖² (0 = off)


@dataclass
class Recipe:
    name: str = "medusa-smollm2"
    base: str = "embedded"  # embedded SmolLM2, a local model dir, a Hub id in the local cache, or a .gguf
    base_dtype: str = "bfloat16"  # dtype of the frozen base for feature extraction / on-the-fly forwards
    heads: HeadsSection = field(default_factory=HeadsSection)
    data: DataSection = field(default_factory=DataSection)
    loss: LossSection = field(default_factory=LossSection)
    train: TrainSection = field(default_factory=TrainSection)
    run: RunSection = field(default_factory=RunSection)
    adversarial: AdversarialSection = field(default_factory=AdversarialSection)

    def to_dict(self) -> dict:
        return asdict(self)

    def identity(self) -> dict:
        """What must match to resume a run: everything that shapes the optimization (model,
        data, loss, schedule). ``run.*`` (logging, checkpoint cadence, paths) may change."""
        data = self.to_dict()
        data.pop("run")
        for key, default in HUB_DEFAULTS.items():
            if data["data"][key] == default:  # unused Hub options: runs from before they existed still resume
                data["data"].pop(key)
        if not self.adversarial.enabled:
            data.pop("adversarial")  # off = as before the section existed: older runs still resume
        return data

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]


CHOICES = {"data.kind": ("selfdistill", "conversations", "tokens"), "loss.labels": ("teacher", "text"),
           "train.mixed_precision": ("no", "bf16", "fp16"), "train.dtype": ("float32", "float64", "bfloat16"),
           "run.save_dtype": ("float32", "float64", "bfloat16", "float16"),
           "base_dtype": ("float32", "float64", "bfloat16", "float16"),
           "adversarial.schedule": ("constant", "linear")}


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, hint)


def _yaml_float(value: Any, hint: Any) -> Any:
    """PyYAML reads ``1e-3`` (no dot) as a string; for a float field that is a float."""
    if isinstance(value, str) and _type_ok(1.5, hint) and not _type_ok(value, hint):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def build(cls: type, data: dict, prefix: str = "") -> Any:
    """Dataclass ``cls`` from a (nested) dict; unknown keys and wrong types name the key."""
    if not isinstance(data, dict):
        raise RecipeError(f"Recipe section {prefix.rstrip('.') or '<root>'} must be a mapping, got {data!r}.")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise RecipeError(f"Unknown recipe key {prefix}{unknown[0]!s}; known keys in "
                          f"{prefix.rstrip('.') or 'the recipe root'}: {sorted(known)}.")
    values = {}
    for name, value in data.items():
        hint, key = hints[name], prefix + name
        if is_dataclass(hint):
            values[name] = build(hint, value or {}, key + ".")
            continue
        value = _yaml_float(value, hint)
        if not _type_ok(value, hint):
            raise RecipeError(f"Recipe key {key} must be {_type_name(hint)}, got {type(value).__name__} {value!r}.")
        if hint is float and value is not None:
            value = float(value)
        if key in CHOICES and value not in CHOICES[key]:
            raise RecipeError(f"Recipe key {key} must be one of {list(CHOICES[key])}, got {value!r}.")
        values[name] = value
    return cls(**values)


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        keys += _leaf_keys(hint, prefix + f.name + ".") if is_dataclass(hint) else [prefix + f.name]
    return keys


def _leaf_hint(key: str) -> Any:
    cls: Any = Recipe
    for part in key.split("."):
        cls = typing.get_type_hints(cls)[part]
    return cls


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["--train.lr", "5e-4", "--epochs=2"]`` → [(dotted key, value parsed as YAML)], bare
    field names resolved to their one dotted key."""
    leaves = _leaf_keys(Recipe)
    pairs, items = [], list(overrides)
    while items:
        item = items.pop(0)
        if not item.startswith("--"):
            raise RecipeError(f"Override {item!r} must look like --key value or --key=value.")
        key, _, value = item[2:].partition("=")
        if not _:
            if not items:
                raise RecipeError(f"Override --{key} has no value.")
            value = items.pop(0)
        key = key.replace("-", "_")
        if key not in leaves:
            matches = [leaf for leaf in leaves if leaf.rsplit(".", 1)[-1] == key]
            if len(matches) != 1:
                raise RecipeError(f"Unknown recipe key {key} in override --{key}"
                                  + (f" (ambiguous: {matches})" if matches else f"; known keys: {leaves}."))
            key = matches[0]
        parsed = yaml.safe_load(value)
        if isinstance(parsed, (bool, int, float)) and _leaf_hint(key) is str:
            parsed = value  # YAML 1.1 reads "no"/"off" as False; a str field means the text
        pairs.append((key, parsed))
    return pairs


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``["--train.lr", "5e-4", "--epochs=2"]`` → nested dict updates (values parsed as YAML)."""
    for key, value in parse_overrides(overrides):
        node = data
        *parents, last = key.split(".")
        for depth, part in enumerate(parents):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                section = ".".join(parents[:depth + 1])
                raise RecipeError(f"Recipe section {section} must be a mapping, got {node!r}; override --{key} "
                                  "cannot set a key in it.")
        node[last] = value
    return data


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (None = all defaults), apply overrides, validate."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"Recipe {path} not found; the shipped recipes are in recipes/*.yaml.")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError:
            raise RecipeError(f"Recipe {path} is not a text file (not UTF-8): pass a YAML recipe such as "
                              "recipes/medusa-smollm2.yaml.") from None
        except yaml.YAMLError as err:
            raise RecipeError(f"Recipe {path} is not valid YAML: {one_line(str(err))}") from None
        except OSError as err:
            raise RecipeError(f"Recipe {path} cannot be read ({err.strerror or err}).") from None
        if not isinstance(data, dict):
            raise RecipeError(f"Recipe {path} holds a YAML {type(data).__name__} at the top level; a recipe is a "
                              "mapping of sections (name:, base:, heads:, data:, train:...), as in recipes/*.yaml.")
    data = apply_overrides(data, overrides or [])
    try:
        recipe = build(Recipe, data)
        check_values(recipe)
    except RecipeError as err:
        if path is None:
            raise
        overridden = {key for key, _ in parse_overrides(overrides or [])}
        raise RecipeError(locate(str(err), path, key_lines(path.read_text(encoding="utf-8")), overridden)) from None
    return recipe


def key_lines(text: str) -> dict[str, int]:
    """Each dotted key written in a YAML recipe (``heads.extra.prefix_heads``) → its line, 1-based."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    lines: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = prefix + str(key.value)
                lines[name] = key.start_mark.line + 1
                walk(value, name + ".")

    walk(root, "")
    return lines


def locate(message: str, path: Path, lines: dict[str, int], overridden: set[str]) -> str:
    """A recipe error naming the key it is about, prefixed with the recipe file and the key's
    line there, so the fix is one look away (unchanged when the value came from an override)."""
    import re

    found = re.search(r"[Rr]ecipe (?:keys?|section) ([A-Za-z_][\w.+-]*\w)", message)
    if found is None:
        return message
    key = found.group(1)
    while key and key not in lines:
        key = key.rpartition(".")[0]
    if not key or any(key == o or o.startswith(key + ".") or key.startswith(o + ".") for o in overridden):
        return message
    return f"{path}, line {lines[key]}: {message}"


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
                "run.log_every": recipe.run.log_every, "data.max_length": recipe.data.max_length,
                "train.chunk_length": recipe.train.chunk_length}
    for key, value in positive.items():
        if value < 1:
            raise RecipeError(f"Recipe key {key} must be ≥ 1, got {value}.")
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
    check_columns(recipe.data.columns)
    at_least = {("heads.draft_vocab_size", 0): recipe.heads.draft_vocab_size, ("data.limit", 0): recipe.data.limit,
                ("data.eval_examples", 1): recipe.data.eval_examples, ("train.max_steps", 0): recipe.train.max_steps,
                ("train.weight_decay", 0): recipe.train.weight_decay, ("train.max_grad_norm", 0): recipe.train.max_grad_norm,
                ("run.keep_checkpoints", 1): recipe.run.keep_checkpoints, ("run.eval_positions", 0): recipe.run.eval_positions,
                ("run.default_budget", 0): recipe.run.default_budget, ("loss.ce_weight", 0): recipe.loss.ce_weight,
                ("loss.kl_weight", 0): recipe.loss.kl_weight, ("loss.noise_alpha", 0): recipe.loss.noise_alpha}
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
    if not recipe.run.tree_budgets or min(recipe.run.tree_budgets) < 1:
        raise RecipeError(f"Recipe key run.tree_budgets must be a non-empty list of node budgets ≥ 1, got "
                          f"{recipe.run.tree_budgets}.")


#: what draftheads itself writes into a checkpoint's ``extra``: set by other recipe keys, never by hand
DERIVED_EXTRA = {"koala": "adversarial.enabled", "imported_from": "draftheads import-medusa"}


def check_family_options(family: str, extra: dict, options_class: type) -> None:
    """``heads.extra`` holds only the family's own options (the fields of its ``options_class``,
    which types them when the heads config is built), each of its type: a misspelt key would
    otherwise train with the default without a word."""
    import difflib

    from ..heads.options import OptionError, check_value

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
