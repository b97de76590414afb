"""Public entry points: recipe text or file -> Recipe."""

from __future__ import annotations

import os
from pathlib import Path

from fp4gen.dsl.model import Recipe
from fp4gen.dsl.resolve import SHIPPED_RECIPES, Loader
from fp4gen.dsl.source import Source, display_name
from fp4gen.errors import RecipeError

PathArg = str | os.PathLike[str]


def parse_recipe(
    text: str, *, file: PathArg | None = None, base_dir: PathArg | None = None
) -> Recipe:
    """Parse recipe text. ``file`` names it in messages (and gives the default recipe name);
    includes are resolved in ``base_dir``, else next to ``file``, else in the working directory."""
    path = Path(file).resolve() if file is not None else None
    if base_dir is not None:
        base = Path(base_dir).resolve()
    elif path is not None:
        base = path.parent
    else:
        base = Path.cwd()
    name = display_name(path) if path is not None else "<recipe>"
    return Loader().recipe(Source(text, name, path, base))


def load_recipe(source: PathArg, *, base_dir: PathArg | None = None) -> Recipe:
    """Load a recipe from a path (an existing file, or any name ending in .fp4r) or from text.

    A relative path that does not exist is also looked up among the shipped recipes, so
    ``load_recipe("nvfp4.fp4r")`` works from anywhere."""
    if isinstance(source, os.PathLike) or _looks_like_path(source):
        path = Path(source)
        if not path.is_file() and not path.is_absolute() and (SHIPPED_RECIPES / path).is_file():
            path = SHIPPED_RECIPES / path
        if not path.is_file():
            raise RecipeError(f"no such recipe file: {path}", file=str(path))
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RecipeError(f"cannot read the recipe: {exc}", file=str(path)) from None
        return parse_recipe(text, file=path, base_dir=base_dir)
    return parse_recipe(source, base_dir=base_dir)


def _looks_like_path(source: str) -> bool:
    if "\n" in source:
        return False
    if source.strip().endswith(".fp4r"):
        return True
    try:
        return Path(source).is_file()
    except (OSError, ValueError):
        return False
