"""The K-grouped block-scaled FP8 GEMM on Hopper: every expert's wgrad C_g = A_g B_g^T in one
launch, the groups side by side along K.

Host side of ``fp4gen.kernels.gemm_sm90_fp8_kgrouped`` (the generated FP8 GEMM class with
``k_grouped=True``). ``k_grouped_block_scaled(a, b, out_dtype=)`` takes one QuantizedTensor per
group for each operand (A_g [M, K_g]: expert g's gradient columns, B_g [N, K_g]: its activation
columns; 1xN blocks along K on both sides, K_g a whole number of blocks) and returns C [G, M, N]
with C[g] what ``fp8_gemm.cute_block_scaled_product`` computes for (A_g, B_g), bit for bit: the
same kernel, the same K-blocks promoted in the same order (docs/moe.md, "The experts' FP8
wgrad"). Where the groups' GEMMs ran one dense call each (two launches and the dense dispatch per
expert), this is one concatenation per operand and one launch.

The arguments (``k_grouped_launch``), in the kernel's order: A's codes [M, K] (every group's
columns side by side, uint8) and block scales (fp32 or ue8m0 codes; MN-major [KB, Mp] in the
default coalesced variant, ``set_k_grouped_coalesced``; else row-major [M, KB] with ue8m0 KB
zero-padded to a multiple of 4), B's likewise, S_a and S_b fp32 [G], the groups' first K
elements int32 [G + 1] (multiples of the block), C [G x M, N] (bf16 for a bf16 output, else
fp32), the GPU's SM count (the persistent grid).

The grouped experts' FP8 wgrad takes it where ``grouped.fp8_grouped_reason`` allows (on by
default since ``tests/test_fp8_kgrouped_gpu.py`` passed on an H200: every group bit for bit
the dense kernel's, and an experts module's training step the loop's on the same kernel), else
each expert's dense GEMM; ``set_k_grouped_fp8(False)`` turns it off (process-wide).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from fp4gen.codegen.gemm_fp8 import (
    K_GROUPED_COALESCED,
    k_grouped_kernel_fields,
    k_grouped_reason,
    kernel_out,
)
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat
from fp4gen.numerics import QuantizedTensor
from fp4gen.runtime import fp8_gemm
from fp4gen.runtime.fp8_gemm import code_bytes, scales_mn_major
from fp4gen.runtime.fp8_grouped import (
    _globals,
    check_one_launch,
    grid_limit,
    launch_device,
    launch_shapes,
    offsets_tensor,
)

# set_k_grouped_fp8: on since tests/test_fp8_kgrouped_gpu.py passed on an H200 (12 tests)
_enabled = [True]


def set_k_grouped_fp8(enabled: bool) -> bool:
    """Whether the grouped experts' block-scaled FP8 wgrad GEMMs run as one K-grouped launch on
    sm_90a (True, the default: tests/test_fp8_kgrouped_gpu.py passed on an H200) or one dense
    GEMM per expert (False). Process-wide, read at every call; returns the previous setting."""
    previous, _enabled[0] = _enabled[0], bool(enabled)
    return previous


def k_grouped_fp8_enabled() -> bool:
    """The ``set_k_grouped_fp8`` setting."""
    return _enabled[0]


# set_k_grouped_from_sides: the arguments equal the groups' bit for bit (tests/test_fp8_kgrouped.py
# on the CPU, tests/test_fp8_kgrouped_gpu.py on the GPU)
_from_sides = [True]


def set_k_grouped_from_sides(enabled: bool) -> bool:
    """Whether ``k_grouped_launch`` takes its arguments from the launches' side-by-side
    columnwise copies where given (True, the default: no group read, no concatenation) or
    concatenates the groups (False; the same bits). Process-wide; returns the previous
    setting."""
    previous, _from_sides[0] = _from_sides[0], bool(enabled)
    return previous


# set_k_grouped_coalesced: the kernel variant (codegen.gemm_fp8.K_GROUPED_COALESCED)
_coalesced = [K_GROUPED_COALESCED]


def set_k_grouped_coalesced(enabled: bool) -> bool:
    """Whether the K-grouped kernel reads MN-major block scales and stores whole sectors (True,
    ``codegen.gemm_fp8.K_GROUPED_COALESCED``, what ``fp4gen compile`` builds) or reads
    row-major scales with the plain epilogue (False; the same bits, compiled on first use).
    Process-wide, read at every call; returns the previous setting."""
    previous, _coalesced[0] = _coalesced[0], bool(enabled)
    return previous


class KGroupedPlan(NamedTuple):
    """What a K-grouped call needs besides its tensors."""

    params: Any  # GemmSm90Fp8Params with k_grouped=True
    block_k: int
    ue8m0: bool
    kernel_out: torch.dtype  # what the kernel writes: bf16 or fp32


def k_grouped_plan(a: BlockFormat, b: BlockFormat, out_dtype: torch.dtype) -> KGroupedPlan:
    """The plan of a served pair (``codegen.gemm_fp8.k_grouped_reason``): its params from
    ``k_grouped_kernel_fields``, as ``fp4gen compile`` builds them."""
    from fp4gen.kernels.gemm_sm90_fp8 import GemmSm90Fp8Params

    out = kernel_out("bf16" if out_dtype == torch.bfloat16 else "fp32", False)
    params = GemmSm90Fp8Params(**k_grouped_kernel_fields(a, b, out, coalesced=_coalesced[0]))
    kernel_dtype = torch.bfloat16 if params.out == "bf16" else torch.float32
    return KGroupedPlan(params, a.block[1], params.scale_kind == "ue8m0", kernel_dtype)


def _check(
    a: Sequence[QuantizedTensor | None], b: Sequence[QuantizedTensor | None]
) -> tuple[QuantizedTensor, QuantizedTensor, list[int]]:
    """TensorError unless the groups can be multiplied: one A and one B per group (both None
    for an empty group), one format per side, every A [M, K_g] and B [N, K_g] with the M and N
    of the others, the group's K in both, one device. Returns the first group's A and B and
    each group's K."""
    if not a or len(a) != len(b):
        raise TensorError(
            f"K-grouped FP8 GEMM: {len(a)} A groups and {len(b)} B groups (one of each per "
            "group, at least one)"
        )
    first = next((i for i, q in enumerate(a) if q is not None), None)
    if first is None:
        raise TensorError("K-grouped FP8 GEMM: every group is empty (None)")
    a0, b0 = a[first], b[first]
    if b0 is None:
        raise TensorError(f"K-grouped FP8 GEMM: B[{first}] is None, A[{first}] is not")
    ks = []
    for i, (qa, qb) in enumerate(zip(a, b, strict=True)):
        if (qa is None) != (qb is None):
            raise TensorError(f"K-grouped FP8 GEMM: group {i} has one operand only (None: empty)")
        if qa is None or qb is None:
            ks.append(0)
            continue
        if qa.format != a0.format or qb.format != b0.format:
            raise TensorError(
                f"K-grouped FP8 GEMM: group {i} is {qa.format.name} x {qb.format.name}, group "
                f"{first} {a0.format.name} x {b0.format.name} (one format per operand)"
            )
        if qa.rows != a0.rows or qb.rows != b0.rows or qa.cols != qb.cols:
            raise TensorError(
                f"K-grouped FP8 GEMM: group {i} is [{qa.rows}, {qa.cols}] x [{qb.rows}, "
                f"{qb.cols}]; expected [{a0.rows}, K] x [{b0.rows}, K]"
            )
        if qa.rht != qb.rht:
            raise TensorError(f"K-grouped FP8 GEMM: group {i}'s A and B carry different RHTs")
        if qa.device != a0.device or qb.device != a0.device:
            raise TensorError("K-grouped FP8 GEMM: operands on several devices")
        ks.append(qa.cols)
    return a0, b0, ks


