"""The K-grouped block-scaled FP8 GEMM for Hopper (sm_90a): every expert's wgrad in one launch.

For G groups of K (each expert's tokens, the wgrad GEMM's reduction) side by side in A and B::

    C_g[m, n] = S_a[g] S_b[g] sum_b s_a[m, b] s_b[n, b] P_b[m, n]
                for the K-blocks b of group g: koffs[g] <= k < koffs[g + 1]

with P_b the FP8 tensor cores' sum over K-block b, exactly as ``fp4gen.kernels.gemm_sm90_fp8``
computes one dense GEMM of A[:, koffs[g]:koffs[g + 1]] and B[:, koffs[g]:koffs[g + 1]]
(numerics.md 6.1): the kernel is that class with ``k_grouped=True``
(``GemmSm90Fp8Params.k_grouped``), the same producer, mainloop, promotion and epilogue; only the
tile walk (group by group), each tile's K range (its group's K-blocks, in order) and the output
(each group's own [M, N] of C) differ. So C_g is the dense kernel's result for the group's
columns, bit for bit: the same K-blocks, wgmma and promotions in the same order.

Arguments (``GemmSm90Fp8KGroupedKernel.__call__``):

- A: uint8 [M, K] FP8 codes, every group's columns side by side; its block scales (1 x block_k
  blocks) MN-major [KB, Mp] with ``mn_major_scales`` (Mp a multiple of a 16-byte chunk's rows),
  else row-major [M, KB] (fp32, or ue8m0 codes with KB padded to 4);
- B: uint8 [N, K] and its scales likewise (1 x block_k blocks);
- S_a, S_b: fp32 [G], each group's global decode scales;
- koffs: int32 [G + 1] on the device, non-decreasing, each a multiple of block_k, koffs[0] = 0
  and koffs[G] <= K: a group may be empty (its C_g is 0 x S_a S_b);
- C: [G x M, N] bf16 or fp32, group g's [M, N] at rows g M.

Every group has ceil(M / tile_m) x ceil(N / tile_n) tiles; the linear tile index runs over group
0's, then group 1's, each group's rasterized as the dense kernel's (``tile_origin``), and the
CTAs walk them persistently. The stages are counted across tiles (each tile takes its group's
k-tiles), the same count in the producer and the MMA warpgroups.

Limits besides the dense kernel's: 1xN blocks on both sides, one CTA per cluster, one partial
accumulator, no bias or accumulate. The coalesced variant (``mn_major_scales`` and
``wide_stores``, the default: ``codegen.gemm_fp8.K_GROUPED_COALESCED``) copies each K-block's
scales in 16-byte chunks and stores whole sectors of the group's C.
"""

from __future__ import annotations

from typing import ClassVar

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8

from fp4gen.kernels.gemm_sm90_fp8 import (
    OUTPUTS,
    GemmSm90Fp8Kernel,
    GemmSm90Fp8Params,
    compile_options,
    fake_scales,
    tile_origin_of,
)


def k_tile_walk(
    koffs: list[int], m: int, n: int, *, tile_m: int = 128, tile_n: int = 128, group_m: int = 8
) -> list[tuple[int, int, int, int, int]]:
    """Every output tile of the K-grouped kernel in walk order, as (group, first row of the
    group's C, first column, first K element, K elements): what ``k_group_tile``,
    ``tile_origin`` and ``k_group_range`` compute on the device for t = 0, 1, ... (pure
    Python, for the CPU tests and the docs)."""
    m_tiles, n_tiles = -(-m // tile_m), -(-n // tile_n)
    tiles = []
    for g in range(len(koffs) - 1):
        for local in range(m_tiles * n_tiles):
            m_tile, n_tile = tile_origin_of(local, m_tiles, n_tiles, group_m)
            k0, k1 = koffs[g], koffs[g + 1]
            tiles.append((g, m_tile * tile_m, n_tile * tile_n, k0, k1 - k0))
    return tiles


class GemmSm90Fp8KGroupedKernel(GemmSm90Fp8Kernel):
    """The K-grouped kernel (module docstring):
    ``__call__(mA, mSFA, mB, mSFB, mGA, mGB, mKOffs, mC, max_ctas, stream)``."""

    K_GROUPED: ClassVar[bool] = True

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # uint8 [M, K]: every group's columns
        mSFA: cute.Tensor,  # [M, KB (padded)]
        mB: cute.Tensor,  # uint8 [N, K]
        mSFB: cute.Tensor,  # [N, KB (padded)]
        mGA: cute.Tensor,  # fp32 [G] S_a per group
        mGB: cute.Tensor,  # fp32 [G] S_b per group
        mKOffs: cute.Tensor,  # int32 [G + 1] the groups' first K elements
        mC: cute.Tensor,  # out [G * M, N]
        max_ctas: Int32,
        stream: cuda.CUstream,
    ):
        self.launch(mA, mSFA, mB, mSFB, mGA, mGB, mC, None, max_ctas, stream, mKOffs)


def compile_k_grouped_fp8_gemm(
    params: GemmSm90Fp8Params, arch: str = "sm_90a", *, dump_dir: str | None = None
):
    """The TVM-FFI compiled K-grouped kernel of ``params`` (``k_grouped=True``) for ``arch``
    (sm_90a), built against fake tensors with dynamic M, N, K, G (K % block_k == 0, checked by
    the caller); needs no GPU. With ``dump_dir`` the PTX is kept there. Arguments of the
    result: A, A's scales, B, B's scales, S_a [G], S_b [G], K offsets [G + 1], C [G * M, N],
    max_ctas; the stream is the current torch one."""
    if not params.k_grouped:
        raise ValueError("compile_k_grouped_fp8_gemm takes k_grouped params")
    options = compile_options(arch, dump_dir)
    fake = cute.runtime.make_fake_compact_tensor
    m, n = cute.sym_int(), cute.sym_int()
    k = cute.sym_int(divisibility=params.block_k)
    groups = cute.sym_int()
    sf_a, sf_b = fake_scales(params, m, n)
    args = [
        fake(Uint8, (m, k), stride_order=(1, 0), assumed_align=16),  # A's FP8 codes
        sf_a,
        fake(Uint8, (n, k), stride_order=(1, 0), assumed_align=16),  # B's
        sf_b,
        fake(Float32, (groups,), assumed_align=4),
        fake(Float32, (groups,), assumed_align=4),
        fake(Int32, (cute.sym_int(),), assumed_align=4),  # K offsets [G + 1]
        fake(OUTPUTS[params.out], (cute.sym_int(), n), stride_order=(1, 0), assumed_align=16),
    ]
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(GemmSm90Fp8KGroupedKernel(params), *args, Int32(1), stream, options=options)


__all__ = [
    "GemmSm90Fp8KGroupedKernel",
    "GemmSm90Fp8Params",  # the generated module imports it from here
    "compile_k_grouped_fp8_gemm",
    "k_tile_walk",
]
