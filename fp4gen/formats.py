"""Number formats: minifloat elements, block scales and block-scaled tensor formats.

Everything here is a plain description computed from a handful of parameters (exponent bits,
mantissa bits, sign, special-value convention). The reference numerics and the code generator
derive every constant they need (bias, max finite, grids, thresholds) from these objects, so a new
format in a recipe needs no new code.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, replace
from functools import cache, cached_property
from typing import Literal

from fp4gen import vocab
from fp4gen.errors import ArgumentError

FLT_MAX = 3.4028234663852886e38  # the largest finite float32
FLT_MIN_NORMAL = 2.0**-126  # the smallest normal float32

# How the all-ones exponent field is used.
#   "finite": every code is a finite number (e2m1, e2m3, e3m2 and custom formats by default).
#   "fn":     only S.1..1.1..1 is NaN, no infinities (e4m3fn).
#   "ieee":   exponent all ones means Inf (mantissa 0) or NaN (e5m2).
Special = Literal["finite", "fn", "ieee"]
SPECIALS: tuple[str, ...] = ("finite", "fn", "ieee")

# The words of fp4gen.vocab.ScaleRounding and vocab.Rounding; the Literal types spell them again
# for type checkers (tests/test_layers.py checks that they agree).
ScaleRounding = Literal["nearest", "up", "down", "ocp", "stochastic"]
SCALE_ROUNDINGS: tuple[str, ...] = vocab.words(vocab.ScaleRounding)

ElementRounding = Literal["nearest", "stochastic", "stochastic16", "stochastic8", "zero"]
ELEMENT_ROUNDINGS: tuple[str, ...] = vocab.words(vocab.Rounding)

# Random bits a stochastic rounding draws per value: "stochastic" a whole 32-bit Philox word,
# "stochastic8" one byte (a word per four values: the budget of Blackwell's cvt.rs...e2m1x4).
_SR_BITS: dict[str, int] = {
    vocab.Rounding.STOCHASTIC.value: 32,
    vocab.Rounding.STOCHASTIC16.value: 16,
    vocab.Rounding.STOCHASTIC8.value: 8,
}


def sr_bits(rounding: str) -> int:
    """Random bits per value of an element rounding: 32, 16 or 8 for the stochastic modes, 0
    for the deterministic ones."""
    return _SR_BITS.get(rounding, 0)


def is_stochastic(rounding: str) -> bool:
    return rounding in _SR_BITS


HIGH_PRECISION_DTYPES: tuple[str, ...] = tuple(vocab.DTYPES)

# How Four Over Six compares a block's candidates (docs/numerics.md 11.1).
TargetError = Literal["mse", "mae"]
TARGET_ERRORS: tuple[str, ...] = ("mse", "mae")
MAX_TARGETS = 8  # candidates per block: each is one more quantization of the block
MAX_EDEN_GROUP = 4096  # elements of an MS-EDEN group along a row  # "bf16", "fp16", "fp32"

_ELEMENT_NAME = re.compile(r"^(u?)e(\d+)m(\d+)$")


@dataclass(frozen=True)
class ElementFormat:
    """A minifloat: optional sign bit, ``exp_bits`` exponent bits, ``man_bits`` mantissa bits.

    Signed formats have subnormals when the exponent field is 0. Unsigned formats must be
    exponent-only (UExM0, like ue8m0): every code is the power of two 2^(E - bias), there is no
    zero, and the all-ones code is NaN.
    """

    exp_bits: int
    man_bits: int
    signed: bool = True
    special: Special = "finite"

    def __post_init__(self) -> None:
        if self.exp_bits < 1:
            raise ValueError(f"{self.name}: a minifloat needs at least one exponent bit")
        if self.man_bits < 0:
            raise ValueError(f"{self.name}: negative mantissa width")
        if self.signed and not 3 <= self.bits <= 8:
            raise ValueError(f"{self.name}: element formats are 3 to 8 bits wide, got {self.bits}")
        if not self.signed:
            if self.man_bits != 0:
                raise ValueError(f"{self.name}: unsigned formats must be exponent-only (UExM0)")
            if not 2 <= self.exp_bits <= 8:
                raise ValueError(f"{self.name}: UExM0 scales have 2 to 8 exponent bits")
        if self.special not in SPECIALS:
            raise ValueError(f"{self.name}: special must be one of {SPECIALS}")
        if self.special == "ieee" and self.man_bits == 0:
            raise ValueError(f"{self.name}: the ieee convention needs a mantissa for NaN")

    # --- naming -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        base = f"{'' if self.signed else 'u'}e{self.exp_bits}m{self.man_bits}"
        default = default_special(self.exp_bits, self.man_bits, self.signed)
        return base if self.special == default else f"{base} {self.special}"

    @property
    def torch_name(self) -> str | None:
        """The torch dtype with exactly these semantics, if torch has one."""
        return {
            (4, 3, True, "fn"): "float8_e4m3fn",
            (5, 2, True, "ieee"): "float8_e5m2",
            (8, 0, False, "finite"): "float8_e8m0fnu",
        }.get((self.exp_bits, self.man_bits, self.signed, self.special))

    # --- derived constants --------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return int(self.signed) + self.exp_bits + self.man_bits

    @property
    def bias(self) -> int:
        return (1 << (self.exp_bits - 1)) - 1

    @property
    def exponent_only(self) -> bool:
        return not self.signed

    def value(self, code: int) -> float:
        """The value of one code as a Python float (NaN and +-Inf where the format has them)."""
        if not 0 <= code < (1 << self.bits):
            raise ValueError(f"{self.name}: code {code} is outside 0..{(1 << self.bits) - 1}")
        if self.exponent_only:
            if code == (1 << self.exp_bits) - 1:
                return math.nan
            return math.ldexp(1.0, code - self.bias)
        sign = -1.0 if code >> (self.bits - 1) else 1.0
        mag = code & ((1 << (self.bits - 1)) - 1)
        exp_field = mag >> self.man_bits
        mant = mag & ((1 << self.man_bits) - 1)
        if self.special == "ieee" and exp_field == (1 << self.exp_bits) - 1:
            return sign * math.inf if mant == 0 else math.nan
        if self.special == "fn" and mag == (1 << (self.bits - 1)) - 1:
            return math.nan
        if exp_field == 0:  # subnormal: 0.m * 2^(1 - bias)
            return sign * math.ldexp(mant, 1 - self.bias - self.man_bits)
        return sign * math.ldexp((1 << self.man_bits) + mant, exp_field - self.bias - self.man_bits)

    @cached_property  # the reference reads it per quantize call: decode the codes once
    def max_finite(self) -> float:
        """Largest finite value, found by decoding the positive codes (no special cases)."""
        positive = range(1 << (self.bits if self.exponent_only else self.bits - 1))
        return max(v for v in map(self.value, positive) if math.isfinite(v))

    @property
    def emax(self) -> int:
        """floor(log2(max finite)): OCP MX's emax_elem."""
        return math.frexp(self.max_finite)[1] - 1

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias) if self.signed else 2.0 ** (-self.bias)

    @property
    def min_positive(self) -> float:
        """Smallest positive value: the smallest subnormal (signed) or 2^-bias (exponent-only)."""
        if self.exponent_only:
            return 2.0 ** (-self.bias)
        return 2.0 ** (1 - self.bias - self.man_bits)

    @property
    def has_zero(self) -> bool:
        return self.signed

    @property
    def significand_bits(self) -> int:
        """Bits of precision including the implicit leading one."""
        return self.man_bits + 1


