"""Every kernel a training run can load, known from the recipe alone: ``runtime_plan(recipe)``.

``fp4gen.compiler.plan`` lowers a recipe to its quantize kernels as one fused launch per tensor
sees them. What ``fp4gen.nn.Linear`` loads at run time is keyed differently, and more kinds of
kernels take part; ``fp4gen compile`` compiles the union of both, so that a process on a GPU
finds every kernel in the cache and compiles nothing (``fp4gen.compiler.jit.compile_count()``
stays 0). How the runtime keys each kernel, and which keys its dispatch can pick (per operand
table of the recipe: the ``operands`` table and every layer or schedule context the plan covers):

* **Quantize** (``QuantKernelSpec``: format, input dtype, the outputs' direction / rounding /
  RHT; ``fp4gen.runtime.cute_backend``), for sm_90a and sm_100a. Forward: x and W rowwise, one
  single-output kernel each. Backward: W^T rowwise (with 2D blocks the transpose of W's rowwise
  codes: the same spec); dy rowwise (dgrad) and columnwise (wgrad) from one tile kernel when both
  slots have the same 1D format, else one single-output kernel each; x columnwise (wgrad) from a
  tile kernel with that one output. A tile kernel takes M and K multiples of its block and RHT
  sizes (its ``check_input``); for other shapes the runtime quantizes the copies one by one, so
  those single-output kernels are compiled too.
* **MoR** (``MoRKernelSpec``: rule, rounding, input dtype): the plan's own, unchanged.
* **Dequantize** (``DequantKernelSpec``: element, block, scale, code layout), for sm_90a and
  sm_100a: each block-scaled operand format of a GEMM whose two operands are block-scaled, with
  one code per byte (``bytes``: a transposed 2D weight, codes the reference quantized) and, for
  4-bit elements, two per byte (``packed``: what the quantize kernels write). The sm_90a dispatch
  takes this path above M = 64 and for pairs without a fused kernel; sm_100a for pairs and shapes
  the native MMA does not take.
* **Fused GEMM, sm_90a** (``GemmKernelSpec``: the pair's element / block / scale formats, output
  dtype, bias, accumulate, tile), for pairs the template generates: the small-M tiles
  ``pick_tile`` gives for M <= 64 (``backend="auto"``) and the wgmma tiles it gives above
  (``backend="cute"``). Output dtype and bias as ``Linear`` calls ``fp4gen.gemm``: fprop without
  bias fp32 (``operand_matmul``), with bias the layer output's dtype (dy's); dgrad x's dtype;
  wgrad W's; the kernel writes bf16 for a bf16 output, fp32 otherwise (fp16 is cast after).
* **Block-scaled FP8 GEMM, sm_90a** (``GemmSm90Fp8Params``: the pair's FP8 elements, scale
  kind, K-block length, B's 1xN or NxN blocks, kernel output, bias, accumulate, variant), for
  pairs the generated kernel serves (``fp4gen.codegen.gemm_fp8.pair_reason``: fp8_blockwise,
  MXFP8, ...), taken by ``backend="cute"`` and by ``auto`` where the measured table
  (``gemm_fp8.AUTO_MIN_M``) says so: one per output dtype and bias as for the fused GEMM, in the
  variant ``gemm_fp8.OVERLAP`` / ``CLUSTER_M`` (what ``fp8_gemm.cute_plan`` builds by default).
* **Native GEMM, sm_100a** (``GemmConfig``: the MMA's element and scale types, kernel output
  dtype, tile and cluster, persistent grid size), for pairs with a block-scaled tcgen05 MMA: both
  tiles ``pick_tile`` gives (M <= 128 and above); fp32 output, and bf16 as well where
  ``native_gemm`` writes bf16 straight from the kernel (bf16 out, no bias, no global scale), which
  it does only for N % 8 == 0, so both are compiled.

Not enumerable from the recipe (reported in ``RuntimePlan.notes`` and by ``fp4gen compile``):
tensor dtypes other than the ones given (``input_dtype``); the SM count of an sm_100a GPU other
than ``DEFAULT_SM_COUNT`` (the persistent grid is compiled in); GEMMs only direct
``fp4gen.gemm`` calls make (``accumulate=``, an explicit ``tile=``). Every shape-dependent
choice above is enumerated.

Importing this module imports neither torch nor the CuTe DSL; ``runtime_plan`` loads the GEMM and
dequantize code generators (torch, Jinja), and for a recipe with FP8 pairs on sm_90a the FP8
kernel's parameter class (the CuTe DSL). The choices it enumerates are the ones the backends
make, read from the same functions (``fp4gen.codegen.gemm``, ``fp4gen.codegen.gemm_configs``,
``fp4gen.codegen.gemm_fp8``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from fp4gen.codegen.gemm_configs import (
    DEFAULT_SM_COUNT,
    FUSED_ARCHS,
    FUSED_MAX_M,
    NATIVE_ARCHS,
    gemm_config,
    mma_plan,
)
from fp4gen.codegen.gemm_configs import pick_tile as sm100_pick
from fp4gen.compiler.jit import ARCHS
from fp4gen.compiler.plan import (
    ROW_SCALED_REASON,
    TENSOR_NAMES,
    Table,
    _contexts,
    _dtypes,
    _kernel_refusal,
    kernel_spec,
    spec_json,
    tile_ok,
)
from fp4gen.dsl.model import MoRRef, Operand, OperandSpec, Recipe
from fp4gen.dsl.spelling import block_text, format_text
from fp4gen.formats import BlockFormat, HighPrecision, overflow_k
from fp4gen.spec import (
    DequantKernelSpec,
    GemmKernelSpec,
    InputDType,
    MoRKernelSpec,
    QuantKernelSpec,
    QuantOutput,
)

Kind = Literal["quantize", "mor", "dequant", "gemm_sm90", "gemm_sm90_fp8", "gemm_sm100"]
KINDS: tuple[Kind, ...] = (
    "quantize",
    "mor",
    "dequant",
    "gemm_sm90",
    "gemm_sm90_fp8",
    "gemm_sm100",
)
KIND_TEXT: dict[str, str] = {
    "quantize": "quantize",
    "mor": "MoR",
    "dequant": "dequantize",
    "gemm_sm90": "sm_90a GEMM",
    "gemm_sm90_fp8": "sm_90a FP8 GEMM",
    "gemm_sm100": "sm_100a GEMM",
}
FP8_ARCHS = ("sm_90a",)  # the generated block-scaled FP8 GEMM: FP8 wgmma (fp8_gemm.CUTE_ARCHS)
# The two operands of each GEMM of a linear layer: A [M, K] and B [N, K], C = A B^T
GEMM_OPERANDS: dict[str, tuple[Operand, Operand]] = {
    "fprop": (Operand.FPROP_ACTIVATION, Operand.FPROP_WEIGHT),
    "dgrad": (Operand.DGRAD_GRADIENT, Operand.DGRAD_WEIGHT),
    "wgrad": (Operand.WGRAD_GRADIENT, Operand.WGRAD_ACTIVATION),
}
# M is scanned up to here to find the tile buckets of a ``pick_tile`` (its thresholds are far
# below; the last bucket is open-ended)
_SCAN_M = 1 << 16


@dataclass(frozen=True)
class RuntimeUse:
    """Where and when the runtime loads a kernel: an operand slot or a GEMM of one context."""

    recipe: str
    context: str
    operand: Operand | None = None  # quantize / MoR kernels
    gemm: str | None = None  # dequantize and GEMM kernels
    when: str = ""  # the run-time condition ("forward", "M <= 16", ...)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"recipe": self.recipe, "context": self.context}
        if self.operand is not None:
            out["operand"] = self.operand.selector
            out["use"] = self.operand.use
        if self.gemm is not None:
            out["gemm"] = self.gemm
        out["when"] = self.when
        return out

    @property
    def text(self) -> str:
        where = self.operand.selector if self.operand is not None else f"{self.gemm}"
        ctx = "" if self.context == "operands" else f" [{self.context}]"
        return f"{where}: {self.when}{ctx}"


@dataclass(frozen=True)
class RuntimeKernel:
    """One generated module the runtime may load: its spec, the archs it is loaded for, and
    every use."""

    kind: Kind
    spec: Any  # QuantKernelSpec | MoRKernelSpec | DequantKernelSpec | GemmKernelSpec | GemmConfig
    archs: tuple[str, ...]
    uses: tuple[RuntimeUse, ...]

    @property
    def name(self) -> str:
        return str(self.spec.name)

    @property
    def roles(self) -> tuple[str, ...]:
        """The tensors (activation, weight, gradient) a quantize kernel reads."""
        seen = {u.operand.role for u in self.uses if u.operand is not None}
        return tuple(r for r in TENSOR_NAMES if r in seen)


@dataclass(frozen=True)
class GemmRoute:
    """What one GEMM of one context runs on each arch (for the printed plan)."""

    recipe: str
    context: str
    gemm: str
    pair: str
    routes: tuple[tuple[str, str], ...]  # (arch, what runs there)


@dataclass(frozen=True)
class RuntimePlan:
    recipe: str
    archs: tuple[str, ...]
    input_dtypes: tuple[tuple[str, InputDType], ...]
    kernels: tuple[RuntimeKernel, ...]
    gemms: tuple[GemmRoute, ...]
    notes: tuple[str, ...]  # what the runtime may still compile: decided by more than the recipe

    def of_kind(self, kind: Kind) -> tuple[RuntimeKernel, ...]:
        return tuple(k for k in self.kernels if k.kind == kind)

    def gemm_text(self) -> str:
        """The GEMMs of every context and what runs them on each arch (a GEMM routed as in an
        earlier context is one line)."""
        lines: list[str] = []
        context = None
        shown: set[tuple[str, str, tuple[tuple[str, str], ...]]] = set()
        for g in self.gemms:
            if (g.recipe, g.context) != context:
                context = (g.recipe, g.context)
                where = "operands table" if g.context == "operands" else f"[{g.context}]"
                prefix = "" if g.recipe == self.recipe else f"recipe {g.recipe}: "
                lines.append(f"GEMMs of the {prefix}{where}:")
            lines.append(f"  {g.gemm:<5}  {g.pair}")
            if (g.gemm, g.pair, g.routes) in shown:
                lines[-1] += " (as above)"
                continue
            shown.add((g.gemm, g.pair, g.routes))
            previous = None
            for arch, what in g.routes:
                lines.append(f"    {arch if arch != previous else '':<8} {what}")
                previous = arch
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The GEMM routes and the notes (the kernels go into the manifest one by one)."""
        return {
            "gemms": [
                {
                    "recipe": g.recipe,
                    "context": g.context,
                    "gemm": g.gemm,
                    "operands": g.pair,
                    "routes": [{"arch": arch, "runs": what} for arch, what in g.routes],
                }
                for g in self.gemms
            ],
            "not_compiled": list(self.notes),
        }


