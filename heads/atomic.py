"""Files and folders written whole: a reader sees the old version or the new one, never half
of either (write into a temporary beside the destination, then rename over it)."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .config import CheckpointError
from .errors import cannot_write


def current_umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


class atomic_directory:
    """``with atomic_directory(target) as tmp:`` write into ``tmp``; on success it replaces
    ``target`` (files only the old folder had are carried over), on error it is deleted. A
    destination that cannot be written is one :class:`~.errors.UnwritablePathError` naming it."""

    def __init__(self, target: Path):
        self.target = Path(target)

    def __enter__(self) -> Path:
        if self.target.is_file():
            raise CheckpointError(f"{self.target} is a file; a checkpoint is a directory: choose another path.")
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.tmp-", dir=self.target.parent))
        except OSError as err:
            raise cannot_write(self.target, err) from None
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        try:
            self._replace()
        except OSError as err:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise cannot_write(self.target, err) from None

    def _replace(self) -> None:
        os.chmod(self.tmp, 0o777 & ~current_umask())  # mkdtemp makes it private; a checkpoint is not
        for item in self.tmp.iterdir():
            os.chmod(item, 0o666 & ~current_umask())
        if not self.target.exists():
            os.rename(self.tmp, self.target)
            return
        old = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.old-", dir=self.target.parent))
        os.rename(self.target, old / "checkpoint")
        for item in (old / "checkpoint").iterdir():
            if not (self.tmp / item.name).exists():
                os.rename(item, self.tmp / item.name)
        os.rename(self.tmp, self.target)
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """``with atomic_file(path) as tmp:`` write the whole file at ``tmp`` (a fresh file beside
    ``path``); when the block ends without error it replaces ``path`` in one rename, with the
    umask's permissions, so a reader never sees half of it; on error it is removed. A
    destination that cannot be written is one :class:`~.errors.UnwritablePathError` naming it.
    The package's one write-to-temp-then-rename for files (folders: :class:`atomic_directory`)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
    except OSError as err:
        raise cannot_write(path, err) from None
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes it private
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise cannot_write(path, err) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace a text file in one rename (a card, a training report, a cached calibration):
    see :func:`atomic_file`."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def check_output_dir(out: str | Path, source: str | Path | None) -> None:
    """Refuse to write a converted checkpoint over its own source or inside it: the source's
    files would be overwritten (its config.json) or mixed with the output's."""
    if source is None:
        return
    out_path, source_path = Path(out).resolve(), Path(source).resolve()
    if out_path == source_path or source_path in out_path.parents:
        where = "is" if out_path == source_path else "is inside"
        raise CheckpointError(f"the output folder {out} {where} the source {source}: writing there would overwrite "
                              "or mix with the source's files; choose another output folder.")
