"""Render a QuantKernelSpec into a CuTe DSL module of quantize kernels.

Two templates: ``quantize.py.j2`` for a single rowwise copy with 1xN blocks (a flat sequence of
units, one or more blocks per thread), ``quantize_tile.py.j2`` for everything else: a columnwise
copy (blocks along M, codes stored transposed [K, M], optional RHT along M), rowwise + columnwise
copies from one read of the input, and 2D BxB tiles (one scale per tile; the columnwise copy is
the transpose of the same codes and scales). Tile kernels hold a ROWS x VEC strip per thread.

Everything that depends on the formats is decided here, in Python, and written into the module as
constants and as straight-line code: the generated source names its formats, grid constants and
thread mapping, and contains only the code paths the spec needs. Shapes (M, K) stay dynamic.

The generated module's contract (used by ``fp4gen.compiler``):

* ``KERNELS``: kernel names in launch order, ``("amax", "quantize")`` with a global scale, else
  ``("quantize",)``;
* ``compile_kernel(name, arch, *, dump_dir=None)``: the TVM-FFI compiled callable of one kernel
  for ``"sm_90a"`` or ``"sm_100a"`` (no GPU needed); with ``dump_dir`` the PTX is kept there;
* ``run(fns, x, *, seed=0, offset=0)``: validates ``x``, allocates the outputs, launches the
  kernels of ``fns`` (name -> callable) and returns ``{"data", "scales", "global_scale"}`` plus
  ``"scales_swizzled"`` for the swizzled layout, for the rowwise copy; a columnwise copy's keys
  carry a ``col_`` prefix (``"col_data"`` [K, M*bits/8], ``"col_scales"``, ...). Tile modules
  take ``offset`` as an int (every copy) or a tuple with one Philox offset per copy, in
  ``OUTPUTS`` order (a 2D kernel's codes use the first). Every module also takes a
  ``fp4gen.device_offset.DeviceOffset(counter, stride, slots)``: copy i's offset is then
  counter[0] * stride + slots[i], read by the kernel from device memory (CUDA graphs);
* ``NONFINITE_TO_NAN_SCALE = True``: after the launches each copy's S_dec (``global_scale``,
  ``col_global_scale``) is NaN iff the input held a NaN or an Inf, and every output bit is
  unchanged for a finite input (docs/numerics.md section 7), so the runtime needs no separate
  finite check.

Numerics: docs/numerics.md, bit for bit (the reference is ``fp4gen.numerics.quantize``).
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, replace
from typing import Any, Literal

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
from fp4gen.dsl.model import RHTSpec
from fp4gen.formats import ElementFormat, Special, is_stochastic, scale_cap, sr_bits
from fp4gen.numerics.hadamard import rht_scale, rht_signs
from fp4gen.numerics.minifloat import max_exponent, max_finite
from fp4gen.spec import QuantKernelSpec
from fp4gen.vocab import DTYPES, Direction, Rounding, ScaleRounding, StrEnum

ARCHS: tuple[str, ...] = ("sm_90a", "sm_100a")

FLT_MAX = float(torch.finfo(torch.float32).max)

# Hardware converts whose result equals the contract's RNE encode (satfinite = the clamp), keyed
# by (exp_bits, man_bits, special). Value: (PTX type, arches that have it).
_HW_CVT = {
    (2, 1, "finite"): ("e2m1x2", ("sm_100a",)),
    (2, 3, "finite"): ("e2m3x2", ("sm_100a",)),
    (3, 2, "finite"): ("e3m2x2", ("sm_100a",)),
    (4, 3, "fn"): ("e4m3x2", ("sm_90a", "sm_100a")),
    (5, 2, "ieee"): ("e5m2x2", ("sm_90a", "sm_100a")),
}

QUANT_THREADS = 256
AMAX_THREADS = 256
MAX_UNIT = 64  # elements one thread holds at once (registers)

# The CuTe type of a store word of codes, by its bytes
_STORE_TYPES = {4: "Uint32", 2: "Uint16", 1: "Uint8"}


def _f32(x: float) -> float:
    """x rounded to fp32 (RNE; overflow gives inf), as a Python float."""
    return torch.tensor(x, dtype=torch.float32).item()


def _f32_mul(a: float, b: float) -> float:
    return (torch.tensor(a, dtype=torch.float32) * torch.tensor(b, dtype=torch.float32)).item()


def _f32_div(a: float, b: float) -> float:
    return (torch.tensor(a, dtype=torch.float32) / torch.tensor(b, dtype=torch.float32)).item()


def _import_order(name: str) -> tuple:
    """isort's order within ``from m import ...``: classes before functions, numbers natural."""
    parts = re.split(r"(\d+)", name)
    return (name[0].islower(), [int(p) if p.isdigit() else p for p in parts])


def _hex(word: int) -> str:
    return f"0x{word & 0xFFFFFFFF:08X}"


@dataclass(frozen=True)
class Mapping:
    """How threads cover the flat sequence of blocks (``fp4gen.kernels.quantize``'s docstring)."""

    unit: int  # elements one thread handles per unit of work (contiguous, 128-bit aligned)
    blocks_per_unit: int  # whole blocks in a unit (1 when threads cooperate on a block)
    threads_per_block: int  # threads that share one block (1: a thread owns whole blocks)
    k_multiple: int  # K must be a multiple of this
    quant_units: int  # units per thread, quantize kernel
    amax_units: int  # units per thread, amax kernel
    # an RHT larger than MAX_UNIT: the lanes one chunk spans (units of 32 values each, the
    # butterflies of h >= 32 by xor shuffles); 1: a unit holds whole chunks
    rht_lanes: int = 1


class SwEncode(StrEnum):
    """The software element encode of a rounding (``fp4gen.kernels.encode``); the kernels
    compare it with these words."""

    RNE = "rne"  # one FFMA; needs a mantissa bit so that rint's even integer is the even code
    # 4-bit codes with 8 random bits and at most 2 mantissa bits, encoded in groups of 8 values:
    # two values per fp16x2 convert and integer op
    SRHALF = "srhalf"
    SRSHIFT = "srshift"  # 8/16 random bits: fp32 bit arithmetic after one exact rescale
    SR64 = "sr64"  # 32 random bits (tile kernels): a 64-bit truncating convert and a borrow
    FLOOR = "floor"  # floor + exact fraction


class ScaleKind(StrEnum):
    """How a kernel encodes its block scales; the templates compare it with these words."""

    FP32 = "fp32"  # plain fp32 scales, nothing to round
    EXPONENT = "exponent"  # an exponent-only format (UExM0)
    E4M3_HW = "e4m3_hw"  # e4m3 rounded to nearest: the hardware convert
    MINIFLOAT = "minifloat"  # any other minifloat, rounded in software


class RandomSource(StrEnum):
    """The generated function that draws a copy's random bits (the words are its name)."""

    WORDS = "random_words"  # whole Philox words: what the "srhalf" encode takes
    FIELDS = "random_fields"  # one sr_bits field per value: every other encode


def _random_source(encode: SwEncode) -> RandomSource:
    return RandomSource.WORDS if encode == SwEncode.SRHALF else RandomSource.FIELDS


def _sw_encode(elem: ElementFormat, rounding: str, *, tile: bool, whole_words: bool) -> SwEncode:
    """The software element encode of a rounding (see SwEncode). ``whole_words``: every encode
    call gets a multiple of 32 // bits values."""
    if rounding == "nearest" and elem.man_bits > 0:
        return SwEncode.RNE
    if _half_image_fits(elem, rounding) and whole_words:
        return SwEncode.SRHALF
    if 0 < sr_bits(rounding) < 32:
        return SwEncode.SRSHIFT
    if rounding == "stochastic" and tile:
        return SwEncode.SR64
    return SwEncode.FLOOR


