"""The grouped block-scaled FP8 GEMM on Hopper: every group's C_g = A_g B_g^T in one launch.

Host side of ``fp4gen.kernels.gemm_sm90_fp8_grouped`` (the generated FP8 GEMM class with
``grouped=True``). ``grouped_block_scaled(a, b, out_dtype=, bias=)`` takes one QuantizedTensor
per group for each operand (A_g [M_g, K]: the tokens of expert g; B_g [N, K]: its weight
operand, every group of one shape) and returns C [sum M_g, N] with group g's rows
C[offsets[g]:offsets[g + 1]] equal to what ``fp8_gemm.cute_block_scaled_product`` computes for
(A_g, B_g) with that bias and output dtype, bit for bit: the same kernel, the same block-scaled
sums in the same order (docs/gemm-sm90.md, "The grouped FP8 GEMM").

The arguments (``grouped_launch``), in the kernel's order:

- A's codes: every group's [M_g, Kp] rows stacked, [M, Kp] uint8 (Kp = K rounded up to whole
  K-blocks, zero codes appended: they add exactly 0); A's block scales stacked likewise, [M, KB]
  (fp32 factors, or ue8m0 codes with KB zero-padded to a multiple of 4, as the dense kernel
  reads them: ``fp8_gemm.cute_scales``);
- B's codes [G * N, Kp] (group g's rows g N .. g N + N - 1) and scales [G * N, KB] (1xN) or
  [G * ceil(N / N_b), KB] (NxN tiles);
- S_a, S_b: fp32 [G], each group's global decode scale (1.0 for a format without one, NaN where
  its input held a NaN or an Inf: the product is NaN then, as the dense kernel's);
- the offsets: int32 [G + 1] on the device (sum of the group sizes before each group);
- C [M, N] (bf16 for a bf16 output, else fp32, rounded here once to the output dtype); the bias
  as fp32 [G * N] where given ([G, N]: group g's row); the GPU's SM count (the persistent grid).

Empty groups (M_g = 0) have no tile; groups of any size share one launch. The variant is the
dense kernel's current one (``fp8_gemm.cute_settings``) except for what grouped rows cannot
take: one CTA per cluster and row-major scales (``grouped_fields``).

``set_grouped_fp8(False)`` turns the grouped kernel off (process-wide): the experts' FP8 GEMMs
then run one dense ``fp4gen.gemm`` per expert, the per-expert loop's own products.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from fp4gen.codegen.gemm_fp8 import grouped_kernel_fields, kernel_out
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat
from fp4gen.numerics import QuantizedTensor
from fp4gen.runtime import fp8_gemm
from fp4gen.runtime.fp8_gemm import code_bytes, cute_scales, round_up
from fp4gen.runtime.host_tables import host_table

log = logging.getLogger(__name__)
_logged: set[str] = set()

_enabled = [True]  # set_grouped_fp8: on since tests/test_fp8_grouped_gpu.py passed on an H200


def set_grouped_fp8(enabled: bool) -> bool:
    """Whether the grouped FP8 GEMM serves the experts' block-scaled FP8 GEMMs on sm_90a (True,
    the default: tests/test_fp8_grouped_gpu.py passed on an H200) or each expert runs its dense
    GEMM (False). Process-wide, read at every call;
    returns the previous setting."""
    previous, _enabled[0] = _enabled[0], bool(enabled)
    return previous


def grouped_fp8_enabled() -> bool:
    """The ``set_grouped_fp8`` setting."""
    return _enabled[0]


def log_fallback(message: str) -> None:
    """Log ``message`` at INFO the first time it comes (a fallback of the grouped kernel)."""
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def grouped_fields(a: BlockFormat, b: BlockFormat, out: str, bias: bool) -> dict[str, Any]:
    """The ``GemmSm90Fp8Params`` fields of the grouped kernel for a served pair
    (``codegen.gemm_fp8.grouped_kernel_fields``) in the dense kernel's current variant
    (``fp8_gemm.cute_settings``)."""
    return grouped_kernel_fields(
        a,
        b,
        out,
        bias,
        overlap=fp8_gemm.CUTE_OVERLAP,
        wide_stores=fp8_gemm.CUTE_WIDE_STORES,
        tile_n=fp8_gemm.CUTE_TILE_N,
    )


class GroupedPlan(NamedTuple):
    """What a grouped call needs besides its tensors."""

    params: Any  # GemmSm90Fp8Params with grouped=True
    block_k: int
    ue8m0: bool
    kernel_out: torch.dtype  # what the kernel writes: bf16 or fp32


def grouped_plan(a: BlockFormat, b: BlockFormat, out_dtype: torch.dtype, bias: bool) -> GroupedPlan:
    """The plan of a served pair (``fp8_gemm.cute_support``)."""
    from fp4gen.kernels.gemm_sm90_fp8 import GemmSm90Fp8Params

    out = kernel_out("bf16" if out_dtype == torch.bfloat16 else "fp32", False)
    params = GemmSm90Fp8Params(**grouped_fields(a, b, out, bias))
    kernel_dtype = torch.bfloat16 if params.out == "bf16" else torch.float32
    return GroupedPlan(params, a.block[1], params.scale_kind == "ue8m0", kernel_dtype)


def offsets_of(counts: Sequence[int]) -> list[int]:
    """The groups' first rows and the end: [0, M_0, M_0 + M_1, ..., M]."""
    return [0, *itertools.accumulate(int(count) for count in counts)]


