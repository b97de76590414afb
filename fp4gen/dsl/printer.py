"""Recipe -> canonical .fp4r text, self-contained (no extends or import), such that
``parse_recipe(print_recipe(r), base_dir=<r's directory>) == r``."""

from __future__ import annotations

import math
import re
from decimal import Decimal

from fp4gen.dsl.model import (
    TE_SIGNS_16,
    LayerAction,
    LayerRule,
    Metric,
    MoRRef,
    MoRSpec,
    OperandSpec,
    Partition,
    Recipe,
    RecipeRef,
    RHTSpec,
    ScheduleRule,
)
from fp4gen.dsl.spelling import percent, quoted
from fp4gen.formats import BUILTIN_FORMATS, BlockFormat, ElementFormat, HighPrecision

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_INDENT = "    "


def print_recipe(recipe: Recipe) -> str:
    scope: dict[str, BlockFormat | HighPrecision] = dict(BUILTIN_FORMATS)
    scope.update(dict(recipe.formats))
    mor_names = {m.name for m in recipe.mors}
    out: list[str] = [f"recipe {_name(recipe.name)} {_string(recipe.description)}"]

    if recipe.formats:
        out.append("")
        out.extend(f"format {name} = {_format_body(fmt)}" for name, fmt in recipe.formats)
    for mor in recipe.mors:
        out.append("")
        out.extend(_mor(mor))

    out += ["", "operands {"]
    width = max(len(op.selector) for op, _ in recipe.operands.items())
    for op, spec in recipe.operands.items():
        body = _operand(spec, scope, mor_names)
        out.append(f"{_INDENT}{op.selector:<{width}} : {body}")
    out.append("}")

    if recipe.layers:
        out += ["", "layers {"]
        out.extend(_INDENT + _layer(rule, scope) for rule in recipe.layers)
        out.append("}")
    if recipe.schedule:
        out += ["", "schedule {"]
        out.extend(_INDENT + _schedule(rule, scope) for rule in recipe.schedule)
        out.append("}")
    if recipe.evaluation is not None:  # absent: eval : fprop, the default
        out += ["", f"eval : {_eval_action(recipe.evaluation, scope)}"]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------
# Pieces
# ------------------------------------------------------------------------------------------------


def _name(name: str) -> str:
    return name if _NAME.match(name) else _string(name)


def _string(text: str) -> str:
    return quoted(text)


def _format_body(fmt: BlockFormat | HighPrecision) -> str:
    if isinstance(fmt, HighPrecision):
        return fmt.name
    rows, cols = fmt.block
    glob = ("row" if fmt.global_rows else "amax") if fmt.global_scale else "none"
    if fmt.global_bound is not None:
        glob += f" {_number(fmt.global_bound)}"
    text = (
        f"{fmt.element.name} block {rows}x{cols} scale {fmt.scale.name} "
        f"round {fmt.scale.rounding} global {glob}"
    )
    # the options of numerics.md 11, only where set: existing formats print as they did
    if fmt.targets:
        targets = " ".join(_number(t) for t in fmt.targets)
        text += f" targets {targets} by {fmt.target_error}"
    if fmt.eden_group is not None:
        text += f" correct eden {fmt.eden_group}"
    return text


def _number(value: float) -> str:
    """A format value (a target or a bound) as its exact decimal, in plain notation (the
    grammar has no exponents): 6, 1.5, 0.0078125; the parser reads it back exactly."""
    return format(Decimal(value), "f")


def _format_ref(
    fmt: BlockFormat | HighPrecision, scope: dict[str, BlockFormat | HighPrecision], where: str
) -> str:
    """The name that means ``fmt`` (block aside) in this recipe's scope."""
    known = scope.get(fmt.name)
    if isinstance(fmt, HighPrecision):
        if known != fmt:
            raise ValueError(f"{where}: {fmt.name} is not the high-precision dtype in scope")
        return fmt.name
    if not isinstance(known, BlockFormat) or known.with_block(fmt.block) != fmt:
        raise ValueError(
            f"{where}: format {fmt.name} differs from the format of that name in the recipe "
            "(add it to Recipe.formats)"
        )
    return fmt.name


