"""The draft sources draftheads ships, one module each, registered in the merge's tie-break order
(most local first, as in Hierarchy Drafting): the heads (:mod:`.heads_source`), the row's own
context (:mod:`.context_source`), the model store (:mod:`.store_source`), the bigram statistics
(:mod:`.stats_source`). A new built-in source is a module here building its
:class:`~draftheads.decoding.drafters.registry.SourceSpec` and one line in :data:`BUILT_IN` (a
source outside the package calls :func:`~draftheads.decoding.drafters.registry.register` itself,
which ranks it after these)."""
from importlib import import_module

from ..registry import SourceSpec, register

#: the built-in sources, in id order: "module.SPEC", one line each (the module is in this package)
BUILT_IN = (
    "heads_source.HEADS",
    "context_source.CONTEXT",
    "store_source.STORE",
    "stats_source.STATS",
)


def built_in_spec(entry: str) -> SourceSpec:
    """``"module.NAME"`` → that module's spec (the module is in this package)."""
    module, _, name = entry.rpartition(".")
    return getattr(import_module(f".{module}", __package__), name)


for entry in BUILT_IN:
    register(built_in_spec(entry))
