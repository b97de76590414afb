"""Grouped tile quantize kernels: the tile kernel's copies (columnwise, rowwise + columnwise from
one read, 2D BxB tiles) of several groups of rows of one tensor in one launch, each group
quantized as the tile kernel quantizes a tensor of its own: the group's rows zero-padded to its
padded row count, its own global amax per amax slot and S_dec per copy, its own Philox seed and
offsets, its stochastic rounding indexed inside its own padded copy. Bit for bit the per-group
reference: ``fp4gen.numerics.quantize`` of the group's padded rows (a rowwise copy), of their
transpose (a columnwise copy), or the transpose of the 2D rowwise copy.

What a Mixture-of-Experts layer quantizes this way: the wgrad copies of every expert's tokens
and output gradient (blocks along the tokens, each expert's tokens padded to the wgrad GEMM's
block length inside the kernel: the caller never pads rows) and the batched expert weights with
2D tiles (equal groups of N rows, their fprop codes and, transposed, their dgrad codes).

The device code is ``TileQuantizeKernel``'s and ``TileAmaxKernel``'s: the subclasses here only
place a CTA's strips in its group (``place``: the group's tile index; ``load``: the group's rows,
rows past the group's real rows as +0.0, the reference's zero padding) and hand the body the
group's tensors (each copy's codes and scales at the group's offset, the group's amax slots,
S_decs and Philox words), with M = the group's padded row count. So every compile-time variant
of the tile kernel (formats, roundings, column RHT, 2D tiles) is the grouped kernel's too, except
what is prepared once per launch (``grouped_params``: the amax kernel's last-CTA preparation of
the encode tables, the 2-D grid, the staged layout, the swizzled scales).

The CTA table (int32 [CTAs, TABLE_COLUMNS], built by ``fp4gen.runtime.grouped_tile.tile_table``):
per CTA its group, the tile's index inside the group (tiles along K fastest, as the 1-D grid of
the tile kernel), the group's first input row and real rows, its padded rows (the copies' M) and
its first padded row (where its copies start in the outputs). An empty group has no CTA.

Output layout: the groups' copies one after another in padded rows. A rowwise copy is the rows
[first padded row, + padded rows) of [sum of padded rows, K] codes and scales. A columnwise
copy takes one of two layouts, fixed when the kernel is built:

- per group (``side_by_side=False``): group g's copy is a [K, padded rows] tensor of its own
  starting at byte first padded row x (bytes of a row of K codes), its scales at element first
  padded row x (scales of a row): the same offsets as the rowwise copy's, so each group's copy
  is a contiguous tensor (the experts' weights: groups of one size, one [groups x K, rows]
  tensor);
- side by side (``side_by_side=True``, 1D blocks only): every group's copy in one [K, sum of
  padded rows] tensor, group g's [K, padded rows] at columns [first padded row, + padded rows)
  (codes from byte first padded row x bits / 8 of each row, scales from element first padded
  row / B): the operands of a GEMM grouped along K (the experts' wgrad), which reads the
  groups side by side with no concatenation. The launch passes the sum of padded rows.

Only the addresses move between the two: each group's blocks, scales and stochastic rounding
are the same (a group's Philox index is its element's place in its own [K, padded rows] copy).
Per group
(fp32): one global amax per amax slot ([G, slots]), one S_dec per copy ([G, copies]); int32
[G, 2 + 2 x stochastic copies]: the seed and each stochastic copy's Philox offset as (lo, hi)
words.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32

from fp4gen.kernels.quantize_tile import TileQuantizeKernel, TileQuantizeParams
from fp4gen.kernels.tile import TileAmaxKernel

# the columns of the CTA table
GROUP, TILE, IN_ROW, ROWS, PAD_ROWS, OUT_ROW = range(6)
TABLE_COLUMNS = 6


def grouped_params(params: TileQuantizeParams) -> TileQuantizeParams:
    """The tile params of the grouped form: the same variant with what is done once per launch
    made per CTA (every group has its own global scale): no prepared constants (each CTA computes
    its encode-factor table from its group's S_dec), hence no fold and no 2-D grid; the rotated
    layout in place of the staged one (which is tied to the fold); whole strips off (a group's
    rows are clamped by its own count)."""
    strip = replace(params.strip, grid_2d=False, whole_strips=False)
    return replace(params, strip=strip, prep=False, fold=(), fold_sdec_max=0.0, staged=False)


def grouped_tile_reason(params: TileQuantizeParams) -> str | None:
    """None where the grouped tile kernels serve these params, else why not."""
    if any(c.swizzled for c in params.copies):
        return "the grouped tile kernels write compact scales only"
    if params.choice:
        return "block targets and stochastic tile scales are the dense tile kernel's only"
    return None


def group_offsets(out_row, k, bits: int, block: int, two_d: bool) -> tuple:
    """(byte offset of a group's codes, element offset of its scales) in the flat outputs, for
    the group's first padded row ``out_row`` and K = ``k``: the same for its rowwise and its
    columnwise copy (module docstring). Ints on the host, Int32 values in the kernel."""
    row_bytes = k * bits // 8  # bytes of a row of K codes
    # 2D: a row of K / B tile scales per B padded rows; 1D: a row of K / B scales per padded row
    # (the columnwise copy: K x padded rows / B, the same count); K is a multiple of B (the host
    # refuses any other K: runtime.grouped_tile.k_reason)
    rows_before = out_row // block if two_d else out_row
    return out_row * row_bytes, rows_before * (k // block)


@dataclass
class GroupTile:
    """This CTA's place in its group (trace-time values read from the CTA table)."""

    tile: Int32  # the tile's index inside the group
    in_row: Int32  # the group's first row of the input
    rows: Int32  # the group's real rows (>= 1)


class GroupedPlacement:
    """The grouped kernels' ``place`` and ``load``: the CTA's tile of its group (``self.group``,
    set by the kernel entry before the body is traced)."""

    group: GroupTile
    strip: object

    def place(self, tidx, tiles_k) -> tuple:
        """The group's tile index (its first tile writes the group's S_dec) and the strip's
        origin inside the group's padded rows."""
        g = self.group
        return g.tile, *self.strip.strip_origin(tidx, g.tile, tiles_k)

    def load(self, gX, row0, col0, M, K) -> list:
        """The strip's rows of the group: loads clamped to the group's last real row (and
        columns to K - vec), then every row at or past the group's real rows set to +0.0, the
        zero padding the reference quantizes (and what the column RHT transforms)."""
        sp = self.strip.p
        g = self.group
        kv = K // sp.vec
        cu = cutlass.min(col0, K - sp.vec) // sp.vec
        last = g.rows - 1
        frags = []
        for i in range(sp.rows):  # issue every load first
            r = cutlass.min(row0 + i, last)
            frag = cute.make_rmem_tensor((sp.vec,), sp.input_type)
            cute.autovec_copy(gX[(g.in_row + r) * kv + cu, None], frag)
            frags.append(frag)
        for i in range(sp.rows):
            keep = row0 + i < g.rows
            words = cute.recast_tensor(frags[i], Uint32)
            for w in range(sp.vec * sp.in_bytes // 4):
                words[w] = cutlass.select_(keep, words[w], Uint32(0))
        return frags


def _at(t: cute.Tensor, offset) -> cute.Tensor:
    """A one-element view of ``t`` at element ``offset`` (the body reads its outputs' base
    addresses and index 0 of its scalars only)."""
    return cute.make_tensor(t.iterator + offset, cute.make_layout(1))


def _tiles_k(p, K):
    """Tiles along K (``p``: quantize or amax params)."""
    return (K + (p.strip.tile_k - 1)) // p.strip.tile_k


class GroupedTileAmaxKernel(GroupedPlacement, TileAmaxKernel):
    """Each group's global amax per amax slot (|x|, |RHT_col(x)|) into a zeroed fp32 [G x
    slots] buffer: a CTA reduces its tile of its group as the tile amax kernel reduces a tile,
    one atomic max per slot into its group's."""

    @cute.jit
    def __call__(
        self, mX: cute.Tensor, mTable: cute.Tensor, mAmax: cute.Tensor, n_ctas: Int32,
        stream: cuda.CUstream,
    ):  # fmt: skip
        K = mX.shape[1]
        tiles_k = _tiles_k(self.p, K)
        self.kernel(self.strip.units(mX), mTable, mAmax, K, tiles_k).launch(
            grid=[n_ctas, 1, 1], block=[self.p.strip.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, gX: cute.Tensor, mTable: cute.Tensor, mAmax: cute.Tensor, K: Int32,
               tiles_k: Int32):  # fmt: skip
        bidx, _, _ = cute.arch.block_idx()
        self.group = GroupTile(mTable[bidx, TILE], mTable[bidx, IN_ROW], mTable[bidx, ROWS])
        amaxes = self.group_amaxes(mAmax, mTable[bidx, GROUP])
        self.body(gX, amaxes, mTable[bidx, PAD_ROWS], K, tiles_k)

    def group_amaxes(self, mAmax, group) -> list:
        """The group's amax slots (one-element views)."""
        slots = len(self.p.slot_rht)
        return [_at(mAmax, group * slots + s) for s in range(slots)]


class GroupedTileQuantizeKernel(GroupedPlacement, TileQuantizeKernel):
    """Every group's copies (module docstring): per CTA the tile kernel's body on its group's
    tile, with the group's outputs, global scales and Philox stream. ``side_by_side``: the
    columnwise copy's layout (module docstring)."""

    def __init__(self, params: TileQuantizeParams, arch: str, side_by_side: bool = False) -> None:
        if side_by_side and params.two_d:
            raise ValueError("the side-by-side columnwise layout takes 1D blocks only")
        super().__init__(params, arch)
        self.side_by_side = side_by_side

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mQ: cute.Tensor,
        mS: cute.Tensor,
        mQc: cute.Tensor,
        mSc: cute.Tensor,
        mTable: cute.Tensor,
        mAmax: cute.Tensor,
        mSdec: cute.Tensor,
        mPhilox: cute.Tensor,
        n_ctas: Int32,
        pad_rows: Int32,
        stream: cuda.CUstream,
    ):
        """mX (M, K) input, every group's rows contiguous; mQ / mS the rowwise copies' codes
        and scales, mQc / mSc the columnwise ones' (flat; a copy the params lack: any
        one-element tensor, never written); mTable (CTAs, TABLE_COLUMNS) int32; mAmax (G x
        slots) fp32 (unread without a global scale); mSdec (G x copies) fp32 (out with a global
        scale; else 1.0 from the host, NaN over it for a non-finite group); mPhilox (G, 2 + 2 x
        stochastic copies) int32 (unread without stochastic rounding); pad_rows: the sum of
        the groups' padded rows (the side-by-side copy's columns; unread per group)."""
        K = mX.shape[1]
        tiles_k = _tiles_k(self.p, K)
        tensors = (mQ, mS, mQc, mSc, mTable, mAmax, mSdec, mPhilox)
        self.kernel(self.strip.units(mX), *tensors, K, tiles_k, pad_rows).launch(
            grid=[n_ctas, 1, 1], block=[self.p.strip.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        gX: cute.Tensor,
        mQ: cute.Tensor,
        mS: cute.Tensor,
        mQc: cute.Tensor,
        mSc: cute.Tensor,
        mTable: cute.Tensor,
        mAmax: cute.Tensor,
        mSdec: cute.Tensor,
        mPhilox: cute.Tensor,
        K: Int32,
        tiles_k: Int32,
        pad_rows: Int32,
    ):
        bidx, _, _ = cute.arch.block_idx()
        self.group = GroupTile(mTable[bidx, TILE], mTable[bidx, IN_ROW], mTable[bidx, ROWS])
        self.pad_rows = pad_rows
        group = mTable[bidx, GROUP]
        outs = {"row": (mQ, mS), "col": (mQc, mSc)}
        tensors = self.group_tensors(outs, mAmax, mSdec, group, mTable[bidx, OUT_ROW], K)
        philox = self.group_philox(mPhilox, group)
        self.body(gX, tensors, philox, mTable[bidx, PAD_ROWS], K, tiles_k)

    def col_strides(self, row_c, nbm) -> tuple:
        """Side by side, a row of the columnwise copy spans every group's padded rows."""
        if self.side_by_side:
            p = self.p
            return self.pad_rows * p.elem.bits // 8, self.pad_rows // p.block
        return row_c, nbm

    def group_tensors(self, outs: dict, mAmax, mSdec, group, out_row, K) -> list:
        """The body's tensors (``split_args``' order) for this group: each copy's codes and
        scales at the group's offset (module docstring), its amax slots and S_decs."""
        p = self.p
        codes_off, scales_off = group_offsets(out_row, K, p.elem.bits, p.block, p.two_d)
        tensors = []
        for c in p.copies:
            codes, scales = outs[c.tag]
            if c.tag == "col" and self.side_by_side:
                # the group's columns of every row: its first padded row's byte and block
                tensors += [
                    _at(codes, out_row * p.elem.bits // 8), _at(scales, out_row // p.block)
                ]  # fmt: skip
                continue
            tensors += [_at(codes, codes_off), _at(scales, scales_off)]
        if p.global_scale:
            tensors += [_at(mAmax, group * p.slots + s) for s in range(p.slots)]
        copies = len(p.copies)
        tensors += [_at(mSdec, group * copies + i) for i in range(copies)]
        return tensors

    def group_philox(self, mPhilox, group) -> list:
        """The body's Philox scalars for this group: its seed and each stochastic copy's offset
        from the table, no device counter (address 0)."""
        p = self.p
        if not p.sr:
            return []
        words = [mPhilox[group, j] for j in range(2 + 2 * p.n_sr)]
        return words + [Int32(0)] * 4


__all__ = [
    "GROUP",
    "IN_ROW",
    "OUT_ROW",
    "PAD_ROWS",
    "ROWS",
    "TABLE_COLUMNS",
    "TILE",
    "GroupTile",
    "GroupedTileAmaxKernel",
    "GroupedTileQuantizeKernel",
    "group_offsets",
    "grouped_params",
    "grouped_tile_reason",
]