# ----------------------------------------------------------------------------------------------
# Descriptions
# ----------------------------------------------------------------------------------------------


def _operand_text(fmt: BlockFormat | HighPrecision | MoRRef) -> str:
    if isinstance(fmt, BlockFormat):
        return f"{fmt.name} {block_text(fmt.block)}"
    return format_text(fmt)


def _element_json(element: Any) -> str | None:
    return None if element is None else element.name


def kernel_spec_json(spec: Any) -> dict[str, Any]:
    """Every parameter of a spec of any kind, JSON-ready (the manifest prints this)."""
    if isinstance(spec, QuantKernelSpec | MoRKernelSpec):
        return spec_json(spec)
    if isinstance(spec, DequantKernelSpec):
        return {
            "kind": "dequant",
            "element": spec.element.name,
            "block": block_text(spec.block),
            "scale": spec.scale.name,
            "codes": spec.codes,
            "digest": spec.digest,
        }
    if isinstance(spec, GemmKernelSpec):
        return {
            "kind": "gemm_sm90",
            "a": {
                "element": spec.a_element.name,
                "block": block_text(spec.a_block),
                "scale": _element_json(spec.a_scale) or "fp32",
            },
            "b": {
                "element": spec.b_element.name,
                "block": block_text(spec.b_block),
                "scale": _element_json(spec.b_scale) or "fp32",
            },
            "out_dtype": spec.out_dtype,
            "bias": spec.bias,
            "accumulate": spec.accumulate,
            "tile": spec.tile.name,
            "digest": spec.digest,
        }
    fp8_params = _fp8_params_type()
    if fp8_params is not None and isinstance(spec, fp8_params):
        return {
            "kind": "gemm_sm90_fp8",
            **{f.name: getattr(spec, f.name) for f in fields(spec)},
            "num_stages": spec.num_stages,  # what stages=0 resolves to
        }
    # an sm_100a GemmConfig (a plain frozen dataclass of strings and numbers)
    return {
        "kind": "gemm_sm100",
        "a_dtype": spec.a_dtype,
        "b_dtype": spec.b_dtype,
        "sf_dtype": spec.sf_dtype,
        "sf_vec": spec.sf_vec,
        "out_dtype": spec.out_dtype,
        "tile": list(spec.tile_mn),
        "cluster": list(spec.cluster_mn),
        "max_active_clusters": spec.max_active_clusters,
    }


