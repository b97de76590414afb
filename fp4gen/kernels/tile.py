"""The tile mapping of the tile quantize kernels (a columnwise copy, rowwise + columnwise copies
from one read of x, 2D BxB tiles) and the device helpers that work on a thread's strip.

A thread holds a strip of ``rows`` rows x ``vec`` columns of x (one vector load per row). A warp
is ``lanes_k`` lanes along K (fastest) x ``lanes_m`` along M, a CTA ``warps_k`` x ``warps_m``
warps, so a CTA covers a ``tile_m`` x ``tile_k`` tile. A row block (1D) or tile (2D) spans
``row_lanes`` lanes along K, a column block (1D) or tile (2D) ``col_lanes`` lanes along M in
``col_warps`` warps (more than one: partial amaxes meet in shared memory). Rows past M are
loaded as a row of the same block (or, on the (tiles along K, tiles along M) grid with M a
multiple of ``rows``, the strip as the last ``rows`` rows) and never stored; columns past K are
clamped likewise, so no load needs a predicate.

``TileParams`` holds the mapping and what the helpers depend on; ``TileStrip`` holds the
helpers: the strip's values as fp32 or as 32-bit words, amaxes (balanced trees that propagate
NaN), the column RHT, butterfly maxes across lanes, the transposes of packed codes, the Philox
words shared by the lanes of a row, the predicated stores of codes and scales, the launch grid.
Plain Python (``strip_origin_2d`` is a ``cute.jit`` function: it branches on the grid at run
time): run while a kernel is traced.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr, range_constexpr

from fp4gen.kernels import philox, quant_ptx
from fp4gen.kernels.hadamard import signed_butterflies
from fp4gen.kernels.scale import (
    FLT_MAX,
    global_scales,
)
from fp4gen.vocab import DTYPES

MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y


@dataclass(frozen=True)
class TileParams:
    """The tile mapping and the constants the strip helpers read."""

    input_dtype: str  # "bf16", "fp16" or "fp32"
    rows: int  # rows of a thread's strip
    vec: int  # columns of a thread's strip
    lanes_k: int
    lanes_m: int
    warps_k: int
    warps_m: int
    row_lanes: int  # lanes along K sharing a row block or tile
    col_lanes: int  # lanes along M sharing a column block or tile
    grid_2d: bool  # a (tiles along K, tiles along M) grid, 1-D past MAX_GRID_Y tile rows
    whole_strips: bool  # M % rows == 0 on that grid: a strip is whole or past M
    elem_bits: int
    fp32_scales: bool  # scales are stored as fp32 values (else one code byte)
    global_scale: bool
    scale_cap: float  # the saturation point of d_b
    rht_size: int = 0  # the columnwise copy's RHT along M; 0: none
    rht_signs: tuple[int, ...] = ()
    rht_scale: float = 1.0  # fp32(1 / sqrt(rht_size))
    row_share: int = 1  # lanes along K whose row segments make up one Philox call
    row_rand_words: int = 0  # Philox words of one row segment (row_share > 1)

    @property
    def threads(self) -> int:
        return 32 * self.warps_k * self.warps_m

    @property
    def rht_tail(self) -> bool:
        """Whether rows past M (loaded as duplicates) can reach a column RHT's result: a strip
        of several RHT chunks (one in, the next past M) or a column block across strips (a
        strip past M joins the block's amax). Else a strip is whole or out and never stored."""
        return self.rht_size > 0 and (self.rows > self.rht_size or self.col_lanes > 1)

    @property
    def tile_k(self) -> int:
        return self.vec * self.lanes_k * self.warps_k

    @property
    def tile_m(self) -> int:
        return self.rows * self.lanes_m * self.warps_m

    @property
    def in_bytes(self) -> int:
        return DTYPES[self.input_dtype].size

    @property
    def input_type(self) -> type:
        return getattr(cutlass, DTYPES[self.input_dtype].cute)

    @property
    def cpair(self) -> int:
        """Values per 32-bit word of the strip."""
        return max(1, 4 // self.in_bytes)

    @property
    def words(self) -> int:
        """Words per row of the strip."""
        return self.vec // self.cpair

    @property
    def row_offsets(self) -> tuple[int, ...]:
        """Lane offsets of the butterflies across a row block's lanes."""
        return tuple(1 << i for i in range(self.row_lanes.bit_length() - 1))

    @property
    def col_offsets(self) -> tuple[int, ...]:
        """Lane offsets of the butterflies across a column block's lanes."""
        return tuple(self.lanes_k << i for i in range(self.col_lanes.bit_length() - 1))


def fmax_nan(a: Float32, b: Float32) -> Float32:
    """max(a, b), NaN if either is NaN (max.NaN.f32: one instruction, as the plain max)."""
    return cute.arch.fmax(a, b, nan=True)


def absmax(xs: list) -> Float32:
    """max |x| over fp32 scalars (a balanced tree); NaN if any is NaN."""
    vals = [abs(x) for x in xs]
    while len(vals) > 1:
        nxt = [fmax_nan(vals[i], vals[i + 1]) for i in range(0, len(vals) - 1, 2)]
        if len(vals) % 2:
            nxt.append(vals[-1])
        vals = nxt
    return vals[0]


def absmax_bf16_word(words: list) -> Uint32:
    """The packed |x| maxima of two or more bf16x2 words, half by half (a balanced HMNMX2 tree);
    NaN where any is NaN."""
    while len(words) > 1:
        nxt = [quant_ptx.bf16x2_absmax(words[i], words[i + 1]) for i in range(0, len(words) - 1, 2)]
        if len(words) % 2:
            nxt.append(words[-1])
        words = nxt
    return words[0]


def absmax_bf16(words: list) -> Float32:
    """max |x| over bf16x2 words: packed HMNMX2 (a balanced tree), then one fp32 max of the
    halves (exact); NaN if any is NaN."""
    h = absmax_bf16_word(words)
    return fmax_nan(
        abs((h << Uint32(16)).bitcast(Float32)), abs((h & Uint32(0xFFFF0000)).bitcast(Float32))
    )


def column(rows: list, j: int) -> list:
    """Element j of every row: a column of the strip."""
    return [xs[j] for xs in rows]


def scaled(xs: list, e: Float32) -> list:
    """fp32(x * e) for every x, with the sign bit x < 0 (scale_value: -0.0 gives +0.0)."""
    return [quant_ptx.scale_value(x, e) for x in xs]


def butterfly_max(v: Float32, offsets) -> Float32:
    """max of v over the lanes that differ from this one in the given lane-offset bits."""
    for off in offsets:
        v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=off))
    return v


