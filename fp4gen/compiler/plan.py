"""Lowering: a Recipe -> the quantize kernels a training run needs (a KernelPlan).

A linear layer y = x W^T has three tensors, each read by two GEMM operand slots:

    activation x  [tokens, in]   fprop (rowwise)  and wgrad (columnwise)
    weight     W  [out, in]      fprop (rowwise)  and dgrad (columnwise)
    gradient   dy [tokens, out]  dgrad (rowwise)  and wgrad (columnwise)

For each tensor, the quantized operand slots are grouped by what fixes the block scales: element,
block shape, scale format and global scale. Each group is ONE QuantKernelSpec with one output per
direction (so x's rowwise and columnwise copies come from one launch, each with its own rounding
and RHT), and a 2D-block weight gets one spec whose two outputs share one set of tile scales.
An operand under a Mixture-of-Representations rule (the format chosen at run time from the data)
gets the rule's MoR kernels (a MoRKernelSpec per rule, rounding and input dtype: they measure,
decide and quantize in one pass); with an RHT it runs the MoR reference instead (the MoR kernels
do not transform), and operands in high precision need nothing; the plan records why.

Besides the operand table, a recipe can run other precisions in some layers (``layers``) or from
some point of training on (``schedule``). The plan covers every such context:

- a layer rule with a high-precision action needs nothing; with a format action every operand of
  those layers uses that format as defined (round to nearest, no RHT, as ``* : FORMAT`` says);
  with ``recipe "path"`` the referenced recipe's whole plan is included;
- schedule rules apply cumulatively, in the order written, to the operand table and to every
  quantized layer context: ``forward`` replaces the fprop slots, ``backward`` the dgrad and wgrad
  slots, ``both`` all six (a format as above, a recipe by its slots for those GEMMs plus its own
  plan). Taking every context is a superset of what any one reading of the rules needs; the
  kernels are deduplicated, so the cost is at most a few extra kernels in unusual recipes;
- the ``eval`` statement (what the forward of a layer that is not training runs in) is one more
  context, the operand table with the eval action's fprop slots: a high-precision eval needs
  nothing, a format or a recipe its fprop kernels (a recipe is planned with it, as above).

Equal specs are one kernel, whichever tensors, contexts and recipes use them. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from fp4gen.dsl.model import (
    GEMMS,
    ROLES,
    MoRRef,
    MoRSpec,
    Operand,
    OperandSpec,
    Recipe,
    RecipeRef,
    RHTSpec,
    ScheduleRule,
)
from fp4gen.dsl.spelling import (
    action_text,
    block_text,
    partition_text,
    rht_json,
    selector_text,
    when_text,
)
from fp4gen.formats import BlockFormat, HighPrecision
from fp4gen.spec import (
    InputDType,
    MoRKernelSpec,
    QuantKernelSpec,
    QuantOutput,
    ScaleLayout,
)

INPUT_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
PASS_GEMMS: dict[str, tuple[str, ...]] = {
    "forward": ("fprop",),
    "backward": ("dgrad", "wgrad"),
    "both": GEMMS,
}
TENSOR_NAMES: dict[str, str] = {"activation": "x", "weight": "W", "gradient": "dy"}
TENSORS: tuple[str, ...] = ("activation", "weight", "gradient")  # planning order: x, W, dy

Table = Mapping[Operand, OperandSpec]


@dataclass(frozen=True)
class OperandUse:
    """One operand slot, in one context, that reads an output of a kernel."""

    recipe: str  # the recipe whose table holds the slot
    context: str  # "operands", "layers: first 2 blocks : bf16", "schedule: at 82% forward", ...
    operand: Operand

    @property
    def text(self) -> str:
        where = self.context if self.context == "operands" else f"[{self.context}]"
        return f"{self.operand.selector} ({self.operand.use}) {where}"


@dataclass(frozen=True)
class PlannedKernel:
    """A kernel of the plan and every operand slot that uses one of its outputs."""

    spec: QuantKernelSpec | MoRKernelSpec
    uses: tuple[OperandUse, ...]

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r for r in TENSORS if any(u.operand.role == r for u in self.uses))

    @property
    def operands(self) -> tuple[Operand, ...]:
        """The distinct operand slots (any context) that use this kernel, in table order."""
        seen = {u.operand for u in self.uses}
        return tuple(op for op in Operand if op in seen)


@dataclass(frozen=True)
class Skipped:
    """Operand slots of one context that need no quantize kernel, and why."""

    recipe: str
    context: str
    operands: tuple[Operand, ...]
    reason: str


@dataclass(frozen=True)
class KernelPlan:
    recipe: str
    input_dtypes: tuple[tuple[str, InputDType], ...]  # (role, dtype) for the three roles
    kernels: tuple[PlannedKernel, ...]
    skipped: tuple[Skipped, ...]

    @property
    def specs(self) -> tuple[QuantKernelSpec | MoRKernelSpec, ...]:
        return tuple(k.spec for k in self.kernels)

    def kernel_for(
        self, operand: Operand, context: str = "operands", recipe: str | None = None
    ) -> PlannedKernel | None:
        """The kernel whose output feeds ``operand`` in ``context`` (None if it needs none)."""
        recipe = self.recipe if recipe is None else recipe
        for k in self.kernels:
            for use in k.uses:
                if (use.operand, use.context, use.recipe) == (operand, context, recipe):
                    return k
        return None

    def contexts(self) -> tuple[tuple[str, str], ...]:
        """Every (recipe, context) the plan covers, in order."""
        seen: dict[tuple[str, str], None] = {}
        for k in self.kernels:
            for u in k.uses:
                seen.setdefault((u.recipe, u.context), None)
        for s in self.skipped:
            seen.setdefault((s.recipe, s.context), None)
        return tuple(seen)

    def to_json(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "input_dtypes": dict(self.input_dtypes),
            "kernels": [
                {
                    "name": k.spec.name,
                    "spec": spec_json(k.spec),
                    "tensors": [TENSOR_NAMES[r] for r in k.roles],
                    "uses": [use_json(u) for u in k.uses],
                }
                for k in self.kernels
            ],
            "skipped": [
                {
                    "recipe": s.recipe,
                    "context": s.context,
                    "operands": [op.selector for op in s.operands],
                    "reason": s.reason,
                }
                for s in self.skipped
            ],
        }


# ----------------------------------------------------------------------------------------------
# JSON (the manifest's view of the plan; fp4gen.describe renders it as text)
# ----------------------------------------------------------------------------------------------


def output_json(out: QuantOutput) -> dict[str, Any]:
    return {
        "direction": out.direction,
        "rounding": out.rounding,
        "rht": rht_json(out.rht),
        "scale_layout": out.scale_layout,
    }


def spec_json(spec: QuantKernelSpec | MoRKernelSpec) -> dict[str, Any]:
    """Every parameter of a spec, JSON-ready (the manifest and ``show`` print this)."""
    if isinstance(spec, MoRKernelSpec):
        rule = spec.rule
        return {
            "kind": "mor",
            "rule": rule.name,
            "candidates": [c.format.name for c in rule.candidates],
            "decide": partition_text(rule.decide),
            "scale": partition_text(rule.scale),
            "scaling": rule.scaling,
            "rounding": spec.rounding,
            "input_dtype": spec.input_dtype,
            "segments": spec.segments,
            "digest": spec.digest,
        }
    out: dict[str, Any] = {
        "element": spec.element.name,
        "block": block_text(spec.block),
        "scale": {"format": spec.scale.name, "rounding": spec.scale.rounding},
        "global_scale": spec.global_scale,
    }
    # the options of docs/numerics.md 11.1 and 11.4 only where set (the manifests of the formats
    # without them stay as they were)
    if spec.targets:
        out["targets"] = {"values": list(spec.targets), "error": spec.target_error}
    if spec.global_bound is not None:
        out["global_bound"] = spec.global_bound
    if spec.global_rows:
        out["global_rows"] = True
    if spec.eden_group is not None:
        out["eden_group"] = spec.eden_group
    out.update(
        input_dtype=spec.input_dtype,
        outputs=[output_json(o) for o in spec.outputs],
        digest=spec.digest,
    )
    return out


def use_json(use: OperandUse) -> dict[str, Any]:
    return {
        "recipe": use.recipe,
        "context": use.context,
        "operand": use.operand.selector,
        "use": use.operand.use,
    }


# ----------------------------------------------------------------------------------------------
# Lowering
# ----------------------------------------------------------------------------------------------


def _dtypes(input_dtype: InputDType | Mapping[str, InputDType]) -> dict[str, InputDType]:
    if isinstance(input_dtype, str):
        chosen = {role: input_dtype for role in TENSORS}
    else:
        unknown = set(input_dtype) - set(ROLES)
        if unknown:
            raise ValueError(f"input dtypes are given per role {ROLES}, got {sorted(unknown)}")
        chosen = {role: input_dtype.get(role, "bf16") for role in TENSORS}
    for role, dtype in chosen.items():
        if dtype not in INPUT_DTYPES:
            raise ValueError(f"input dtype of the {role} must be one of {INPUT_DTYPES}: {dtype!r}")
    return chosen  # type: ignore[return-value]


def _uniform(fmt: BlockFormat | HighPrecision) -> dict[Operand, OperandSpec]:
    return {op: OperandSpec(fmt) for op in Operand}


def _table(recipe: Recipe) -> dict[Operand, OperandSpec]:
    return dict(recipe.operands.items())


def _ref_recipe(ref: RecipeRef, owner: Recipe) -> Recipe:
    if ref.recipe is not None:
        return ref.recipe
    from fp4gen.dsl import load_recipe

    base = owner.source.parent if owner.source is not None else None
    return load_recipe(base / ref.path if base is not None else ref.path)


def _recipe_key(recipe: Recipe) -> tuple[str, str]:
    return (recipe.name, str(recipe.source))


def _when(rule: ScheduleRule) -> str:
    return f"schedule: at {when_text(rule)} {rule.passes}"


def _contexts(
    recipe: Recipe, visiting: frozenset[tuple[str, str]] = frozenset()
) -> Iterator[tuple[Recipe, str, Table | str]]:
    """(the recipe whose table it is, context label, operand table or a reason nothing is
    quantized)."""
    visiting = visiting | {_recipe_key(recipe)}
    contexts: list[tuple[str, Table]] = [("operands", _table(recipe))]
    yield recipe, "operands", contexts[0][1]

    included: list[Recipe] = []
    for rule in recipe.layers:
        label = f"layers: {selector_text(rule.selector)} : "
        label += action_text(rule.action)
        action = rule.action
        if isinstance(action, HighPrecision):
            yield recipe, label, f"layer rule keeps these layers in {action.name}"
        elif isinstance(action, BlockFormat):
            table = _uniform(action)
            contexts.append((label, table))
            yield recipe, label, table
        else:
            included.append(_ref_recipe(action, recipe))
            yield recipe, label, f"layer rule runs recipe {included[-1].name} (planned with it)"

    # Schedule rules switch passes from some point on; they accumulate in the order written.
    current = list(contexts)
    for rule in recipe.schedule:
        gemms = PASS_GEMMS[rule.passes]
        action = rule.action
        nxt = []
        for label, table in current:
            new = dict(table)
            for op in Operand:
                if op.gemm not in gemms:
                    continue
                if isinstance(action, RecipeRef):
                    new[op] = _ref_recipe(action, recipe).operands[op]
                else:
                    new[op] = OperandSpec(action)
            when = _when(rule) + f" : {action_text(action)}"
            nxt.append((f"{when}" if label == "operands" else f"{label}; {when}", new))
        if isinstance(action, RecipeRef):
            included.append(_ref_recipe(action, recipe))
        for label, table in nxt:
            yield recipe, label, table
        current = nxt

    evaluation = recipe.evaluation
    if evaluation is not None:
        label = f"eval : {action_text(evaluation)}"
        if isinstance(evaluation, HighPrecision):
            yield recipe, label, f"eval runs the forward in {evaluation.name}: no quantization"
        else:
            table = dict(contexts[0][1])
            for op in Operand:
                if op.gemm == "fprop":
                    if isinstance(evaluation, RecipeRef):
                        table[op] = _ref_recipe(evaluation, recipe).operands[op]
                    else:
                        table[op] = OperandSpec(evaluation)
            if isinstance(evaluation, RecipeRef):
                included.append(_ref_recipe(evaluation, recipe))
            yield recipe, label, table

    for sub in included:
        if _recipe_key(sub) in visiting:
            continue  # a cycle of recipe references: that recipe is being planned already
        yield from _contexts(sub, visiting)


def _specs_of(
    table: Table, dtypes: Mapping[str, InputDType], scale_layout: ScaleLayout
) -> Iterator[tuple[QuantKernelSpec, tuple[Operand, ...]]]:
    """The kernels one operand table needs: per tensor, one per group of slots sharing scales."""
    for role in TENSORS:
        slots = [op for op in Operand if op.role == role]
        slots.sort(key=lambda op: op.use != "rowwise")  # rowwise output first
        groups: dict[BlockFormat, list[Operand]] = {}
        for op in slots:
            fmt = table[op].format
            if not isinstance(fmt, BlockFormat) or _kernel_refusal(table[op]) is not None:
                continue
            # what fixes the block scales: element, block, scale format, global scale and the
            # options (with block targets or stochastic block scales the tile template refuses
            # the fused spec and the build takes its single-output stand-ins, as the runtime
            # quantizes a columnwise copy by the rowwise kernel on the transpose)
            key = replace(fmt, name="")
            groups.setdefault(key, []).append(op)
        for fmt, ops in groups.items():
            outputs = tuple(
                QuantOutput(op.use, table[op].rounding, table[op].rht, scale_layout) for op in ops
            )
            yield kernel_spec(fmt, dtypes[role], outputs), tuple(ops)


def kernel_spec(
    fmt: BlockFormat, input_dtype: InputDType, outputs: tuple[QuantOutput, ...]
) -> QuantKernelSpec:
    """The quantize kernel spec writing ``outputs`` of an ``input_dtype`` tensor in ``fmt``,
    with the format's block targets and global bound (docs/numerics.md 11.1)."""
    # signs drawn per layer or step: the kernel takes them as arguments, one kernel per size
    outputs = tuple(
        o if o.rht is None or not o.rht.redrawn else replace(o, rht=kernel_rht(o.rht))
        for o in outputs
    )
    return QuantKernelSpec(
        fmt.element,
        fmt.block,
        fmt.scale,
        fmt.global_scale,
        input_dtype,
        outputs,
        targets=fmt.targets,
        target_error=fmt.target_error if fmt.targets else "mse",
        global_bound=fmt.global_bound,
        global_rows=fmt.global_rows,
        eden_group=fmt.eden_group,
    )


