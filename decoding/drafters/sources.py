"""The draft sources draftheads ships, registered in the merge's tie-break order (most local
first, as in Hierarchy Drafting): the heads, the row's own context, the model store, the bigram
statistics. A new built-in source is a module building its :class:`~.registry.SourceSpec` and
one line in :data:`BUILT_IN` (a source outside the package calls :func:`~.registry.register`
itself, which ranks it after these)."""
from importlib import import_module

from .registry import SourceSpec, register

#: the built-in sources, in id order: "module.SPEC", one line each
BUILT_IN = (
    "heads_drafter.HEADS",
    "context_source.CONTEXT",
    "store_source.STORE",
    "stats.STATS",
)


def built_in_spec(entry: str) -> SourceSpec:
    """``"module.NAME"`` → that module's spec (the module is in this package)."""
    module, _, name = entry.rpartition(".")
    return getattr(import_module(f".{module}", __package__), name)


for entry in BUILT_IN:
    register(built_in_spec(entry))
