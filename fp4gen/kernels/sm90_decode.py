"""The e2m1 decodes of the Hopper fused GEMMs (fp4gen/templates/gemm_sm90*.py.j2) and their
scale conversions: 8 packed codes and a pair of block-scale codes -> 4 bf16x2 words. None
depends on the spec beyond the decode it picks, so generated modules import them from here; the
PTX wrappers they are made of (prmt, the bf16x2 multiply) are ``fp4gen.kernels.sm90_ptx``'s.

The decodes (sm_90 has no e2m1 convert):

* "arith" (e4m3 block scales): the bf16 bits (code & 7) << 6 are exactly v * 2^-126 (a bf16
  subnormal for |v| = 0.5), the sign goes to bit 15. bf16x2 word j of an 8-value group holds
  elements (j, j+4): a K permutation inside each group, the same for A and B, so every dot
  product is unchanged. One HMUL2.BF16 by bf16(s * 2^119) gives v * s * 2^-7 exactly; the
  epilogue multiplies by ``EPILOGUE_SCALE`` (2^14).
* "lut" (ue8m0 block scales): prmt byte tables of the eight bf16 magnitudes, the sign bytes
  gathered with two more prmt (natural K order), then one HMUL2.BF16 by the block scale, whose
  bf16 bits are c << 7 (code 0 the subnormal 2^-127, code 255 NaN).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Uint32
from cutlass.cutlass_dsl import T, dsl_user_op

from fp4gen.kernels.sm90_ptx import inline_asm, ir_arg, mul_bf16x2_bcast, prmt

# ---- "arith" decode
TWO_POW_119 = 0x7B000000  # fp32 bits of 2^119
EPILOGUE_SCALE = 16384.0  # 2^14: undoes the 2^-7 per operand of the arith decode
# bf16x2 masks of the arith decode
MAG_BITS = 0x01C001C0  # bits 6..8 of both halves: (code & 7) << 6
SIGN_BITS = 0x80008000

# ---- "lut" decode: bf16 magnitudes of the e2m1 codes 0..7 [0, .5, 1, 1.5, 2, 3, 4, 6] =
# 0000 3F00 3F80 3FC0 4000 4040 4080 40C0, as prmt byte tables (low bytes, high bytes)
LUT_LO_A, LUT_LO_B = 0xC0800000, 0xC0804000  # codes 0-3 / 4-7
LUT_HI_A, LUT_HI_B = 0x3F3F3F00, 0x40404040


def times_scale(words: tuple[Uint32, ...], sc: Uint32, hi: bool) -> tuple[Uint32, ...]:
    """The decoded bf16x2 words times the low (hi False) or high half of the scale pair ``sc``:
    the last step of every decode (one HMUL2.BF16 a word)."""
    return tuple(mul_bf16x2_bcast(w, sc, hi) for w in words)


# ----------------------------------------------------------------------------------------------
# The "arith" decode (e4m3 scales)
# ----------------------------------------------------------------------------------------------
@dsl_user_op
def scale_pair_arith(codes: Uint32, *, loc=None, ip=None) -> Uint32:
    """Two e4m3 codes (low 16 bits) -> bf16x2 of s * 2^119, exactly (byte 0 -> low half):
    cvt.rn.f16x2.e4m3x2, widen to f32, times 2^119 (448 * 2^119 < 2^128), cvt.rn.bf16x2.f32
    (its first source goes to the HIGH half)."""
    return Uint32(
        inline_asm(
            T.i32(),
            [ir_arg(codes, Uint32, loc, ip)],
            "{\n\t.reg .b16 lo, hi;\n\t.reg .b32 h2;\n\t.reg .f32 f0, f1;\n\t"
            "mov.b32 {lo, hi}, $1;\n\t"
            "cvt.rn.f16x2.e4m3x2 h2, lo;\n\t"
            "mov.b32 {lo, hi}, h2;\n\t"
            "cvt.f32.f16 f0, lo;\n\t"
            "cvt.f32.f16 f1, hi;\n\t"
            f"mul.f32 f0, f0, 0f{TWO_POW_119:08X};\n\t"
            f"mul.f32 f1, f1, 0f{TWO_POW_119:08X};\n\t"
            "cvt.rn.bf16x2.f32 $0, f1, f0;\n\t}",
            "=r,r",
        )
    )


@cute.jit
def decode8_arith(x: Uint32, sc: Uint32, hi: cutlass.Constexpr[bool]):
    """8 e2m1 codes -> 4 bf16x2 words of v * s * 2^-7; word j holds elements (j, j+4)."""
    m = Uint32(MAG_BITS)
    sg = Uint32(SIGN_BITS)
    w0 = ((x << Uint32(6)) & m) | ((x << Uint32(12)) & sg)
    w1 = ((x << Uint32(2)) & m) | ((x << Uint32(8)) & sg)
    w2 = ((x >> Uint32(2)) & m) | ((x << Uint32(4)) & sg)
    w3 = ((x >> Uint32(6)) & m) | (x & sg)
    return times_scale((w0, w1, w2, w3), sc, hi)


# ----------------------------------------------------------------------------------------------
# The "lut" decode (ue8m0 scales)
# ----------------------------------------------------------------------------------------------
@cute.jit
def scale_bits_lut(c: Uint32) -> Uint32:
    """bf16 bits of the ue8m0 value 2^(c - 127): c << 7; code 0 is the subnormal 0x0040,
    code 255 NaN."""
    bits = c << Uint32(7)
    bits = cutlass.select_(c == Uint32(0), Uint32(0x0040), bits)
    return cutlass.select_(c == Uint32(255), Uint32(0x7FC0), bits)


@cute.jit
def scale_pair_lut(codes: Uint32) -> Uint32:
    """Two ue8m0 codes (low 16 bits) -> bf16x2 of their values (byte 0 -> low half)."""
    lo = scale_bits_lut(codes & Uint32(0xFF))
    hi = scale_bits_lut((codes >> Uint32(8)) & Uint32(0xFF))
    return lo | (hi << Uint32(16))


def lut_lookup(sel: Uint32) -> tuple[Uint32, Uint32]:
    """The low and the high bytes of the bf16 magnitudes whose codes the nibbles of ``sel``'s low
    half select (prmt byte tables)."""
    lo = prmt(Uint32(LUT_LO_A), Uint32(LUT_LO_B), sel)
    hi = prmt(Uint32(LUT_HI_A), Uint32(LUT_HI_B), sel)
    return lo, hi


@cute.jit
def decode8_lut(x: Uint32, sc: Uint32, hi: cutlass.Constexpr[bool]):
    """8 e2m1 codes -> 4 bf16x2 words of v * s, natural order: word j = elements (2j, 2j+1)."""
    xm = x & Uint32(0x77777777)  # magnitudes as prmt byte indices (bit 3, the mode, cleared)
    xm_hi = xm >> Uint32(16)
    l03, h03 = lut_lookup(xm)
    l47, h47 = lut_lookup(xm_hi)
    # the sign of element e to bit 7 of byte e: even elements from x << 4, odd ones from x
    xs = x << Uint32(4)
    h03 = h03 | (prmt(xs, x, 0x5140) & Uint32(0x80808080))
    h47 = h47 | (prmt(xs, x, 0x7362) & Uint32(0x80808080))
    # each word multiplied as soon as it is gathered (times_scale after all four prmt would
    # reorder the instructions of every lut GEMM's PTX)
    return (
        mul_bf16x2_bcast(prmt(l03, h03, 0x5140), sc, hi),
        mul_bf16x2_bcast(prmt(l03, h03, 0x7362), sc, hi),
        mul_bf16x2_bcast(prmt(l47, h47, 0x5140), sc, hi),
        mul_bf16x2_bcast(prmt(l47, h47, 0x7362), sc, hi),
    )