def to_store(words: list, word_bytes: int, n: int) -> list:
    """The packed words as n store values of word_bytes bytes each (in the low bytes)."""
    if word_bytes == 4:
        return words[:n]
    out = []
    for w in words:
        out += [w >> Uint32(8 * word_bytes * i) if i else w for i in range(4 // word_bytes)]
    return out[:n]


def swizzled_offset(row: Int32, col: Int32, c4: Int32) -> Int32:
    """Byte offset of scale (row, col) in the 128x4 tensor-core layout (docs/numerics.md 3):
    ((r // 128) * ceil(C/4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4."""
    atom = (row >> 7) * c4 + (col >> 2)  # 512-byte atom of 128 rows x 4 scales
    return atom * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4 + (col & 3)


class TileStrip:
    """The device helpers of a tile kernel's strip (module docstring)."""

    def __init__(self, params: TileParams) -> None:
        self.p = params

    # ---- the strip's values
    def to_f32(self, frag: cute.Tensor) -> list:
        """The vec input values of a register fragment as fp32 scalars (exact)."""
        vec = self.p.vec
        xf = cute.make_rmem_tensor((vec,), Float32)
        xf.store(frag.load().to(Float32))
        return [xf[j] for j in range(vec)]

    def rows_f32(self, frags: list) -> list:
        """Every row of the strip as fp32 scalars."""
        return [self.to_f32(frag) for frag in frags]

    def frag_words(self, frag: cute.Tensor) -> list:
        """A row vector of the strip as 32-bit words (the first value in the low bits)."""
        raw = cute.recast_tensor(frag, Uint32)
        return [raw[i] for i in range(self.p.vec * self.p.in_bytes // 4)]

    def words_f32(self, words: list) -> list:
        """The values of 32-bit words of the strip as fp32 scalars (exact)."""
        p = self.p
        if p.in_bytes == 4:
            return [w.bitcast(Float32) for w in words]
        if p.input_dtype == "bf16":
            out = []
            for w in words:
                out += [
                    (w << Uint32(16)).bitcast(Float32),
                    (w & Uint32(0xFFFF0000)).bitcast(Float32),
                ]
            return out
        raw = cute.make_rmem_tensor((len(words),), Uint32)
        for i, w in enumerate(words):
            raw[i] = w
        vals = cute.recast_tensor(raw, p.input_type)
        xf = cute.make_rmem_tensor((len(words) * p.cpair,), Float32)
        xf.store(vals.load().to(Float32))
        return [xf[i] for i in range(len(words) * p.cpair)]

    def words_absmax(self, words: list, xs: list, lo: int, hi: int) -> Float32:
        """max |x| over values lo..hi-1 of a row's words."""
        if self.p.input_dtype == "bf16":
            return absmax_bf16(words[lo // 2 : hi // 2])
        return absmax(xs[lo:hi])

    def strip_absmax(self, frags: list, xfs: list) -> Float32:
        """max |x| over a thread's whole strip."""
        if self.p.input_dtype == "bf16":
            return absmax_bf16([w for frag in frags for w in self.frag_words(frag)])
        return absmax([x for xs in xfs for x in xs])

    def first_columns(self, strip: list) -> list:
        """The cpair columns held by the first word of every row, as cpair lists of fp32."""
        p = self.p
        vals = self.words_f32([strip[i * p.words] for i in range(p.rows)])
        return [[vals[i * p.cpair + q] for i in range(p.rows)] for q in range(p.cpair)]

    def column_absmaxes(self, words: list) -> list:
        """max |x| of each of the cpair columns that ``words`` (one 32-bit word per row) hold.
        bf16: one packed HMNMX2 tree over the words, then each half (exact: the max of bf16
        values is one of them); other inputs: fp32 values."""
        p = self.p
        if p.input_dtype == "bf16":
            h = words[0]
            if len(words) > 1:
                h = absmax_bf16_word(words)
            return [
                abs((h << Uint32(16)).bitcast(Float32)),
                abs((h & Uint32(0xFFFF0000)).bitcast(Float32)),
            ]
        vals = self.words_f32(words)
        n = len(words)
        return [absmax([vals[i * p.cpair + q] for i in range(n)]) for q in range(p.cpair)]

    def rotate_words(self, strip: list) -> list:
        """Every row's words rotated by one: the next cpair columns come first."""
        p = self.p
        out = []
        for i in range(p.rows):
            row = strip[i * p.words : (i + 1) * p.words]
            out += row[1:] + row[:1]
        return out

    # ---- the column RHT
    def butterflies(self, xs: list) -> list:
        """Signs, then butterflies h = 1, 2, ..., size/2 in fp32 (docs/numerics.md section 4),
        on every chunk of xs; a negative sign folds into the first add as a negation."""
        return signed_butterflies(xs, self.p.rht_size, self.p.rht_signs)

    def bf16_round(self, v: list):
        """fp32(1/sqrt(d)) * v rounded to bf16 (RNE): (fp32 scalars, bf16x2 words)."""
        v = [t * Float32(self.p.rht_scale) for t in v]
        out = []
        words = []
        for i in range(0, len(v), 2):
            w = quant_ptx.cvt_bf16x2(v[i], v[i + 1])
            words.append(w)
            out.append((w & Uint32(0xFFFF0000)).bitcast(Float32))
            out.append((w << Uint32(16)).bitcast(Float32))
        return out, words

    def rows_below(self, xs: list, row0: Int32, M: Int32) -> list:
        """xs (one value per row of the strip) with the rows at or past M as +0.0: the strip
        loads them as duplicates of a row of x, which leave a block amax unchanged but not once
        transformed, so the column RHT must see the zero padding the reference transforms
        (docs/numerics.md 3: a partial block is zero-padded; a strip of lcm(B, d) rows can reach
        past M by whole chunks of d rows)."""
        return [cutlass.select_(row0 + Int32(i) < M, x, Float32(0.0)) for i, x in enumerate(xs)]

    def rht_amax(self, xs: list) -> Float32:
        """max |RHT(x)| over the chunks of xs without rounding every value: scaling by
        fp32(1/sqrt(d)) and rounding to bf16 are monotone and odd, so the max of the rounded
        values is the rounded max."""
        m = absmax(self.butterflies(xs)) * Float32(self.p.rht_scale)
        return (quant_ptx.cvt_bf16x2(m, m) & Uint32(0xFFFF0000)).bitcast(Float32)

    # ---- scales
    def scale_bits(self, code) -> Uint32:
        """A scale as the bits to store: the fp32 value of fp32 scales, else its code."""
        if self.p.fp32_scales:
            return code.bitcast(Uint32)
        return Uint32(code)

    def encode_factor(self, code: Uint32, s_dec) -> Float32:
        """e_b of the e4m3 scale code (docs/numerics.md 2.5): min(1 / (s_b [* S_dec]), FLT_MAX)."""
        if self.p.global_scale:
            s_b = quant_ptx.cvt_e4m3_to_f32(code)
            return cute.arch.fmin(Float32(1.0) / (s_b * s_dec), Float32(FLT_MAX))
        return cute.arch.fmin(Float32(1.0) / quant_ptx.cvt_e4m3_to_f32(code), Float32(FLT_MAX))

    def block_scale_table(self, amax_b: Float32, k_enc: Float32, table: cute.Tensor):
        """The e4m3 block scale with e_b read from the copy's table of encode factors: (scale
        code, e_b)."""
        d_b = cute.arch.fmin(amax_b * k_enc, Float32(self.p.scale_cap))
        code = quant_ptx.cvt_f32_to_e4m3(d_b)  # RNE, satfinite: the hardware convert is the rule
        return code, table[Int32(code)]

    # ---- packed codes
    def transpose_codes(self, words: list) -> list:
        """Transpose an n x n matrix of codes (n = 32 // bits) held as one word per row (code j
        of word i = element (i, j)): recursive 2x2 block swaps, byte-sized and larger blocks by
        byte permutes, nibble blocks by masks."""
        n = 32 // self.p.elem_bits
        w = list(words)
        s = n // 2
        while s >= 1:
            bits = s * self.p.elem_bits  # width of a block of s codes
            for i in range(n):
                if (i // s) % 2:
                    continue
                a, b = w[i], w[i + s]
                if bits == 16:
                    w[i], w[i + s] = quant_ptx.prmt(a, b, 0x5410), quant_ptx.prmt(a, b, 0x7632)
                elif bits == 8:
                    w[i], w[i + s] = quant_ptx.prmt(a, b, 0x6240), quant_ptx.prmt(a, b, 0x7351)
                else:
                    low = sum(((1 << bits) - 1) << (2 * bits * g) for g in range(32 // (2 * bits)))
                    t = ((a >> Uint32(bits)) ^ b) & Uint32(low)
                    w[i], w[i + s] = a ^ (t << Uint32(bits)), b ^ t
            s //= 2
        return w

    def transpose_strip(self, row_words: list) -> list:
        """Packed codes of the strip's rows (one word each) -> each column's packed codes (rows
        codes in rows / n words)."""
        n = 32 // self.p.elem_bits
        cols = [[] for _ in range(self.p.vec)]
        for g in range(0, self.p.rows, n):
            t = self.transpose_codes([row_words[g + i][0] for i in range(n)])
            for j in range(self.p.vec):
                cols[j].append(t[j])
        return cols

    # ---- where the strip is, and loading it
    def strip_origin(self, tidx: Int32, bidx: Int32, tiles_k: Int32):
        """(first row, first column) of this thread's strip, and its (warp row, lane row, lane
        column), on a 1-D grid: CTA t takes tile (t // tiles_k, t % tiles_k)."""
        p = self.p
        warp = tidx // 32
        lane = tidx - warp * 32
        wm = warp // p.warps_k
        wk = warp - wm * p.warps_k
        lm = lane // p.lanes_k
        lk = lane - lm * p.lanes_k
        tm = bidx // tiles_k
        tk = bidx - tm * tiles_k
        row0 = tm * p.tile_m + (wm * p.lanes_m + lm) * p.rows
        col0 = tk * p.tile_k + (wk * p.lanes_k + lk) * p.vec
        return row0, col0, wm, lm, lk

    @cute.jit
    def strip_origin_2d(self, tidx: Int32, tiles_k: Int32):
        """strip_origin on the (tiles along K, tiles along M) grid, or 1-D past MAX_GRID_Y tile
        rows (then the tile index is divided by tiles_k: the only case that pays for an integer
        division)."""
        p = self.p
        bidx, bidy, _ = cute.arch.block_idx()
        _, gdy, _ = cute.arch.grid_dim()
        warp = tidx // 32
        lane = tidx - warp * 32
        wm = warp // p.warps_k
        wk = warp - wm * p.warps_k
        lm = lane // p.lanes_k
        lk = lane - lm * p.lanes_k
        tm = Int32(bidy)
        tk = Int32(bidx)
        if gdy == 1:
            tm = Int32(bidx) // tiles_k
            tk = Int32(bidx) - tm * tiles_k
        row0 = tm * p.tile_m + (wm * p.lanes_m + lm) * p.rows
        col0 = tk * p.tile_k + (wk * p.lanes_k + lk) * p.vec
        return row0, col0, wm, lm, lk

    def load_strip(self, gX: cute.Tensor, row0: Int32, col0: Int32, M: Int32, K: Int32) -> list:
        """The rows row vectors of the strip, columns clamped to K - vec and rows to M - 1 (or,
        ``whole_strips``, the strip to the last rows rows: one past M is never stored), so every
        load is in bounds and needs no predicate."""
        p = self.p
        kv = K // p.vec
        frags = []
        if p.whole_strips:
            u0 = cutlass.min(row0, M - p.rows) * kv + cutlass.min(col0, K - p.vec) // p.vec
            for i in range(p.rows):
                frag = cute.make_rmem_tensor((p.vec,), p.input_type)
                cute.autovec_copy(gX[u0 + i * kv, None], frag)
                frags.append(frag)
            return frags
        cu = cutlass.min(col0, K - p.vec) // p.vec
        for i in range(p.rows):
            r = cutlass.min(row0 + i, M - 1)
            frag = cute.make_rmem_tensor((p.vec,), p.input_type)
            cute.autovec_copy(gX[r * kv + cu, None], frag)
            frags.append(frag)
        return frags

    def units(self, mX: cute.Tensor) -> cute.Tensor:
        """(M, K) compact row-major -> (M*K/vec, vec): row r's vector at column c is unit
        r * K/vec + c/vec."""
        vec = self.p.vec
        n = mX.shape[0] * (mX.shape[1] // vec)
        return cute.make_tensor(mX.iterator, cute.make_layout((n, vec), stride=(vec, 1)))

    def grid(self, M, K):
        """(tiles_k, grid): the (tiles along K, tiles along M) grid, 1-D past MAX_GRID_Y tile
        rows; without ``grid_2d`` a 1-D grid of tiles (its size)."""
        p = self.p
        tiles_k = (K + (p.tile_k - 1)) // p.tile_k
        tiles_m = (M + (p.tile_m - 1)) // p.tile_m
        if not p.grid_2d:
            return tiles_k, tiles_m * tiles_k
        two_d = tiles_m <= MAX_GRID_Y
        grid_x = Int32(cutlass.select_(two_d, tiles_k, tiles_k * tiles_m))
        grid_y = Int32(cutlass.select_(two_d, tiles_m, Int32(1)))
        return tiles_k, [grid_x, grid_y, 1]

    # ---- random words shared along a row
    def shared_row_words(
        self, r0: Int32, col0: Int32, K: Int32, keys: list, off_lo: Uint32, off_hi: Uint32
    ) -> list:
        """The random words of this lane's segments of rows r0 .. r0 + row_share - 1, one list
        per row (docs/numerics.md 5). A Philox call covers the row segments of row_share
        neighbouring lanes; rather than every lane computing the call and keeping its slice,
        lane `part` computes the call of row r0 + part and the lanes trade slices by butterfly
        shuffles: one call per lane for row_share rows."""
        share, nw, vec = self.p.row_share, self.p.row_rand_words, self.p.vec
        part = (Uint32(col0) // Uint32(vec)) % Uint32(share)
        i0 = (Uint32(r0) + part) * Uint32(K) + Uint32(col0)
        call = philox.philox4x32_10(i0 // Uint32(vec * share), Uint32(0), off_lo, off_hi, keys)
        own = philox.call_slice(call, part, nw)
        got = {}  # d -> this lane's slice of the call of row r0 + (part ^ d), from lane ^ d
        for d in range(1, share):
            send = philox.call_slice(call, part ^ Uint32(d), nw)
            got[d] = [cute.arch.shuffle_sync_bfly(w, offset=d) for w in send]
        rows = []
        for p in range(share):
            words = own
            for d in range(1, share):
                words = [
                    cutlass.select_(part == Uint32(p ^ d), Uint32(got[d][w]), words[w])
                    for w in range(nw)
                ]
            rows.append(words)
        return rows


def place_on_grid(strip: TileStrip, tidx: Int32, tiles_k: Int32) -> tuple:
    """(the CTA's tile index or None, row0, col0, warp row, lane row, lane column) of this
    thread's strip on the launch grid: ``strip_origin_2d`` on the 2-D grid (no tile index),
    else ``strip_origin`` of the 1-D grid's block index."""
    if const_expr(strip.p.grid_2d):
        return None, *strip.strip_origin_2d(tidx, tiles_k)
    bidx, _, _ = cute.arch.block_idx()
    return bidx, *strip.strip_origin(tidx, bidx, tiles_k)


@dataclass(frozen=True)
class TileAmaxParams:
    """What the tile kernels' amax kernel depends on besides its tensors."""

    strip: TileParams
    slot_rht: tuple[bool, ...]  # per amax slot: is it the column RHT's (else |x|)
    prep: bool  # the last CTA prepares S_dec, k_enc and the encode-factor tables
    copies: tuple[tuple[str, int], ...] = ()  # (tag, amax slot) of each copy, in output order
    fold: tuple[str, ...] = ()  # tags of the copies whose tables fold half_scale in
    fold_sdec_max: float = 0.0  # the S_dec up to which folded encode factors stay normal
    half_scale: float = 0.0  # the fp16 image's factor (ElementParams.half_scale)
    inv_max: float = 0.0  # fp32(1 / element max)
    global_num: float = 0.0  # fp32(scale max * element max)

    @property
    def const_head(self) -> int:
        """Where (k_enc, S_dec) of each copy start in the prepared constants: after the tables."""
        return 256 * len(self.copies)


class TileAmaxKernel:
    """Global amaxes into zero-initialised fp32 [1] buffers, one per slot (|x|, or |x| after the
    column RHT): each CTA reduces its tile, one atomic max per slot. With ``prep`` the last CTA
    to finish (a counter in a zero-initialised int32 [1]) then prepares, from the final amaxes,
    what every CTA of the quantize kernel needs: S_dec and k_enc of each copy and its table of
    the 256 encode factors, and writes each copy's S_dec. A generated module's subclass spells
    the entry: ``__call__`` -> ``launch``, ``kernel`` -> ``body``."""

    def __init__(self, params: TileAmaxParams, arch: str) -> None:
        self.p = params
        self.arch = arch
        self.strip = TileStrip(params.strip)

    # ---- where the strip is and its loads (a grouped subclass places them in its group)
    def place(self, tidx, tiles_k) -> tuple:
        """(this CTA's tile index on a 1-D grid or None, then ``strip_origin``'s five values)."""
        return place_on_grid(self.strip, tidx, tiles_k)

    def load(self, gX, row0, col0, M, K) -> list:
        """The strip's row vectors (``TileStrip.load_strip``)."""
        return self.strip.load_strip(gX, row0, col0, M, K)

    def fold_ok(self, s_dec: list):
        """S_dec <= fold_sdec_max for every copy that folds half_scale into its table (s_dec:
        each slot's S_dec)."""
        fold_ok = None
        for tag, slot in self.p.copies:
            if tag in self.p.fold:
                ok = s_dec[slot] <= Float32(self.p.fold_sdec_max)
                fold_ok = ok if fold_ok is None else fold_ok & ok
        return fold_ok

    @cute.jit
    def launch(self, mX: cute.Tensor, tensors: list, stream):
        """tensors: each slot's (1,) fp32 global amax, with ``prep`` then the (1,) int32 CTA
        counter, the constants and each copy's (1,) fp32 S_dec (the entry's order)."""
        M, K = mX.shape[0], mX.shape[1]
        tiles_k, grid = self.strip.grid(M, K)
        if const_expr(not self.p.strip.grid_2d):
            grid = [grid, 1, 1]
        self.kernel(self.strip.units(mX), *tensors, M, K, tiles_k).launch(
            grid=grid, block=[self.p.strip.threads, 1, 1], stream=stream
        )

    @cute.jit
    def body(self, gX, tensors: list, M, K, tiles_k):
        """The kernel's body: ``tensors`` as ``__call__`` takes them."""
        p, sp, strip = self.p, self.p.strip, self.strip
        slots = len(p.slot_rht)
        amaxes = list(tensors[:slots])
        mCount = mConst = None
        sdecs = []
        if const_expr(p.prep):
            mCount, mConst = tensors[slots], tensors[slots + 1]
            sdecs = list(tensors[slots + 2 :])
        threads = sp.threads
        tidx, _, _ = cute.arch.thread_idx()
        _, row0, col0, _, _, _ = self.place(tidx, tiles_k)
        frags = self.load(gX, row0, col0, M, K)
        xfs = strip.rows_f32(frags)
        accs = []
        for s in range_constexpr(len(p.slot_rht)):
            if const_expr(p.slot_rht[s]):
                if const_expr(sp.rht_tail):
                    # rows past M (loaded as duplicates) are zero padding for the RHT: M %
                    # RHT_SIZE == 0, so a chunk is whole or out, but a strip of several can be both
                    acc = strip.rht_amax(strip.rows_below(column(xfs, 0), row0, M))
                    for j in range_constexpr(1, sp.vec):
                        acc = fmax_nan(
                            acc, strip.rht_amax(strip.rows_below(column(xfs, j), row0, M))
                        )
                    accs.append(acc)
                else:
                    acc = strip.rht_amax(column(xfs, 0))
                    for j in range_constexpr(1, sp.vec):
                        acc = fmax_nan(acc, strip.rht_amax(column(xfs, j)))
                    # a strip past M (all rows clamped to M - 1) is no chunk of x: M % RHT_SIZE
                    # == 0 and the strip is one chunk, so it is either whole or out
                    accs.append(Float32(cutlass.select_(row0 < M, acc, Float32(0.0))))
            else:
                accs.append(strip.strip_absmax(frags, xfs))

        # CTA reduction per slot: warp shuffles, one shared-memory slot per warp, warp 0 ends;
        # every max propagates NaN, so a NaN reaches the atomic as the canonical (positive) NaN
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(
            Float32, cute.make_layout(slots * (threads // 32)), byte_alignment=16
        )
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        for s in range_constexpr(slots):
            acc = cute.arch.warp_reduction(accs[s], fmax_nan)
            if lane == 0:
                red[s * (threads // 32) + warp] = acc
        cute.arch.barrier()
        if warp == 0:
            for w_slot in range_constexpr(slots):
                w = Float32(0.0)
                if lane < threads // 32:
                    w = red[w_slot * (threads // 32) + lane]
                w = cute.arch.warp_reduction(w, fmax_nan)
                if lane == 0:
                    # |x| >= 0: the fp32 max is the integer max of the bits (Inf and the
                    # positive NaN above every finite value)
                    cute.arch.atomic_fmax(amaxes[w_slot].iterator, w, sign_bit=False)
        if const_expr(p.prep):
            # ---- the last CTA to count itself sees every CTA's atomic max: it prepares S_dec,
            # k_enc and the encode-factor tables once for the quantize kernel, not once per CTA
            last = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
            if tidx == 0:
                gdx, gdy, _ = cute.arch.grid_dim()
                # acq_rel: this CTA's atomic maxes (same thread) are ordered before its count
                done = quant_ptx.count_cta(mCount.iterator.toint())
                last[0] = Int32(cutlass.select_(done == Uint32(gdx * gdy - 1), Int32(1), Int32(0)))
            cute.arch.barrier()
            if last[0] != 0:
                self.prepare(amaxes, mCount, mConst, sdecs, tidx)

    def prepare(self, amaxes: list, mCount, mConst, sdecs: list, tidx):
        """The last CTA's work: S_dec and k_enc of each copy and its encode-factor table into
        the prepared constants, S_dec into each copy's buffer, the counter reset."""
        p, strip = self.p, self.strip
        threads = p.strip.threads
        s_enc = []
        s_dec = []
        for amax in amaxes:
            s_enc_s, s_dec_s = global_scales(
                quant_ptx.load_acquire(amax.iterator.toint()), p.global_num
            )
            s_enc.append(s_enc_s)
            s_dec.append(s_dec_s)
        fold_f = None
        if p.fold:
            # half_scale folded into the tables of the fp16-image copies while S_dec <=
            # fold_sdec_max (every entry a normal fp32); the quantize kernel checks the same
            fold_ok = self.fold_ok(s_dec)
            fold_f = Float32(cutlass.select_(fold_ok, Float32(p.half_scale), Float32(1.0)))
        for i, (tag, slot) in enumerate(p.copies):
            for t in range(256 // threads):
                code = tidx + t * threads
                e_b = strip.encode_factor(Uint32(code), s_dec[slot])
                mConst[i * 256 + code] = e_b * fold_f if tag in p.fold else e_b
        self.store_prepared(mCount, mConst, sdecs, s_enc, s_dec, tidx)

    @cute.jit
    def store_prepared(self, mCount, mConst, sdecs: list, s_enc: list, s_dec: list, tidx):
        """Thread 0: the counter reset, (k_enc, S_dec) of each copy, each copy's S_dec."""
        p = self.p
        if tidx == 0:
            mCount[0] = Int32(0)  # ready for another launch on the same buffers
            for i in range_constexpr(len(p.copies)):
                slot = p.copies[i][1]
                # k_enc = fp32(S_enc * fp32(1 / ELEM_MAX))
                mConst[p.const_head + 2 * i] = s_enc[slot] * Float32(p.inv_max)
                mConst[p.const_head + 2 * i + 1] = s_dec[slot]
                sdecs[i][0] = s_dec[slot]


__all__ = [
    "MAX_GRID_Y",
    "TileAmaxKernel",
    "TileAmaxParams",
    "TileParams",
    "TileStrip",
    "absmax",
    "absmax_bf16",
    "butterfly_max",
    "column",
    "fmax_nan",
    "place_on_grid",
    "scaled",
    "swizzled_offset",
    "to_store",
]
