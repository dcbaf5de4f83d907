"""The project's error root, below everything else (in ``core/``, the floor every other one imports).

Every problem draftheads reports about what the user gave it — an argument, a file, a folder,
the Hub — is a :class:`DraftheadsError` whose message is one line naming the problem and the
fix. The command line catches this one class once, at its top, for every subcommand (one
``error:`` line, exit 2, no traceback); Python callers catch it too, or the ``ValueError`` /
``TypeError`` / ``OSError`` each subclass also is, as they did before the root existed.
"""
from __future__ import annotations

from pathlib import Path


class DraftheadsError(Exception):
    """A problem with the user's input, files or environment; the message names the fix."""


class MissingPathError(DraftheadsError, FileNotFoundError):
    """A path the user named does not exist (also a ``FileNotFoundError``)."""


class UnwritablePathError(DraftheadsError, PermissionError):
    """A destination draftheads cannot write (also a ``PermissionError``)."""


class DamagedFileError(DraftheadsError, ValueError):
    """A file that exists but cannot be read as what it claims to be: truncated, not its format
    (also a ``ValueError``)."""


class CheckpointError(DraftheadsError, ValueError):
    """A head checkpoint that cannot be used: wrong base, corrupt file, unknown family..."""


def cannot_write(path: str | Path, err: OSError) -> UnwritablePathError:
    """``err`` (raised while writing under ``path``) as the one-line error that names the path."""
    reason = err.strerror or str(err)
    return UnwritablePathError(f"cannot write to {path} ({reason}): choose a writable folder or fix its permissions.")


def one_line(message: str) -> str:
    """A message on one line (a multi-line library message joined with spaces)."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


class DataError(DraftheadsError, ValueError):
    """Training data that cannot be used as asked: missing file or column, inconsistent resume."""


class InputError(DraftheadsError, ValueError):
    """An argument or input the decoder cannot use; the message says what to pass instead."""


class InputTypeError(InputError, TypeError):
    """An argument of the wrong type (also a ``TypeError``)."""