def default_special(exp_bits: int, man_bits: int, signed: bool = True) -> Special:
    """The special-value convention a bare name like ``e4m3`` implies."""
    if not signed:
        return "finite"  # exponent-only: all-ones is NaN by construction, nothing to choose
    if (exp_bits, man_bits) == (4, 3):
        return "fn"
    if (exp_bits, man_bits) == (5, 2):
        return "ieee"
    return "finite"


def parse_element_name(name: str, special: str | None = None) -> ElementFormat:
    """``e2m1`` -> ElementFormat(2, 1); ``ue8m0`` -> exponent-only; raises ValueError otherwise."""
    match = _ELEMENT_NAME.match(name)
    if not match:
        raise ValueError(f"{name!r} is not an element format name of the form eXmY or ueXm0")
    signed = match.group(1) == ""
    exp_bits, man_bits = int(match.group(2)), int(match.group(3))
    chosen = special if special is not None else default_special(exp_bits, man_bits, signed)
    if not signed and special not in (None, "finite"):
        raise ValueError(f"{name}: unsigned exponent-only formats take no special-value option")
    return ElementFormat(exp_bits, man_bits, signed, chosen)  # type: ignore[arg-type]


E2M1 = ElementFormat(2, 1)
E2M3 = ElementFormat(2, 3)
E3M2 = ElementFormat(3, 2)
E4M3 = ElementFormat(4, 3, special="fn")
E5M2 = ElementFormat(5, 2, special="ieee")
UE8M0 = ElementFormat(8, 0, signed=False)


