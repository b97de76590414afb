"""The tile quantize kernel: a columnwise copy (1xB blocks along M, codes stored transposed
[K, M], an optional RHT along M), rowwise + columnwise copies from one read of x, or 2D BxB tiles
(one scale per tile; the columnwise copy is the transpose of the same codes and scales), for
every element and scale format, rounding, input dtype, global scale and scale layout
(docs/numerics.md sections 1-5 and 7, bit for bit; the reference is
``fp4gen.numerics.quantize``).

Thread mapping: ``fp4gen.kernels.tile`` (a thread holds a strip of ``rows`` x ``vec`` values of x,
one vector load per row). What the kernel does with its strip, by layout:

* 2D tiles (``two_d``): one amax of the strip, butterflies across the tile's lanes (and shared
  memory across its warps), one scale and encode factor per tile; the codes once, row by row; the
  columnwise codes are their transpose (4- and 8-bit codes of whole words, ``transpose``) or the
  same encode per column.
* 1D, rotated (the default): the strip as 32-bit words, ``words`` per row, through two rolled
  loops: an iteration of the row loop takes the first ``ROWS_PER_STEP`` rows and then rotates the
  rows, one of the column loop the first word of every row (``cpair`` columns) and then rotates
  each row's words. Rolled loops keep the kernel small enough for the instruction cache (fully
  unrolled, instruction fetch stalls took half its time); the data stays in registers.
* 1D, staged (the fused gradient layout, ``staged``): the strip also in shared memory; the column
  copy from the registers (unrolled over the words, no rotation), the row copy from shared memory
  (a rolled loop can index shared memory, not registers). With ``fold`` the fp16-image encode
  takes half_scale folded into the encode-factor tables, exact while every S_dec <=
  ``fold_sdec_max``; past it both copies take an unfolded path from shared memory.

Block scales: ``BlockScaler`` (``fp4gen.kernels.scale``), or with e4m3 scales on 1D blocks
(``encode_table``) the encode factor of each of the 256 scale codes once per CTA in shared memory;
with a global scale too (``prep``) the amax kernel (``TileAmaxKernel``) prepared those tables, k_enc
and S_dec once, and the kernel copies them. Without a global scale S_dec is 1.0 from the host and
a thread whose values hold a NaN or an Inf stores NaN over that copy's S_dec.

Every variant is a field of ``TileQuantizeParams``, read as a Python value while the kernel is
traced (``cutlass.const_expr`` in the kernel bodies). The generated module's subclass spells
``__call__`` and ``kernel`` with exactly the spec's arguments and hands them to ``launch`` and
``body`` here (``split_args`` says their order).

Carried tensors: the DSL passes through a rolled loop (``cutlass.range``) or a branch on a
runtime value every local that the region assigns or calls a method of, in the order they first
appear there, and that order decides the register numbering of the PTX. The loops here reassign
the tensors they store to at the end of their body (``mS, mSwz, mQ = mS, mSwz, mQ``), so each
loop carries the same values in the same order as the kernel had when it was template text
(whose loops called ``mQ.iterator`` themselves), and its PTX is the same byte for byte
(``tests/ptx_identity.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr, range_constexpr

from fp4gen.kernels import encode, philox
from fp4gen.kernels.encode import ElementEncoder, ElementParams
from fp4gen.kernels.quant_ptx import add_rn, store_if, store_vec_if
from fp4gen.kernels.quantize import tree_sum
from fp4gen.kernels.scale import (
    NAN_BITS,
    NONFINITE_BITS,
    BlockScaler,
    ScaleParams,
    global_scales,
    scale_word,
    target_factors,
)
from fp4gen.kernels.tile import (
    TileAmaxParams,
    TileParams,
    TileStrip,
    absmax,
    absmax_bf16,
    butterfly_max,
    column,
    fmax_nan,
    place_on_grid,
    scaled,
    swizzled_offset,
    to_store,
)

ROWS_PER_STEP = 4  # rows per iteration of the rotated row loop
ROW_UNROLL = 1  # row-loop iterations per loop body (2 measured 15% slower)
COL_UNROLL = 2  # column-loop iterations per loop body (1 measured 2% slower)


@dataclass(frozen=True)
class TileCopy:
    """One copy the kernel writes."""

    tag: str  # "row" / "col"
    rounding: str  # a Rounding word
    sw_encode: str  # the software encode of that rounding (a SwEncode word)
    hw_archs: tuple[str, ...]  # arches whose hardware convert gives this copy's codes
    swizzled: bool  # scales also in the swizzled 128x4 layout
    slot: int  # its global amax slot: one per distinct transform (none / the column RHT)
    sr_bits: int  # random bits per value; 0: a deterministic rounding
    sr_index: int  # its Philox offset among the kernel's stochastic copies
    rht: bool = False  # the column RHT along M before the amax (columnwise copies)

    @property
    def rand_words(self) -> bool:
        """The encode takes whole Philox words ("srhalf"), else one random field per value."""
        return self.sw_encode == "srhalf"


@dataclass(frozen=True)
class TileQuantizeParams:
    """Everything the tile quantize kernel depends on besides its tensors: compile-time
    constants."""

    strip: TileParams  # the thread mapping
    block: int  # B of the 1xB blocks or BxB tiles
    two_d: bool  # BxB tiles: one scale per tile, the columnwise copy its transpose
    elem: ElementParams
    scale: ScaleParams
    copies: tuple[TileCopy, ...]  # in output order: the rowwise copy first
    row_blocks: int  # whole row blocks in a thread's row segment (1D)
    col_blocks: int  # whole column blocks in a thread's column strip (1D)
    col_warps: int  # warps along M sharing a column block or tile (partial amaxes in smem)
    row_store_bytes: int  # store word of a row segment's packed codes
    row_store_n: int  # store words per row segment
    col_store_bytes: int  # store word of a column strip's packed codes
    col_store_n: int  # store words per column strip
    swar: bool  # whole codes per 32-bit word (4- and 8-bit): pack and sign them word by word
    partial: bool  # a row segment or column strip holds part of a code word
    transpose: bool  # 2D: the columnwise codes are the transpose of the rowwise code words
    encode_table: bool  # 1D with e4m3 scales: e_b of every scale code once per CTA (smem)
    staged: bool  # the fused gradient layout (module docstring)
    prep: bool  # the amax kernel prepared S_dec, k_enc and the encode-factor tables
    fold: tuple[str, ...] = ()  # tags of the copies whose table folds half_scale in (staged)
    fold_sdec_max: float = 0.0  # the S_dec up to which folded encode factors stay normal
    global_num: float = 1.0  # fp32(scale max * element max), S_enc's numerator
    # the options of docs/numerics.md 11.1-11.2 on 2D tiles (defaults: none)
    target_invs: tuple[float, ...] = ()  # fp32(1 / T) per block target T, in order
    target_mae: bool = False  # the targets' error: |d| (mae) instead of d * d (mse)
    scale_sr: bool = False  # stochastic tile scales: a 32-bit Philox word per tile

    def __post_init__(self) -> None:
        tags = tuple(c.tag for c in self.copies)
        if tags not in (("row",), ("col",), ("row", "col")):
            raise ValueError(
                f"tile copies must be rowwise, columnwise or both, in that order: {tags}"
            )
        if self.fold and not (self.staged and self.prep):
            raise ValueError("the fold goes with the staged layout and the prepared tables")
        if self.choice and not (self.two_d and self.strip.col_lanes == 1 and self.col_warps == 1):
            raise ValueError(
                "block targets and stochastic block scales: 2D tiles held by one strip's rows"
            )

    @property
    def choice(self) -> bool:
        """Block targets or stochastic tile scales: ``tile_choice`` quantizes the tile."""
        return bool(self.target_invs) or self.scale_sr

    def draws(self, copy: TileCopy) -> bool:
        """Whether ``copy`` takes a Philox offset: it rounds stochastically, or the tile
        scales do (2D: the codes and scales draw from the first copy's stream)."""
        return bool(copy.sr_bits) or self.scale_sr

    @property
    def global_scale(self) -> bool:
        return self.strip.global_scale

    @property
    def sr(self) -> bool:
        """Some copy rounds stochastically (or the tile scales do)."""
        return any(self.draws(c) for c in self.copies)

    @property
    def n_sr(self) -> int:
        """Copies that draw: one Philox offset each."""
        return sum(1 for c in self.copies if self.draws(c))

    @property
    def scale_bytes(self) -> int:
        """Bytes of a stored scale: an fp32 value or a code byte."""
        return 4 if self.strip.fp32_scales else 1

    @property
    def const_head(self) -> int:
        """Where (k_enc, S_dec) of each copy start in the prepared constants."""
        return 256 * len(self.copies)

    @property
    def slots(self) -> int:
        """Global amax slots: one per distinct transform of x (none, the column RHT)."""
        return 1 + max(c.slot for c in self.copies)

    @property
    def philox_args(self) -> int:
        """The quantize kernel's Philox scalars: the seed, each stochastic copy's offset, the
        counter address and stride, as (lo, hi) Int32 words; 0 without stochastic rounding."""
        return 2 * (3 + self.n_sr) if self.sr else 0

    def amax_params(self) -> TileAmaxParams:
        """The parameters of the spec's global amax kernel (``fp4gen.kernels.tile``)."""
        slot_rht = [False] * self.slots
        for c in self.copies:
            slot_rht[c.slot] = slot_rht[c.slot] or c.rht
        if not self.prep:
            return TileAmaxParams(strip=self.strip, slot_rht=tuple(slot_rht), prep=False)
        return TileAmaxParams(
            strip=self.strip,
            slot_rht=tuple(slot_rht),
            prep=True,
            copies=tuple((c.tag, c.slot) for c in self.copies),
            fold=self.fold,
            fold_sdec_max=self.fold_sdec_max,
            half_scale=self.elem.half_scale if self.fold else 0.0,
            inv_max=self.elem.inv_max,
            global_num=self.global_num,
        )

    def copy(self, tag: str) -> TileCopy | None:
        for c in self.copies:
            if c.tag == tag:
                return c
        return None


class TileQuantizeKernel:
    """The tile quantize kernel (module docstring). A generated module's subclass spells the
    entries with the spec's arguments: ``__call__`` -> ``launch``, ``kernel`` -> ``body``
    (their arguments have names: the TVM-FFI function of the compiled entry needs them). Plain
    methods run while the kernel is traced; those with a rolled loop or a branch on a runtime
    value are ``cute.jit``."""

    def __init__(self, params: TileQuantizeParams, arch: str) -> None:
        self.p = params
        self.arch = arch
        self.strip = TileStrip(params.strip)
        self.scaler = BlockScaler(params.scale, params.global_scale)
        self.row = params.copy("row")
        self.col = params.copy("col")
        # one encoder and hardware-convert choice per copy
        self.encoders = {
            c.tag: ElementEncoder(params.elem, c.rounding, c.sw_encode, params.swar, params.partial)
            for c in params.copies
        }
        self.hw = {c.tag: arch in c.hw_archs for c in params.copies}

    # ---- host side: the launch (the subclass's __call__ gives the spec's arguments)
    @cute.jit
    def launch(self, mX: cute.Tensor, tensors: list, philox_args, stream):
        """tensors: the entry's tensor arguments after x, in its order (``split_args``);
        philox_args: the stochastic rounding's Int32 scalars (empty without)."""
        M, K = mX.shape[0], mX.shape[1]
        tiles_k, grid = self.strip.grid(M, K)
        if const_expr(not self.p.strip.grid_2d):
            grid = [grid, 1, 1]
        self.kernel(self.strip.units(mX), *tensors, *philox_args, M, K, tiles_k).launch(
            grid=grid, block=[self.p.strip.threads, 1, 1], stream=stream
        )

    # ---- device side (the subclass's kernel gives the spec's arguments)
    def split_args(self, tensors: list, philox_args) -> tuple:
        """The entry's tensor arguments after x, in order: each copy's codes, scales and
        (swizzled) swizzled scales, rowwise first; then the prepared constants (``prep``), or
        each amax slot's global amax and each copy's S_dec (a global scale), or each copy's
        S_dec. Then come the Philox scalars (``philox_args`` of them: the seed, each stochastic
        copy's offset, the counter address and stride). Returns (rowwise outputs, columnwise
        outputs, constants, amaxes, S_decs, Philox scalars), None for what the spec lacks."""
        p = self.p
        args = list(tensors)
        outs = {"row": None, "col": None}
        for c in p.copies:
            outs[c.tag] = (args[0], args[1], args[2] if c.swizzled else None)
            args = args[3 if c.swizzled else 2 :]
        mConst, amaxes, sdecs = None, [], []
        if p.prep:
            mConst = args[0]
        else:
            if p.global_scale:
                amaxes, args = args[: p.slots], args[p.slots :]
            sdecs = args
        return outs["row"], outs["col"], mConst, amaxes, sdecs, philox_args if p.sr else None

    @cute.jit
    def body(self, gX, tensors: list, philox_args, M, K, tiles_k):
        """The kernel's body: ``tensors`` and ``philox_args`` as ``__call__`` takes them."""
        p = self.p
        row_out, col_out, mConst, amaxes, sdecs, philox_args = self.split_args(tensors, philox_args)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, row0, col0, wm, lm, lk = self.place(tidx, tiles_k)

        # ---- issue every load of the strip first (clamped: no predicates)
        frags = self.load(gX, row0, col0, M, K)
        col_ok = col0 < K
        nbm = nbk = row_c = byte0 = strides = None
        if const_expr(self.col is not None):
            nbm = (M + (p.block - 1)) // p.block  # blocks along M
        if const_expr(self.row is not None):
            nbk = K // p.block  # blocks along K
        if const_expr(self.col is not None):
            row_c = M * p.elem.bits // 8  # bytes of a row of the transposed codes
            byte0 = row0 * p.elem.bits // 8  # the strip's first byte in such a row
            strides = self.col_strides(row_c, nbm)

        scales = self.copy_scales(mConst, amaxes, sdecs, bidx, tidx)
        keys, poffs = self.philox_streams(philox_args)
        smem = None
        if const_expr(p.encode_table or p.col_warps > 1 or p.staged):
            smem = cutlass.memory.SmemAllocator()
        fold_ok = None
        if const_expr(p.fold):
            # ---- half_scale folded into the encode factors of the fp16-image copies: exact
            # while every e_b * half_scale is a normal fp32, i.e. S_dec <= fold_sdec_max (amax
            # beyond ~2^111 for NVFP4 takes the unfolded path)
            fold_ok = self.fold_ok(scales)
        if const_expr(p.encode_table):
            self.encode_tables(scales, mConst, smem, tidx)

        at = _Strip(row0, col0, wm, lm, col_ok, M, K, nbm, nbk, row_c, byte0, strides, keys, poffs)
        if const_expr(p.two_d):
            self.tiles_2d(at, frags, row_out, col_out, sdecs, scales, smem)
        elif const_expr(p.staged):
            self.staged(at, frags, row_out, col_out, scales, smem, fold_ok)
        else:
            self.rotated(at, frags, row_out, col_out, sdecs, scales, smem)

    # ---- where the strip is and its loads (a grouped subclass places them in its group)
    def place(self, tidx, tiles_k) -> tuple:
        """(this CTA's tile index on a 1-D grid or None, then ``strip_origin``'s five values)."""
        return place_on_grid(self.strip, tidx, tiles_k)

    def col_strides(self, row_c, nbm) -> tuple:
        """(bytes, scales) from one row of the columnwise copy's codes and scales to the next:
        a row's own length, the copy one [K, M] tensor (a grouped subclass may place its
        groups' copies side by side in a wider one)."""
        return row_c, nbm

    def load(self, gX, row0, col0, M, K) -> list:
        """The strip's row vectors (``TileStrip.load_strip``)."""
        return self.strip.load_strip(gX, row0, col0, M, K)

    # ---- per copy: k_enc, S_enc, S_dec and the encode-factor table
    def copy_scales(self, mConst, amaxes: list, sdecs: list, bidx, tidx) -> dict:
        """{tag: [k_enc, S_enc, S_dec, table]} of each copy that quantizes (2D: the first, whose
        tile scale both copies share); S_enc and S_dec are None without a global scale, the
        table is filled by encode_tables."""
        p = self.p
        copies = p.copies[:1] if p.two_d else p.copies
        scales = {}
        if p.prep:
            # ---- k_enc (and S_dec where the fold needs it) of every copy, prepared by the amax
            # kernel like the tables
            for i, c in enumerate(p.copies):
                k_enc = mConst[p.const_head + 2 * i]
                s_dec = None
                if c.tag in p.fold:
                    s_dec = mConst[p.const_head + 2 * i + 1]
                scales[c.tag] = [k_enc, None, s_dec, None]
        elif p.global_scale:
            # ---- global scales, recomputed by every thread (a broadcast load, div.rn + rcp.rn)
            s_enc = []
            s_dec = []
            for mAmax in amaxes:
                s_enc_s, s_dec_s = global_scales(mAmax[0], p.global_num)
                s_enc.append(s_enc_s)
                s_dec.append(s_dec_s)
            self.store_sdecs(bidx, tidx, sdecs, [s_dec[c.slot] for c in p.copies])
            for c in copies:
                # k_enc = fp32(S_enc * fp32(1 / ELEM_MAX))
                k_enc = s_enc[c.slot] * Float32(p.elem.inv_max)
                scales[c.tag] = [k_enc, s_enc[c.slot], s_dec[c.slot], None]
        else:
            for c in copies:
                # no global scale: S_enc = S_dec = 1, k_enc = fp32(1 * fp32(1 / ELEM_MAX))
                scales[c.tag] = [Float32(p.elem.inv_max), None, None, None]
        return scales

    @cute.jit
    def store_sdecs(self, bidx, tidx, sdecs: list, s_decs: list) -> None:
        """Thread 0 of CTA 0 writes each copy's S_dec."""
        if bidx == 0:  # noqa: SIM102
            if tidx == 0:
                for i in range_constexpr(len(sdecs)):
                    sdecs[i][0] = s_decs[i]

    def philox_streams(self, philox_args):
        """(keys, each stochastic copy's Philox offset) of the stochastic rounding, or (None,
        []): the int offset, or counter * stride + slot read from device memory (a
        DeviceOffset). 2D: the codes draw with the first copy's offset."""
        p = self.p
        if not p.sr:
            return None, []
        seed_lo, seed_hi = philox_args[0], philox_args[1]
        ctr_lo, ctr_hi, stride_lo, stride_hi = philox_args[2 + 2 * p.n_sr :]
        keys = philox.philox_keys(Uint32(seed_lo), Uint32(seed_hi))
        poffs = []
        for i in range(1 if p.two_d else p.n_sr):
            off_lo, off_hi = philox_args[2 + 2 * i], philox_args[3 + 2 * i]
            poffs.append(philox.philox_offset(ctr_lo, ctr_hi, stride_lo, stride_hi, off_lo, off_hi))
        return keys, poffs

    def fold_ok(self, scales: dict):
        """S_dec <= fold_sdec_max for every copy that folds half_scale into its table."""
        ok = None
        for tag in self.p.fold:
            c = scales[tag][2] <= Float32(self.p.fold_sdec_max)
            ok = c if ok is None else ok & c
        return ok

    def encode_tables(self, scales: dict, mConst, smem, tidx) -> None:
        """The encode-factor table of every copy in shared memory: copied from the prepared
        constants (``prep``), else computed; block scales then cost one shared-memory load."""
        p = self.p
        threads = p.strip.threads
        for i, c in enumerate(p.copies):
            table = smem.allocate_tensor(Float32, cute.make_layout(256), byte_alignment=16)
            for t in range(256 // threads):
                if p.prep:
                    table[tidx + t * threads] = mConst[i * 256 + tidx + t * threads]
                else:
                    table[tidx + t * threads] = self.strip.encode_factor(
                        Uint32(tidx + t * threads), scales[c.tag][2]
                    )
            scales[c.tag][3] = table
        cute.arch.barrier()

    def block_scale(self, scales: dict, tag: str, amax_b: Float32):
        """(scale code or value, e_b) of a block of copy ``tag``."""
        k_enc, s_enc, s_dec, table = scales[tag]
        if self.p.encode_table:
            return self.strip.block_scale_table(amax_b, k_enc, table)
        return self.scaler.block_scale(amax_b, k_enc, s_enc, s_dec)

    def nan_stores(self, sdecs: list, seen: list) -> None:
        """Without a global scale: S_dec = NaN (over the host's 1.0) for each copy whose values
        seen by this thread hold a NaN or an Inf (predicated stores, no branch; every writer
        stores the same NaN). seen: the NaN-propagating max of the block amaxes of each copy."""
        for i in range(len(self.p.copies)):
            bad = Int32(seen[i].bitcast(Uint32) >= Uint32(NONFINITE_BITS))
            store_if(sdecs[i].iterator.toint(), Uint32(NAN_BITS), bad, 4)

    # ---- 2D tiles
    def tiles_2d(self, at, frags, row_out, col_out, sdecs, scales, smem) -> None:
        """One amax, scale and encode factor per BxB tile; the codes once, row by row; the
        columnwise copy is their transpose."""
        p, sp, strip = self.p, self.p.strip, self.strip
        first = p.copies[0]
        xfs = strip.rows_f32(frags)
        seen = strip.strip_absmax(frags, xfs)  # NaN or Inf iff this thread's values hold one
        amax_t = butterfly_max(butterfly_max(seen, sp.row_offsets), sp.col_offsets)
        if p.col_warps > 1:
            # the tile spans col_warps warps along M: partial amaxes meet in shared memory
            per_warp = sp.tile_k // p.block
            part = smem.allocate_tensor(
                Float32, cute.make_layout(sp.warps_m * per_warp), byte_alignment=16
            )
            tile_k = (at.col0 % sp.tile_k) // p.block
            part[at.wm * per_warp + tile_k] = amax_t  # equal in the lanes of a tile
            cute.arch.barrier()
            g0 = (at.wm // p.col_warps) * p.col_warps
            amax_t = part[g0 * per_warp + tile_k]
            for w in range(1, p.col_warps):
                amax_t = cute.arch.fmax(amax_t, part[(g0 + w) * per_warp + tile_k])
        code_t = e_t = ys = None  # with block options: chosen below, after the random fields
        if not p.choice:
            code_t, e_t = self.block_scale(scales, first.tag, amax_t)
        tile_row = at.row0 // p.block
        tile_col = at.col0 // p.block
        if not p.choice:
            ys = [scaled(xs, e_t) for xs in xfs]
        rand = None
        if first.sr_bits:
            rand = []
            for i in range(sp.rows):
                i0 = Uint32(at.row0 + i) * Uint32(at.K) + Uint32(at.col0)
                rand.append(self.random(first, i0, sp.vec, at.keys, at.poffs[0]))
        enc = self.encoders[first.tag]
        hw = self.hw[first.tag]
        tile_ok = Int32(at.col_ok & (at.row0 < at.M))
        chosen = None
        if p.choice:
            code_t, e_t, chosen = self.tile_choice(at, xfs, amax_t, scales, rand, tile_row)
            if self.col is not None and not p.transpose:
                ys = [scaled(xs, e_t) for xs in xfs]  # the column encode's values
        # the codes once, row by row; the columnwise copy is their transpose
        row_words = []
        for i in range(sp.rows):
            if p.choice:
                row_words.append(encode.pack_bits(chosen[i]))
            else:
                row_words.append(encode.pack_bits(enc.encode_elements(ys[i], _at(rand, i), hw)))
            if self.row is not None:
                mQ, _, mSwz = row_out
                r = at.row0 + i
                ok = Int32(at.col_ok & (r < at.M))
                vals = to_store(row_words[i], p.row_store_bytes, p.row_store_n)
                addr = mQ.iterator.toint() + Int64((r * at.K + at.col0) * p.elem.bits // 8)
                self.store_codes(addr, vals, ok, p.row_store_bytes)
                if self.row.swizzled:
                    addr = mSwz.iterator.toint() + Int64(
                        swizzled_offset(r, tile_col, (at.nbk + 3) // 4)
                    )
                    store_if(addr, Uint32(code_t), ok, 1)  # the tile's scale on every row
        if self.row is not None:
            addr = row_out[1].iterator.toint() + Int64(
                (tile_row * at.nbk + tile_col) * p.scale_bytes
            )
            store_if(addr, strip.scale_bits(code_t), tile_ok, p.scale_bytes)
        if self.col is not None:
            mQc, mSc, mSwzc = col_out
            if p.transpose:
                col_words = strip.transpose_strip(row_words)
            else:
                # codes per column (the same encode of the same values as the rows)
                col_words = []
                for j in range(sp.vec):
                    rand_j = None if rand is None else column(rand, j)
                    col_words.append(
                        encode.pack_bits(enc.encode_elements(column(ys, j), rand_j, hw))
                    )
            for j in range(sp.vec):
                c = at.col0 + j
                vals = to_store(col_words[j], p.col_store_bytes, p.col_store_n)
                addr = mQc.iterator.toint() + Int64(c * at.strides[0] + at.byte0)
                oks = [self.col_store_ok(at, w) for w in range(p.col_store_n)]
                self.store_words(addr, vals, oks, p.col_store_bytes)
                if self.col.swizzled:
                    addr = mSwzc.iterator.toint() + Int64(
                        swizzled_offset(c, tile_row, (at.nbm + 3) // 4)
                    )
                    store_if(addr, Uint32(code_t), tile_ok, 1)  # the tile's scale on every row
            scale_at = tile_col * at.strides[1] + tile_row
            addr = mSc.iterator.toint() + Int64(scale_at * p.scale_bytes)
            store_if(addr, strip.scale_bits(code_t), tile_ok, p.scale_bytes)
        if not p.global_scale:
            self.nan_stores(sdecs, [seen] * len(p.copies))

    def tile_choice(self, at, xfs: list, amax_t, scales: dict, rand, tile_row) -> tuple:
        """The block options of docs/numerics.md 11.1-11.2 on one BxB tile (the strip holds all
        its rows, ``row_lanes`` lanes its columns): per target in order (k_enc = fp32(S_enc *
        fp32(1 / T))) the tile scale, its codes (the same random fields for every target) and
        the tile's error against z = fp32(x * S_enc); a later target replaces the kept one only
        where its error is strictly lower. The error is the reference's tree in row-major index
        order: per row the tree of the strip's values, then across the tile's lanes (xor
        butterflies, lowest lane bit first: the row's tree), then over the rows in order; rows
        past M (loaded as copies of a row) count 0, as the reference's zero padding. With
        stochastic tile scales the scale rounding takes the word of element index 2^62 + b of
        the first copy's stream, b = tile_row * (K / B) + tile_col, the same for every target.
        Returns (scale code or fp32 scale, e_b, the chosen code fields of each row)."""
        p = self.p
        first = p.copies[0]
        _, s_enc, s_dec, _ = scales[first.tag]
        enc = self.encoders[first.tag]
        hw = self.hw[first.tag]
        k_encs = target_factors(p.target_invs, p.elem.inv_max, s_enc, p.global_scale)
        word = None
        if p.scale_sr:
            b = Uint32(tile_row) * Uint32(at.K // p.block) + Uint32(at.col0 // p.block)
            word = scale_word(b, at.keys, *at.poffs[0])
        az = None
        if len(k_encs) > 1:
            # |z| = |fp32(x * S_enc)|: the code's sign is x's, so |q - z| needs no signs
            az = [[abs(x) * s_enc if p.global_scale else abs(x) for x in xs] for xs in xfs]
        kept = kept_err = None
        for k_enc in k_encs:
            code, s_b, e_b = self.scaler.block_scale_value(amax_t, k_enc, s_enc, s_dec, word)
            cand = [
                enc.encode_elements(scaled(xs, e_b), _at(rand, i), hw) for i, xs in enumerate(xfs)
            ]
            if kept is None:
                kept = (code, e_b, cand)
                if len(k_encs) > 1:
                    kept_err = self.tile_error(at, cand, s_b, az)
            else:
                err = self.tile_error(at, cand, s_b, az)
                better = err < kept_err  # strictly lower: ties keep the earlier target
                kept_err = cutlass.select_(better, err, kept_err)
                kept = (
                    cutlass.select_(better, code, kept[0]),
                    Float32(cutlass.select_(better, e_b, kept[1])),
                    [
                        encode.keep_lower(better, row, kept_row)
                        for row, kept_row in zip(cand, kept[2], strict=True)
                    ],
                )
        return kept

    def tile_error(self, at, fields: list, s_b, az: list):
        """A tile's error (``tile_choice``): e(fp32(fp32(|value(code)| * s_b) - |z|)) per
        value (e = d * d, or |d| for mae; explicit mul.rn / sub.rn / add.rn, never fused), the
        pairwise tree of each row, the rows' trees across the tile's lanes, then over the rows."""
        p, sp = self.p, self.p.strip
        row_sums = []
        for i in range(sp.rows):
            row = tree_sum(encode.error_terms(fields[i], s_b, az[i], p.elem, p.target_mae))
            for off in sp.row_offsets:
                row = add_rn(row, cute.arch.shuffle_sync_bfly(row, offset=off))
            # a row past M is the reference's zero padding: no error
            row_sums.append(Float32(cutlass.select_(at.row0 + i < at.M, row, Float32(0.0))))
        return tree_sum(row_sums)

    def store_codes(self, addr, vals: list, ok, word_bytes: int) -> None:
        """A segment's packed codes (to_store's values) as predicated stores from addr."""
        self.store_words(addr, vals, [ok] * len(vals), word_bytes)

    def col_store_ok(self, at, w: int) -> Int32:
        """Whether store word w of a column strip lies before the end of its transposed row
        (and the strip inside K)."""
        bytes_w = self.p.col_store_bytes
        return Int32(at.col_ok & (at.byte0 + (w + 1) * bytes_w <= at.row_c))

    def store_words(self, addr, vals: list, oks: list, word_bytes: int) -> None:
        """Packed code words from addr, word w where oks[w] (a prefix: the words of a strip
        that lie before the end of its row). Two or four 32-bit words, or each four of a
        multiple of four (a strip of 32 8-bit codes from fp32 inputs), go as one vector store
        where all are stored and its address is aligned to their size, else word by word:
        each store instruction of a warp then writes whole 32-byte sectors (a column strip of
        16 8-bit codes was four 4-byte stores, each a partial-sector L2 write per lane pair)."""
        n = len(vals)
        if word_bytes == 4 and (n in (2, 4) or n % 4 == 0):
            step = n if n in (2, 4) else 4
            for c0 in range(0, n, step):
                a = addr if c0 == 0 else addr + Int64(4 * c0)
                aligned = Int32((a & Int64(4 * step - 1)) == Int64(0))
                whole = aligned & oks[c0 + step - 1]
                store_vec_if(a, vals[c0 : c0 + step], whole)
                for w in range(c0, c0 + step):
                    store_if(addr + Int64(4 * w), vals[w], oks[w] & (Int32(1) - whole), 4)
            return
        for w in range(n):
            store_if(addr + Int64(w * word_bytes), vals[w], oks[w], word_bytes)

    def random(self, copy: TileCopy, i0, n: int, keys: list, offs):
        """The random fields (or Philox words, ``rand_words``) of copy's n values from flat index
        i0."""
        fn = philox.random_words if copy.rand_words else philox.random_fields
        return fn(i0, n, copy.sr_bits, keys, *offs)

    # ---- 1D: one column pair and one step of row segments
    def col_pair(
        self, at, t, pxs: list, col_out, scales, part, g0, tcol, seen_col, folded, words=None
    ):
        """The columnwise copy of the cpair columns held by word t of every row (pxs: their
        values; words: those words, whose packed maxima give bf16 columns' block amaxes):
        per column its block amaxes (or the shared-memory partial amaxes), scales and codes.
        Returns the NaN-propagating max of its block amaxes so far (no global scale)."""
        p, sp, strip, col = self.p, self.p.strip, self.strip, self.col
        mQc, mSc, mSwzc = col_out
        bl = sp.rows // p.col_blocks  # rows of one column block held by this thread
        packed = None
        if words is not None and sp.input_dtype == "bf16" and not col.rht and p.col_warps == 1:
            packed = [
                strip.column_absmaxes(words[g * bl : (g + 1) * bl]) for g in range(p.col_blocks)
            ]
        for q in range(sp.cpair):
            j = t * sp.cpair + q
            c = at.col0 + j
            xc = pxs[q]
            xw = None
            if col.rht:
                xs = pxs[q]
                if sp.rht_tail:  # rows past M are duplicates: the RHT transforms zero padding
                    xs = strip.rows_below(xs, at.row0, at.M)
                xc, xw = strip.bf16_round(strip.butterflies(xs))
            ys = []
            for g in range(p.col_blocks):
                if p.col_warps > 1:
                    amax_b = part[g0 * sp.tile_k + tcol + j]
                    for w in range(1, p.col_warps):
                        amax_b = cute.arch.fmax(amax_b, part[(g0 + w) * sp.tile_k + tcol + j])
                else:
                    if col.rht:
                        amax_b = absmax_bf16(xw[g * bl // 2 : (g + 1) * bl // 2])  # exact
                    elif packed is not None:
                        amax_b = packed[g][q]
                    else:
                        amax_b = absmax(xc[g * bl : (g + 1) * bl])
                    if not p.global_scale:
                        seen_col = fmax_nan(seen_col, amax_b)  # this thread's part of the block
                    amax_b = butterfly_max(amax_b, sp.col_offsets)
                code, e_b = self.block_scale(scales, "col", amax_b)
                ys += scaled(xc[g * bl : (g + 1) * bl], e_b)
                b = (at.row0 + g * bl) // p.block
                ok = Int32(at.col_ok & (at.row0 + g * bl < at.M))
                if p.col_warps > 1:
                    # the block's warps hold the same scale: its first warp stores it (the
                    # others' stores were as many more partial-sector writes to L2)
                    ok = ok & Int32(at.wm == g0)
                addr = mSc.iterator.toint() + Int64((c * at.strides[1] + b) * p.scale_bytes)
                store_if(addr, strip.scale_bits(code), ok, p.scale_bytes)
                if col.swizzled:
                    off = swizzled_offset(c, b, (at.nbm + 3) // 4)
                    store_if(mSwzc.iterator.toint() + Int64(off), Uint32(code), ok, 1)
            rand = None
            if col.sr_bits:
                i0 = Uint32(c) * Uint32(at.M) + Uint32(at.row0)
                rand = self.random(col, i0, sp.rows, at.keys, at.poffs[col.sr_index])
            fold = {"folded": True} if folded and "col" in p.fold else {}
            codes = self.encoders["col"].encode_elements(ys, rand, self.hw["col"], **fold)
            vcol = to_store(encode.pack_bits(codes), p.col_store_bytes, p.col_store_n)
            addr = mQc.iterator.toint() + Int64(c * at.strides[0] + at.byte0)
            oks = [self.col_store_ok(at, w) for w in range(p.col_store_n)]
            self.store_words(addr, vcol, oks, p.col_store_bytes)
        return seen_col

    def shared_row_calls(self, at, r0) -> list:
        """The Philox words of ROWS_PER_STEP row segments from row r0, one Philox call per lane
        (TileStrip.shared_row_words)."""
        share = self.p.strip.row_share
        offs = at.poffs[self.row.sr_index]
        shared = []
        for g in range(ROWS_PER_STEP // share):
            shared += self.strip.shared_row_words(r0 + g * share, at.col0, at.K, at.keys, *offs)
        return shared

    def row_segments(self, at, r0, rows: list, shared, row_out, scales, seen_row, folded):
        """The rowwise copy of ROWS_PER_STEP row segments from row r0 (rows: each one's 32-bit
        words): block amaxes across the row block's lanes, scales, codes. Returns the
        NaN-propagating max of the block amaxes so far (no global scale)."""
        p, sp, strip, row = self.p, self.p.strip, self.strip, self.row
        mQ, mS, mSwz = row_out
        for ii in range(ROWS_PER_STEP):
            r = r0 + ii
            ok_r = Int32(at.col_ok & (r < at.M))
            words = rows[ii]
            xs = strip.words_f32(words)
            yr = []
            for g in range(p.row_blocks):
                lo = g * (sp.vec // p.row_blocks)
                hi = lo + sp.vec // p.row_blocks
                amax_r = strip.words_absmax(words, xs, lo, hi)
                if not p.global_scale:
                    seen_row = fmax_nan(seen_row, amax_r)  # this thread's part of the block
                amax_r = butterfly_max(amax_r, sp.row_offsets)
                code_r, e_r = self.block_scale(scales, "row", amax_r)
                yr += scaled(xs[lo:hi], e_r)
                # the lanes of a block hold the same scale: all store it
                addr = mS.iterator.toint() + Int64(
                    (r * at.nbk + at.col0 // p.block + g) * p.scale_bytes
                )
                store_if(addr, strip.scale_bits(code_r), ok_r, p.scale_bytes)
                if row.swizzled:
                    off_r = swizzled_offset(r, at.col0 // p.block + g, (at.nbk + 3) // 4)
                    store_if(mSwz.iterator.toint() + Int64(off_r), Uint32(code_r), ok_r, 1)
            rand_r = None
            if sp.row_share > 1:
                rand_r = shared[ii]
                if not row.rand_words:
                    rand_r = philox.fields_of(shared[ii], row.sr_bits)
            elif row.sr_bits:
                i0_r = Uint32(r) * Uint32(at.K) + Uint32(at.col0)
                rand_r = self.random(row, i0_r, sp.vec, at.keys, at.poffs[row.sr_index])
            fold = {"folded": True} if folded and "row" in p.fold else {}
            codes = self.encoders["row"].encode_elements(yr, rand_r, self.hw["row"], **fold)
            vrow = to_store(encode.pack_bits(codes), p.row_store_bytes, p.row_store_n)
            addr = mQ.iterator.toint() + Int64((r * at.K + at.col0) * p.elem.bits // 8)
            self.store_codes(addr, vrow, ok_r, p.row_store_bytes)
        return seen_row

    # ---- 1D, rotated: the strip in registers through two rolled loops
    @cute.jit
    def rotated(self, at, frags, row_out, col_out, sdecs, scales, smem):
        p, sp = self.p, self.p.strip
        words_n = sp.words
        strip = [w for frag in frags for w in self.strip.frag_words(frag)]
        seen_row = seen_col = None
        if const_expr(not p.global_scale):
            # the NaN-propagating max of this thread's block amaxes, per copy (S_dec = NaN if
            # not finite)
            if const_expr(self.row is not None):
                seen_row = Float32(0.0)
            if const_expr(self.col is not None):
                seen_col = Float32(0.0)
        if const_expr(self.row is not None):
            # ---- rowwise copy: ROWS_PER_STEP row segments per iteration, blocks along K
            mQ, mS, mSwz = row_out
            for t in cutlass.range(sp.rows // ROWS_PER_STEP, unroll=ROW_UNROLL):
                r0 = at.row0 + t * ROWS_PER_STEP
                shared = None
                if const_expr(sp.row_share > 1):
                    shared = self.shared_row_calls(at, r0)
                rows = [strip[ii * words_n : (ii + 1) * words_n] for ii in range(ROWS_PER_STEP)]
                seen_row = self.row_segments(
                    at, r0, rows, shared, (mQ, mS, mSwz), scales, seen_row, False
                )
                strip = strip[ROWS_PER_STEP * words_n :] + strip[: ROWS_PER_STEP * words_n]
                mS, mSwz, mQ = mS, mSwz, mQ  # carried through the loop (module docstring)
        if const_expr(self.col is not None):
            # ---- columnwise copy: cpair columns per iteration, blocks along M
            mQc, mSc, mSwzc = col_out
            part = g0 = tcol = seen_part = None
            if const_expr(p.col_warps > 1):
                # a column block spans col_warps warps along M: partial amaxes meet in shared
                # memory
                part = smem.allocate_tensor(
                    Float32, cute.make_layout(sp.warps_m * sp.tile_k), byte_alignment=16
                )
                tcol = at.col0 % sp.tile_k
                # unrolled over the words (each column's values are one word per row: no
                # rotation); bf16 columns' amaxes are packed maxima of those words
                for t in range_constexpr(words_n):
                    amaxes = self.strip.column_absmaxes(
                        [strip[i * words_n + t] for i in range(sp.rows)]
                    )
                    for q in range_constexpr(sp.cpair):
                        amax_p = amaxes[q]
                        if const_expr(not p.global_scale):
                            seen_col = fmax_nan(seen_col, amax_p)  # this thread's part
                        amax_p = butterfly_max(amax_p, sp.col_offsets)
                        part[at.wm * sp.tile_k + tcol + t * sp.cpair + q] = amax_p
                cute.arch.barrier()
                g0 = (at.wm // p.col_warps) * p.col_warps
                # the column loop's blocks read these amaxes: they add nothing to seen_col
                seen_part, seen_col = seen_col, None
            for t in cutlass.range(words_n, unroll=COL_UNROLL):
                pxs = self.strip.first_columns(strip)
                firsts = [strip[i * words_n] for i in range(sp.rows)]
                seen_col = self.col_pair(
                    at,
                    t,
                    pxs,
                    (mQc, mSc, mSwzc),
                    scales,
                    part,
                    g0,
                    tcol,
                    seen_col,
                    False,
                    words=firsts,
                )
                strip = self.strip.rotate_words(strip)
                mSc, mSwzc, mQc = mSc, mSwzc, mQc  # carried through the loop (module docstring)
            if const_expr(p.col_warps > 1):
                seen_col = seen_part
        if const_expr(not p.global_scale):
            seen = [seen_row if c.tag == "row" else seen_col for c in p.copies]
            self.nan_stores(sdecs, seen)

    # ---- 1D, staged: the column copy from registers, the row copy from shared memory
    @cute.jit
    def staged(self, at, frags, row_out, col_out, scales, smem, fold_ok):
        sp = self.p.strip
        mQ, mS, _ = row_out
        mQc, mSc, _ = col_out
        # ---- the strip in registers and in shared memory: the column copy reads the registers
        # (unrolled over the words, so no rotation), the row copy its rows from shared memory
        # (each thread reads back only what it wrote, so no barrier)
        strip = [w for frag in frags for w in self.strip.frag_words(frag)]
        units_k = sp.tile_k // sp.vec  # row vectors per tile row
        sX = smem.allocate_tensor(
            sp.input_type,
            cute.make_layout((sp.tile_m * units_k, sp.vec), stride=(sp.vec, 1)),
            byte_alignment=16,
        )
        unit0 = (at.wm * sp.lanes_m + at.lm) * sp.rows * units_k + (at.col0 % sp.tile_k) // sp.vec
        for i in range_constexpr(sp.rows):
            cute.autovec_copy(frags[i], sX[unit0 + i * units_k, None])
        if fold_ok:
            for t in range_constexpr(sp.words):
                ws = [strip[i * sp.words + t] for i in range(sp.rows)]
                vals = self.strip.words_f32(ws)
                pxs = [[vals[i * sp.cpair + q] for i in range(sp.rows)] for q in range(sp.cpair)]
                self.col_pair(
                    at, t, pxs, (mQc, mSc, None), scales, None, None, None, None, True, words=ws
                )
            self.staged_rows(at, sX, unit0, mQ, mS, scales, True)
            mSc, mQc, mS, mQ = mSc, mQc, mS, mQ  # carried through the branch (module docstring)
        else:  # amax beyond the fold's range: unfolded, both copies from shared memory (rolled)
            sW = cute.recast_tensor(sX, Uint32)
            for t in cutlass.range(sp.words, unroll=1):
                ws = [sW[unit0 + i * units_k, t] for i in range(sp.rows)]
                vals = self.strip.words_f32(ws)
                pxs = [[vals[i * sp.cpair + q] for i in range(sp.rows)] for q in range(sp.cpair)]
                self.col_pair(
                    at, t, pxs, (mQc, mSc, None), scales, None, None, None, None, False, words=ws
                )
                mSc, mQc = mSc, mQc  # carried through the loop (module docstring)
            self.staged_rows(at, sX, unit0, mQ, mS, scales, False)
            mSc, mQc, mS, mQ = mSc, mQc, mS, mQ  # carried through the branch (module docstring)

    @cute.jit
    def staged_rows(self, at, sX, unit0, mQ, mS, scales, folded: cutlass.Constexpr):
        """The rowwise copy of the staged layout: ROWS_PER_STEP rows per iteration, read back
        from shared memory."""
        sp = self.p.strip
        units_k = sp.tile_k // sp.vec
        for t in cutlass.range(sp.rows // ROWS_PER_STEP, unroll=1):
            r0 = at.row0 + t * ROWS_PER_STEP
            rows = []
            for ii in range_constexpr(ROWS_PER_STEP):
                fr = cute.make_rmem_tensor((sp.vec,), sp.input_type)
                cute.autovec_copy(sX[unit0 + (t * ROWS_PER_STEP + ii) * units_k, None], fr)
                rows.append(self.strip.frag_words(fr))
            shared = None
            if const_expr(sp.row_share > 1):
                shared = self.shared_row_calls(at, r0)
            self.row_segments(at, r0, rows, shared, (mQ, mS, None), scales, None, folded)
            mS, mQ = mS, mQ  # carried through the loop (module docstring)


@dataclass
class _Strip:
    """Where a thread's strip is and what its copies share (trace-time values)."""

    row0: Int32
    col0: Int32
    wm: Int32  # warp row
    lm: Int32  # lane row
    col_ok: object  # col0 < K
    M: Int32
    K: Int32
    nbm: object  # blocks along M (a columnwise copy)
    nbk: object  # blocks along K (a rowwise copy)
    row_c: object  # bytes of a row of the transposed codes
    byte0: object  # the strip's first byte in such a row
    strides: object  # (bytes, scales) from a row of the transposed copy to the next
    keys: object  # the Philox keys, or None
    poffs: list  # each stochastic copy's Philox offset


def _at(values, i: int):
    return None if values is None else values[i]


__all__ = ["TileCopy", "TileQuantizeKernel", "TileQuantizeParams"]
