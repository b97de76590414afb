"""The M-grouped block-scaled FP8 GEMM for Hopper (sm_90a): one launch for every expert's GEMM.

For G groups of rows of A (the tokens routed to each expert, sorted by expert) and one B per
group (the experts' weights, batched)::

    C[r, n] = S_a[g] S_b[g] sum_b s_a[r, b] s_b[g][n, b] P_b[r, n]  (+ bias[g][n])
              for offsets[g] <= r < offsets[g + 1]

with P_b the FP8 tensor cores' sum over K-block b, exactly as ``fp4gen.kernels.gemm_sm90_fp8``
computes one dense GEMM (numerics.md 6.1): the kernel is that class with ``grouped=True``
(``GemmSm90Fp8Params.grouped``), the same producer, mainloop, promotion and epilogue; only the
persistent tile walk, the rows the TMA loads and the epilogue's row limit differ. So each
group's rows are the dense kernel's result for that group's A rows and B, bit for bit: an
element's K-blocks, wgmma and promotions are the same whatever row of a tile it sits in.

Arguments (``GemmSm90Fp8GroupedKernel.__call__``):

- A: uint8 [M, K] FP8 codes, every group's rows, group g at rows offsets[g] .. offsets[g + 1];
  A's block scales [M, KB] row-major (fp32, or ue8m0 codes with KB padded to 4);
- B: uint8 [G * N, K], group g's [N, K] at rows g N; its scales [G * N, KB] (1 x block_k) or
  [G * ceil(N / block_k), KB] (block_k x block_k tiles), group g's from row g N (or
  g ceil(N / block_k));
- S_a, S_b: fp32 [G], each group's global decode scale (1.0 for formats without one);
- offsets: int32 [G + 1] on the device, non-decreasing, offsets[0] = 0, offsets[G] = M: groups
  may be empty (no tile) or of any size;
- C: [M, N] bf16 or fp32; the bias (``GemmSm90Fp8GroupedBiasKernel``): fp32 [G * N], group g's
  at g N.

The tile walk. Group g has ceil(M_g / tile_m) M-tiles of N-tiles each; the linear tile index t
runs over group 0's tiles, then group 1's, ... (``tile_walk`` in Python says the same, for the
CPU tests). Inside a group the tiles are rasterized as the dense kernel's (``tile_origin``:
group_m M-tiles at a time). A tile never spans two groups: its rows start at offsets[g] +
m_tile tile_m, and the rows past offsets[g + 1] (the next group's, or past M, which the TMA
zero-fills) only feed outputs that are not stored. The CTAs walk t = cta, cta + grid, ... as
the dense kernel does; each warp keeps its place in the walk (group, its first tile, its
M-tiles) and moves it forward, so finding a tile's group costs one step per group passed.
The grid is min(SMs, (ceil(M / tile_m) + G) N-tiles), a bound on the tiles without reading the
offsets on the host; the walk's own count is the groups' sum, read once per CTA.

Limits besides the dense kernel's: one CTA per cluster, row-major scales (a group's rows start
at any row, so no 16-byte chunks of MN-major scales), G * N rows of B and M * N < 2^31.
"""

from __future__ import annotations

from typing import ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8
from cutlass.cute.nvgpu import cpasync

from fp4gen.kernels.gemm_sm90_fp8 import (
    OUTPUTS,
    GemmSm90Fp8Kernel,
    GemmSm90Fp8Params,
    compile_options,
    tile_origin_of,
)


