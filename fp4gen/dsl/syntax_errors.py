"""Turn Lark's parse exceptions into RecipeErrors that say, in words, what was expected where.

Lark reports terminal names (COLON, _NL, ELEM_ROUND, ...) and LALR states. We ask the interactive
parser which terminals it really accepts (LALR's merged lookaheads over-report), look at the
value stack to see which section and statement we are in, and phrase both for a person.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

from lark import Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from fp4gen.dsl.source import MAX_STRING_CHARS, Pos, Source, clip, did_you_mean
from fp4gen.errors import RecipeError
from fp4gen.vocab import Rounding, ScaleRounding, words

# Terminals that stand for a fixed list of words.
_ENUMS: dict[str, tuple[str, ...]] = {
    "SCALE_ROUND": words(ScaleRounding),
    "ELEM_ROUND": words(Rounding),
    "GLOBAL_KIND": ("amax", "row", "none"),
    "TARGET_ERROR": ("mse", "mae"),
    "CORRECTION": ("eden", "none"),
    "REDRAW": ("layer", "step"),
    "GLOBAL_SCOPE": ("expert", "tensor"),
    "MOR_SCALING": ("gam", "e8m0", "amax"),
    "END": ("first", "last"),
    "UNIT": ("blocks", "layers"),
    "PASSES": ("forward", "backward", "both"),
}

_PUNCT: dict[str, str] = {
    "COLON": "':'",
    "EQUAL": "'='",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "LPAR": "'('",
    "RPAR": "')'",
    "DOT": "'.'",
    "LESSTHAN": "'<'",
    "_NL": "end of line",
    "$END": "end of file",
}

# Keywords that start a top-level item; the value stack tells us which one we are inside.
_ITEMS = {
    "RECIPE", "EXTENDS", "IMPORT", "FORMAT", "OPERANDS", "MOR", "LAYERS", "SCHEDULE", "EVAL",
}  # fmt: skip

_TREE_PHRASES = {
    "selector": "the operand selector",
    "format_ref": "the format name",
    "mor_ref": "the mor name",
    "o_block": "the block shape",
    "o_round": "the rounding",
    "o_rht": "the RHT size",
    "o_rht_none": "'rht none'",
    "o_from": "the operand copied from",
    "o_from_none": "'from none'",
    "o_global": "the global scale's scope",
    "candidate": "the candidate format",
    "partition": "the partition",
    "special": "the special-value option",
    "f_block": "the block shape",
    "f_scale": "the scale format",
    "f_round": "the scale rounding",
    "f_global": "the global scale",
    "f_targets": "the block targets",
    "f_correct": "the scale correction",
    "signs_te": "the sign source",
    "signs_none": "the sign source",
    "signs_fixed": "the sign string",
    "signs_seed": "the seed",
    "signs_redrawn": "the sign source",
}

_STATEMENTS = {
    "operand_stmt", "m_decide", "m_scale", "m_try", "m_else", "l_count", "l_match", "sched_stmt",
}  # fmt: skip

# Order in which alternatives are listed: content first, structure last.
_LAST = ("_NL", "RBRACE", "$END")


def translate(exc: UnexpectedInput, source: Source) -> RecipeError:
    if isinstance(exc, UnexpectedToken):
        return _unexpected_token(exc, source)
    if isinstance(exc, UnexpectedCharacters):
        return _unexpected_char(exc, source)
    line = getattr(exc, "line", None) or 1
    column = getattr(exc, "column", None) or 1
    return Pos(source, line, column).error("syntax error")


# ------------------------------------------------------------------------------------------------
# Unexpected token
# ------------------------------------------------------------------------------------------------


def _unexpected_token(exc: UnexpectedToken, source: Source) -> RecipeError:
    token: Token = exc.token
    stack: list = []
    accepts: set[str] = set(exc.expected or ())
    if exc.interactive_parser is not None:
        stack = list(exc.interactive_parser.parser_state.value_stack)
        # accepts() replays the parser; never let that hide the real error
        with contextlib.suppress(Exception):
            accepts = set(exc.interactive_parser.accepts()) or accepts
    ctx = _Context(stack)
    pos = _token_pos(token, source)
    expected = _alternatives(accepts, ctx)
    after = ctx.after()
    tail = f" after {after}" if after else ""

    if token.type == "$END" and "RBRACE" in accepts and ctx.brace is not None:
        section = ctx.item.value if ctx.item is not None else "the"
        msg = (
            f"unexpected end of file: expected '}}' to close the {section} block "
            f"opened on line {ctx.brace.line}"
        )
        return pos.error(msg)

    special = _special_case(token, ctx, source)
    if special is not None:
        return pos.error(special)

    if token.type == "NAME" and "NAME" not in accepts:
        words = _words(accepts)
        if words and str(token.value) not in _all_words():
            hint = did_you_mean(str(token.value), words)
            return pos.error(
                f"unknown keyword '{clip(token.value)}': expected {expected}{tail}{hint}"
            )

    return pos.error(f"unexpected {_describe(token)}: expected {expected}{tail}")


def _special_case(token: Token, ctx: _Context, source: Source) -> str | None:
    """Mistakes common enough to deserve their own sentence."""
    last = ctx.last_type()
    after_token = _char_after(token, source)
    if token.type == "INT" and after_token and after_token in "\u00d7\u2715*":
        return "write block shapes with the letter x, e.g. 16x16"
    if last == "INT" and ctx.prev_type() == "RHT" and str(token.value).startswith("x"):
        return "the Hadamard size is one number, e.g. `rht 16`, not a shape"
    if token.type == "INT" and last == "LESSTHAN":
        return f"write the threshold as a percentage, e.g. {clip(token.value)}%"
    if token.type == "INT" and last == "AT":
        value = clip(token.value)
        return f"write a point in training as a percentage ({value}%) or a step (step {value})"
    return None


def _char_after(token: Token, source: Source) -> str:
    end = getattr(token, "end_pos", None)
    if end is None or end >= len(source.text):
        return ""
    return source.text[end]


def _token_pos(token: Token, source: Source) -> Pos:
    # Lark borrows the last token's position for $END; point just after that token.
    if token.type == "$END" and token.value == "" and token.end_line is not None:
        text_lines = source.text.split("\n")  # the grammar's line ends only (not \x0b, \x85...)
        line = min(token.line or 1, len(text_lines))
        last = text_lines[line - 1].split("#")[0].rstrip()
        return Pos(source, line, len(last) + 1)
    return Pos(source, token.line or 1, token.column or 1)


def _describe(token: Token) -> str:
    if token.type in ("_NL", "$END"):
        return _PUNCT[token.type]
    if token.type == "STRING":
        return f"string {clip(token.value)}"
    return f"'{clip(token.value)}'"


class _Context:
    """Where in the recipe the parser stopped: the top-level item, the open brace, the statement."""

    def __init__(self, stack: Sequence[object]) -> None:
        # Completed items are reduced to trees; the open item starts at the last item keyword
        # outside braces that no top-level newline has closed yet.
        start: int | None = None
        depth = 0
        for i, value in enumerate(stack):
            if not isinstance(value, Token):
                continue
            if value.type == "LBRACE":
                depth += 1
            elif value.type == "RBRACE":
                depth -= 1
            elif depth == 0 and value.type in _ITEMS:
                start = i
            elif depth == 0 and value.type == "_NL":
                start = None
        item_part = list(stack[start:]) if start is not None else []
        self.item: Token | None = item_part[0] if item_part else None  # type: ignore[assignment]
        self.brace: Token | None = None
        stmt = item_part
        for i, value in enumerate(item_part):
            if isinstance(value, Token) and value.type == "LBRACE":
                self.brace = value
                stmt = item_part[i + 1 :]
            elif isinstance(value, Token) and value.type == "RBRACE":
                self.brace, stmt = None, [value]  # the block is closed: we are after it
        if self.brace is not None:
            # Inside braces, the statement starts after the last newline.
            for i in range(len(stmt) - 1, -1, -1):
                value = stmt[i]
                if isinstance(value, Token) and value.type == "_NL":
                    stmt = stmt[i + 1 :]
                    break
            # Finished statements inside the braces are trees followed by newlines.
            stmt = [v for v in stmt if not (isinstance(v, Tree) and _finished(v))]
        self.stmt: list[object] = stmt

    @property
    def section(self) -> str | None:
        return self.item.type if self.item is not None else None

    def last_type(self) -> str | None:
        if not self.stmt:
            return None
        last = self.stmt[-1]
        return last.type if isinstance(last, Token) else f"tree:{last.data}"

    def prev_type(self) -> str | None:
        if len(self.stmt) < 2:
            return None
        prev = self.stmt[-2]
        return prev.type if isinstance(prev, Token) else f"tree:{prev.data}"

    def after(self) -> str | None:
        """What the parser had just read, in words; None at the start of a statement."""
        if not self.stmt:
            return None
        last = self.stmt[-1]
        in_selector = not any(isinstance(v, Token) and v.type == "COLON" for v in self.stmt)
        after_dot = isinstance(last, Token) and last.type == "DOT"
        if self.section == "OPERANDS" and self.brace is not None and in_selector and not after_dot:
            return "the operand selector"
        if isinstance(last, Tree):
            return _TREE_PHRASES.get(str(last.data), f"the {last.data}")
        if last.type == "NAME":
            prev = self.prev_type()
            if prev == "FORMAT":
                return f"the format name '{clip(last.value)}'"
            if prev == "MOR":
                return f"the mor name '{clip(last.value)}'"
            if prev == "EQUAL":
                return f"the base format '{clip(last.value)}'"
            if prev in ("TRY", "ELSE", "LPAR"):
                return f"the candidate '{clip(last.value)}'"
            if prev == "SCALE":
                return f"the scale format '{clip(last.value)}'"
            if prev == "COLON":
                return f"the format name '{clip(last.value)}'"
            return f"'{clip(last.value)}'"
        if last.type == "LBRACE":
            return "'{'"
        if last.type in ("INT", "PERCENT") and self.prev_type() == "END":
            return f"the count {clip(last.value)}"
        if last.type == "INT" and self.prev_type() == "RHT":
            return f"the RHT size {clip(last.value)}"
        if last.type == "SHAPE":
            return f"the block shape {clip(last.value)}"
        if last.type in ("INT", "PERCENT", "STRING"):
            return clip(str(last.value))
        if last.type in _PUNCT:
            return _PUNCT[last.type]
        return f"'{clip(last.value)}'"


def _finished(tree: Tree) -> bool:
    return str(tree.data) in _STATEMENTS or str(tree.data).startswith("__")


_VALUES = ("NAME", "SHAPE", "INT", "PERCENT", "STRING", "STAR")


def _sort_key(name: str) -> tuple[int, int, str]:
    if name in _VALUES:
        return (0, _VALUES.index(name), "")
    if name in _LAST:
        return (2, _LAST.index(name), "")
    return (1, 0, name)


def _alternatives(accepts: Iterable[str], ctx: _Context) -> str:
    accepts = set(accepts)
    if len(accepts) > 1:
        accepts.discard("$END")  # "or end of file" is true almost everywhere and helps no one
    if not ctx.stmt and len(accepts) > 1:
        accepts.discard("_NL")  # so is a blank line before a statement
    phrases: list[str] = []
    for name in sorted(accepts, key=_sort_key):
        for phrase in _terminal_phrases(name, ctx):
            if phrase and phrase not in phrases:
                phrases.append(phrase)
    if not phrases:
        return "something else"
    if len(phrases) == 1:
        return phrases[0]
    return ", ".join(phrases[:-1]) + " or " + phrases[-1]


def _terminal_phrases(name: str, ctx: _Context) -> list[str]:
    if name in _ENUMS:
        return [f"'{word}'" for word in _ENUMS[name]]
    return [_terminal_phrase(name, ctx)]


def _terminal_phrase(name: str, ctx: _Context) -> str:
    last = ctx.last_type()
    if name in _PUNCT:
        if name == "RBRACE" and ctx.item is not None:
            return f"'}}' to close the {ctx.item.value} block"
        return _PUNCT[name]
    if name == "NAME":
        return _name_phrase(ctx, last)
    if name == "SHAPE":
        return "a block shape such as 1x16 or 16x16"
    if name == "PERCENT":
        return "a percentage such as 4.5%"
    if name == "DECIMAL":
        return "a number such as 4 or 1.5"
    if name == "INT":
        return {
            "RHT": "the Hadamard size (a power of two such as 16)",
            "SEED": "a seed (a whole number)",
            "STEP": "a step number",
            "END": "a count",
        }.get(last or "", "a whole number")
    if name == "STRING":
        if last in ("EXTENDS", "IMPORT", "RECIPE") and ctx.section != "RECIPE":
            return "a quoted file name"
        if last == "MATCH":
            return 'a quoted module-name pattern such as "*lm_head"'
        if last == "SIGNS":
            return 'a quoted sign string such as "++-+"'
        return "a quoted string"
    if name == "STAR":  # in the operands section it is part of the selector phrase
        return "" if ctx.section == "OPERANDS" else "'*'"
    if name == "RANGE":
        return "'range'"
    if name == "TE":
        return "te"
    if name == "NONE":
        return "none"
    return f"'{name.lower()}'"


def _name_phrase(ctx: _Context, last: str | None) -> str:
    section = ctx.section
    if section == "OPERANDS":
        if last is None:
            return "an operand selector (*, a role, a GEMM or gemm.role)"
        if last == "DOT":
            return "a role (weight, activation, gradient)"
        if last == "MOR":
            return "a mor name"
        return "a format name"
    if section == "FORMAT":
        if last == "FORMAT":
            return "a name for the format"
        if last == "EQUAL":
            return "an element (such as e2m1) or a format to start from"
        if last == "SCALE":
            return "a scale format (such as e4m3, ue8m0 or fp32)"
    if section == "MOR":
        if last == "MOR":
            return "a name for the mor rule"
        return "an element (such as e4m3) or bf16, fp16, fp32"
    if section == "RECIPE":
        return "a recipe name"
    if section in ("LAYERS", "SCHEDULE"):
        return "a format name (or bf16, fp16, fp32)"
    return "a name"


def _words(accepts: Iterable[str]) -> list[str]:
    words: list[str] = []
    for name in accepts:
        if name in _ENUMS:
            words.extend(_ENUMS[name])
        elif (
            name not in _PUNCT
            and name.isupper()
            and name
            not in (
                "NAME",
                "SHAPE",
                "PERCENT",
                "INT",
                "STRING",
            )
        ):
            words.append(name.lower())
    return words


def _all_words() -> set[str]:
    words = {w for values in _ENUMS.values() for w in values}
    words |= {
        "recipe", "extends", "import", "format", "operands", "mor", "layers", "schedule",
        "block", "scale", "round", "global", "finite", "fn", "ieee", "rht", "signs", "seed",
        "te", "none", "decide", "try", "else", "if", "relerr", "range", "tensor", "channel",
        "match", "at", "step", "eval", "fprop", "from",
    }  # fmt: skip
    return words


# ------------------------------------------------------------------------------------------------
# Unexpected character
# ------------------------------------------------------------------------------------------------


def _unexpected_char(exc: UnexpectedCharacters, source: Source) -> RecipeError:
    pos = Pos(source, exc.line, exc.column)
    char = exc.char
    if char == '"':
        length = _string_length(source.text, exc.pos_in_stream)
        if length is not None:  # closed, yet no STRING: more escapes than a string may hold
            return pos.error(
                f"a string of {length:,} characters; strings are at most "
                f"{MAX_STRING_CHARS:,} characters"
            )
        return pos.error("unterminated string: the closing '\"' is missing on this line")
    if char in "×✕":
        return pos.error(f"unexpected character '{char}': write block shapes with an x, e.g. 16x16")
    if char == "\r":  # a lone carriage return: the old Mac line end, which the grammar lacks
        return pos.error(
            "a carriage return without a line feed: lines end with \\n or \\r\\n; save the "
            "file with Unix or Windows line endings"
        )
    index = exc.pos_in_stream
    before = source.text[index - 1] if index > 0 else ""
    after = source.text[index + 1] if index + 1 < len(source.text) else ""
    hint = ""
    if char == "-" and after.isdigit():
        hint = ": numbers in recipes are not negative"
    elif char in "-./" and (before.isalnum() or before == "_"):
        hint = ": names are letters, digits and _ (quote file names and patterns)"
    return pos.error(f"unexpected character {char!r}{hint}")


def _string_length(text: str, start: int) -> int | None:
    """The length between the quotes of the string opened at ``start``, or None when the line
    ends first (a backslash takes the next character with it)."""
    i = start + 1
    while i < len(text) and text[i] != "\n":
        if text[i] == "\\":
            if text[i + 1 : i + 2] == "\n":
                return None
            i += 2
        elif text[i] == '"':
            return i - start - 1
        else:
            i += 1
    return None
