"""Hypothesis strategies that write valid ``.fp4r`` recipes over the whole grammar.

``recipe_cases()`` draws a ``RecipeCase``: the text of a main recipe, the helper files it
``extends``, ``import``s or names with ``recipe "..."`` (written into a folder by
``RecipeCase.write``), and what the operand cascade must resolve to (``expected``: the six
``OperandSpec``s, computed here independently of ``fp4gen.dsl.resolve``).

What is drawn: elements of 3 to 8 bits with and without ``finite``/``fn``/``ieee``; 1xN and NxN
blocks (N also not a power of two); signed, exponent-only and fp32 scales with every scale rounding
the scale takes (``stochastic`` too); ``global amax``/``row``/``none`` with and without a bound;
block targets by mse or mae and ``correct eden``/``none`` (docs/numerics.md 11, reset where an
inherited one no longer fits; per-row formats only where a token operand uses them); formats built
from an element or from another format (built-in, inherited, imported or defined earlier); every
element rounding; RHTs of every size and sign source (``signs layer``/``step`` too); operand sources
(``from GEMM.ROLE`` on the one operand of each pair, later format or rounding statements that keep
it, ``from none``); ``global per tensor``/``expert`` (kept over format changes, reset where a later
format has no global amax); MoR rules with every partition, scaling and metric; layer rules,
schedules and ``eval`` statements with format, dtype and ``recipe "..."`` actions (and ``eval :
fprop``); ``extends`` (also from a sub-folder) and ``import``; names that are keywords elsewhere
(``up``, ``tensor``, ``none``); numbers with leading zeros; comments, blank lines, tabs, CRLF line
ends, one-line sections.

A recipe is valid by construction, except one combination that is refused on purpose and drawn now
and then (``RecipeCase.refusable``): a global amax scale whose element and scale formats cannot
carry one (``fp4gen.formats.global_scale_problem``: a scale as wide as fp32, ue8m0, or a product
elem_max * scale_max outside fp32's range).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path

from hypothesis import strategies as st

from fp4gen.dsl.model import (
    GEMMS,
    ROLES,
    SOURCE_PAIRS,
    TE_SIGNS_16,
    MoRRef,
    Operand,
    OperandSpec,
    RHTSpec,
)
from fp4gen.errors import FP4GenError
from fp4gen.formats import (
    BUILTIN_FORMATS,
    FLT_MAX,
    HIGH_PRECISION_DTYPES,
    MAX_EDEN_GROUP,
    BlockFormat,
    ElementFormat,
    HighPrecision,
    ScaleSpec,
    default_special,
    grid_values,
    target_scale_problem,
)

Format = BlockFormat | HighPrecision
Shape = tuple[int, int]

# Block lengths: powers of two and not (3, 12, 24, 48, 100), up to the 1x1024 limit.
LENGTHS_1D = [1, 2, 3, 4, 8, 12, 16, 24, 32, 48, 64, 100, 128, 256, 1024]
LENGTHS_2D = [2, 4, 8, 12, 16, 24, 32, 64, 128, 256]
RHT_SIZES = [2, 4, 8, 16, 32, 64, 128, 256]
ELEMENT_ROUNDINGS = ["nearest", "stochastic", "stochastic16", "stochastic8", "zero"]
# names that are keywords elsewhere in the grammar, and plain ones
FORMAT_NAMES = ["fa", "fb", "fc", "up", "tensor", "none", "seed", "x_1", "Wide"]
MOR_NAMES = ["m1", "m2", "channel", "gam"]
REFUSALS = ("global amax cannot be used with", "need no global scale", "do not need one")
# the copies whose rows are tokens: the only ones a format with per-row global scales may serve
TOKEN_ROWS = (Operand.FPROP_ACTIVATION, Operand.DGRAD_GRADIENT)


@dataclass
class RecipeCase:
    """A drawn recipe: ``files`` maps a relative path to its text; ``main`` is the recipe."""

    files: dict[str, str]
    main: str = "main.fp4r"
    expected: dict[Operand, OperandSpec] | None = None  # None when the recipe may be refused
    refusable: bool = False  # holds a combination refused on purpose (module docstring)
    layer_count: int = 0
    schedule_count: int = 0
    evaluated: bool = False  # an eval statement other than `eval : fprop` is in force

    @property
    def text(self) -> str:
        return self.files[self.main]

    def write(self, folder: Path) -> Path:
        for rel, text in self.files.items():
            path = folder / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode("utf-8"))
        return folder / self.main

    def listing(self) -> str:
        """Every file, for a failure message."""
        return "\n".join(f"--- {rel}\n{text}" for rel, text in self.files.items())


# ------------------------------------------------------------------------------------------------
# The cascade, as docs/recipe-language.md describes it
# ------------------------------------------------------------------------------------------------

UNSET = object()  # an RHT never set (the default, none), as opposed to `rht none`


@dataclass
class Slot:
    format: tuple[str, str] | None = None  # ("format" | "mor", name)
    block: Shape | None = None
    rounding: str | None = None
    rht: object = UNSET  # RHTSpec, None (`rht none`) or UNSET
    source: Operand | None = None  # `from GEMM.ROLE`; None: the tensor (default, `from none`)
    scope: str = "expert"  # `global per expert|tensor`: a property of its own, like the source

    def apply(
        self,
        fmt: tuple[str, str] | None,
        block: Shape | None,
        rnd: str | None,
        rht: object,
        source: object = UNSET,  # Operand, None (`from none`) or UNSET (not named)
        scope: str | None = None,  # `global per ...` where named
    ) -> None:
        if fmt is not None:  # a block override belongs to the format it was given with
            self.format, self.block = fmt, block
        elif block is not None:
            self.block = block
        if rnd is not None:
            self.rounding = rnd
        if rht is not UNSET:
            self.rht = rht
        if source is not UNSET:  # a property of its own: a format or rounding keeps it
            assert source is None or isinstance(source, Operand)
            self.source = source
        if scope is not None:
            self.scope = scope

    def copy(self) -> Slot:
        return Slot(self.format, self.block, self.rounding, self.rht, self.source, self.scope)


def has_global_amax(fmt: object) -> bool:
    """Whether ``global per tensor`` may be given to an operand in ``fmt``: one global amax."""
    return isinstance(fmt, BlockFormat) and fmt.global_scale and not fmt.global_rows


def exact(value: float) -> str:
    """A format value written out in full (the grammar has no exponents)."""
    return format(Decimal(value), "f")


def nests(length: int, size: int) -> bool:
    return length % size == 0 or size % length == 0


def resolve_slot(op: Operand, slot: Slot, scope: dict[str, Format]) -> OperandSpec | None:
    """The slot's spec, or None where the validator must refuse it."""
    if slot.format is None:
        return None
    kind, name = slot.format
    rounding = slot.rounding or "nearest"
    rht = None if slot.rht is UNSET else slot.rht
    assert rht is None or isinstance(rht, RHTSpec)
    if kind == "mor":
        if slot.block is not None or slot.scope != "expert":
            return None
        return OperandSpec(MoRRef(name), rounding, rht, slot.source)  # type: ignore[arg-type]
    fmt = scope[name]
    if isinstance(fmt, HighPrecision):
        if slot.block is not None or rounding != "nearest" or rht is not None:
            return None
        if slot.scope != "expert":
            return None
        return OperandSpec(fmt, source=slot.source)
    if slot.block is not None:
        try:
            fmt = fmt.with_block(slot.block)
        except ValueError:  # an option that needs other blocks (MS-EDEN, per-row scales)
            return None
    if fmt.is_2d and op.role != "weight":
        return None
    if fmt.global_rows and op not in TOKEN_ROWS:
        return None
    if slot.scope != "expert" and not has_global_amax(fmt):
        return None
    return OperandSpec(fmt, rounding, rht, slot.source, slot.scope)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# Text
