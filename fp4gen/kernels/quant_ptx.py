"""PTX inline-asm wrappers of the quantize and MoR kernels: the exact fp32 arithmetic the
contract needs that the DSL does not spell (a rounding mode other than nearest, the sign-keeping
element scaling), the converts (bf16x2, fp16x2, e4m3 scales, the hardware element converts),
the packed bf16 absolute max, the 64-bit stochastic-rounding step and the predicated load of a
device Philox counter.

All are pure (no side effects) except where they read memory: LLVM may CSE and schedule them.
The byte permute is ``sm90_ptx.prmt``.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32, Uint64
from cutlass.cutlass_dsl import T, dsl_user_op

from fp4gen.kernels.sm90_ptx import inline_asm, ir_arg, prmt


@dsl_user_op
def scale_value(x: Float32, e: Float32, *, loc=None, ip=None) -> Float32:
    """fp32(x * e) for e > 0, as one fma.rn with +0.0 added: the product itself wherever it is
    not zero, -0.0 where a negative product underflows, and +0.0 for x = -0.0 (-0 + +0 = +0
    when rounding to nearest). So the result's sign bit is x < 0: the sign bit of x's code
    (docs/numerics.md 1), at the cost of the multiply it replaces."""
    return Float32(
        inline_asm(
            T.f32(),
            [ir_arg(x, Float32, loc, ip), ir_arg(e, Float32, loc, ip)],
            "fma.rn.f32 $0, $1, $2, 0f00000000;",
            "=f,f,f",
        )
    )


@dsl_user_op
def add_rz(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a + b rounded toward zero (2^23 +rz q = 2^23 + floor(q) for q in [0, 2^22))."""
    return Float32(
        inline_asm(
            T.f32(),
            [ir_arg(a, Float32, loc, ip), ir_arg(b, Float32, loc, ip)],
            "add.rz.f32 $0, $1, $2;",
            "=f,f,f",
        )
    )


