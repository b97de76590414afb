"""Writing the files a command leaves for its user: whole or not at all, never through a link.

Every command that writes user-visible files (``compile``, ``export``, ``demo``, ``sweep``,
``report``) writes them through an ``OutputFiles`` of its output folder:

- A file is written to a temporary name in its own folder (``.<name>.<random>.tmp``), flushed,
  fsynced and renamed over its name, so a reader sees the old file or the whole new one. A full
  disk or an interrupt leaves the old file as it was and no partial file; the error is one line
  naming the file.
- Nothing is written through a symbolic link: a link at a file's name, or a folder on the way
  that resolves outside the output folder, is refused with a one-line error (the link is left
  alone). The output folder itself may be a link: the user named it.
- The files it replaced that it had not written itself are listed (``replaced``), so the command
  can say so; ``refuse_existing`` refuses to replace any (a command's ``--overwrite`` lifts it).
- ``transaction()`` writes several files as one: each is staged under its temporary name and
  all are renamed into place only once every one is written, so a failure leaves the folder as
  it was.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from fp4gen.errors import FP4GenError

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]+", re.ASCII)
PLAIN_NAME_RULE = (
    "a plain name (letters, digits, '_', '-', '.'; not '.' or '..'; no path separators)"
)
_CHUNK = 1 << 20  # bytes per write call


class OutputError(FP4GenError):
    """A file a command was about to write that it refuses to write or could not write."""


# ----------------------------------------------------------------------------------------------
# Paths: names that become paths, and file-system errors in one line
# ----------------------------------------------------------------------------------------------


def is_plain_name(name: str) -> bool:
    """One path component that cannot climb out of its folder (see PLAIN_NAME_RULE)."""
    return name not in (".", "..") and _PLAIN_NAME.fullmatch(name) is not None


def inside(folder: Path, *names: str) -> Path:
    """``folder / names...``: each a plain name, and the result, resolved, still under the
    resolved ``folder`` (a symbolic link inside could lead anywhere). Raises FP4GenError."""
    for name in names:
        if not is_plain_name(name):
            raise OutputError(
                f"{name!r} names a path under {folder}, so it must be {PLAIN_NAME_RULE}"
            )
    path = folder.joinpath(*names)
    if not path.resolve().is_relative_to(folder.resolve()):
        raise OutputError(f"{path} leads out of {folder} through a symbolic link")
    return path


def file_in_the_way(path: Path) -> Path | None:
    """The first of ``path`` and its parents that exists and is not a folder, if any."""
    for p in (path, *path.parents):
        try:
            mode = p.stat().st_mode
        except OSError:  # absent, or under a file: the culprit is further up
            continue
        return None if stat.S_ISDIR(mode) else p
    return None


def path_problem(folder: Path, err: OSError) -> str:
    """What ``err`` says is wrong with writing into ``folder``, naming the path at fault."""
    blocker = file_in_the_way(folder)
    if blocker is not None:
        return f"{blocker} is a file, not a folder"
    where = err.filename if err.filename else folder
    if isinstance(err, PermissionError):
        return f"{where}: permission denied"
    return f"{where}: {err.strerror or err}"


def link_refusal(path: Path, flag: str) -> OutputError:
    """The error for a symbolic link where a file is to be written."""
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return OutputError(
        f"{path} is a symbolic link{target}: fp4gen writes no file through a link; remove the "
        f"link or choose another {flag}"
    )


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def _write_data(file: BinaryIO, data: bytes) -> None:
    """Write ``data`` in chunks (one place a test can make the disk fill up)."""
    view = memoryview(data)
    for start in range(0, len(view), _CHUNK):
        file.write(view[start : start + _CHUNK])


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(folder: Path) -> None:
    """Make a rename durable; some file systems cannot fsync a folder, which is fine."""
    with contextlib.suppress(OSError):
        _fsync_path(folder)


class OutputFiles:
    """The files one command writes into one folder (see the module docstring).

    folder: the output folder, created on the first write. flag: how the user named it
    (``--out``), for the messages. overwrite: False refuses to replace an existing file.
    """

    def __init__(
        self, folder: str | os.PathLike[str], *, flag: str = "--out", overwrite: bool = True
    ) -> None:
        self.folder = Path(folder)
        self.flag = flag
        self.overwrite = overwrite
        self.replaced: list[Path] = []  # existing files replaced (not ones written here)
        self.written: list[Path] = []  # every file written, in order, once each
        self._staged: list[tuple[Path, Path]] | None = None  # (temporary, target) in a transaction
        self._removals: list[Path] = []

    # -- paths ---------------------------------------------------------------------------------

    def target(self, name: str) -> Path:
        """The checked path of ``name`` (names joined by ``/``, none of them ``..``): not a
        symbolic link, and its folder resolves inside the output folder. OutputError if not."""
        parts = name.split("/")
        for part in parts:
            if part in ("", ".", "..") or "\0" in part:
                raise OutputError(
                    f"{name!r} names a file under {self.folder}, so each of its '/'-separated "
                    "parts must be a file or folder name (not empty, '.' or '..'; no NUL byte)"
                )
        path = self.folder.joinpath(*parts)
        if path.is_symlink():
            raise link_refusal(path, self.flag)
        root = self.folder.resolve()
        if not path.parent.resolve().is_relative_to(root):
            raise OutputError(
                f"{path} leads out of {self.folder} through a symbolic link: fp4gen writes no "
                f"file through a link; choose another {self.flag}"
            )
        blocker = file_in_the_way(path.parent)
        if blocker is not None:
            raise OutputError(
                f"cannot write {path}: {blocker} is a file, not a folder (choose another "
                f"{self.flag})"
            )
        if path.is_dir():
            raise OutputError(f"cannot write {path}: it is a folder (choose another {self.flag})")
        return path

    def refuse_existing(self, names: Iterable[str], *, hint: str = "--overwrite") -> None:
        """Check every name (links refused even with overwrite); without overwrite, refuse
        names that exist already, listing them."""
        present = [name for name in names if os.path.lexists(self.target(name))]
        if present and not self.overwrite:
            shown = ", ".join(present[:4]) + (", ..." if len(present) > 4 else "")
            raise OutputError(
                f"{self.folder}: already holds {shown}; pass {hint} to replace "
                f"{'it' if len(present) == 1 else 'them'}"
            )

    # -- writing -------------------------------------------------------------------------------

    def write_text(self, name: str, text: str, *, keep_same: bool = False) -> Path:
        return self.write_bytes(name, text.encode(), keep_same=keep_same)

    def write_bytes(self, name: str, data: bytes, *, keep_same: bool = False) -> Path:
        """Write ``data`` as ``name``. keep_same: leave an identical regular file untouched (its
        modification time too), and do not count it as replaced."""
        path = self.target(name)
        if keep_same and self._same(path, data):
            self._note_written(path)
            return path

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                _write_data(f, data)

        return self._write(path, write)

    def write_with(self, name: str, write: Callable[[Path], None]) -> Path:
        """Write ``name`` by calling ``write(path)`` on its temporary path (a library that
        writes files by name: safetensors, matplotlib)."""
        return self._write(self.target(name), write)

    def remove(self, name: str) -> bool:
        """Delete ``name`` (a file or a link, never what a link points to); in a transaction,
        once every file is written. False when there was nothing to delete."""
        path = self.folder.joinpath(*name.split("/"))
        if not os.path.lexists(path) or (path.is_dir() and not path.is_symlink()):
            return False
        if self._staged is not None:
            self._removals.append(path)
        else:
            self._unlink(path)
        return True

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Stage every file written inside; rename them all into place (and make the removals)
        at the end, or, on an error, delete the staged files and leave the folder as it was."""
        if self._staged is not None:
            raise RuntimeError("OutputFiles transactions do not nest")
        staged: list[tuple[Path, Path]] = []
        self._staged, self._removals = staged, []
        try:
            yield
            removals, self._staged = self._removals, None
            targets = {target for _, target in staged}
            for path in removals:
                if path not in targets:
                    self._unlink(path)
            while staged:
                tmp, path = staged[0]
                self._publish(tmp, path)
                staged.pop(0)
        except BaseException:
            for tmp, _ in staged:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            raise
        finally:
            self._staged, self._removals = None, []
            _fsync_folder(self.folder)

    def replaced_text(self) -> str | None:
        """ "replaced N existing file(s) in DIR: a, b" for the files replaced, or None."""
        if not self.replaced:
            return None
        names = [str(p.relative_to(self.folder)) for p in self.replaced]
        return f"replaced {len(names)} existing file(s) in {self.folder}: {', '.join(names)}"

    # -- the steps -----------------------------------------------------------------------------

    def _write(self, path: Path, write: Callable[[Path], None]) -> Path:
        if not self.overwrite and os.path.lexists(path) and path not in self.written:
            self.refuse_existing([str(path.relative_to(self.folder))])
        self._make_folder(path.parent)
        tmp = self._temporary(path)
        try:
            write(tmp)
            _fsync_path(tmp)
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink()
            kept = "the previous file is unchanged" if path.exists() else "nothing was written"
            raise OutputError(f"cannot write {path}: {err.strerror or err} ({kept})") from None
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        if self._staged is not None:
            self._staged.append((tmp, path))
        else:
            self._publish(tmp, path)
            _fsync_folder(path.parent)
        return path

    def _temporary(self, path: Path) -> Path:
        """A new empty file next to ``path``, created exclusively (never an existing file or a
        link), with the permissions a new file gets."""
        for _ in range(100):
            tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
            except FileExistsError:
                continue
            except OSError as err:
                raise OutputError(
                    f"cannot write {path}: {path_problem(path.parent, err)}"
                ) from None
            os.close(fd)
            return tmp
        raise OutputError(f"cannot write {path}: no free temporary name in {path.parent}")

    def _publish(self, tmp: Path, path: Path) -> None:
        """Rename ``tmp`` over ``path``, recording a replaced file."""
        try:
            if path.is_symlink():  # made while the file was written
                raise link_refusal(path, self.flag)
            existed = os.path.lexists(path)
            os.replace(tmp, path)
        except BaseException as err:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if isinstance(err, OSError):
                raise OutputError(f"cannot write {path}: {err.strerror or err}") from None
            raise
        if existed and path not in self.written and path not in self.replaced:
            self.replaced.append(path)
        self._note_written(path)

    def _note_written(self, path: Path) -> None:
        if path not in self.written:
            self.written.append(path)

    def _same(self, path: Path, data: bytes) -> bool:
        try:
            return path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data
        except OSError:
            return False

    def _make_folder(self, folder: Path) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OutputError(
                f"cannot write the output folder {self.folder}: {path_problem(folder, err)} "
                f"(choose another {self.flag})"
            ) from None

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            raise OutputError(f"cannot remove {path}: {err.strerror or err}") from None


def write_file(path: str | os.PathLike[str], data: bytes | str, *, flag: str = "--out") -> Path:
    """Write one file by the same rules, its folder the output folder (no overwrite check)."""
    where = Path(path)
    files = OutputFiles(where.parent, flag=flag)
    raw = data.encode() if isinstance(data, str) else data
    return files.write_bytes(where.name, raw)


__all__ = [
    "PLAIN_NAME_RULE",
    "OutputError",
    "OutputFiles",
    "file_in_the_way",
    "inside",
    "is_plain_name",
    "link_refusal",
    "path_problem",
    "write_file",
]
