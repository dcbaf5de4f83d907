"""Which drafter a model uses: the source names (``sources=``, read from the registry
:mod:`.registry`), the store file beside the heads, and the drafter built from them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from ...heads import DraftHeads
from ..cost import LINEAR_COST, CostModel
from ...core.errors import InputError, InputTypeError
from ..tree import Tree
from .heads_drafter import HeadsDrafter
from .sources.heads_source import HEADS
from .lookup import LookupConfig, LookupSources
from .merged import MergedDrafter
from .interface import Drafter
from .registry import available, lookup_names, needing, source_names, spec_of
from .store import ModelStore, StoreError, tokenizer_identity
from .width import PACKED_PADDING_SHARE, PADDED_SLOT_SHARE, WidthChooser


#: the store file a head checkpoint ships beside its weights (``draftheads store build``)
STORE_NAME = "lookup_store.safetensors"


def parse_sources(sources: str | Sequence[str]) -> tuple[str, ...]:
    """``"heads,context"`` / ``["heads", "context"]`` / ``"all"`` → the source names, checked,
    in the registry's order."""
    known = source_names()
    if not isinstance(sources, (str, list, tuple)) or any(not isinstance(n, str) for n in
                                                           ([] if isinstance(sources, str) else sources)):
        raise InputTypeError(f"sources must be a str such as 'heads,context' (or 'all') or a list/tuple of such names, "
                             f"got {type(sources).__name__} {sources!r}; the sources are {', '.join(known)}.")
    names = sources.split(",") if isinstance(sources, str) else list(sources)
    names = [n.strip().lower() for n in names if n.strip()]
    if names == ["all"]:
        return known
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise InputError(f"sources={sources!r}: expected a comma-separated subset of {', '.join(known)} "
                         "(or 'all').")
    return tuple(n for n in known if n in names)


def check_review(review: bool, sources: Sequence[str]) -> None:
    """The vertical cascade needs the heads (the reviewers) and a lookup source (the reviewed)."""
    if not isinstance(review, bool):
        raise InputError(f"review={review!r}: expected True (the heads rescore lookup drafts) or False.")
    if review and (HEADS.name not in sources or not [s for s in sources if s != HEADS.name]):
        raise InputError(f"review=True: the heads review lookup drafts, so sources must include 'heads' and at "
                         f"least one of {', '.join(lookup_names())} (got {','.join(sources)}).")


def build_drafter(sources: Sequence[str], heads: DraftHeads | None, store=None, cost: CostModel | None = None,
                  eos_token_id: int | None = None, review: bool = False, packed_ragged: bool = False,
                  heads_tree: Tree | None = None, offer: Callable[[Tree], Tree] | None = None,
                  per_row: bool = False, vocab: int | None = None) -> Drafter:
    """The drafter for ``sources`` (:func:`parse_sources`): the heads alone → :class:`HeadsDrafter`
    (filling ``offer``'s larger tree where given); any lookup → :class:`MergedDrafter` (with the
    heads when "heads" is among them, filling ``heads_tree`` where given; ``per_row``: each row
    its own node count). ``packed_ragged``: the base verifies ragged rows packed
    (:func:`~..base.verifies_ragged`), so the width chooser prices a ragged step's padding at
    :data:`~.width.PACKED_PADDING_SHARE`. ``vocab``: the base's embedding rows, the bound every
    lookup source's proposed ids are checked against (:func:`~.lookup.check_proposals`)."""
    if heads is None and needing("heads", sources):
        raise InputError(f"sources include {', '.join(repr(n) for n in needing('heads', sources))} but no head "
                         f"checkpoint was loaded: pass heads_path, or draft with lookups only "
                         f"(sources='{','.join(lookup_names())}').")
    check_review(review, sources)
    lookups = [s for s in sources if s != HEADS.name]  # LookupSources names any unknown one
    if not lookups:
        return HeadsDrafter(heads, offer)
    config = LookupConfig(tuple(spec_of(name).config(eos_token_id=eos_token_id) for name in lookup_names()))
    lookup = LookupSources(store, config, sources=lookups, vocab=vocab)
    return MergedDrafter(heads if HEADS.name in sources else None, lookup,
                         WidthChooser(cost if cost is not None else LINEAR_COST, per_row=per_row,
                                      padding_share=PACKED_PADDING_SHARE if packed_ragged else PADDED_SLOT_SHARE),
                         review=review, heads_tree=heads_tree)


def check_store_argument(lookup_store) -> None:
    """``lookup_store=``: None (the store shipped beside the heads) or a path."""
    if lookup_store is not None and not isinstance(lookup_store, (str, Path)):
        raise InputTypeError(f"lookup_store must be a path to a lookup store file (str or Path) or None (the one "
                             f"shipped beside the heads), got {type(lookup_store).__name__} {lookup_store!r}.")
    if lookup_store is not None and not str(lookup_store).strip():
        raise InputError("lookup_store='' is empty: pass the lookup store file's path, or None (the one shipped "
                         "beside the heads).")


def open_store(path: str | Path | None, heads: DraftHeads | None, tokenizer, vocab: int | None = None):
    """The model store at ``path`` (default: beside the heads), checked against the tokenizer
    and every id against ``vocab`` (the base's embedding rows)."""
    if path is None:
        folder = heads.checkpoint_dir if heads is not None else None
        if folder is None or not (Path(folder) / STORE_NAME).is_file():
            raise StoreError(f"No {STORE_NAME} beside the heads ({folder}): build one with `draftheads store build "
                             f"--data <the base's answers.jsonl> --out <heads dir>/{STORE_NAME}` or pass lookup_store=.")
        path = Path(folder) / STORE_NAME
    return ModelStore.open(path, expect=tokenizer_identity(tokenizer) if tokenizer is not None else None,
                           vocab_limit=vocab)


def auto_sources(heads: DraftHeads | None, lookup_store: str | Path | None = None) -> tuple[str, ...]:
    """``sources="auto"``: every registered source there is data for — the heads (when loaded),
    the context, and the store and its bigram statistics when there is a store (``lookup_store``,
    or one shipped beside the heads). Faster than the heads alone on every Spec-Bench category:
    the merged tree spends each step's slots on whichever source is likelier to be accepted.
    evidence: results/drafting_sources/bench_drafts_bf16"""
    folder = heads.checkpoint_dir if heads is not None else None
    has_store = lookup_store is not None or (folder is not None and (folder / STORE_NAME).is_file())
    return available((["heads"] if heads is not None else []) + (["store"] if has_store else []))
