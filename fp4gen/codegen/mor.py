"""Render a MoR rule into a CuTe DSL module of Mixture-of-Representations kernels (``mor.py.j2``).

A :class:`MoRKernelSpec` is a recipe's ``mor`` rule plus what the operand adds (element rounding,
input dtype). Everything that depends on it is decided here and baked into the generated module
as constants and straight-line code: the candidates and every representation measured (a
``relerr(F)`` yardstick included), each element format's encode constants (derived from its
exponent/mantissa bits, any signed ExMy), the metrics and their thresholds, the scaling method,
and the decision and scale partitions as shifts (``tensor``: 31, ``channel``: rows 0 / columns
31, ``block RxC``: log2 R / log2 C). Shapes stay dynamic.

The generated module's contract (used by ``fp4gen.runtime.mor_kernels``):

* ``KERNELS``: kernel names in launch order: ``("amax", "scales", "quantize")`` when a decision
  unit fits in a 128x128 tile (the decision is taken in the quantizing pass), else
  ``("amax", "scales", "measure", "decide", "emit")`` (a tensor-, channel- or wider decision
  needs every tile's error first: ``decide`` adds the tiles' partial sums and decides);
* ``compile_kernel(name, arch, *, dump_dir=None)``: the TVM-FFI compiled callable of one kernel
  for ``"sm_90a"`` or ``"sm_100a"`` (no GPU needed);
* ``run(fns, x)``: validates ``x`` [R, K], allocates the outputs, launches every kernel (no host
  synchronisation) and returns the tensors a ``MoRTensor`` is made of.

Numerics: docs/numerics.md section 8, bit for bit (the reference is ``fp4gen.numerics.mor``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fp4gen.codegen.render import (
    InputContext,
    SpecEntries,
    TemplateContext,
    inline,
    input_context,
    lit,
    render_template,
)
from fp4gen.dsl.model import MoRScaling, MoRSpec, Partition
from fp4gen.formats import ElementFormat, HighPrecision, Special
from fp4gen.numerics.minifloat import max_finite
from fp4gen.numerics.mor import SUM_TILE, representations
from fp4gen.spec import MoRKernelSpec
from fp4gen.vocab import DTYPES, Arch, Rounding, words

ARCHS: tuple[str, ...] = words(Arch)
ROUNDINGS: tuple[str, ...] = ("nearest", "zero")  # stochastic rounding stays on the reference
SEGMENTS: tuple[int, ...] = (4, 8)  # row segments per thread: 512 or 256 threads (2 spills)
TILE = 128  # a CTA's tile: TILE x TILE elements (must be the reference's SUM_TILE)
WHOLE = 31  # the shift of a partition side that spans the whole tensor (R, K < 2^31)


assert TILE == SUM_TILE, "the kernels' tile is the reference's summation piece"


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _shifts(part: Partition, what: str) -> tuple[int, int]:
    """(row shift, column shift): a row's unit index is row >> shift (31: the whole tensor)."""
    if part.kind == "tensor":
        return WHOLE, WHOLE
    if part.kind == "channel":
        return 0, WHOLE
    assert part.block is not None
    rows, cols = part.block
    for side, n in (("rows", rows), ("columns", cols)):
        if n <= 0 or n & (n - 1):
            raise NotImplementedError(
                f"{what} block {rows}x{cols}: the kernels take power-of-two sides ({side} {n})"
            )
    if cols < 8:
        raise NotImplementedError(
            f"{what} block {rows}x{cols}: at least 8 columns (a thread holds 8 along K)"
        )
    return rows.bit_length() - 1, cols.bit_length() - 1


@dataclass(frozen=True)
class ElementRep:
    """A representation the kernels measure that is an element format (a candidate or a
    ``relerr(F)`` yardstick): its encode constants."""

    name: str
    index: int  # among the element representations (their scale buffers, encode_<index>)
    rep: int  # among all the representations
    bits: int
    exp_bits: int
    man_bits: int
    special: Special
    emin_biased: int  # 1 - bias + 127: the smallest normal's fp32 exponent field
    max: str  # literal of the largest finite value
    sign_shift: int  # bits - 1: the sign bit of a code
    range_bound: str  # literal of max / min normal, the ``range`` metric's bound
    kind: Literal["elem"] = "elem"


@dataclass(frozen=True)
class HighRep:
    """A representation that keeps the values in a high-precision dtype."""

    name: str  # the dtype: "bf16", "fp16" or "fp32"
    rep: int  # among all the representations
    index: None = None  # not an element representation: no scale buffer
    kind: Literal["hp"] = "hp"


def _element(fmt: ElementFormat, index: int, rep: int) -> ElementRep:
    if not fmt.signed:
        raise NotImplementedError(f"{fmt.name}: MoR candidates must be signed element formats")
    q_max = max_finite(fmt)
    emin = 1 - fmt.bias
    return ElementRep(
        name=fmt.name,
        index=index,
        rep=rep,
        bits=fmt.bits,
        exp_bits=fmt.exp_bits,
        man_bits=fmt.man_bits,
        special=fmt.special,
        emin_biased=emin + 127,
        max=lit(q_max),
        sign_shift=fmt.bits - 1,
        range_bound=lit(q_max / fmt.min_normal),  # exact: q_max has few significant bits
    )