# Whether the tile kernel quantizes 2D tiles with block targets or stochastic block scales (on:
# tests/test_quantize_tile_options_gpu.py passed on an H200; fp4gen.runtime.cute_backend.
# set_tile_option_kernels(False) turns it off): off, the reference quantizes those operands
_tile_option_kernels = [True]


def tile_options(fmt: BlockFormat) -> bool:
    """Whether the tile kernel serves ``fmt``'s block options on its 2D tiles: the switch is on,
    the format has only block targets, stochastic block scales or a global bound, and its tiles
    are ones a thread's strip holds the rows of (``codegen.quantize.tile_options_refusal``)."""
    if not _tile_option_kernels[0] or not fmt.is_2d:
        return False
    if fmt.global_rows or fmt.eden_group is not None:
        return False
    from fp4gen.codegen.quantize import fp32_targets_refusal, tile_options_refusal

    if fp32_targets_refusal(fmt.targets, fmt.scale) is not None:
        return False
    return tile_options_refusal(fmt.block, 2) is None


def rowwise_only(fmt: BlockFormat) -> bool:
    """Block targets, stochastic block scales, the MS-EDEN correction or per-row global scales
    (docs/numerics.md 11): only the rowwise kernel (one rowwise copy, 1D blocks) implements
    them, not the tile kernel (the global bound alone both do)."""
    return (
        bool(fmt.targets)
        or fmt.scale.rounding == "stochastic"
        or fmt.global_rows
        or fmt.eden_group is not None
    )


