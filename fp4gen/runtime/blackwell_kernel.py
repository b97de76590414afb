"""The CuTe DSL side of the native Blackwell GEMM: NVIDIA's block-scaled tcgen05 GEMM with the
global decode scales applied in its epilogue.

The kernel is ``PersistentDenseBlockScaledGemmKernel`` of nvidia-cutlass-operators (persistent,
warp-specialized: a TMA warp loads A, B and both scale-factor tensors, an MMA warp copies the
scale factors to tensor memory and issues ``tcgen05.mma ... block_scale``, four epilogue warps
read the fp32 accumulator back and store C with TMA). fp4gen adds two things:

* An entry point on byte tensors. Codes arrive as uint8 rows (two e2m1 codes per byte, one e4m3
  / e5m2 code per byte, four 6-bit codes per three bytes), scale codes as the uint8 buffer of
  the 128x4 layout, alpha as one fp32 element; the pointers are recast to the MMA's element and
  scale types. Compiled with TVM-FFI against fake tensors, so M, N and K stay dynamic and
  torch tensors are passed straight in (the current torch stream is used).
* The epilogue alpha S_a * S_b. The package's kernel applies a compile-time elementwise
  callable in its epilogue but takes no runtime scalar, and a kernel cannot capture a value of
  the host function that launches it. So the package's kernel body is traced inside a kernel
  of ours that has one more parameter (a pointer to alpha), loads alpha once and hands the body
  the epilogue ``x * alpha``. The body runs unchanged: the package's ``__call__`` builds every
  layout, TMA atom and the tile scheduler and calls ``self.kernel(...)``, which we override to
  launch our kernel instead. The hook applies after the conversion to the output type, so the
  alpha multiply is exact only for fp32 output (bf16 output: see fp4gen.runtime.blackwell_gemm).

Importing this module imports the CuTe DSL and nvidia-cutlass-operators; nothing here needs a GPU
(``compile_gemm`` cross-compiles for sm_100a on any machine).
"""

from __future__ import annotations

import inspect
import os
import shlex
import types
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
from cutlass.cute.nvgpu.common import OperandMajorMode
from cutlass.operators.providers.cutedsl.gemm.implementations.sm100_dense_blockscaled_static_persistent_impl import (  # noqa: E501
    PersistentDenseBlockScaledGemmKernel,
)

from fp4gen.runtime.blackwell_gemm import GemmConfig
from fp4gen.vocab import Arch

ARCHS: tuple[str, ...] = (Arch.SM100A.value,)

# The package kernel's parameters, in order, after ``self`` and before ``epilogue_op``: our
# kernel takes the same (plus alpha). Checked against the installed package at import.
BODY_PARAMS: tuple[str, ...] = (
    "tiled_mma",
    "tiled_mma_sfb",
    "tma_atom_a",
    "mA_mkl",
    "tma_atom_b",
    "mB_nkl",
    "tma_atom_sfa",
    "mSFA_mkl",
    "tma_atom_sfb",
    "mSFB_nkl",
    "tma_atom_c",
    "mC_mnl",
    "cluster_layout_vmnk",
    "cluster_layout_sfb_vmnk",
    "a_smem_layout_staged",
    "b_smem_layout_staged",
    "sfa_smem_layout_staged",
    "sfb_smem_layout_staged",
    "c_smem_layout_staged",
    "epi_tile",
    "tile_sched_params",
)

_DTYPES: dict[str, type[cutlass.Numeric]] = {
    "Float4E2M1FN": cutlass.Float4E2M1FN,
    "Float6E2M3FN": cutlass.Float6E2M3FN,
    "Float6E3M2FN": cutlass.Float6E3M2FN,
    "Float8E4M3FN": cutlass.Float8E4M3FN,
    "Float8E5M2": cutlass.Float8E5M2,
    "Float8E8M0FNU": cutlass.Float8E8M0FNU,
    "Float32": cutlass.Float32,
    "BFloat16": cutlass.BFloat16,
}


def _package_body() -> Any:
    """The package kernel's body as a traceable function (its own decorated kernel stays
    untouched: the DSL records decoration state on the function object, so this is a fresh
    function around the same code, with the same name, which the DSL's source preprocessor
    looks up)."""
    raw = PersistentDenseBlockScaledGemmKernel.kernel.__wrapped__
    params = list(inspect.signature(raw).parameters)
    if params != ["self", *BODY_PARAMS, "epilogue_op"]:
        raise ImportError(
            "nvidia-cutlass-operators changed the parameters of "
            "PersistentDenseBlockScaledGemmKernel.kernel (fp4gen wraps it with an epilogue "
            f"alpha): expected {['self', *BODY_PARAMS, 'epilogue_op']}, found {params}"
        )
    fn = types.FunctionType(
        raw.__code__, raw.__globals__, raw.__name__, raw.__defaults__, raw.__closure__
    )
    fn.__qualname__ = raw.__qualname__
    return cute.jit(fn)


_BODY = _package_body()