def _fp8_params_type() -> type | None:
    """``GemmSm90Fp8Params`` where its module is loaded (a plan with FP8 kernels loaded it),
    else None: no spec can be one, and the CuTe DSL stays unimported."""
    module = sys.modules.get("fp4gen.kernels.gemm_sm90_fp8")
    return None if module is None else module.GemmSm90Fp8Params


def _m_text(lo: int, hi: int | None) -> str:
    if hi is None:
        return f"M >= {lo}"
    return f"M <= {hi}" if lo <= 1 else f"{lo} <= M <= {hi}"


def tile_buckets(
    pick: Callable[[int], Any], limit: int = _SCAN_M
) -> list[tuple[int, int | None, Any]]:
    """The M ranges over which ``pick(m)`` (a ``pick_tile``) returns one tile, in order:
    (first M, last M or None for the open end, tile). Scanned, so that the buckets are the
    runtime's own thresholds, whatever they become."""
    out: list[tuple[int, int | None, Any]] = []
    lo, current = 1, pick(1)
    for m in range(2, limit + 1):
        tile = pick(m)
        if tile != current:
            out.append((lo, m - 1, current))
            lo, current = m, tile
    out.append((lo, None, current))
    return out


# ----------------------------------------------------------------------------------------------
# Quantize kernels, as fp4gen.nn.Linear asks for them
# ----------------------------------------------------------------------------------------------