def offsets_tensor(
    counts: Sequence[int],
    given: tuple[Sequence[int], torch.Tensor] | None,
    device: torch.device,
) -> torch.Tensor:
    """``offsets_of(counts)`` as an int32 tensor on ``device``: the caller's (``given``: the
    host values and their device tensor, e.g. ``grouped.RoutingTables``: one copy for every
    launch of a routing) where they are these offsets, else one copy of its own."""
    offsets = offsets_of(counts)
    if given is not None and list(given[0]) == offsets and given[1].device == device:
        return given[1]
    return host_table(offsets, torch.int32, device)


def _check(
    a: Sequence[QuantizedTensor | None],
    b: Sequence[QuantizedTensor | None],
    bias: torch.Tensor | None,
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """TensorError unless ``a`` and ``b`` are groups one GEMM can take: as many of each (None
    for an empty group's A, and its B if it has none), at least one group with rows, one format
    per operand, K shared, every B of one shape, one device; the bias [G, N]. Returns the
    first group with rows' A and B (they say the formats and shapes)."""
    if not a or len(a) != len(b):
        raise TensorError(
            f"grouped FP8 GEMM: {len(a)} A groups and {len(b)} B groups (one of each per group, "
            "at least one)"
        )
    first = next((i for i, q in enumerate(a) if q is not None), None)
    if first is None or b[first] is None:
        raise TensorError("grouped FP8 GEMM: every group is empty (None)")
    for i, (qa, qb) in enumerate(zip(a, b, strict=True)):
        if qb is None and qa is not None:
            raise TensorError(f"grouped FP8 GEMM: B[{i}] is None, A[{i}] is not (None: empty)")
    for name, group in (("A", a), ("B", b)):
        for i, q in enumerate(group):
            if q is None:
                continue
            if not isinstance(q, QuantizedTensor):
                raise TensorError(f"grouped FP8 GEMM: {name}[{i}] is a {type(q).__name__}")
            if q.format != group[first].format:  # type: ignore[union-attr]
                raise TensorError(
                    f"grouped FP8 GEMM: {name}[{i}] is {q.format.name}, {name}[{first}] "
                    f"{group[first].format.name} (one format per operand)"  # type: ignore[union-attr]
                )
    a0, b0 = a[first], b[first]
    assert a0 is not None and b0 is not None
    n, k = b0.rows, b0.cols
    for i, q in enumerate(b):
        if q is not None and (q.rows, q.cols) != (n, k):
            raise TensorError(
                f"grouped FP8 GEMM: B[{i}] is [{q.rows}, {q.cols}], B[{first}] [{n}, {k}] "
                "(every group's B of one shape)"
            )
    for i, q in enumerate(a):
        if q is None:
            continue
        if q.cols != k:
            raise TensorError(f"grouped FP8 GEMM: A[{i}] is [{q.rows}, {q.cols}], B's K is {k}")
        if q.rht != b[i].rht:  # type: ignore[union-attr]
            raise TensorError(f"grouped FP8 GEMM: A[{i}] and B[{i}] carry different RHTs")
    devices = {q.device for q in (*a, *b) if q is not None}
    if len(devices) != 1:
        raise TensorError(
            f"grouped FP8 GEMM: operands on several devices {sorted(map(str, devices))}"
        )
    _check_bias(bias, len(b), n)
    return a0, b0


def grouped_launch(
    a: Sequence[QuantizedTensor | None],
    b: Sequence[QuantizedTensor | None],
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    sms: int | None = None,
    wholes: tuple[Any, Any] = (None, None),
    global_scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    offsets: tuple[Sequence[int], torch.Tensor] | None = None,
) -> tuple[GroupedPlan, list]:
    """The plan and the kernel's arguments (module docstring) for groups ``a`` and ``b``,
    without the launch; ``sms``: the persistent grid's limit (default: the device's SM count).
    ``wholes``: for A and for B, every group's rows as one QuantizedTensor where one grouped
    quantize wrote them (``GroupedOperands.whole``), whose codes and scales then are the
    arguments as they are, not a concatenation of the groups' (a copy of every code); and
    ``global_scales`` every group's S_dec as one fp32 [groups] tensor
    (``GroupedOperands.global_scales``); None: from the groups. Either is used only where no
    group of its side is None and its rows are the groups' rows. ``offsets``: the groups'
    first rows as host values and a device tensor, used where they are these groups'
    (``offsets_tensor``).
    Raises TensorError for groups that cannot be multiplied and FP4GenError for a pair the
    kernel does not serve. Runs on any device (the CPU tests check the layouts). An empty
    group is None in ``a`` (as ``grouped_quantize.quantize_groups`` gives it), its B None or
    given: it has no tile, its B rows are never read (zero codes where None)."""
    launched = _launched(a, b, bias, wholes)
    if launched is not None:  # every group's rows of one launch each: no group is read
        (a0, b0), rows, (n, k) = launched
        whole_a, whole_b = wholes
    else:
        a0, b0 = _check(a, b, bias)
        n, k = b0.rows, b0.cols
        rows = [0 if q is None else q.rows for q in a]
    if out_dtype not in fp8_gemm.OUT_DTYPES:
        raise TensorError(f"out_dtype must be one of {fp8_gemm.OUT_DTYPES}, got {out_dtype}")
    reason = fp8_gemm.cute_support(a0.format, b0.format)
    if reason is not None:
        raise FP4GenError(f"the grouped FP8 GEMM does not serve this pair: {reason}")
    plan = grouped_plan(a0.format, b0.format, out_dtype, bias is not None)
    dev = a0.device
    kp = round_up(k, plan.block_k)
    m = sum(rows)
    if m * n >= 2**31 or len(b) * n >= 2**31:
        raise FP4GenError(f"the grouped FP8 GEMM indexes with 32 bits: M * N = {m * n}")
    ue8m0 = plan.ue8m0
    none_b = None
    if launched is None and any(q is None for q in b):  # an empty group's B: rows never read
        b_scales = cute_scales(b0, ue8m0)
        none_b = (torch.zeros((n, kp), dtype=torch.uint8, device=dev), torch.zeros_like(b_scales))
    one = torch.ones(1, dtype=torch.float32, device=dev)
    if launched is None:
        whole_a = _whole(wholes[0], a, m)
        whole_b = _whole(wholes[1], b, len(b) * n)
    if whole_a is not None:
        codes_a, scales_a = code_bytes(whole_a, m, kp), cute_scales(whole_a, ue8m0)
    else:
        codes_a = torch.cat([code_bytes(q, q.rows, kp) for q in a if q is not None])
        scales_a = torch.cat([cute_scales(q, ue8m0) for q in a if q is not None])
    if whole_b is not None:
        codes_b, scales_b = code_bytes(whole_b, len(b) * n, kp), cute_scales(whole_b, ue8m0)
    else:
        codes_b = torch.cat([none_b[0] if q is None else code_bytes(q, n, kp) for q in b])  # type: ignore[index]
        scales_b = torch.cat([none_b[1] if q is None else cute_scales(q, ue8m0) for q in b])  # type: ignore[index]
    args = [
        codes_a,
        scales_a,
        codes_b,
        scales_b,
        _globals(global_scales[0], a, one, dev, whole=launched is not None),
        _globals(global_scales[1], b, one, dev, whole=launched is not None),
        offsets_tensor(rows, offsets, dev),
        torch.empty((m, n), dtype=plan.kernel_out, device=dev),
    ]
    if bias is not None:
        args.append(bias.detach().to(device=dev, dtype=torch.float32).reshape(-1).contiguous())
    args.append(grid_limit(sms, dev))
    return plan, args


def _launched(
    a: Sequence[QuantizedTensor | None],
    b: Sequence[QuantizedTensor | None],
    bias: torch.Tensor | None,
    wholes: tuple[Any, Any],
) -> tuple[tuple[Any, Any], list[int], tuple[int, int]] | None:
    """Where each side's groups are the rows of one grouped launch (``wholes`` given, and the
    groups' shapes known without building them: ``GroupedOperands.shapes``) and no group is
    empty: the two wholes (they say the formats, RHTs and device), A's rows per group and B's
    shape [N, K], checked as ``_check`` checks the groups (the per-group checks hold by
    construction: one launch, one format). Else None: the groups are checked one by one."""
    shapes = launch_shapes(a, b, wholes)
    if shapes is None:
        return None
    (shapes_a, shapes_b), (whole_a, whole_b) = shapes, wholes
    n, k = shapes_b[0]
    # each side's shapes as columns (C-level unpacking: no Python step per group)
    rows, cols = map(list, zip(*shapes_a, strict=True))
    b_rows, b_cols = zip(*shapes_b, strict=True)
    if (
        b_rows.count(n) != len(b_rows)
        or b_cols.count(k) != len(b_cols)
        or cols.count(k) != len(cols)
        or whole_a.rows != sum(rows)
        or whole_b.rows != len(b) * n
        or (whole_a.cols, whole_b.cols) != (k, k)
    ):
        return None
    check_one_launch(whole_a, whole_b, "grouped FP8 GEMM")
    _check_bias(bias, len(b), n)
    return (whole_a, whole_b), rows, (n, k)


def launch_shapes(
    a: Sequence[Any], b: Sequence[Any], given: tuple[Any, Any]
) -> tuple[list, list] | None:
    """Each side's groups' shapes where both sides are one launch's groups (``given``: a tensor
    of every group of each side; the shapes known without building a group,
    ``GroupedOperands.shapes``) and no group is empty; else None."""
    shapes_a, shapes_b = getattr(a, "shapes", None), getattr(b, "shapes", None)
    if shapes_a is None or shapes_b is None or given[0] is None or given[1] is None:
        return None
    if not a or len(a) != len(b) or len(shapes_a) != len(a) or len(shapes_b) != len(b):
        return None
    if None in shapes_a or None in shapes_b:  # an empty group (one C-level scan each)
        return None
    return shapes_a, shapes_b


def check_one_launch(x: Any, y: Any, what: str) -> None:
    """TensorError unless A's and B's launch tensors carry one RHT and sit on one device."""
    if x.rht != y.rht:
        raise TensorError(f"{what}: A and B carry different RHTs")
    if x.device != y.device:
        raise TensorError(f"{what}: operands on several devices {x.device}, {y.device}")


def _check_bias(bias: torch.Tensor | None, groups: int, n: int) -> None:
    if bias is not None and tuple(bias.shape) != (groups, n):
        raise TensorError(
            f"grouped FP8 GEMM: the bias must be [groups, N] = [{groups}, {n}], got "
            f"{tuple(bias.shape)} {bias.dtype}"
        )


def _whole(whole: Any, groups: Sequence[QuantizedTensor | None], rows: int) -> Any:
    """``whole`` where it can stand for the groups' concatenation (no group None, its rows the
    groups' rows), else None."""
    if whole is None or any(q is None for q in groups) or whole.rows != rows:
        return None
    return whole


def _globals(
    given: torch.Tensor | None,
    groups: Sequence[QuantizedTensor | None],
    one: torch.Tensor,
    device: torch.device,
    *,
    whole: bool = False,
) -> torch.Tensor:
    """Every group's S_dec as fp32 [groups] on ``device`` (an empty group's 1): ``given`` where
    no group is None (``whole``: known to be so, no group read), else each group's."""
    complete = whole or not any(q is None for q in groups)
    if given is not None and complete and given.numel() == len(groups):
        if given.dtype != torch.float32 or given.device != device:
            given = given.to(device=device, dtype=torch.float32)
        # the kernel reads unit-stride vectors; a copy's column of a [groups, copies] table
        # (GroupedOperands.global_scales of a dual-output launch) is strided
        return given.reshape(-1).contiguous()
    return torch.cat([one if q is None else _global(q, device) for q in groups])


def _global(q: QuantizedTensor, device: torch.device) -> torch.Tensor:
    """S_dec of one group as fp32 [1] on ``device``."""
    g = q.global_scale
    if g.dtype != torch.float32 or g.device != device:
        g = g.to(device=device, dtype=torch.float32)
    return g.reshape(1)


def grid_limit(sms: int | None, dev: torch.device) -> int:
    """A persistent launch's CTA limit: ``sms`` where given, else the device's SM count (1 off
    CUDA, where the CPU tests only build the arguments)."""
    if sms is not None:
        return sms
    return fp8_gemm.sm_count(dev) if dev.type == "cuda" else 1


def launch_device(groups: Sequence[Any], given: Any, what: str) -> torch.device:
    """The device of a grouped FP8 launch: ``given``'s (one tensor of every group: no group
    read for it) or the first group's; FP4GenError unless it is a CUDA device of an arch with
    FP8 wgmma (sm_90a), the caller's cue to run the groups one by one."""
    if given is not None:
        dev = given.device
    else:
        dev = next((q.device for q in groups if q is not None), None)
    if dev is None or dev.type != "cuda":
        raise FP4GenError(f"the {what} runs on CUDA tensors, not on {dev}")
    from fp4gen.compiler.jit import detect_arch

    arch = detect_arch(dev)
    if arch not in fp8_gemm.CUTE_ARCHS:
        raise FP4GenError(f"no {what} for {arch} (FP8 wgmma: sm_90a only)")
    return dev


def grouped_block_scaled(
    a: Sequence[QuantizedTensor | None],
    b: Sequence[QuantizedTensor | None],
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    wholes: tuple[Any, Any] = (None, None),
    global_scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    offsets: tuple[Sequence[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """C [sum M_g, N] in ``out_dtype`` with C_g = S_a[g] S_b[g] sum_b s_a s_b P_b (+
    bias[g]) for every group in one launch of the grouped FP8 kernel (module docstring);
    ``bias`` [G, N] or None; ``wholes``, ``global_scales``, ``offsets``: as
    ``grouped_launch``. Raises TensorError for groups that cannot be multiplied and
    FP4GenError where the kernel does not serve them (not CUDA, not sm_90a, the pair): the
    caller's cue to run the groups one by one. An empty group: None in ``a``
    (``grouped_launch``)."""
    launch_device(a, wholes[0], "grouped FP8 GEMM")
    plan, args = grouped_launch(
        a,
        b,
        out_dtype=out_dtype,
        bias=bias,
        wholes=wholes,
        global_scales=global_scales,
        offsets=offsets,
    )
    c = args[7]
    if c.shape[0]:  # every group empty: nothing to launch
        fp8_gemm.cute_kernel(plan.params)(*args)
    if c.dtype != out_dtype:
        return c.to(out_dtype)
    return c


__all__ = [
    "GroupedPlan",
    "grouped_block_scaled",
    "grouped_fields",
    "grouped_fp8_enabled",
    "grouped_launch",
    "grouped_plan",
    "grid_limit",
    "launch_device",
    "log_fallback",
    "offsets_of",
    "offsets_tensor",
    "set_grouped_fp8",
]