def _block_scales(q: QuantizedTensor, ue8m0: bool) -> torch.Tensor:
    """A group's block scales as the kernel reads them, before the concatenation: fp32 [R, KB]
    or the ue8m0 codes uint8 [R, KB] (unpadded: the whole concatenation is padded)."""
    s = q.scale_codes if ue8m0 else q.scales
    if s is None:
        raise TensorError("a ue8m0-scaled QuantizedTensor without scale codes")
    return s if ue8m0 or s.dtype == torch.float32 else s.to(torch.float32)


def kernel_scales(s: torch.Tensor, plan: KGroupedPlan) -> torch.Tensor:
    """Every group's block scales side by side, [R, KB] (``_block_scales``), as the plan's
    kernel reads them: MN-major [KB, Rp] (``fp8_gemm.scales_mn_major``), or row-major with
    ue8m0 codes' KB zero-padded to a multiple of 4 (the kernel copies aligned 4-byte words)."""
    if plan.params.mn_major_scales:
        return scales_mn_major(s)
    if plan.ue8m0 and s.shape[1] % 4:
        s = F.pad(s, (0, 4 - s.shape[1] % 4))
    return s.contiguous()


def operand_arguments(q: QuantizedTensor, plan: KGroupedPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """One operand's codes (uint8 [R, K]) and block scales as the plan's kernel reads them,
    for every group's columns side by side in ``q`` [R, K]."""
    return code_bytes(q, q.rows, q.cols), kernel_scales(_block_scales(q, plan.ue8m0), plan)


def _launched(
    a: Sequence[Any], b: Sequence[Any], sides: tuple[Any, Any]
) -> tuple[tuple[Any, Any], list[int], tuple[int, int]] | None:
    """Where each side's groups are one launch's side-by-side columnwise copy (``sides`` given:
    every group's [rows, K_g] blocks in one [rows, sum K_g] QuantizedTensor,
    ``GroupedOperands.side``; the groups' shapes known without building them,
    ``GroupedOperands.shapes``) and no group is empty: the two sides (they say the formats,
    RHTs and device), each group's K and [M, N]. Else None: the groups are read one by one."""
    shapes = launch_shapes(a, b, sides)
    if shapes is None:
        return None
    (shapes_a, shapes_b), (side_a, side_b) = shapes, sides
    m, n = shapes_a[0][0], shapes_b[0][0]
    # each side's shapes as columns (C-level unpacking: no Python step per group)
    a_rows, a_ks = zip(*shapes_a, strict=True)
    b_rows, b_ks = zip(*shapes_b, strict=True)
    ks = list(a_ks)
    if a_rows.count(m) != len(a_rows) or b_rows.count(n) != len(b_rows) or b_ks != a_ks:
        return None
    if tuple(side_a.shape) != (m, sum(ks)) or tuple(side_b.shape) != (n, sum(ks)):
        return None
    check_one_launch(side_a, side_b, "K-grouped FP8 GEMM")
    return (side_a, side_b), ks, (m, n)


def k_grouped_launch(
    a: Sequence[QuantizedTensor | None],
    b: Sequence[QuantizedTensor | None],
    *,
    out_dtype: torch.dtype = torch.float32,
    sms: int | None = None,
    sides: tuple[Any, Any] = (None, None),
    global_scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    offsets: tuple[Sequence[int], torch.Tensor] | None = None,
) -> tuple[KGroupedPlan, list]:
    """The plan and the kernel's arguments (module docstring) for groups ``a`` and ``b``,
    without the launch; ``sms``: the persistent grid's limit (default: the device's SM count).
    ``sides``: each side's groups as one launch's side-by-side columnwise copy
    (``GroupedOperands.side``) where there is one, and ``global_scales`` every group's S_dec as
    one fp32 [groups] tensor: with the groups' shapes known, the arguments are these copies'
    codes and scales as they are, and no group is read.
    ``offsets``: the groups' first K as host values and a device tensor, used where they are
    these groups' (``fp8_grouped.offsets_tensor``).
    Raises TensorError for groups that cannot be multiplied and FP4GenError for a pair or a
    group K the kernel does not take. Runs on any device (the CPU tests check the layouts)."""
    launched = _launched(a, b, sides) if _from_sides[0] else None
    if launched is not None:
        (a0, b0), ks, (m, n) = launched
    else:
        a0, b0, ks = _check(a, b)
        m, n = a0.rows, b0.rows
    if out_dtype not in fp8_gemm.OUT_DTYPES:
        raise TensorError(f"out_dtype must be one of {fp8_gemm.OUT_DTYPES}, got {out_dtype}")
    reason = k_grouped_reason(a0.format, b0.format)
    if reason is not None:
        raise FP4GenError(f"the K-grouped FP8 GEMM does not serve this pair: {reason}")
    plan = k_grouped_plan(a0.format, b0.format, out_dtype)
    if any(k % plan.block_k for k in ks):
        raise FP4GenError(
            f"the K-grouped FP8 GEMM takes whole K-blocks of {plan.block_k} per group; the "
            f"groups' K are {ks}"
        )
    dev = a0.device
    groups = len(a)
    if groups * m * n >= 2**31 or m * sum(ks) >= 2**31 or n * sum(ks) >= 2**31:
        raise FP4GenError("the K-grouped FP8 GEMM indexes with 32 bits")
    if launched is not None:  # the launches wrote the groups side by side already
        codes_a, scales_a = operand_arguments(a0, plan)
        codes_b, scales_b = operand_arguments(b0, plan)
    else:
        present = [(qa, qb) for qa, qb in zip(a, b, strict=True) if qa is not None]
        codes_a = torch.cat([code_bytes(qa, m, qa.cols) for qa, _ in present], dim=1)
        codes_b = torch.cat([code_bytes(qb, n, qb.cols) for _, qb in present], dim=1)
        scales_a = torch.cat([_block_scales(qa, plan.ue8m0) for qa, _ in present], dim=1)
        scales_b = torch.cat([_block_scales(qb, plan.ue8m0) for _, qb in present], dim=1)
        scales_a, scales_b = kernel_scales(scales_a, plan), kernel_scales(scales_b, plan)
    one = torch.ones(1, dtype=torch.float32, device=dev)
    args = [
        codes_a,
        scales_a,
        codes_b,
        scales_b,
        _globals(global_scales[0], a, one, dev, whole=launched is not None),
        _globals(global_scales[1], b, one, dev, whole=launched is not None),
        offsets_tensor(ks, offsets, dev),
        torch.empty((groups * m, n), dtype=plan.kernel_out, device=dev),
        grid_limit(sms, dev),
    ]
    return plan, args


def k_grouped_sides(
    a: QuantizedTensor,
    b: QuantizedTensor,
    global_scales: tuple[torch.Tensor, torch.Tensor],
    offsets: torch.Tensor,
    groups: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """C [groups, M, N] in ``out_dtype``, C[g] = A_g B_g^T over group g's columns, one launch,
    with every size on the device (what a CUDA graph replays for any routing): ``a`` [M, K]
    and ``b`` [N, K] hold every group's columns side by side (1xN blocks along K),
    ``global_scales`` each group's S_dec (fp32 [groups] per side), ``offsets`` the groups'
    first columns (int32 [groups + 1] on the device, whole K-blocks each: the caller's
    contract, not checked here). The pair must be served (``k_grouped_reason``)."""
    plan = k_grouped_plan(a.format, b.format, out_dtype)
    c = torch.empty((groups * a.rows, b.rows), dtype=plan.kernel_out, device=a.device)
    args = [
        *operand_arguments(a, plan),
        *operand_arguments(b, plan),
        *global_scales,
        offsets,
        c,
        grid_limit(None, a.device),
    ]
    fp8_gemm.cute_kernel(plan.params)(*args)
    c = c.view(groups, a.rows, b.rows)
    return c if c.dtype == out_dtype else c.to(out_dtype)


def k_grouped_block_scaled(
    a: Sequence[QuantizedTensor | None],
    b: Sequence[QuantizedTensor | None],
    *,
    out_dtype: torch.dtype = torch.float32,
    sides: tuple[Any, Any] = (None, None),
    global_scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    offsets: tuple[Sequence[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """C [G, M, N] in ``out_dtype`` with C[g] = S_a[g] S_b[g] sum_b s_a s_b P_b over group g's
    K-blocks, one launch (module docstring); an empty group (None, None) gives zeros. Raises
    TensorError for groups that cannot be multiplied and FP4GenError where the kernel does not
    serve them (not CUDA, not sm_90a, the pair, a group's K): the caller's cue to run the
    groups one by one. ``sides``, ``global_scales``, ``offsets``: as ``k_grouped_launch``."""
    launch_device(a, sides[0], "K-grouped FP8 GEMM")
    plan, args = k_grouped_launch(
        a, b, out_dtype=out_dtype, sides=sides, global_scales=global_scales, offsets=offsets
    )
    c = args[7]
    fp8_gemm.cute_kernel(plan.params)(*args)
    c = c.view(len(a), -1, c.shape[1])
    return c if c.dtype == out_dtype else c.to(out_dtype)


__all__ = [
    "KGroupedPlan",
    "k_grouped_block_scaled",
    "k_grouped_fp8_enabled",
    "k_grouped_launch",
    "k_grouped_plan",
    "k_grouped_sides",
    "kernel_scales",
    "operand_arguments",
    "set_k_grouped_coalesced",
    "set_k_grouped_fp8",
    "set_k_grouped_from_sides",
]
