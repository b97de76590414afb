"""Quantize with a per-tensor amax shared by several ranks.

Two features quantize part of a tensor that other ranks hold the rest of, and need the scale a
process holding the whole tensor would use: FSDP2's quantized weight all-gather (a weight shard,
``fp4gen.runtime.fsdp``) and ``fp4gen.nn.Linear``'s ``amax_group`` (an activation or gradient
whose tokens are split over the ranks of a sequence- or tensor-parallel group).

The NVFP4 global scale is a function of the tensor's amax only, and every block scale and code a
function of its block's values and the global scale. So a rank that knows the group's amax
(``group_amax``: one all-reduce MAX) and quantizes its part with it gives the rows (block-rows)
of quantizing the whole tensor, bit for bit. The quantizers (the reference and the kernels)
take the amax from the tensor they are given; ``quantize_with_amax`` therefore appends one
block-row holding the amax in one element and zeros elsewhere, so the tensor's amax is the
group's and no other block changes, and cuts that block-row's codes and scales off again. The
appended row comes last, so the stochastic-rounding field of every real element (row * columns
+ column) is the one it has without it.

This cannot carry the amax of an operand with a Hadamard transform (the quantizer's amax is that
of the transformed tensor) nor of a Mixture-of-Representations operand; ``check_reducible``
refuses those (docs/distributed.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from fp4gen.device_offset import DeviceOffset
from fp4gen.dsl.model import MoRRef, Operand, OperandSpec
from fp4gen.errors import FP4GenError
from fp4gen.formats import BlockFormat, HighPrecision
from fp4gen.numerics import QuantizedTensor
from fp4gen.numerics.quantize import PackedCodes
from fp4gen.runtime.operands import quantize_operand

# The operands a sequence-parallel layer holds a token slice of and quantizes along the features
# (1xN blocks along K): every row is then independent of the other ranks' rows given the scale.
DEFAULT_AMAX_OPERANDS: tuple[Operand, ...] = (Operand.FPROP_ACTIVATION, Operand.DGRAD_GRADIENT)
# A rank's activation and gradient operands round with seed + rank * RANK_SEED_STRIDE: more than
# any model's layer count (convert gives layer i the seed seed + i), so no two (layer, rank)
# pairs share a Philox key.
RANK_SEED_STRIDE = 2**20


def quantize_with_amax(
    t: torch.Tensor,
    spec: OperandSpec,
    amax: torch.Tensor,
    *,
    seed: int,
    offset: int | DeviceOffset,
    backend: str = "auto",
) -> QuantizedTensor:
    """Q(t; spec) with the per-tensor amax ``amax`` (fp32 0-dim, >= t's own amax, one of the
    values of the whole tensor) in place of t's: one block-row [block height, cols] holding
    ``amax`` in its first element is appended and its codes and scales are cut off (module
    docstring). The block height divides t's rows (the callers ensure it)."""
    assert isinstance(spec.format, BlockFormat) and spec.rht is None
    if spec.format.global_rows:  # a row's scale is its own amax's: the ranks agree already
        q = quantize_operand(t, spec, seed=seed, offset=offset, backend=backend)
        assert isinstance(q, QuantizedTensor)
        return q
    height = spec.format.block[0]
    rows, cols = t.shape
    extra = t.new_zeros((height, cols))
    extra[0, 0] = amax.to(t.dtype)  # exact: the amax is one of the tensor's values
    q = quantize_operand(torch.cat((t, extra)), spec, seed=seed, offset=offset, backend=backend)
    assert isinstance(q, QuantizedTensor)
    data = q.data[:rows]
    if q.scale_codes is not None:
        scales, scale_codes = None, q.scale_codes[: rows // height]
    else:
        scales, scale_codes = q.scales[: rows // height], None
    return QuantizedTensor(
        codes=None,
        scales=scales,
        scale_codes=scale_codes,
        global_scale=q.global_scale,
        format=q.format,
        rounding=q.rounding,
        rht=None,
        seed=q.seed,
        offset=q.offset,
        shape=t.shape,
        dtype=t.dtype,
        packed=PackedCodes(data, cols, q.element.bits),
    )


def group_amax(t: torch.Tensor, group: Any) -> torch.Tensor:
    """The amax of the tensor the ranks of ``group`` hold parts of (fp32 0-dim, on t's device):
    one all-reduce (MAX) of two fp32 numbers, the local amax and a non-finite flag (a MAX need
    not propagate NaN). Any part with a NaN or an Inf gives NaN on every rank, so every rank
    does what the quantizer does with a non-finite input (the reference raises TensorError, the
    kernels give a NaN global scale) rather than one rank stopping while the others wait in the
    next collective. No value is read back to the host."""
    if t.numel():
        local = torch.stack((t.abs().amax().float(), (~torch.isfinite(t)).any().float()))
    else:  # a rank without tokens adds nothing
        local = torch.zeros(2, dtype=torch.float32, device=t.device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return torch.where(local[1] > 0, torch.full_like(local[0], float("nan")), local[0])


def resolve_operands(operands: Iterable[Operand | str] | None) -> frozenset[Operand]:
    """Operand slots from Operands or selectors (``"fprop.activation"``); None: the default."""
    if operands is None:
        return frozenset(DEFAULT_AMAX_OPERANDS)
    by_selector = {op.selector: op for op in Operand}
    out = set()
    for op in operands:
        if isinstance(op, str):
            if op not in by_selector:
                raise FP4GenError(
                    f"amax_operands: unknown operand '{op}' (known: {', '.join(by_selector)})"
                )
            op = by_selector[op]
        out.add(op)
    return frozenset(out)


def check_reducible(op: Operand, spec: OperandSpec, where: str) -> None:
    """FP4GenError when ``op`` (with ``spec``) cannot be quantized with a group's amax exactly.
    A high-precision operand passes: it has no scale, so there is nothing to reduce (a precision
    schedule may switch an operand to BF16)."""
    head = f"{where}: amax_group cannot reduce {op.selector}"
    fmt = spec.format
    if op.role == "weight":
        raise FP4GenError(
            f"{head}: it is a weight operand (only activation and gradient operands, whose "
            "tokens the ranks split, are reduced; a sharded weight gets its whole amax from "
            "FSDP2's quantized all-gather)"
        )
    if isinstance(fmt, HighPrecision):
        return
    if isinstance(fmt, MoRRef):
        raise FP4GenError(
            f"{head}: a Mixture-of-Representations operand ({fmt.name}) decides per unit "
            "from the tensor's own amax, which the group's amax cannot be given to"
        )
    assert isinstance(fmt, BlockFormat)
    if not fmt.global_scale:
        raise FP4GenError(
            f"{head}: its format {fmt.name} has no per-tensor scale (every block scale is a "
            "function of its block alone, so the ranks already agree without a reduction); "
            "leave it out of amax_operands"
        )
    if fmt.is_2d:
        raise FP4GenError(
            f"{head}: its {fmt.block[0]}x{fmt.block[1]} blocks span several tokens, which "
            "the ranks split (only 1xN blocks)"
        )
    if spec.rht is not None:
        raise FP4GenError(
            f"{head}: it has a Hadamard transform (rht {spec.rht.size}), whose global scale "
            "comes from the amax of the transformed tensor, which the appended-row method "
            "cannot carry; it needs a template change (docs/distributed.md). Use a recipe "
            "without an RHT on this operand or leave it out of amax_operands"
        )


__all__ = [
    "DEFAULT_AMAX_OPERANDS",
    "RANK_SEED_STRIDE",
    "check_reducible",
    "group_amax",
    "quantize_with_amax",
    "resolve_operands",
]