def rowwise_only_reason(fmt: BlockFormat) -> str | None:
    """Why no generated kernel quantizes ``fmt`` with 2D blocks (its block targets or
    stochastic block scales are the rowwise kernel's alone), or None."""
    if not rowwise_only(fmt) or not fmt.is_2d or tile_options(fmt):
        return None
    what = _options_text(fmt, ("targets", "stochastic", "rows", "eden"))
    return (
        f"format {fmt.name} has {what} on {fmt.block[0]}x{fmt.block[1]} blocks: only the "
        "rowwise kernel (1D blocks) implements them, so the reference quantizes these operands"
    )


def columnwise_tile_reason(fmt: BlockFormat) -> str | None:
    """Why one tile launch cannot make a columnwise copy of 2D-tiled ``fmt`` with the rowwise
    one, or None: with block targets, stochastic block scales (or the other rowwise-only
    options) on 2D tiles, the quantization of x.t() is not the transpose of x's (the targets'
    error sums and the tile scales' draws follow x.t()'s own order), so each copy is
    quantized on its own."""
    if not (fmt.is_2d and rowwise_only(fmt)):
        return None
    return (
        f"format {fmt.name}: with block targets or stochastic block scales on 2D tiles a "
        "columnwise copy (of x.t()) is not the transpose of the rowwise one; the copies run one "
        "by one"
    )


