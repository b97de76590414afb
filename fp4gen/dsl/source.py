"""Source files, positions and message helpers. Every value read from a recipe remembers where
it came from, so errors found long after parsing (in the cascade, in an extended file) still
point at a token.

This module also decides what a recipe argument names (:func:`find_recipe`) and reads recipe
files (:func:`read_recipe_file`), so that the command line, ``load_recipe`` and includes treat
names, paths and unreadable files alike.
"""

from __future__ import annotations

import difflib
import errno
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from fp4gen.errors import RecipeError

T = TypeVar("T")

# Recipes shipped with the package: bare names and includes fall back to this directory.
SHIPPED_RECIPES = Path(__file__).resolve().parent.parent / "recipes"
SUFFIX = ".fp4r"

# Recipes are a few kilobytes; these bounds keep absurd input from costing memory or time.
MAX_RECIPE_CHARS = 1_000_000  # recipe text, in characters (a file: in bytes)
MAX_STRING_CHARS = 4096  # one quoted string, between the quotes
MAX_NAME_CHARS = 256  # one name (format, mor, recipe, selector, keyword)

# A byte order mark some editors put first in UTF-8 files: not part of the recipe.
BOM = "\ufeff"
LINK_LOOP = "is a symbolic-link loop: following its links never reaches a file"
# A line whose first non-blank character starts something other than a comment.
_STATEMENT_LINE = re.compile(r"^[ \t\r\f\v]*[^ \t\r\f\v\n#]", re.MULTILINE)


@dataclass(frozen=True)
class Source:
    """One recipe text: what it says, what to call it in messages, where its includes live."""

    text: str = field(repr=False)
    file: str  # display name in messages
    path: Path | None  # resolved path on disk; None for text that came from a string
    base_dir: Path  # relative paths in this text are resolved here first

    @staticmethod
    def from_path(path: Path) -> Source:
        """Read a recipe file; a file that cannot be read, or holds no statement, raises
        :class:`UnreadableRecipe`."""
        try:
            os.stat(path)  # a link loop or a dangling link is named before resolve() hides it
        except OSError as exc:
            reason = _unreachable(path, exc)
            if reason is not None:
                raise UnreadableRecipe(path, reason) from None
        try:
            path = path.resolve()
        except (OSError, RuntimeError):  # RuntimeError: Python before 3.13 on a link loop
            raise UnreadableRecipe(path, LINK_LOOP) from None
        text = read_recipe_file(path)
        blank = blank_reason(text)
        if blank is not None:
            raise UnreadableRecipe(path, blank)
        return Source(text, display_name(path), path, path.parent)

    @property
    def key(self) -> str:
        """Identity for cycle detection and caching."""
        return str(self.path) if self.path is not None else f"<text:{id(self)}>"

    @property
    def stem(self) -> str | None:
        return self.path.stem if self.path is not None else None


def display_name(path: Path) -> str:
    """Paths below the working directory are shown relative to it, others in full."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return str(path)
    return str(path) if rel.startswith("..") else rel


@dataclass(frozen=True, eq=False)
class Pos:
    """A line and column (both 1-based) in a source."""

    source: Source
    line: int
    column: int

    def error(self, message: str) -> RecipeError:
        return RecipeError(
            message,
            file=self.source.file,
            line=self.line,
            column=self.column,
            text=self.source.text,
        )

    def shifted(self, columns: int) -> Pos:
        return Pos(self.source, self.line, self.column + columns)

    def where(self, other: Source | None = None) -> str:
        """'line 4' within the same source, 'base.fp4r line 4' from elsewhere."""
        if other is not None and other is not self.source:
            return f"{self.source.file} line {self.line}"
        return f"line {self.line}"


@dataclass(frozen=True, eq=False)
class At(Generic[T]):
    """A value and the position of the token that gave it."""

    value: T
    pos: Pos


def did_you_mean(word: str, candidates: Sequence[str]) -> str:
    """' (did you mean 'x'?)' for a close candidate, else ''."""
    if len(word) > 64:  # no keyword or format name is that long; spare difflib the work
        return ""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def clip(text: str, limit: int = 40) -> str:
    """``text`` for a message, shortened in the middle when longer than ``limit`` characters."""
    if len(text) <= limit:
        return text
    half = (limit - 3) // 2
    return f"{text[:half]}...{text[-half:]} ({len(text):,} characters)"


# ------------------------------------------------------------------------------------------------
# Finding and reading recipe files
# ------------------------------------------------------------------------------------------------


class UnreadableRecipe(Exception):
    """Why a file cannot be read as a recipe, worded to follow the file's name in a message
    (``f"{path} {reason}"``): "is a directory, not a recipe file", "cannot be read: ..."."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path} {reason}")


