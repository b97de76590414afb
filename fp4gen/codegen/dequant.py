"""Render a DequantKernelSpec into a CuTe DSL module: block-scaled codes -> bf16 GEMM operand.

The large-M GEMM path on Hopper (docs/gemm-sm90.md) decodes each operand once into bf16
holding element x block scale, then runs cuBLAS with fp32 accumulation; the fused kernels
re-decode every B tile once per M-tile instead. This kernel is that decode: a memory-bound
elementwise pass (reads 1 or 0.5 code bytes and 1/16 or 1/32 scale byte per value, writes 2
bytes).

Decode, for any element format eXmY (3 to 8 bits, signed) and any 8-bit-or-narrower scale
format (eXmY or exponent-only ueXm0), by bit placement and exact fp32 multiplies:

* element: the magnitude field (exponent then mantissa) shifted to fp32's exponent/mantissa
  position, the sign to bit 31: as fp32 that is v * 2^(bias - 127) (a normal or an fp32
  subnormal, exactly); times 2^(127 - bias) gives v exactly (the multiply honours subnormal
  inputs: PTX mul.f32 without .ftz);
* scale: the same for eXmY scales; ueXm0 code c is 2^(c - bias), fp32 bits (c + 127 - bias) << 23
  (code 0 of ue8m0 is the fp32 subnormal 2^-127, bits 0x00400000);
* v * s in fp32 is exact (at most 8 significant bits when the pair is exact in bf16, and no
  product reaches below fp32's subnormal step), then one cvt.rn to bf16: the value itself in
  bf16's normal range (from 2^-126; below it bf16's subnormals hold fewer bits, and the value
  rounds as ``.to(bfloat16)`` does: only with ue8m0 scales near 2^-127, i.e. blocks whose amax
  is below ~1e-36). So the output equals ``q.dequantize_blockwise().to(torch.bfloat16)`` bit
  for bit.

Codes a quantizer never writes (NaN of e4m3, Inf/NaN of e5m2, the NaN code of ueXm0) decode
as the finite value of their bit pattern.

The kernel itself is ``fp4gen.kernels.dequant.DequantKernel``, one CuTe DSL class for every
format; the generated module binds this spec's ``DequantParams`` (derived here) and adds the
host code. Its contract (used through ``fp4gen.runtime.kernels_for``):

* ``KERNELS = ("dequant",)``, ``ARCHS = ("sm_90a", "sm_100a")``;
* ``compile_kernel(name, arch, *, dump_dir=None)``: the TVM-FFI compiled function (no GPU);
* ``launch_args(codes, scale_codes, *, cols, out=None)`` and ``run(fns, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp4gen.codegen.render import SpecEntries, TemplateContext, doc_block, inline, render_template
from fp4gen.formats import BlockFormat, ElementFormat
from fp4gen.spec import DequantKernelSpec
from fp4gen.vocab import Arch, DequantScaleMode, StrEnum, words

ARCHS: tuple[str, ...] = words(Arch)
# values per unit of work: 8 code bytes (4 packed) in, one 16-byte store out, so that every
# load and store instruction of a warp covers one contiguous span (a 16-value unit's two
# 16-byte stores per thread half-fill the sectors of each instruction: 0.75x copy on H100)
UNIT = 8
THREADS = 256
UNITS_PER_THREAD = 8  # loads issued back to back before any decode


def unsupported_reason(spec: DequantKernelSpec) -> str | None:
    """Why the template cannot generate ``spec`` (None when it can)."""
    e, s = spec.element, spec.scale
    if not e.signed or not 3 <= e.bits <= 8:
        return f"{e.name} elements (signed formats of 3 to 8 bits)"
    if s.bits > 8:
        return f"{s.name} scales are wider than a byte"
    if e.significand_bits + (1 if s.exponent_only else s.significand_bits) > 8:
        return (
            f"{e.name} x {s.name} needs more than bf16's 8 significant bits (the product would "
            "not be exact in bf16)"
        )
    if spec.codes == "packed" and e.bits != 4:
        return f"packed codes are two 4-bit codes per byte; {e.name} has {e.bits} bits"
    if spec.codes not in ("bytes", "packed"):
        return f"code layout {spec.codes!r} (bytes or packed)"
    rows, cols = spec.block
    if rows < 1 or cols < 1 or (rows != 1 and rows != cols):
        return f"{rows}x{cols} blocks (1xN or NxN)"
    return None


def spec_for(fmt: BlockFormat, codes: str = "bytes") -> DequantKernelSpec | str:
    """The dequantize spec of a block format, or why there is none (fp32 scales, a product
    that is not exact in bf16, ...)."""
    if fmt.scale.element is None:
        return f"{fmt.name} has fp32 block scales (not exact in bf16)"
    spec = DequantKernelSpec(fmt.element, fmt.block, fmt.scale.element, codes)  # type: ignore[arg-type]
    reason = unsupported_reason(spec)
    return spec if reason is None else f"{fmt.name}: {reason}"


class ScaleKind(StrEnum):
    """How the kernel decodes a scale code; the template compares it with these words."""

    EXPONENT = "exponent"  # ueXm0: code c is 2^(c - bias), placed as an fp32 exponent field
    MINIFLOAT = "minifloat"  # eXmY: the magnitude field shifted into place, as the elements


ScaleMode = DequantScaleMode  # how the UNIT values of a unit map to scale columns


@dataclass(frozen=True)
class ElementDecode:
    """What the decode of an element code needs."""

    name: str
    bits: int
    man_bits: int
    bias: int
    mag_mask: int  # the magnitude bits of a code
    shift: int  # 23 - man_bits: the magnitude field's shift to fp32's exponent/mantissa


@dataclass(frozen=True)
class ScaleDecode:
    """What the decode of a scale code needs; the fields after ``bias`` are None where ``kind``
    has no use for them."""

    name: str
    kind: ScaleKind
    bias: int
    offset: int | None = None  # exponent-only: the fp32 biased exponent of code c is c + offset
    code0_subnormal: bool | None = None  # exponent-only: 2^-127 is below fp32's normal range
    mag_mask: int | None = None  # minifloat: the magnitude bits of a code
    shift: int | None = None  # minifloat: 23 - man_bits


@dataclass(frozen=True)
class DequantContext(TemplateContext):
    """The variables of dequant.py.j2."""

    entries: SpecEntries[DequantKernelSpec] = inline()
    elem: ElementDecode
    scale: ScaleDecode
    block: tuple[int, int]
    br: int  # block rows
    bc: int  # block columns
    packed: bool  # two 4-bit codes per byte
    unit: int  # values per unit of work
    unit_bytes: int  # code bytes of a unit
    code_words: int  # 32-bit words of a unit's codes
    threads: int  # threads per CTA
    units_per_thread: int
    scale_mode: ScaleMode
    scale_groups: tuple[tuple[int, ...], ...]  # per scale column of a unit: its values
    archs: tuple[str, ...]
    launch_doc: str  # the launch function's docstring paragraph


def _element_context(e: ElementFormat) -> ElementDecode:
    return ElementDecode(
        name=e.name,
        bits=e.bits,
        man_bits=e.man_bits,
        bias=e.bias,
        mag_mask=(1 << (e.bits - 1)) - 1,
        shift=23 - e.man_bits,
    )


def _scale_context(s: ElementFormat) -> ScaleDecode:
    if s.exponent_only:
        return ScaleDecode(
            name=s.name,
            kind=ScaleKind.EXPONENT,
            bias=s.bias,
            offset=127 - s.bias,
            code0_subnormal=s.bias == 127,
        )
    return ScaleDecode(
        name=s.name,
        kind=ScaleKind.MINIFLOAT,
        bias=s.bias,
        mag_mask=(1 << (s.bits - 1)) - 1,
        shift=23 - s.man_bits,
    )


def _scale_groups(bc: int) -> tuple[ScaleMode, tuple[tuple[int, ...], ...]]:
    """How the UNIT values of a unit map to scale columns (see ScaleMode), with the values of
    each scale column."""
    if bc % UNIT == 0:  # whole units per block (a unit starts at a multiple of UNIT)
        return ScaleMode.UNIT, (tuple(range(UNIT)),)
    if UNIT % bc == 0:
        groups = tuple(tuple(range(g * bc, (g + 1) * bc)) for g in range(UNIT // bc))
        return ScaleMode.SPLIT, groups
    return ScaleMode.VALUE, tuple((j,) for j in range(UNIT))


def dequant_context(spec: DequantKernelSpec) -> DequantContext:
    """Everything the template needs, all derived from the spec."""
    reason = unsupported_reason(spec)
    if reason is not None:
        raise NotImplementedError(f"{spec.name}: {reason}")
    br, bc = spec.block
    mode, groups = _scale_groups(bc)
    packed = spec.codes == "packed"
    unit_bytes = UNIT // 2 if packed else UNIT
    launch_doc = (
        f"codes uint8 [R, {'ceil(K/2)' if packed else 'K'}] ("
        + ("two codes per byte, element 0 in the low nibble" if packed else "one code per byte")
        + f"), scale_codes uint8 [ceil(R/{br}), ceil(K/{bc})] ({spec.scale.name}), both on one "
        f"CUDA device; out bf16 [R, Kp] with Kp = K rounded up to a multiple of {UNIT} "
        "(allocated when not given; columns K..Kp hold zeros)"
    )
    return DequantContext(
        entries=SpecEntries.of(spec),
        elem=_element_context(spec.element),
        scale=_scale_context(spec.scale),
        block=spec.block,
        br=br,
        bc=bc,
        packed=packed,
        unit=UNIT,
        unit_bytes=unit_bytes,
        code_words=unit_bytes // 4,
        threads=THREADS,
        units_per_thread=UNITS_PER_THREAD,
        scale_mode=mode,
        scale_groups=groups,
        archs=ARCHS,
        launch_doc=doc_block(launch_doc),
    )


def render_dequant(spec: DequantKernelSpec) -> str:
    """The generated CuTe DSL module (Python source) of ``spec``'s dequantize kernel.

    Raises NotImplementedError for formats the template does not cover (see
    ``unsupported_reason``)."""
    return render_template("dequant.py.j2", dequant_context(spec))


__all__ = [
    "ARCHS",
    "THREADS",
    "UNIT",
    "DequantContext",
    "ElementDecode",
    "ScaleDecode",
    "ScaleKind",
    "ScaleMode",
    "dequant_context",
    "render_dequant",
    "spec_for",
    "unsupported_reason",
]
