"""The draft sources by name: each declares once what the rest of drafting derives from it.

A :class:`SourceSpec` names a source (its ``sources=`` name), its prior hit rate, and for a
lookup source its configuration dataclass, how a row's source starts and how a step's rows
propose at once, whether it is static (its data never changes during a request, so it is muted
for a row where it keeps missing) and what must be loaded for it (a head checkpoint, a model
store). The names ``sources=`` and the CLI accept, the hit-rate priors, the lookup sources'
configurations and classes, ``sources="auto"``'s choice and the missing-file checks all read
this registry. A new source is one module building its spec and one :func:`register` line
(the built-in ones: :mod:`.sources`); register before building a model.

The registration order is the source's id (a node's ``source``): on an exact score tie the
merge keeps the lower id, so sources register most local first (Hierarchy Drafting's order).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable, Mapping, Sequence

from ...core.errors import InputError, InputTypeError

#: what a source may need loaded (``SourceSpec.needs``)
LOADABLE = {"heads": "a head checkpoint", "store": "a model store"}
#: words ``sources=`` gives a meaning of its own, so no source may take them as its name
RESERVED = ("all", "auto", "none")
#: a node's source id is an int8
MOST_SOURCES = 127


def reads_nothing(loaded: Mapping[str, Any]) -> None:
    """The shared data of a source that reads no loaded file (each row indexes its own text)."""
    return None


@dataclass(frozen=True)
class SourceSpec:
    """One draft source, as the registry knows it (see the module docstring).

    ``prior(bucket)``: the calibration q before any observation, for a node of this source in
    that bucket (match length for lookups, depth for the heads). For a lookup source:
    ``config`` its configuration dataclass (with an ``eos_token_id`` field: drafts are cut after
    EOS), ``shared(loaded)`` what all rows read, built once per drafter from the loaded files
    (``{"store": ModelStore | None}``), ``start(prompt, config, shared)`` one row's
    :class:`~.interface.LookupSource`, and ``propose_rows(row_sources, budget)`` every row's
    candidates of a step as one :class:`~.candidates.CandidateBatch` (``None`` for a row that
    does not ask it). The heads register without these: they draft from hidden states, not
    from a row's text, and the merged drafter calls them itself."""

    name: str
    prior: Callable[[int], float]
    config: type | None = None
    start: Callable[[Sequence[int], Any, Any], Any] | None = None  # → a LookupSource (imported by none here)
    propose_rows: Callable[[Sequence[Any], int], Any] | None = None  # → a CandidateBatch
    static: bool = False
    needs: tuple[str, ...] = ()
    shared: Callable[[Mapping[str, Any]], Any] = reads_nothing

    @property
    def lookup(self) -> bool:
        """A lookup source (drafts from each row's text), not the heads."""
        return self.start is not None


#: name → spec, in registration (= id, = tie-break) order
REGISTRY: dict[str, SourceSpec] = {}
_IDS: dict[str, int] = {}  # name → id
_BY_ID: list[SourceSpec] = []  # id → spec


def register(spec: SourceSpec) -> SourceSpec:
    """Add a source (it takes the next id); checks what the rest of drafting relies on, each
    refusal one line naming the source (:func:`check_spec`)."""
    check_spec(spec)
    name = spec.name
    if REGISTRY.get(name) is spec:
        return spec
    if name in REGISTRY:
        raise InputError(f"A draft source named {name!r} is registered already; pick another name.")
    if not spec.lookup and any(not other.lookup for other in REGISTRY.values()):
        raise InputError(f"Draft source {name!r} has no start(): only the heads draft without one; a new source drafts "
                         "from each row's text, so give it start, propose_rows and a config dataclass.")
    if len(REGISTRY) >= MOST_SOURCES:
        raise InputError(f"At most {MOST_SOURCES} draft sources can be registered (a node's source is an int8).")
    REGISTRY[name] = spec
    _renumber()
    return spec


def check_spec(spec: Any) -> None:
    """What :func:`register` needs of a spec before anything reads it: a :class:`SourceSpec`
    whose name is a lowercase word, whose callables are callable and whose needs are loadable."""
    if not isinstance(spec, SourceSpec):
        raise InputTypeError(f"register() takes a SourceSpec, got {type(spec).__name__} {spec!r}: build one "
                             "with draftheads.decoding.drafters.SourceSpec(name, prior, config, start=..., "
                             "propose_rows=...).")
    name = spec.name
    if not isinstance(name, str):
        raise InputTypeError(f"Draft source name {name!r} ({type(name).__name__}): a source's name is a str, a "
                             "lowercase word such as 'repeat'.")
    if not name or name != name.strip().lower() or "," in name or name in RESERVED:
        raise InputError(f"Draft source name {name!r}: use a lowercase word without commas, not one of {RESERVED}.")
    for field_name in ("prior", "start", "propose_rows", "shared"):
        value = getattr(spec, field_name)
        if not callable(value) and (value is not None or field_name in ("prior", "shared")):
            raise InputTypeError(f"Draft source {name!r}: {field_name}={value!r} is not callable; pass a function "
                                 "(see SourceSpec's docstring for its arguments).")
    if not isinstance(spec.static, bool):
        raise InputTypeError(f"Draft source {name!r}: static={spec.static!r}: expected True or False.")
    needs = spec.needs
    if not isinstance(needs, tuple) or any(not isinstance(n, str) or n not in LOADABLE for n in needs):
        raise InputError(f"Draft source {name!r} needs {needs!r}; a source needs a tuple of {sorted(LOADABLE)} "
                         "(or () for nothing).")
    if spec.lookup and (spec.propose_rows is None or not isinstance(spec.config, type) or not is_dataclass(spec.config)
                        or "eos_token_id" not in {f.name for f in fields(spec.config)}):
        raise InputError(f"Lookup source {name!r} needs propose_rows and a config dataclass with an "
                         "eos_token_id field.")


def unregister(name: str) -> None:
    """Remove a source (tests); the sources registered after it move up one id."""
    REGISTRY.pop(name)
    _renumber()


def _renumber() -> None:
    _IDS.clear()
    _IDS.update({n: i for i, n in enumerate(REGISTRY)})
    _BY_ID[:] = REGISTRY.values()


def source_id(name: str) -> int:
    """The id a source's nodes carry (its registration position)."""
    return _IDS[name]


def spec_of(source: int | str) -> SourceSpec:
    """The spec of a source, by id or by name."""
    return REGISTRY[source] if isinstance(source, str) else _BY_ID[int(source)]


def source_count() -> int:
    return len(REGISTRY)


def source_names() -> tuple[str, ...]:
    """Every source ``sources=`` accepts, in id order."""
    return tuple(REGISTRY)


def lookup_names() -> tuple[str, ...]:
    """The lookup sources, in id order (most local first)."""
    return tuple(name for name, spec in REGISTRY.items() if spec.lookup)


def needing(what: str, names: Sequence[str] | None = None) -> tuple[str, ...]:
    """Those of ``names`` (default: every source) that need ``what`` loaded (:data:`LOADABLE`)."""
    return tuple(n for n in (source_names() if names is None else names) if n in REGISTRY and what in REGISTRY[n].needs)


def available(loaded: Sequence[str], lookups_only: bool = False) -> tuple[str, ...]:
    """The sources whose needs are all among ``loaded``, in id order."""
    return tuple(name for name, spec in REGISTRY.items()
                 if set(spec.needs) <= set(loaded) and (spec.lookup or not lookups_only))