def _operand(
    spec: OperandSpec, scope: dict[str, BlockFormat | HighPrecision], mors: set[str]
) -> str:
    fmt = spec.format
    if isinstance(fmt, MoRRef):
        if fmt.name not in mors:
            raise ValueError(f"operand uses mor {fmt.name}, which the recipe does not define")
        parts = [f"mor {fmt.name}"]
    elif isinstance(fmt, BlockFormat):
        rows, cols = fmt.block
        parts = [_format_ref(fmt, scope, "operand"), f"block {rows}x{cols}"]
    else:
        parts = [_format_ref(fmt, scope, "operand")]
    parts += [f"round {spec.rounding}", rht_text(spec.rht)]
    if spec.source is not None:  # absent: quantized from the tensor, the default
        parts.append(f"from {spec.source.selector}")
    if spec.global_scope != "expert":  # absent: the default, each expert's own amax
        parts.append(f"global per {spec.global_scope}")
    return " ".join(parts)


def rht_text(rht: RHTSpec | None) -> str:
    if rht is None:
        return "rht none"
    if rht.sign_source == "seeded":
        return f"rht {rht.size} seed {rht.seed}"
    if rht.redrawn:
        if rht.stream is not None:
            raise ValueError("a recipe holds redrawn RHT signs unresolved (stream None)")
        return f"rht {rht.size} signs {rht.sign_source} seed {rht.seed}"
    if rht.sign_source == "none":
        return f"rht {rht.size} signs none"
    assert rht.signs is not None
    if rht.signs == TE_SIGNS_16:
        return "rht 16 signs te"
    return f'rht {rht.size} signs "' + "".join("+" if s > 0 else "-" for s in rht.signs) + '"'


def _mor(mor: MoRSpec) -> list[str]:
    lines = [f"mor {mor.name} {{"]
    lines.append(f"{_INDENT}decide {_partition(mor.decide)}")
    lines.append(f"{_INDENT}scale {_partition(mor.scale)} {mor.scaling}")
    for i, cand in enumerate(mor.candidates):
        last = i == len(mor.candidates) - 1
        if last != (cand.metric is None):
            raise ValueError(f"mor {mor.name}: only the last candidate is a metric-free fallback")
        if last:
            lines.append(f"{_INDENT}else {_candidate(cand.format)}")
        else:
            assert cand.metric is not None
            lines.append(f"{_INDENT}try {_candidate(cand.format)} if {_metric(cand.metric)}")
    lines.append("}")
    return lines


def _partition(part: Partition) -> str:
    if part.kind == "block":
        assert part.block is not None
        return f"block {part.block[0]}x{part.block[1]}"
    return part.kind


def _candidate(fmt: ElementFormat | HighPrecision) -> str:
    return fmt.name


def _metric(metric: Metric) -> str:
    if metric.kind == "relerr":
        assert metric.threshold is not None
        return f"relerr < {_percent(metric.threshold)}"
    if metric.kind == "relerr_vs":
        assert metric.versus is not None
        return f"relerr < relerr({metric.versus.name})"
    return "range"


def _action(action: LayerAction, scope: dict[str, BlockFormat | HighPrecision]) -> str:
    if isinstance(action, RecipeRef):
        return f"recipe {_string(action.path)}"
    if isinstance(action, BlockFormat) and scope.get(action.name) != action:
        raise ValueError(f"layer action {action.name} is not a format of the recipe as it is")
    return _format_ref(action, scope, "layer action")


def _eval_action(action: LayerAction, scope: dict[str, BlockFormat | HighPrecision]) -> str:
    text = _action(action, scope)
    if text == "fprop":  # the keyword there: a format of that name cannot be written back
        raise ValueError("an eval action format named fprop reads back as `eval : fprop`")
    return text


def _layer(rule: LayerRule, scope: dict[str, BlockFormat | HighPrecision]) -> str:
    sel = rule.selector
    if sel.kind == "match":
        assert sel.pattern is not None
        head = f"match {_string(sel.pattern)}"
    else:
        unit = sel.unit or "layers"
        if sel.count is not None:
            amount = str(sel.count)
            if sel.count == 1:
                unit = unit[:-1]  # "first 1 block"
        else:
            assert sel.fraction is not None
            amount = _percent(sel.fraction)
        head = f"{sel.kind} {amount} {unit}"
    return f"{head} : {_action(rule.action, scope)}"


def _schedule(rule: ScheduleRule, scope: dict[str, BlockFormat | HighPrecision]) -> str:
    if rule.step is not None:
        point = f"step {rule.step}"
    else:
        assert rule.fraction is not None
        point = _percent(rule.fraction)
    return f"at {point} {rule.passes} : {_action(rule.action, scope)}"


def _percent(fraction: float) -> str:
    """The shortest decimal percentage that reads back as exactly this fraction."""
    text = percent(fraction)
    if not (math.isfinite(fraction) and float(text[:-1]) / 100 == fraction):
        raise ValueError(f"{fraction!r} cannot be written as a percentage that reads back exactly")
    return text