def _block(spec: OperandSpec) -> BlockFormat | None:
    # a format with an option no kernel implements is quantized by the reference (plan.py)
    fmt = spec.format
    return fmt if isinstance(fmt, BlockFormat) and _kernel_refusal(spec) is None else None


def _quant(fmt: BlockFormat, dtype: InputDType, *outputs: QuantOutput) -> QuantKernelSpec:
    # as fp4gen.runtime.cute_backend._spec builds it
    return kernel_spec(fmt, dtype, outputs)


def _out(direction: str, spec: OperandSpec) -> QuantOutput:
    return QuantOutput(direction, spec.rounding, spec.rht)  # type: ignore[arg-type]


def quantize_uses(
    table: Table, dtypes: Mapping[str, InputDType]
) -> Iterator[tuple[QuantKernelSpec, Operand, str]]:
    """(spec, operand slot, when) of every quantize kernel ``fp4gen.nn.Linear`` can load for
    one operand table (``forward_gemm``, ``columnwise_weight``, ``quantize_operand_pair``);
    MoR operands are the plan's (``fp4gen.compiler.plan``)."""
    act, weight, grad = dtypes["activation"], dtypes["weight"], dtypes["gradient"]
    fa, fw = table[Operand.FPROP_ACTIVATION], table[Operand.FPROP_WEIGHT]
    dg, dw = table[Operand.DGRAD_GRADIENT], table[Operand.DGRAD_WEIGHT]
    wg, wa = table[Operand.WGRAD_GRADIENT], table[Operand.WGRAD_ACTIVATION]
    # forward: quantize(x) and quantize(W), rowwise
    if (fmt := _block(fa)) is not None:
        yield _quant(fmt, act, _out("rowwise", fa)), Operand.FPROP_ACTIVATION, "forward"
    if (fmt := _block(fw)) is not None:
        yield _quant(fmt, weight, _out("rowwise", fw)), Operand.FPROP_WEIGHT, "forward"
    # backward, W: quantize(W^T) rowwise, or with 2D blocks (fprop's spec, no RHT) the transpose
    # of quantize(W) with this same spec
    if (fmt := _block(dw)) is not None:
        yield _quant(fmt, weight, _out("rowwise", dw)), Operand.DGRAD_WEIGHT, "backward"
    # backward, dy: one tile kernel for both copies when they share a 1D format
    fmt = _block(wg)
    # (block targets, stochastic block scales: the rowwise kernel alone, no tile kernel)
    tiled = (
        fmt is not None and dg.format == fmt and not fmt.is_2d and tile_ok(fmt, (dg.rht, wg.rht))
    )
    if tiled:
        assert fmt is not None
        spec = _quant(fmt, grad, _out("rowwise", dg), _out("columnwise", wg))
        yield spec, Operand.DGRAD_GRADIENT, "backward (tile kernel)"
        yield spec, Operand.WGRAD_GRADIENT, "backward (tile kernel)"
    alone = "backward, shapes the tile kernel does not take" if tiled else "backward"
    for op, slot in ((Operand.DGRAD_GRADIENT, dg), (Operand.WGRAD_GRADIENT, wg)):
        if (fmt := _block(slot)) is not None:
            yield _quant(fmt, grad, _out("rowwise", slot)), op, alone
    # backward, x: the columnwise copy from a tile kernel (1D blocks), else from x^T
    if (fmt := _block(wa)) is not None:
        alone = "backward"
        if not fmt.is_2d and tile_ok(fmt, (wa.rht,)):
            yield (
                _quant(fmt, act, _out("columnwise", wa)),
                Operand.WGRAD_ACTIVATION,
                ("backward (tile kernel)"),
            )
            alone = "backward, shapes the tile kernel does not take"
        yield _quant(fmt, act, _out("rowwise", wa)), Operand.WGRAD_ACTIVATION, alone


