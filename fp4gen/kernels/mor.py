"""Device helpers of the Mixture-of-Representations kernels (docs/mor-kernels.md): where a
thread's row segments of a 128 x 128 tile are, the fixed summation trees over a tile's pieces
(lanes, then the thread's segments, then warps through shared memory), the element encode of a
candidate representation, the high-precision candidates' values and the block scales of the
scale kernel.

``MoRTile`` holds the tile mapping (``iters`` row segments of ``VEC`` columns per thread, a warp
covering 2 * iters rows); the rest are plain functions. Plain Python: run while a kernel is
traced (loops unroll, every index is a compile-time constant).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Float64, Int32, Int64, Uint32, const_expr, range_constexpr
from cutlass.cutlass_dsl import T, dsl_user_op

from fp4gen.kernels.scale import FLT_MAX
from fp4gen.kernels.sm90_ptx import inline_asm, ir_arg
from fp4gen.vocab import DTYPES

TILE = 128  # a CTA's tile is TILE x TILE; also the pieces of the summation order
VEC = 8  # contiguous columns per thread and row


def add(a, b):
    return a + b


def pairwise(vals: list, op):
    """The pairwise tree of op over vals (a power-of-two count): adjacent pairs first."""
    while len(vals) > 1:
        vals = [op(vals[i], vals[i + 1]) for i in range(0, len(vals), 2)]
    return vals[0]


def writes(row: Int32, col: Int32, row_bits: int, col_bits: int):
    """True for the one thread (of those holding a piece's result) at the piece's origin."""
    return ((col & ((1 << col_bits) - 1)) == 0) & ((row & ((1 << row_bits) - 1)) == 0)


def lane_reduce(v, op, col_bits: int, row_bits: int):
    """The part of the tree of op over a 2^row_bits x 2^col_bits piece (col_bits >= 3) that
    runs across lanes, for one row segment already combined over its VEC columns: column bits
    3.. (lane xor 1, 2, 4, 8), then row bit 0 (lane xor 16)."""
    for b in range(3, col_bits):
        v = op(v, cute.arch.shuffle_sync_bfly(v, offset=1 << (b - 3)))
    if row_bits >= 1:
        v = op(v, cute.arch.shuffle_sync_bfly(v, offset=16))
    return v


class SegmentTree:
    """Row bits 1..log_iters of the tree (the thread's row segments), built while the segments
    are pushed in order: a binary counter of partial sums, so few are alive."""

    def __init__(self, op, row_bits: int, log_iters: int) -> None:
        self.op = op
        self.levels = max(min(row_bits, 1 + log_iters) - 1, 0)
        self.stack: list = []

    def push(self, v) -> None:
        level = 0
        while self.stack and self.stack[-1][0] == level and level < self.levels:
            v = self.op(self.stack.pop()[1], v)
            level += 1
        self.stack.append((level, v))

    def slots(self) -> list:
        """One value per group of slot_iters(row_bits) segments."""
        return [v for _, v in self.stack]


class MoRTile:
    """A CTA's 128 x 128 tile: each thread holds ``iters`` row segments of VEC inputs (segment i
    is row + 2 i), a warp 2 * iters rows; the summation trees over a tile's pieces."""

    def __init__(self, iters: int, log_iters: int, input_type: type) -> None:
        self.iters = iters
        self.log_iters = log_iters
        self.input_type = input_type
        self.warps = TILE // (2 * iters)

    def slot_iters(self, row_bits: int) -> int:
        """Row segments of a thread that one unit piece of 2^row_bits rows covers (>= 1)."""
        return 1 << max(min(row_bits, 1 + self.log_iters) - 1, 0)

    def segment_tree(self, op, row_bits: int) -> SegmentTree:
        return SegmentTree(op, row_bits, self.log_iters)

    def thread_origin(self, tidx: Int32, bidx: Int32, tiles_k: Int32):
        """(row of the thread's segment 0, its first column); segment i is row + 2 i."""
        warp = tidx // 32
        lane = tidx - warp * 32
        tr = bidx // tiles_k
        tc = bidx - tr * tiles_k
        return tr * TILE + warp * (2 * self.iters) + (lane >> 4), tc * TILE + (lane & 15) * VEC

    def load_tile(self, gX: cute.Tensor, row0: Int32, col0: Int32, R: Int32, K: Int32) -> list:
        """The thread's iters row segments of VEC inputs, rows clamped to R - 1 and columns to
        K - VEC (every load in bounds, no predicates); all loads issued first."""
        kv = K // VEC
        cu = cutlass.min(col0, K - VEC) // VEC
        frags = []
        for i in range(self.iters):
            r = cutlass.min(row0 + 2 * i, R - 1)
            frag = cute.make_rmem_tensor((VEC,), self.input_type)
            cute.autovec_copy(gX[r * kv + cu, None], frag)
            frags.append(frag)
        return frags

    def warp_reduce(self, vals: list, op, row_bits: int, red: cute.Tensor, tidx: Int32) -> list:
        """Row bits log_iters + 1..6 of the tree (warps, through shared memory) for pieces
        taller than a warp's 2 * iters rows (vals is then a single value); others are returned
        as they are."""
        if row_bits <= 1 + self.log_iters:
            return vals
        group = 1 << (row_bits - 1 - self.log_iters)  # warps in a piece
        red[tidx] = vals[0]
        cute.arch.barrier()
        warp = tidx // 32
        first = (warp // group) * group * 32 + (tidx - warp * 32)
        out = [pairwise([red[first + 32 * w] for w in range(group)], op)]
        cute.arch.barrier()  # red is reused
        return out

    def reduce_tile(
        self, vals: list, op, col_bits: int, row_bits: int, red: cute.Tensor, tidx: Int32
    ):
        """The tree of op over a 2^row_bits x 2^col_bits piece of the tile from vals[i], the
        thread's value for row segment i (its VEC columns already combined). Returns one value
        per group of slot_iters(row_bits) segments; every thread of a piece holds its result."""
        tree = self.segment_tree(op, row_bits)
        for v in vals:
            tree.push(lane_reduce(v, op, col_bits, row_bits))
        return self.warp_reduce(tree.slots(), op, row_bits, red, tidx)

    def cta_reduce(self, v, op, red: cute.Tensor, tidx: Int32):
        """op over every thread of the CTA (an order-free op: max, min, integer add)."""
        v = cute.arch.warp_reduction(v, op)
        red[tidx // 32] = v  # every lane holds the warp's result: identical stores
        cute.arch.barrier()
        out = pairwise([red[w] for w in range(self.warps)], op)
        cute.arch.barrier()
        return out


# ---- high-precision candidates: the values rounded to their dtype
def round_bf16(a: Float32) -> Float32:
    """a rounded to bf16 (RNE on the bits; overflow gives inf), as fp32."""
    b = a.bitcast(Uint32)
    return ((b + Uint32(0x7FFF) + ((b >> Uint32(16)) & Uint32(1))) & Uint32(0xFFFF0000)).bitcast(
        Float32
    )


@dsl_user_op
def round_fp16(a: Float32, *, loc=None, ip=None) -> Float32:
    """a rounded to fp16 (cvt.rn: subnormals kept, overflow gives inf), as fp32."""
    return Float32(
        inline_asm(
            T.f32(),
            [ir_arg(a, Float32, loc, ip)],
            "{\n\t.reg .b16 h;\n\tcvt.rn.f16.f32 h, $1;\n\tcvt.f32.f16 $0, h;\n\t}",
            "=f,f",
        )
    )


@dsl_user_op
def f16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """fp16 RNE of lo (low half) and hi (high half); cvt.f16x2 takes the high half first."""
    return Uint32(
        inline_asm(
            T.i32(),
            [ir_arg(hi, Float32, loc, ip), ir_arg(lo, Float32, loc, ip)],
            "cvt.rn.f16x2.f32 $0, $1, $2;",
            "=r,f,f",
        )
    )


def high_words(name: str, xs: list, packed: bool) -> list:
    """A segment's values rounded to the dtype ``name``: packed, two bf16 / fp16 values per
    word (element 2j in the low half); else as fp32 bits, one value per word."""
    if packed and name == "bf16":
        bits = [round_bf16(x).bitcast(Uint32) for x in xs]
        return [(bits[2 * i] >> Uint32(16)) | bits[2 * i + 1] for i in range(len(xs) // 2)]
    if packed and name == "fp16":
        return [f16x2(xs[2 * i], xs[2 * i + 1]) for i in range(len(xs) // 2)]
    if name == "bf16":
        return [round_bf16(x).bitcast(Uint32) for x in xs]
    if name == "fp16":
        return [round_fp16(x).bitcast(Uint32) for x in xs]
    return [x.bitcast(Uint32) for x in xs]


# ---- a minifloat candidate's encode
class RepEncoder:
    """The element encode of a minifloat representation: ``encode(a)`` gives (magnitude code,
    its value) of a in [0, max], rounded to nearest (ties to the even code) or toward zero.

    With k = max(floor(log2 a), emin), q = a * 2^(m - k) is exact and the grid step is 1 in q:
    the code is n + (k - emin) * 2^m for the integer n that q rounds to (n = 2^(m+1) rolls into
    the next binade) and the value n * 2^(k - m), both exact. floor(q) by a truncating convert,
    frac = q - floor(q) exact."""

    def __init__(self, man_bits: int, emin_biased: int, rounding: str) -> None:
        self.man_bits = man_bits
        self.emin_biased = emin_biased  # 1 - bias + 127: the smallest normal exponent field
        self.rounding = rounding

    def encode(self, a: Float32) -> tuple[Uint32, Float32]:
        m = self.man_bits
        k_min = Uint32(self.emin_biased << 23)
        two_k = cutlass.max(a.bitcast(Uint32) & Uint32(0x7F800000), k_min)  # biased k, as bits
        p = (Uint32((m + 254) << 23) - two_k).bitcast(Float32)  # 2^(m - k)
        q = a * p  # exact, in [0, 2^(m+1)]
        n = Uint32(q)  # floor
        lo = n + ((two_k - k_min) >> Uint32(23 - m))  # + (k - emin) * 2^m
        if self.rounding == "nearest":
            f = Float32(n)
            frac = q - f  # exact
            half = Float32(0.5)
            odd = (lo & Uint32(1)) != Uint32(0)
            up = (frac > half) | ((frac == half) & odd)  # ties to the even code
            step = Uint32(cutlass.select_(up, Uint32(1), Uint32(0)))
            grid = (two_k - Uint32(m << 23)).bitcast(Float32)  # 2^(k - m)
            return lo + step, (f + Float32(step)) * grid
        grid = (two_k - Uint32(m << 23)).bitcast(Float32)  # 2^(k - m)
        return lo, Float32(n) * grid


# ---- the scale kernel's block scales
def split_fp32(s: Float32) -> tuple[Float32, Int32]:
    """(m, e) with s = m * 2^e, m in [1, 2), for a finite s > 0 (an fp32 subnormal is scaled by
    2^64 first): frexp, as the reference's split_fp32."""
    small = s < Float32(2.0**-126)
    bits = Float32(cutlass.select_(small, s * Float32(2.0**64), s)).bitcast(Uint32)
    e = Int32(bits >> Uint32(23)) - Int32(127) - Int32(cutlass.select_(small, Int32(64), Int32(0)))
    return ((bits & Uint32(0x7FFFFF)) | Uint32(0x3F800000)).bitcast(Float32), e


def pow2_f64(e: Int32) -> Float64:
    """2^e as float64 for e in [-1022, 1023], from its bits (exact)."""
    return ((Int64(e) + Int64(1023)) << Int64(52)).bitcast(Float64)


def block_scale(amax_b: Float32, amax_g: Float32, q_max: Float32, scaling: str):
    """(encode scale fp32, decode factor float64, exponent, group mantissa) of one block: ideal
    scales s = min(q_max / amax, FLT_MAX) (the group's 1 when its amax is 0; a zero block takes
    the group's), then the scaling: "amax" keeps s_b, "e8m0" rounds it down to a power of two,
    otherwise the group's mantissa times a power of two (lowered: nothing saturates)."""
    flt_max, fmin = Float32(FLT_MAX), cute.arch.fmin
    zero = Float32(0.0)
    s_g = Float32(cutlass.select_(amax_g == zero, Float32(1.0), fmin(q_max / amax_g, flt_max)))
    s_b = Float32(cutlass.select_(amax_b == zero, s_g, fmin(q_max / amax_b, flt_max)))
    if scaling == "amax":
        return s_b, Float64(Float32(1.0) / s_b), Int32(0), Float32(1.0)
    if scaling == "e8m0":
        _, e_b = split_fp32(s_b)
        return Float32(pow2_f64(e_b)), pow2_f64(-e_b), e_b, Float32(1.0)
    m_g, _ = split_fp32(s_g)
    m_b, e_b = split_fp32(s_b)
    e = Int32(cutlass.select_(m_g <= m_b, e_b, e_b - Int32(1)))  # lowered: nothing saturates
    encode = Float32(Float64(m_g) * pow2_f64(e))  # exact product, one rounding to fp32
    decode = Float64(Float32(1.0) / m_g) * pow2_f64(-e)  # fp32(1 / m_g), then exact
    return encode, decode, e, m_g


# ---- the amax and scales kernels
@dataclass(frozen=True)
class MoRScaleParams:
    """What the MoR amax and scales kernels depend on besides their tensors."""

    iters: int  # row segments per thread
    log_iters: int
    input_dtype: str  # "bf16", "fp16" or "fp32"
    scale_row_shift: int  # the scale block of row r, column c is (r >> row_shift, c >> col_shift)
    scale_col_shift: int
    scale_row_bits: int  # log2 of a scale block's piece inside one tile
    scale_col_bits: int
    elem_max: tuple[float, ...]  # each element representation's largest value
    scaling: str  # "amax", "e8m0" or "gam"

    @property
    def threads(self) -> int:
        return 32 * (TILE // (2 * self.iters))

    @property
    def input_type(self) -> type:
        return getattr(cutlass, DTYPES[self.input_dtype].cute)


def abs_bits(frag: cute.Tensor, ok) -> list:
    """The bits of |x| (sign bit cleared) of one row segment as Int32, 0 where ``ok`` is
    false."""
    xf = cute.make_rmem_tensor((VEC,), Float32)
    xf.store(frag.load().to(Float32))
    mask = Int32(0x7FFFFFFF)
    return [Int32(cutlass.select_(ok, xf[j].bitcast(Int32) & mask, Int32(0))) for j in range(VEC)]


def segments(mX: cute.Tensor):
    """(R, K) compact row-major -> (R*K/VEC, VEC): one row segment per index."""
    n = mX.shape[0] * (mX.shape[1] // VEC)
    return cute.make_tensor(mX.iterator, cute.make_layout((n, VEC), stride=(VEC, 1)))


def tiles(R, K):
    """(tiles along K, tiles): the grid of 128 x 128 tiles."""
    tiles_k = (K + (TILE - 1)) // TILE
    return tiles_k, ((R + (TILE - 1)) // TILE) * tiles_k


def words(t: cute.Tensor, n):
    """A flat view of t's memory as n 32-bit words."""
    return cute.make_tensor(cute.recast_ptr(t.iterator, dtype=Uint32), cute.make_layout(n))


class MoRAmaxKernel:
    """amax_b of every scale block and the tensor's amax (the buffer's last entry): maxima of
    the bits of |x| (sign cleared: the integer order of non-negative floats, and a NaN, whose
    bits exceed inf's, survives for the finiteness check), atomic max into a zeroed int32
    buffer."""

    def __init__(self, params: MoRScaleParams, arch: str) -> None:
        self.p = params
        self.arch = arch
        self.tile = MoRTile(params.iters, params.log_iters, params.input_type)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mAmax: cute.Tensor, stream: cuda.CUstream):
        R, K = mX.shape[0], mX.shape[1]
        tiles_k, grid = tiles(R, K)
        self.kernel(segments(mX), mAmax, R, K, tiles_k).launch(
            grid=[grid, 1, 1], block=[self.p.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, gX: cute.Tensor, gAmax: cute.Tensor, R: Int32, K: Int32, tiles_k: Int32):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row0, col0 = self.tile.thread_origin(tidx, bidx, tiles_k)
        frags = self.tile.load_tile(gX, row0, col0, R, K)
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Int32, cute.make_layout(p.threads), byte_alignment=16)
        col_ok = col0 < K
        maxes = []
        for i in range_constexpr(p.iters):
            maxes.append(pairwise(abs_bits(frags[i], col_ok & (row0 + 2 * i < R)), cutlass.max))
        blocks = self.tile.reduce_tile(
            list(maxes), cutlass.max, p.scale_col_bits, p.scale_row_bits, red, tidx
        )
        nbc = ((K - 1) >> p.scale_col_shift) + 1
        nb = (((R - 1) >> p.scale_row_shift) + 1) * nbc
        slot_iters = self.tile.slot_iters(p.scale_row_bits)
        for s in range_constexpr(len(blocks)):
            row = row0 + 2 * (s * slot_iters)
            if writes(row, col0, p.scale_row_bits, p.scale_col_bits) & (row < R) & col_ok:
                b = (row >> p.scale_row_shift) * nbc + (col0 >> p.scale_col_shift)
                cute.arch.atomic_max(gAmax.iterator + b, blocks[s])
        tile = self.tile.reduce_tile(maxes, cutlass.max, 7, 7, red, tidx)[0]
        if tidx == 0:
            cute.arch.atomic_max(gAmax.iterator + nb, tile)


class MoRScalesKernel:
    """Per scale block and element representation: encode scale (fp32), decode factor
    (float64), exponent (int32, gam / e8m0); the group mantissa (gam) from block 0."""

    def __init__(self, params: MoRScaleParams, arch: str) -> None:
        self.p = params
        self.arch = arch

    @cute.jit
    def __call__(
        self,
        mAmax: cute.Tensor,  # (nb + 1,) int32: fp32 bits of amax_b, then the tensor's amax
        mEnc: cute.Tensor,  # (N_ELEM * nb,) fp32
        mDec: cute.Tensor,  # (N_ELEM * nb,) float64
        mExp: cute.Tensor,  # (N_ELEM * nb,) int32
        mMant: cute.Tensor,  # (N_ELEM,) fp32
        R: Int32,
        K: Int32,
        stream: cuda.CUstream,
    ):
        p = self.p
        nb = (((R - 1) >> p.scale_row_shift) + 1) * (((K - 1) >> p.scale_col_shift) + 1)
        grid = (nb + (p.threads - 1)) // p.threads
        self.kernel(mAmax, mEnc, mDec, mExp, mMant, nb).launch(
            grid=[grid, 1, 1], block=[p.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        gAmax: cute.Tensor,
        gEnc: cute.Tensor,
        gDec: cute.Tensor,
        gExp: cute.Tensor,
        gMant: cute.Tensor,
        nb: Int32,
    ):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        b = bidx * p.threads + tidx
        if b < nb:
            amax_b = gAmax[b].bitcast(Float32)
            amax_g = gAmax[nb].bitcast(Float32)
            for r in range_constexpr(len(p.elem_max)):
                enc, dec, e, m_g = block_scale(amax_b, amax_g, Float32(p.elem_max[r]), p.scaling)
                gEnc[r * nb + b] = enc
                gDec[r * nb + b] = dec
                gExp[r * nb + b] = e
                if b == 0:
                    gMant[r] = m_g


# ---- the decision
@dataclass(frozen=True)
class Candidate:
    """One candidate of a rule, as the decision reads it."""

    index: int  # its position among the rule's candidates
    metric: str | None  # "relerr", "relerr_vs", "range"; None: the fallback (the last one)
    rep: int  # its representation's position among the measured ones (the error sums)
    threshold: float = 0.0  # relerr: the mean relative error below which it is taken
    versus: int = 0  # relerr_vs: the yardstick's representation
    range_bound: float = 0.0  # range: its element format's max finite / min normal


def decide(cands: tuple[Candidate, ...], errs: list, count: Int32, amax, amin) -> Int32:
    """Algorithm 2: the first candidate whose metric accepts the unit, else the last one
    (cands in the rule's order; amax / amin of the unit's |x| for the range metric)."""
    choice = Int32(len(cands) - 1)
    if any(c.metric == "relerr" for c in cands):
        n64 = Float64(cutlass.max(count, Int32(1)))
    zero = Float64(0.0)
    for c in reversed(cands):
        if c.metric == "relerr":
            mean = Float64(cutlass.select_(count > Int32(0), errs[c.rep] / n64, zero))
            ok = mean < Float64(c.threshold)
        elif c.metric == "relerr_vs":
            ok = (errs[c.rep] < errs[c.versus]) | (errs[c.rep] == zero)
        elif c.metric == "range":
            ok = Float64(amax) < Float64(c.range_bound) * Float64(amin)
        else:  # the fallback: taken when no other accepts the unit
            continue
        choice = Int32(cutlass.select_(ok, Int32(c.index), choice))
    return choice


@dataclass(frozen=True)
class MoRDecideParams:
    """What the decide kernel depends on besides its tensors."""

    iters: int  # row segments per thread (the CTA size)
    input_dtype: str
    unit_row_shift: int  # the unit of row r, column c is (r >> row_shift, c >> col_shift)
    unit_col_shift: int
    unit_row_bits: int  # log2 of a unit's piece inside one tile
    unit_col_bits: int
    pieces_row_shift: int  # log2 of a unit's pieces along rows (capped: whole tensor)
    pieces_col_shift: int
    n_reps: int  # representations measured (error sums)
    cands: tuple[Candidate, ...]
    uses_range: bool  # some candidate takes the range metric (max / min |x|)

    @property
    def threads(self) -> int:
        return 32 * (TILE // (2 * self.iters))


class MoRDecideKernel:
    """Per decision unit (one CTA): the pairwise tree over its pieces (columns, then rows; in
    place, one level per barrier), the non-zero count (and max / min |x| for the range metric),
    the decision. The entry (``__call__`` and ``kernel``) of a rule without the range metric;
    ``MoRDecideRangeKernel``'s takes each piece's max and min too."""

    def __init__(self, params: MoRDecideParams, arch: str) -> None:
        self.p = params
        self.arch = arch
        input_type = getattr(cutlass, DTYPES[params.input_dtype].cute)
        self.tile = MoRTile(params.iters, params.iters.bit_length() - 1, input_type)

    @cute.jit
    def __call__(
        self,
        mP: cute.Tensor,  # (N_REPS * pieces,) float64 partial sums
        mCnt: cute.Tensor,  # (pieces,) int32 non-zero counts
        mChoice: cute.Tensor,  # (units,) int64
        mErr: cute.Tensor,  # (N_REPS * units,) float64
        mNz: cute.Tensor,  # (units,) int64
        R: Int32,
        K: Int32,
        stream: cuda.CUstream,
    ):
        self.launch((mP, mCnt), (mChoice, mErr, mNz), R, K, stream)

    def launch(self, stats: tuple, outs: tuple, R, K, stream) -> None:
        """One CTA per decision unit; ``stats``: the partial sums and each piece's statistics
        (the kernel's arguments before the outputs)."""
        p = self.p
        nu = (((R - 1) >> p.unit_row_shift) + 1) * (((K - 1) >> p.unit_col_shift) + 1)
        self.kernel(*stats, *outs, R, K).launch(
            grid=[nu, 1, 1], block=[p.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        gP: cute.Tensor,
        gCnt: cute.Tensor,
        gChoice: cute.Tensor,
        gErr: cute.Tensor,
        gNz: cute.Tensor,
        R: Int32,
        K: Int32,
    ):
        self.body(gP, gCnt, None, None, gChoice, gErr, gNz, R, K)

    @cute.jit
    def body(self, gP, gCnt, gPmax, gPmin, gChoice, gErr, gNz, R, K):
        """gPmax / gPmin: None without the range metric."""
        p = self.p
        threads = p.threads
        tidx, _, _ = cute.arch.thread_idx()
        u, _, _ = cute.arch.block_idx()
        nuc = ((K - 1) >> p.unit_col_shift) + 1
        nu = (((R - 1) >> p.unit_row_shift) + 1) * nuc
        npr = ((R - 1) >> p.unit_row_bits) + 1
        npc = ((K - 1) >> p.unit_col_bits) + 1
        np_ = npr * npc
        ur = u // nuc
        uc = u - ur * nuc
        pr0 = ur << p.pieces_row_shift
        pc0 = uc << p.pieces_col_shift
        nr = cutlass.min(npr - pr0, Int32(1 << p.pieces_row_shift))
        nc = cutlass.min(npc - pc0, Int32(1 << p.pieces_col_shift))

        # ---- order-free statistics: strided over the pieces, then across the CTA
        smem = cutlass.memory.SmemAllocator()
        red32 = smem.allocate_tensor(Int32, cute.make_layout(self.tile.warps), byte_alignment=16)
        redf = None
        if const_expr(p.uses_range):
            redf = smem.allocate_tensor(
                Float32, cute.make_layout(self.tile.warps), byte_alignment=16
            )
        count = Int32(0)
        amax = amin = None
        if const_expr(p.uses_range):
            amax = Float32(0.0)
            amin = Float32(math.inf)
            for f in cutlass.range(tidx, nr * nc, threads, unroll=1):
                r = f // nc
                q = (pr0 + r) * npc + pc0 + (f - r * nc)
                count = count + gCnt[q]
                amax = cute.arch.fmax(amax, gPmax[q])
                amin = cute.arch.fmin(amin, gPmin[q])
        else:
            for f in cutlass.range(tidx, nr * nc, threads, unroll=1):
                r = f // nc
                q = (pr0 + r) * npc + pc0 + (f - r * nc)
                count = count + gCnt[q]
        count = self.tile.cta_reduce(count, add, red32, tidx)
        if const_expr(p.uses_range):
            amax = self.tile.cta_reduce(amax, cute.arch.fmax, redf, tidx)
            amin = self.tile.cta_reduce(amin, cute.arch.fmin, redf, tidx)

        # ---- the error sums: pairwise levels over piece columns, then piece rows
        h = Int32(1)
        while h < nc:
            pairs = (nc + 2 * h - 1) // (2 * h)
            for f in cutlass.range(tidx, nr * pairs, threads, unroll=1):
                r = f // pairs
                c = (f - r * pairs) * 2 * h
                if c + h < nc:
                    q = (pr0 + r) * npc + pc0 + c
                    for e in range_constexpr(p.n_reps):
                        gP[e * np_ + q] = gP[e * np_ + q] + gP[e * np_ + q + h]
            cute.arch.barrier()
            h = h * 2
        h = Int32(1)
        while h < nr:
            pairs = (nr + 2 * h - 1) // (2 * h)
            for f in cutlass.range(tidx, pairs, threads, unroll=1):
                r = f * 2 * h
                if r + h < nr:
                    q = (pr0 + r) * npc + pc0
                    for e in range_constexpr(p.n_reps):
                        gP[e * np_ + q] = gP[e * np_ + q] + gP[e * np_ + q + h * npc]
            cute.arch.barrier()
            h = h * 2

        if tidx == 0:
            p0 = pr0 * npc + pc0
            errs = [gP[e * np_ + p0] for e in range(p.n_reps)]
            choice = decide(p.cands, errs, count, amax, amin)
            gChoice[u] = Int64(choice)
            gNz[u] = Int64(count)
            for e in range_constexpr(p.n_reps):
                gErr[e * nu + u] = errs[e]


class MoRDecideRangeKernel(MoRDecideKernel):
    """The decide kernel of a rule with the range metric: its entry also takes each piece's
    max and min non-zero |x|."""

    @cute.jit
    def __call__(
        self,
        mP: cute.Tensor,
        mCnt: cute.Tensor,
        mPmax: cute.Tensor,  # (pieces,) fp32
        mPmin: cute.Tensor,  # (pieces,) fp32
        mChoice: cute.Tensor,
        mErr: cute.Tensor,
        mNz: cute.Tensor,
        R: Int32,
        K: Int32,
        stream: cuda.CUstream,
    ):
        self.launch((mP, mCnt, mPmax, mPmin), (mChoice, mErr, mNz), R, K, stream)

    @cute.kernel
    def kernel(
        self,
        gP: cute.Tensor,
        gCnt: cute.Tensor,
        gPmax: cute.Tensor,
        gPmin: cute.Tensor,
        gChoice: cute.Tensor,
        gErr: cute.Tensor,
        gNz: cute.Tensor,
        R: Int32,
        K: Int32,
    ):
        self.body(gP, gCnt, gPmax, gPmin, gChoice, gErr, gNz, R, K)


# ---- measuring a tile: every representation's errors, the chosen outputs
@dataclass(frozen=True)
class Rep:
    """A representation the kernels measure: an element format or a high-precision dtype."""

    kind: str  # "elem" or "hp"
    name: str  # the format's or the dtype's name
    index: int = -1  # an element representation's position among them (scales, encodes)
    max: float = 0.0  # its largest finite value
    man_bits: int = 0
    emin_biased: int = 0  # 1 - bias + 127: the smallest normal's fp32 exponent field
    sign_shift: int = 0  # bits - 1: the sign bit of a code


@dataclass(frozen=True)
class MoRMeasureParams:
    """What measuring a tile and emitting its chosen outputs depend on."""

    iters: int  # row segments per thread
    log_iters: int
    input_dtype: str
    unit_row_bits: int  # log2 of a decision unit's piece inside one tile
    unit_col_bits: int
    scale_row_shift: int  # the scale block of row r, column c is (r >> row_shift, c >> col_shift)
    scale_col_shift: int
    reps: tuple[Rep, ...]  # every representation measured, in order
    cands: tuple[Candidate, ...]  # the rule's candidates (Candidate.rep: a position in reps)
    rounding: str  # the element encodes' rounding: "nearest" or "zero"
    high: str | None  # the dtype the kernels write high-precision values in; None: none
    high_words: int  # 32-bit words of a segment's high-precision values
    uses_range: bool  # some candidate takes the range metric (max / min |x|)
    unit_row_shift: int = 31  # the decision unit of row r, column c: (r >> shift, c >> shift)
    unit_col_shift: int = 31

    @property
    def n_elem(self) -> int:
        return sum(r.kind == "elem" for r in self.reps)

    @property
    def high_bytes(self) -> int:
        """Bytes of one high-precision value."""
        return self.high_words * 4 // VEC


def scaled(a: Float32, enc: Float32, q_max: float) -> Float32:
    """min(fp32(|x| * encode scale), q_max): the magnitude the element encode rounds (the clamp
    of fp32(x * scale), sign apart)."""
    return cute.arch.fmin(a * enc, Float32(q_max))


def signed(mag: Uint32, x: Float32, shift: int) -> Uint32:
    """The code of a magnitude code and x's sign: the sign bit iff x < 0, a zero magnitude
    included (a negative x that rounds to zero is negative zero; -0.0 is code 0)."""
    return mag | Uint32(cutlass.select_(x < Float32(0.0), Uint32(1 << shift), Uint32(0)))


def byte_words(cs: list) -> list:
    """One code per byte, four per 32-bit word, element 0 in the low byte."""
    return [
        cs[i] | (cs[i + 1] << Uint32(8)) | (cs[i + 2] << Uint32(16)) | (cs[i + 3] << Uint32(24))
        for i in range(0, len(cs), 4)
    ]


class MoRMeasure:
    """Measuring a tile: a segment's values, every representation's relative errors, the tree
    sums over each decision unit's piece, and the chosen candidate's outputs."""

    def __init__(self, params: MoRMeasureParams) -> None:
        self.p = params
        input_type = getattr(cutlass, DTYPES[params.input_dtype].cute)
        self.tile = MoRTile(params.iters, params.log_iters, input_type)
        self.encoders = {
            r.index: RepEncoder(r.man_bits, r.emin_biased, params.rounding)
            for r in params.reps
            if r.kind == "elem"
        }

    def tile_values(self, frag: cute.Tensor, ok) -> tuple[list, list]:
        """(x, |x| with 0 where ``ok`` is false) of one row segment, fp32 (exact)."""
        xf = cute.make_rmem_tensor((VEC,), Float32)
        xf.store(frag.load().to(Float32))
        xs = [xf[j] for j in range(VEC)]
        zero = Float32(0.0)
        return xs, [Float32(cutlass.select_(ok, abs(x), zero)) for x in xs]

    def scale_entries(self, gEnc: cute.Tensor, gDec: cute.Tensor, sb: Int32, nb: Int32):
        """(encode scales, decode factors) of every element representation for scale block
        sb."""
        n = self.p.n_elem
        enc = [gEnc[i * nb + sb] for i in range(n)]
        dec = [gDec[i * nb + sb] for i in range(n)]
        return enc, dec

    def row_errors(self, axs: list, enc: list, dec: list) -> list:
        """Per representation: the tree sum over the segment of |x - Q(x)| / |x| (0 for
        x = 0)."""
        ax64 = [Float64(a) for a in axs]
        nz = [a != Float32(0.0) for a in axs]
        safe = [Float64(cutlass.select_(n, a, Float64(1.0))) for n, a in zip(nz, ax64, strict=True)]
        sums = []
        for r in self.p.reps:
            if r.kind == "elem":
                # y = min(|x| * encode, max), its code's value times the exact decode factor
                encode = self.encoders[r.index].encode
                vals = [
                    Float64(encode(scaled(a, enc[r.index], r.max))[1]) * dec[r.index] for a in axs
                ]
            elif r.name == "bf16":
                vals = [Float64(round_bf16(a)) for a in axs]
            elif r.name == "fp16":
                vals = [Float64(round_fp16(a)) for a in axs]
            if r.kind == "hp" and r.name == "fp32":
                sums.append(Float64(0.0))  # fp32 is exact
            else:
                sums.append(
                    pairwise(
                        [
                            Float64(cutlass.select_(n, abs(a - v) / s, Float64(0.0)))
                            for n, a, v, s in zip(nz, ax64, vals, safe, strict=True)
                        ],
                        add,
                    )
                )
        return sums

    def row_outputs(self, xs: list, axs: list, enc: list, choice: Int32) -> tuple[list, list]:
        """(code words, high-precision words) of the segment for the chosen candidate: the
        chosen element format's codes (one byte each) or 0; the chosen high-precision value or
        0."""
        p = self.p
        codes = [Uint32(0), Uint32(0)]
        high = [Uint32(0)] * p.high_words if p.high else []
        for c in p.cands:
            r = p.reps[c.rep]
            if r.kind == "elem":
                encode = self.encoders[r.index].encode
                mags = [encode(scaled(a, enc[r.index], r.max))[0] for a in axs]
                words = byte_words(
                    [signed(m, x, r.sign_shift) for m, x in zip(mags, xs, strict=True)]
                )
                pick = choice == Int32(c.index)
                codes = [
                    Uint32(cutlass.select_(pick, w, k)) for w, k in zip(words, codes, strict=True)
                ]
            else:
                words = high_words(r.name, xs, p.high in ("bf16", "fp16"))
                pick = choice == Int32(c.index)
                high = [
                    Uint32(cutlass.select_(pick, w, h)) for w, h in zip(words, high, strict=True)
                ]
        return codes, high

    def measure_tile(self, frags, row0, col0, R, K, gEnc, gDec, red64, red32, redf, tidx):
        """The tree of each quantity over the decision unit's piece in this tile: the
        representations' error sums, the non-zero count (max |x| and min non-zero |x| for the
        range metric). One entry per group of the unit's slot_iters row segments; each segment
        is reduced across lanes as soon as it is measured (few values stay alive)."""
        p, tile = self.p, self.tile
        nbc = ((K - 1) >> p.scale_col_shift) + 1
        nb = (((R - 1) >> p.scale_row_shift) + 1) * nbc
        col_ok = col0 < K
        cc = cutlass.min(col0, K - VEC)
        zero, one, none = Float32(0.0), Int32(1), Int32(0)
        cw, rh = p.unit_col_bits, p.unit_row_bits
        errs = [tile.segment_tree(add, rh) for _ in range(len(p.reps))]
        counts = tile.segment_tree(add, rh)
        if p.uses_range:
            inf, fmax, fmin = Float32(math.inf), cute.arch.fmax, cute.arch.fmin
            maxes = tile.segment_tree(fmax, rh)
            mins = tile.segment_tree(fmin, rh)
        for i in range(p.iters):
            row = row0 + 2 * i
            ok = col_ok & (row < R)
            _, axs = self.tile_values(frags[i], ok)
            rc = cutlass.min(row, R - 1)
            sb = (rc >> p.scale_row_shift) * nbc + (cc >> p.scale_col_shift)
            enc, dec = self.scale_entries(gEnc, gDec, sb, nb)
            for tree, s in zip(errs, self.row_errors(axs, enc, dec), strict=True):
                tree.push(lane_reduce(s, add, cw, rh))
            n = pairwise([Int32(cutlass.select_(a != zero, one, none)) for a in axs], add)
            counts.push(lane_reduce(n, add, cw, rh))
            if p.uses_range:
                maxes.push(lane_reduce(pairwise(axs, fmax), fmax, cw, rh))
                low = pairwise([Float32(cutlass.select_(a != zero, a, inf)) for a in axs], fmin)
                mins.push(lane_reduce(low, fmin, cw, rh))
        return (
            [tile.warp_reduce(t.slots(), add, rh, red64, tidx) for t in errs],
            tile.warp_reduce(counts.slots(), add, rh, red32, tidx),
            tile.warp_reduce(maxes.slots(), fmax, rh, redf, tidx) if p.uses_range else [],
            tile.warp_reduce(mins.slots(), fmin, rh, redf, tidx) if p.uses_range else [],
        )


# ---- the kernels that measure a tile or write its chosen outputs
class MoRTileKernel:
    """What the quantize, measure and emit kernels share: their parameters, the tile mapping and
    the measurement. The entry (``__call__``, ``kernel``) takes exactly the rule's tensors, so
    a rule with or without high-precision values or range statistics has a subclass of its own
    (the PTX names the kernel's parameters); ``body`` takes None for what the rule lacks."""

    def __init__(self, params: MoRMeasureParams, arch: str) -> None:
        self.p = params
        self.arch = arch
        self.m = MoRMeasure(params)
        self.tile = self.m.tile

    @property
    def threads(self) -> int:
        return self.tile.warps * 32

    def launch(self, mX: cute.Tensor, tensors: list, stream) -> None:
        """One CTA per 128 x 128 tile of mX: the kernel takes mX's row segments, ``tensors``,
        then R, K and the tiles along K."""
        R, K = mX.shape[0], mX.shape[1]
        tiles_k, grid = tiles(R, K)
        self.kernel(segments(mX), *tensors, R, K, tiles_k).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream
        )

    def outputs(self, mQ: cute.Tensor, mH, R, K) -> list:
        """The codes (and the high-precision values, with mH) as 32-bit words."""
        out = [words(mQ, R * K // 4)]
        if mH is not None:
            out.append(words(mH, R * K * self.p.high_bytes // 4))
        return out

    def prologue(self, gX, gEnc, gDec, R, K, tiles_k):
        """This thread's place and fragments, the shared reduction buffers, each unit's errors,
        non-zero counts and ranges: (row0, col0, errs, counts, maxes, mins)."""
        threads = self.tile.warps * 32
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row0, col0 = self.tile.thread_origin(tidx, bidx, tiles_k)
        frags = self.tile.load_tile(gX, row0, col0, R, K)
        smem = cutlass.memory.SmemAllocator()
        red64 = smem.allocate_tensor(Float64, cute.make_layout(threads), byte_alignment=16)
        red32 = smem.allocate_tensor(Int32, cute.make_layout(threads), byte_alignment=16)
        redf = smem.allocate_tensor(Float32, cute.make_layout(threads), byte_alignment=16)

        errs, counts, maxes, mins = self.m.measure_tile(
            frags, row0, col0, R, K, gEnc, gDec, red64, red32, redf, tidx
        )
        return row0, col0, errs, counts, maxes, mins


class MoRQuantizeKernel(MoRTileKernel):
    """Measure, decide and quantize in one pass: per tile, every representation's errors, the
    sums of each decision unit (a unit fits in the tile), the decision, the chosen outputs.
    The entry of a rule with a high-precision candidate (``MoRQuantizeCodesKernel``: without)."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (R, K) input
        mEnc: cute.Tensor,  # (N_ELEM * scale blocks,) fp32 encode scales
        mDec: cute.Tensor,  # (N_ELEM * scale blocks,) float64 decode factors
        mQ: cute.Tensor,  # (R, K) uint8 codes
        mH: cute.Tensor,  # (R, K) high-precision values
        mChoice: cute.Tensor,  # (units,) int64
        mErr: cute.Tensor,  # (N_REPS * units,) float64
        mNz: cute.Tensor,  # (units,) int64
        stream: cuda.CUstream,
    ):
        outs = self.outputs(mQ, mH, mX.shape[0], mX.shape[1])
        self.launch(mX, [mEnc, mDec, *outs, mChoice, mErr, mNz], stream)

    @cute.kernel
    def kernel(
        self,
        gX: cute.Tensor,
        gEnc: cute.Tensor,
        gDec: cute.Tensor,
        gQ: cute.Tensor,
        gH: cute.Tensor,
        gChoice: cute.Tensor,
        gErr: cute.Tensor,
        gNz: cute.Tensor,
        R: Int32,
        K: Int32,
        tiles_k: Int32,
    ):
        self.body(gX, gEnc, gDec, gQ, gH, gChoice, gErr, gNz, R, K, tiles_k)

    @cute.jit
    def body(self, gX, gEnc, gDec, gQ, gH, gChoice, gErr, gNz, R, K, tiles_k):
        p = self.p
        row0, col0, errs, counts, maxes, mins = self.prologue(gX, gEnc, gDec, R, K, tiles_k)

        # ---- decide each unit this thread holds; one thread per unit writes its statistics
        nuc = ((K - 1) >> p.unit_col_shift) + 1
        nu = (((R - 1) >> p.unit_row_shift) + 1) * nuc
        slot_iters = self.tile.slot_iters(p.unit_row_bits)
        choices = []
        for s in range_constexpr(len(counts)):
            choice = decide(
                p.cands,
                [e[s] for e in errs],
                counts[s],
                maxes[s] if p.uses_range else None,
                mins[s] if p.uses_range else None,
            )
            choices.append(choice)
            row = row0 + 2 * (s * slot_iters)
            if writes(row, col0, p.unit_row_bits, p.unit_col_bits) & (row < R) & (col0 < K):
                u = (row >> p.unit_row_shift) * nuc + (col0 >> p.unit_col_shift)
                gChoice[u] = Int64(choice)
                gNz[u] = Int64(counts[s])
                for e in range_constexpr(len(p.reps)):
                    gErr[e * nu + u] = errs[e][s]

        # ---- the chosen outputs, segment by segment, from the input read again (the tile was
        # just read, so from cache): holding it through the measurement costs registers
        frags = self.tile.load_tile(gX, row0, col0, R, K)
        nbc = ((K - 1) >> p.scale_col_shift) + 1
        nb = (((R - 1) >> p.scale_row_shift) + 1) * nbc
        cc = cutlass.min(col0, K - VEC)
        for i in range_constexpr(p.iters):
            row = row0 + 2 * i
            xs, axs = self.m.tile_values(frags[i], col0 < K)
            rc = cutlass.min(row, R - 1)
            sb = (rc >> p.scale_row_shift) * nbc + (cc >> p.scale_col_shift)
            enc, _ = self.m.scale_entries(gEnc, gDec, sb, nb)
            codes, high = self.m.row_outputs(xs, axs, enc, choices[i // slot_iters])
            if (row < R) & (col0 < K):  # predicated stores of the segment
                first = row * K + col0  # its first element
                gQ[first // 4] = codes[0]
                gQ[first // 4 + 1] = codes[1]
                if const_expr(p.high is not None):
                    for j in range_constexpr(p.high_words):
                        gH[first * p.high_bytes // 4 + j] = high[j]


class MoRQuantizeCodesKernel(MoRQuantizeKernel):
    """The quantize kernel of a rule without a high-precision candidate: codes only."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mEnc: cute.Tensor,
        mDec: cute.Tensor,
        mQ: cute.Tensor,
        mChoice: cute.Tensor,
        mErr: cute.Tensor,
        mNz: cute.Tensor,
        stream: cuda.CUstream,
    ):
        outs = self.outputs(mQ, None, mX.shape[0], mX.shape[1])
        self.launch(mX, [mEnc, mDec, *outs, mChoice, mErr, mNz], stream)

    @cute.kernel
    def kernel(
        self,
        gX: cute.Tensor,
        gEnc: cute.Tensor,
        gDec: cute.Tensor,
        gQ: cute.Tensor,
        gChoice: cute.Tensor,
        gErr: cute.Tensor,
        gNz: cute.Tensor,
        R: Int32,
        K: Int32,
        tiles_k: Int32,
    ):
        self.body(gX, gEnc, gDec, gQ, None, gChoice, gErr, gNz, R, K, tiles_k)


class MoRMeasureKernel(MoRTileKernel):
    """Per tile: every representation's errors summed per piece (the part of a decision unit in
    the tile), the non-zero count (and max / min non-zero |x| for the range metric) per piece.
    The entry of a rule without the range metric (``MoRMeasureRangeKernel``: with it)."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (R, K) input
        mEnc: cute.Tensor,
        mDec: cute.Tensor,
        mP: cute.Tensor,  # (N_REPS * pieces,) float64 partial sums
        mCnt: cute.Tensor,  # (pieces,) int32
        stream: cuda.CUstream,
    ):
        self.launch(mX, [mEnc, mDec, mP, mCnt], stream)

    @cute.kernel
    def kernel(
        self,
        gX: cute.Tensor,
        gEnc: cute.Tensor,
        gDec: cute.Tensor,
        gP: cute.Tensor,
        gCnt: cute.Tensor,
        R: Int32,
        K: Int32,
        tiles_k: Int32,
    ):
        self.body(gX, gEnc, gDec, gP, gCnt, None, None, R, K, tiles_k)

    @cute.jit
    def body(self, gX, gEnc, gDec, gP, gCnt, gPmax, gPmin, R, K, tiles_k):
        p = self.p
        row0, col0, errs, counts, maxes, mins = self.prologue(gX, gEnc, gDec, R, K, tiles_k)

        npc = ((K - 1) >> p.unit_col_bits) + 1
        np_ = (((R - 1) >> p.unit_row_bits) + 1) * npc
        slot_iters = self.tile.slot_iters(p.unit_row_bits)
        for s in range_constexpr(len(counts)):
            row = row0 + 2 * (s * slot_iters)
            if writes(row, col0, p.unit_row_bits, p.unit_col_bits) & (row < R) & (col0 < K):
                q = (row >> p.unit_row_bits) * npc + (col0 >> p.unit_col_bits)
                gCnt[q] = counts[s]
                for e in range_constexpr(len(p.reps)):
                    gP[e * np_ + q] = errs[e][s]
                if const_expr(p.uses_range):
                    gPmax[q] = maxes[s]
                    gPmin[q] = mins[s]


class MoRMeasureRangeKernel(MoRMeasureKernel):
    """The measure kernel of a rule with the range metric: its entry also takes each piece's
    max and min non-zero |x|."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mEnc: cute.Tensor,
        mDec: cute.Tensor,
        mP: cute.Tensor,
        mCnt: cute.Tensor,
        mPmax: cute.Tensor,  # (pieces,) fp32
        mPmin: cute.Tensor,  # (pieces,) fp32
        stream: cuda.CUstream,
    ):
        self.launch(mX, [mEnc, mDec, mP, mCnt, mPmax, mPmin], stream)

    @cute.kernel
    def kernel(
        self,
        gX: cute.Tensor,
        gEnc: cute.Tensor,
        gDec: cute.Tensor,
        gP: cute.Tensor,
        gCnt: cute.Tensor,
        gPmax: cute.Tensor,
        gPmin: cute.Tensor,
        R: Int32,
        K: Int32,
        tiles_k: Int32,
    ):
        self.body(gX, gEnc, gDec, gP, gCnt, gPmax, gPmin, R, K, tiles_k)


class MoREmitKernel(MoRTileKernel):
    """Per tile: the codes / high-precision values of each unit's chosen candidate. The entry
    of a rule with a high-precision candidate (``MoREmitCodesKernel``: without)."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mEnc: cute.Tensor,
        mDec: cute.Tensor,
        mChoice: cute.Tensor,  # (units,) int64
        mQ: cute.Tensor,  # (R, K) uint8 codes
        mH: cute.Tensor,  # (R, K) high-precision values
        stream: cuda.CUstream,
    ):
        outs = self.outputs(mQ, mH, mX.shape[0], mX.shape[1])
        self.launch(mX, [mEnc, mDec, mChoice, *outs], stream)

    @cute.kernel
    def kernel(
        self,
        gX: cute.Tensor,
        gEnc: cute.Tensor,
        gDec: cute.Tensor,
        gChoice: cute.Tensor,
        gQ: cute.Tensor,
        gH: cute.Tensor,
        R: Int32,
        K: Int32,
        tiles_k: Int32,
    ):
        self.body(gX, gEnc, gDec, gChoice, gQ, gH, R, K, tiles_k)

    @cute.jit
    def body(self, gX, gEnc, gDec, gChoice, gQ, gH, R, K, tiles_k):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row0, col0 = self.tile.thread_origin(tidx, bidx, tiles_k)
        frags = self.tile.load_tile(gX, row0, col0, R, K)
        nuc = ((K - 1) >> p.unit_col_shift) + 1
        nbc = ((K - 1) >> p.scale_col_shift) + 1
        nb = (((R - 1) >> p.scale_row_shift) + 1) * nbc
        cc = cutlass.min(col0, K - VEC)
        for i in range_constexpr(p.iters):
            row = row0 + 2 * i
            rc = cutlass.min(row, R - 1)
            choice = Int32(gChoice[(rc >> p.unit_row_shift) * nuc + (cc >> p.unit_col_shift)])
            xs, axs = self.m.tile_values(frags[i], col0 < K)
            sb = (rc >> p.scale_row_shift) * nbc + (cc >> p.scale_col_shift)
            enc, _ = self.m.scale_entries(gEnc, gDec, sb, nb)
            codes, high = self.m.row_outputs(xs, axs, enc, choice)
            if (row < R) & (col0 < K):  # predicated stores of the segment
                first = row * K + col0  # its first element
                gQ[first // 4] = codes[0]
                gQ[first // 4 + 1] = codes[1]
                if const_expr(p.high is not None):
                    for j in range_constexpr(p.high_words):
                        gH[first * p.high_bytes // 4 + j] = high[j]


class MoREmitCodesKernel(MoREmitKernel):
    """The emit kernel of a rule without a high-precision candidate: codes only."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mEnc: cute.Tensor,
        mDec: cute.Tensor,
        mChoice: cute.Tensor,
        mQ: cute.Tensor,
        stream: cuda.CUstream,
    ):
        outs = self.outputs(mQ, None, mX.shape[0], mX.shape[1])
        self.launch(mX, [mEnc, mDec, mChoice, *outs], stream)

    @cute.kernel
    def kernel(
        self,
        gX: cute.Tensor,
        gEnc: cute.Tensor,
        gDec: cute.Tensor,
        gChoice: cute.Tensor,
        gQ: cute.Tensor,
        R: Int32,
        K: Int32,
        tiles_k: Int32,
    ):
        self.body(gX, gEnc, gDec, gChoice, gQ, None, R, K, tiles_k)


__all__ = [
    "Candidate",
    "MoRAmaxKernel",
    "MoRDecideKernel",
    "MoRDecideParams",
    "MoRDecideRangeKernel",
    "MoREmitCodesKernel",
    "MoREmitKernel",
    "MoRMeasure",
    "MoRMeasureKernel",
    "MoRMeasureParams",
    "MoRMeasureRangeKernel",
    "MoRQuantizeCodesKernel",
    "MoRQuantizeKernel",
    "MoRScaleParams",
    "MoRScalesKernel",
    "MoRTile",
    "MoRTileKernel",
    "Rep",
    "RepEncoder",
    "SegmentTree",
    "abs_bits",
    "add",
    "block_scale",
    "byte_words",
    "decide",
    "f16x2",
    "high_words",
    "lane_reduce",
    "pairwise",
    "pow2_f64",
    "round_bf16",
    "round_fp16",
    "scaled",
    "segments",
    "signed",
    "split_fp32",
    "tiles",
    "words",
    "writes",
]
