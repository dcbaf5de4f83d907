"""The draft sources draftheads ships, registered in the merge's tie-break order (most local
first, as in Hierarchy Drafting): the heads, the row's own context, the model store, the bigram
statistics. A new source is a module building its :class:`~.registry.SourceSpec` and one entry
here (or its own :func:`~.registry.register` call, which ranks it after these)."""
from .context_source import CONTEXT
from .heads_drafter import HEADS
from .registry import register
from .stats import STATS
from .store_source import STORE

#: the built-in sources, in id order
BUILT_IN = (HEADS, CONTEXT, STORE, STATS)
for spec in BUILT_IN:
    register(spec)