@dataclass(frozen=True)
class ScaleSpec:
    """How a block's decode scale is stored.

    ``element`` is None for a plain fp32 scale. ``rounding`` says how the ideal decode scale
    d = amax * S_enc / max_elem is brought into the scale format:
      nearest: round to nearest, ties to even (NVFP4's e4m3 scales);
      up:      toward +inf (the NVFP4 paper's MX convention, nothing saturates);
      down:    toward zero;
      ocp:     OCP MX v1.0: 2^(floor(log2 amax) - emax_elem); exponent-only scales only;
      stochastic: up or down at random, up with probability (d - lo) / (hi - lo), from a
               32-bit Philox word of the block (docs/numerics.md 11.2).
    """

    element: ElementFormat | None = None
    rounding: ScaleRounding = "nearest"

    def __post_init__(self) -> None:
        if self.rounding not in SCALE_ROUNDINGS:
            raise ValueError(f"scale rounding must be one of {SCALE_ROUNDINGS}")
        if self.rounding == "ocp" and (self.element is None or not self.element.exponent_only):
            raise ValueError("the ocp scale rounding is defined for exponent-only (UExM0) scales")
        if self.rounding == "stochastic" and self.element is None:
            raise ValueError("fp32 scales are stored as computed: stochastic rounding needs a grid")

    @property
    def name(self) -> str:
        return "fp32" if self.element is None else self.element.name

    @property
    def max_value(self) -> float:
        return FLT_MAX if self.element is None else self.element.max_finite


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _f32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


@cache
def scale_cap(element: ElementFormat, scale: ScaleSpec) -> float:
    """The largest decode scale s (on the scale format's grid, or any fp32 for fp32 scales, and
    at most its max finite) with elem_max * s <= FLT_MAX: the saturation point of block scales.

    Without it a block near FLT_MAX whose scale rounds up decodes to +-inf (MXFP4: code 4.0 times
    the scale 2^126 is 2^128). Products are exact in float64: both factors have at most 24
    significant bits.
    """
    elem_max = element.max_finite
    if scale.element is None:
        # FLT_MAX / elem_max rounded to fp32, then one ulp down if that rounding went up
        s = _f32_from_bits(_f32_bits(FLT_MAX / elem_max))
        while elem_max * s > FLT_MAX:
            s = _f32_from_bits(_f32_bits(s) - 1)
        return s
    fmt = scale.element
    n_pos = 1 << (fmt.bits if fmt.exponent_only else fmt.bits - 1)
    grid = (fmt.value(c) for c in range(n_pos))
    return max(v for v in grid if math.isfinite(v) and elem_max * v <= FLT_MAX)


def _power(value: float) -> str:
    """``value`` for a message: 2^k for a large or small power of two (scale maxima often
    are), else 4 digits."""
    mantissa, exponent = math.frexp(value)
    return f"2^{exponent - 1}" if mantissa == 0.5 and abs(exponent - 1) > 10 else f"{value:.4g}"


def grid_values(element: ElementFormat) -> tuple[float, ...]:
    """The finite non-negative values of a format's codes, ascending."""
    n_pos = 1 << (element.bits if element.exponent_only else element.bits - 1)
    return tuple(sorted({v for v in map(element.value, range(n_pos)) if math.isfinite(v)}))


