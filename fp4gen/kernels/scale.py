"""Block and global scales of the quantize and MoR kernels (docs/numerics.md 2-3; the reference
is ``fp4gen.numerics.quantize``): the per-tensor S_enc / S_dec from the amax, and per block the
scale code s_b and the encode factor e_b, for every scale format and rounding.

``ScaleParams`` holds a scale format's constants and its kind (``fp4gen.codegen.quantize.
ScaleKind``: "fp32" scales are not rounded, "exponent" UExM0 formats by exponent-bit arithmetic,
"e4m3_hw" by the hardware convert, any other "minifloat" in software); ``BlockScaler`` computes
with them. Plain Python: run while a kernel is traced.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from fp4gen.kernels.encode import RNE_MAGIC, TWO32
from fp4gen.kernels.philox import call_slice, philox4x32_10
from fp4gen.kernels.quant_ptx import add_rz, cvt_e4m3_to_f32, cvt_f32_to_e4m3

FLT_MAX = 3.4028234663852886e38
NONFINITE_BITS = 0x7F800000  # bits of |v| at or above this (unsigned): v is an Inf or a NaN
NAN_BITS = 0x7FFFFFFF  # the NaN a kernel stores as S_dec


@dataclass(frozen=True)
class ScaleParams:
    """A block scale format's constants. The fields after ``cap`` matter only to the kinds that
    use them (fp32 scales use none)."""

    kind: str  # a ScaleKind word
    rounding: str  # a ScaleRounding word, "exact" for fp32 scales
    cap: float  # the saturation point of d_b: element max * cap <= FLT_MAX
    man_bits: int = 0  # minifloat
    emin_biased: int = 0  # minifloat: emin + 127, an fp32 exponent field
    bias: int = 0  # exponent
    min: float = 0.0  # exponent: 2^-bias (these formats have no zero)
    max_code: int = 0  # exponent: the largest finite code (all ones is NaN)
    elem_emax: int = 0  # exponent rounded "ocp": floor(log2(element max)), OCP MX's emax_elem


def global_scales(amax: Float32, global_num: float):
    """S_enc = min(global_num / A, FLT_MAX), 1 if A == 0 or S_enc == 0 (global_num: fp32(scale
    max * element max)); S_dec = 1 / S_enc (IEEE div.rn / rcp.rn). An A that is not finite (the
    NaN-propagating amax of an input holding a NaN or an Inf) gives S_dec = NaN; S_enc is then
    any finite value, so the codes are meaningless but computed as usual."""
    s_enc = cute.arch.fmin(Float32(global_num) / amax, Float32(FLT_MAX))
    degenerate = (amax == Float32(0.0)) | (s_enc == Float32(0.0))
    s_enc = Float32(cutlass.select_(degenerate, Float32(1.0), s_enc))
    finite = amax.bitcast(Uint32) < Uint32(NONFINITE_BITS)  # A >= 0: its bits order like it
    nan = Uint32(NAN_BITS).bitcast(Float32)
    return s_enc, Float32(cutlass.select_(finite, Float32(1.0) / s_enc, nan))


def target_factors(target_invs: tuple, inv_max: float, s_enc, global_scale: bool) -> list:
    """k_enc = fp32(S_enc * fp32(1 / T)) per block target T, in order (docs/numerics.md 11.1;
    target_invs: fp32(1 / T) each, () for the element's max alone, whose fp32(1 / T) is
    inv_max); without a global scale S_enc = 1: fp32(1 / T) itself."""
    invs = target_invs if target_invs else (inv_max,)
    if global_scale:
        return [s_enc * Float32(i) for i in invs]
    return [Float32(i) for i in invs]


def scale_word(b: Uint32, keys: list, off_lo, off_hi) -> Uint32:
    """The 32-bit Philox word of block b's stochastic scale rounding (docs/numerics.md 11.2):
    word (2^62 + b) % 4 of the call with counter (2^62 + b) // 4, i.e. (b // 4, 2^28, offset_lo,
    offset_hi) for b < 2^34."""
    call = philox4x32_10(b >> Uint32(2), Uint32(1 << 28), off_lo, off_hi, keys)
    return call_slice(call, b & Uint32(3), 1)[0]


class BlockScaler:
    """The block scale of one scale format: ``block_scale(amax_b, k_enc, s_enc, s_dec)``."""

    def __init__(self, scale: ScaleParams, global_scale: bool) -> None:
        self.s = scale
        self.global_scale = global_scale

    # ---- minifloat scales in software
    def scale_round_minifloat(self, d: Float32, word: Uint32 | None = None):
        """(code, fp32 value) of d in [0, cap] on the scale grid, in the scale rounding. As for
        elements: k = max(floor(log2 d), emin), q = d * 2^(m - k) exact, grid step 1 in q; the
        value is n * 2^(k - m) for the chosen integer n (exact). ``word``: the block's 32-bit
        Philox word of a stochastic rounding (docs/numerics.md 11.2): up iff word <
        floor(frac * 2^32)."""
        s = self.s
        e = cutlass.max(d.bitcast(Uint32) >> Uint32(23), Uint32(s.emin_biased))  # k + 127
        p = ((Uint32(s.man_bits + 254) - e) << Uint32(23)).bitcast(Float32)  # 2^(m - k)
        q = d * p  # exact
        if s.rounding == "stochastic":
            t = add_rz(q, Float32(RNE_MAGIC))  # 2^23 + floor(q)
            n = t.bitcast(Uint32) - Uint32(0x4B000000)  # floor(q)
            # frac * 2^32 = q * 2^32 - floor(q) * 2^32, every step exact; the cvt truncates
            floor32 = t * Float32(TWO32) - Float32(2.0**55)
            up = word < Uint32(q * Float32(TWO32) - floor32)
            n = n + cutlass.select_(up, Uint32(1), Uint32(0))
        elif s.rounding == "nearest" and s.man_bits > 0:
            n = (q + Float32(RNE_MAGIC)).bitcast(Uint32) - Uint32(0x4B000000)  # rint, ties even
        else:
            t = add_rz(q, Float32(RNE_MAGIC))  # 2^23 + floor(q)
            n = t.bitcast(Uint32) - Uint32(0x4B000000)  # floor(q)
            if s.rounding != "down":
                frac = q - (t - Float32(RNE_MAGIC))  # exact
            if s.rounding == "up":
                n = n + cutlass.select_(frac != Float32(0.0), Uint32(1), Uint32(0))
            elif s.rounding == "nearest":
                odd = ((n + e) & Uint32(1)) != Uint32(s.emin_biased & 1)  # m = 0: the parity
                half = Float32(0.5)
                n = n + cutlass.select_(
                    (frac > half) | ((frac == half) & odd), Uint32(1), Uint32(0)
                )
        code = n + ((e - Uint32(s.emin_biased)) << Uint32(s.man_bits))
        value = Float32(n) * ((e - Uint32(s.man_bits)) << Uint32(23)).bitcast(Float32)
        return code, value

    # ---- exponent-only scales (UExM0)
    def floor_log2_biased(self, v: Float32):
        """(floor(log2 v) + 127, the 23 fraction bits of v) for a finite v > 0; with a bias of
        127 or more also when v is an fp32 subnormal (scaled by 2^64 first)."""
        if self.s.bias >= 127:
            small = v < Float32(2.0**-126)
            vn = Float32(cutlass.select_(small, v * Float32(2.0**64), v))
            bits = vn.bitcast(Uint32)
            fl = Int32(bits >> Uint32(23)) - cutlass.select_(small, Int32(64), Int32(0))
        else:
            bits = v.bitcast(Uint32)  # v >= min = 2^-bias is a normal fp32
            fl = Int32(bits >> Uint32(23))
        return fl, bits & Uint32(0x7FFFFF)

    def pow2(self, n: Int32) -> Float32:
        """2^n as fp32 for n in [-bias, max_code - bias]."""
        bits = Uint32((n + Int32(127)) << Int32(23))
        if self.s.bias >= 127:
            bits = Uint32(cutlass.select_(n == Int32(-127), Uint32(0x00400000), bits))  # 2^-127
        return bits.bitcast(Float32)

    def scale_round_ocp(self, v: Float32):
        """OCP MX v1.0 from v = amax_b * S_enc: code = floor(log2 v) - elem_emax + bias clamped
        to [0, max_code]; v == 0 gives code 0. Never above cap: v <= FLT_MAX, so the value is at
        most 2^(127 - elem_emax), and the element max < 2^(elem_emax + 1)."""
        s = self.s
        v = cute.arch.fmin(v, Float32(FLT_MAX))  # an overflow to inf reads as 2^127
        fl, _ = self.floor_log2_biased(cute.arch.fmax(v, Float32(2.0**-149)))
        code = fl + Int32(s.bias - 127 - s.elem_emax)
        code = cutlass.max(cutlass.min(code, Int32(s.max_code)), Int32(0))
        code = cutlass.select_(v == Float32(0.0), Int32(0), code)
        return code, self.pow2(code - Int32(s.bias))

    def scale_round_exponent(self, d: Float32, word: Uint32 | None = None):
        """(code, fp32 value) of d in [min, cap] on the power-of-two grid, in the scale rounding:
        exact exponent-bit arithmetic. Stochastic (``word``: the block's Philox word): between
        2^f and 2^(f+1) the fraction is the 23 fraction bits of d over 2^23, so floor(frac *
        2^32) is those bits shifted up by 9."""
        s = self.s
        fl, frac = self.floor_log2_biased(d)
        code = fl + Int32(s.bias - 127)  # floor(log2 d) + bias
        if s.rounding == "stochastic":
            code = code + cutlass.select_(word < (frac << Uint32(9)), Int32(1), Int32(0))
        elif s.rounding == "up":
            code = code + cutlass.select_(frac != Uint32(0), Int32(1), Int32(0))
        elif s.rounding == "nearest":
            half = Uint32(0x400000)  # d = 1.5 * 2^floor: the midpoint, ties to the even code
            tie_up = (frac == half) & ((code & Int32(1)) != Int32(0))
            code = code + cutlass.select_((frac > half) | tie_up, Int32(1), Int32(0))
        return code, self.pow2(code - Int32(s.bias))

    def round_scale(self, d: Float32, word=None):
        """The scale code (fp32 scales: the value) of an ideal scale d in [0, cap], in the
        format's rounding (``word``: the block's Philox word of a stochastic one): the MS-EDEN
        correction's rounding of fp32(s_b * F) (docs/numerics.md 11.3)."""
        s = self.s
        if s.kind == "fp32":
            return d
        if s.kind == "e4m3_hw":
            return cvt_f32_to_e4m3(d)
        if s.kind == "minifloat":
            return self.scale_round_minifloat(d, word)[0]
        return self.scale_round_exponent(cute.arch.fmax(d, Float32(s.min)), word)[0]

    # ---- the block scale
    def block_scale(self, amax_b: Float32, k_enc: Float32, s_enc, s_dec):
        """Block scale and encode factor (docs/numerics.md 2, steps 4-5): d_b = min(amax_b *
        fp32(S_enc * fp32(1 / ELEM_MAX)), cap), s_b = scale(d_b), e_b = min(1 / (s_b [* S_dec]),
        FLT_MAX). Returns (s_b for fp32 scales, else the scale code; e_b)."""
        out, _, e_b = self.block_scale_value(amax_b, k_enc, s_enc, s_dec)
        return out, e_b

    def block_scale_value(self, amax_b: Float32, k_enc: Float32, s_enc, s_dec, word=None):
        """``block_scale`` with the scale's fp32 value: (code or fp32 s_b, s_b, e_b). k_enc is
        fp32(S_enc * fp32(1 / T)) for the block target T (the element's max unless the format
        has targets, docs/numerics.md 11.1); ``word``: the block's Philox word of a stochastic
        scale rounding (11.2), else None."""
        s = self.s
        if s.kind == "fp32":
            s_b = cute.arch.fmin(amax_b * k_enc, Float32(s.cap))
            out = s_b
        elif s.kind == "e4m3_hw":
            d_b = cute.arch.fmin(amax_b * k_enc, Float32(s.cap))
            out = cvt_f32_to_e4m3(d_b)  # RNE, satfinite: the hardware convert is the contract's
            s_b = cvt_e4m3_to_f32(out)
        elif s.kind == "minifloat":
            d_b = cute.arch.fmin(amax_b * k_enc, Float32(s.cap))
            out, s_b = self.scale_round_minifloat(d_b, word)
        elif s.rounding == "ocp":
            out, s_b = self.scale_round_ocp(amax_b * s_enc if self.global_scale else amax_b)
        else:
            d_b = cute.arch.fmin(amax_b * k_enc, Float32(s.cap))
            d_b = cute.arch.fmax(d_b, Float32(s.min))  # no zero
            out, s_b = self.scale_round_exponent(d_b, word)
        if self.global_scale:
            e_b = cute.arch.fmin(Float32(1.0) / (s_b * s_dec), Float32(FLT_MAX))
        else:
            e_b = cute.arch.fmin(Float32(1.0) / s_b, Float32(FLT_MAX))
        return out, s_b, e_b


__all__ = [
    "FLT_MAX",
    "NAN_BITS",
    "NONFINITE_BITS",
    "BlockScaler",
    "ScaleParams",
    "global_scales",
    "scale_word",
    "target_factors",
]