# ----------------------------------------------------------------------------------------------
# GEMM kernels, as fp4gen.gemm's dispatch picks them
# ----------------------------------------------------------------------------------------------


def gemm_outputs(
    dtypes: Mapping[str, InputDType],
) -> dict[str, tuple[tuple[InputDType, bool], ...]]:
    """(output dtype, bias) of each GEMM as ``fp4gen.nn.Linear`` calls ``fp4gen.gemm``: fprop
    without a bias through ``operand_matmul`` (fp32), with one in the layer output's dtype (the
    gradient's: dy is y's gradient); dgrad in x's dtype; wgrad in W's."""
    return {
        "fprop": (("fp32", False), (dtypes["gradient"], True)),
        "dgrad": ((dtypes["activation"], False),),
        "wgrad": ((dtypes["weight"], False),),
    }


class _Collector:
    """Kernels by spec, in the order first seen, with every use."""

    def __init__(self) -> None:
        self.kinds: dict[Any, Kind] = {}
        self.archs: dict[Any, tuple[str, ...]] = {}
        self.uses: dict[Any, list[RuntimeUse]] = {}

    def add(self, kind: Kind, spec: Any, archs: tuple[str, ...], use: RuntimeUse) -> None:
        if not archs:
            return
        if spec not in self.kinds:
            self.kinds[spec], self.archs[spec], self.uses[spec] = kind, archs, []
        if use not in self.uses[spec]:
            self.uses[spec].append(use)

    def kernels(self) -> tuple[RuntimeKernel, ...]:
        found = [
            RuntimeKernel(self.kinds[s], s, self.archs[s], tuple(self.uses[s])) for s in self.kinds
        ]
        return tuple(sorted(found, key=lambda k: KINDS.index(k.kind)))  # stable within a kind


def _among(archs: tuple[str, ...], wanted: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in archs if a in wanted)


