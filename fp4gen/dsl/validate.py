"""A resolved unit -> Recipe: bind names, apply block overrides, and check what only makes sense
once the cascade is done (every operand has a format, rounding and RHT fit that format, 2D
blocks only on weights, both operands of a GEMM transformed alike)."""

from __future__ import annotations

from collections.abc import Callable

from fp4gen.dsl.model import (
    GEMMS,
    SOURCE_PAIRS,
    LayerAction,
    LayerRule,
    MoRRef,
    Operand,
    OperandSpec,
    OperandTable,
    Recipe,
    RecipeRef,
    RHTSpec,
    ScheduleRule,
)
from fp4gen.dsl.printer import rht_text
from fp4gen.dsl.source import At, Pos, did_you_mean
from fp4gen.dsl.statements import ActionRef
from fp4gen.dsl.unit import Slot, Unit
from fp4gen.errors import ArgumentError
from fp4gen.formats import (
    BUILTIN_FORMATS,
    HIGH_PRECISION_DTYPES,
    BlockFormat,
    Format,
    HighPrecision,
)

LoadRef = Callable[[At[str]], tuple[str, Recipe]]
# the copies whose rows are tokens: where a per-row global scale is one scale per token
ROW_SCALED_OPERANDS: tuple[Operand, ...] = (Operand.FPROP_ACTIVATION, Operand.DGRAD_GRADIENT)
EVAL_2D = "an eval statement's format applies to the fprop activation too"


def finish(unit: Unit, load_ref: LoadRef) -> Recipe:
    scope: dict[str, Format] = dict(BUILTIN_FORMATS)
    scope.update({name: fmt.value for name, fmt in unit.formats.items()})
    specs = {op: _operand(op, unit.slots[op], unit, scope) for op in Operand}
    _check_rht_pairs(unit, specs)
    _check_scoped_sources(unit, specs)
    table = OperandTable(**{op.name.lower(): spec for op, spec in specs.items()})

    layers: tuple[LayerRule, ...] = ()
    if unit.layers is not None:
        layers = tuple(
            LayerRule(rule.selector, _action(rule.action, unit, scope, load_ref))
            for rule in unit.layers.rules
        )
    schedule: tuple[ScheduleRule, ...] = ()
    if unit.schedule is not None:
        schedule = tuple(
            ScheduleRule(
                rule.step,
                rule.fraction,
                rule.passes,
                _action(rule.action, unit, scope, load_ref),
            )
            for rule in unit.schedule.rules
        )
    evaluation = None
    if unit.evaluation is not None and unit.evaluation.action is not None:
        evaluation = _eval_action(unit.evaluation.action, unit, scope, load_ref)
    # Only what differs from the builtins is part of the recipe, so equal recipes compare equal.
    formats = tuple(
        (name, fmt.value)
        for name, fmt in unit.formats.items()
        if BUILTIN_FORMATS.get(name) != fmt.value
    )
    return Recipe(
        name=unit.name or unit.source.stem or "recipe",
        description=unit.description or "",
        formats=formats,
        operands=table,
        mors=tuple(m.value for m in unit.mors.values()),
        layers=layers,
        schedule=schedule,
        evaluation=evaluation,
        source=unit.source.path,
    )


def _later(slot: Slot, *props: str) -> Pos:
    """The position of whichever of these properties the cascade set last."""
    best: tuple[int, Pos] | None = None
    for prop in props:
        value: At | None = getattr(slot, prop)
        if value is None or prop not in slot.order:
            continue
        if best is None or slot.order[prop] > best[0]:
            best = (slot.order[prop], value.pos)
    assert best is not None
    return best[1]


def _describe(fmt: Format | MoRRef) -> str:
    if isinstance(fmt, HighPrecision):
        return f"the high-precision dtype {fmt.name}"
    if isinstance(fmt, MoRRef):
        return f"the mor rule {fmt.name}"
    return f"the block format {fmt.name}"


