"""What the app prints about recipes and kernel plans: one-line text for tables, JSON-ready
dicts, and the text of a ``KernelPlan`` (``plan_text``).

The short spellings of model values (a block shape, a selector, a schedule point) are the model's
own, in ``fp4gen.dsl.spelling``; they are re-exported here for the command line. The plan is
data (``fp4gen.compiler.plan``); this module renders it, so nothing below the app imports it.
"""

from __future__ import annotations

from typing import Any

from fp4gen.compiler.plan import TENSOR_NAMES, KernelPlan
from fp4gen.dsl.model import (
    TE_SIGNS_16,
    Candidate,
    LayerRule,
    Metric,
    MoRRef,
    MoRSpec,
    Operand,
    OperandSpec,
    Partition,
    Recipe,
    RecipeRef,
    RHTSpec,
    ScheduleRule,
)
from fp4gen.dsl.spelling import (
    action_text,
    block_text,
    format_text,
    partition_text,
    percent,
    rht_json,
    selector_text,
    when_text,
)
from fp4gen.formats import BlockFormat, ElementFormat, HighPrecision, ScaleSpec
from fp4gen.spec import MoRKernelSpec, QuantKernelSpec, QuantOutput


def scale_text(scale: ScaleSpec) -> str:
    return "fp32" if scale.element is None else f"{scale.element.name} ({scale.rounding})"


def global_text(fmt: BlockFormat) -> str:
    """A format's global scale in a table cell: none, fp32 amax (per tensor or per row), and
    the bound the amax is mapped to where it is not the scale format's max."""
    if not fmt.global_scale:
        return "none"
    text = "fp32 amax per row" if fmt.global_rows else "fp32 amax"
    return text if fmt.global_bound is None else f"{text} to {fmt.global_bound:g}"


def scale_detail(fmt: BlockFormat) -> str:
    """``scale_text`` with the block-scale options of docs/numerics.md 11 that are set."""
    parts = [scale_text(fmt.scale)]
    if fmt.targets:
        targets = " ".join(f"{t:g}" for t in fmt.targets)
        parts.append(f"targets {targets} by {fmt.target_error}")
    if fmt.eden_group is not None:
        parts.append(f"MS-EDEN over {fmt.eden_group}")
    return ", ".join(parts)


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
    elif rht.redrawn:
        signs = f"per {rht.sign_source}, seed {rht.seed}"
    else:
        signs = "none"
    return f"{rht.size} (signs {signs})"


def metric_text(metric: Metric | None) -> str:
    if metric is None:
        return "always (fallback)"
    if metric.kind == "relerr":
        return f"mean relative error < {percent(metric.threshold or 0.0)}"
    if metric.kind == "relerr_vs":
        name = metric.versus.name if metric.versus else "?"
        return f"summed relative error < that of {name}"
    return "dynamic range fits the normal range"


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
            # the options of docs/numerics.md 11, only where set (other formats read as before)
            **({"global_rows": True} if fmt.global_rows else {}),
            **({"global_bound": fmt.global_bound} if fmt.global_bound is not None else {}),
            **(
                {"targets": list(fmt.targets), "target_error": fmt.target_error}
                if fmt.targets
                else {}
            ),
            **({"eden_group": fmt.eden_group} if fmt.eden_group is not None else {}),
        }
    if isinstance(fmt, HighPrecision):
        return {"kind": "high_precision", "name": fmt.name}
    if isinstance(fmt, ElementFormat):
        return {"kind": "element", **(element_json(fmt) or {})}
    return {"kind": "mor", "name": fmt.name}


def operand_json(spec: OperandSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "format": format_json(spec.format),
        "rounding": spec.rounding,
        "rht": rht_json(spec.rht),
    }
    if spec.source is not None:  # only where set: existing descriptions stay as they were
        out["source"] = spec.source.selector
    if spec.global_scope != "expert":  # likewise: an experts module's one global amax
        out["global_scope"] = spec.global_scope
    return out


def operand_format_text(spec: OperandSpec) -> str:
    """The operand's format, the copy it is quantized from where it has one, and the global
    scale's scope where it is per tensor."""
    text = format_text(spec.format)
    if spec.source is not None:
        text = f"{text} from {spec.source.selector}"
    return text if spec.global_scope == "expert" else f"{text}, global per {spec.global_scope}"


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