def tile_reason(fmt: BlockFormat) -> str | None:
    """Why the tile kernel (a columnwise copy, two copies in one launch, 2D blocks) does not
    quantize ``fmt``, or None: the rowwise kernel alone implements block targets, stochastic
    block scales and per-row global scales, so a columnwise copy is the rowwise kernel run on
    the transpose. With ``tile_options`` the tile kernel serves 2D tiles with them."""
    if not rowwise_only(fmt) or tile_options(fmt):
        return None
    what = _options_text(fmt, ("targets", "stochastic", "rows", "eden"))
    return (
        f"format {fmt.name} has {what}: the tile kernel does not implement them, so each copy "
        "is quantized on its own (a columnwise copy by the rowwise kernel on the transpose)"
    )


def _options_text(fmt: BlockFormat, which: tuple[str, ...]) -> str:
    """The options of docs/numerics.md 11 that ``fmt`` has, among ``which``, in words."""
    options = []
    if "targets" in which and fmt.targets:
        targets = " ".join(f"{t:g}" for t in fmt.targets)
        options.append(f"targets {targets} (a choice of scale per block)")
    if "bound" in which and fmt.global_bound is not None:
        options.append(f"a global bound {fmt.global_bound:g}")
    if "rows" in which and fmt.global_rows:
        options.append("per-row global scales")
    if "eden" in which and fmt.eden_group is not None:
        options.append(f"the MS-EDEN correction over {fmt.eden_group} elements")
    if "stochastic" in which and fmt.scale.rounding == "stochastic":
        options.append("stochastic block scales")
    return ", ".join(options)


