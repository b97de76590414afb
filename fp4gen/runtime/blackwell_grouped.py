"""The grouped block-scaled GEMM on sm_100a: every expert's GEMM of a Mixture-of-Experts layer in
one launch of the tcgen05 block-scaled MMA, reading the quantized codes (nothing dequantized).

The kernel is NVIDIA's ``PersistentDenseBlockScaledGemmKernel`` (nvidia-cutlass-operators, the
dense native GEMM's) over a batch of L = groups (``fp4gen.runtime.blackwell_grouped_kernel``):
nvidia-cutlass-operators 0.3 ships no block-scaled grouped kernel (its contiguous-offset grouped
GEMM is dense BF16 / FP8 without block scales), so fp4gen lays the groups out as the batched
kernel reads them (docs/gemm-sm100.md, "Grouped"):

* codes: uint8 [L, M, K * bits / 8], group g's packed rows (``packed_codes``, the dense
  path's bytes) in [g, :rows_g, :K_g * bits / 8], zeros elsewhere (a zero code is the value 0);
* scales: L buffers of the 128x4 tensor-core layout of an [M, K / vec] scale matrix, back to
  back (``batched_scales``), group g's per-row scale codes in its top-left corner, zeros
  elsewhere;
* M and K are the largest group's (K rounded up to the MMA's K multiple); N is the same for
  every group (the B operands' rows).

The cost of that layout: the padded rows and K columns are copied and multiplied (zero tiles
still run through the MMA), so a launch does L * ceil(M_max / tile) * ceil(N / tile) tiles
where a group-aware scheduler would do sum_g ceil(M_g / tile) * ceil(N / tile); equal groups
(balanced routing) waste only each group's last partial tile, one expert with all the tokens
wastes (L - 1) / L of the work. Host side, the batch costs one copy of the codes and one of the
scale codes per operand (one per group where the groups' K differ) and one swizzle.

The kernel writes C [L, M, N] in fp32 with alpha 1: the products of block values (element x
block scale), no global scale. The per-group alpha S_a S_b is the caller's one fp32 multiply
(``grouped_gemm``; the grouped path of ``fp4gen.runtime.grouped`` multiplies in its epilogue
anyway), the same single rounding the dense kernel's epilogue does.

Nothing here has run on a Blackwell GPU: the kernels are cross-compiled and their PTX is checked,
the layouts are checked bit for bit on the CPU (tests/test_gemm_sm100_grouped.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from fp4gen.codegen.gemm_configs import (
    GROUPED_KERNEL,
    NATIVE_ARCHS,
    OPERATORS_PACKAGE,
    GemmConfig,
    MmaPlan,
    gemm_config,
    mma_plan,
    render_grouped_module,
    shape_reason,
)
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.runtime.blackwell_gemm import _sm_count, load_rendered, packed_codes
from fp4gen.runtime.checks import check_pair
from fp4gen.runtime.device_memory import kept
from fp4gen.runtime.host_tables import host_table
from fp4gen.runtime.loader import BUILD_FAILED, KernelLoader, Reasons, Unsupported

log = logging.getLogger(__name__)
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


# ----------------------------------------------------------------------------------------------
# Operand layouts
# ----------------------------------------------------------------------------------------------
def row_scales(q: Any) -> torch.Tensor:
    """uint8 [rows, ceil(K / vec)]: one scale code per row and K block (a 2D tile's scale on
    each of its rows), what ``QuantizedTensor.swizzled_scales`` swizzles."""
    if q.scale_codes is None:
        raise TensorError("fp32 block scales have no tensor-core layout")
    block_rows = min(q.format.block[0], q.rows)
    return q.scale_codes.repeat_interleave(block_rows, 0)[: q.rows]


def batched_scales(scales: torch.Tensor) -> torch.Tensor:
    """uint8 scale codes [L, R, C] -> L buffers of the 128x4 tensor-core layout, back to back
    (R padded to 128 and C to 4 with zeros): byte ``g * ceil(R/128) * ceil(C/4) * 512`` starts
    group g's buffer, which is ``fp4gen.numerics.layout.swizzle_scales(scales[g])``."""
    if scales.dtype != torch.uint8 or scales.dim() != 3:
        raise TensorError(
            f"batched scale codes must be uint8 [L, R, C], got {scales.dtype} {tuple(scales.shape)}"
        )
    groups, rows, cols = scales.shape
    r128, c4 = -(-rows // 128), -(-cols // 4)
    padded = torch.nn.functional.pad(scales, (0, c4 * 4 - cols, 0, r128 * 128 - rows))
    # r = rb*128 + q*32 + i, c = cb*4 + j  ->  offset (g, rb, cb, i, q, j) row-major
    atoms = padded.reshape(groups, r128, 4, 32, c4, 4).permute(0, 1, 4, 3, 2, 5)
    return atoms.contiguous().reshape(-1)


def batch_shape(a_groups: Sequence[Any], b_groups: Sequence[Any], plan: MmaPlan) -> tuple[int, ...]:
    """(L, M, N, K) of the batch: the largest group's rows and K (K rounded up to the MMA's
    multiple), B's rows (the same for every group)."""
    m = max(a.rows for a in a_groups)
    k = max(a.cols for a in a_groups)
    k = -(-k // plan.k_multiple) * plan.k_multiple
    return len(a_groups), m, b_groups[0].rows, k


def batched_operand(
    groups: Sequence[Any], bits: int, rows: int, k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [L, rows, k * bits / 8], scales: ``batched_scales`` of [L, rows, k / vec])
    of QuantizedTensors ``groups`` (each [rows_g <= rows, K_g <= k]), zero-padded."""
    vec = groups[0].format.block[1]
    codes = torch.zeros((len(groups), rows, k * bits // 8), dtype=torch.uint8, device=device)
    scales = torch.zeros((len(groups), rows, -(-k // vec)), dtype=torch.uint8, device=device)
    packed = [packed_codes(q, bits) for q in groups]
    per_row = [row_scales(q) for q in groups]
    if len({q.cols for q in groups}) == 1:
        # one K (fprop, dgrad): every group's rows in one copy per tensor
        index = torch.cat(
            [torch.arange(g * rows, g * rows + q.rows, device=device) for g, q in enumerate(groups)]
        )
        width, cols = packed[0].shape[1], per_row[0].shape[1]
        codes.view(-1, codes.shape[2])[:, :width].index_copy_(0, index, torch.cat(packed))
        scales.view(-1, scales.shape[2])[:, :cols].index_copy_(0, index, torch.cat(per_row))
    else:  # a K per group (wgrad: the tokens)
        for g, q in enumerate(groups):
            codes[g, : q.rows, : packed[g].shape[1]] = packed[g]
            scales[g, : q.rows, : per_row[g].shape[1]] = per_row[g]
    return codes, batched_scales(scales)


# ----------------------------------------------------------------------------------------------
# Which groups the kernel takes
# ----------------------------------------------------------------------------------------------
def grouped_reason(a_groups: Sequence[Any], b_groups: Sequence[Any]) -> MmaPlan | str:
    """The MMA of the groups, or why the grouped kernel cannot take them: every group's A in one
    format and B in one format (a pair ``mma_plan`` serves), B's rows the same in every group,
    the batch's shapes within the kernel's (``shape_reason`` of the padded group, and 32-bit
    sizes of the whole batch)."""
    if not a_groups or len(a_groups) != len(b_groups):
        return f"{len(a_groups)} A groups and {len(b_groups)} B groups"
    a_fmt, b_fmt = a_groups[0].format, b_groups[0].format
    if any(a.format != a_fmt for a in a_groups) or any(b.format != b_fmt for b in b_groups):
        return "the groups' operands are not all in one format per side"
    plan = mma_plan(a_fmt, b_fmt)
    if isinstance(plan, str):
        return plan
    if len({b.rows for b in b_groups}) != 1:
        return "the B operands' rows (N) differ between groups"
    batches, m, n, k = batch_shape(a_groups, b_groups, plan)
    reason = shape_reason(plan, m, n, k)
    if reason is not None:
        return reason
    if batches * max(m * n, m * k, n * k) >= 2**31:
        return "the batch's sizes are 32-bit (L * M * N, L * M * K, L * N * K < 2^31)"
    return plan


# ----------------------------------------------------------------------------------------------
# Compile, cache, load
# ----------------------------------------------------------------------------------------------
_loaded: dict[tuple[GemmConfig, str, str], Any] = {}
_lock = threading.Lock()
_loader: KernelLoader[GemmConfig, Any] = KernelLoader(
    Reasons(
        dsl=f"{OPERATORS_PACKAGE} or the CuTe DSL cannot be imported ({{err}})",
        build=BUILD_FAILED,
    )
)


def grouped_kernel(config: GemmConfig, arch: str, *, cache: Any = None) -> Any:
    """The loaded TVM-FFI function of the grouped GEMM of ``config`` for ``arch``: compiled on
    first use (about 1 s, no GPU needed) and kept in the kernel cache (the module
    ``render_grouped_module`` writes); later processes load it."""
    return load_rendered(_loaded, _lock, config, arch, cache, render_grouped_module, GROUPED_KERNEL)


# ----------------------------------------------------------------------------------------------
# The grouped GEMM
# ----------------------------------------------------------------------------------------------
_ones: dict[torch.device, torch.Tensor] = {}


def grouped_args(
    a_groups: Sequence[Any], b_groups: Sequence[Any], plan: MmaPlan, out: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The compiled function's arguments: the batched A and B codes and scales
    (``batched_operand``), C (``out``, [L, M, N] row-major) and alpha 1 (fp32 [1])."""
    _, m, n, k = batch_shape(a_groups, b_groups, plan)
    dev = out.device
    a_codes, a_scales = batched_operand(a_groups, plan.a_bits, m, k, dev)
    b_codes, b_scales = batched_operand(b_groups, plan.b_bits, n, k, dev)
    return a_codes, b_codes, a_scales, b_scales, out, _one(dev)


def _one(dev: torch.device) -> torch.Tensor:
    """fp32 [1] holding 1, kept per device; on CUDA made outside any CUDA-graph pool
    (``device_memory.kept``: a kept tensor made while torch.compile's graphs warm up would be
    one of their pool's, which they refuse)."""
    return kept(_ones, dev, lambda: torch.ones(1, dtype=torch.float32, device=dev), dev)


def grouped_product(
    a_groups: Sequence[Any], b_groups: Sequence[Any], *, arch: str, tile: str | None = None
) -> torch.Tensor:
    """C [L, M, N] in fp32 with C[g, :rows of A_g] = A_g @ B_g^T in block values (element x
    block scale, no global scale), every group in one launch; rows past a group's are zero.

    ``a_groups`` [rows_g, K_g] and ``b_groups`` [N, K_g]: QuantizedTensors, pairwise with the
    same K and RHT (``check_pair``), on one CUDA device. Raises FP4GenError where the kernel
    cannot take them (``grouped_reason``, the arch, the kernel unavailable), TensorError for
    operands that do not fit together."""
    if arch not in NATIVE_ARCHS:
        raise FP4GenError(
            f"no block-scaled tcgen05 MMA on {arch} (the grouped GEMM targets {NATIVE_ARCHS})"
        )
    plan = grouped_reason(a_groups, b_groups)
    if isinstance(plan, str):
        raise FP4GenError(f"the grouped native GEMM cannot take these groups: {plan}")
    dev = a_groups[0].device
    for a, b in zip(a_groups, b_groups, strict=True):
        check_pair(a, b)
        if a.device != dev or b.device != dev or dev.type != "cuda":
            raise TensorError(
                f"the grouped native GEMM needs every operand on one CUDA device: {dev}, "
                f"{a.device}, {b.device}"
            )
    batches, m, n, _ = batch_shape(a_groups, b_groups, plan)
    config = gemm_config(plan, m, out_dtype="Float32", tile=tile, sm_count=_sm_count(dev))
    fn = _loader.get(config, arch, grouped_kernel)
    if isinstance(fn, Unsupported):
        raise FP4GenError(f"the grouped native GEMM kernel is not available: {fn.reason}")
    out = torch.empty((batches, m, n), dtype=torch.float32, device=dev)
    fn(*grouped_args(a_groups, b_groups, plan, out))
    return out


def group_rows_of(c: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """The groups' real rows of a batched product C [L, M, N], one after another: [sum rows, N]
    (what ``fp4gen.runtime.grouped.group_rows`` returns)."""
    batches, m, n = c.shape
    index = torch.cat([torch.arange(g * m, g * m + r, device=c.device) for g, r in enumerate(rows)])
    return c.reshape(batches * m, n).index_select(0, index)


def grouped_gemm(
    a_groups: Sequence[Any],
    b_groups: Sequence[Any],
    *,
    out_dtype: torch.dtype = torch.float32,
    arch: str,
    tile: str | None = None,
) -> torch.Tensor:
    """[sum of the A groups' rows, N]: group g's rows are fp32(A_g @ B_g^T * S_a S_b) of its
    QuantizedTensors, rounded once to ``out_dtype``, each group as ``fp4gen.gemm(A_g, B_g)``
    computes it up to the fp32 summation order (the dense epilogue's alpha, one fp32 multiply
    per group)."""
    c = grouped_product(a_groups, b_groups, arch=arch, tile=tile)
    alphas = torch.stack(
        [
            a.global_scale.to(c.device, torch.float32).reshape(())
            * b.global_scale.to(c.device, torch.float32).reshape(())
            for a, b in zip(a_groups, b_groups, strict=True)
        ]
    )
    rows = [a.rows for a in a_groups]
    repeats = host_table(rows, torch.int64, c.device)
    per_row = torch.repeat_interleave(alphas, repeats, output_size=sum(rows))[:, None]
    return (group_rows_of(c, rows) * per_row).to(out_dtype)


# ----------------------------------------------------------------------------------------------
# The grouped path's products (fp4gen.runtime.grouped)
# ----------------------------------------------------------------------------------------------
_enabled = [True]


def set_native_grouped(enabled: bool) -> bool:
    """Whether the grouped experts' GEMMs on sm_100a GPUs take this kernel (True, the default)
    or the dequantize + ``torch._grouped_mm`` product of other GPUs (False). Process-wide,
    read at every call; returns the previous setting."""
    previous, _enabled[0] = _enabled[0], bool(enabled)
    return previous


def native_products(pairs: Sequence[tuple[Any, Any]], *, by_rows: bool) -> torch.Tensor | None:
    """The grouped path's fp32 product of the groups' QuantizedTensor pairs (A_g, B_g) on an
    sm_100a GPU, without global scales: ``by_rows`` [sum of the A rows, N] (fprop, dgrad: what
    ``group_rows`` returns), else [L, M, N] (wgrad, every A_g with M rows: ``group_k``'s).
    None where this kernel does not serve (not an sm_100a GPU, turned off, the groups or the
    kernel refused: the reason logged once); the caller then computes its own product."""
    if not (_enabled[0] and pairs) or pairs[0][0].device.type != "cuda":
        return None
    from fp4gen.compiler.jit import detect_arch

    arch = detect_arch(pairs[0][0].device)
    if arch not in NATIVE_ARCHS:
        return None
    a_groups, b_groups = [a for a, _ in pairs], [b for _, b in pairs]
    try:
        c = grouped_product(a_groups, b_groups, arch=arch)
    except FP4GenError as err:
        _log_once(f"the grouped experts' GEMM is not the native grouped one: {err}")
        return None
    return group_rows_of(c, [a.rows for a in a_groups]) if by_rows else c


__all__ = [
    "batch_shape",
    "batched_operand",
    "batched_scales",
    "group_rows_of",
    "grouped_args",
    "grouped_gemm",
    "grouped_kernel",
    "grouped_product",
    "grouped_reason",
    "native_products",
    "row_scales",
    "set_native_grouped",
]
