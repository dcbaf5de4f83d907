"""Command-line argument values the CLI, the demo's page and the scripts share (nothing of them
imports the CLI): where a ``--heads`` argument points, ``--tree`` and ``--sources`` (with its old
name ``--drafts``)."""
from __future__ import annotations

import argparse
import warnings

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
    from .core.errors import InputError
    from .decoding.input_checks import parse_tree_option

    try:
        return parse_tree_option(value)
    except InputError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def source_list() -> str:
    """The registered draft sources as ``--sources`` spells them: ``heads,context,store,stats``."""
    from .decoding.drafters import source_names

    return ",".join(source_names())


def sources_argument(value: str) -> tuple[str, ...]:
    """``--sources``: a comma-separated subset of the registered draft sources (or ``all``)."""
    from .decoding.drafters import parse_sources

    try:
        return parse_sources(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


#: where ``--drafts``, the old name of ``--sources``, is parsed to (absent unless given)
OLD_SOURCES_DEST = "old_drafts"


def add_sources_option(parser: argparse.ArgumentParser, help: str) -> None:
    """``--sources`` into ``args.sources``, and its old name ``--drafts`` (hidden; read by
    :func:`renamed_sources_option` after parsing)."""
    parser.add_argument("--sources", type=sources_argument, default=None, help=help)
    parser.add_argument("--drafts", dest=OLD_SOURCES_DEST, type=sources_argument, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)


def renamed_sources_option(args: argparse.Namespace) -> argparse.Namespace:
    """``--drafts`` given → ``args.sources``, with a FutureWarning; both given → one error line."""
    if not hasattr(args, OLD_SOURCES_DEST):
        return args
    from .core.errors import InputError

    old = getattr(args, OLD_SOURCES_DEST)
    delattr(args, OLD_SOURCES_DEST)
    if args.sources is not None:
        raise InputError("--sources and --drafts both given: --drafts is the old name of --sources; pass --sources only.")
    warnings.warn("--drafts is now --sources; --drafts still works but will be removed: pass --sources instead.",
                  FutureWarning, stacklevel=2)
    args.sources = old
    return args