def tile_walk(
    offsets: list[int], n: int, *, tile_m: int = 128, tile_n: int = 128, group_m: int = 8
) -> list[tuple[int, int, int, int]]:
    """Every output tile of the grouped kernel in walk order, as (group, first row, row end,
    first column): what ``GemmSm90Fp8GroupedKernel.walk_to`` and ``tile_origin`` compute on the
    device for t = 0, 1, ... (pure Python, for the CPU tests and the docs)."""
    n_tiles = -(-n // tile_n)
    tiles = []
    for g in range(len(offsets) - 1):
        m_tiles = -(-(offsets[g + 1] - offsets[g]) // tile_m)
        for local in range(m_tiles * n_tiles):
            m_tile, n_tile = tile_origin_of(local, m_tiles, n_tiles, group_m)
            tiles.append((g, offsets[g] + m_tile * tile_m, offsets[g + 1], n_tile * tile_n))
    return tiles


class GemmSm90Fp8GroupedKernel(GemmSm90Fp8Kernel):
    """The grouped kernel (module docstring):
    ``__call__(mA, mSFA, mB, mSFB, mGA, mGB, mOffs, mC, max_ctas, stream)``."""

    GROUPED: ClassVar[bool] = True

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # uint8 [M, K]: every group's rows
        mSFA: cute.Tensor,  # [M, KB (padded)]
        mB: cute.Tensor,  # uint8 [G * N, K]: the groups' B
        mSFB: cute.Tensor,  # [G * N or G * ceil(N / block_k), KB (padded)]
        mGA: cute.Tensor,  # fp32 [G] S_a per group
        mGB: cute.Tensor,  # fp32 [G] S_b per group
        mOffs: cute.Tensor,  # int32 [G + 1] the groups' first rows
        mC: cute.Tensor,  # out [M, N]
        max_ctas: Int32,
        stream: cuda.CUstream,
    ):
        self.launch(mA, mSFA, mB, mSFB, mGA, mGB, mC, None, max_ctas, stream, mOffs)

    # ---- the tile walk (device side; ``tile_walk`` is the same in Python)
    @cute.jit
    def group_m_tiles(self, mOffs: cute.Tensor, g):
        """Group g's M-tiles: ceil((offsets[g + 1] - offsets[g]) / tile_m)."""
        return (mOffs[g + 1] - mOffs[g] + (self.p.tile_m - 1)) // self.p.tile_m

    @cute.jit
    def group_tile_count(self, mOffs: cute.Tensor, n_tiles):
        """Every group's tiles together."""
        count = Int32(0)
        for g in cutlass.range(mOffs.shape[0] - 1, unroll=1):
            count = count + self.group_m_tiles(mOffs, g) * n_tiles
        return count

    @cute.jit
    def walk_start(self, mOffs: cute.Tensor):
        """The walk's place before tile 0: group 0, its first tile 0, its M-tiles."""
        return Int32(0), Int32(0), self.group_m_tiles(mOffs, Int32(0))

    @cute.jit
    def walk_to(self, t, g, first, mt, mOffs: cute.Tensor, n_tiles):
        """The walk's place at tile t (t at least the current place's first tile, below the
        total): the groups whose tiles all lie before t are passed (empty groups have none)."""
        while t >= first + mt * n_tiles:
            first = first + mt * n_tiles
            g = g + 1
            mt = self.group_m_tiles(mOffs, g)
        return g, first, mt

    def b_scale_rows(self, n):
        """Rows of B's scales per group: N (1 x block_k), ceil(N / block_k) (tiles)."""
        if self.p.b_2d:
            return (n + (self.p.block_k - 1)) // self.p.block_k
        return n

    @cute.jit
    def rows_at(self, tma_atom, mX_tma: cute.Tensor, sX: cute.Tensor, row0, rows: int):
        """The TMA source of ``rows`` rows from row ``row0`` (any row) on: (atom, k-tile)."""
        gX = cute.local_tile(
            cute.domain_offset((row0, 0), mX_tma), (rows, self.p.tile_k), (0, None)
        )
        _, tXgX = cpasync.tma_partition(
            tma_atom,
            0,
            cute.make_layout(1),
            cute.group_modes(sX, 0, 2),
            cute.group_modes(gX, 0, 2),
        )
        return tXgX

    @cute.jit
    def group_bias(self, mBias: cute.Tensor | None, g, n):
        """Group g's bias [N] (element j at g N + j), or None."""
        if cutlass.const_expr(mBias is None):
            return None
        return cute.domain_offset((g * n,), mBias)


class GemmSm90Fp8GroupedBiasKernel(GemmSm90Fp8GroupedKernel):
    """The grouped kernel with a bias per group: ``__call__(mA, mSFA, mB, mSFB, mGA, mGB,
    mOffs, mC, mBias, max_ctas, stream)`` with mBias fp32 [G * N]."""

    TAKES_BIAS: ClassVar[bool] = True

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mSFA: cute.Tensor,
        mB: cute.Tensor,
        mSFB: cute.Tensor,
        mGA: cute.Tensor,
        mGB: cute.Tensor,
        mOffs: cute.Tensor,
        mC: cute.Tensor,
        mBias: cute.Tensor,
        max_ctas: Int32,
        stream: cuda.CUstream,
    ):
        self.launch(mA, mSFA, mB, mSFB, mGA, mGB, mC, mBias, max_ctas, stream, mOffs)


def compile_grouped_fp8_gemm(
    params: GemmSm90Fp8Params, arch: str = "sm_90a", *, dump_dir: str | None = None
):
    """The TVM-FFI compiled grouped kernel of ``params`` (``grouped=True``) for ``arch``
    (sm_90a), built against fake tensors with dynamic M, N, K, G (K % block_k == 0, checked by
    the caller); needs no GPU. With ``dump_dir`` the PTX is kept there. Arguments of the
    result: A, A's scales, B, B's scales, S_a [G], S_b [G], offsets [G + 1], C (, bias
    [G * N]), max_ctas; the stream is the current torch one."""
    if not params.grouped:
        raise ValueError("compile_grouped_fp8_gemm takes grouped params")
    options = compile_options(arch, dump_dir)
    fake = cute.runtime.make_fake_compact_tensor
    m, n = cute.sym_int(), cute.sym_int()
    k = cute.sym_int(divisibility=params.block_k)
    groups = cute.sym_int()
    sf_t = Float32 if params.scale_kind == "fp32" else Uint8
    sf_div = 1 if params.scale_kind == "fp32" else 4  # ue8m0 rows padded to whole words
    cls = GemmSm90Fp8GroupedBiasKernel if params.bias else GemmSm90Fp8GroupedKernel
    args = [
        fake(Uint8, (m, k), stride_order=(1, 0), assumed_align=16),  # A's FP8 codes
        fake(sf_t, (m, cute.sym_int(divisibility=sf_div)), stride_order=(1, 0), assumed_align=4),
        fake(Uint8, (cute.sym_int(), k), stride_order=(1, 0), assumed_align=16),  # B's, batched
        fake(
            sf_t,
            (cute.sym_int(), cute.sym_int(divisibility=sf_div)),
            stride_order=(1, 0),
            assumed_align=4,
        ),
        fake(Float32, (groups,), assumed_align=4),
        fake(Float32, (groups,), assumed_align=4),
        fake(Int32, (cute.sym_int(),), assumed_align=4),  # offsets [G + 1]
        fake(OUTPUTS[params.out], (m, n), stride_order=(1, 0), assumed_align=16),
    ]
    if params.bias:
        args.append(fake(Float32, (cute.sym_int(),), assumed_align=4))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(cls(params), *args, Int32(1), stream, options=options)


__all__ = [
    "GemmSm90Fp8GroupedBiasKernel",
    "GemmSm90Fp8Params",  # the generated module imports it from here
    "GemmSm90Fp8GroupedKernel",
    "compile_grouped_fp8_gemm",
    "tile_walk",
]