def _fp8_kernels(
    found: _Collector,
    a: BlockFormat,
    b: BlockFormat,
    outputs: tuple[tuple[InputDType, bool], ...],
    use: RuntimeUse,
    archs: tuple[str, ...],
    auto: str,
    experts: tuple[tuple[InputDType, bool], ...] = (),
) -> list[tuple[str, str]]:
    """Add the generated block-scaled FP8 GEMMs of a pair ``fp8_gemm.cute_support`` serves
    (one per output dtype and bias ``Linear`` passes, keyed by ``fp8_gemm.cute_plan``: the
    runtime's own params) to ``found``; return the sm_90a route lines. ``auto``: what
    ``backend="auto"`` runs where scaled_mm does not serve the pair. ``experts``: the output
    dtypes and biases of the grouped experts' launch of this GEMM (``grouped_fp8_outputs``),
    whose grouped kernels are added too."""
    from fp4gen.codegen import gemm_fp8
    from fp4gen.kernels.gemm_sm90_fp8 import GemmSm90Fp8Params  # the CuTe DSL: FP8 pairs only

    name = gemm_fp8.pair_name(a, b)
    least = gemm_fp8.AUTO_MIN_M.get(name)  # the measured table: auto from this M on
    how = 'backend="cute"' + (f", auto for M >= {least}" if least is not None else "")
    fp8_archs = _among(FP8_ARCHS, archs)
    # the widths fp8_gemm.cute_tile_n picks: the widest the pair takes, and where that is
    # wider than 128, 128 for the shapes it leaves a partial wave (gemm_fp8.tile_n_for)
    for out_dtype, bias in outputs:
        out = gemm_fp8.kernel_out(out_dtype, False)
        # the params fp8_gemm.cute_plan builds (the default variant)
        made = [GemmSm90Fp8Params(**gemm_fp8.kernel_fields(a, b, out, bias, False))]
        if gemm_fp8.TILE_BY_SHAPE and made[0].tile_n > 128:
            fields = gemm_fp8.kernel_fields(a, b, out, bias, False, tile_n=128)
            made.append(GemmSm90Fp8Params(**fields))
        for params in made:
            when = f"{how}, {params.out} out" + (", bias" if bias else "")
            if len(made) > 1:
                when += f", 128x{params.tile_n} tiles"
            found.add("gemm_sm90_fp8", params, fp8_archs, replace(use, when=when))
    refused = gemm_fp8.scaled_mm_reason(a, b)  # gemm_dispatch.choose_backend on sm_90a
    if refused is None:
        auto = (
            f"block-scaled FP8 GEMM: torch scaled_mm {gemm_fp8.scaled_mm_name(a, b)} (cuBLAS; "
            "set_fp8_semantics('exact'): torch decode + fp32 GEMM)"
        )
    elif a.scale.element is None and b.scale.element is None:  # fp32 block scales
        auto = (
            f"block-scaled FP8 GEMM: the generated kernel ({name}, wgmma; scaled_mm: {refused}; "
            "set_fp8_semantics('exact'): torch decode + fp32 GEMM)"
        )
    lines = [("sm_90a", auto if least is None else f"M < {least}: {auto}")]
    kernel = f"generated block-scaled FP8 kernel ({name}, wgmma)"
    if least is not None:
        lines.append(("sm_90a", f"M >= {least}: {kernel}, measured faster"))
    lines.append(("sm_90a", f'backend="cute": {kernel}'))
    if experts and use.gemm == "wgrad":
        if gemm_fp8.k_grouped_reason(a, b) is None:  # the experts' wgrad: groups along K
            for out_dtype, _ in experts:
                out = gemm_fp8.kernel_out(out_dtype, False)
                params = GemmSm90Fp8Params(**gemm_fp8.k_grouped_kernel_fields(a, b, out))
                when = f"MoE experts, K-grouped, {params.out} out"
                found.add("gemm_sm90_fp8", params, fp8_archs, replace(use, when=when))
            lines.append(("sm_90a", "MoE experts: the K-grouped FP8 kernel, one launch"))
    elif experts:
        for out_dtype, bias in experts:  # the experts' fprop and dgrad: groups of rows
            out = gemm_fp8.kernel_out(out_dtype, False)
            # the codegen defaults, as a dense layer's kernels above (the runtime's variant)
            params = GemmSm90Fp8Params(**gemm_fp8.grouped_kernel_fields(a, b, out, bias))
            when = f"MoE experts, grouped, {params.out} out" + (", bias" if bias else "")
            found.add("gemm_sm90_fp8", params, fp8_archs, replace(use, when=when))
        lines.append(("sm_90a", "MoE experts: the grouped FP8 kernel, one launch"))
    return lines


def grouped_fp8_outputs(
    dtypes: Mapping[str, InputDType],
) -> dict[str, tuple[tuple[InputDType, bool], ...]]:
    """(output dtype, bias) of each GEMM as the grouped experts launch the grouped FP8 kernels
    (``fp4gen.runtime.grouped``): fprop in the layer output's dtype (the gradient's), with and
    without a per-expert bias (gpt-oss); dgrad in x's dtype; wgrad (K-grouped) in W's."""
    return {
        "fprop": ((dtypes["gradient"], False), (dtypes["gradient"], True)),
        "dgrad": ((dtypes["activation"], False),),
        "wgrad": ((dtypes["weight"], False),),
    }


