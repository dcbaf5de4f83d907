"""Typed head options: what a family lets a recipe choose beyond the fields every family shares
(:class:`~.head_config.HeadConfig`), one frozen dataclass per family declared beside it
(``options_class``), plus :class:`KoalaOptions`, which any family may carry.

Each options class checks its own values in ``__post_init__`` (one line naming the key and
the fix), so a config that holds one is valid. On disk they keep their place: the keys of
``config.json``'s ``extra`` object (and a recipe's ``heads.extra``), which is how every
checkpoint written before reads unchanged (:meth:`FamilyOptions.split`, :meth:`FamilyOptions.to_extra`).
"""
from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from ..core.errors import DraftheadsError


class OptionError(DraftheadsError, ValueError):
    """A head option of the wrong type or out of range. ``key``, ``value`` and ``expected``
    ("a whole number ≥ 1") let a caller name the option in its own terms (a recipe key)."""

    def __init__(self, owner: str, key: str, value: Any, expected: str):
        super().__init__(f"{owner} option extra.{key} must be {expected}, got {value!r}.")
        self.key, self.value, self.expected = key, value, expected


#: an option's value type → what it must be, as the error says it
EXPECTED = {int: "a whole number ≥ 1", bool: "true or false", float: "a number ≥ 0", str: "a string"}


def check_value(owner: str, key: str, value: Any, kind: type) -> None:
    """Refuse ``value`` unless it is a ``kind`` as options take it: an int ≥ 1 (never a bool),
    a bool, a float ≥ 0 (an int is a number too) or a str."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise OptionError(owner, key, value, EXPECTED.get(kind, f"a {kind.__name__}"))


def field_kinds(cls: type) -> dict[str, type]:
    """Each dataclass field's value type, ``X | None`` read as ``X``."""
    hints = typing.get_type_hints(cls)
    return {f.name: next(t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if t is not type(None))
            for f in fields(cls)}


def check_fields(options: Any, owner: str) -> None:
    """Every field of ``options`` is of its declared type; ``None`` only where that is the default
    (it then means "derived from the config", as the field's comment says)."""
    kinds = field_kinds(type(options))
    for f in fields(options):
        value = getattr(options, f.name)
        if value is None and f.default is None:
            continue
        check_value(owner, f.name, value, kinds[f.name])


@dataclass(frozen=True)
class FamilyOptions:
    """A family's options; this base class is the options of a family that has none. A
    subclass declares its fields with their defaults (``None``: derived from the config when
    the heads are built) and sets ``owner`` to the family's display name."""

    #: how errors name the family ("Amphista option extra.attn_heads ...")
    owner: ClassVar[str] = "Head"

    def __post_init__(self) -> None:
        check_fields(self, self.owner)

    @classmethod
    def kinds(cls) -> dict[str, type]:
        """Option name → value type (int options are ≥ 1): what a recipe's ``heads.extra`` is checked against."""
        return field_kinds(cls)

    @classmethod
    def split(cls, extra: dict) -> tuple["FamilyOptions", dict]:
        """``extra`` as ``config.json`` or a recipe holds it → (these options, the other keys)."""
        names = cls.kinds()
        return (cls(**{k: v for k, v in extra.items() if k in names}),
                {k: v for k, v in extra.items() if k not in names})

    def to_extra(self) -> dict:
        """The options as ``extra`` keys, for ``config.json`` (``None`` = derived: not written)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class KoalaOptions:
    """KOALA (arXiv 2408.08146) over any family: ``layers``-layer heads trained against a
    discriminator (training's ``adversarial`` recipe section). Training records it in
    ``config.json`` as ``extra.koala``; reports and cards name the checkpoint ``label``
    ("KOALA-Medusa"). The discriminator itself is not part of the checkpoint."""

    label: str
    layers: int
    adversarial_weight: float = 0.1
    schedule: str = "constant"  # constant | linear (λ ramps over ramp_steps after warmup_steps)
    warmup_steps: int = 0
    ramp_steps: int = 0
    disc_hidden: int = 256
    disc_steps: int = 1
    disc_lr: float = 1e-4
    label_smoothing: float = 0.0
    grad_penalty: float = 0.0
    paper: str = "arXiv:2408.08146"

    def __post_init__(self) -> None:
        owner = "KOALA"
        for name, kind in field_kinds(type(self)).items():
            value = getattr(self, name)
            if name in ("warmup_steps", "ramp_steps"):  # whole numbers that may be 0
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise OptionError(owner, f"koala.{name}", value, "a whole number ≥ 0")
            else:
                check_value(owner, f"koala.{name}", value, kind)
        if self.schedule not in ("constant", "linear"):
            raise OptionError(owner, "koala.schedule", self.schedule, "'constant' or 'linear'")

    @classmethod
    def from_value(cls, value: Any) -> "KoalaOptions":
        """``extra.koala`` as ``config.json`` holds it (an object) → the options."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise OptionError("KOALA", "koala", value, "an object of KOALA settings")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise OptionError("KOALA", "koala", unknown, "KOALA settings only (unknown keys)")
        return cls(**value)

    def to_extra(self) -> dict:
        return asdict(self)
