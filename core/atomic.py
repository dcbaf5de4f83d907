"""Files and folders written whole: a reader sees the old version or the new one, never half
of either (write into a temporary beside the destination, then rename over it).

A folder write never costs the user a file: it replaces only a folder that is absent, empty or
draftheads' own (:func:`stamped_config`), keeping the files of that folder it does not write
itself; someone else's folder is refused before anything is written. Whatever fails part-way
(an error, Ctrl-C), the old folder is where it was, whole, and no temporary is left beside it."""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .errors import CheckpointError, cannot_write

#: the file whose stamp marks a folder as draftheads' own: a head checkpoint's config.json
#: (``CONFIG_NAME`` in :mod:`draftheads.heads.head_config`, which reads the same name) or an export's
STAMP_NAME = "config.json"


def current_umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def stamped_config(folder: Path) -> bool:
    """Whether ``folder/config.json`` is one draftheads wrote: a head checkpoint's (its
    ``draftheads_version``, or ``format_version`` + ``family`` before versions were recorded) or
    an export's (a ``draftheads`` entry). Only such a folder may be replaced whole."""
    import json

    try:
        config = json.loads((folder / STAMP_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and ("draftheads_version" in config or "draftheads" in config
                                         or {"format_version", "family"} <= config.keys())


def saved_dataset(folder: Path) -> bool:
    """Whether ``folder`` is a ``datasets`` ``save_to_disk`` folder (its state.json): how the
    self-distillation cache marks the shards it writes."""
    return (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()


class FolderNotOursError(CheckpointError):
    """An existing folder holds files draftheads did not write: it is never replaced or emptied."""

    def __init__(self, message: str, target: Path):
        super().__init__(message)
        self.target = target


def beside_candidates(target: Path) -> Iterator[Path]:
    """Where a folder goes when ``target`` is someone else's: ``NAME-draftheads``, then
    ``NAME-draftheads-2``, ... (the first that is free or already ours is used)."""
    yield target.with_name(f"{target.name}-draftheads")
    for n in range(2, 1000):
        yield target.with_name(f"{target.name}-draftheads-{n}")


def replaceable(target: Path, ours: Callable[[Path], bool]) -> bool:
    """A destination that may be written without losing anything: absent, an empty folder, or
    a folder ``ours`` recognizes as draftheads' own."""
    if not target.exists():
        return True
    return target.is_dir() and (not any(target.iterdir()) or ours(target))


def choose_destination(target: str | Path, ours: Callable[[Path], bool] = stamped_config,
                       beside: bool = False) -> Path:
    """The absolute folder a write goes to: ``target`` when :func:`replaceable`, else (with
    ``beside``) the first replaceable :func:`beside_candidates`, else one
    :class:`FolderNotOursError` naming the folder and the way out. Checked before anything is
    written, so a refusal leaves nothing behind."""
    target = Path(os.path.abspath(Path(target).expanduser()))
    if target.is_file():
        raise CheckpointError(f"{target} is a file; a checkpoint is a directory: choose another path.")
    if target.is_dir() and (target == Path.cwd() or target in Path.cwd().parents):
        raise CheckpointError(f"{target} is the working directory (or holds it): replacing it would pull the folder "
                              "from under this shell; write to a new folder inside or beside it.")
    if replaceable(target, ours):
        return target
    if beside:
        for candidate in beside_candidates(target):
            if not candidate.is_file() and replaceable(candidate, ours):
                return candidate
    names = sorted(p.name for p in target.iterdir())
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise FolderNotOursError(f"{target} already exists and holds files draftheads did not write ({shown}); it is "
                             "left as it is: choose a new or empty folder.", target)


def check_links(folder: str | Path, skip: tuple[str, ...] = ()) -> None:
    """Refuse a folder to be copied that holds a symlink pointing nowhere (one line naming it):
    links that resolve are followed (their targets copied), a dangling one would end the copy."""
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in dirs + files:
            path = Path(root) / name
            if path.is_symlink() and not path.exists():
                raise CheckpointError(f"{path} is a symlink to {os.readlink(path)}, which does not exist; restore "
                                      "the file it points to or remove the link, then export again.")


def settle_permissions(staging: Path) -> None:
    """mkdtemp makes the staging folder private; a checkpoint follows the umask like any folder
    (and the files written into it, whatever wrote them). Done before anything of the user's is
    linked in, so no file of theirs changes mode."""
    umask = current_umask()
    os.chmod(staging, 0o777 & ~umask)
    for item in staging.iterdir():
        if item.is_file() and not item.is_symlink():
            os.chmod(item, 0o666 & ~umask)


def link_or_copy(src: str, dst: str) -> str:
    """A hard link (no copy of the weights, and the original stays where it is) where the
    filesystem allows, else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def carry_over(old: Path, staging: Path) -> None:
    """Put into ``staging`` what only the folder being replaced has (a training report, files
    the user added), as links or copies: the old folder itself is not touched, so a failure
    at any point loses nothing of it."""
    for item in old.iterdir():
        dest = staging / item.name
        if dest.exists() or dest.is_symlink():
            continue
        if item.is_symlink():
            os.symlink(os.readlink(item), dest)
        elif item.is_dir():
            shutil.copytree(item, dest, symlinks=True, copy_function=link_or_copy)
        else:
            link_or_copy(str(item), str(dest))


def aside_name(target: Path) -> Path:
    """A fresh hidden sibling name for the folder being replaced (nothing is created)."""
    import secrets

    while True:
        aside = target.with_name(f".{target.name}.old-{secrets.token_hex(4)}")
        if not aside.exists():
            return aside


@functools.lru_cache(maxsize=1)
def _libc():
    """The C library, where it has ``renameat2`` (Linux glibc ≥ 2.28), else None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):
        return None
    return libc if hasattr(libc, "renameat2") else None


#: renameat2's flag that swaps two existing paths in one step, and "relative to the working directory"
RENAME_EXCHANGE, AT_FDCWD = 2, -100


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing folders in one atomic rename (Linux ``renameat2(RENAME_EXCHANGE)``):
    a reader sees one or the other under each name, never neither. False where this system or
    filesystem has no such rename (then nothing happened); an ``OSError`` where it failed."""
    libc = _libc()
    if libc is None:
        return False
    if libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def swap_in(staging: Path, target: Path) -> None:
    """``staging`` becomes ``target``. Where ``target`` is absent or empty this is one rename.
    Where it is a folder of ours, its own files are carried over (:func:`carry_over`) and the
    two are swapped in one rename (:func:`exchange`), the old one then removed; where the system
    cannot swap, the old folder is renamed aside, ``staging`` renamed in and the old one removed,
    and if the second rename fails the first is undone. Either way the caller sees the old
    folder or the new one, whole."""
    if not target.exists() or (target.is_dir() and not any(target.iterdir())):
        os.rename(staging, target)
        return
    carry_over(target, staging)
    if exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)  # now the old folder
        return
    aside = aside_name(target)
    os.rename(target, aside)
    try:
        os.rename(staging, target)
    except BaseException:
        try:
            os.rename(aside, target)
        except OSError as err:
            raise CheckpointError(f"{target} could not be replaced nor put back ({err.strerror or err}); the previous "
                                  f"folder is whole at {aside}: rename it back to {target.name}.") from None
        raise
    shutil.rmtree(aside, ignore_errors=True)


class atomic_directory:
    """``with atomic_directory(target) as tmp:`` write into ``tmp`` (a staging folder beside
    the destination); when the block ends without error it becomes the destination
    (:func:`swap_in`), on error it is deleted. The destination (``.target``, chosen when the
    block starts: :func:`choose_destination`) is ``target`` if it is absent, empty or a folder
    ``ours`` recognizes (its files this write does not make are kept); a folder of someone
    else's is refused, or with ``beside`` a sibling is written instead. A destination that
    cannot be written is one :class:`~draftheads.core.errors.UnwritablePathError` naming it; whatever fails,
    no staging or set-aside folder is left behind and no file of the old folder is lost."""

    def __init__(self, target: str | Path, ours: Callable[[Path], bool] = stamped_config, beside: bool = False):
        self.requested, self.ours, self.beside = Path(target), ours, beside
        self.target = self.requested

    def __enter__(self) -> Path:
        self.target = choose_destination(self.requested, self.ours, self.beside)
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
            settle_permissions(self.tmp)
            if not replaceable(self.target, self.ours):  # someone else's files appeared while this was written
                raise FolderNotOursError(f"{self.target} was filled by something else while draftheads wrote it; it "
                                         "is left as it is: choose a new or empty folder.", self.target)
            swap_in(self.tmp, self.target)
        except OSError as err:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise cannot_write(self.target, err) from None
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """``with atomic_file(path) as tmp:`` write the whole file at ``tmp`` (a fresh file beside
    ``path``); when the block ends without error it replaces ``path`` in one rename, with the
    umask's permissions, so a reader never sees half of it; on error it is removed. A
    destination that cannot be written is one :class:`~draftheads.core.errors.UnwritablePathError` naming it.
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