@dsl_user_op
def mul_rz(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a * b rounded toward zero, subnormal results kept (no .ftz)."""
    return Float32(
        inline_asm(
            T.f32(),
            [ir_arg(a, Float32, loc, ip), ir_arg(b, Float32, loc, ip)],
            "mul.rz.f32 $0, $1, $2;",
            "=f,f,f",
        )
    )


# fp32 arithmetic rounded to nearest that is never fused into an fma: a plain multiply whose
# product feeds an add may be contracted (by NVVM or ptxas) into one fma, rounding once where the
# contract rounds twice; an explicit .rn is not contracted. The block error and MS-EDEN trees
# (docs/numerics.md 11.1, 11.3) sum products that must each be rounded.
@dsl_user_op
def mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """fp32(a * b), rounded to nearest even on its own (never fused into an fma)."""
    return Float32(
        inline_asm(
            T.f32(),
            [ir_arg(a, Float32, loc, ip), ir_arg(b, Float32, loc, ip)],
            "mul.rn.f32 $0, $1, $2;",
            "=f,f,f",
        )
    )


@dsl_user_op
def add_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """fp32(a + b), rounded to nearest even; a product operand is not fused into it."""
    return Float32(
        inline_asm(
            T.f32(),
            [ir_arg(a, Float32, loc, ip), ir_arg(b, Float32, loc, ip)],
            "add.rn.f32 $0, $1, $2;",
            "=f,f,f",
        )
    )


@dsl_user_op
def sub_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """fp32(a - b), rounded to nearest even; a product operand is not fused into it."""
    return Float32(
        inline_asm(
            T.f32(),
            [ir_arg(a, Float32, loc, ip), ir_arg(b, Float32, loc, ip)],
            "sub.rn.f32 $0, $1, $2;",
            "=f,f,f",
        )
    )


@dsl_user_op
def cvt_bf16x2(a: Float32, b: Float32, *, loc=None, ip=None) -> Uint32:
    """bf16 RNE of a (high half) and b (low half)."""
    return Uint32(
        inline_asm(
            T.i32(),
            [ir_arg(a, Float32, loc, ip), ir_arg(b, Float32, loc, ip)],
            "cvt.rn.bf16x2.f32 $0, $1, $2;",
            "=r,f,f",
        )
    )


@dsl_user_op
def bf16x2_absmax(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Per-half max(|a|, |b|) of two bf16x2 words, NaN where either half is NaN (the sign of the
    result is garbage)."""
    return Uint32(
        inline_asm(
            T.i32(),
            [ir_arg(a, Uint32, loc, ip), ir_arg(b, Uint32, loc, ip)],
            "max.NaN.xorsign.abs.bf16x2 $0, $1, $2;",
            "=r,r,r",
        )
    )


@dsl_user_op
def cvt_f32_to_e4m3(x: Float32, *, loc=None, ip=None) -> Uint32:
    """e4m3 code of x (RNE, satfinite) in the low byte; the x2 cvt puts its first source in the
    high byte, so x goes second."""
    return Uint32(
        inline_asm(
            T.i32(),
            [ir_arg(x, Float32, loc, ip)],
            "{\n\t.reg .b16 h;\n\tcvt.rn.satfinite.e4m3x2.f32 h, 0f00000000, $1;\n\t"
            "cvt.u32.u16 $0, h;\n\t}",
            "=r,f",
        )
    )


@dsl_user_op
def cvt_e4m3_to_f32(code: Uint32, *, loc=None, ip=None) -> Float32:
    """fp32 value of the e4m3 code in the low byte (exact: e4m3 -> f16 -> f32)."""
    return Float32(
        inline_asm(
            T.f32(),
            [ir_arg(code, Uint32, loc, ip)],
            "{\n\t.reg .b16 lo, hi;\n\t.reg .b32 h2;\n\tmov.b32 {lo, hi}, $1;\n\t"
            "cvt.rn.f16x2.e4m3x2 h2, lo;\n\tmov.b32 {lo, hi}, h2;\n\tcvt.f32.f16 $0, lo;\n\t}",
            "=f,r",
        )
    )


# The hardware element converts: their result equals the contract's RNE encode (satfinite is
# the clamp). The cvt sets a code's sign bit from its source's, also where the magnitude rounds
# to 0 (-0.0 included): the contract's rule (docs/numerics.md 1), since the sources come from
# scale_value, whose sign bit is x < 0 (an x of -0.0 gives +0.0). Nothing to clear.
def hw_per_word(ptx_type: str) -> int:
    """Values one hardware-converted 32-bit word holds: 8 e2m1 nibbles, else 4 bytes."""
    return 8 if ptx_type == "e2m1x2" else 4


@dsl_user_op
def cvt_hw(v, ptx_type: str, *, loc=None, ip=None) -> Uint32:
    """``hw_per_word(ptx_type)`` fp32 -> as many codes (RNE, satfinite), element 0 in the low
    bits: e2m1 nibbles, else one code per byte (6-bit codes leave the two top bits of a byte
    zero). The x2 cvt puts its first source in the HIGH half, so pairs go in as (odd, even)."""
    ops = [ir_arg(x, Float32, loc, ip) for x in v]
    if ptx_type == "e2m1x2":
        text = (
            "{\n\t.reg .b8 b0, b1, b2, b3;\n\t"
            "cvt.rn.satfinite.e2m1x2.f32 b0, $2, $1;\n\t"
            "cvt.rn.satfinite.e2m1x2.f32 b1, $4, $3;\n\t"
            "cvt.rn.satfinite.e2m1x2.f32 b2, $6, $5;\n\t"
            "cvt.rn.satfinite.e2m1x2.f32 b3, $8, $7;\n\t"
            "mov.b32 $0, {b0, b1, b2, b3};\n\t}"
        )
        return Uint32(inline_asm(T.i32(), ops, text, "=r,f,f,f,f,f,f,f,f"))
    text = (
        "{\n\t.reg .b16 lo, hi;\n\t"
        f"cvt.rn.satfinite.{ptx_type}.f32 lo, $2, $1;\n\t"
        f"cvt.rn.satfinite.{ptx_type}.f32 hi, $4, $3;\n\t"
        "mov.b32 $0, {lo, hi};\n\t}"
    )
    return Uint32(inline_asm(T.i32(), ops, text, "=r,f,f,f,f"))


@dsl_user_op
def sr_step(q32: Float32, nr: Uint32, base: Uint32, *, loc=None, ip=None) -> Uint32:
    """base + floor(q) + (r < floor(frac(q) * 2^32)) for q32 = q * 2^32 >= 0 and nr = ~r, exactly:
    the truncating cvt to u64 gives floor(q * 2^32) = (floor(q), floor(frac(q) * 2^32)) as
    (hi, lo), and lo + ~r carries out iff r < lo; addc adds the carry."""
    return Uint32(
        inline_asm(
            T.i32(),
            [
                ir_arg(q32, Float32, loc, ip),
                ir_arg(nr, Uint32, loc, ip),
                ir_arg(base, Uint32, loc, ip),
            ],
            "{\n\t.reg .b64 w;\n\t.reg .b32 lo, hi, d;\n\tcvt.rzi.u64.f32 w, $1;\n\t"
            "mov.b64 {lo, hi}, w;\n\tadd.cc.u32 d, lo, $2;\n\taddc.u32 $0, hi, $3;\n\t}",
            "=r,f,r,r",
        )
    )


@dsl_user_op
def cvt_rz_f16x2(a: Float32, b: Float32, *, loc=None, ip=None) -> Uint32:
    """fp16 of a (high half) and b (low half), rounded toward zero."""
    return Uint32(
        inline_asm(
            T.i32(),
            [ir_arg(a, Float32, loc, ip), ir_arg(b, Float32, loc, ip)],
            "cvt.rz.f16x2.f32 $0, $1, $2;",
            "=r,f,f",
        )
    )


@dsl_user_op
def min_abs_f16x2(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Per half min(|a|, |b|), with the sign of a xor the sign of b."""
    return Uint32(
        inline_asm(
            T.i32(),
            [ir_arg(a, Uint32, loc, ip), ir_arg(b, Uint32, loc, ip)],
            "min.xorsign.abs.f16x2 $0, $1, $2;",
            "=r,r,r",
        )
    )


@dsl_user_op
def cvt_f16x2_both(a: Float32, *, loc=None, ip=None) -> Uint32:
    """fp16 of a in both halves, rounded to nearest even (exact where a is an fp16 value)."""
    return Uint32(
        inline_asm(
            T.i32(),
            [ir_arg(a, Float32, loc, ip)],
            "cvt.rn.f16x2.f32 $0, $1, $1;",
            "=r,f",
        )
    )


@dsl_user_op
def mul_f16x2(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Per half fp16(a * b), rounded to nearest even (fp16 subnormals kept)."""
    return Uint32(
        inline_asm(
            T.i32(),
            [ir_arg(a, Uint32, loc, ip), ir_arg(b, Uint32, loc, ip)],
            "mul.rn.f16x2 $0, $1, $2;",
            "=r,r,r",
        )
    )


@dsl_user_op
def f16_half_to_f32(w: Uint32, high: bool, *, loc=None, ip=None) -> Float32:
    """The fp32 value (exact) of the low or the high fp16 half of w."""
    pick = "hi" if high else "lo"
    return Float32(
        inline_asm(
            T.f32(),
            [ir_arg(w, Uint32, loc, ip)],
            f"{{\n\t.reg .b16 lo, hi;\n\tmov.b32 {{lo, hi}}, $1;\n\tcvt.f32.f16 $0, {pick};\n\t}}",
            "=f,r",
        )
    )


@dsl_user_op
def fma_rn(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """fp32(a * b + c), rounded once to nearest even."""
    return Float32(
        inline_asm(
            T.f32(),
            [ir_arg(a, Float32, loc, ip), ir_arg(b, Float32, loc, ip), ir_arg(c, Float32, loc, ip)],
            "fma.rn.f32 $0, $1, $2, $3;",
            "=f,f,f,f",
        )
    )


@dsl_user_op
def byte_field(w: Uint32, j: int, *, loc=None, ip=None) -> Uint32:
    """Byte j of w in the low byte, zeros above (one prmt)."""
    return Uint32(
        inline_asm(
            T.i32(), [ir_arg(w, Uint32, loc, ip)], f"prmt.b32 $0, $1, 0, {0x4440 | j:#x};", "=r,r"
        )
    )


@dsl_user_op
def load_counter(addr_lo: Int32, addr_hi: Int32, *, loc=None, ip=None) -> Uint64:
    """The u64 at global address (addr_hi, addr_lo), or 0 where the address is 0 (a predicated
    load: no access, no branch)."""
    return Uint64(
        inline_asm(
            T.i64(),
            [ir_arg(addr_lo, Int32, loc, ip), ir_arg(addr_hi, Int32, loc, ip)],
            "{\n\t.reg .pred p;\n\t.reg .b64 a;\n\tmov.b64 a, {$1, $2};\n\t"
            "setp.ne.b64 p, a, 0;\n\tmov.b64 $0, 0;\n\t@p ld.global.u64 $0, [a];\n\t}",
            "=l,r,r",
        )
    )


# ---- memory: the tile kernels' predicated stores and the amax kernel's CTA count
@dsl_user_op
def store_if(addr: Int64, value: Uint32, ok: Int32, nbytes: int, *, loc=None, ip=None) -> None:
    """st.global of the low nbytes of value at addr where ok != 0: a predicated store, no
    branch."""
    width = {1: "u8", 2: "u16", 4: "u32"}[nbytes]
    inline_asm(
        None,
        [ir_arg(addr, Int64, loc, ip), ir_arg(value, Uint32, loc, ip), ir_arg(ok, Int32, loc, ip)],
        f"{{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\t@p st.global.{width} [$0], $1;\n\t}}",
        "l,r,r",
        side_effects=True,
    )


@dsl_user_op
def store_vec_if(addr: Int64, values: list, ok: Int32, *, loc=None, ip=None) -> None:
    """One st.global.v2 / .v4 of 2 or 4 32-bit values at addr (8- or 16-byte aligned) where
    ok != 0: a predicated store, no branch."""
    n = len(values)
    regs = ", ".join(f"${i + 1}" for i in range(n))
    inline_asm(
        None,
        [ir_arg(addr, Int64, loc, ip)]
        + [ir_arg(v, Uint32, loc, ip) for v in values]
        + [ir_arg(ok, Int32, loc, ip)],
        f"{{\n\t.reg .pred p;\n\tsetp.ne.s32 p, ${n + 1}, 0;\n\t"
        f"@p st.global.v{n}.u32 [$0], {{{regs}}};\n\t}}",
        "l," + ",".join(["r"] * (n + 1)),
        side_effects=True,
    )


@dsl_user_op
def count_cta(addr: Int64, *, loc=None, ip=None) -> Uint32:
    """atom.add 1 on a global u32 with acquire-release semantics at GPU scope: the old value."""
    return Uint32(
        inline_asm(
            T.i32(),
            [ir_arg(addr, Int64, loc, ip)],
            "atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;",
            "=r,l,~{memory}",
            side_effects=True,
        )
    )


@dsl_user_op
def load_acquire(addr: Int64, *, loc=None, ip=None) -> Float32:
    """ld.acquire.gpu of a global fp32: a value other CTAs wrote with atomics."""
    return Float32(
        inline_asm(
            T.f32(),
            [ir_arg(addr, Int64, loc, ip)],
            "ld.acquire.gpu.global.f32 $0, [$1];",
            "=f,l,~{memory}",
            side_effects=True,
        )
    )


__all__ = [
    "add_rz",
    "bf16x2_absmax",
    "byte_field",
    "count_cta",
    "cvt_bf16x2",
    "cvt_e4m3_to_f32",
    "cvt_f16x2_both",
    "cvt_f32_to_e4m3",
    "cvt_hw",
    "cvt_rz_f16x2",
    "f16_half_to_f32",
    "fma_rn",
    "hw_per_word",
    "load_acquire",
    "load_counter",
    "min_abs_f16x2",
    "mul_f16x2",
    "mul_rz",
    "prmt",
    "scale_value",
    "sr_step",
    "store_if",
]