def _operand(op: Operand, slot: Slot, unit: Unit, scope: dict[str, Format]) -> OperandSpec:
    if slot.format is None:
        assert unit.anchor is not None
        raise unit.anchor.error(
            f"operand {op.selector} has no format: give it one, e.g. `{op.selector} : nvfp4` "
            "or `* : nvfp4` in the operands section"
        )
    ref = slot.format
    fmt: Format | MoRRef
    if ref.value.kind == "mor":
        if ref.value.name not in unit.mors:
            known = ", ".join(unit.mors) or "none are defined"
            raise ref.pos.error(
                f"unknown mor '{ref.value.name}'{did_you_mean(ref.value.name, list(unit.mors))} "
                f"(mors in scope: {known})"
            )
        fmt = MoRRef(ref.value.name)
    else:
        fmt = _lookup(ref.value.name, ref.pos, unit, scope)

    block = slot.block
    if block is not None:
        if not isinstance(fmt, BlockFormat):
            rows, cols = block.value
            raise block.pos.error(
                f"'block {rows}x{cols}' applies to block-scaled formats, but {op.selector} uses "
                f"{_describe(fmt)}"
            )
        try:
            fmt = fmt.with_block(block.value)
        except ArgumentError as exc:  # an option of the format that needs its own blocks
            raise block.pos.error(f"{op.selector}: {exc}") from None
    rounding = slot.rounding.value if slot.rounding is not None else "nearest"
    rht = slot.rht.value if slot.rht is not None else None

    if isinstance(fmt, BlockFormat) and fmt.is_2d and op.role != "weight":
        where = block.pos if block is not None else ref.pos
        rows, cols = fmt.block
        raise where.error(
            f"{op.selector} cannot use {rows}x{cols} blocks: only weights can have 2D blocks; "
            f"{op.role}s are scaled in 1xN blocks along the dot product"
        )
    if isinstance(fmt, BlockFormat) and fmt.global_rows and op not in ROW_SCALED_OPERANDS:
        tokens = " and ".join(o.selector for o in ROW_SCALED_OPERANDS)
        raise ref.pos.error(
            f"{op.selector} cannot use {fmt.name}'s per-row global scales: a row of this copy is "
            f"not a token; they are defined on {tokens} (one scale per token, folded into the "
            "GEMM's output rows)"
        )
    if isinstance(fmt, HighPrecision):
        if rounding != "nearest":
            raise _later(slot, "format", "rounding").error(
                f"{rounding} rounding on {op.selector}, which is {fmt.name}: a high-precision "
                "operand is not quantized, so there is no neighbour to round to (use round "
                "nearest)"
            )
        if rht is not None:
            raise _later(slot, "format", "rht").error(
                f"rht on {op.selector}, which is {fmt.name}: the transform only helps "
                "quantization, and a high-precision operand is not quantized (use rht none)"
            )
    # an RHT size and a block length need not nest: the transform runs on chunks of its size
    # before the blocks are formed, and fp4gen.nn.Linear pads K to both (numerics.md 12)
    scope = _global_scope(op, slot, fmt)
    return OperandSpec(fmt, rounding, rht, _source(op, slot), scope)  # type: ignore[arg-type]


def _global_scope(op: Operand, slot: Slot, fmt: Format | MoRRef) -> str:
    """The slot's ``global per expert|tensor``: "tensor" only where the format has one global
    amax to take over every expert's operand (numerics.md 13)."""
    if slot.global_scope is None or slot.global_scope.value == "expert":
        return "expert"  # the default; it holds for every operand, with or without a scale
    problem = None
    if isinstance(fmt, HighPrecision):
        problem = f"it is {fmt.name}, which is not quantized"
    elif isinstance(fmt, MoRRef):
        problem = f"it uses the mor rule {fmt.name}, which decides and scales per partition"
    elif fmt.global_rows:
        problem = f"its format {fmt.name} has per-row global scales (`global row`), one per token"
    elif not fmt.global_scale:
        problem = (
            f"its format {fmt.name} has no global amax scale ({fmt.scale.name} block scales, "
            "global none)"
        )
    if problem is None:
        return "tensor"
    raise _later(slot, "format", "global_scope").error(
        f"global per tensor on {op.selector}, but {problem}: the scope says which tensor one "
        "global amax is taken over, so it needs a format with `global amax` (write `global per "
        "expert`, the default, or give the operand such a format)"
    )


def _source(op: Operand, slot: Slot) -> Operand | None:
    """The copy ``op`` is quantized from: only the same tensor in another GEMM, read before it."""
    if slot.source is None or slot.source.value is None:
        return None
    source = slot.source.value
    if SOURCE_PAIRS.get(op) != source:
        allowed = ", ".join(f"{a.selector} from {b.selector}" for a, b in SOURCE_PAIRS.items())
        raise slot.source.pos.error(
            f"{op.selector} cannot be quantized from {source.selector}: an operand comes only "
            f"from the copy of the same tensor that an earlier GEMM quantized ({allowed})"
        )
    return source