# ------------------------------------------------------------------------------------------------


class _Writer:
    """Draws the pieces of recipes, keeping what the cascade and the scope will hold."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw
        self.refusable = False

    # --- lexical variety ------------------------------------------------------------------------
    def sp(self) -> str:
        return self.draw(st.sampled_from([" ", " ", " ", "  ", "\t", " \t "]))

    def num(self, value: int) -> str:
        """A non-negative integer, now and then with leading zeros."""
        return (
            "0" * self.draw(st.integers(1, 3)) if self.draw(st.integers(0, 9)) == 0 else ""
        ) + str(value)

    def shape(self, shape: Shape) -> str:
        return f"{self.num(shape[0])}x{self.num(shape[1])}"

    def percent(self, upper: int, inclusive: bool = False) -> tuple[str, float]:
        """A percentage in (0, upper) (or (0, upper]) and the fraction the parser makes of it."""
        hundredths = self.draw(st.integers(1, upper * 100 - (0 if inclusive else 1)))
        whole, frac = divmod(hundredths, 100)
        style = self.draw(st.integers(0, 3))
        if frac == 0 and style:
            text = str(whole)
        elif frac % 10 == 0 and style == 1:
            text = f"{whole}.{frac // 10}"
        else:
            text = f"{whole}.{frac:02d}"
        if self.draw(st.integers(0, 9)) == 0:
            text = "0" + text
        return text + "%", float(text) / 100

    def string(self, min_size: int = 0) -> str:
        """A quoted string: any characters but quote, backslash and line breaks, and escapes."""
        plain = st.characters(blacklist_categories=("Cs",), blacklist_characters='"\\\n\r')
        parts = self.draw(
            st.lists(
                st.text(plain, min_size=1, max_size=4)
                | st.sampled_from(["\\\\", '\\"', "\\n", "\\t"]),
                min_size=min_size,
                max_size=4,
            )
        )
        return '"' + "".join(parts) + '"'

    def comment(self) -> str:
        if self.draw(st.integers(0, 5)):
            return ""
        return self.sp() + "# " + self.draw(st.sampled_from(["note", "x : y { }", "é", ""]))

    # --- formats ---------------------------------------------------------------------------------
    def element(self, allow_ieee: bool = True) -> tuple[str, ElementFormat]:
        exp_bits = self.draw(st.integers(1, 7))
        man_bits = self.draw(st.integers(max(0, 2 - exp_bits), 7 - exp_bits))
        base = f"e{exp_bits}m{man_bits}"
        specials = ["finite", "fn"] + (["ieee"] if man_bits and allow_ieee else [])
        default = default_special(exp_bits, man_bits)
        special = self.draw(st.sampled_from([None, *specials]))
        chosen = special or default
        if chosen == "ieee" and man_bits == 0:  # only e.g. a bare e5m0 would imply it: never
            chosen, special = "finite", "finite"
        text = base if special is None else f"{base}{self.sp()}{special}"
        return text, ElementFormat(exp_bits, man_bits, True, chosen)  # type: ignore[arg-type]

    def scale(self) -> tuple[str, ElementFormat | None]:
        kind = self.draw(st.sampled_from(["signed", "signed", "unsigned", "unsigned", "fp32"]))
        if kind == "fp32":
            return "fp32", None
        if kind == "unsigned":
            exp_bits = self.draw(st.integers(2, 8))
            return f"ue{exp_bits}m0", ElementFormat(exp_bits, 0, signed=False)
        return self.element()

    def block(self, two_d: bool) -> Shape:
        if two_d and self.draw(st.integers(0, 2)) == 0:
            n = self.draw(st.sampled_from(LENGTHS_2D))
            return (n, n)
        return (1, self.draw(st.sampled_from(LENGTHS_1D)))

    def format_def(
        self, name: str, scope: dict[str, Format], allow_rows: bool = False
    ) -> tuple[str, Format]:
        """`format NAME = ...` and what it defines, given the formats in scope before it.
        ``allow_rows``: it may have per-row global scales (only where no layer, schedule or eval
        rule of a parent can name it: those apply a format to every operand)."""
        bases = [n for n, f in scope.items() if isinstance(f, BlockFormat)]
        kind = self.draw(st.sampled_from(["element", "element", "base", "dtype"]))
        if kind == "dtype":
            dtype = self.draw(st.sampled_from(HIGH_PRECISION_DTYPES))
            return f"format {name} ={self.sp()}{dtype}", HighPrecision(dtype)
        clauses: list[str] = []
        if kind == "element":
            head, element = self.element()
            block: Shape = self.block(True)
            scale_text, scale_el = self.scale()
            given_scale, given_block = True, True
            rounding, global_scale = None, False
        else:
            head = self.draw(st.sampled_from(bases))
            base = scope[head]
            assert isinstance(base, BlockFormat)
            element, block, scale_el = base.element, base.block, base.scale.element
            rounding, global_scale = base.scale.rounding, base.global_scale
            given_block, given_scale = self.draw(st.booleans()), self.draw(st.booleans())
            if given_block:
                block = self.block(True)
            if given_scale:
                scale_text, scale_el = self.scale()
                rounding = None
        if given_block:
            clauses.append(f"block{self.sp()}{self.shape(block)}")
        if given_scale:
            clauses.append(f"scale{self.sp()}{scale_text}")
        # scale rounding: what the scale takes; a new scale without one gets its default
        allowed = ["nearest"] if scale_el is None else ["nearest", "up", "down", "stochastic"]
        if scale_el is not None and scale_el.exponent_only:
            allowed.append("ocp")
        if rounding not in allowed:  # an inherited rounding the new scale does not take
            rounding = None
        if rounding is None or self.draw(st.booleans()):
            if rounding is None and self.draw(st.booleans()) and scale_el is not None:
                rounding = "up" if scale_el.exponent_only else "nearest"  # the default
            else:
                rounding = self.draw(st.sampled_from(allowed))
                clauses.append(f"round{self.sp()}{rounding}")
        # global scale: never with fp32 scales; a combination refused on purpose, now and then
        want_global = scale_el is not None and self.draw(st.booleans())
        spec = ScaleSpec(scale_el, rounding)  # type: ignore[arg-type]
        fmt: Format = BUILTIN_FORMATS["nvfp4"]  # a stand-in where the recipe is refused
        refused = False
        try:
            fmt = BlockFormat(name, element, block, spec, want_global)
        except (FP4GenError, ValueError):
            if self.draw(st.integers(0, 2)):  # mostly: written without the global scale
                want_global = False
                fmt = BlockFormat(name, element, block, spec, False)
            else:
                self.refusable = refused = True
        inherited = (
            (base.global_rows, base.global_bound, base.targets, base.target_error, base.eden_group)
            if kind == "base"
            else (False, None, (), "mse", None)
        )
        options, option_clauses = self.options(fmt, want_global, allow_rows, inherited)
        if refused:  # the stand-in's options would not be the format's: none drawn
            options.update(global_rows=False, global_bound=None)
            option_clauses = []
        if (want_global, options["global_rows"], options["global_bound"]) != (
            global_scale,
            inherited[0],
            inherited[1],
        ) or self.draw(st.booleans()):
            word = ("row" if options["global_rows"] else "amax") if want_global else "none"
            bound = options["global_bound"]
            written = "" if bound is None else f"{self.sp()}{exact(bound)}"
            clauses.append(f"global{self.sp()}{word}{written}")
        clauses.extend(option_clauses)
        if not self.refusable:
            fmt = replace(fmt, **options)  # type: ignore[arg-type]
        order = self.draw(st.permutations(clauses))
        return f"format {name} = {head}" + "".join(self.sp() + c for c in order), fmt

    def options(
        self,
        fmt: Format,
        want_global: bool,
        allow_rows: bool,
        inherited: tuple[bool, float | None, tuple[float, ...], str, int | None],
    ) -> tuple[dict[str, object], list[str]]:
        """The options of numerics.md 11 for the plain format ``fmt``: per-row global scales and
        a bound (written with the global clause by the caller), targets and MS-EDEN (their
        clauses returned); an inherited option the new format cannot take is reset."""
        assert isinstance(fmt, BlockFormat)
        rows, bound, targets, target_error, eden = inherited
        clauses: list[str] = []
        one_d, ocp = fmt.block[0] == 1, fmt.scale.rounding == "ocp"
        scale_el, elem_max = fmt.scale.element, fmt.element.max_finite
        # the global clause: per row now and then, a bound on the scale grid now and then
        rows = want_global and allow_rows and one_d and self.draw(st.integers(0, 3)) == 0
        bounds = [
            b
            for b in (grid_values(scale_el) if scale_el is not None else ())
            if b > 0 and 4 <= elem_max * b <= FLT_MAX
        ]
        keep = bound is not None and want_global and bound in bounds and self.draw(st.booleans())
        if not keep:
            bound = None
            if want_global and bounds and self.draw(st.integers(0, 2)) == 0:
                bound = self.draw(st.sampled_from(bounds))
        # targets: values of the element's grid, by mse or mae; the default again now and then;
        # with a global scale only those whose largest block scale it can carry
        # (fp4gen.formats.target_scale_problem)

        def carried(t: float) -> bool:
            return not want_global or target_scale_problem(fmt.element, fmt.scale, bound, t) is None

        grid = [v for v in grid_values(fmt.element) if v > 0 and carried(v)]
        if ocp or self.draw(st.integers(0, 3)) == 0:
            drawn = (
                ()
                if ocp
                else tuple(
                    self.draw(st.lists(st.sampled_from(grid), min_size=1, max_size=3, unique=True))
                )
            )
            error = self.draw(st.sampled_from(["mse", "mae"]))
            by = "" if error == "mse" and self.draw(st.booleans()) else f" by {error}"
            if drawn and drawn != (elem_max,):
                targets, target_error = drawn, error
                clauses.append("targets " + " ".join(exact(t) for t in drawn) + by)
            elif targets or self.draw(st.integers(0, 4)) == 0:  # back to the element's max
                targets, target_error = (), "mse"
                clauses.append(f"targets {exact(elem_max)}{by}")
        elif not all(carried(t) for t in targets):  # inherited ones the global scale refuses
            targets, target_error = (), "mse"
            clauses.append(f"targets {exact(elem_max)}")
        # MS-EDEN: a multiple of the block length along rows; reset where it no longer fits
        fits = one_d and not ocp
        if fits and self.draw(st.integers(0, 3)) == 0:
            eden = fmt.block[1] * self.draw(st.integers(1, 4))
            if eden > MAX_EDEN_GROUP:
                eden = fmt.block[1]
            written = "" if eden == fmt.block[1] and self.draw(st.booleans()) else f" {eden}"
            clauses.append(f"correct eden{written}")
        elif (eden is not None and (not fits or eden % fmt.block[1])) or (
            self.draw(st.integers(0, 9)) == 0
        ):
            eden = None
            clauses.append("correct none")
        options = {
            "global_rows": rows,
            "global_bound": bound,
            "targets": targets,
            "target_error": target_error,
            "eden_group": eden,
        }
        return options, clauses

    # --- RHT and MoR -----------------------------------------------------------------------------
    def rht(self, lengths: list[int]) -> tuple[str, RHTSpec]:
        """An RHT: mostly of a size that nests with every block length in ``lengths``."""
        # mostly a size that nests with the blocks (what the kernels take), now and then any
        sizes = [s for s in RHT_SIZES if all(nests(n, s) for n in lengths)]
        size = self.draw(
            st.sampled_from(sizes if sizes and self.draw(st.integers(0, 3)) else RHT_SIZES)
        )
        source = self.draw(st.sampled_from(["te", "seed", "none", "string", "layer", "step"]))
        if source in ("layer", "step"):  # drawn per layer (and step), the seed 0 by default
            if self.draw(st.booleans()):
                return f"rht {self.num(size)} signs {source}", RHTSpec(size, source, None, 0)
            seed = self.draw(st.integers(0, 2**64 - 1))
            return f"rht {self.num(size)} signs {source} seed {self.num(seed)}", RHTSpec(
                size, source, None, seed
            )
        if source == "te" and size == 16:
            text = self.draw(st.sampled_from(["rht 16", "rht 16 signs te", "rht 016 signs te"]))
            return text, RHTSpec(16, "fixed", TE_SIGNS_16)
        if source == "seed":
            seed = self.draw(st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 2**64 - 1]))
            return f"rht {self.num(size)} seed {self.num(seed)}", RHTSpec(
                size, "seeded", None, seed
            )
        if source == "none":
            return f"rht {self.num(size)} signs none", RHTSpec(size, "none", None)
        signs = self.draw(st.lists(st.sampled_from([1, -1]), min_size=size, max_size=size))
        written = "".join("+" if s > 0 else "-" for s in signs)
        return f'rht {self.num(size)} signs "{written}"', RHTSpec(size, "fixed", tuple(signs))

    def partition(self) -> str:
        kind = self.draw(st.sampled_from(["tensor", "channel", "block"]))
        if kind != "block":
            return kind
        return f"block{self.sp()}{self.shape(self.block(True))}"

    def candidate(self, dtype_ok: bool) -> tuple[str, bool]:
        """(text, is an element)."""
        if dtype_ok and self.draw(st.integers(0, 3)) == 0:
            return self.draw(st.sampled_from(HIGH_PRECISION_DTYPES)), False
        return self.element()[0], True

    def mor_def(self, name: str) -> list[str]:
        lines = [f"decide{self.sp()}{self.partition()}"]
        scaling = self.draw(st.sampled_from(["gam", "e8m0", "amax"]))
        lines.insert(self.draw(st.integers(0, 1)), f"scale{self.sp()}{self.partition()} {scaling}")
        for _ in range(self.draw(st.integers(1, 3))):
            cand, is_element = self.candidate(dtype_ok=True)
            metric = self.draw(st.sampled_from(["relerr", "relerr_vs", "range"]))
            if metric == "range" and is_element:
                written = "range"
            elif metric == "relerr_vs":
                written = f"relerr < relerr({self.element()[0]})"
            else:
                written = f"relerr{self.sp()}<{self.sp()}{self.percent(100)[0]}"
            lines.insert(self.draw(st.integers(0, len(lines))), f"try {cand} if {written}")
        lines.append(f"else {self.candidate(dtype_ok=True)[0]}")
        return self.section(f"mor {name}", lines)

    # --- sections --------------------------------------------------------------------------------
    def section(self, head: str, lines: list[str]) -> list[str]:
        if len(lines) == 1 and self.draw(st.integers(0, 2)) == 0:
            return [f"{head} {{ {lines[0]} }}"]
        indent = self.draw(st.sampled_from(["    ", "\t", "  ", ""]))
        body = [indent + line + self.comment() for line in lines]
        if self.draw(st.integers(0, 4)) == 0:
            body.insert(self.draw(st.integers(0, len(body))), "")
        return [f"{head} {{" + self.comment(), *body, "}"]

    def selector(self) -> tuple[str, tuple[Operand, ...]]:
        words = ["*", *ROLES, *GEMMS, *(op.selector for op in Operand)]
        word = self.draw(st.sampled_from(words))
        if word == "*":
            return word, tuple(Operand)
        if word in ROLES:
            return word, tuple(op for op in Operand if op.role == word)
        if word in GEMMS:
            return word, tuple(op for op in Operand if op.gemm == word)
        return word, tuple(op for op in Operand if op.selector == word)

    def action(self, scope: dict[str, Format], refs: list[str]) -> str:
        choices = ["dtype", "format"] + (["recipe"] if refs else [])
        kind = self.draw(st.sampled_from(choices))
        if kind == "dtype":
            return self.draw(st.sampled_from(HIGH_PRECISION_DTYPES))
        if kind == "recipe":
            return f'recipe "{self.draw(st.sampled_from(refs))}"'
        # a 1D block format or a dtype alias (a layer runs every operand in it)
        names = [
            n
            for n, f in scope.items()
            if isinstance(f, HighPrecision) or not (f.is_2d or f.global_rows)
        ]
        return self.draw(st.sampled_from(names))

    def layers(self, scope: dict[str, Format], refs: list[str]) -> list[str]:
        lines = []
        for _ in range(self.draw(st.integers(0, 4))):
            if self.draw(st.integers(0, 3)) == 0:
                head = f"match {self.string(min_size=1)}"
            else:
                end = self.draw(st.sampled_from(["first", "last"]))
                unit = self.draw(st.sampled_from(["blocks", "block", "layers", "layer"]))
                if self.draw(st.booleans()):
                    amount = self.percent(100, inclusive=True)[0]
                else:
                    amount = self.num(self.draw(st.integers(1, 1_000_000) | st.integers(1, 8)))
                head = f"{end}{self.sp()}{amount}{self.sp()}{unit}"
            lines.append(f"{head}{self.sp()}:{self.sp()}{self.action(scope, refs)}")
        return lines

    def schedule(self, scope: dict[str, Format], refs: list[str]) -> list[str]:
        lines = []
        for _ in range(self.draw(st.integers(0, 3))):
            if self.draw(st.booleans()):
                point = self.percent(100)[0]
            else:
                point = f"step {self.num(self.draw(st.integers(0, 2**63 - 1) | st.integers(0, 9)))}"
            passes = self.draw(st.sampled_from(["", " forward", " backward", " both"]))
            lines.append(f"at {point}{passes} : {self.action(scope, refs)}")
        return lines

    def evaluation(self, scope: dict[str, Format], refs: list[str]) -> tuple[list[str], bool]:
        """An eval statement, and whether it sets Recipe.evaluation (`fprop` is the default)."""
        if self.draw(st.integers(0, 3)) == 0:
            return [f"eval{self.sp()}:{self.sp()}fprop"], False
        return [f"eval{self.sp()}:{self.sp()}{self.action(scope, refs)}"], True


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------


@dataclass
class _File:
    """What one file defines, before it is written out."""

    items: list[list[str]] = field(default_factory=list)  # top-level items, each some lines
    formats: list[list[str]] = field(default_factory=list)  # format lines, in order
    operands: list[list[str]] = field(default_factory=list)  # operands sections, in order
    scope: dict[str, Format] = field(default_factory=dict)  # formats it defines
    mors: list[str] = field(default_factory=list)


def _assemble(w: _Writer, header: list[list[str]], body: _File) -> str:
    """Interleave the items; format definitions (each may name earlier ones) and operands
    sections (a cascade) keep their order."""
    items: list[list[str]] = list(w.draw(st.permutations(body.items))) if body.items else []
    for ordered in (body.formats, body.operands):
        # positions among the items so far, in order; each insertion shifts the later ones
        spots = sorted(w.draw(st.integers(0, len(items))) for _ in ordered)
        for shift, (spot, item) in enumerate(zip(spots, ordered, strict=True)):
            items.insert(spot + shift, item)
    lines: list[str] = []
    for item in [*header, *items]:
        if lines and w.draw(st.integers(0, 2)) == 0:
            lines.append(w.draw(st.sampled_from(["", "# a comment", "   ", "\t# é"])))
        lines.extend(item)
    ending = "\r\n" if w.draw(st.integers(0, 9)) == 0 else "\n"
    text = ending.join(line + (w.comment() if not line.endswith("{") else "") for line in lines)
    if w.draw(st.integers(0, 5)):
        text += ending
    return text


def _define(
    w: _Writer, file: _File, scope: dict[str, Format], names: list[str], allow_rows: bool = True
) -> None:
    """Format definitions into ``file``; ``scope`` grows as they are defined. A built-in name
    redefined never gets per-row global scales (a parent's rules may name it)."""
    for name in names:
        line, fmt = w.format_def(name, scope, allow_rows and name not in BUILTIN_FORMATS)
        file.formats.append([line])
        file.scope[name] = fmt
        scope[name] = fmt


def _operand_lines(
    w: _Writer, slots: dict[Operand, Slot], formats: list[str], mors: list[str], count: int
) -> list[str]:
    """``count`` random cascade statements (not necessarily valid on their own)."""
    lines = []
    for _ in range(count):
        text, ops = w.selector()
        props: list[str] = []
        fmt = block = rnd = None
        rht: object = UNSET
        if w.draw(st.integers(0, 2)):
            if mors and w.draw(st.integers(0, 4)) == 0:
                name = w.draw(st.sampled_from(mors))
                fmt = ("mor", name)
                props.append(f"mor {name}")
            else:
                name = w.draw(st.sampled_from(formats))
                fmt = ("format", name)
                props.append(name)
        if w.draw(st.integers(0, 3)) == 0:
            block = w.block(all(op.role == "weight" for op in ops))
            props.append(f"block {w.shape(block)}")
        if w.draw(st.integers(0, 2)) == 0:
            rnd = w.draw(st.sampled_from(ELEMENT_ROUNDINGS))
            props.append(f"round {rnd}")
        if w.draw(st.integers(0, 3)) == 0:
            if w.draw(st.booleans()):
                rht_text, rht = w.rht([])
            else:
                rht_text, rht = "rht none", None
            props.append(rht_text)
        source: object = UNSET
        if len(ops) == 1 and ops[0] in SOURCE_PAIRS and w.draw(st.booleans()):
            # only the one operand of a pair may name its source; a wider selector could not
            source = SOURCE_PAIRS[ops[0]]
            props.append(f"from{w.sp()}{source.selector}")
        elif w.draw(st.integers(0, 9)) == 0:  # valid on any selector: back to the tensor
            source = None
            props.append(f"from{w.sp()}none")
        scope_word = None
        if w.draw(st.integers(0, 5)) == 0:  # the global amax's scope in an experts module
            scope_word = w.draw(st.sampled_from(["tensor", "tensor", "expert"]))
            props.append(f"global{w.sp()}per{w.sp()}{scope_word}")
        if not props:
            rnd = "nearest"
            props.append("round nearest")
        head, *rest = props
        props = [head, *w.draw(st.permutations(rest))] if fmt else w.draw(st.permutations(props))
        for op in ops:
            slots[op].apply(fmt, block, rnd, rht, source, scope_word)
        lines.append(f"{text}{w.sp()}:{w.sp()}" + w.sp().join(props))
    return lines


def _repair(
    w: _Writer, slots: dict[Operand, Slot], scope: dict[str, Format], mors: list[str]
) -> list[str]:
    """Statements that make the final cascade valid, and the slots updated with them."""
    lines = []
    names = sorted(scope)
    # now and then a source first, so the statements below rewrite a slot that has one
    for op, source in SOURCE_PAIRS.items():
        if w.draw(st.integers(0, 3)) == 0:
            slots[op].apply(None, None, None, UNSET, source)
            lines.append(f"{op.selector}{w.sp()}:{w.sp()}from{w.sp()}{source.selector}")
    for op in Operand:
        if resolve_slot(op, slots[op], scope) is not None and w.draw(st.integers(0, 5)):
            continue
        # the whole slot, written out: a format (or mor), block, rounding, RHT
        choices = [
            ("format", n)
            for n in names
            if not (isinstance(scope[n], BlockFormat) and scope[n].global_rows)  # type: ignore[union-attr]
            or op in TOKEN_ROWS
        ] + [("mor", m) for m in mors]
        kind, name = w.draw(st.sampled_from(choices))
        fmt = scope.get(name) if kind == "format" else None
        block = None
        if isinstance(fmt, BlockFormat) and (
            (fmt.is_2d and op.role != "weight") or w.draw(st.integers(0, 2)) == 0
        ):
            block = w.block(op.role == "weight")
        if isinstance(fmt, BlockFormat) and (fmt.eden_group or fmt.global_rows):
            block = None  # they are 1D and MS-EDEN's group must stay a multiple of the block
        rnd = (
            "nearest"
            if isinstance(fmt, HighPrecision)
            else w.draw(st.sampled_from(ELEMENT_ROUNDINGS))
        )
        props = [name if kind == "format" else f"mor {name}"]
        if block is not None:
            props.append(f"block {w.shape(block)}")
        props.append(f"round {rnd}")
        props.append("rht none")
        # the scope carries over format changes: per tensor only where there is a global amax
        scope_word = None
        if has_global_amax(fmt):
            scope_word = w.draw(st.sampled_from([None, "tensor", "tensor", "expert"]))
        elif slots[op].scope != "expert":
            scope_word = "expert"
        if scope_word is not None:
            props.append(f"global per {scope_word}")
        slots[op].apply((kind, name), block, rnd, None, scope=scope_word)
        lines.append(f"{op.selector} : " + " ".join(props))
    # both operands of a GEMM transformed alike; now and then an RHT for the pair
    for gemm in GEMMS:
        pair = [op for op in Operand if op.gemm == gemm]
        specs = [resolve_slot(op, slots[op], scope) for op in pair]
        assert all(s is not None for s in specs)
        if specs[0].rht == specs[1].rht and w.draw(st.integers(0, 2)):  # type: ignore[union-attr]
            continue
        lengths = [s.format.block_len for s in specs if isinstance(s.format, BlockFormat)]  # type: ignore[union-attr]
        high = any(isinstance(s.format, HighPrecision) for s in specs)  # type: ignore[union-attr]
        if high or w.draw(st.booleans()):
            text, rht = "rht none", None
        else:
            text, rht = w.rht(lengths)
        for op in pair:
            slots[op].apply(None, None, None, rht)
        lines.append(f"{gemm} : {text}")
    # no copy quantized from another where either is per tensor (its amax is the tensor's)
    for op, source in SOURCE_PAIRS.items():
        if slots[op].source is not None:
            for o in (op, source):
                if slots[o].scope != "expert":
                    slots[o].apply(None, None, None, UNSET, scope="expert")
                    lines.append(f"{o.selector} : global per expert")
    return lines


def _ref_recipe(w: _Writer) -> str:
    """A small complete recipe that a layer or schedule rule names with ``recipe "..."``."""
    name = w.draw(st.sampled_from(["nvfp4", "mxfp4", "mxfp8_e4m3", "fa"]))
    lines = []
    if name == "fa":
        lines.append("format fa = e3m2 block 1x24 scale e4m3 round down")
    lines.append(f"operands {{ * : {name} round {w.draw(st.sampled_from(ELEMENT_ROUNDINGS))} }}")
    return "\n".join(lines) + "\n"


@st.composite
def recipe_cases(draw: st.DrawFn) -> RecipeCase:
    w = _Writer(draw)
    files: dict[str, str] = {}
    scope: dict[str, Format] = dict(BUILTIN_FORMATS)
    slots = {op: Slot() for op in Operand}
    mors: list[str] = []
    layer_lines: list[str] | None = None
    schedule_lines: list[str] | None = None
    evaluated = False
    names = list(draw(st.permutations(FORMAT_NAMES)))
    mor_names = list(draw(st.permutations(MOR_NAMES)))
    header: list[list[str]] = []

    # recipes a layer or schedule rule may run (a shipped one is found among the shipped recipes)
    refs = ["mxfp8.fp4r", "nvfp4"]
    if draw(st.booleans()):
        files["ref.fp4r"] = _ref_recipe(w)
        refs.append("ref.fp4r")

    # the parent (extends), possibly in a sub-folder: its own formats, mors, cascade, rules
    if draw(st.integers(0, 2)) == 0:
        folder = draw(st.sampled_from(["", "sub/"]))
        parent = _File()
        _define(w, parent, scope, [names.pop() for _ in range(draw(st.integers(0, 2)))])
        for _ in range(draw(st.integers(0, 1))):
            name = mor_names.pop()
            parent.items.append(w.mor_def(name))
            mors.append(name)
        lines = _operand_lines(w, slots, sorted(scope), mors, draw(st.integers(0, 4)))
        if lines:
            parent.operands.append(w.section("operands", lines))
        parent_refs = ["../ref.fp4r" if folder and r == "ref.fp4r" else r for r in refs]
        if draw(st.booleans()):
            layer_lines = w.layers(scope, [r for r in refs if r != "ref.fp4r" or not folder])
            parent.items.append(w.section("layers", layer_lines))
        if draw(st.booleans()):
            schedule_lines = w.schedule(scope, parent_refs)
            parent.items.append(w.section("schedule", schedule_lines))
        if draw(st.integers(0, 3)) == 0:  # dtypes only: the child may redefine a format as 2D
            dtypes = {n: f for n, f in scope.items() if isinstance(f, HighPrecision)}
            line, evaluated = w.evaluation(dtypes, parent_refs)
            parent.items.append(line)
        if not parent.items and not parent.formats and not parent.operands:
            parent.operands.append(["operands { * : nvfp4 }"])
            slots = {op: Slot(("format", "nvfp4")) for op in Operand}
        parent_header = [[f"recipe base{w.sp()}{w.string()}"]] if draw(st.booleans()) else []
        files[f"{folder}base.fp4r"] = _assemble(w, parent_header, parent)
        header.append([f'extends "{folder}base{draw(st.sampled_from([".fp4r", ""]))}"'])

    # imported files: formats and mors only (names distinct between imports)
    for i in range(draw(st.integers(0, 2))):
        lib = _File()
        lib_scope = dict(BUILTIN_FORMATS)  # an imported file sees only its own scope
        _define(w, lib, lib_scope, [names.pop() for _ in range(draw(st.integers(1, 2)))])
        scope.update(lib.scope)
        if mor_names and draw(st.booleans()):
            name = mor_names.pop()
            lib.items.append(w.mor_def(name))
            if name not in mors:
                mors.append(name)
        files[f"lib{i}.fp4r"] = _assemble(w, [], lib)
        header.append([f'import "lib{i}.fp4r"'])

    # the main recipe: its own formats (a parent's may be redefined), mors, cascade, rules
    main = _File()
    own = [names.pop() for _ in range(draw(st.integers(0, 3)))]
    # a redefinition, which may be 2D: not under a parent's layer or schedule rules, whose
    # format actions see it and must stay 1D
    if layer_lines is None and schedule_lines is None and draw(st.integers(0, 3)) == 0:
        own.append(draw(st.sampled_from(["nvfp4", "mxfp4", "mxfp8_e5m2"])))
    seen: set[str] = set()
    own = [n for n in own if not (n in seen or seen.add(n))]  # type: ignore[func-returns-value]
    _define(w, main, scope, own)
    for _ in range(draw(st.integers(0, 2))):
        if not mor_names:
            break
        name = mor_names.pop()
        main.items.append(w.mor_def(name))
        mors.append(name)
    lines = _operand_lines(w, slots, sorted(scope), mors, draw(st.integers(0, 6)))
    lines += _repair(w, slots, scope, mors)
    # the statements may go into one or two operands sections
    cut = draw(st.integers(0, len(lines)))
    for part in (lines[:cut], lines[cut:]):
        if part:
            main.operands.append(w.section("operands", part))
    if not main.operands:
        main.operands.append(["operands {", "}"])
    if draw(st.integers(0, 2)) == 0:
        layer_lines = w.layers(scope, refs)
        main.items.append(w.section("layers", layer_lines))
    if draw(st.integers(0, 2)) == 0:
        schedule_lines = w.schedule(scope, refs)
        main.items.append(w.section("schedule", schedule_lines))
    if draw(st.integers(0, 3)) == 0:  # replaces the parent's
        line, evaluated = w.evaluation(scope, refs)
        main.items.append(line)
    if draw(st.booleans()):
        name = (
            draw(st.sampled_from(["main", "r1", "up", "tensor"]))
            if draw(st.booleans())
            else w.string(1)
        )
        desc = f"{w.sp()}{w.string()}" if draw(st.booleans()) else ""
        header.insert(draw(st.integers(0, len(header))), [f"recipe {name}{desc}"])
    files["main.fp4r"] = _assemble(w, header, main)

    expected = None
    if not w.refusable:
        found = {op: resolve_slot(op, slots[op], scope) for op in Operand}
        assert all(spec is not None for spec in found.values()), found
        expected = found  # type: ignore[assignment]
    return RecipeCase(
        files=files,
        expected=expected,
        refusable=w.refusable,
        layer_count=len(layer_lines or []),
        schedule_count=len(schedule_lines or []),
        evaluated=evaluated,
    )
