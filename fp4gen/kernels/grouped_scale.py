"""The grouped products' epilogue: each row of a 16-bit product times its group's alpha.

On Hopper the experts' decoded operands are multiplied by ``torch._grouped_mm``, whose fast
kernel writes bf16. What is left is the epilogue of docs/numerics.md 6 without a bias:

    out[r, j] = round(fp32(c[src[r], j]) * alpha[r])     (src[r] = r without a gather)

``c`` bf16 [Rc, N], ``alpha`` fp32 [R] (the row's group's S_dec(A) S_dec(B)), ``out`` bf16,
fp16 or fp32 [R, N]; ``src`` int32 [R] takes the dgrad's real rows out of its padded ones in
the same pass. A bf16 value is exact in fp32 (its bits shifted into place), the product is
one fp32 multiply (mul.rn: nothing to fuse it with) and the output one cvt.rn, so the bits
are those of ``torch.mul(c.float(), alpha[:, None]).to(out)``: the torch ops it replaces,
which took three passes over the product (the fp32 copy, a broadcast multiply on torch's
unvectorized mixed-dtype path, the gather) where this takes one.

Thread mapping (as the dequantize kernel's): [R, N] is a flat sequence of R * N / 8 units of 8
values (one 16-byte load of c, one 16- or 32-byte store). A CTA of ``threads`` threads takes
``threads * units_per_thread`` consecutive units, unit v of a thread being cta * tile + v *
threads + tid, so each warp's loads and stores cover one contiguous span; every load of a
thread is issued before any multiply, indices past the end are clamped and only the stores
are guarded.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Uint32, const_expr, range_constexpr

UNIT = 8  # values per unit: one 16-byte load of bf16
IN_WORDS = UNIT // 2  # 32-bit words of a unit of c
OUT_TYPES = {"bf16": BFloat16, "fp16": Float16, "fp32": Float32}
OUT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class ScaleRowsParams:
    """The kernel's compile-time constants."""

    out: str  # a key of OUT_TYPES
    gather: bool  # the source row of each output row read from ``src``
    threads: int = 256
    units_per_thread: int = 4  # loads issued back to back before any multiply

    @property
    def out_words(self) -> int:
        return UNIT * OUT_BYTES[self.out] // 4


class ScaleRowsKernel:
    """``__call__(c, src, alpha, out, stream)``: the module docstring's epilogue. ``src`` is
    read only with ``gather`` (else any int32 tensor of one element)."""

    def __init__(self, params: ScaleRowsParams) -> None:
        self.p = params

    @cute.jit
    def __call__(
        self,
        mC: cute.Tensor,
        mSrc: cute.Tensor,
        mAlpha: cute.Tensor,
        mOut: cute.Tensor,
        stream: cuda.CUstream,
    ):
        p = self.p
        units_per_row = mOut.shape[1] // UNIT
        num_units = mOut.shape[0] * units_per_row
        gC = cute.make_tensor(
            cute.recast_ptr(mC.iterator, dtype=Uint32),
            cute.make_layout((mC.shape[0] * units_per_row, IN_WORDS), stride=(IN_WORDS, 1)),
        )
        gO = cute.make_tensor(
            cute.recast_ptr(mOut.iterator, dtype=Uint32),
            cute.make_layout((num_units, p.out_words), stride=(p.out_words, 1)),
        )
        tile = p.threads * p.units_per_thread
        grid = (num_units + (tile - 1)) // tile
        self.kernel(gC, mSrc, mAlpha, gO, units_per_row, num_units).launch(
            grid=[grid, 1, 1], block=[p.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        gC: cute.Tensor,
        mSrc: cute.Tensor,
        mAlpha: cute.Tensor,
        gO: cute.Tensor,
        units_per_row: Int32,
        num_units: Int32,
    ):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        last = num_units - 1
        base = bidx * (p.threads * p.units_per_thread) + tidx

        # ---- every load of this thread first (clamped: no predicates)
        frags = []
        for v in range_constexpr(p.units_per_thread):
            u = cutlass.min(base + v * p.threads, last)
            row = u // units_per_row
            source = u
            if const_expr(p.gather):
                source = mSrc[row] * units_per_row + (u - row * units_per_row)
            frag = cute.make_rmem_tensor((IN_WORDS,), Uint32)
            cute.autovec_copy(gC[source, None], frag)
            frags.append(frag)

        for v in range_constexpr(p.units_per_thread):
            u = cutlass.min(base + v * p.threads, last)
            alpha = Float32(mAlpha[u // units_per_row])
            vals = cute.make_rmem_tensor((UNIT,), Float32)
            for w in range_constexpr(IN_WORDS):
                word = frags[v][w]
                # bf16 element 2w in the low half, 2w + 1 in the high half: exact in fp32
                vals[2 * w] = (word << Uint32(16)).bitcast(Float32) * alpha
                vals[2 * w + 1] = (word & Uint32(0xFFFF0000)).bitcast(Float32) * alpha
            out = cute.make_rmem_tensor((UNIT,), OUT_TYPES[p.out])
            out.store(vals.load().to(OUT_TYPES[p.out]))
            if base + v * p.threads < num_units:
                cute.autovec_copy(cute.recast_tensor(out, Uint32), gO[u, None])


__all__ = ["OUT_TYPES", "UNIT", "ScaleRowsKernel", "ScaleRowsParams"]
