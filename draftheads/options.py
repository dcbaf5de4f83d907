"""Command-line option values shared by the CLI and the scripts (nothing imports the CLI):
where a ``--heads`` argument points, and ``--tree``."""
from __future__ import annotations

import argparse

from .decoding.base.loading import from_checkout


def find_heads(path: str | None) -> str | None:
    """``none`` → plain decoding; a relative path is tried from the working directory, then
    from the source checkout the package was installed from."""
    if path is None or path.lower() == "none":
        return None
    local = from_checkout(path)
    return str(local) if local.is_dir() else path  # else maybe a Hub id; DraftHeadsModel explains if not


def tree_argument(value: str) -> str | int:
    """``--tree``: ``adaptive`` or a node budget, parsed as ``from_pretrained(tree=...)`` parses it."""
    from .decoding.limits import InputError, parse_tree_option

    try:
        return parse_tree_option(value)
    except InputError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def draft_source_list() -> str:
    """The registered draft sources as ``--drafts`` spells them: ``heads,context,store,stats``."""
    from .decoding.drafters import source_names

    return ",".join(source_names())


def drafts_argument(value: str) -> tuple[str, ...]:
    """``--drafts``: a comma-separated subset of the registered draft sources (or ``all``)."""
    from .decoding.drafters import parse_drafts

    try:
        return parse_drafts(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