class AlphaEpilogueGemm(PersistentDenseBlockScaledGemmKernel):
    """The package's block-scaled GEMM with C = alpha * (A @ B^T) computed in its epilogue."""

    def __init__(self, config: GemmConfig) -> None:
        super().__init__(config.sf_vec, config.tile_mn, config.cluster_mn)
        self.config = config
        self._alpha_ptr: Any = None  # set by run() while tracing, read by kernel()

    def kernel(self, *args: Any) -> Any:
        """Called by the package's ``__call__`` with its kernel arguments (the last is its
        epilogue): launch our kernel instead, with alpha instead of the epilogue."""
        if len(args) != len(BODY_PARAMS) + 1:
            raise TypeError(f"expected {len(BODY_PARAMS) + 1} kernel arguments, got {len(args)}")
        return self.alpha_kernel(*args[:-1], self._alpha_ptr)

    @cute.kernel
    def alpha_kernel(
        self,
        tiled_mma: cute.TiledMma,
        tiled_mma_sfb: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA_mkl: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_nkl: cute.Tensor,
        tma_atom_sfa: cute.CopyAtom,
        mSFA_mkl: cute.Tensor,
        tma_atom_sfb: cute.CopyAtom,
        mSFB_nkl: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC_mnl: cute.Tensor,
        cluster_layout_vmnk: cute.Layout,
        cluster_layout_sfb_vmnk: cute.Layout,
        a_smem_layout_staged: cute.ComposedLayout,
        b_smem_layout_staged: cute.ComposedLayout,
        sfa_smem_layout_staged: cute.Layout,
        sfb_smem_layout_staged: cute.Layout,
        c_smem_layout_staged: cute.Layout | cute.ComposedLayout,
        epi_tile: cute.Tile,
        tile_sched_params: utils.PersistentTileSchedulerParams,
        alpha_ptr: cute.Pointer,
    ):
        alpha = cute.make_tensor(alpha_ptr, cute.make_layout(1))[0]

        def epilogue(x: Any) -> Any:
            # x is already in the output type; fp32 output multiplies exactly once.
            return (x.to(cutlass.Float32) * alpha).to(x.dtype)

        _BODY(
            self,
            tiled_mma,
            tiled_mma_sfb,
            tma_atom_a,
            mA_mkl,
            tma_atom_b,
            mB_nkl,
            tma_atom_sfa,
            mSFA_mkl,
            tma_atom_sfb,
            mSFB_nkl,
            tma_atom_c,
            mC_mnl,
            cluster_layout_vmnk,
            cluster_layout_sfb_vmnk,
            a_smem_layout_staged,
            b_smem_layout_staged,
            sfa_smem_layout_staged,
            sfb_smem_layout_staged,
            c_smem_layout_staged,
            epi_tile,
            tile_sched_params,
            epilogue,
        )

    @cute.jit
    def run(
        self,
        a_codes: cute.Tensor,  # uint8 [M, K * a_bits / 8]
        b_codes: cute.Tensor,  # uint8 [N, K * b_bits / 8]
        a_scales: cute.Tensor,  # uint8, the 128x4 layout of [M, K / vec]
        b_scales: cute.Tensor,  # uint8, the 128x4 layout of [N, K / vec]
        c: cute.Tensor,  # fp32 / bf16 [M, N], row-major
        alpha: cute.Tensor,  # fp32 [1]
        stream: Any,
    ):
        cfg = self.config
        sf_dtype = _DTYPES[cfg.sf_dtype]
        self._alpha_ptr = alpha.iterator
        m, n = c.shape[0], c.shape[1]
        k = a_codes.shape[1] * 8 // cfg.a_bits
        self.__call__(
            cute.recast_ptr(a_codes.iterator, dtype=_DTYPES[cfg.a_dtype]),
            cute.recast_ptr(b_codes.iterator, dtype=_DTYPES[cfg.b_dtype]),
            cute.recast_ptr(a_scales.iterator, dtype=sf_dtype),
            cute.recast_ptr(b_scales.iterator, dtype=sf_dtype),
            c.iterator,
            (OperandMajorMode.K, OperandMajorMode.K, cutlass.tensor_utils.LayoutEnum.ROW_MAJOR),
            (m, n, k, cutlass.Int32(1)),
            cfg.max_active_clusters,
            stream,
        )


def compile_gemm(config: GemmConfig, arch: str, *, dump_dir: str | None = None) -> Any:
    """The TVM-FFI compiled GEMM of ``config`` for ``arch`` (no GPU needed). Arguments of the
    compiled function: a_codes, b_codes, a_scales, b_scales, c, alpha (see ``run``). With
    ``dump_dir`` (created if missing) the PTX is kept: there and in ``__ptx__``."""
    if arch not in ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; the tcgen05 GEMM targets {ARCHS}")
    options = f"--enable-tvm-ffi --gpu-arch {arch}"
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        options += f" --keep-ptx --dump-dir {shlex.quote(os.fspath(dump_dir))}"
    fake = cute.runtime.make_fake_compact_tensor
    out_dtype = _DTYPES[config.out_dtype]
    m = cute.sym_int()
    # C rows must be 16-byte aligned for its TMA store; B's rows are C's columns.
    n = cute.sym_int(divisibility=128 // out_dtype.width)
    row_major = {"stride_order": (1, 0), "assumed_align": 16}
    code_bytes = cute.sym_int(divisibility=16), cute.sym_int(divisibility=16)  # K * bits / 8
    args = [
        fake(cutlass.Uint8, (m, code_bytes[0]), **row_major),
        fake(cutlass.Uint8, (n, code_bytes[1]), **row_major),
        fake(cutlass.Uint8, (cute.sym_int(divisibility=512),), assumed_align=32),
        fake(cutlass.Uint8, (cute.sym_int(divisibility=512),), assumed_align=32),
        fake(out_dtype, (m, n), **row_major),
        fake(cutlass.Float32, (1,), assumed_align=4),
    ]
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(AlphaEpilogueGemm(config).run, *args, stream, options=options)


__all__ = ["ARCHS", "AlphaEpilogueGemm", "compile_gemm"]
