"""Plain descriptions of recipe objects: one-line text for tables and JSON-ready dicts."""

from __future__ import annotations

from typing import Any

from fp4gen.dsl.model import (
    TE_SIGNS_16,
    Candidate,
    LayerRule,
    LayerSelector,
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
from fp4gen.formats import BlockFormat, ElementFormat, HighPrecision, ScaleSpec


def block_text(block: tuple[int, int]) -> str:
    return f"{block[0]}x{block[1]}"


def percent(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def scale_text(scale: ScaleSpec) -> str:
    return "fp32" if scale.element is None else f"{scale.element.name} ({scale.rounding})"


def rht_text(rht: RHTSpec | None) -> str:
    if rht is None:
        return "-"
    if rht.sign_source == "fixed":
        signs = (
            "te"
            if rht.signs == TE_SIGNS_16
            else "".join("+" if s > 0 else "-" for s in rht.signs or ())
        )
    elif rht.sign_source == "seeded":
        signs = f"seed {rht.seed}"
    else:
        signs = "none"
    return f"{rht.size} (signs {signs})"


def format_text(fmt: BlockFormat | HighPrecision | MoRRef | ElementFormat) -> str:
    if isinstance(fmt, BlockFormat):
        return fmt.name
    if isinstance(fmt, MoRRef):
        return f"mor {fmt.name}"
    return fmt.name


def partition_text(part: Partition) -> str:
    return f"block {block_text(part.block)}" if part.block else part.kind


def metric_text(metric: Metric | None) -> str:
    if metric is None:
        return "always (fallback)"
    if metric.kind == "relerr":
        return f"mean relative error < {percent(metric.threshold or 0.0)}"
    if metric.kind == "relerr_vs":
        name = metric.versus.name if metric.versus else "?"
        return f"summed relative error < that of {name}"
    return "dynamic range fits the normal range"


def selector_text(sel: LayerSelector) -> str:
    if sel.kind == "match":
        return f'match "{sel.pattern}"'
    amount = percent(sel.fraction) if sel.fraction is not None else str(sel.count)
    return f"{sel.kind} {amount} {sel.unit}"


def action_text(action: HighPrecision | BlockFormat | RecipeRef) -> str:
    if isinstance(action, RecipeRef):
        return f'recipe "{action.path}"'
    return action.name


def when_text(rule: ScheduleRule) -> str:
    return f"step {rule.step}" if rule.step is not None else f"{percent(rule.fraction or 0.0)}"


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def element_json(el: ElementFormat | None) -> dict[str, Any] | None:
    if el is None:
        return None
    return {
        "name": el.name,
        "bits": el.bits,
        "exp_bits": el.exp_bits,
        "man_bits": el.man_bits,
        "signed": el.signed,
        "special": el.special,
        "max_finite": el.max_finite,
        "min_positive": el.min_positive,
    }


def format_json(fmt: BlockFormat | HighPrecision | MoRRef | ElementFormat) -> dict[str, Any]:
    if isinstance(fmt, BlockFormat):
        return {
            "kind": "block_scaled",
            "name": fmt.name,
            "element": element_json(fmt.element),
            "block": list(fmt.block),
            "layout": "2d" if fmt.is_2d else "1d",
            "scale": {
                "format": fmt.scale.name,
                "rounding": fmt.scale.rounding,
                "element": element_json(fmt.scale.element),
            },
            "global_scale": "amax" if fmt.global_scale else "none",
        }
    if isinstance(fmt, HighPrecision):
        return {"kind": "high_precision", "name": fmt.name}
    if isinstance(fmt, ElementFormat):
        return {"kind": "element", **(element_json(fmt) or {})}
    return {"kind": "mor", "name": fmt.name}


def rht_json(rht: RHTSpec | None) -> dict[str, Any] | None:
    if rht is None:
        return None
    return {
        "size": rht.size,
        "sign_source": rht.sign_source,
        "signs": list(rht.signs) if rht.signs else None,
        "seed": rht.seed,
    }


def operand_json(spec: OperandSpec) -> dict[str, Any]:
    return {
        "format": format_json(spec.format),
        "rounding": spec.rounding,
        "rht": rht_json(spec.rht),
    }


def partition_json(part: Partition) -> dict[str, Any]:
    return {"kind": part.kind, "block": list(part.block) if part.block else None}


def candidate_json(cand: Candidate) -> dict[str, Any]:
    metric = cand.metric
    return {
        "format": format_json(cand.format),
        "metric": None
        if metric is None
        else {
            "kind": metric.kind,
            "threshold": metric.threshold,
            "versus": metric.versus.name if metric.versus else None,
        },
    }


def mor_json(spec: MoRSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "decide": partition_json(spec.decide),
        "scale": partition_json(spec.scale),
        "scaling": spec.scaling,
        "candidates": [candidate_json(c) for c in spec.candidates],
    }


def action_json(action: HighPrecision | BlockFormat | RecipeRef) -> dict[str, Any]:
    if isinstance(action, RecipeRef):
        return {"kind": "recipe", "path": action.path}
    return format_json(action)


def layer_rule_json(rule: LayerRule) -> dict[str, Any]:
    sel = rule.selector
    return {
        "selector": {
            "kind": sel.kind,
            "unit": sel.unit,
            "count": sel.count,
            "fraction": sel.fraction,
            "pattern": sel.pattern,
        },
        "action": action_json(rule.action),
    }


def schedule_rule_json(rule: ScheduleRule) -> dict[str, Any]:
    return {
        "step": rule.step,
        "fraction": rule.fraction,
        "passes": rule.passes,
        "action": action_json(rule.action),
    }


def recipe_json(recipe: Recipe) -> dict[str, Any]:
    return {
        "name": recipe.name,
        "description": recipe.description,
        "source": str(recipe.source) if recipe.source else None,
        "formats": {name: format_json(fmt) for name, fmt in recipe.formats},
        "operands": {
            op.selector: {"gemm": op.gemm, "role": op.role, "use": op.use, **operand_json(spec)}
            for op, spec in recipe.operands.items()
        },
        "mor": [mor_json(m) for m in recipe.mors],
        "layers": [layer_rule_json(r) for r in recipe.layers],
        "schedule": [schedule_rule_json(r) for r in recipe.schedule],
    }