def runtime_plan(
    recipe: Recipe,
    *,
    archs: tuple[str, ...] | None = None,
    input_dtype: InputDType | Mapping[str, InputDType] = "bf16",
) -> RuntimePlan:
    """Every kernel the runtime can load for ``recipe`` on ``archs`` (default: all), with the
    tensors in ``input_dtype`` (one for all or per role, as ``plan_recipe`` takes it): the
    quantize kernels ``fp4gen.nn.Linear`` asks for, and the dequantize and GEMM kernels of the
    recipe's GEMMs (module docstring). The plan's own quantize and MoR kernels are not repeated
    here unless the runtime uses them too."""
    # the code generators load torch and Jinja: only when a plan is made
    from fp4gen.codegen import dequant as dequant_codegen
    from fp4gen.codegen.gemm import fused_support, gemm_spec
    from fp4gen.codegen.gemm import pick_tile as sm90_pick
    from fp4gen.codegen.gemm_fp8 import pair_reason as fp8_pair_reason

    archs = tuple(archs or ARCHS)
    dtypes = _dtypes(input_dtype)
    found = _Collector()
    routes: list[GemmRoute] = []
    quant_archs = _among(ARCHS, archs)
    dequant_archs = _among(dequant_codegen.ARCHS, archs)
    sm90_archs = _among(FUSED_ARCHS, archs)
    sm100_archs = _among(NATIVE_ARCHS, archs)
    sm90_tiles = tile_buckets(sm90_pick)
    sm100_tiles = tile_buckets(sm100_pick)
    outputs = gemm_outputs(dtypes)
    notes: dict[str, None] = {}

    for owner, context, table in _contexts(recipe):
        if isinstance(table, str):
            continue  # nothing quantized in this context (the plan says why)
        rname = owner.name
        for spec, op, when in quantize_uses(table, dtypes):
            found.add(
                "quantize", spec, quant_archs, RuntimeUse(rname, context, operand=op, when=when)
            )
        for gemm, (a_op, b_op) in GEMM_OPERANDS.items():
            a, b = table[a_op].format, table[b_op].format
            pair = (
                f"A = {TENSOR_NAMES[a_op.role]} ({_operand_text(a)}), "
                f"B = {TENSOR_NAMES[b_op.role]} ({_operand_text(b)})"
            )
            if not (isinstance(a, BlockFormat) and isinstance(b, BlockFormat)):
                what = "no GEMM kernel: an operand is high precision or a MoR mix"
                routes.append(GemmRoute(rname, context, gemm, pair, (("all", what),)))
                continue
            if a.global_rows or b.global_rows:
                routes.append(GemmRoute(rname, context, gemm, pair, (("all", ROW_SCALED_REASON),)))
                continue
            lines: list[tuple[str, str]] = []
            first = overflow_k(a, b)  # gemm_dispatch.accumulator_overflow_reason at run time
            if first is not None:
                lines.append(
                    ("all", f"K >= {first}: the float64 reference (an fp32 accumulator could "
                            "overflow: both operands' global scales apply after the sum)")
                )  # fmt: skip
                if first == 1:
                    routes.append(GemmRoute(rname, context, gemm, pair, tuple(lines)))
                    continue

            # dequantize kernels: both operands' formats, every code layout the runtime reads
            decode: list[str] = []
            for side, fmt, op in (("A", a, a_op), ("B", b, b_op)):
                layouts = ("bytes", "packed") if fmt.element.bits == 4 else ("bytes",)
                for codes in layouts:
                    dspec = dequant_codegen.spec_for(fmt, codes)
                    if isinstance(dspec, str):
                        decode.append(dspec)
                        continue
                    use = RuntimeUse(
                        rname,
                        context,
                        gemm=gemm,
                        when=f"{side} = {TENSOR_NAMES[op.role]}, {codes} codes",
                    )
                    found.add("dequant", dspec, dequant_archs, use)
            dequant_what = (
                "dequantize kernels + cuBLAS"
                if not decode
                else (f"torch decode + GEMM ({'; '.join(dict.fromkeys(decode))})")
            )

            # sm_90a: the fused kernels
            if "sm_90a" in archs:
                reason = fused_support(a, b)
                if reason is not None and fp8_pair_reason(a, b) is None:
                    use = RuntimeUse(rname, context, gemm=gemm)
                    auto = f"no fused kernel ({reason}): {dequant_what}"
                    experts = grouped_fp8_outputs(dtypes)[gemm]
                    lines.extend(
                        _fp8_kernels(found, a, b, outputs[gemm], use, archs, auto, experts)
                    )
                elif reason is not None:
                    lines.append(("sm_90a", f"no fused kernel ({reason}): {dequant_what}"))
                else:
                    for out_dtype, bias in outputs[gemm]:
                        kernel_out = "bf16" if out_dtype == "bf16" else "fp32"
                        for lo, hi, tile in sm90_tiles:
                            spec = gemm_spec(a, b, lo, out_dtype=kernel_out, bias=bias, tile=tile)
                            how = "auto" if lo <= FUSED_MAX_M else 'backend="cute"'
                            when = f"{_m_text(lo, hi)} ({how}), {kernel_out} out"
                            when += ", bias" if bias else ""
                            use = RuntimeUse(rname, context, gemm=gemm, when=when)
                            found.add("gemm_sm90", spec, sm90_archs, use)
                    small = [t.name for lo, _, t in sm90_tiles if lo <= FUSED_MAX_M]
                    wgmma = [t.name for lo, _, t in sm90_tiles if lo > FUSED_MAX_M]
                    lines.append(
                        ("sm_90a", f"M <= {FUSED_MAX_M}: fused mma.sync ({', '.join(small)})")
                    )
                    lines.append(("sm_90a", f"M > {FUSED_MAX_M}: {dequant_what}"))
                    lines.append(
                        ("sm_90a", f'backend="cute", M > {FUSED_MAX_M}: wgmma ({", ".join(wgmma)})')
                    )

            # sm_100a: the native block-scaled MMA
            if "sm_100a" in archs:
                mma = mma_plan(a, b)
                if isinstance(mma, str):
                    lines.append(("sm_100a", f"no native MMA ({mma}): {dequant_what}"))
                else:
                    scaled = a.global_scale or b.global_scale
                    for out_dtype, bias in outputs[gemm]:
                        # bf16 straight from the kernel only for N % 8 == 0: both are compiled
                        direct = out_dtype == "bf16" and not bias and not scaled
                        kinds = ("BFloat16", "Float32") if direct else ("Float32",)
                        for kernel_out in kinds:
                            for lo, hi, tile in sm100_tiles:
                                config = gemm_config(
                                    mma, lo, out_dtype=kernel_out, tile=tile,  # type: ignore[arg-type]
                                    sm_count=DEFAULT_SM_COUNT,
                                )  # fmt: skip
                                when = f"{_m_text(lo, hi)}, {kernel_out} out"
                                if kernel_out == "BFloat16":
                                    when += " (N % 8 == 0)"
                                elif direct:
                                    when += " (N % 8 != 0)"
                                use = RuntimeUse(rname, context, gemm=gemm, when=when)
                                found.add("gemm_sm100", config, sm100_archs, use)
                    tiles = ", ".join(str(t) for _, _, t in sm100_tiles)
                    lines.append(("sm_100a", f"{mma.describe()} ({tiles})"))
                    lines.append(("sm_100a", f"shapes it does not take: {dequant_what}"))
                    grid = (
                        "sm_100a GEMMs are compiled for a persistent grid of "
                        f"{DEFAULT_SM_COUNT} SMs (a B200); an sm_100a GPU with another SM "
                        "count compiles its own on first use"
                    )
                    notes[grid] = None
            routes.append(GemmRoute(rname, context, gemm, pair, tuple(lines)))

    inputs = ", ".join(f"{TENSOR_NAMES[r]} {d}" for r, d in dtypes.items())
    note_list = [
        f"tensors are taken to be {inputs} (--input-dtype), and GEMM outputs follow them; a model "
        "whose tensors have other dtypes compiles those kernels on first use"
    ]
    if any(k.kind in ("gemm_sm90", "gemm_sm90_fp8", "gemm_sm100") for k in found.kernels()):
        note_list.append(
            "GEMMs that only direct fp4gen.gemm calls make are not compiled: accumulate= "
            '(C += A B^T) and backend="cute" with an explicit tile= (e.g. the 64x64 wgmma tile)'
        )
    note_list.extend(notes)
    return RuntimePlan(
        recipe=recipe.name,
        archs=archs,
        input_dtypes=tuple(dtypes.items()),
        kernels=found.kernels(),
        gemms=tuple(routes),
        notes=tuple(note_list),
    )


__all__ = [
    "GEMM_OPERANDS",
    "KINDS",
    "GemmRoute",
    "RuntimeKernel",
    "RuntimePlan",
    "RuntimeUse",
    "gemm_outputs",
    "kernel_spec_json",
    "quantize_uses",
    "runtime_plan",
    "tile_buckets",
]
