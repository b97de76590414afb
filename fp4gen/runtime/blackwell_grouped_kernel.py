"""The CuTe DSL side of the grouped (Mixture-of-Experts) block-scaled GEMM on sm_100a.

Every expert's GEMM in one launch of NVIDIA's ``PersistentDenseBlockScaledGemmKernel``
(nvidia-cutlass-operators) over a batch: L = the groups, each group's operands padded to the
largest group's rows and K (``fp4gen.runtime.blackwell_grouped`` builds them). The package's
kernel takes a batch count L (its tile scheduler walks M x N x L tiles; A, B and C are
[L, rows, cols] with the batch outermost, the scale factors ``tile_atom_to_shape_SF((M, K, L))``:
one 128x4-swizzled buffer per group, back to back), so the kernel body is the dense one's:
``fp4gen.runtime.blackwell_kernel.AlphaEpilogueGemm`` with its epilogue alpha, called with
three-dimensional operands.

The alpha here is one value for the whole launch (the callers pass 1): the package's epilogue
hook sees the converted values only, not the tile's batch index, so a per-group alpha (each
expert's S_a S_b) is one fp32 multiply per group after the kernel, the same arithmetic the
dense kernel's epilogue does (docs/gemm-sm100.md, "Grouped").

Importing this module imports the CuTe DSL and nvidia-cutlass-operators; nothing here needs a GPU
(``compile_grouped_gemm`` cross-compiles for sm_100a on any machine).
"""

from __future__ import annotations

import os
import shlex
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu.common import OperandMajorMode

from fp4gen.runtime.blackwell_gemm import GemmConfig
from fp4gen.runtime.blackwell_kernel import _DTYPES, ARCHS, AlphaEpilogueGemm


class BatchedAlphaGemm(AlphaEpilogueGemm):
    """The package's block-scaled GEMM over L batches: C[l] = alpha * (A[l] @ B[l]^T)."""

    @cute.jit
    def run_batched(
        self,
        a_codes: cute.Tensor,  # uint8 [L, M, K * a_bits / 8]
        b_codes: cute.Tensor,  # uint8 [L, N, K * b_bits / 8]
        a_scales: cute.Tensor,  # uint8, L 128x4 buffers of [M, K / vec], back to back
        b_scales: cute.Tensor,  # uint8, L 128x4 buffers of [N, K / vec], back to back
        c: cute.Tensor,  # fp32 / bf16 [L, M, N], row-major per batch
        alpha: cute.Tensor,  # fp32 [1]
        stream: Any,
    ):
        cfg = self.config
        sf_dtype = _DTYPES[cfg.sf_dtype]
        self._alpha_ptr = alpha.iterator
        batches, m, n = c.shape[0], c.shape[1], c.shape[2]
        k = a_codes.shape[2] * 8 // cfg.a_bits
        self.__call__(
            cute.recast_ptr(a_codes.iterator, dtype=_DTYPES[cfg.a_dtype]),
            cute.recast_ptr(b_codes.iterator, dtype=_DTYPES[cfg.b_dtype]),
            cute.recast_ptr(a_scales.iterator, dtype=sf_dtype),
            cute.recast_ptr(b_scales.iterator, dtype=sf_dtype),
            c.iterator,
            (OperandMajorMode.K, OperandMajorMode.K, cutlass.tensor_utils.LayoutEnum.ROW_MAJOR),
            (m, n, k, batches),
            cfg.max_active_clusters,
            stream,
        )


def compile_grouped_gemm(config: GemmConfig, arch: str, *, dump_dir: str | None = None) -> Any:
    """The TVM-FFI compiled batched GEMM of ``config`` for ``arch`` (no GPU needed); L, M, N
    and K stay dynamic. Arguments of the compiled function: a_codes, b_codes, a_scales,
    b_scales, c, alpha (see ``BatchedAlphaGemm.run_batched``). With ``dump_dir`` the PTX is
    kept: there and in ``__ptx__``."""
    if arch not in ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; the tcgen05 GEMM targets {ARCHS}")
    options = f"--enable-tvm-ffi --gpu-arch {arch}"
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        options += f" --keep-ptx --dump-dir {shlex.quote(os.fspath(dump_dir))}"
    fake = cute.runtime.make_fake_compact_tensor
    out_dtype = _DTYPES[config.out_dtype]
    batches, m = cute.sym_int(), cute.sym_int()
    # C rows must be 16-byte aligned for its TMA store; B's rows are C's columns.
    n = cute.sym_int(divisibility=128 // out_dtype.width)
    row_major = {"stride_order": (2, 1, 0), "assumed_align": 16}
    code_bytes = cute.sym_int(divisibility=16), cute.sym_int(divisibility=16)  # K * bits / 8
    args = [
        fake(cutlass.Uint8, (batches, m, code_bytes[0]), **row_major),
        fake(cutlass.Uint8, (batches, n, code_bytes[1]), **row_major),
        fake(cutlass.Uint8, (cute.sym_int(divisibility=512),), assumed_align=32),
        fake(cutlass.Uint8, (cute.sym_int(divisibility=512),), assumed_align=32),
        fake(out_dtype, (batches, m, n), **row_major),
        fake(cutlass.Float32, (1,), assumed_align=4),
    ]
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(BatchedAlphaGemm(config).run_batched, *args, stream, options=options)


__all__ = ["BatchedAlphaGemm", "compile_grouped_gemm"]
