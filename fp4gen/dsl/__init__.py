"""The recipe language: parse .fp4r text into the Recipe model and print it back.

The names below load their modules on first use, so importing the model (``fp4gen.dsl.model``,
which the numerics read) does not load the parser and Lark.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fp4gen import lazy_attribute

_LAZY: dict[str, str] = {
    "find_recipe": "fp4gen.dsl.source",
    "load_recipe": "fp4gen.dsl.parser",
    "parse_recipe": "fp4gen.dsl.parser",
    "print_recipe": "fp4gen.dsl.printer",
}

__all__ = ["find_recipe", "load_recipe", "parse_recipe", "print_recipe"]

if TYPE_CHECKING:
    from fp4gen.dsl.parser import load_recipe, parse_recipe
    from fp4gen.dsl.printer import print_recipe
    from fp4gen.dsl.source import find_recipe


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, globals(), name)


def __dir__() -> list[str]:
    return sorted(__all__)