def _check_scoped_sources(unit: Unit, specs: dict[Operand, OperandSpec]) -> None:
    """``global per tensor`` neither on a copy quantized ``from`` another nor on the copy it
    comes from: the experts' amax of a dequantized copy is not taken (numerics.md 13)."""
    for op, spec in specs.items():
        source = spec.source
        if source is None:
            continue
        scoped = [o for o in (op, source) if specs[o].global_scope == "tensor"]
        if not scoped:
            continue
        slot = unit.slots[op]
        candidates = [(slot.order.get("source", -1), slot.source)]
        for o in scoped:
            at = unit.slots[o].global_scope
            candidates.append((unit.slots[o].order.get("global_scope", -1), at))
        pos = max(((order, at) for order, at in candidates if at is not None), key=lambda c: c[0])[
            1
        ].pos
        raise pos.error(
            f"global per tensor on {scoped[0].selector}, but {op.selector} is quantized from "
            f"{source.selector}'s copy: the amax over every expert is not taken of a "
            "dequantized copy; write `global per expert` on both or `from none`"
        )


def _lookup(name: str, pos: Pos, unit: Unit, scope: dict[str, Format]) -> Format:
    if name in scope:
        return scope[name]
    extra = ""
    if name in unit.mors:
        extra = f"; {name} is a mor rule, write `mor {name}` to use it"
    raise pos.error(
        f"unknown format '{name}'{did_you_mean(name, list(scope))}{extra}; formats in scope: "
        + ", ".join(sorted(scope))
    )


def _rht_text(rht: RHTSpec | None) -> str:
    return "no RHT" if rht is None else f"`{rht_text(rht)}`"


def _check_rht_pairs(unit: Unit, specs: dict[Operand, OperandSpec]) -> None:
    """x H (W H)^T = x W^T only when both operands get the same H."""
    for gemm in GEMMS:
        a, b = (op for op in Operand if op.gemm == gemm)
        if specs[a].rht == specs[b].rht:
            continue
        slots = {op: unit.slots[op] for op in (a, b)}
        # Report at the later of the two rht settings (one may be the default: never set).
        order = {op: slots[op].order.get("rht", -1) for op in (a, b)}
        culprit = a if order[a] > order[b] else b
        other = b if culprit is a else a
        rht_at = slots[culprit].rht
        pos = rht_at.pos if rht_at is not None else unit.anchor
        assert pos is not None
        raise pos.error(
            f"{culprit.selector} has {_rht_text(specs[culprit].rht)} but {other.selector} has "
            f"{_rht_text(specs[other].rht)}: both operands of {gemm} need the same transform "
            "so that it cancels in the dot product"
        )


def _eval_action(
    action: At[ActionRef], unit: Unit, scope: dict[str, Format], load_ref: LoadRef
) -> LayerAction:
    ref = action.value
    if ref.kind == "format" and ref.name not in scope:
        words = ["fprop", *scope]
        raise action.pos.error(
            f"unknown eval action '{ref.name}'{did_you_mean(ref.name, words)}: expected fprop "
            '(the forward\'s own operands, the default), recipe "FILE" or a format in scope: '
            + ", ".join(sorted(scope))
        )
    return _action(action, unit, scope, load_ref, EVAL_2D)


def _action(
    action: At[ActionRef],
    unit: Unit,
    scope: dict[str, Format],
    load_ref: LoadRef,
    applies: str = "a layer or schedule rule's format applies to every operand of its layers",
) -> LayerAction:
    ref = action.value
    if ref.kind == "recipe":
        path, recipe = load_ref(At(ref.name, action.pos))
        return RecipeRef(path, recipe)
    if ref.name in HIGH_PRECISION_DTYPES:
        return HighPrecision(ref.name)
    fmt = _lookup(ref.name, action.pos, unit, scope)
    # a format action stands for every operand of the layers it matches (activations and
    # gradients too), so it is held to the operands section's rule: 2D blocks only on weights
    if isinstance(fmt, BlockFormat) and fmt.is_2d:
        rows, cols = fmt.block
        raise action.pos.error(
            f"{ref.name} has {rows}x{cols} blocks, but {applies} and only weights can have 2D "
            'blocks; name a recipe (recipe "FILE") whose operands section gives the weights '
            "their 2D blocks"
        )
    if isinstance(fmt, BlockFormat) and fmt.global_rows:
        raise action.pos.error(
            f"{ref.name} has per-row global scales, but {applies} and they are defined only on "
            "the copies whose rows are tokens (fprop.activation, dgrad.gradient); name a recipe "
            '(recipe "FILE") whose operands section gives them to those operands'
        )
    return fmt
