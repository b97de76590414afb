"""Parse tree -> positioned statements, checking every value that can be judged on its own
(element names, block shapes, RHT sizes and signs, percentages, selectors, duplicate clauses).

Checks that need other statements (names, the operand cascade, includes) happen in resolve.py
and validate.py; the statements keep the positions those checks need.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from lark import Token, Tree

from fp4gen.dsl.model import (
    GEMMS,
    ROLES,
    TE_SIGNS_16,
    Candidate,
    LayerSelector,
    Metric,
    MoRSpec,
    Operand,
    Partition,
    RHTSpec,
)
from fp4gen.dsl.source import (
    MAX_NAME_CHARS,
    MAX_STRING_CHARS,
    At,
    Pos,
    Source,
    clip,
    did_you_mean,
)
from fp4gen.formats import (
    HIGH_PRECISION_DTYPES,
    MAX_EDEN_GROUP,
    ElementFormat,
    HighPrecision,
    default_special,
)

Shape = tuple[int, int]

_ELEMENT = re.compile(r"^(u?)e(\d+)m(\d+)$")
_ELEMENTISH = re.compile(r"^u?e\d")  # looks like an attempt at an element name


# Bounds on numbers, so that an absurd value is an error here rather than an overflow or a huge
# allocation in a kernel or the runtime. Every shipped recipe is far inside them.
MAX_BLOCK_DIM = 1024  # rows or columns of a block (format blocks and mor partitions)
MAX_BLOCK_ELEMENTS = 256 * 256  # elements of one block: 1x1024 and 256x256 fit, 512x512 not
MAX_COUNT = 1_000_000  # N in `first|last N blocks|layers`
MAX_STEP = 2**63 - 1  # N in `at step N`: a step counter is an int64
MAX_NUMBER_CHARS = 200  # a target or bound written out: ue8m0's 2^-127 takes 130 characters
_MAX_DIGITS = 30  # longer digit strings are beyond every bound above; int() is not even tried


def number(text: str) -> int:
    """The value of a digit string, or 10**_MAX_DIGITS (beyond every bound) for a longer one:
    int() refuses strings past 4300 digits and is slow long before."""
    digits = text.lstrip("0")
    return int(digits or "0") if len(digits) <= _MAX_DIGITS else 10**_MAX_DIGITS


def is_element_name(name: str) -> bool:
    return _ELEMENT.match(name) is not None


def looks_like_element(name: str) -> bool:
    return _ELEMENTISH.match(name) is not None


# ------------------------------------------------------------------------------------------------
# Statements
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class RecipeDecl:
    name: At[str]
    description: str | None
    pos: Pos


@dataclass(frozen=True, eq=False)
class Include:
    kind: Literal["extends", "import"]
    path: At[str]
    pos: Pos  # the keyword


@dataclass(frozen=True)
class GlobalClause:
    """``global amax|row|none [BOUND]``: per tensor, per row or no global scale, and the block
    scale value the amax is mapped onto (None: the scale format's max)."""

    kind: Literal["amax", "row", "none"]
    bound: At[float] | None = None


@dataclass(frozen=True)
class TargetsClause:
    """``targets T1 T2 ... [by mse|mae]``: the values a block's amax may be mapped onto."""

    targets: tuple[float, ...]
    error: str = "mse"


@dataclass(frozen=True)
class CorrectClause:
    """``correct eden [GROUP]`` or ``correct none``; ``group`` None: the block length."""

    kind: Literal["eden", "none"]
    group: At[int] | None = None


@dataclass(frozen=True, eq=False)
class FormatDef:
    name: At[str]
    base: At[str]  # as written: an element name or the name of a format to start from
    element: ElementFormat | None  # set when ``base`` is an element
    special: At[str] | None
    block: At[Shape] | None
    scale: At[ElementFormat | None] | None  # a None value means fp32 scales
    rounding: At[str] | None
    global_scale: At[GlobalClause] | None
    targets: At[TargetsClause] | None = None
    correct: At[CorrectClause] | None = None


@dataclass(frozen=True)
class FormatRef:
    kind: Literal["format", "mor"]
    name: str


@dataclass(frozen=True, eq=False)
class OperandStmt:
    selector: At[tuple[Operand, ...]]
    format: At[FormatRef] | None
    block: At[Shape] | None
    rounding: At[str] | None
    rht: At[RHTSpec | None] | None
    # ``from GEMM.ROLE`` (the copy quantized from) or ``from none`` (a None value)
    source: At[Operand | None] | None = None
    # ``global per expert|tensor``: the global amax's scope in an experts module
    global_scope: At[str] | None = None


@dataclass(frozen=True, eq=False)
class OperandsSection:
    pos: Pos
    statements: tuple[OperandStmt, ...]


@dataclass(frozen=True, eq=False)
class MoRDef:
    name: At[str]
    spec: MoRSpec


@dataclass(frozen=True)
class ActionRef:
    kind: Literal["format", "recipe"]
    name: str  # a format name or a recipe path as written


@dataclass(frozen=True, eq=False)
class LayerStmt:
    selector: LayerSelector
    action: At[ActionRef]


@dataclass(frozen=True, eq=False)
class ScheduleStmt:
    step: int | None
    fraction: float | None
    passes: Literal["forward", "backward", "both"]
    action: At[ActionRef]


@dataclass(frozen=True, eq=False)
class LayersSection:
    pos: Pos
    rules: tuple[LayerStmt, ...]


@dataclass(frozen=True, eq=False)
class ScheduleSection:
    pos: Pos
    rules: tuple[ScheduleStmt, ...]


@dataclass(frozen=True, eq=False)
class EvalStmt:
    """``eval : fprop | ACTION``; ``action`` is None for ``fprop`` (the default)."""

    action: At[ActionRef] | None
    pos: Pos  # the keyword


Statement = (
    RecipeDecl
    | Include
    | FormatDef
    | OperandsSection
    | MoRDef
    | LayersSection
    | ScheduleSection
    | EvalStmt
)


# ------------------------------------------------------------------------------------------------
# Builder
# ------------------------------------------------------------------------------------------------


def build_statements(tree: Tree, source: Source) -> list[Statement]:
    return _Builder(source).items(tree)


class _Builder:
    def __init__(self, source: Source) -> None:
        self.source = source

    # --- positions --------------------------------------------------------------------------
    def pos(self, node: Token | Tree) -> Pos:
        if isinstance(node, Token):
            return Pos(self.source, node.line or 1, node.column or 1)
        return Pos(self.source, node.meta.line, node.meta.column)

    def at(self, token: Token) -> At[str]:
        if token.type == "NAME" and len(token) > MAX_NAME_CHARS:
            raise self.pos(token).error(
                f"a name of {len(token):,} characters ({clip(str(token))}); names are at most "
                f"{MAX_NAME_CHARS} characters"
            )
        return At(str(token), self.pos(token))

    # --- top level --------------------------------------------------------------------------
    def items(self, tree: Tree) -> list[Statement]:
        out: list[Statement] = []
        for item in tree.children:
            if isinstance(item, Tree):
                out.append(getattr(self, str(item.data))(item))
        return out

    def recipe_decl(self, tree: Tree) -> RecipeDecl:
        name_tok = tree.children[0]
        name = self.at(name_tok)
        if name_tok.type == "STRING":
            name = At(self.string(name_tok), name.pos)
            if not name.value:
                raise name.pos.error("the recipe name must not be empty")
        desc = self.string(tree.children[1]) if len(tree.children) > 1 else None
        return RecipeDecl(name, desc, self.pos(tree))

    def extends_decl(self, tree: Tree) -> Include:
        return Include("extends", self.path(tree.children[0]), self.pos(tree))

    def import_decl(self, tree: Tree) -> Include:
        return Include("import", self.path(tree.children[0]), self.pos(tree))

    def path(self, token: Token) -> At[str]:
        value = self.string(token)
        if not value:
            raise self.pos(token).error("empty file name")
        return At(value, self.pos(token))

    # --- formats ----------------------------------------------------------------------------
    def format_def(self, tree: Tree) -> FormatDef:
        children = list(tree.children)
        name = self.at(children.pop(0))
        base = self.at(children.pop(0))
        special: At[str] | None = None
        if children and isinstance(children[0], Tree) and children[0].data == "special":
            special = self.special(children.pop(0))
        clauses: dict[str, At] = {}
        for clause in children:
            kind = str(clause.data)
            if kind in clauses:
                word = kind.removeprefix("f_")
                first = clauses[kind].pos
                raise self.pos(clause).error(
                    f"'{word}' given twice in the definition of {name.value} "
                    f"(first on {first.where()})"
                )
            clauses[kind] = self.format_clause(clause)
        element = None
        if is_element_name(base.value):
            element = self.element(base, special, what="element")
        elif special is not None:
            raise special.pos.error(
                f"'{special.value}' sets the special values of an element (eXmY); "
                f"'{base.value}' is a format name"
            )
        return FormatDef(
            name=name,
            base=base,
            element=element,
            special=special,
            block=clauses.get("f_block"),
            scale=clauses.get("f_scale"),
            rounding=clauses.get("f_round"),
            global_scale=clauses.get("f_global"),
            targets=clauses.get("f_targets"),
            correct=clauses.get("f_correct"),
        )

    def format_clause(self, clause: Tree) -> At:
        kind = str(clause.data)
        first = clause.children[0]
        if kind == "f_block":
            return self.shape(first)
        if kind == "f_scale":
            special = None
            if len(clause.children) > 1:
                special = self.special(clause.children[1])
            name = self.at(first)
            if name.value == "fp32":
                if special is not None:
                    raise special.pos.error("fp32 scales take no special-value option")
                return At(None, name.pos)
            if not is_element_name(name.value):
                raise name.pos.error(
                    f"bad scale format '{name.value}': expected an element such as e4m3, an "
                    "unsigned exponent-only format such as ue8m0, or fp32"
                )
            return At(self.element(name, special, what="scale"), name.pos)
        if kind == "f_round":
            return self.at(first)
        if kind == "f_global":
            bound = None
            if len(clause.children) > 1:
                bound = self.number(clause.children[1], what="global bound")
                if str(first) == "none":
                    raise bound.pos.error(
                        "'global none' has no bound: a bound belongs to global amax or global row"
                    )
            return At(GlobalClause(str(first), bound), self.pos(first))  # type: ignore[arg-type]
        if kind == "f_targets":
            numbers = [c for c in clause.children if isinstance(c, Tree)]
            values = tuple(self.number(c, what="target").value for c in numbers)
            error = [c for c in clause.children if isinstance(c, Token)]
            return At(
                TargetsClause(values, str(error[0]) if error else "mse"), self.pos(numbers[0])
            )
        if kind == "f_correct":
            group = None
            if len(clause.children) > 1:
                token = clause.children[1]
                group = At(number(str(token)), self.pos(token))
                if str(first) == "none":
                    raise group.pos.error("'correct none' takes no group length")
                if group.value < 1 or group.value > MAX_EDEN_GROUP:
                    raise group.pos.error(
                        f"MS-EDEN group {clip(str(token))}: 1 to {MAX_EDEN_GROUP} elements"
                    )
            return At(CorrectClause(str(first), group), self.pos(first))  # type: ignore[arg-type]
        raise AssertionError(kind)

    def number(self, tree: Tree, *, what: str) -> At[float]:
        """A decimal number (INT or DECIMAL) as the nearest double (the exact value of a
        format's grid point when it is written out in full, as the printer does); more than
        MAX_NUMBER_CHARS characters or a value beyond 2^128 is refused."""
        token = tree.children[0]
        text = str(token)
        pos = self.pos(token)
        if len(text) > MAX_NUMBER_CHARS:
            raise pos.error(
                f"{what} {clip(text)}: a number of {len(text):,} characters; at most "
                f"{MAX_NUMBER_CHARS} (enough for every value of an 8-bit format in full)"
            )
        value = float(text)
        if value >= 2.0**128:
            raise pos.error(f"{what} {clip(text)}: beyond every format's range")
        return At(value, pos)

    def special(self, tree: Tree) -> At[str]:
        return self.at(tree.children[0])

    def element(self, name: At[str], special: At[str] | None, *, what: str) -> ElementFormat:
        """Check and build an element format, with a message for each way it can be wrong."""
        match = _ELEMENT.match(name.value)
        if match is None:
            raise name.pos.error(
                f"bad element name '{name.value}': expected eXmY (X exponent bits, Y mantissa "
                "bits) such as e2m1 or e4m3, or ueXm0 for an unsigned scale"
            )
        unsigned = match.group(1) == "u"
        exp_bits, man_bits = number(match.group(2)), number(match.group(3))
        if unsigned:
            if what != "scale":
                raise name.pos.error(
                    f"{name.value} is an unsigned exponent-only scale format; {what}s need a "
                    f"sign bit: use a signed eXmY"
                )
            if man_bits != 0:
                raise name.pos.error(
                    f"{name.value}: unsigned scale formats are exponent-only (ueXm0); "
                    f"write ue{exp_bits}m0, or e{exp_bits}m{man_bits} for a signed scale"
                )
            if not 2 <= exp_bits <= 8:
                raise name.pos.error(
                    f"{name.value}: exponent-only scales have 2 to 8 exponent bits"
                )
            if special is not None:
                raise special.pos.error(
                    f"{name.value} takes no special-value option: its all-ones code is NaN"
                )
            return ElementFormat(exp_bits, 0, signed=False)
        if exp_bits < 1:
            raise name.pos.error(f"{name.value}: a minifloat needs at least one exponent bit")
        bits = 1 + exp_bits + man_bits
        if not 3 <= bits <= 8:
            raise name.pos.error(
                f"{name.value} is {bits} bits wide (1 sign + {exp_bits} exponent + {man_bits} "
                "mantissa); element formats are 3 to 8 bits wide"
            )
        chosen = special.value if special is not None else default_special(exp_bits, man_bits)
        if chosen == "ieee" and man_bits == 0:
            assert special is not None
            raise special.pos.error(
                f"{name.value} has no mantissa bits, so the ieee convention has no NaN codes: "
                "use finite or fn"
            )
        return ElementFormat(exp_bits, man_bits, True, chosen)  # type: ignore[arg-type]

    def shape(self, token: Token) -> At[Shape]:
        rows, cols = (number(part) for part in str(token).split("x"))
        pos = self.pos(token)
        shown = clip(str(token))
        if rows < 1 or cols < 1:
            raise pos.error(f"block {shown}: block dimensions must be at least 1")
        if rows > MAX_BLOCK_DIM or cols > MAX_BLOCK_DIM:
            raise pos.error(
                f"block {shown}: a block dimension is at most {MAX_BLOCK_DIM}, e.g. "
                f"1x{MAX_BLOCK_DIM} or 128x128"
            )
        if rows != 1 and rows != cols:
            raise pos.error(
                f"block {shown}: 1D blocks are 1xN (along the dot-product dimension) and 2D "
                "blocks are square NxN"
            )
        if rows * cols > MAX_BLOCK_ELEMENTS:
            raise pos.error(
                f"block {shown} has {rows * cols:,} elements; a block has at most "
                f"{MAX_BLOCK_ELEMENTS:,} (up to 256x256)"
            )
        return At((rows, cols), pos)

    # --- operands ---------------------------------------------------------------------------
    def operands_sec(self, tree: Tree) -> OperandsSection:
        stmts = tuple(self.operand_stmt(s) for s in tree.children if isinstance(s, Tree))
        return OperandsSection(self.pos(tree), stmts)

    def operand_stmt(self, tree: Tree) -> OperandStmt:
        selector_tree, *props = tree.children
        selector = self.selector(selector_tree)
        found: dict[str, At] = {}
        for prop in props:
            kind = str(prop.data)
            key = {"o_rht_none": "o_rht", "mor_ref": "format_ref", "o_from_none": "o_from"}.get(
                kind, kind
            )
            if key in found:
                word = {
                    "o_block": "block",
                    "o_round": "round",
                    "o_rht": "rht",
                    "o_from": "from",
                    "o_global": "global",
                }[key]
                raise self.pos(prop).error(
                    f"'{word}' given twice in one statement (first at column "
                    f"{found[key].pos.column})"
                )
            found[key] = self.operand_prop(prop)
        return OperandStmt(
            selector=selector,
            format=found.get("format_ref"),
            block=found.get("o_block"),
            rounding=found.get("o_round"),
            rht=found.get("o_rht"),
            source=found.get("o_from"),
            global_scope=found.get("o_global"),
        )

    def selector(self, tree: Tree) -> At[tuple[Operand, ...]]:
        parts = [t for t in tree.children if isinstance(t, Token)]
        pos = self.pos(parts[0])
        if parts[0].type == "STAR":
            return At(tuple(Operand), pos)
        first = str(parts[0])
        if len(parts) == 1:
            if first in ROLES:
                return At(tuple(op for op in Operand if op.role == first), pos)
            if first in GEMMS:
                return At(tuple(op for op in Operand if op.gemm == first), pos)
            words = ["weight", "activation", "gradient", *GEMMS]
            hint = did_you_mean(first, words + [op.selector for op in Operand])
            raise pos.error(
                f"unknown selector '{first}': expected *, a role (weight, activation, "
                f"gradient), a GEMM (fprop, dgrad, wgrad) or gemm.role{hint}"
            )
        role = str(parts[1])
        if first not in GEMMS:
            raise pos.error(
                f"unknown GEMM '{first}' in selector '{first}.{role}': expected fprop, dgrad "
                f"or wgrad{did_you_mean(first, list(GEMMS))}"
            )
        for op in Operand:
            if op.gemm == first and op.role == role:
                return At((op,), pos)
        names = [op.role for op in Operand if op.gemm == first]
        role_pos = self.pos(parts[1])
        raise role_pos.error(
            f"{first} has no '{role}' operand: its operands are {first}.{names[0]} and "
            f"{first}.{names[1]}"
        )

    def operand_prop(self, prop: Tree) -> At:
        kind = str(prop.data)
        pos = self.pos(prop)
        if kind == "format_ref":
            name = self.at(prop.children[0])
            return At(FormatRef("format", name.value), name.pos)
        if kind == "mor_ref":
            name = self.at(prop.children[0])
            return At(FormatRef("mor", name.value), name.pos)
        if kind == "o_block":
            return self.shape(prop.children[0])
        if kind == "o_round":
            return self.at(prop.children[0])
        if kind == "o_rht_none":
            return At(None, pos)
        if kind == "o_rht":
            return At(self.rht(prop), pos)
        if kind == "o_from_none":
            return At(None, pos)
        if kind == "o_from":
            return At(self.copied_from(prop), pos)
        if kind == "o_global":  # at the scope word, where a misuse is reported
            return self.at(prop.children[0])
        raise AssertionError(kind)

    def copied_from(self, prop: Tree) -> Operand:
        """The operand ``from GEMM.ROLE`` names; which pairs are allowed is checked once the
        cascade has said which operand the statement applies to."""
        gemm_tok, role_tok = prop.children
        gemm, role = str(gemm_tok), str(role_tok)
        for op in Operand:
            if op.gemm == gemm and op.role == role:
                return op
        known = ", ".join(op.selector for op in Operand)
        hint = did_you_mean(f"{gemm}.{role}", [op.selector for op in Operand])
        raise self.pos(gemm_tok).error(
            f"'from {clip(gemm)}.{clip(role)}' names no GEMM operand{hint}: expected one of {known}"
        )

    def rht(self, prop: Tree) -> RHTSpec:
        size_tok = prop.children[0]
        size = number(size_tok)
        size_pos = self.pos(size_tok)
        if size < 2 or size > 256 or size & (size - 1):
            raise size_pos.error(
                f"RHT size {clip(str(size_tok))} is not a power of two from 2 to 256 (the paper "
                "uses 16)"
            )
        signs = prop.children[1] if len(prop.children) > 1 else None
        if signs is None:
            if size != 16:
                raise size_pos.error(
                    f"rht {size} needs a sign source: the default, Transformer Engine's fixed "
                    f"vector (signs te), has 16 entries; add `seed N`, `signs none` or a "
                    f"{size}-sign string"
                )
            return RHTSpec(16, "fixed", TE_SIGNS_16)
        kind = str(signs.data)
        if kind == "signs_te":
            if size != 16:
                raise self.pos(signs.children[0]).error(
                    f"signs te is Transformer Engine's fixed 16-entry vector, but the RHT size "
                    f"is {size}: use `seed N`, `signs none` or a {size}-sign string"
                )
            return RHTSpec(16, "fixed", TE_SIGNS_16)
        if kind == "signs_none":
            return RHTSpec(size, "none", None)
        if kind in ("signs_seed", "signs_redrawn"):
            redraw = str(signs.children[0]) if kind == "signs_redrawn" else None
            seed_tok = signs.children[-1] if len(signs.children) > (redraw is not None) else None
            seed = 0 if seed_tok is None else number(seed_tok)
            if seed >= 2**64:
                raise self.pos(seed_tok).error(
                    f"RHT seed {clip(str(seed_tok))} does not fit in 64 bits: a seed is a whole "
                    "number from 0 to 18446744073709551615"
                )
            if redraw is not None:  # drawn per layer, or per layer and step (numerics.md 12)
                return RHTSpec(size, redraw, None, seed)  # type: ignore[arg-type]
            return RHTSpec(size, "seeded", None, seed)
        # signs_fixed: a string of + and -
        tok = signs.children[0]
        text = self.string(tok)
        for i, char in enumerate(text):
            if char not in "+-":
                # +1 for the opening quote; escapes are not expected in sign strings
                raise (
                    self.pos(tok)
                    .shifted(i + 1)
                    .error(f"a sign string holds only '+' and '-', found {char!r}")
                )
        if len(text) != size:
            raise self.pos(tok).error(
                f"the sign string has {len(text)} signs but the RHT size is {size}"
            )
        return RHTSpec(size, "fixed", tuple(1 if c == "+" else -1 for c in text))

    # --- mixture of representations ---------------------------------------------------------
    def mor_def(self, tree: Tree) -> MoRDef:
        name_tok, *stmts = tree.children
        name = self.at(name_tok)
        decide: At[Partition] | None = None
        scale: tuple[At[Partition], str] | None = None
        candidates: list[Candidate] = []
        fallback: Pos | None = None
        for stmt in stmts:
            kind = str(stmt.data)
            pos = self.pos(stmt)
            if kind == "m_decide":
                if decide is not None:
                    raise pos.error(
                        f"'decide' given twice in mor {name.value} (first on {decide.pos.where()})"
                    )
                decide = self.partition(stmt.children[0])
            elif kind == "m_scale":
                if scale is not None:
                    raise pos.error(
                        f"'scale' given twice in mor {name.value} (first on {scale[0].pos.where()})"
                    )
                scale = (self.partition(stmt.children[0]), str(stmt.children[1]))
            elif kind in ("m_try", "m_else"):
                if fallback is not None:
                    word = "try" if kind == "m_try" else "else"
                    raise pos.error(
                        f"'{word}' after 'else' (on {fallback.where()}): the else fallback "
                        "must be the last candidate"
                    )
                cand = self.candidate(stmt.children[0])
                if kind == "m_else":
                    fallback = pos
                    candidates.append(Candidate(cand.value))
                else:
                    candidates.append(Candidate(cand.value, self.metric(stmt.children[1], cand)))
            else:
                raise AssertionError(kind)
        where = name.pos
        if decide is None:
            raise where.error(
                f"mor {name.value} needs a 'decide' line: decide tensor, decide block RxC or "
                "decide channel"
            )
        if scale is None:
            raise where.error(
                f"mor {name.value} needs a 'scale' line, e.g. `scale block 128x128 gam`"
            )
        if fallback is None:
            raise where.error(
                f"mor {name.value} has no 'else' fallback: end the candidates with e.g. `else bf16`"
            )
        if len(candidates) < 2:
            raise fallback.error(
                f"mor {name.value} has only the fallback: add a `try FORMAT if METRIC` line "
                "before 'else'"
            )
        spec = MoRSpec(
            name=name.value,
            decide=decide.value,
            scale=scale[0].value,
            scaling=scale[1],  # type: ignore[arg-type]
            candidates=tuple(candidates),
        )
        return MoRDef(name, spec)

    def partition(self, tree: Tree) -> At[Partition]:
        kind = str(tree.children[0])
        pos = self.pos(tree)
        if kind == "block":
            shape = self.shape(tree.children[1])
            return At(Partition("block", shape.value), pos)
        return At(Partition(kind), pos)  # type: ignore[arg-type]

    def candidate(self, tree: Tree) -> At[ElementFormat | HighPrecision]:
        name = self.at(tree.children[0])
        special = self.special(tree.children[1]) if len(tree.children) > 1 else None
        if name.value in HIGH_PRECISION_DTYPES:
            if special is not None:
                raise special.pos.error(f"{name.value} takes no special-value option")
            return At(HighPrecision(name.value), name.pos)
        if not is_element_name(name.value):
            raise name.pos.error(
                f"'{name.value}' cannot be a mor candidate: candidates are elements such as "
                "e4m3 or e5m2 (the mor's scale line gives their scaling), or bf16, fp16, fp32"
            )
        return At(self.element(name, special, what="candidate"), name.pos)

    def metric(self, tree: Tree, cand: At[ElementFormat | HighPrecision]) -> Metric:
        kind = str(tree.data)
        if kind == "relerr":
            tok = tree.children[0]
            value = self.percent(tok)
            if not 0 < value < 100:
                raise self.pos(tok).error(
                    f"threshold {clip(str(tok))} is out of range: a relative-error threshold lies "
                    "strictly between 0% and 100%"
                )
            return Metric("relerr", threshold=value / 100)
        if kind == "relerr_vs":
            versus = self.candidate(tree.children[0])
            if not isinstance(versus.value, ElementFormat):
                raise versus.pos.error(
                    f"relerr({versus.value.name}) compares against an element format such as "
                    "e5m2; a high-precision dtype has no error to compare with"
                )
            return Metric("relerr_vs", versus=versus.value)
        if kind == "range":
            if not isinstance(cand.value, ElementFormat):
                raise self.pos(tree).error(
                    f"'range' checks an element format's normal range; {cand.value.name} is a "
                    "high-precision dtype"
                )
            return Metric("range")
        raise AssertionError(kind)

    # --- layers and schedule ----------------------------------------------------------------
    def layers_sec(self, tree: Tree) -> LayersSection:
        rules = tuple(self.layer_stmt(s) for s in tree.children if isinstance(s, Tree))
        return LayersSection(self.pos(tree), rules)

    def layer_stmt(self, tree: Tree) -> LayerStmt:
        if tree.data == "l_match":
            pattern_tok, action = tree.children
            pattern = self.string(pattern_tok)
            if not pattern:
                raise self.pos(pattern_tok).error("empty module-name pattern")
            return LayerStmt(LayerSelector("match", pattern=pattern), self.action(action))
        end, amount, unit_tok, action = tree.children
        unit = "blocks" if str(unit_tok).startswith("block") else "layers"
        if amount.type == "PERCENT":
            value = self.percent(amount)
            if not 0 < value <= 100:
                raise self.pos(amount).error(
                    f"{clip(str(amount))} is out of range: a share of the {unit} lies in (0%, 100%]"
                )
            selector = LayerSelector(str(end), unit, fraction=value / 100)  # type: ignore[arg-type]
        else:
            count = number(amount)
            if count < 1:
                raise self.pos(amount).error(f"the count of {unit} must be at least 1")
            if count > MAX_COUNT:
                raise self.pos(amount).error(
                    f"{clip(str(amount))} {unit} is out of range: a count of {unit} is at most "
                    f"{MAX_COUNT:,} (or give a share, e.g. 15%)"
                )
            selector = LayerSelector(str(end), unit, count=count)  # type: ignore[arg-type]
        return LayerStmt(selector, self.action(action))

    def schedule_sec(self, tree: Tree) -> ScheduleSection:
        rules = tuple(self.sched_stmt(s) for s in tree.children if isinstance(s, Tree))
        return ScheduleSection(self.pos(tree), rules)

    def sched_stmt(self, tree: Tree) -> ScheduleStmt:
        point, *rest = tree.children
        passes = "both"
        if len(rest) == 2:
            passes = str(rest[0])
        action = self.action(rest[-1])
        if point.type == "PERCENT":
            value = self.percent(point)
            if not 0 < value < 100:
                raise self.pos(point).error(
                    f"{clip(str(point))} is out of range: a point in training lies strictly "
                    "between 0% and 100% (use `at step 0` for the start)"
                )
            return ScheduleStmt(None, value / 100, passes, action)  # type: ignore[arg-type]
        step = number(point)
        if step > MAX_STEP:
            raise self.pos(point).error(
                f"step {clip(str(point))} is out of range: a step is at most {MAX_STEP:,} "
                "(2^63 - 1, a 64-bit step counter)"
            )
        return ScheduleStmt(step, None, passes, action)  # type: ignore[arg-type]

    def eval_decl(self, tree: Tree) -> EvalStmt:
        (what,) = tree.children
        if isinstance(what, Token):  # fprop: the forward's own operands, as in training
            return EvalStmt(None, self.pos(tree))
        return EvalStmt(self.action(what), self.pos(tree))

    def action(self, tree: Tree) -> At[ActionRef]:
        tok = tree.children[0]
        if tree.data == "a_recipe":
            path = self.path(tok)
            return At(ActionRef("recipe", path.value), path.pos)
        return At(ActionRef("format", str(tok)), self.pos(tok))

    # --- literals ---------------------------------------------------------------------------
    def percent(self, token: Token) -> float:
        # float() of a digit string never raises: an absurd one becomes inf, which every range
        # check rejects.
        return float(str(token)[:-1])

    def string(self, token: Token) -> str:
        """Unquote a string token; the escapes are \\\\, \\", \\n and \\t."""
        raw = str(token)[1:-1]
        if len(raw) > MAX_STRING_CHARS:
            raise self.pos(token).error(
                f"a string of {len(raw):,} characters; strings are at most "
                f"{MAX_STRING_CHARS:,} characters"
            )
        out: list[str] = []
        i = 0
        while i < len(raw):
            char = raw[i]
            if char == "\\":
                nxt = raw[i + 1]
                if nxt not in _ESCAPES:
                    raise (
                        self.pos(token)
                        .shifted(i + 1)
                        .error(f"unknown escape '\\{nxt}' in a string: use \\\\, \\\", \\n or \\t")
                    )
                out.append(_ESCAPES[nxt])
                i += 2
            else:
                out.append(char)
                i += 1
        return "".join(out)


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "t": "\t"}