# docs/numerics.md 11.4: the GEMM kernels take one global scale per operand, so an operand with
# per-row global scales is decoded by torch ops and the shared epilogue applies S_dec per row
ROW_SCALED_REASON = (
    "per-row global scales: the GEMM kernels take one global scale per operand; torch decodes "
    "the operands and the epilogue scales each row"
)


def redrawn_rht_reason(rht: RHTSpec | None) -> str | None:
    """Why no generated kernel serves an RHT whose signs are drawn per layer or step, or None:
    the MoR kernels' reason (the quantize kernels: ``redrawn_tile_reason``)."""
    if rht is None or not rht.redrawn:
        return None
    return (
        f"rht {rht.size} signs {rht.sign_source}: the signs are drawn per layer"
        f"{' and step' if rht.sign_source == 'step' else ''} and the kernels take theirs when "
        "they are compiled, so the reference quantizes these operands"
    )


def redrawn_tile_reason(rht: RHTSpec | None) -> str | None:
    """Why the tile kernel does not serve an RHT whose signs are drawn per layer or step (it
    takes its signs when it is compiled; the rowwise kernel takes them as arguments), or None."""
    if rht is None or not rht.redrawn:
        return None
    return (
        f"rht {rht.size} signs {rht.sign_source}: the signs are drawn per layer"
        f"{' and step' if rht.sign_source == 'step' else ''} and the tile kernel takes its "
        "signs when it is compiled, so each copy is quantized on its own (a columnwise copy by "
        "the rowwise kernel on the transpose, which takes the signs as arguments)"
    )