@dataclass(frozen=True)
class CandidateContext:
    """A candidate of the rule, in its order."""

    index: int
    rep: ElementRep | HighRep
    metric: Literal["relerr", "relerr_vs", "range"] | None  # None: the fallback
    text: str  # when it is taken, in words
    threshold: str | None = None  # relerr: literal of the threshold
    versus: int | None = None  # relerr_vs: the yardstick's representation


@dataclass(frozen=True)
class HighContext:
    """The high-precision dtype the kernels write high-precision candidates' values in."""

    name: str  # "bf16", "fp16" or "fp32"
    torch: str  # the torch attribute: "bfloat16"


@dataclass(frozen=True)
class KernelClass:
    """A kernel of the module: its class there (whose name is the kernel symbol's) and the
    ``fp4gen.kernels.mor`` class it subclasses, built with one of the module's parameter
    objects."""

    name: str  # the kernel's name in KERNELS: "amax"
    cls: str  # the module's class: "AmaxKernel"
    base: str  # the fp4gen.kernels.mor class: the entry taking exactly the rule's tensors
    params: str  # the parameter object: "SCALE_PARAMS", "MEASURE_PARAMS" or "DECIDE_PARAMS"


def kernel_classes(fused: bool, high: bool, uses_range: bool) -> tuple[KernelClass, ...]:
    """The module's kernels in launch order. Where a rule's tensors differ, so does the entry:
    without high-precision values the quantize and emit kernels' ``Codes`` entries, with the
    range metric the measure and decide kernels' ``Range`` entries."""
    codes = "" if high else "Codes"
    ranged = "Range" if uses_range else ""
    rows = [("amax", "MoRAmax", "SCALE"), ("scales", "MoRScales", "SCALE")]
    if fused:
        rows.append(("quantize", f"MoRQuantize{codes}", "MEASURE"))
    else:
        rows += [
            ("measure", f"MoRMeasure{ranged}", "MEASURE"),
            ("decide", f"MoRDecide{ranged}", "DECIDE"),
            ("emit", f"MoREmit{codes}", "MEASURE"),
        ]
    return tuple(
        KernelClass(name, f"{name.capitalize()}Kernel", f"{base}Kernel", f"{params}_PARAMS")
        for name, base, params in rows
    )


@dataclass(frozen=True)
class MoRContext(TemplateContext):
    """The variables of mor.py.j2. Partition shifts: a row's (column's) unit index is row >> shift,
    31 for a side that spans the whole tensor."""

    entries: SpecEntries[MoRKernelSpec] = inline()
    rule_text: tuple[str, ...]  # the rule, one statement a line
    kernels: tuple[str, ...]  # kernel names in launch order
    classes: tuple[KernelClass, ...]  # the module's kernel classes, in launch order
    fused: bool  # a decision unit fits a 128x128 tile: decided in the quantizing pass
    archs: tuple[str, ...]
    input: InputContext
    rounding: Rounding
    reps: tuple[ElementRep | HighRep, ...]  # every representation measured, in order
    elems: tuple[ElementRep, ...]  # the element ones
    n_elem: int
    cands: tuple[CandidateContext, ...]
    n_cands: int
    high: HighContext | None  # None: no high-precision candidate
    high_bytes: int  # bytes per value of ``high``, 0 without
    high_cands: tuple[str, ...]  # the high-precision candidates' dtypes, sorted
    uses_range: bool  # some candidate takes the ``range`` metric
    scaling: MoRScaling
    urs: int  # the decision unit's row shift
    ucs: int  # the decision unit's column shift
    rh: int  # its row shift within a 128x128 tile: min(urs, 7)
    cw: int  # its column shift within a tile: min(ucs, 7)
    srs: int  # the scale unit's row shift
    scs: int  # the scale unit's column shift
    s_rh: int  # its row shift within a tile: min(srs, 7)
    s_cw: int  # its column shift within a tile: min(scs, 7)
    upr_shift: int  # log2 of the tiles a decision unit spans along rows (at most 24)
    upc_shift: int  # the same along columns
    segments: int  # row segments per thread
    log_segments: int


def check(spec: MoRKernelSpec) -> None:
    """Raise NotImplementedError (with the reason) for a spec the kernels do not cover."""
    rule = spec.rule
    if spec.rounding not in ROUNDINGS:
        raise NotImplementedError(
            f"rounding {spec.rounding!r}: the MoR kernels round {' or '.join(ROUNDINGS)}"
        )
    if spec.input_dtype not in DTYPES:
        raise NotImplementedError(f"input dtype {spec.input_dtype!r}")
    if spec.segments not in SEGMENTS:
        raise NotImplementedError(f"{spec.segments} segments per thread (one of {SEGMENTS})")
    _shifts(rule.decide, "a decision")
    _shifts(rule.scale, "a scale")
    if not any(isinstance(c.format, ElementFormat) for c in rule.candidates):
        raise NotImplementedError("a rule without element candidates (nothing to quantize)")
    for rep in representations(rule):
        if isinstance(rep, ElementFormat) and not rep.signed:
            raise NotImplementedError(f"{rep.name}: MoR candidates must be signed formats")