def _not_regular(mode: int) -> str | None:
    """What a file of this mode is, if it is not a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _os_reason(exc: OSError) -> str:
    return (exc.strerror or type(exc).__name__).lower()


def _unreachable(path: Path, exc: OSError) -> str | None:
    """Why ``path`` cannot be opened, worded to follow its name; None where it simply does not
    exist (or the OS rejects the name), which the caller reports in its own words."""
    if exc.errno == errno.ELOOP:
        return LINK_LOOP
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        try:
            target = os.readlink(path)
        except (OSError, ValueError):
            return None  # not a link: simply missing
        return f"is a symbolic link to {target}, which does not exist"
    if exc.errno == errno.ENAMETOOLONG:
        return None
    if isinstance(exc, PermissionError):
        return "cannot be read: permission denied"
    return f"cannot be read: {_os_reason(exc)}"


def blank_reason(text: str) -> str | None:
    """Why ``text`` holds no recipe (empty, or only blank lines and comments), worded to follow
    the file's name; None when it has a statement. A statement never spans lines and nothing
    but a comment starts with '#', so a line scan tells exactly what the grammar would."""
    if _STATEMENT_LINE.search(text) is not None:  # stops at the first: no copy of the text
        return None
    hint = "a recipe needs at least an operands section, or an extends line"
    if not text:
        return f"is empty: {hint}"
    return f"has no statements, only blank lines and comments: {hint}"


def read_recipe_file(path: Path) -> str:
    """The UTF-8 text of a regular file of at most MAX_RECIPE_CHARS bytes.

    A FIFO, device or directory is refused without waiting for a writer (the open does not
    block); every problem raises :class:`UnreadableRecipe` with a one-line reason.
    """
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it changes nothing for files.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except IsADirectoryError:
        raise UnreadableRecipe(path, "is a directory, not a recipe file") from None
    except OSError as exc:
        reason = _unreachable(path, exc) or f"cannot be read: {_os_reason(exc)}"
        raise UnreadableRecipe(path, reason) from None
    try:
        info = os.fstat(fd)
        kind = _not_regular(info.st_mode)
        if kind is not None:
            raise UnreadableRecipe(path, f"is {kind}, not a recipe file")
        if info.st_size > MAX_RECIPE_CHARS:
            raise UnreadableRecipe(path, _too_long(info.st_size, "bytes"))
        with os.fdopen(fd, "rb", closefd=False) as stream:
            data = stream.read(MAX_RECIPE_CHARS + 1)  # +1: a file that grew since fstat
    except OSError as exc:
        raise UnreadableRecipe(path, f"cannot be read: {_os_reason(exc)}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_RECIPE_CHARS:
        raise UnreadableRecipe(path, _too_long(len(data), "bytes"))
    try:
        return data.decode("utf-8").removeprefix(BOM)
    except UnicodeDecodeError as exc:
        raise UnreadableRecipe(path, _not_utf8(data, exc.start)) from None


def _not_utf8(data: bytes, start: int) -> str:
    """Where the first byte that is not UTF-8 is, by line and column (columns count characters
    as the parser does; a leading byte order mark is not one)."""
    line = data.count(b"\n", 0, start) + 1
    line_start = data.rfind(b"\n", 0, start) + 1
    before = data[line_start:start].decode("utf-8")  # valid: the first bad byte is at ``start``
    if line_start == 0:
        before = before.removeprefix(BOM)
    where = f"byte 0x{data[start]:02x} at line {line}, column {len(before) + 1}"
    return f"is not UTF-8 text ({where}): save it as UTF-8"


def _too_long(size: int, unit: str) -> str:
    return f"is {size:,} {unit} long; a recipe may be at most {MAX_RECIPE_CHARS:,} {unit}"


def shipped_names() -> list[str]:
    """The names of the shipped recipes (``nvfp4``, ``mxfp4``, ...), sorted."""
    return sorted(p.stem for p in SHIPPED_RECIPES.glob(f"*{SUFFIX}"))


def find_recipe(name: str | os.PathLike[str]) -> Path:
    """The recipe file a command-line argument or ``load_recipe`` argument names.

    - A bare name (no path separator, no ``.fp4r``) is the shipped recipe of that name
      (``nvfp4`` -> ``fp4gen/recipes/nvfp4.fp4r``), else a file of that name; write ``./nvfp4``
      for a file that shadows a shipped name.
    - A name ending in ``.fp4r`` without a separator is that file, else the shipped recipe of
      that file name (``nvfp4.fp4r`` works from anywhere).
    - Anything with a separator is a path.

    Raises RecipeError for a missing file ("no such recipe file: X"), an unknown bare name (with
    the shipped names) and a directory, FIFO or other file that is not a regular file. Nothing
    is opened, so a FIFO never blocks.
    """
    text = os.fspath(name)
    if not text.strip():
        # file="": the message has no name to show
        raise RecipeError("an empty recipe name: give a .fp4r path or a shipped name", file="")
    if "\0" in text:
        shown = repr(text)
        raise RecipeError(f"no such recipe file: {shown} (a name holds no NUL byte)", file=shown)
    has_sep = any(sep in text for sep in "/" + os.sep + (os.altsep or ""))
    bare = not has_sep and not text.endswith(SUFFIX)
    candidates = [Path(text)]
    if bare:
        candidates.insert(0, SHIPPED_RECIPES / f"{text}{SUFFIX}")
    elif not has_sep:
        candidates.append(SHIPPED_RECIPES / text)
    for path in candidates:
        try:
            mode = path.stat().st_mode
        except ValueError:  # a name the OS rejects
            continue
        except OSError as exc:  # missing, or there but out of reach (a link loop, no access)
            reason = _unreachable(path, exc)
            if reason is None:
                continue
            raise RecipeError(f"{text} {reason}", file=text) from None
        kind = _not_regular(mode)
        if kind is not None:
            raise RecipeError(f"{text} is {kind}, not a recipe file", file=text)
        return path
    if bare:
        names = shipped_names()
        raise RecipeError(
            f"no recipe named {clip(text)!r}{did_you_mean(text, names)}: it is neither a file "
            f"nor a shipped recipe (shipped: {', '.join(names)})",
            file=text,
        )
    raise RecipeError(f"no such recipe file: {clip(text, 200)}", file=text)


def read_source(path: Path) -> Source:
    """A recipe file named on the command line or given to ``load_recipe``, as a Source; a file
    that cannot be read is a one-line RecipeError naming it."""
    try:
        return Source.from_path(path)
    except UnreadableRecipe as exc:
        shown = display_name(exc.path)
        raise RecipeError(f"{shown} {exc.reason}", file=shown) from None