# the canonical transform of a kernel whose RHT signs are arguments: one kernel per size
_RUNTIME_SIGNS: dict[int, RHTSpec] = {}


def kernel_rht(rht: RHTSpec | None) -> RHTSpec | None:
    """The RHT a kernel spec holds: the transform itself, or for signs drawn per layer or step
    (which the rowwise kernel takes as arguments, docs/numerics.md 12) one canonical transform
    per size (``signs layer seed 0``, no stream), so that every layer, step and seed shares the
    kernel."""
    if rht is None or not rht.redrawn:
        return rht
    canonical = _RUNTIME_SIGNS.get(rht.size)
    if canonical is None:
        canonical = _RUNTIME_SIGNS.setdefault(rht.size, RHTSpec(rht.size, "layer", None, 0))
    return canonical


def unnested_rht_reason(fmt: BlockFormat, rht: RHTSpec | None) -> str | None:
    """Why no generated kernel serves a block length and an RHT size that do not nest (neither
    a multiple of the other: the kernels transform within a block or tile whole blocks into
    one transform), or None."""
    if rht is None or fmt.block_len % rht.size == 0 or rht.size % fmt.block_len == 0:
        return None
    return (
        f"rht {rht.size} with 1x{fmt.block_len} blocks: the kernels need the block length and "
        "the RHT size to nest (one a multiple of the other), so the reference quantizes these "
        "operands"
    )


def _kernel_refusal(spec: OperandSpec) -> str | None:
    """Why a block-format operand goes to the reference whatever the kernels could do: an
    option of its format, a block and an RHT that do not nest."""
    fmt = spec.format
    if not isinstance(fmt, BlockFormat):
        return None
    return unnested_rht_reason(fmt, spec.rht) or rowwise_only_reason(fmt)


def tile_ok(fmt: BlockFormat, rhts: Iterable[RHTSpec | None]) -> bool:
    """Whether the tile kernel can write copies of ``fmt`` with the transforms ``rhts``: not
    with block targets, stochastic block scales or signs drawn per layer or step (the rowwise
    kernel's alone)."""
    return tile_reason(fmt) is None and all(redrawn_tile_reason(r) is None for r in rhts)


