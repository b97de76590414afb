"""The kinds of user error fp4gen reports: bad recipes, bad tensors and bad arguments."""

from __future__ import annotations

from pathlib import Path


class FP4GenError(Exception):
    """Base class of every error fp4gen raises on purpose."""


class RecipeError(FP4GenError):
    """A recipe that cannot be parsed or does not make sense.

    The message names the file, line and column, shows the offending line with a caret under the
    column (a window of a very long line), and says what was expected or why the value is
    illegal. A problem with a whole file (missing, a directory, not UTF-8) has no line: its
    message is one line naming the file.
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
            # A problem with a whole file ("x.fp4r is a directory, not a recipe file") names
            # the file itself; prefix it only where the message does not.
            return self.reason if self.file in self.reason else f"{self.file}: {self.reason}"
        where = f"{self.file}:{self.line}:{self.column or 1}"
        out = f"{where}: {self.reason}"
        if text is not None:
            # the grammar's line ends only: \x0b, \x0c, \x85, \u2028 ... stay inside a line,
            # as they do for the line numbers; quoted as blanks, so the message is 3 lines
            lines = text.split("\n")
            if 1 <= self.line <= len(lines):
                line = lines[self.line - 1].removesuffix("\r").translate(_BLANK_BREAKS)
                src, column = _window(line.expandtabs(1), self.column or 1)
                caret = " " * max(column - 1, 0) + "^"
                out += f"\n    {src}\n    {caret}"
        return out


SOURCE_WIDTH = 160  # longest source line quoted in full under a message
# what str.splitlines() breaks at besides \n: a blank each in a quoted line (the caret's column)
_BLANK_BREAKS = str.maketrans("\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029", " " * 9)


def _window(line: str, column: int) -> tuple[str, int]:
    """The part of a long source line around ``column``, and the column within that part: a
    message quotes the offending line, never megabytes of it."""
    if len(line) <= SOURCE_WIDTH:
        return line, column
    start = max(0, min(column - 1 - SOURCE_WIDTH // 2, len(line) - SOURCE_WIDTH))
    part = line[start : start + SOURCE_WIDTH]
    head = "..." if start > 0 else ""
    tail = "..." if start + SOURCE_WIDTH < len(line) else ""
    return f"{head}{part}{tail}", column - start + len(head)


class TensorError(FP4GenError, ValueError):
    """A tensor that breaks a rule: its shape, dtype, device or values."""


class ArgumentError(FP4GenError, ValueError):
    """An argument of an fp4gen function or command that breaks its rule: the message names the
    argument, the value given and the rule. A ValueError, so callers that catch ValueError keep
    working, also where a wrong type was given."""