def eval_json(action: HighPrecision | BlockFormat | RecipeRef | None) -> dict[str, Any]:
    """The eval statement: ``{"kind": "fprop"}`` for the default, else its action."""
    return {"kind": "fprop"} if action is None else action_json(action)


def eval_text(action: HighPrecision | BlockFormat | RecipeRef | None) -> str:
    """What the forward of a layer that is not training runs in, as ``fp4gen show`` says it."""
    if action is None:
        return "fprop (the forward's operands in force)"
    if isinstance(action, RecipeRef):
        return f"the fprop operands of {action_text(action)}"
    return f"{action.name} (both fprop operands)"


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
        "eval": eval_json(recipe.evaluation),
    }


# ---------------------------------------------------------------------------------------------
# kernel plans
# ---------------------------------------------------------------------------------------------


def spec_summary(spec: QuantKernelSpec | MoRKernelSpec) -> str:
    if isinstance(spec, MoRKernelSpec):
        rule = spec.rule
        cands = " -> ".join(c.format.name for c in rule.candidates)
        return (
            f"MoR rule {rule.name} ({cands}; decided per {partition_text(rule.decide)},"
            f" {rule.scaling} scales per {partition_text(rule.scale)}), round "
            f"{spec.rounding}, input {spec.input_dtype}: measure, decide and quantize"
        )
    scale = scale_text(spec.scale)
    glob = "global amax" if spec.global_scale else "no global scale"
    block = block_text(spec.block)
    return f"{spec.element.name} {block} blocks, scale {scale}, {glob}, input {spec.input_dtype}"


def operands_text(operands: tuple[Operand, ...]) -> str:
    if set(operands) == set(Operand):
        return "every operand"
    return ", ".join(op.selector for op in operands)


def output_summary(out: QuantOutput) -> str:
    rht = "" if out.rht is None else f", RHT {rht_text(out.rht)}"
    layout = "" if out.scale_layout == "compact" else f", {out.scale_layout} scales"
    return f"{out.direction}: round {out.rounding}{rht}{layout}"


def plan_text(plan: KernelPlan) -> str:
    """The plan as ``fp4gen show`` prints it: each kernel, its outputs and who uses them, then
    the operand slots that need no kernel and why."""
    lines = [f"kernel plan for recipe {plan.recipe}: {len(plan.kernels)} quantize kernel(s)"]
    dtypes = ", ".join(f"{TENSOR_NAMES[r]} {d}" for r, d in plan.input_dtypes)
    lines.append(f"  inputs: {dtypes}")
    for i, k in enumerate(plan.kernels, 1):
        tensors = "/".join(TENSOR_NAMES[r] for r in k.roles)
        lines.append("")
        lines.append(f"{i}. {k.spec.name}")
        lines.append(f"   tensor {tensors}: {spec_summary(k.spec)}")
        for out in k.spec.outputs if isinstance(k.spec, QuantKernelSpec) else ():
            lines.append(f"   - {output_summary(out)}")
        lines.append("   used by:")
        for use in k.uses:
            prefix = "" if use.recipe == plan.recipe else f"recipe {use.recipe}: "
            lines.append(f"     {prefix}{use.text}")
    if plan.skipped:
        lines.append("")
        lines.append("no quantize kernel:")
        for s in plan.skipped:
            prefix = "" if s.recipe == plan.recipe else f"recipe {s.recipe}: "
            where = "" if s.context == "operands" else f" [{s.context}]"
            lines.append(f"  {prefix}{operands_text(s.operands)}{where}: {s.reason}")
    return "\n".join(lines)


__all__ = [
    "action_json",
    "action_text",
    "block_text",
    "candidate_json",
    "element_json",
    "eval_json",
    "eval_text",
    "format_json",
    "format_text",
    "layer_rule_json",
    "metric_text",
    "mor_json",
    "operand_format_text",
    "operand_json",
    "operands_text",
    "output_summary",
    "partition_json",
    "partition_text",
    "percent",
    "plan_text",
    "recipe_json",
    "rht_json",
    "rht_text",
    "scale_text",
    "schedule_rule_json",
    "selector_text",
    "spec_summary",
    "when_text",
]