def _skip_reason(spec: OperandSpec) -> str | None:
    if isinstance(spec.format, MoRRef) and spec.rht is not None:
        redrawn = redrawn_rht_reason(spec.rht)
        if redrawn is not None:
            return redrawn
    if isinstance(spec.format, BlockFormat):
        return _kernel_refusal(spec)
    if isinstance(spec.format, HighPrecision):
        return f"high precision ({spec.format.name}): no quantization"
    if isinstance(spec.format, MoRRef) and spec.rht is not None:
        return (
            f"Mixture of Representations rule {spec.format.name} with an RHT: the MoR kernels do "
            "not transform, so the MoR reference quantizes these operands"
        )
    return None


def _mor_specs_of(
    table: Table, mors: Mapping[str, MoRSpec], dtypes: Mapping[str, InputDType]
) -> Iterator[tuple[MoRKernelSpec, Operand]]:
    """The MoR kernels of an operand table: one spec per rule, rounding and input dtype (the
    rowwise and columnwise slots of a tensor share it: the columnwise copy is the same kernels
    run on the transpose)."""
    for op in Operand:
        spec = table[op]
        if isinstance(spec.format, MoRRef) and spec.rht is None:  # (MoR with an RHT: skipped)
            yield MoRKernelSpec(mors[spec.format.name], spec.rounding, dtypes[op.role]), op


def plan_recipe(
    recipe: Recipe,
    *,
    input_dtype: InputDType | Mapping[str, InputDType] = "bf16",
    scale_layout: ScaleLayout = "compact",
) -> KernelPlan:
    """Lower ``recipe`` to the quantize kernels it needs, deduplicated across every context.

    input_dtype: the dtype the kernels read, one for all tensors or a mapping role -> dtype
        (roles "activation", "weight", "gradient"; missing roles are bf16).
    scale_layout: the layout every output writes its scales in ("compact" or "swizzled").
    """
    dtypes = _dtypes(input_dtype)
    if scale_layout not in ("compact", "swizzled"):
        raise ValueError(f"scale_layout must be 'compact' or 'swizzled', got {scale_layout!r}")
    kernels: dict[QuantKernelSpec | MoRKernelSpec, list[OperandUse]] = {}
    skipped: list[Skipped] = []
    contexts = list(_contexts(recipe))
    # MoR rules by name across the recipes involved (a schedule rule may bring in the operand
    # of another recipe; the runtime takes the same scope and rejects a name used twice)
    mors: dict[str, MoRSpec] = {}
    for owner, _, _ in contexts:
        for rule in owner.mors:
            mors.setdefault(rule.name, rule)
    for owner, context, table in contexts:
        rname = owner.name
        if isinstance(table, str):
            skipped.append(Skipped(rname, context, tuple(Operand), table))
            continue
        for spec, ops in _specs_of(table, dtypes, scale_layout):
            uses = kernels.setdefault(spec, [])
            uses.extend(OperandUse(rname, context, op) for op in ops)
        for mspec, op in _mor_specs_of(table, mors, dtypes):
            kernels.setdefault(mspec, []).append(OperandUse(rname, context, op))
        reasons: dict[str, list[Operand]] = {}
        for op in Operand:
            reason = _skip_reason(table[op])
            if reason is not None:
                reasons.setdefault(reason, []).append(op)
        for reason, ops in reasons.items():
            skipped.append(Skipped(rname, context, tuple(ops), reason))
    return KernelPlan(
        recipe=recipe.name,
        input_dtypes=tuple(dtypes.items()),
        kernels=tuple(PlannedKernel(spec, tuple(uses)) for spec, uses in kernels.items()),
        skipped=tuple(skipped),
    )


__all__ = [
    "ROW_SCALED_REASON",
    "KernelPlan",
    "OperandUse",
    "PlannedKernel",
    "Skipped",
    "output_json",
    "plan_recipe",
    "kernel_rht",
    "kernel_spec",
    "redrawn_rht_reason",
    "redrawn_tile_reason",
    "rowwise_only",
    "rowwise_only_reason",
    "tile_ok",
    "tile_reason",
    "unnested_rht_reason",
    "spec_json",
]