def _half_image_fits(elem: ElementFormat, rounding: str) -> bool:
    """Whether the fp16 image of a 4-bit format (z = y * 2^(-14 - emin): the format's grid on
    fp16's) keeps the 8 random bits below the code: m + 8 <= 10 fp16 mantissa bits."""
    return elem.bits == 4 and rounding == "stochastic8" and elem.man_bits <= 2


def _half_bits(value: float) -> int:
    """The fp16 bits of a value fp16 holds exactly."""
    bits = struct.unpack("<H", struct.pack("<e", value))[0]
    if struct.unpack("<e", struct.pack("<H", bits))[0] != value:
        raise ValueError(f"{value!r} is not an fp16 value")
    return bits


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def choose_mapping(block: int, rht: int | None, in_bytes: int) -> Mapping:
    """Thread mapping for 1xB blocks (B % 8 == 0) with an optional row RHT of size d."""
    d = rht or 1
    k_multiple = math.lcm(block, d)
    unit = tpb = 0
    if block > 32:
        # cooperating threads: each holds EPT elements of one block, shuffles combine the amax
        for ept in (32, 16, 8):
            if block % ept == 0 and _is_pow2(block // ept) and block // ept <= 32 and ept % d == 0:
                unit, tpb = ept, block // ept
                break
    rht_lanes = 1
    if not unit and d > MAX_UNIT and _is_pow2(d) and _is_pow2(block) and block <= 32:
        # a chunk of the RHT over d / 32 consecutive lanes: units of 32 values, whole blocks
        unit, tpb, rht_lanes = 32, 1, d // 32
    if not unit:
        unit, tpb = k_multiple, 1
        if unit > MAX_UNIT:
            raise NotImplementedError(
                f"1x{block} blocks with an RHT of size {d}: a thread would hold {unit} elements "
                f"(at most {MAX_UNIT}); cross-thread butterflies / block splits of this shape are "
                "not generated yet"
            )
    unit_bytes = unit * in_bytes
    quant_units = max(1, 32 // unit_bytes)
    amax_units = max(1, min(2, 128 // unit_bytes))
    blocks_per_unit = unit // block if tpb == 1 else 1
    return Mapping(unit, blocks_per_unit, tpb, k_multiple, quant_units, amax_units, rht_lanes)


@dataclass(frozen=True)
class HalfImage:
    """The fp16 image of a 4-bit format that the "srhalf" encode works on: z = y * 2^(-14 - emin)
    puts the format's grid on fp16's, the code in the fp16 bits from 10 - m."""

    scale: str  # literal of 2^(-14 - emin), the factor y -> z
    max2: str  # hex word: the fp16 bits of the image of the format's max, in both halves
    code_shift: int  # 10 - m: the lowest code bit of an image
    rand_shift: int  # 2 - m: the lowest of the 8 random bits below the code


@dataclass(frozen=True)
class ElementContext:
    """The element format's constants, spelled as the generated module writes them."""

    name: str
    bits: int
    exp_bits: int
    man_bits: int
    bias: int
    emin: int  # 1 - bias: exponent of the smallest normal (and of the subnormals)
    emin_biased: int  # emin + 127, as an fp32 exponent field
    special: Special  # which codes are Inf / NaN
    max: str  # literal of the largest finite value
    inv_max: str  # literal of fp32(1 / max)
    emax: int  # floor(log2(max))
    # magnitude code = bits(2^23 + n) + (k + 127) * 2^m - code_bias (hex, as the next two)
    code_bias: str
    word_bias: str  # code_bias in every lane of a 32-bit word, mod 2^32
    lane_signs: str  # the sign bit of every lane of a 32-bit word
    hw_cvt: str | None  # the PTX type of a hardware convert equal to the RNE encode, if any
    hw_archs: tuple[str, ...]  # the arches that have that convert
    sign_mask: int  # the sign bit of a code
    half: HalfImage | None  # the fp16 image, for 4-bit formats with at most 2 mantissa bits


def _element_context(fmt: ElementFormat) -> ElementContext:
    emax_val = max_finite(fmt)
    emin = 1 - fmt.bias
    m = fmt.man_bits
    hw = _HW_CVT.get((fmt.exp_bits, fmt.man_bits, fmt.special))
    code_bias = 0x4B000000 + ((emin + 127) << m)
    lanes = 32 // fmt.bits
    sign = 1 << (fmt.bits - 1)
    half = None
    if fmt.bits == 4 and m <= 2:
        half = HalfImage(
            scale=lit(2.0 ** (-14 - emin)),
            max2=_hex(_half_bits(emax_val * 2.0 ** (-14 - emin)) * 0x10001),
            code_shift=10 - m,
            rand_shift=2 - m,
        )
    return ElementContext(
        name=fmt.name,
        bits=fmt.bits,
        exp_bits=fmt.exp_bits,
        man_bits=m,
        bias=fmt.bias,
        emin=emin,
        emin_biased=emin + 127,
        special=fmt.special,
        max=lit(emax_val),
        inv_max=lit(_f32_div(1.0, emax_val)),
        emax=max_exponent(fmt),
        code_bias=_hex(code_bias),
        word_bias=_hex(sum(code_bias << (fmt.bits * j) for j in range(lanes))),
        lane_signs=_hex(sum(sign << (fmt.bits * j) for j in range(lanes))),
        hw_cvt=hw[0] if hw else None,
        hw_archs=hw[1] if hw else (),
        sign_mask=sign,
        half=half,
    )


@dataclass(frozen=True)
class ScaleContext:
    """The block scale format's constants. The fields after ``cap`` are None where ``kind`` has
    no use for them (fp32 scales have none of them)."""

    kind: ScaleKind
    name: str
    rounding: ScaleRounding | Literal["exact"]  # "exact": fp32 scales are not rounded
    max: str  # literal of the largest finite scale
    cap: str  # literal of the saturation point: element max * cap <= FLT_MAX
    bits: int | None = None
    exp_bits: int | None = None
    man_bits: int | None = None
    bias: int | None = None
    min: str | None = None  # exponent-only: literal of 2^-bias (these formats have no zero)
    max_code: int | None = None  # exponent-only: the largest finite code (all ones is NaN)
    emin_biased: int | None = None  # software minifloat: emin + 127, an fp32 exponent field


def _scale_context(spec: QuantKernelSpec) -> ScaleContext:
    scale = spec.scale
    # d_b saturates at the cap, not at the format's max, so no code decodes to +-inf
    cap = lit(scale_cap(spec.element, scale))
    fmt = scale.element
    if fmt is None:
        return ScaleContext(
            kind=ScaleKind.FP32, name="fp32", rounding="exact", max=lit(FLT_MAX), cap=cap
        )
    rounding = ScaleRounding(scale.rounding)
    emin = 1 - fmt.bias
    if fmt.exponent_only:
        kind = ScaleKind.EXPONENT
    elif (fmt.exp_bits, fmt.man_bits, fmt.special) == (4, 3, "fn") and rounding == "nearest":
        kind = ScaleKind.E4M3_HW
    else:
        kind = ScaleKind.MINIFLOAT
    return ScaleContext(
        kind=kind,
        name=fmt.name,
        rounding=rounding,
        max=lit(max_finite(fmt)),
        cap=cap,
        bits=fmt.bits,
        exp_bits=fmt.exp_bits,
        man_bits=fmt.man_bits,
        bias=fmt.bias,
        min=lit(fmt.min_positive) if kind == ScaleKind.EXPONENT else None,
        max_code=(1 << fmt.exp_bits) - 2 if kind == ScaleKind.EXPONENT else None,
        emin_biased=emin + 127 if kind == ScaleKind.MINIFLOAT else None,
    )


@dataclass(frozen=True)
class RHTContext:
    """A random Hadamard transform of a copy."""

    size: int
    signs: tuple[int, ...]  # +1 / -1 per position
    signs_text: str  # the signs as a string of "+" and "-"
    source: str  # where the signs come from, in words
    scale: str  # literal of fp32(1 / sqrt(size))
    runtime: bool = False  # the signs are the kernels' arguments (drawn per layer or step)


def _rht_context(rht: RHTSpec) -> RHTContext:
    if rht.redrawn:  # docs/numerics.md 12: drawn per call, so the kernels take them as arguments
        return RHTContext(
            size=rht.size,
            signs=(),
            signs_text="",
            source="signs per layer"
            + (" and step" if rht.sign_source == "step" else "")
            + ": arguments",
            scale=lit(rht_scale(rht.size)),
            runtime=True,
        )
    signs = tuple(int(s) for s in rht_signs(rht).tolist())
    source = {
        "fixed": "fixed vector",
        "seeded": f"seeded by Philox, seed {rht.seed}",
        "none": "no signs",
    }[rht.sign_source]
    return RHTContext(
        size=rht.size,
        signs=signs,
        signs_text="".join("+" if s > 0 else "-" for s in signs),
        source=source,
        scale=lit(rht_scale(rht.size)),
    )


@dataclass(frozen=True)
class QuantCommon(TemplateContext):
    """The variables the rowwise and the tile template share: the spec, its kernels, the input
    type, the element and scale formats with the global scale's numerator, the archs."""

    entries: SpecEntries[QuantKernelSpec] = inline()
    kernels: tuple[str, ...]  # kernel names in launch order
    input: InputContext
    in_bytes: int  # bytes per input value
    elem: ElementContext
    scale: ScaleContext
    global_scale: bool  # an fp32 per-tensor scale from the tensor's amax
    # literal of fp32(scale max * element max), S_enc's numerator (the global bound for the
    # scale max where the format has one)
    global_num: str
    archs: tuple[str, ...]
    flt_max: str  # literal of the largest fp32
    uses_math: bool  # the global numerator is spelled with math.inf: the module imports math
    # inline PTX: the rowwise element scaling (scale_value), the tile kernels' predicated stores
    uses_asm: bool


def _common_context(spec: QuantKernelSpec) -> QuantCommon:
    scale_max = FLT_MAX if spec.scale.element is None else max_finite(spec.scale.element)
    if spec.global_bound is not None:  # docs/numerics.md 11.1: the amax maps to ELEM_MAX * BOUND
        scale_max = spec.global_bound
    global_num = lit(_f32_mul(scale_max, max_finite(spec.element)))
    return QuantCommon(
        entries=SpecEntries.of(spec),
        kernels=("amax", "quantize") if spec.global_scale else ("quantize",),
        input=input_context(spec.input_dtype),
        in_bytes=DTYPES[spec.input_dtype].size,
        elem=_element_context(spec.element),
        scale=_scale_context(spec),
        global_scale=spec.global_scale,
        global_num=global_num,
        archs=ARCHS,
        flt_max=lit(FLT_MAX),
        uses_math=spec.global_scale and "math" in global_num,
        uses_asm=True,
    )


def is_rowwise(spec: QuantKernelSpec) -> bool:
    """One rowwise output and 1D blocks: the rowwise template (quantize.py.j2); every other spec
    (a columnwise output, rowwise + columnwise, 2D blocks) takes the tile template."""
    return spec.block[0] == 1 and [o.direction for o in spec.outputs] == ["rowwise"]


def _check(spec: QuantKernelSpec) -> None:
    if not spec.element.signed:
        raise ValueError(f"{spec.name}: element formats must be signed, got {spec.element.name}")
    if spec.block[1] % 8:
        raise NotImplementedError(
            f"{spec.name}: block length {spec.block[1]} is not a multiple of 8 (a thread's unit "
            "must be whole 128-bit loads and whole bytes of codes)"
        )
    if spec.input_dtype not in DTYPES:
        raise ValueError(f"{spec.name}: unsupported input dtype {spec.input_dtype!r}")
    out = spec.outputs[0]
    if out.scale_layout == "swizzled" and spec.scale.element is None:
        raise ValueError(f"{spec.name}: fp32 block scales have no tensor-core swizzled layout")
    if out.rht is not None and out.rht.size % 8 and out.rht.size > spec.block[1]:
        raise NotImplementedError(f"{spec.name}: RHT size {out.rht.size} is not supported")


# The Philox scalars and the RHT's sign words of a rowwise entry, in the kernels' order
PHILOX_ARGS: tuple[str, ...] = (
    "seed_lo",
    "seed_hi",
    "offset_lo",
    "offset_hi",
    "ctr_lo",
    "ctr_hi",
    "stride_lo",
    "stride_hi",
)
SIGN_ARGS: tuple[str, ...] = tuple(f"s{i}" for i in range(8))
_ARG_NOTES = {  # the notes the compiled function's scalars carry
    "ctr_lo": "address of a DeviceOffset counter (0: none), low and high words",
    "stride_lo": "the DeviceOffset stride",
    "s0": "the RHT's sign words: bit i % 32 of word i // 32 for position i",
}

# A parameter of a generated entry: (name, annotation, note; "" for none)
EntryParam = tuple[str, str, str]


@dataclass(frozen=True)
class RowwiseEntry(TemplateContext):
    """What quantize.py.j2 spells of the rowwise kernel classes, as data: the fields of
    ``RowwiseParams`` (each a (field, source, note) with the module's constants by name) and the
    quantize kernel's two entries, ``__call__`` (the compiled function's parameters, with notes)
    and ``kernel``, with the arguments each hands to ``launch`` and ``body``."""

    params_fields: tuple[tuple[str, str, str], ...] = ()
    amax_base: str = ""  # the fp4gen.kernels.quantize class the amax kernel subclasses
    call_params: tuple[EntryParam, ...] = ()
    launch_args: tuple[str, ...] = ()
    kernel_params: tuple[EntryParam, ...] = ()
    body_args: tuple[str, ...] = ()
    philox_args: tuple[str, ...] = ()  # the scalars packed into the tuple ``philox``


@dataclass(frozen=True)
class RowwiseContext(TemplateContext):
    """The variables of quantize.py.j2: one rowwise copy with 1xN blocks."""

    common: QuantCommon = inline()
    entry: RowwiseEntry = inline()
    rounding: Rounding
    sr: bool  # stochastic rounding
    sr_bits: int  # random bits per value, 0 for a deterministic rounding
    sw_encode: SwEncode
    hw_archs: tuple[str, ...]  # arches whose hardware convert gives this rounding's codes
    swar: bool  # whole codes per 32-bit word (4- and 8-bit): pack and sign them word by word
    block: int  # elements per 1xN block
    map: Mapping
    map_note: str  # what a unit holds and who owns its blocks, in words
    unit_bytes: int  # bytes of a unit's packed codes
    store_bytes: int  # bytes of one store word of codes
    store_n: int  # store words per unit
    cutlass_names: tuple[str, ...]  # names the module imports from cutlass, in isort's order
    k_rule: str  # what K must be a multiple of, in words
    rht: RHTContext | None  # the row RHT before every amax
    swizzled: bool  # scales also in the swizzled 128x4 layout
    quant_threads: int  # threads per CTA, quantize kernel
    amax_threads: int  # threads per CTA, amax kernel
    rand_fn: RandomSource
    # docs/numerics.md 11.1: fp32(1 / T) per block target T, in order (() without
    # targets: the element's max alone) and whether the error is |d| (mae) rather than d * d
    target_invs: tuple[float, ...]
    target_mae: bool
    global_bound: str | None  # literal of the global bound (11.1), None: the scale's max
    scale_sr: bool  # stochastic block scales (11.2): a Philox word per block
    philox: bool  # the kernel draws Philox words: it takes the seed and the offset
    global_rows: bool  # one global scale per row (11.4): amax and S_dec are [M]
    eden_group: int  # the MS-EDEN correction's group (11.3); 0: none
    # MS-EDEN with stochastic scales: the ScaleKind of the codes' nearest scale rounding
    eden_first_kind: str


def context(spec: QuantKernelSpec) -> RowwiseContext:
    """Everything the rowwise template needs, all derived from the spec."""
    _check(spec)
    common = _common_context(spec)
    out = spec.outputs[0]
    block = spec.block[1]
    rht = out.rht
    mapping = _eden_mapping(spec, choose_mapping(block, rht.size if rht else None, common.in_bytes))
    unit_bits = mapping.unit * spec.element.bits
    unit_bytes = unit_bits // 8
    store_bytes = 4 if unit_bytes % 4 == 0 else 2 if unit_bytes % 2 == 0 else 1
    # the module itself spells only the entry and the host code: the device code is
    # fp4gen.kernels.quantize's (no inline PTX of its own)
    common = replace(common, uses_asm=False)
    names = {"Float32", "Int32", "Uint8"}
    sr = is_stochastic(out.rounding)
    scale_sr = spec.scale.rounding == "stochastic"
    sw_encode = _sw_encode(
        spec.element,
        out.rounding,
        tile=False,
        whole_words=mapping.unit % (32 // spec.element.bits) == 0,
    )
    ctx = RowwiseContext(
        common=common,
        entry=RowwiseEntry(),
        rounding=Rounding(out.rounding),
        sr=sr,
        sr_bits=sr_bits(out.rounding),
        sw_encode=sw_encode,
        hw_archs=common.elem.hw_archs if out.rounding == "nearest" else (),
        swar=32 % spec.element.bits == 0,
        block=block,
        map=mapping,
        map_note=_mapping_note(mapping, rht.size if rht else 0),
        unit_bytes=unit_bytes,
        store_bytes=store_bytes,
        store_n=unit_bytes // store_bytes,
        cutlass_names=tuple(sorted(names, key=_import_order)),
        k_rule=f"1x{block} blocks" + (f", RHT size {rht.size}" if rht else ""),
        rht=_rht_context(rht) if rht is not None else None,
        swizzled=out.scale_layout == "swizzled",
        quant_threads=QUANT_THREADS,
        amax_threads=AMAX_THREADS,
        rand_fn=_random_source(sw_encode),
        target_invs=tuple(_f32_div(1.0, t) for t in spec.targets),
        target_mae=bool(spec.targets) and spec.target_error == "mae",
        global_bound=lit(spec.global_bound) if spec.global_bound is not None else None,
        scale_sr=scale_sr,
        philox=sr or scale_sr,
        global_rows=spec.global_rows,
        eden_group=spec.eden_group or 0,
        eden_first_kind=_eden_first_kind(spec),
    )
    return replace(ctx, entry=_rowwise_entry(ctx))


def _mapping_note(mapping: Mapping, rht_size: int) -> str:
    """The generated docstring's words for what a unit of the rowwise mapping holds."""
    if mapping.threads_per_block > 1:
        lanes = mapping.threads_per_block
        return f"{lanes} consecutive lanes share a block and combine its amax by butterfly shuffles"
    n = mapping.blocks_per_unit
    note = f"{n} whole block{'s' if n > 1 else ''}"
    if rht_size and mapping.rht_lanes > 1:
        lanes = mapping.rht_lanes
        note += f", 1/{lanes} of an RHT chunk ({lanes} lanes: its butterflies by xor shuffles)"
    elif rht_size:
        chunks = mapping.unit // rht_size
        note += f", {chunks} RHT chunk{'s' if chunks > 1 else ''}"
    return note + ": a thread owns whole blocks"


def _rowwise_params_fields(c: RowwiseContext) -> tuple[tuple[str, str, str], ...]:
    """The fields of the module's ``quantize.RowwiseParams``: the spec's values, spelled with
    the module's constants where it has them; the optional ones only where the spec sets them."""
    rht, g = c.rht, c.common.global_scale
    fields = [
        ("input_dtype", "INPUT_DTYPE", ""),
        ("block", "BLOCK", ""),
        ("elem", "ELEMENT", ""),
        ("scale", "SCALE", ""),
        ("rounding", "ELEM_ROUNDING", ""),
        ("sw_encode", f'"{c.sw_encode}"', "the software element encode"),
        ("swar", str(c.swar), "codes packed and signed word by word"),
        ("sr_bits", "SR_BITS" if c.sr else "0", ""),
        ("rand_words", str(c.rand_fn == RandomSource.WORDS), "the encode takes whole Philox words"),
        ("hw_archs", "ELEM_HW_CVT_ARCHS", ""),
        ("global_scale", "GLOBAL_SCALE", ""),
        ("global_num", "GLOBAL_NUM" if g else "1.0", ""),
        ("swizzled", "SCALES_SWIZZLED", ""),
        ("rht_size", "RHT_SIZE" if rht else "0", ""),
        ("rht_signs", "RHT_SIGNS" if rht else "()", ""),
        ("rht_scale", "RHT_SCALE" if rht else "1.0", ""),
        ("unit", "UNIT", ""),
        ("blocks_per_unit", "BLOCKS_PER_UNIT", ""),
        ("threads_per_block", "THREADS_PER_BLOCK", ""),
        ("store_bytes", str(c.store_bytes), ""),
        ("store_n", "STORE_N", ""),
        ("quant_threads", "QUANT_THREADS", ""),
        ("quant_units", "QUANT_UNITS", ""),
        ("amax_threads", "AMAX_THREADS" if g else str(c.amax_threads), ""),
        ("amax_units", "AMAX_UNITS" if g else str(c.map.amax_units), ""),
    ]
    if c.target_invs:
        fields.append(("target_invs", "BLOCK_TARGET_INVS", ""))
        if c.target_mae:
            fields.append(("target_mae", "True", ""))
    if c.scale_sr:
        fields.append(("scale_sr", "True", "stochastic block scales: a Philox word per block"))
    if rht and rht.runtime:
        fields.append(("rht_runtime_signs", "True", "the RHT's signs are the kernels' arguments"))
    if c.global_rows:
        fields.append(("global_rows", "GLOBAL_ROWS", ""))
    if c.map.rht_lanes > 1:
        fields.append(("rht_lanes", str(c.map.rht_lanes), "an RHT chunk over this many lanes"))
    if c.eden_group:
        fields.append(("eden_group", "EDEN_GROUP", ""))
        if c.eden_first_kind:
            note = "the codes' scale: rounded to nearest"
            fields.append(("eden_first_kind", f'"{c.eden_first_kind}"', note))
    return tuple(fields)


def _rowwise_entry(c: RowwiseContext) -> RowwiseEntry:
    """The rowwise module's kernel entries: the quantize kernel's ``__call__`` takes the input,
    the codes, the scales (and their swizzled copy), the global amax and S_dec, the Philox
    scalars and the RHT's sign words the spec has, then the stream, and hands them to ``launch``
    with None for what the spec lacks; ``kernel`` takes the launch's tensors (the swizzled copy
    with the blocks per row and their 4-groups) and scalars, then the unit count, for ``body``."""
    runtime_signs = c.rht is not None and c.rht.runtime
    scale_note = " (fp32 values)" if c.common.scale.kind == ScaleKind.FP32 else ""
    tensor = "cute.Tensor"
    call: list[EntryParam] = [
        ("mX", tensor, "(M, K) input"),
        ("mQ", tensor, "(M, K * ELEM_BITS / 8) uint8 packed codes"),
        ("mS", tensor, "(M, K / BLOCK) scale codes" + scale_note),
    ]
    kernel: list[EntryParam] = [("gX", tensor, ""), ("gQ", tensor, ""), ("gS", tensor, "")]
    if c.swizzled:
        call.append(("mSwz", tensor, "(bytes,) uint8 swizzled scale codes, zero-initialised"))
        kernel += [("gSwz", tensor, ""), ("nbk", "Int32", ""), ("c4", "Int32", "")]
    if c.common.global_scale:
        call.append(("mAmax", tensor, "(1,) fp32 global amax"))
        call.append(("mSdec", tensor, "(1,) fp32 out: S_dec"))
        kernel.append(("mAmax", tensor, ""))
    else:
        sdec_note = "(1,) fp32 S_dec, 1.0 from launches(): NaN for a non-finite input"
        call.append(("mSdec", tensor, sdec_note))
    kernel.append(("mSdec", tensor, ""))
    scalars = (PHILOX_ARGS if c.philox else ()) + (SIGN_ARGS if runtime_signs else ())
    call += [(a, "Int32", _ARG_NOTES.get(a, "")) for a in scalars]
    kernel += [(a, "Int32", "") for a in scalars]
    call.append(("stream", "cuda.CUstream", ""))
    kernel.append(("num_units", "Int32", ""))
    philox = "philox" if c.philox else "None"
    signs = (f"signs=({', '.join(SIGN_ARGS)})",) if runtime_signs else ()
    swizzled = ("mSwz",) if c.swizzled else ("None",)
    amax = "mAmax" if c.common.global_scale else "None"
    launch = ("mX", "mQ", "mS", *swizzled, amax, "mSdec", philox, "stream", *signs)
    swizzled = ("gSwz", "nbk", "c4") if c.swizzled else ("None", "None", "None")
    body = ("gX", "gQ", "gS", *swizzled, amax, "mSdec", philox, "num_units", *signs)
    return RowwiseEntry(
        params_fields=_rowwise_params_fields(c),
        amax_base="RowwiseAmaxSignsKernel" if runtime_signs else "RowwiseAmaxKernel",
        call_params=tuple(call),
        launch_args=launch,
        kernel_params=tuple(kernel),
        body_args=body,
        philox_args=PHILOX_ARGS if c.philox else (),
    )


def _eden_mapping(spec: QuantKernelSpec, mapping: Mapping) -> Mapping:
    """The thread mapping with the MS-EDEN group (docs/numerics.md 11.3): K a multiple of the
    group (so a group never crosses a row), the group whole blocks of a power-of-two length (its
    tree the blocks' trees) spread over at most a warp's aligned lanes."""
    group = spec.eden_group
    if group is None:
        return mapping
    block = spec.block[1]
    if not _is_pow2(block) or not _is_pow2(group) or group % block:
        raise NotImplementedError(
            f"{spec.name}: MS-EDEN over {group} values with 1x{block} blocks: the kernels take "
            "power-of-two blocks and groups"
        )
    if group > 32 * mapping.unit:
        raise NotImplementedError(
            f"{spec.name}: an MS-EDEN group of {group} values spans more than a warp's units "
            f"({mapping.unit} values each)"
        )
    if spec.scale.rounding == "ocp":
        raise NotImplementedError(f"{spec.name}: MS-EDEN with the ocp scale rounding")
    return replace(mapping, k_multiple=math.lcm(mapping.k_multiple, group))


def _eden_first_kind(spec: QuantKernelSpec) -> str:
    """With MS-EDEN and stochastic block scales the codes take the nearest scale: its
    ScaleKind (e4m3's is the hardware convert); "" otherwise."""
    if spec.eden_group is None or spec.scale.rounding != "stochastic":
        return ""
    nearest = replace(spec, scale=replace(spec.scale, rounding="nearest"), eden_group=None)
    return str(_scale_context(nearest).kind)


# ----------------------------------------------------------------------------------------------
# Tile kernels: a columnwise output, rowwise + columnwise in one launch, 2D blocks
# ----------------------------------------------------------------------------------------------
TILE_WARPS = 4  # warps per CTA
MAX_STRIP = 32  # rows of a thread's column strip
MAX_TILE_VALUES = 128  # input values a thread holds (ROWS x VEC), 2D tiles
MAX_TILE_VALUES_1D = 128  # the same for 1D blocks


@dataclass(frozen=True)
class TileMapping:
    """How threads cover [M, K] in the tile kernels (see the generated module's docstring).

    A thread holds a strip of ``rows`` x ``vec`` elements (one vector load per row). Lanes of a
    warp are ``lanes_k`` along K (fastest) x ``lanes_m`` along M; warps are ``warps_k`` along K
    x ``warps_m`` along M. A row block (1D) or tile (2D) spans ``row_lanes`` lanes along K; a
    column block (1D) or tile (2D) spans ``col_lanes`` lanes along M and ``col_warps`` warps
    along M (more than one: the amax is combined through shared memory).
    """

    rows: int
    vec: int
    lanes_k: int
    lanes_m: int
    warps_k: int
    warps_m: int
    row_lanes: int
    row_blocks: int  # whole row blocks in a thread's row segment (1D)
    col_lanes: int
    col_warps: int
    col_blocks: int  # whole column blocks in a thread's column strip (1D)
    k_multiple: int
    m_multiple: int

    @property
    def threads(self) -> int:
        return 32 * self.warps_k * self.warps_m

    @property
    def tile_k(self) -> int:
        return self.vec * self.lanes_k * self.warps_k

    @property
    def tile_m(self) -> int:
        return self.rows * self.lanes_m * self.warps_m


def _share(span: int, b: int) -> tuple[int, int]:
    """(threads that share one block, blocks per thread) when each thread holds ``span`` values
    along a direction with blocks of ``b``: one of the two is 1."""
    return (1, span // b) if span >= b else (b // span, 1)


def choose_tile_mapping(
    block: tuple[int, int],
    in_bytes: int,
    *,
    rowwise: bool,
    columnwise: bool,
    col_rht: int | None = None,
    col_call: int = 4,
) -> TileMapping:
    """Thread mapping of a tile kernel: 1xB blocks (B a power of two >= 8) with a rowwise and/or
    a columnwise output (a column RHT of size d runs inside one thread's strip), or BxB tiles.
    ``col_call``: elements per Philox call of the columnwise copy's stochastic rounding (a strip's
    fields must start on a call or inside one: docs/numerics.md 5)."""
    two_d = block[0] != 1
    b = block[1]
    if not _is_pow2(b) or b < 8 or (two_d and block[0] != b):
        raise NotImplementedError(
            f"{block[0]}x{block[1]} blocks: the tile kernels take 1xB and BxB blocks with B a "
            "power of two >= 8"
        )
    d = col_rht or 1
    if two_d:
        rows = min(b, MAX_STRIP)
        if b > MAX_STRIP:
            # a tile spans several strips anyway (FP8's 128x128): strips short enough that a
            # thread's rows are whole 16-byte loads (bf16: 16 rows x 8 columns, not 32 x 4)
            rows = max(MAX_TILE_VALUES * in_bytes // 16, 16)
    else:
        base = math.lcm(b, d) if columnwise else b
        if d > MAX_STRIP:
            raise NotImplementedError(
                f"a column RHT of size {d}: a thread's strip holds at most {MAX_STRIP} rows "
                "(cross-thread butterflies are not generated yet)"
            )
        rows = base if base <= MAX_STRIP else MAX_STRIP
        load_rows = max(MAX_TILE_VALUES_1D * in_bytes // 16, 16)
        if base > load_rows and d == 1:
            # without a column RHT a column block may span strips (FP8's 1x128, MX's 1x32):
            # strips short enough that a thread's rows are whole 16-byte loads (for bf16, 16 rows
            # x 8 columns instead of 32 x 4: half the load instructions and of the row-amax
            # shuffles per value; MXFP8's row + col kernel 0.51 -> 0.73x copy on the H200)
            rows = load_rows
        rows = max(rows, 16)
    values = MAX_TILE_VALUES if two_d else MAX_TILE_VALUES_1D
    vec = max(4, min(16 // in_bytes, values // rows))
    # along K: lanes that share a row block (1D) or a tile (2D)
    row_lanes, row_blocks = _share(vec, b) if two_d or rowwise else (1, 1)
    if row_lanes > 32:
        raise NotImplementedError(f"1x{b} blocks: a row block would span {row_lanes} lanes")
    lanes_k = max(row_lanes, 8)
    lanes_m = 32 // lanes_k
    # along M: strips that share a column block (1D) or a tile (2D)
    total, col_blocks = _share(rows, b) if two_d or columnwise else (1, 1)
    col_lanes = min(total, lanes_m)
    col_warps = total // col_lanes
    if col_warps > TILE_WARPS:
        raise NotImplementedError(f"{block[0]}x{block[1]} blocks span more than one CTA")
    if col_warps > 1 and d > 1:
        raise NotImplementedError(
            "a column RHT with column blocks spanning several warps is not generated yet"
        )
    warps_m = max(col_warps, 2)
    warps_k = TILE_WARPS // warps_m
    k_multiple = math.lcm(vec, b) if (two_d or rowwise) else vec
    m_multiple = math.lcm(8, d, min(rows, col_call)) if columnwise else 1
    return TileMapping(
        rows=rows,
        vec=vec,
        lanes_k=lanes_k,
        lanes_m=lanes_m,
        warps_k=warps_k,
        warps_m=warps_m,
        row_lanes=row_lanes,
        row_blocks=row_blocks,
        col_lanes=col_lanes,
        col_warps=col_warps,
        col_blocks=col_blocks,
        k_multiple=k_multiple,
        m_multiple=m_multiple,
    )


def spec_tile_mapping(spec: QuantKernelSpec) -> TileMapping:
    """The tile mapping of a spec's kernel."""
    outs = {o.direction: o for o in spec.outputs}
    row, col = outs.get("rowwise"), outs.get("columnwise")
    one_d = spec.block[0] == 1
    return choose_tile_mapping(
        spec.block,
        DTYPES[spec.input_dtype].size,
        rowwise=row is not None,
        columnwise=col is not None,
        col_rht=col.rht.size if col is not None and col.rht is not None else None,
        # 2D: the columnwise codes reuse the rowwise draws (no column stream)
        col_call=4 * 32 // (sr_bits(col.rounding) or 32) if col is not None and one_d else 4,
    )


def _store_bytes(*sizes: int) -> int:
    """The widest store word (4, 2 or 1 bytes) dividing every size."""
    g = math.gcd(*sizes)
    return 4 if g % 4 == 0 else 2 if g % 2 == 0 else 1


def tile_options_refusal(block: tuple[int, int], in_bytes: int) -> str | None:
    """Why the tile kernel does not implement block targets and stochastic block scales
    (docs/numerics.md 11.1-11.2) for ``block``, or None: it does for 2D BxB tiles whose rows a
    thread's strip holds (B <= 32: one tile per strip's rows, the tile's lanes along K), not for
    1xB blocks (the rowwise kernel's) nor for tiles across strips or warps (FP8's 128x128)."""
    if block[0] == 1:
        return (
            "block targets and stochastic block scales (docs/numerics.md 11.1-11.2) are "
            "implemented by the rowwise kernel only"
        )
    try:
        mapping = choose_tile_mapping(block, in_bytes, rowwise=True, columnwise=True)
    except NotImplementedError as err:
        return str(err)
    if mapping.col_lanes != 1 or mapping.col_warps != 1:
        return (
            f"block targets and stochastic block scales on {block[0]}x{block[1]} tiles: the "
            "tile kernel implements them where one strip holds a tile's rows (tiles up to 32x32)"
        )
    return None


def fp32_targets_refusal(targets: tuple, scale: Any) -> str | None:
    """Why the tile kernel does not choose among block targets with fp32 block scales (its
    choice of target keeps coded scales only: compiled, the fp32 choice met a type error), or
    None. Such 2D operands are quantized by the reference."""
    if targets and scale.element is None:
        return (
            "block targets with fp32 block scales on 2D tiles are not in the tile kernel (it "
            "keeps the chosen scale as a code)"
        )
    return None


def _check_tile(spec: QuantKernelSpec) -> None:
    if not spec.element.signed:
        raise ValueError(f"{spec.name}: element formats must be signed, got {spec.element.name}")
    if reason := fp32_targets_refusal(spec.targets, spec.scale):
        raise NotImplementedError(f"{spec.name}: {reason}")
    if (spec.targets or spec.scale.rounding == "stochastic") and (
        reason := tile_options_refusal(
            spec.block, DTYPES[spec.input_dtype].size if spec.input_dtype in DTYPES else 4
        )
    ):
        raise NotImplementedError(f"{spec.name}: {reason}")
    if spec.global_rows or spec.eden_group is not None:
        raise NotImplementedError(
            f"{spec.name}: per-row global scales and the MS-EDEN correction (docs/numerics.md "
            "11.3-11.4) are implemented by the rowwise kernel only"
        )
    if any(o.rht is not None and o.rht.redrawn for o in spec.outputs):
        raise NotImplementedError(
            f"{spec.name}: RHT signs drawn per layer or step (docs/numerics.md 12) are "
            "implemented by the rowwise kernel only"
        )
    if spec.input_dtype not in DTYPES:
        raise ValueError(f"{spec.name}: unsupported input dtype {spec.input_dtype!r}")
    for out in spec.outputs:
        if out.scale_layout == "swizzled" and spec.scale.element is None:
            raise ValueError(f"{spec.name}: fp32 block scales have no tensor-core swizzled layout")
    if spec.block[0] != 1:
        if spec.block[0] != spec.block[1]:
            raise NotImplementedError(f"{spec.name}: 2D blocks must be square")
        if any(o.rht is not None for o in spec.outputs):
            raise NotImplementedError(
                f"{spec.name}: an RHT with 2D blocks (the columnwise copy is the transpose of "
                "the same codes, which an RHT along rows does not give)"
            )
        if len({o.rounding for o in spec.outputs}) > 1:
            raise NotImplementedError(
                f"{spec.name}: with 2D blocks both copies are one set of codes, so they must "
                "round alike"
            )
    for out in spec.outputs:
        if out.direction == "rowwise" and out.rht is not None:
            raise NotImplementedError(
                f"{spec.name}: a rowwise RHT in a kernel with a columnwise output (the tile "
                "kernels transform columns only)"
            )
        if out.rht is not None and not _is_pow2(out.rht.size):
            raise NotImplementedError(f"{spec.name}: RHT size {out.rht.size} is not supported")
    if reason := tile_bytes_reason(spec):
        raise NotImplementedError(f"{spec.name}: {reason}")


def tile_bytes_reason(spec: QuantKernelSpec) -> str | None:
    """Why the tile kernel cannot store the codes of ``spec``, or None: each thread stores the
    codes of its strip's row segments (``vec`` values along K: rowwise copies and 2D tiles) and
    of its column segments (``rows`` values along M: columnwise copies) at byte addresses, so
    each segment must be whole bytes. With fp32 inputs a strip is 4 values wide, so elements of
    3, 5 or 7 bits (e2m0, e2m2, e3m3, ...) would start every other segment inside a byte."""
    mapping = spec_tile_mapping(spec)
    bits = spec.element.bits
    directions = {o.direction for o in spec.outputs}
    if ("rowwise" in directions or spec.block[0] != 1) and mapping.vec * bits % 8:
        return (
            f"a thread's {mapping.vec} codes of {bits} bits along K are not whole bytes "
            f"({spec.input_dtype} inputs: {mapping.vec}-value loads)"
        )
    if "columnwise" in directions and mapping.rows * bits % 8:
        return f"a thread's {mapping.rows} codes of {bits} bits along M are not whole bytes"
    return None


@dataclass(frozen=True)
class TileOutput:
    """One copy a tile kernel writes."""

    direction: Direction
    tag: str  # "row" / "col": the copy's names in the module (ROW_ROUNDING, mSdec_col, ...)
    rounding: Rounding
    sw_encode: SwEncode  # the software encode of its rounding
    hw_archs: tuple[str, ...]  # arches whose hardware convert gives this copy's codes
    rht: RHTContext | None
    swizzled: bool  # scales also in the swizzled 128x4 layout
    slot: int  # its amax slot: one per distinct transform (none / a column RHT)
    sr: bool  # stochastic rounding
    sr_bits: int  # random bits per value, 0 for a deterministic rounding
    sr_index: int  # its Philox offset among the kernel's stochastic copies
    rand_fn: RandomSource


@dataclass(frozen=True)
class StoreWords:
    """How a thread stores one segment of packed codes: ``n`` words of ``bytes`` bytes."""

    bytes: int
    type: str  # the CuTe type of a word
    n: int


@dataclass(frozen=True)
class RowStore(StoreWords):
    unit_bytes: int  # bytes of a row segment's codes (VEC values)


@dataclass(frozen=True)
class ColStore(StoreWords):
    strip_bytes: int  # bytes of a column strip's codes (ROWS values)


@dataclass(frozen=True)
class TileContext(TemplateContext):
    """The variables of quantize_tile.py.j2: a columnwise copy, rowwise + columnwise copies in
    one launch, or 2D tiles."""

    common: QuantCommon = inline()
    block: int  # B of the 1xB blocks or BxB tiles
    two_d: bool  # BxB tiles: one scale per tile, the columnwise copy its transpose
    map: TileMapping
    outputs: tuple[TileOutput, ...]  # in the spec's order
    row: TileOutput | None
    # lanes whose row segments make up one Philox call: they share its computation
    row_share: int
    col: TileOutput | None
    col_rht: RHTContext | None  # the columnwise copy's RHT along M
    slots: int  # amax slots: one per distinct transform
    sr: bool  # some copy rounds stochastically
    swar: bool  # whole codes per 32-bit word (4- and 8-bit)
    partial: bool  # a row segment or column strip holds part of a code word
    row_store: RowStore
    col_store: ColStore
    transpose: bool  # 2D: the columnwise codes are the transpose of the rowwise code words
    # 1D with e4m3 scales: e_b of each of the 256 scale codes once per CTA (shared memory), not
    # a division per block
    encode_table: bool
    # the fused gradient layout: the strip also staged in shared memory, the column copy from
    # the registers, the row copy from shared memory
    staged: bool
    # the amax kernel's last CTA prepares S_dec, k_enc and the encode-factor tables once
    prep: bool
    grid_2d: bool  # a (tiles along K, tiles along M) grid, one row clamp per strip
    fold: tuple[str, ...]  # tags of the copies whose encode-factor table folds ELEM_TO_F16 in
    fold_sdec_max: str | None  # literal of the largest S_dec the fold is exact for
    # the block options of docs/numerics.md 11.1-11.2 on 2D tiles: fp32(1 / T) per target T
    # (() without targets), whether their error is |d| (mae), stochastic tile scales
    target_invs: tuple[float, ...]
    target_mae: bool
    scale_sr: bool
    kernel_imports: str  # the import of the fp4gen.kernels modules the module calls
    # the kernels' arguments: the quantize kernel's tensors after x (name, what it holds) and
    # Philox scalars; the amax kernel's tensors after x (name, what it holds)
    quant_tensors: tuple[tuple[str, str], ...]
    sr_args: tuple[str, ...]
    amax_tensors: tuple[tuple[str, str], ...]


def _row_share(row: TileOutput | None, mapping: TileMapping, two_d: bool) -> int:
    """How many lanes' row segments (VEC values each) one Philox call covers, when more than one
    (1D tile kernels with 8- or 16-bit random fields; K a multiple of the call's values, so that
    no call spans two rows): each of them computes one row's call."""
    if row is None or two_d or not row.sr:
        return 1
    per_call = 4 * (32 // row.sr_bits)
    if per_call <= mapping.vec or mapping.k_multiple % per_call:
        return 1
    return per_call // mapping.vec


def tile_context(spec: QuantKernelSpec) -> TileContext:
    """Everything the tile template needs, all derived from the spec."""
    _check_tile(spec)
    # the device helpers and their inline PTX are fp4gen.kernels': the module has none of its own
    common = replace(_common_context(spec), uses_asm=False)
    two_d = spec.block[0] != 1
    block = spec.block[1]
    outs = {o.direction: o for o in spec.outputs}
    row, col = outs.get("rowwise"), outs.get("columnwise")
    col_rht = col.rht if col is not None else None
    mapping = spec_tile_mapping(spec)
    bits = spec.element.bits
    roundings = list(dict.fromkeys(o.rounding for o in spec.outputs))
    swar = 32 % bits == 0
    partial = swar and (
        ((row is not None or two_d) and mapping.vec % (32 // bits))
        or (col is not None and mapping.rows % (32 // bits))
    )
    # 2D: the columnwise codes are the transpose of the rowwise ones (4- and 8-bit codes with
    # one word per row segment); otherwise they are encoded again per column
    transpose = (
        two_d
        and col is not None
        and bits in (4, 8)
        and mapping.vec == 32 // bits
        and mapping.rows % (32 // bits) == 0
    )
    whole_words = swar and not partial and (transpose or not two_d)
    sw_encode_of = {
        r: _sw_encode(spec.element, r, tile=True, whole_words=whole_words) for r in roundings
    }
    # amax slots: one per distinct transform (no RHT / a column RHT)
    slots: list[RHTSpec | None] = []
    outputs: list[TileOutput] = []
    sr_index = 0
    # stochastic tile scales (docs/numerics.md 11.2): every copy takes a Philox offset, the
    # first copy's stream gives the tiles' words
    scale_sr = two_d and spec.scale.rounding == "stochastic"
    for out in spec.outputs:
        transform = out.rht if out.direction == "columnwise" else None
        if transform not in slots:
            slots.append(transform)
        sw_encode = sw_encode_of[out.rounding]
        sr = is_stochastic(out.rounding)
        outputs.append(
            TileOutput(
                direction=Direction(out.direction),
                tag="row" if out.direction == "rowwise" else "col",
                rounding=Rounding(out.rounding),
                sw_encode=sw_encode,
                hw_archs=common.elem.hw_archs if out.rounding == "nearest" else (),
                rht=_rht_context(out.rht) if out.rht is not None else None,
                swizzled=out.scale_layout == "swizzled",
                slot=slots.index(transform),
                sr=sr,
                sr_bits=sr_bits(out.rounding),
                sr_index=sr_index,
                rand_fn=_random_source(sw_encode),
            )
        )
        if sr or scale_sr:
            sr_index += 1
    out_by = {o.direction: o for o in outputs}
    # stores: a row segment of VEC codes; a column strip of ROWS codes
    k_mult, m_mult = mapping.k_multiple, mapping.m_multiple
    row_bytes = mapping.vec * bits // 8
    row_word = _store_bytes(row_bytes, k_mult * bits // 8)
    col_bytes = mapping.rows * bits // 8
    col_word = _store_bytes(col_bytes, max(m_mult * bits // 8, 1)) if col else 1
    sr_any = any(o.sr for o in outputs) or scale_sr
    bf16_input = spec.input_dtype == "bf16"
    swizzled = any(o.swizzled for o in outputs)
    encode_table = not two_d and common.scale.kind == ScaleKind.E4M3_HW
    # Copies whose fp16-image encode can take ELEM_TO_F16 folded into their encode-factor
    # table (one multiply per value fewer); exact while every entry stays a normal fp32, which
    # S_dec <= FOLD_SDEC_MAX guarantees (the kernel checks it and otherwise takes an unfolded path)
    fold = tuple(
        o.tag
        for o in outputs
        if encode_table and spec.global_scale and o.sw_encode == SwEncode.SRHALF
    )
    # The fused gradient layout: the strip also staged in shared memory, the column copy from
    # the registers (unrolled, no rotation), the row copy from shared memory (a rolled loop).
    # Only this layout emits the folded encodes, so the fold goes with it
    staged = bool(
        fold
        and row is not None
        and col is not None
        and bf16_input
        and mapping.col_warps == 1
        and not swizzled
    )
    # The amax kernel's last CTA prepares S_dec, k_enc and the encode-factor tables once, where
    # every CTA of the quantize kernel would otherwise compute them (about 100 instructions per
    # thread: two div.rn + rcp.rn pairs, two table entries per copy)
    prep = encode_table and spec.global_scale
    entries = _tile_entries(outputs, len(slots), prep, spec.global_scale, sr_index)
    return TileContext(
        common=common,
        block=block,
        two_d=two_d,
        map=mapping,
        outputs=tuple(outputs),
        row=out_by.get(Direction.ROWWISE),
        row_share=_row_share(out_by.get(Direction.ROWWISE), mapping, two_d),
        col=out_by.get(Direction.COLUMNWISE),
        col_rht=_rht_context(col_rht) if col_rht is not None else None,
        slots=len(slots),
        sr=sr_any,
        swar=swar,
        partial=bool(partial),
        row_store=RowStore(row_word, _STORE_TYPES[row_word], row_bytes // row_word, row_bytes),
        col_store=ColStore(col_word, _STORE_TYPES[col_word], col_bytes // col_word, col_bytes),
        transpose=transpose,
        encode_table=encode_table,
        staged=staged,
        prep=prep,
        # The same kernels take a (tiles along K, tiles along M) grid and load a strip with one
        # row clamp (no integer division, fewer address instructions). Not the other layouts:
        # the 2D weight kernel, measured, went from 161 to 254 registers without the division
        # and lost 5%
        grid_2d=prep,
        fold=fold if staged else (),
        fold_sdec_max=lit(2.0 ** _fold_sdec_exponent(spec)) if staged else None,
        target_invs=tuple(_f32_div(1.0, t) for t in spec.targets) if two_d else (),
        target_mae=two_d and bool(spec.targets) and spec.target_error == "mae",
        scale_sr=scale_sr,
        kernel_imports=(
            "from fp4gen.kernels import encode, host, quantize_tile, quantize_tile_host, "
            "scale, tile"
        ),
        **entries,
    )


def _tile_entries(
    outputs: list[TileOutput], slots: int, prep: bool, global_scale: bool, n_sr: int
) -> dict[str, tuple]:
    """The arguments the tile module's kernel entries spell, in the kernels' parameter order:
    the quantize kernel's tensors after x (each copy's codes, scales and swizzled scales, then
    the prepared constants, or the global amaxes and each S_dec, or each S_dec) and Philox
    scalars; the amax kernel's tensors after x (the global amaxes, then with ``prep`` the CTA
    counter, the constants and each S_dec)."""
    quant: list[tuple[str, str]] = []
    for o in outputs:
        sfx = "" if o.tag == "row" else "c"
        codes = "(M, K * ELEM_BITS / 8)" if o.tag == "row" else "(K, M * ELEM_BITS / 8)"
        quant.append((f"mQ{sfx}", f"{codes} uint8 packed codes"))
        quant.append((f"mS{sfx}", "scale codes (fp32 values for fp32 scales)"))
        if o.swizzled:
            quant.append((f"mSwz{sfx}", "(bytes,) uint8 swizzled scale codes, zero-initialised"))
    sdecs = tuple(f"mSdec_{o.tag}" for o in outputs)
    amaxes = tuple(f"mAmax{s}" for s in range(slots)) if global_scale else ()
    if prep:
        quant.append(("mConst", "fp32: the amax kernel's prepared constants"))
    else:
        quant += [(a, "(1,) fp32 global amax of a slot") for a in amaxes]
        sdec_note = "S_dec out" if global_scale else "S_dec: 1.0, NaN if non-finite"
        quant += [(s, f"(1,) fp32 {sdec_note}") for s in sdecs]
    sr_args: tuple[str, ...] = ()
    if n_sr:
        offsets = tuple(f"offset{i}_{w}" for i in range(n_sr) for w in ("lo", "hi"))
        sr_args = ("seed_lo", "seed_hi", *offsets, "ctr_lo", "ctr_hi", "stride_lo", "stride_hi")
    amax_tensors = [(a, "(1,) fp32 global amax of a slot, zeroed") for a in amaxes]
    if prep:
        amax_tensors += [
            ("mCount", "(1,) int32, zero-initialised: CTAs done"),
            ("mConst", "fp32 out: the prepared constants (tables, k_enc, S_dec)"),
        ]
        amax_tensors += [(s, "(1,) fp32 out: S_dec of a copy") for s in sdecs]
    return {
        "quant_tensors": tuple(quant),
        "sr_args": sr_args,
        "amax_tensors": tuple(amax_tensors),
    }


def _fold_sdec_exponent(spec: QuantKernelSpec) -> int:
    """The largest n such that S_dec <= 2^n keeps every folded table entry e_b * ELEM_TO_F16 a
    normal fp32: e_b = 1 / (s_b * S_dec) >= 1 / (SCALE_MAX * 2^n) > 2^-(ceil(log2 SCALE_MAX) + n)
    and ELEM_TO_F16 = 2^(-14 - emin), so n = 126 - 14 - emin - ceil(log2 SCALE_MAX) - 1 (one
    binade of margin for the rounding of s_b * S_dec and of its reciprocal)."""
    assert spec.scale.element is not None
    scale_max = max_finite(spec.scale.element)
    emin = 1 - spec.element.bias
    return 126 - 14 - emin - math.ceil(math.log2(scale_max)) - 1


def render(spec: QuantKernelSpec) -> str:
    """The generated CuTe DSL module (Python source) of ``spec``'s quantize kernels: the rowwise
    template for one rowwise output with 1xN blocks, the tile template otherwise (a columnwise
    output, rowwise + columnwise in one launch, 2D blocks).

    Raises NotImplementedError for block/RHT shapes the thread mappings do not cover.
    """
    if is_rowwise(spec):
        return render_template("quantize.py.j2", context(spec))
    return render_template("quantize_tile.py.j2", tile_context(spec))


__all__ = [
    "ARCHS",
    "ElementContext",
    "HalfImage",
    "InputContext",
    "Mapping",
    "QuantCommon",
    "RHTContext",
    "RandomSource",
    "RowwiseContext",
    "RowwiseEntry",
    "ScaleContext",
    "ScaleKind",
    "SwEncode",
    "TileContext",
    "TileMapping",
    "TileOutput",
    "choose_mapping",
    "choose_tile_mapping",
    "context",
    "is_rowwise",
    "render",
    "tile_context",
    "tile_options_refusal",
]
