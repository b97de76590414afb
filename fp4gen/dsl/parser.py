"""Public entry points: recipe text or file -> Recipe."""

from __future__ import annotations

import os
import re
from pathlib import Path

from fp4gen.dsl.model import Recipe
from fp4gen.dsl.resolve import Loader
from fp4gen.dsl.source import (
    BOM,
    Source,
    blank_reason,
    display_name,
    find_recipe,
    read_source,
)
from fp4gen.errors import RecipeError

PathArg = str | os.PathLike[str]

# How recipe text starts when it is one line: a comment or a top-level keyword and a blank or '{'
# (or ':' after eval).
_TEXT_START = re.compile(
    r"\s*(?:#|(?:recipe|extends|import|format|operands|mor|layers|schedule)[\s{]|eval[\s:])"
)


def parse_recipe(
    text: str, *, file: PathArg | None = None, base_dir: PathArg | None = None
) -> Recipe:
    """Parse recipe text. ``file`` names it in messages (and gives the default recipe name);
    includes are resolved in ``base_dir``, else next to ``file``, else in the working directory.
    A leading byte order mark is dropped; text without a statement is a RecipeError."""
    text = text.removeprefix(BOM)
    path = Path(file).resolve() if file is not None else None
    if base_dir is not None:
        base = Path(base_dir).resolve()
    elif path is not None:
        base = path.parent
    else:
        base = Path.cwd()
    name = display_name(path) if path is not None else "<recipe>"
    blank = blank_reason(text)
    if blank is not None:
        raise RecipeError(f"{name if path is not None else 'the recipe text'} {blank}", file=name)
    return Loader().recipe(Source(text, name, path, base))


def is_recipe_text(source: str) -> bool:
    """Does ``load_recipe`` read this string as recipe text (rather than a name or path)?

    Yes when it holds a line break, is blank, or starts (after blanks) with ``#`` or a top-level
    keyword followed by a blank or ``{`` (``operands { * : nvfp4 }``)."""
    return "\n" in source or "\r" in source or not source.strip() or bool(_TEXT_START.match(source))


def load_recipe(source: PathArg, *, base_dir: PathArg | None = None) -> Recipe:
    """Load a recipe from a file, a shipped recipe's name, or recipe text.

    A ``str`` is recipe text when :func:`is_recipe_text` says so (it holds a line break, or
    starts with ``#`` or a keyword such as ``operands {``); otherwise it, like any PathLike, is
    resolved by :func:`fp4gen.dsl.source.find_recipe`, as the command line does: ``"nvfp4"``
    and ``"nvfp4.fp4r"`` are the shipped recipe, anything with a path separator is a path. A
    missing file, a directory, a FIFO or an unreadable file raises RecipeError in one line.

    ``base_dir`` overrides where the recipe's includes are looked up (default: next to the file,
    or the working directory for text)."""
    if isinstance(source, str) and is_recipe_text(source.removeprefix(BOM)):
        return parse_recipe(source, base_dir=base_dir)
    src = read_source(find_recipe(source))
    if base_dir is not None:
        src = Source(src.text, src.file, src.path, Path(base_dir).resolve())
    return Loader().recipe(src)
