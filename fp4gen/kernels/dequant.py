"""The dequantize kernel: block-scaled codes -> bf16 element x block scale, for every format.

What it computes and why it is exact: ``fp4gen.codegen.dequant`` (the module that derives a
spec's ``DequantParams`` and renders the module binding them). In short, an element code's
magnitude field is shifted to fp32's exponent/mantissa position and its sign to bit 31, which
is v * 2^(bias - 127) as fp32; one multiply by 2^(127 - bias) gives v. Scale codes are decoded
the same way (eXmY) or placed as an fp32 exponent (ueXm0). v * s is exact in fp32 and one
conversion rounds it to bf16.

Thread mapping: [R, Kp] is a flat sequence of R * Kp / unit units of ``unit`` values (one row,
``code_words`` 32-bit words of codes, one 16-byte store of bf16 out). A CTA of ``threads``
threads takes ``threads * units_per_thread`` consecutive units; unit v of a thread is
cta * threads * units_per_thread + v * threads + tid, so each load and store of a warp covers one
contiguous span. Every code load of a thread is issued before any decode; indices past the end
are clamped (no predicates) and only the stores are guarded.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32, const_expr, range_constexpr

from fp4gen.vocab import DequantScaleMode


@dataclass(frozen=True)
class DequantParams:
    """Everything the kernel depends on besides its tensors: compile-time constants."""

    elem_bits: int
    elem_mag_mask: int  # the magnitude bits of an element code
    elem_shift: int  # 23 - mantissa bits: the magnitude field onto fp32's
    elem_factor: float  # 2^(127 - bias)
    scale_exponent: bool  # ueXm0 scales (else eXmY, decoded as the elements)
    scale_offset: int  # ueXm0: the fp32 biased exponent of code c is c + offset
    scale_code0_subnormal: bool  # ueXm0 with bias 127: code 0 is the fp32 subnormal 2^-127
    scale_mag_mask: int  # eXmY
    scale_shift: int  # eXmY
    scale_factor: float  # eXmY: 2^(127 - bias)
    block_rows: int
    block_cols: int
    packed: bool  # two 4-bit codes per byte, element 0 in the low nibble
    unit: int  # values per unit of work
    code_words: int  # 32-bit words of codes per unit
    threads: int  # per CTA
    units_per_thread: int
    scale_mode: str  # a DequantScaleMode word


class DequantKernel:
    """bf16 element x block scale of a [R, K] operand: ``__call__(codes, scale_codes, out,
    stream)`` with codes uint8 [R, Kp] (Kp / 2 packed), scale codes uint8 [ceil(R / br),
    ceil(K / bc)] and out bf16 [R, Kp] (module docstring)."""

    def __init__(self, params: DequantParams) -> None:
        self.p = params

    # ---- decode of one code (plain Python: unrolled while the kernel is traced)
    def scale_value(self, c: Uint32) -> Float32:
        """The fp32 value of a scale code (exact)."""
        p = self.p
        if const_expr(p.scale_exponent):
            if const_expr(p.scale_code0_subnormal):
                bits = Uint32(cutlass.select_(c == Uint32(0), Uint32(0x00400000), c << Uint32(23)))
            else:
                bits = (c + Uint32(p.scale_offset)) << Uint32(23)
            return bits.bitcast(Float32)
        bits = (c & Uint32(p.scale_mag_mask)) << Uint32(p.scale_shift)
        return bits.bitcast(Float32) * Float32(p.scale_factor)

    def element_value(self, code: Uint32) -> Float32:
        """The fp32 value of one element code in the low bits of ``code`` (higher bits zero)."""
        p = self.p
        bits = ((code & Uint32(p.elem_mag_mask)) << Uint32(p.elem_shift)) | (
            (code << Uint32(32 - p.elem_bits)) & Uint32(0x80000000)
        )
        return bits.bitcast(Float32) * Float32(p.elem_factor)

    def unit_codes(self, words: cute.Tensor) -> list:
        """The codes of a unit, in K order, each in the low bits of a Uint32."""
        codes = []
        for w in range(self.p.code_words):
            word = words[w]
            if const_expr(self.p.packed):
                for j in range(8):
                    codes.append((word >> Uint32(4 * j)) & Uint32(0xF))
            else:
                for j in range(4):
                    codes.append((word >> Uint32(8 * j)) & Uint32(0xFF))
        return codes

    # ---- host side: the launch
    @cute.jit
    def __call__(
        self,
        mCodes: cute.Tensor,
        mScales: cute.Tensor,
        mOut: cute.Tensor,
        stream: cuda.CUstream,
    ):
        unit, threads = self.p.unit, self.p.threads
        units_per_row = mOut.shape[1] // unit
        num_units = mOut.shape[0] * units_per_row
        gC = cute.make_tensor(
            cute.recast_ptr(mCodes.iterator, dtype=Uint32),
            cute.make_layout((num_units, self.p.code_words), stride=(self.p.code_words, 1)),
        )
        gO = cute.make_tensor(
            cute.recast_ptr(mOut.iterator, dtype=Uint32),
            cute.make_layout((num_units, unit // 2), stride=(unit // 2, 1)),
        )
        tile = threads * self.p.units_per_thread
        grid = (num_units + (tile - 1)) // tile
        self.kernel(gC, mScales, gO, units_per_row, num_units).launch(
            grid=[grid, 1, 1], block=[threads, 1, 1], stream=stream
        )

    # ---- device side
    @cute.kernel
    def kernel(
        self,
        gC: cute.Tensor,
        mScales: cute.Tensor,
        gO: cute.Tensor,
        units_per_row: Int32,
        num_units: Int32,
    ):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        last = num_units - 1
        base = bidx * (p.threads * p.units_per_thread) + tidx
        last_scale_col = mScales.shape[1] - 1

        # ---- every code load of this thread first (clamped: no predicates)
        frags = []
        for v in range_constexpr(p.units_per_thread):
            frag = cute.make_rmem_tensor((p.code_words,), Uint32)
            cute.autovec_copy(gC[cutlass.min(base + v * p.threads, last), None], frag)
            frags.append(frag)

        for v in range_constexpr(p.units_per_thread):
            u = cutlass.min(base + v * p.threads, last)
            row = u // units_per_row
            cu = u - row * units_per_row  # unit index within the row
            srow = row
            if const_expr(p.block_rows > 1):
                srow = row // p.block_rows
            codes = self.unit_codes(frags[v])
            vals = cute.make_rmem_tensor((p.unit,), Float32)
            if const_expr(p.scale_mode == DequantScaleMode.UNIT):  # one block covers the unit
                ucol = cu
                if const_expr(p.block_cols > p.unit):
                    ucol = cu // (p.block_cols // p.unit)
                col = cutlass.min(ucol, last_scale_col)
                s = self.scale_value(Uint32(mScales[srow, col]))
                for j in range_constexpr(p.unit):
                    vals[j] = self.element_value(codes[j]) * s
            elif const_expr(p.scale_mode == DequantScaleMode.SPLIT):  # unit / bc blocks per unit
                groups = p.unit // p.block_cols
                for g in range_constexpr(groups):
                    col = cutlass.min(cu * groups + g, last_scale_col)
                    s = self.scale_value(Uint32(mScales[srow, col]))
                    for j in range_constexpr(p.block_cols):
                        vals[g * p.block_cols + j] = (
                            self.element_value(codes[g * p.block_cols + j]) * s
                        )
            else:  # a scale column per value: blocks straddle units
                for j in range_constexpr(p.unit):
                    col = cutlass.min((cu * p.unit + j) // p.block_cols, last_scale_col)
                    vals[j] = self.element_value(codes[j]) * self.scale_value(
                        Uint32(mScales[srow, col])
                    )
            out = cute.make_rmem_tensor((p.unit,), BFloat16)
            out.store(vals.load().to(BFloat16))
            if base + v * p.threads < num_units:
                cute.autovec_copy(cute.recast_tensor(out, Uint32), gO[u, None])


__all__ = ["DequantKernel", "DequantParams"]
