"""What a head checkpoint's ``config.json`` holds, the folder's file names, and the family
registry: the ground of ``heads/``, imported by the interface (:mod:`.protocol`), the families
and the checkpoint format (:mod:`.checkpoint`), importing none of them (the families fill
:data:`REGISTRY` as they import)."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from torch import nn

from ..core.errors import CheckpointError, InputError, InputTypeError
from .family_options import FamilyOptions, KoalaOptions
from .fusion import feature_layer_problem


CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"
#: 1: the first layout (no version recorded); 2: adds ``draftheads_version``, ``base_revision``
#: and ``owns_lm_head``; 4: adds ``expected_tau_on``; 5: adds ``feature_layers``. A reader loads every
#: format up to its own and names both versions otherwise.
FORMAT_VERSION = 5
#: keys formats 1-2 kept in ``extra`` that format 3 made typed fields (moved on load)
PROMOTED_FROM_EXTRA = ("default_budget", "expected_tau", "default_budget_by_dtype")
#: the drafted part of a checkpoint's expected τ that decoding counts on, by what it was measured on:
#: held-out training text is in-distribution (MT-Bench read 0.66-0.88 of its drafted part,
#: docs/measurements.md); on the base's answers to evaluation prompts, the 8-node tree's decoded τ
#: read above it (1.75 against 1.68: results/data_scaling/hydra-union)
EXPECTED_TAU_SCALE = {"held_out": 0.75, "dev": 1.0}
#: what each ``expected_tau_on`` value names, in words (the model card's)
EXPECTED_TAU_TEXT = {"held_out": "held-out positions of the training data",
                     "dev": "the base's answers to the evaluation prompts"}
#: the package version, recorded in every ``config.json`` (``draftheads.__version__`` reads it)
DRAFTHEADS_VERSION = "0.1.0"


@dataclass
class HeadConfig:
    """Everything needed to rebuild a head module; saved as ``config.json``.

    ``draft_vocab_size`` > 0 restricts draft logits to the most frequent tokens (ids kept in
    the checkpoint as ``vocab_ids``): drafting and training get several times cheaper, and a
    token outside the subset simply cannot be drafted (verification stays exact).

    ``options`` are the family's own (its ``options_class``: :class:`~.amphista.AmphistaOptions`
    ...), ``koala`` what KOALA training recorded. ``config.json`` keeps both where formats 1-3
    always had them, as keys of ``extra``: :meth:`from_dict` reads them from there (and so does
    the constructor, for a recipe's ``heads.extra``), :meth:`to_dict` writes them back, so the
    file format is unchanged. What stays in ``extra`` is provenance no head reads (the recipe,
    held-out accuracy, an import's source).
    """

    family: str = "medusa"
    num_heads: int = 4
    num_layers: int = 1
    hidden_size: int = 576
    vocab_size: int = 49152
    draft_vocab_size: int = 0
    base_fingerprint: dict | None = None
    base_name: str | None = None
    trees: dict[str, list[list[int]]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    #: Hub revision (commit/tag) of the base, where known
    base_revision: str | None = None
    #: True: every head has its own ``Linear(d, V_draft)`` instead of reading out through the
    #: base's frozen LM head (imported Medusa-1 checkpoints); families that cannot refuse it.
    owns_lm_head: bool = False
    #: the draftheads version that wrote the checkpoint (None: written before versions were recorded)
    draftheads_version: str | None = None
    #: the node budget of the default tree (when no per-dtype choice applies)
    default_budget: int = 4
    #: expected tokens per verification step of each stored tree, {budget: τ}, measured by
    #: training's tree search (the adaptive policy's prior) on ``expected_tau_on``'s text
    expected_tau: dict[str, float] = field(default_factory=dict)
    #: what ``expected_tau`` was measured on: "held_out" (the training data's own held-out answers:
    #: in-distribution, decoding reads less) or "dev" (the base's answers to evaluation prompts);
    #: decoding scales the drafted part by :data:`EXPECTED_TAU_SCALE` of it
    expected_tau_on: str = "held_out"
    #: the cost model's default budget per dtype name, {"bfloat16": {"budget": 6, ...}}
    #: (``scripts/default_trees.py``: a calibration of the step × ``expected_tau``)
    default_budget_by_dtype: dict[str, dict] = field(default_factory=dict)
    #: the family's typed options (left as the base class: read from ``extra``'s keys)
    options: FamilyOptions = field(default_factory=FamilyOptions)
    #: KOALA's settings when the heads were trained with it (``extra.koala`` on disk)
    koala: KoalaOptions | None = None
    #: base layers the heads read beside its final state (``output_hidden_states`` numbering, see
    #: :mod:`.fusion`); [] (every checkpoint before format 5): the final state only
    feature_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        defaults = {f.name: (f.default_factory() if callable(f.default_factory) else f.default) for f in fields(self)}
        self.extra = dict(self.extra)
        for key in PROMOTED_FROM_EXTRA:  # formats 1-2 kept these untyped in ``extra``
            if key in self.extra:
                value = self.extra.pop(key)
                if getattr(self, key) == defaults[key]:
                    setattr(self, key, value)
        self._type_options()
        for name in ("num_heads", "num_layers", "hidden_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"HeadConfig.{name} must be a positive integer, got {value!r}.")
        check_expected_tau(self.expected_tau)
        if self.expected_tau_on not in EXPECTED_TAU_SCALE:
            raise ValueError(f"HeadConfig.expected_tau_on must be one of {sorted(EXPECTED_TAU_SCALE)}, "
                             f"got {self.expected_tau_on!r}.")
        problem = feature_layer_problem(self.feature_layers)
        if problem is not None:
            raise ValueError(f"HeadConfig: {problem}.")
        self.feature_layers = list(self.feature_layers)
        if not isinstance(self.draft_vocab_size, int) or not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"HeadConfig.draft_vocab_size must be in [0, vocab_size={self.vocab_size}] "
                             f"(0 = full vocabulary), got {self.draft_vocab_size!r}.")

    def _type_options(self) -> None:
        """Type the family's options and KOALA's record, taking them out of ``extra`` where they
        are given there (a checkpoint's ``config.json``, a recipe's ``heads.extra``)."""
        kind = REGISTRY[self.family].options_class if self.family in REGISTRY else FamilyOptions
        named = sorted(key for key in self.extra if key in kind.kinds())
        given, self.extra = kind.split(self.extra)
        if type(self.options) is FamilyOptions:
            self.options = given
        elif named:
            raise ValueError(f"HeadConfig: the {self.family} options {named} are given twice, in options and in "
                             "extra; give them once, in options.")
        if type(self.options) is not kind:
            raise ValueError(f"HeadConfig.options is {type(self.options).__name__} but {self.family} heads take "
                             f"{kind.__name__}: pass {kind.__name__}(...).")
        if "koala" in self.extra:
            if self.koala is not None:
                raise ValueError("HeadConfig: KOALA's settings are given twice, in koala and in extra; give them "
                                 "once, in koala.")
            self.koala = self.extra.pop("koala")
        if self.koala is not None:
            self.koala = KoalaOptions.from_value(self.koala)

    def to_dict(self) -> dict:
        """``config.json``'s object: the typed options go back to their keys in ``extra``."""
        data = {"format_version": FORMAT_VERSION, **asdict(self), "draftheads_version": DRAFTHEADS_VERSION}
        del data["options"], data["koala"]
        koala = {"koala": self.koala.to_extra()} if self.koala is not None else {}
        data["extra"] = {**self.options.to_extra(), **koala, **data["extra"]}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "HeadConfig":
        """Read any format up to :data:`FORMAT_VERSION` (older ones lack keys, which keep their
        defaults); a newer checkpoint fails naming the version that wrote it and this one."""
        version = data.get("format_version", 1)
        known = {f.name for f in fields(cls)} - {"options", "koala"}  # on disk: keys of ``extra``
        unknown = set(data) - known - {"format_version"}
        if not isinstance(version, int) or version > FORMAT_VERSION or unknown:
            what = f"format {version}" + (f" with unknown keys {sorted(unknown)}" if unknown else "")
            raise CheckpointError(
                f"config.json is {what}, written by draftheads {data.get('draftheads_version') or 'unknown'}; this is "
                f"draftheads {DRAFTHEADS_VERSION}, which reads formats 1-{FORMAT_VERSION}. Upgrade draftheads "
                f"(pip install -U draftheads) to load it.")
        return cls(**{k: v for k, v in data.items() if k in known})


def check_expected_tau(expected_tau: Any) -> None:
    """``expected_tau``: {node budget: τ}, each budget a whole number ≥ 1 (a JSON key: its digits)
    and each τ a number ≥ 1 (tokens per verification step, the base's own included)."""
    if not isinstance(expected_tau, dict):
        raise CheckpointError(f"HeadConfig.expected_tau must be an object {{node budget: expected τ}} such as "
                              f"{{\"3\": 1.7}}, got {type(expected_tau).__name__} {expected_tau!r}; fix config.json "
                              "or re-download the checkpoint.")
    for budget, tau in expected_tau.items():
        whole = str(budget).isdigit() and int(budget) >= 1 and not isinstance(budget, bool)
        number = isinstance(tau, (int, float)) and not isinstance(tau, bool) and math.isfinite(tau) and tau >= 1
        if not (whole and number):
            raise CheckpointError(f"HeadConfig.expected_tau[{budget!r}] = {tau!r}: each entry must map a node "
                                  "budget (a whole number ≥ 1) to a number ≥ 1 (expected tokens per step); fix "
                                  "config.json or re-download the checkpoint.")


#: family name → head class (filled by :func:`register` as the family modules import)
REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: make a family loadable by name from ``config.json``. A family is an
    ``nn.Module`` class (a :class:`~.protocol.DraftHeads`) with its own ``family`` name and a
    :class:`~.family_options.FamilyOptions` class; each refusal is one line naming the class."""
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise InputTypeError(f"register() takes a head family class (a subclass of draftheads.heads.DraftHeads), "
                             f"got {type(cls).__name__} {cls!r}: decorate the class itself with @register.")
    family = getattr(cls, "family", None)
    if not isinstance(family, str) or not family or family != family.strip().lower():
        raise InputError(f"Head family class {cls.__name__} has family={family!r}: set family to its name in "
                         "config.json, a lowercase word such as 'medusa'.")
    options = getattr(cls, "options_class", FamilyOptions)
    if not isinstance(options, type) or not issubclass(options, FamilyOptions):
        raise InputError(f"Head family {family!r}: options_class={options!r} is not a FamilyOptions subclass; "
                         "declare the family's options as a frozen dataclass subclassing FamilyOptions.")
    known = REGISTRY.get(family)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise InputError(f"Head family {family!r} is registered already (by {known.__qualname__}); give "
                         f"{cls.__name__} another family name.")
    REGISTRY[family] = cls
    return cls


def build_heads(config: HeadConfig) -> nn.Module:
    """Fresh heads of ``config.family`` (registered families only)."""
    if config.family not in REGISTRY:
        raise CheckpointError(f"Unknown head family {config.family!r}; known families: {sorted(REGISTRY)}.")
    return REGISTRY[config.family](config)


def display_name(family: str) -> str:
    """A registered family's display name ("Medusa", "Hydra++"), else the family string."""
    cls = REGISTRY.get(family)
    return (cls.display_name if cls is not None else "") or family


def read_json_object(path: str | Path, what: str, fix: str) -> dict:
    """The one reader of the JSON objects draftheads keeps beside its files (``config.json``, a
    training report, bench results, a run's ``recipe.json``): every way the file can be
    unusable — missing, unreadable, not UTF-8, not JSON, not an object — is one
    :class:`CheckpointError` naming the file, ``what`` it should be, and ``fix``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} not found: {what} is needed here; {fix}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({err.strerror or err}); {fix}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({type(err).__name__}: {err}), so it is not {what}; "
                              f"{fix}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not {what} (a JSON object); {fix}")
    return data


def read_config(directory: str | Path) -> HeadConfig:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a head checkpoint is a directory with {CONFIG_NAME} and {WEIGHTS_NAME}.")
    data = read_json_object(path, "a head checkpoint's config", "the checkpoint is corrupt: re-download or re-train it.")
    if "family" not in data and ("model_type" in data or "architectures" in data):
        raise CheckpointError(f"{path} is a model's config (model_type {data.get('model_type')!r}), not draft heads: "
                              "pass the folder heads.save_pretrained() or training wrote (its config.json has a "
                              "'family'), and the base with --base / base_name_or_path.")
    try:
        return HeadConfig.from_dict(data)
    except CheckpointError as err:
        raise CheckpointError(f"{path}: {err}") from None
    except (TypeError, ValueError) as err:  # a field of the wrong type or out of range
        raise CheckpointError(f"{path}: {err} Fix the field or re-download the checkpoint.") from None
