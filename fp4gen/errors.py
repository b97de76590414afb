"""The two kinds of user error fp4gen reports: bad recipes and bad tensors."""

from __future__ import annotations

from pathlib import Path


class FP4GenError(Exception):
    """Base class of every error fp4gen raises on purpose."""


class RecipeError(FP4GenError):
    """A recipe that cannot be parsed or does not make sense.

    The message names the file, line and column, shows the offending line with a caret under the
    column, and says what was expected or why the value is illegal.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | Path | None = None,
        line: int | None = None,
        column: int | None = None,
        text: str | None = None,
    ) -> None:
        self.reason = message
        self.file = str(file) if file is not None else "<recipe>"
        self.line = line
        self.column = column
        super().__init__(self._render(text))

    def _render(self, text: str | None) -> str:
        if self.line is None:
            return f"{self.file}: {self.reason}"
        where = f"{self.file}:{self.line}:{self.column or 1}"
        out = f"{where}: {self.reason}"
        if text is not None:
            lines = text.splitlines()
            if 1 <= self.line <= len(lines):
                src = lines[self.line - 1].expandtabs(1)
                caret = " " * max((self.column or 1) - 1, 0) + "^"
                out += f"\n    {src}\n    {caret}"
        return out


class TensorError(FP4GenError, ValueError):
    """A tensor that breaks a rule: its shape, dtype, device or values."""