def global_scale_problem(
    element: ElementFormat, scale: ElementFormat | None, bound: float | None = None
) -> str | None:
    """Why a global amax scale cannot pair ``element`` with block scales in ``scale`` (None:
    fp32 scales), or None where it can (docs/numerics.md, section 2.1). ``bound`` (None: the
    scale format's max) is the block scale the tensor's amax is mapped onto (section 11.1): a
    value of the scale format's grid, at most its max; it takes scale_max's place below.

    The global scale maps the tensor's amax A onto P = elem_max * scale_max: S_enc = P / A,
    S_dec = A / P, and the largest block's decode scale lands on scale_max. That holds for
    every finite A > 0, with S_enc, S_dec, every s_b and e_b finite, only when
      1. the scale format's range scale_max / scale_min is at most 2^126, fp32's normal range
         (a wider one, ue8m0, reaches every fp32 exponent itself; with a global scale S_dec
         would be subnormal for any A below 2 * elem_max);
      2. P <= FLT_MAX: otherwise S_enc's numerator is not an fp32 and the largest block's scale
         is cut at the scale cap, far below the scale S_dec was made for (the data saturates);
      3. P >= 2^-126 * FLT_MAX (about 4): otherwise S_enc = P / A is subnormal (or S_dec
         infinite) for amaxes near FLT_MAX.
    P is exact in float64: both maxima have at most 8 significant bits.
    """
    if scale is None:
        return "fp32 block scales hold any fp32 value and need no global scale; write global none"
    elem_max, scale_max, scale_min = element.max_finite, scale.max_finite, scale.min_positive
    wide = scale_max / scale_min > 2.0**126  # condition 1, whatever the bound
    if bound is not None and not wide:
        if bound not in grid_values(scale) or bound <= 0:
            return (
                f"the global bound {bound:g} is not a positive value of the block scale format "
                f"{scale.name} (whose largest is {_power(scale_max)})"
            )
        scale_max = bound
    product = elem_max * scale_max
    pair = f"{element.name} elements with {scale.name} block scales"
    maxima = f"elem_max * scale_max = {_power(elem_max)} * {_power(scale_max)}"
    if wide:
        return (
            f"global amax cannot be used with {pair}: a {scale.name} scale spans "
            f"{_power(scale_min)} to {_power(scale_max)}, fp32's whole exponent range, by "
            "itself, so it needs no global scale, and one would make the decode scale "
            f"S_dec = amax / ({_power(elem_max)} * {_power(scale_max)}) subnormal for every "
            f"amax below {product * FLT_MIN_NORMAL:.4g}; write global none"
        )
    if product > FLT_MAX:
        return (
            f"global amax cannot be used with {pair}: the global encode scale "
            f"elem_max * scale_max / amax needs {maxima} = {_power(product)}, more than "
            "fp32's largest value (just under 2^128); use a scale format with a smaller max, "
            "or write global none"
        )
    if product < FLT_MIN_NORMAL * FLT_MAX:
        return (
            f"global amax cannot be used with {pair}: {maxima} = {_power(product)} is below 4 "
            "(2^-126 times fp32's largest value), so the global encode scale "
            "elem_max * scale_max / amax would be subnormal for amaxes near fp32's largest "
            "value; use a scale format with a larger max, or write global none"
        )
    return None


def target_scale_problem(
    element: ElementFormat, scale: ScaleSpec, bound: float | None, target: float
) -> str | None:
    """Why block target ``target`` cannot be used with a global amax scale (bound ``bound``,
    None: the scale format's max), or None where it can (docs/numerics.md 11.1).

    The global scale maps the tensor's amax A onto P = elem_max * bound, so S_dec = A / P, and a
    target T maps the largest block's amax onto the block scale elem_max * bound / T, which the
    scale rounding may take to the next value of its grid (at most the scale cap). The encode
    factor 1 / (s_b * S_dec) stays finite and non-zero for every A up to fp32's largest value
    only where that scale is at most P: a larger one overflows the product for amaxes near
    FLT_MAX, and the block's codes would all be zero."""
    if scale.element is None:
        return None  # fp32 scales take no global scale (global_scale_problem says so)
    elem_max = element.max_finite
    bound = scale.element.max_finite if bound is None else bound
    product = elem_max * bound
    cap = scale_cap(element, scale)
    wanted = min(elem_max * bound / target, cap)
    largest = min(next((g for g in grid_values(scale.element) if g >= wanted), cap), cap)
    if largest <= product:
        return None
    return (
        f"target {target:g} with a global amax scale: the largest block's scale would be "
        f"{largest:g}, more than elem_max * bound = {elem_max:g} * {bound:g} = {product:g}, so "
        "for amaxes near fp32's largest value the encode factor 1 / (s_b * S_dec) underflows "
        "and that block's codes are all zero; use a larger target, or global none"
    )


