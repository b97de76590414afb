"""Statements -> a resolved unit per file: includes loaded, formats and mors in scope, and the
operand cascade run. Finishing a unit into a Recipe (and the checks that need the whole
cascade) is validate.py's job.

Names used by operands, layers and the schedule are looked up only when the recipe is finished,
so a child that redefines a format (or a mor) also changes the operands it inherits.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, replace
from pathlib import Path

from fp4gen.dsl.model import MoRSpec, Recipe
from fp4gen.dsl.source import (
    SHIPPED_RECIPES,
    SUFFIX,
    At,
    Pos,
    Source,
    UnreadableRecipe,
    clip,
    did_you_mean,
)
from fp4gen.dsl.statements import (
    EvalStmt,
    FormatDef,
    Include,
    LayersSection,
    MoRDef,
    OperandsSection,
    OperandStmt,
    RecipeDecl,
    ScheduleSection,
    Statement,
    build_statements,
    is_element_name,
    looks_like_element,
)
from fp4gen.dsl.syntax import parse_tree
from fp4gen.dsl.unit import Unit
from fp4gen.dsl.validate import finish
from fp4gen.errors import ArgumentError
from fp4gen.formats import (
    BUILTIN_FORMATS,
    HIGH_PRECISION_DTYPES,
    BlockFormat,
    ElementFormat,
    Format,
    HighPrecision,
    ScaleSpec,
    global_scale_problem,
)

# Words that a format name would be read as where formats are referenced.
_RESERVED = frozenset({"mor", "block", "round", "rht", "recipe", "from"})

# How many extends/import/recipe references may be followed from the top-level recipe to the
# deepest file. Resolution recurses once per file; this keeps it far from Python's recursion
# limit (and no real recipe comes close: the shipped ones nest two deep).
MAX_INCLUDE_DEPTH = 32


@dataclass(frozen=True)
class _Frame:
    key: str
    name: str
    via: str  # how this file was reached: "extends", "import", "recipe" or "" for the root


class Loader:
    """Loads recipe files with their includes, caching each file once per top-level load."""

    def __init__(self) -> None:
        self._units: dict[str, Unit] = {}
        self._recipes: dict[str, Recipe] = {}
        self._order = itertools.count()

    # --- entry points -----------------------------------------------------------------------
    def recipe(self, source: Source, stack: tuple[_Frame, ...] = ()) -> Recipe:
        if source.key in self._recipes:
            return self._recipes[source.key]
        root_name = source.path.name if source.path is not None else source.file
        stack = stack or (_Frame(source.key, root_name, ""),)
        unit = self.unit(source, stack)

        def load_ref(path: At[str]) -> tuple[str, Recipe]:
            found = self.find(path)
            frame = self._enter(found, path, "recipe", stack)
            recipe = self.recipe(self.read(found, path), (*stack, frame))
            written = path.value
            if locate(written, source.base_dir) != found:
                # Inherited from a file elsewhere: keep the reference valid from this file.
                written = _relative(found, source.base_dir)
            return written, recipe

        recipe = finish(unit, load_ref)
        self._recipes[source.key] = recipe
        return recipe

    def unit(self, source: Source, stack: tuple[_Frame, ...]) -> Unit:
        if source.key in self._units:
            return self._units[source.key]
        statements = build_statements(parse_tree(source), source)
        unit = self._resolve(source, statements, stack)
        self._units[source.key] = unit
        return unit

    # --- files ------------------------------------------------------------------------------
    def find(self, path: At[str]) -> Path:
        """Resolve a reference: next to the file that names it, else among the shipped recipes.
        Only .fp4r files are references, so a reference never reads another kind of file."""
        found = locate(path.value, path.pos.source.base_dir)
        if found is not None:
            return found
        written = Path(_with_suffix(path.value))
        where = (
            f"in {written.parent}"
            if written.is_absolute()
            else f"in {path.pos.source.base_dir} or among the shipped recipes"
        )
        looked = f"looked {where}"
        if not path.value.endswith(SUFFIX):
            looked = f"looked for {written.name} {where}; references name {SUFFIX} files"
        raise path.pos.error(f"cannot find recipe file '{clip(path.value, 200)}' ({looked})")

    def read(self, found: Path, path: At[str]) -> Source:
        try:
            return Source.from_path(found)
        except UnreadableRecipe as exc:
            # Say which file the reference led to: it may be a shipped recipe or a link.
            raise path.pos.error(f"cannot use '{clip(path.value, 200)}': {exc}") from None

    def _enter(self, found: Path, path: At[str], via: str, stack: tuple[_Frame, ...]) -> _Frame:
        key = str(found)
        frame = _Frame(key, Path(key).name, via)
        keys = [f.key for f in stack]
        if key in keys:
            chain = [*stack[keys.index(key) :], frame]
            kinds = {f.via for f in chain[1:]}
            label = "/".join(sorted(kinds)) if len(kinds) > 1 else next(iter(kinds))
            names = " -> ".join(f.name for f in chain)
            raise path.pos.error(f"{label} cycle: {names}")
        if len(stack) > MAX_INCLUDE_DEPTH:
            chain = [*stack, frame]
            shown = [f.name for f in chain[:2]] + ["..."] + [f.name for f in chain[-2:]]
            raise path.pos.error(
                f"{via} '{clip(path.value, 200)}' would be {len(chain) - 1} references deep "
                f"({' -> '.join(shown)}); extends, import and recipe references nest at most "
                f"{MAX_INCLUDE_DEPTH} deep"
            )
        return frame

    def include(self, inc: Include, stack: tuple[_Frame, ...]) -> Unit:
        found = self.find(inc.path)
        frame = self._enter(found, inc.path, inc.kind, stack)
        return self.unit(self.read(found, inc.path), (*stack, frame))

    # --- one file ---------------------------------------------------------------------------
    def _resolve(
        self, source: Source, statements: list[Statement], stack: tuple[_Frame, ...]
    ) -> Unit:
        unit = Unit(source, anchor=Pos(source, 1, 1))
        decl: RecipeDecl | None = None
        extends: Include | None = None
        imports: list[Include] = []
        for st in statements:
            if isinstance(st, RecipeDecl):
                if decl is not None:
                    raise st.pos.error(
                        f"a second 'recipe' line (the first is on {decl.pos.where()})"
                    )
                decl = st
            elif isinstance(st, Include) and st.kind == "extends":
                if extends is not None:
                    raise st.pos.error(
                        f"a recipe extends at most one other; this one already extends "
                        f"'{extends.path.value}' ({extends.pos.where()}): use import for formats "
                        "and mors from more files"
                    )
                extends = st
            elif isinstance(st, Include):
                imports.append(st)
        if decl is not None:
            unit.name, unit.description = decl.name.value, decl.description

        if extends is not None:
            parent = self.include(extends, stack)
            unit.formats = dict(parent.formats)
            unit.mors = dict(parent.mors)
            unit.slots = {op: slot.copy() for op, slot in parent.slots.items()}
            unit.layers, unit.schedule = parent.layers, parent.schedule
            unit.evaluation = parent.evaluation
            unit.anchor = extends.pos
        self._import_all(unit, imports, stack)

        local_formats: dict[str, At[Format]] = {}
        local_mors: dict[str, At[MoRSpec]] = {}
        sections: dict[type, Pos] = {}
        own_eval: EvalStmt | None = None
        for st in statements:
            if isinstance(st, FormatDef):
                self._define_format(unit, st, local_formats)
            elif isinstance(st, MoRDef):
                name = st.name.value
                if name in local_mors:
                    raise st.name.pos.error(
                        f"mor {name} is already defined on {local_mors[name].pos.where()}"
                    )
                local_mors[name] = unit.mors[name] = At(st.spec, st.name.pos)
            elif isinstance(st, OperandsSection):
                unit.anchor = st.pos
                for stmt in st.statements:
                    self._apply(unit, stmt)
            elif isinstance(st, (LayersSection, ScheduleSection)):
                word = "layers" if isinstance(st, LayersSection) else "schedule"
                if type(st) in sections:
                    raise st.pos.error(
                        f"a second {word} section (the first is on "
                        f"{sections[type(st)].where()}): put all {word} rules in one"
                    )
                sections[type(st)] = st.pos
                # A child's section replaces the parent's as a whole.
                if isinstance(st, LayersSection):
                    unit.layers = st
                else:
                    unit.schedule = st
            elif isinstance(st, EvalStmt):
                if own_eval is not None:
                    raise st.pos.error(
                        f"a second eval statement (the first is on {own_eval.pos.where()}): a "
                        "recipe says once what its layers run in when not training"
                    )
                own_eval = unit.evaluation = st  # a child's replaces the parent's
        return unit

    def _import_all(self, unit: Unit, imports: list[Include], stack: tuple[_Frame, ...]) -> None:
        seen_formats: dict[str, tuple[At[Format], Include]] = {}
        seen_mors: dict[str, tuple[At[MoRSpec], Include]] = {}
        for inc in imports:
            other = self.include(inc, stack)
            for what, items, seen, target in (
                ("format", other.formats, seen_formats, unit.formats),
                ("mor", other.mors, seen_mors, unit.mors),
            ):
                for name, item in items.items():
                    if name in seen and seen[name][0].value != item.value:
                        first = seen[name][1]
                        raise inc.path.pos.error(
                            f"{what} {name} from '{inc.path.value}' differs from the {what} "
                            f"{name} imported from '{first.path.value}' ({first.pos.where()})"
                        )
                    seen[name] = (item, inc)  # type: ignore[assignment]
                    target[name] = item  # type: ignore[assignment]

    def _define_format(self, unit: Unit, fd: FormatDef, local: dict[str, At[Format]]) -> None:
        name = fd.name.value
        if name in local:
            raise fd.name.pos.error(
                f"format {name} is already defined on {local[name].pos.where()}"
            )
        if is_element_name(name):
            raise fd.name.pos.error(
                f"'{name}' names an element format; pick another name for a block format"
            )
        if name in HIGH_PRECISION_DTYPES:
            raise fd.name.pos.error(f"{name} is a high-precision dtype and cannot be redefined")
        if name in _RESERVED:
            raise fd.name.pos.error(
                f"'{name}' is a keyword where formats are used; pick another name"
            )
        fmt = self._build_format(unit, fd)
        local[name] = unit.formats[name] = At(fmt, fd.name.pos)

    def _build_format(self, unit: Unit, fd: FormatDef) -> Format:
        name = fd.name.value
        base: Format | None = None
        if fd.element is None:
            scope: dict[str, Format] = dict(BUILTIN_FORMATS)
            scope.update({n: f.value for n, f in unit.formats.items()})
            if fd.base.value not in scope:
                if looks_like_element(fd.base.value):
                    raise fd.base.pos.error(
                        f"bad element name '{fd.base.value}': expected eXmY (X exponent bits, "
                        "Y mantissa bits) such as e2m1, optionally followed by finite, fn or ieee"
                    )
                raise fd.base.pos.error(
                    f"unknown format '{fd.base.value}'{did_you_mean(fd.base.value, list(scope))}: "
                    "expected an element such as e2m1 or one of " + ", ".join(sorted(scope))
                )
            base = scope[fd.base.value]
        if isinstance(base, HighPrecision):
            for clause, word in (
                (fd.block, "block"),
                (fd.scale, "scale"),
                (fd.rounding, "round"),
                (fd.global_scale, "global"),
            ):
                if clause is not None:
                    raise clause.pos.error(
                        f"{base.name} is a high-precision dtype: it takes no '{word}' clause"
                    )
            return base

        element: ElementFormat = fd.element if fd.element is not None else base.element  # type: ignore[union-attr]
        # a format built from a bare element has no base to inherit its block or scale from
        if base is None and (fd.block is None or fd.scale is None):
            needed = (
                "a block shape: add e.g. `block 1x16`"
                if fd.block is None
                else "a scale format: add e.g. `scale e4m3` or `scale ue8m0`"
            )
            raise fd.base.pos.error(
                f"format {name} is built from the element {fd.base.value} and needs {needed}"
            )
        block = fd.block.value if fd.block is not None else base.block  # type: ignore[union-attr]
        scale_el = fd.scale.value if fd.scale is not None else base.scale.element  # type: ignore[union-attr]
        # A new scale starts from its own default rounding; an inherited one keeps the base's.
        if fd.rounding is not None:
            rounding = fd.rounding.value
        elif fd.scale is None and base is not None:
            rounding = base.scale.rounding
        else:
            rounding = "up" if scale_el is not None and scale_el.exponent_only else "nearest"
        round_pos = (
            fd.rounding.pos
            if fd.rounding is not None
            else (fd.scale.pos if fd.scale is not None else fd.base.pos)
        )
        scale_name = "fp32" if scale_el is None else scale_el.name
        if rounding == "ocp" and (scale_el is None or not scale_el.exponent_only):
            raise round_pos.error(
                f"ocp scale rounding (OCP MX: 2^(floor(log2 amax) - emax)) is defined for "
                f"exponent-only scales such as ue8m0, not for {scale_name}"
            )
        if scale_el is None and rounding != "nearest":
            raise round_pos.error(
                f"fp32 block scales are stored as computed; 'round {rounding}' does not apply "
                "(use round nearest)"
            )
        if fd.global_scale is not None:
            clause = fd.global_scale.value
            global_scale, global_rows = clause.kind != "none", clause.kind == "row"
            global_bound = clause.bound.value if clause.bound is not None else None
        elif base is not None:
            global_scale, global_rows = base.global_scale, base.global_rows
            global_bound = base.global_bound
        else:
            global_scale, global_rows, global_bound = False, False, None
        if global_scale and scale_el is None:
            where = fd.global_scale.pos if fd.global_scale is not None else fd.scale.pos  # type: ignore[union-attr]
            raise where.error(
                "a global amax scale brings block scales into a narrow scale format's range; "
                "fp32 block scales do not need one (use global none)"
            )
        problem = global_scale_problem(element, scale_el, global_bound) if global_scale else None
        if problem is not None:  # at the clause that asked for it, or the scale that broke it
            clause_pos = fd.global_scale
            if clause_pos is not None and clause_pos.value.bound is not None:
                bound_problem = global_scale_problem(element, scale_el)
                where = clause_pos.value.bound.pos if bound_problem is None else clause_pos.pos
            elif clause_pos is not None:
                where = clause_pos.pos
            else:
                where = fd.scale.pos  # type: ignore[union-attr]
            raise where.error(problem)
        try:
            fmt = BlockFormat(name, element, block, ScaleSpec(scale_el, rounding), global_scale)  # type: ignore[arg-type]
        except ValueError as exc:  # the checks above should have caught it; keep the position
            raise fd.name.pos.error(str(exc)) from None
        return self._with_options(fd, base, fmt, global_bound, global_rows)

    def _with_options(
        self,
        fd: FormatDef,
        base: BlockFormat | None,
        fmt: BlockFormat,
        global_bound: float | None,
        global_rows: bool,
    ) -> BlockFormat:
        """``fmt`` with the options of numerics.md 11 (targets, global bound and rows, MS-EDEN),
        each from its clause or the base format; a misfit is an error at the clause that set
        the option (or, for an inherited one, at the clause that broke it)."""
        if fd.targets is not None:
            targets, target_error = fd.targets.value.targets, fd.targets.value.error
            if targets == (fmt.element.max_finite,):
                targets, target_error = (), "mse"  # the element's max alone: the default
        elif base is not None:
            targets, target_error = base.targets, base.target_error
        else:
            targets, target_error = (), "mse"
        if fd.correct is not None:
            clause = fd.correct.value
            eden_group = None
            if clause.kind == "eden":
                eden_group = fmt.block[1] if clause.group is None else clause.group.value
        else:
            eden_group = base.eden_group if base is not None else None
        # an inherited option that no longer fits: at the first clause that changed the base
        changed = fd.rounding or fd.scale or fd.block or fd.global_scale or fd.targets or fd.base
        steps = (
            (fd.global_scale, {"global_bound": global_bound, "global_rows": global_rows}),
            (fd.targets, {"targets": targets, "target_error": target_error}),
            (fd.correct, {"eden_group": eden_group}),
        )
        try:  # the options checked together: the format they make is what must fit
            return replace(fmt, **{k: v for _, options in steps for k, v in options.items()})
        except ArgumentError as exc:  # BlockFormat checks them: options_problem
            error = exc
        # named at the first clause whose options, added in order, no longer fit (else at the
        # last option clause written: only the options together fail)
        written = [clause for clause, _ in steps if clause is not None]
        where = written[-1].pos if written else changed.pos
        for clause, options in steps:
            try:
                fmt = replace(fmt, **options)  # type: ignore[arg-type]
            except ArgumentError as exc:
                error, where = exc, (clause.pos if clause is not None else changed.pos)
                break
        raise where.error(str(error)) from None

    def _apply(self, unit: Unit, stmt: OperandStmt) -> None:
        """One cascade step: set only the properties the statement names."""
        for op in stmt.selector.value:
            slot = unit.slots[op]
            if stmt.format is not None:
                # A block override belongs to the format it was given with.
                slot.format, slot.block = stmt.format, stmt.block
                slot.order["format"] = next(self._order)
                slot.order["block"] = next(self._order)
            elif stmt.block is not None:
                slot.block = stmt.block
                slot.order["block"] = next(self._order)
            if stmt.rounding is not None:
                slot.rounding = stmt.rounding
                slot.order["rounding"] = next(self._order)
            if stmt.rht is not None:
                slot.rht = stmt.rht
                slot.order["rht"] = next(self._order)
            if stmt.source is not None:
                slot.source = stmt.source
                slot.order["source"] = next(self._order)
            if stmt.global_scope is not None:
                slot.global_scope = stmt.global_scope
                slot.order["global_scope"] = next(self._order)


def _with_suffix(written: str) -> str:
    return written if written.endswith(SUFFIX) else written + SUFFIX


def locate(written: str, base: Path) -> Path | None:
    """The .fp4r file a reference names from ``base`` (the directory of the file that names
    it): there first, then among the shipped recipes. A missing ``.fp4r`` is added, so
    ``"nvfp4"`` finds ``nvfp4.fp4r`` and ``"/etc/passwd"`` only ``/etc/passwd.fp4r``. Whatever
    exists there is returned, so that a directory or FIFO is reported as such when read, and a
    symbolic link that leads nowhere (a loop, a missing target) as such when opened."""
    path = Path(_with_suffix(written))
    dirs = [Path(path.anchor)] if path.is_absolute() else [base, SHIPPED_RECIPES]
    for directory in dirs:
        place = directory / path
        try:
            if place.exists():
                return place.resolve()
            if place.is_symlink():  # a loop or a dangling link: reading it says which
                return place.absolute()
        except PermissionError:  # a folder on the way that may not be searched: reading says so
            return place.absolute()
        except (OSError, ValueError):  # a name the OS rejects (NUL byte, too long)
            continue
    return None


def _relative(path: Path, base: Path) -> str:
    try:
        return os.path.relpath(path, base)
    except ValueError:
        return str(path)
