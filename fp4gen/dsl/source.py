"""Source files, positions and message helpers. Every value read from a recipe remembers where
it came from, so errors found long after parsing (in the cascade, in an extended file) still
point at a token."""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from fp4gen.errors import RecipeError

T = TypeVar("T")


@dataclass(frozen=True)
class Source:
    """One recipe text: what it says, what to call it in messages, where its includes live."""

    text: str = field(repr=False)
    file: str  # display name in messages
    path: Path | None  # resolved path on disk; None for text that came from a string
    base_dir: Path  # relative paths in this text are resolved here first

    @staticmethod
    def from_path(path: Path) -> Source:
        path = path.resolve()
        text = path.read_text(encoding="utf-8")
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
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