def options_problem(fmt: BlockFormat) -> str | None:
    """Why the options of docs/numerics.md 11 (targets, global bound, per-row global scales,
    MS-EDEN, stochastic scales) do not fit the rest of ``fmt``, or None where they do. Each
    message says what the option needs."""
    elem, scale = fmt.element, fmt.scale
    if fmt.targets:
        grid = grid_values(elem)
        shown = " ".join(f"{t:g}" for t in fmt.targets)
        if len(fmt.targets) > MAX_TARGETS:
            return f"targets {shown}: at most {MAX_TARGETS} candidates per block"
        if len(set(fmt.targets)) != len(fmt.targets):
            return f"targets {shown}: a candidate is given twice"
        for t in fmt.targets:
            if t <= 0 or t not in grid:
                return (
                    f"target {t:g} is not a positive value of the element {elem.name} (its "
                    f"values run up to {elem.max_finite:g}: the block's amax is mapped onto one)"
                )
        if scale.rounding == "ocp":
            return (
                "targets need a block scale computed as amax / target; the ocp rounding fixes "
                "it from amax's exponent alone (use round up, nearest, down or stochastic)"
            )
        if fmt.global_scale:
            for t in fmt.targets:
                problem = target_scale_problem(elem, scale, fmt.global_bound, t)
                if problem is not None:
                    return problem
    if fmt.target_error not in TARGET_ERRORS:
        return f"the targets' error must be one of {TARGET_ERRORS}, got {fmt.target_error!r}"
    if fmt.global_bound is not None and not fmt.global_scale:
        return "a global bound belongs to a global amax scale (global amax BOUND)"
    if fmt.global_rows:
        if not fmt.global_scale:
            return "per-row global scales need a global scale (global row)"
        if fmt.is_2d:
            return (
                f"per-row global scales need 1D blocks: a {fmt.block[0]}x{fmt.block[1]} tile "
                "spans several rows, and its columnwise copy (the same codes) would need one "
                "scale per column along the dot product"
            )
    if fmt.eden_group is not None:
        group, bc = fmt.eden_group, fmt.block[1]
        if fmt.is_2d:
            return "the MS-EDEN correction runs along rows: it needs 1D blocks"
        if scale.rounding == "ocp":
            return "the MS-EDEN correction rescales the block scale; ocp rounding fixes it"
        if not 1 <= group <= MAX_EDEN_GROUP or group % bc:
            return (
                f"MS-EDEN group {group}: a multiple of the block length {bc} up to "
                f"{MAX_EDEN_GROUP} (whole blocks share one correction)"
            )
    return None


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: elements, block shape (rows, cols), block scale, global scale.

    ``block`` is (1, N) for 1D blocks along the dot-product dimension and (N, N) for 2D tiles.
    ``global_scale`` adds NVFP4's fp32 per-tensor scale computed from the tensor's amax.

    The 2026 options (docs/numerics.md 11; all off by default):
    ``targets``: candidate values the block's amax is mapped to (Four Over Six: (6.0, 4.0));
    each block keeps the candidate whose decoded values have the lower ``target_error`` ("mse"
    or "mae"), ties to the first; () is the element's max alone.
    ``global_bound``: the block scale value the tensor's amax is mapped to by the global scale
    (None: the scale format's max; Four Over Six uses 256 with e4m3 so a 4-target fits).
    ``global_rows``: one global scale per row (the row's amax) instead of one per tensor.
    ``eden_group``: MS-EDEN correction (Quartet II): per group of this many elements along a
    row, the block scales are multiplied by <x, x> / <x, q> before their final rounding.
    """

    name: str
    element: ElementFormat
    block: tuple[int, int]
    scale: ScaleSpec
    global_scale: bool = False
    targets: tuple[float, ...] = ()
    target_error: TargetError = "mse"
    global_bound: float | None = None
    global_rows: bool = False
    eden_group: int | None = None

    def __post_init__(self) -> None:
        rows, cols = self.block
        if cols < 1 or rows < 1:
            raise ValueError(f"{self.name}: block dimensions must be positive, got {self.block}")
        if rows != 1 and rows != cols:
            raise ValueError(f"{self.name}: blocks are 1xN or NxN, got {rows}x{cols}")
        if self.global_scale:
            # here, not in the parser: formats built in Python meet the same rule
            problem = global_scale_problem(self.element, self.scale.element, self.global_bound)
            if problem is not None:
                raise ArgumentError(f"format {self.name}: {problem}")
        problem = options_problem(self)
        if problem is not None:
            raise ArgumentError(f"format {self.name}: {problem}")

    def __hash__(self) -> int:
        # formats key the per-call kernel and dispatch caches: hash the nested fields once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(
                (
                    self.name,
                    self.element,
                    self.block,
                    self.scale,
                    self.global_scale,
                    self.targets,
                    self.target_error,
                    self.global_bound,
                    self.global_rows,
                    self.eden_group,
                )
            )
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict[str, object]:
        # string hashes differ between processes: an unpickled format hashes afresh
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def is_2d(self) -> bool:
        return self.block[0] > 1

    @property
    def block_targets(self) -> tuple[float, ...]:
        """The values a block's amax is mapped to, in the order tried: ``targets``, or the
        element's max alone."""
        return self.targets or (self.element.max_finite,)

    @property
    def global_max(self) -> float:
        """The block scale the global scale maps the tensor's (or row's) amax onto: the bound,
        or the scale format's max."""
        return self.scale.max_value if self.global_bound is None else self.global_bound

    @property
    def is_plain(self) -> bool:
        """No option of docs/numerics.md 11: what the generated quantize kernels implement."""
        return (
            not self.targets
            and self.global_bound is None
            and not self.global_rows
            and self.eden_group is None
            and self.scale.rounding != "stochastic"
        )

    @property
    def block_len(self) -> int:
        """Elements along the quantization (dot-product) direction."""
        return self.block[1]

    def with_block(self, block: tuple[int, int]) -> BlockFormat:
        return replace(self, block=block)

    @property
    def scale_cap(self) -> float:
        """The largest block decode scale s_b the quantizer produces (docs/numerics.md 2): the
        scale format's max finite, lowered to the largest value of its grid (any fp32 for fp32
        scales) with elem_max * s_b <= FLT_MAX, so that every code decodes to a finite value."""
        return scale_cap(self.element, self.scale)

    def gemm_exact_in_bf16(self) -> bool:
        """Is element x block scale exact in bf16 (8 significand bits)? See numerics contract 8."""
        scale_bits = 24 if self.scale.element is None else self.scale.element.significand_bits
        if self.scale.element is not None and self.scale.element.exponent_only:
            scale_bits = 1
        return self.element.significand_bits + scale_bits <= 8


@dataclass(frozen=True)
class HighPrecision:
    """A tensor kept in a high-precision dtype (bf16, fp16, fp32): no quantization."""

    name: str  # one of HIGH_PRECISION_DTYPES

    def __post_init__(self) -> None:
        if self.name not in HIGH_PRECISION_DTYPES:
            raise ValueError(f"high-precision dtype must be one of {HIGH_PRECISION_DTYPES}")


def _builtin_formats() -> dict[str, BlockFormat | HighPrecision]:
    up = "up"
    formats: dict[str, BlockFormat | HighPrecision] = {
        "nvfp4": BlockFormat("nvfp4", E2M1, (1, 16), ScaleSpec(E4M3, "nearest"), True),
        "mxfp4": BlockFormat("mxfp4", E2M1, (1, 32), ScaleSpec(UE8M0, up)),
        "mxfp6_e2m3": BlockFormat("mxfp6_e2m3", E2M3, (1, 32), ScaleSpec(UE8M0, up)),
        "mxfp6_e3m2": BlockFormat("mxfp6_e3m2", E3M2, (1, 32), ScaleSpec(UE8M0, up)),
        "mxfp8_e4m3": BlockFormat("mxfp8_e4m3", E4M3, (1, 32), ScaleSpec(UE8M0, up)),
        "mxfp8_e5m2": BlockFormat("mxfp8_e5m2", E5M2, (1, 32), ScaleSpec(UE8M0, up)),
    }
    for dtype in HIGH_PRECISION_DTYPES:
        formats[dtype] = HighPrecision(dtype)
    return formats


# Named formats every recipe can use; a recipe may redefine any of them.
BUILTIN_FORMATS: dict[str, BlockFormat | HighPrecision] = _builtin_formats()

Format = BlockFormat | HighPrecision


def decoded_max(fmt: BlockFormat | object) -> float | None:
    """The largest |element x block scale| a global-amax format's codes decode to, whatever the
    data (its global scale maps the tensor's amax onto elem_max x the scale cap), or None for a
    format without a global scale (its decoded values are the data's own magnitudes)."""
    if not isinstance(fmt, BlockFormat) or not fmt.global_scale or fmt.scale.element is None:
        return None
    cap = fmt.global_bound if fmt.global_bound is not None else fmt.scale.element.max_finite
    return fmt.element.max_finite * cap


def overflow_k(a: BlockFormat | object, b: BlockFormat | object) -> int | None:
    """The smallest K at which ``accumulator_overflow_reason`` sends this pair to the float64
    reference (K products of the decoded maxima reach half of fp32's largest value: room for
    the partial sums' rounding), or None where no K below 2^31 does."""
    pa, pb = decoded_max(a), decoded_max(b)
    if pa is None or pb is None:
        return None
    first = max(1, math.ceil(FLT_MAX / 2 / (pa * pb)))
    return first if first < 2**31 else None