def context(spec: MoRKernelSpec) -> MoRContext:
    """Everything the template needs, derived from the spec."""
    check(spec)
    rule = spec.rule
    evaluated = representations(rule)
    reps: list[ElementRep | HighRep] = []
    n_elem = 0
    for i, fmt in enumerate(evaluated):
        if isinstance(fmt, ElementFormat):
            reps.append(_element(fmt, n_elem, i))
            n_elem += 1
        else:
            assert isinstance(fmt, HighPrecision)
            reps.append(HighRep(fmt.name, i))
    cands = []
    for i, cand in enumerate(rule.candidates):
        rep = reps[evaluated.index(cand.format)]
        metric = cand.metric
        threshold: str | None = None
        versus: int | None = None
        if metric is None:
            text = "no other candidate accepts (the fallback)"
        elif metric.kind == "relerr":
            assert metric.threshold is not None
            threshold = lit(metric.threshold)
            text = f"relerr < {metric.threshold!r}"
        elif metric.kind == "relerr_vs":
            assert metric.versus is not None
            versus = evaluated.index(metric.versus)
            text = f"relerr < relerr({metric.versus.name})"
        else:
            assert isinstance(rep, ElementRep)
            text = f"range: max < {rep.range_bound} * min over non-zeros"
        cands.append(
            CandidateContext(
                index=i,
                rep=rep,
                metric=None if metric is None else metric.kind,
                text=text,
                threshold=threshold,
                versus=versus,
            )
        )
    highs = sorted({c.format.name for c in rule.candidates if isinstance(c.format, HighPrecision)})
    high = highs[0] if len(highs) == 1 else ("fp32" if highs else None)
    urs, ucs = _shifts(rule.decide, "a decision")
    srs, scs = _shifts(rule.scale, "a scale")
    rh, cw = min(urs, 7), min(ucs, 7)
    fused = urs <= 7 and ucs <= 7
    uses_range = any(c.metric == "range" for c in cands)
    classes = kernel_classes(fused, high is not None, uses_range)
    return MoRContext(
        entries=SpecEntries.of(spec),
        rule_text=tuple(_rule_text(rule)),
        kernels=tuple(c.name for c in classes),
        classes=classes,
        fused=fused,
        archs=ARCHS,
        input=input_context(spec.input_dtype),
        rounding=Rounding(spec.rounding),
        reps=tuple(reps),
        elems=tuple(r for r in reps if isinstance(r, ElementRep)),
        n_elem=n_elem,
        cands=tuple(cands),
        n_cands=len(cands),
        high=None if high is None else HighContext(high, DTYPES[high].torch_name),
        high_bytes=0 if high is None else DTYPES[high].size,
        high_cands=tuple(highs),
        uses_range=uses_range,
        scaling=rule.scaling,
        urs=urs,
        ucs=ucs,
        rh=rh,
        cw=cw,
        srs=srs,
        scs=scs,
        s_rh=min(srs, 7),
        s_cw=min(scs, 7),
        upr_shift=min(urs - rh, 24),
        upc_shift=min(ucs - cw, 24),
        segments=spec.segments,
        log_segments=spec.segments.bit_length() - 1,
    )


def _part_text(part: Partition) -> str:
    if part.kind == "block":
        assert part.block is not None
        return f"block {part.block[0]}x{part.block[1]}"
    return part.kind


def _rule_text(rule: MoRSpec) -> list[str]:
    lines = [f"mor {rule.name}", f"decide {_part_text(rule.decide)}"]
    lines.append(f"scale {_part_text(rule.scale)} {rule.scaling}")
    for c in rule.candidates:
        if c.metric is None:
            lines.append(f"else {c.format.name}")
        elif c.metric.kind == "relerr":
            lines.append(f"try {c.format.name} if relerr < {c.metric.threshold!r}")
        elif c.metric.kind == "relerr_vs":
            assert c.metric.versus is not None
            lines.append(f"try {c.format.name} if relerr < relerr({c.metric.versus.name})")
        else:
            lines.append(f"try {c.format.name} if range")
    return lines


def render(spec: MoRKernelSpec) -> str:
    """The generated CuTe DSL module (Python source) of ``spec``'s MoR kernels.

    Raises NotImplementedError for rules the kernels do not cover (``check``)."""
    return render_template("mor.py.j2", context(spec))


__all__ = [
    "ARCHS",
    "ROUNDINGS",
    "SEGMENTS",
    "TILE",
    "CandidateContext",
    "ElementRep",
    "HighContext",
    "HighRep",
    "KernelClass",
    "MoRContext",
    "MoRKernelSpec",
    "check",
    "context",
    "kernel_classes",
    "render",
]
