"""Text -> Lark parse tree. Syntax errors leave this module as RecipeError, never as Lark's own."""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedInput
from lark.lark import PostLex

from fp4gen.dsl.source import MAX_RECIPE_CHARS, Source
from fp4gen.dsl.syntax_errors import translate
from fp4gen.errors import RecipeError

GRAMMAR = Path(__file__).with_name("grammar.lark")


class _OneNewline(PostLex):
    """Statements end at one _NL token. The _NL regex takes blank lines and up to 256 whole-line
    comments (a repeated group costs Python's re memory for every repetition, so it is
    bounded); the lexer ignores the comment after those, and the _NL that follows is dropped
    here."""

    # The contextual lexer must find _NL even where the grammar has just read one.
    always_accept = ("_NL",)

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        after_newline = False
        for token in stream:
            if token.type == "_NL":
                if after_newline:
                    continue
                after_newline = True
            else:
                after_newline = False
            yield token


@lru_cache(maxsize=1)
def _parser() -> Lark:
    # Built once per process: grammar analysis costs far more than parsing a recipe.
    return Lark(
        GRAMMAR.read_text(encoding="utf-8"),
        parser="lalr",
        lexer="contextual",
        postlex=_OneNewline(),
        propagate_positions=True,
        maybe_placeholders=False,
    )


def parse_tree(source: Source) -> Tree:
    if len(source.text) > MAX_RECIPE_CHARS:
        # before the lexer: its cost grows with the text, and no recipe needs a megabyte
        raise RecipeError(
            f"{source.file} is {len(source.text):,} characters long; a recipe may be at most "
            f"{MAX_RECIPE_CHARS:,} characters",
            file=source.file,
        )
    try:
        return _parser().parse(source.text)
    except UnexpectedInput as exc:
        raise translate(exc, source) from None
