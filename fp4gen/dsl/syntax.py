"""Text -> Lark parse tree. Syntax errors leave this module as RecipeError, never as Lark's own."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from lark import Lark, Tree
from lark.exceptions import UnexpectedInput

from fp4gen.dsl.source import Source
from fp4gen.dsl.syntax_errors import translate

GRAMMAR = Path(__file__).with_name("grammar.lark")


@lru_cache(maxsize=1)
def _parser() -> Lark:
    # Built once per process: grammar analysis costs far more than parsing a recipe.
    return Lark(
        GRAMMAR.read_text(encoding="utf-8"),
        parser="lalr",
        lexer="contextual",
        propagate_positions=True,
        maybe_placeholders=False,
    )


def parse_tree(source: Source) -> Tree:
    try:
        return _parser().parse(source.text)
    except UnexpectedInput as exc:
        raise translate(exc, source) from None
