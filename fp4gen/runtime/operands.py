"""One GEMM operand of a linear layer: quantize it as its OperandSpec says, and multiply two.

An operand is a QuantizedTensor (block-scaled format), a MoRTensor (a Mixture-of-Representations
rule: each decision unit in its own representation) or a plain tensor already rounded to its
high-precision dtype. ``operand_matmul`` computes A @ B^T for any mix: two quantized operands
through ``fp4gen.gemm`` (the best path on the device), every other mix with the reference
semantics (exact values, float64 sum, one rounding to fp32). For MoR operands that is the
paper's upcast: a block kept in BF16 meets the other operand's block at the higher precision.

A MoRRef names a rule of the recipe; the caller passes the rules in scope (``mors``, name ->
MoRSpec, see ``mor_scope``).

``quantize_operand_pair`` gives a tensor's rowwise operand and its transpose's (the columnwise
one): on CUDA from one tile-kernel launch when both use one block format (the scales of each copy
along its own direction), else one by one on ``t`` and on ``t.t()``.

``k_multiple`` says what a GEMM's K is zero-padded to a multiple of before its operands are
quantized (docs/numerics.md, section 3: "Padding K in fp4gen.nn.Linear"); ``pad_to`` makes the
padded copy, only when one is needed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from fp4gen.device_offset import DeviceOffset
from fp4gen.dsl.model import MoRRef, MoRSpec, OperandSpec, RHTSpec
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat, HighPrecision
from fp4gen.gemm_dispatch import gemm
from fp4gen.numerics import QuantizedTensor
from fp4gen.numerics.mor import MoRTensor
from fp4gen.runtime.cute_backend import quantize_cute, quantize_tile_cute
from fp4gen.runtime.quantize_dispatch import capturing, mor_quantize, quantize

HP_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}

Operand = QuantizedTensor | MoRTensor | torch.Tensor


def mor_scope(*sources: Iterable[MoRSpec]) -> dict[str, MoRSpec]:
    """The MoR rules of several recipes by name; one name with two different rules is an error
    (a layer could not tell which one its operands mean)."""
    scope: dict[str, MoRSpec] = {}
    for source in sources:
        for spec in source:
            known = scope.setdefault(spec.name, spec)
            if known != spec:
                raise FP4GenError(
                    f"two different MoR rules are named '{spec.name}' (from the recipe and a "
                    "recipe its layer or schedule rules use); rename one"
                )
    return scope


def check_supported(
    spec: OperandSpec, where: str, mors: Mapping[str, MoRSpec] | None = None
) -> None:
    """Reject specs the runtime cannot run, at conversion time rather than mid-training."""
    if isinstance(spec.format, MoRRef) and spec.format.name not in (mors or {}):
        known = ", ".join(sorted(mors or {})) or "none"
        raise FP4GenError(
            f"{where} uses the Mixture-of-Representations rule '{spec.format.name}', which is "
            f"not among the rules given to the layer (known: {known})"
        )


def k_multiple(a: OperandSpec, b: OperandSpec, *, blocks: bool) -> int:
    """What the K of a GEMM with operands ``a`` and ``b`` is zero-padded to a multiple of: the
    RHT sizes (the transform needs whole chunks), and with ``blocks`` (the wgrad GEMM, whose K is
    the token count) the block lengths along K too, so that the kernels take every token count.
    A MoR rule or a high-precision operand counts as block length 1 (MoR pads its edge blocks
    itself). Zero padding changes no amax, no code of a real element and no product."""
    return math.lcm(_k_unit(a, blocks), _k_unit(b, blocks))


def _k_unit(spec: OperandSpec, blocks: bool) -> int:
    rht = 1 if spec.rht is None else spec.rht.size
    fmt = spec.format
    if blocks and isinstance(fmt, BlockFormat):
        return math.lcm(fmt.block_len, rht)
    return rht


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= n."""
    return -(-n // multiple) * multiple


def pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The 2-D ``t`` zero-padded at the end to [rows, cols] (a new contiguous tensor), or ``t``
    itself when it already has that shape: no copy unless padding is needed."""
    r, c = t.shape
    if r == rows and c == cols:
        return t
    out = t.new_zeros((rows, cols))
    out[:r, :c] = t
    return out


def quantize_operand(
    t: torch.Tensor,
    spec: OperandSpec,
    *,
    seed: int,
    offset: int | DeviceOffset,
    backend: str = "auto",
    mors: Mapping[str, MoRSpec] | None = None,
) -> Operand:
    """Quantize a 2-D tensor along its last dimension per ``spec`` (or round it to its dtype).

    A MoR operand (``spec.format`` a MoRRef, looked up in ``mors``) gives a MoRTensor: "auto"
    runs the generated MoR kernels on CUDA tensors they support (else the reference, logged
    once), "cute" requires them, "reference" runs ``fp4gen.numerics.mor``."""
    fmt = spec.format
    if isinstance(fmt, HighPrecision):
        return t.to(HP_DTYPES[fmt.name])
    check_supported(spec, "an operand", mors)
    if isinstance(fmt, MoRRef):
        assert mors is not None
        return mor_quantize(
            t,
            mors[fmt.name],
            rounding=spec.rounding,
            hadamard=spec.rht,
            seed=seed,
            offset=offset,
            backend=backend,
        )
    if isinstance(offset, DeviceOffset):
        # a stochastic operand whose offset lives on the device (fp4gen.nn.Linear on CUDA): the
        # kernels read it there; backend="reference" never runs them (it is the oracle the
        # kernels are checked against), as quantize_operand_pair does not
        if backend in ("auto", "cute"):
            got = quantize_cute(
                t.detach(),
                fmt,
                rounding=spec.rounding,
                rht=spec.rht,
                seed=seed,
                offset=offset,
                required=backend == "cute",
            )
            if got is not None:
                return got
        if capturing(t):
            raise TensorError(
                f"cannot quantize the input of shape {tuple(t.shape)} with the torch reference "
                "inside a CUDA graph capture: the reference takes a stochastic operand's Philox "
                "offset from the host, a device read (the generated kernels do not take this "
                "input; outside a capture it runs)"
            )
        offset = offset.offsets()[0]  # the reference takes it from the host: one read
    return quantize(
        t,
        fmt,
        rounding=spec.rounding,
        hadamard=spec.rht,
        seed=seed,
        offset=offset,
        backend=backend,
    )


def quantize_operand_pair(
    t: torch.Tensor,
    row: tuple[OperandSpec, int | DeviceOffset] | None,
    col: tuple[OperandSpec, int | DeviceOffset],
    *,
    seed: int,
    backend: str = "auto",
    mors: Mapping[str, MoRSpec] | None = None,
) -> tuple[Operand | None, Operand]:
    """(the rowwise operand of ``t`` or None, the operand of ``t.t()``) for the (spec, Philox
    offset) pairs ``row`` and ``col``: the same operands as ``quantize_operand`` on ``t`` and on
    ``t.t().contiguous()``, from one read of ``t`` when a tile kernel serves both."""
    fmt = col[0].format
    same = row is None or row[0].format == fmt
    if backend in ("auto", "cute") and same and isinstance(fmt, BlockFormat) and t.is_cuda:
        outputs = [("columnwise", col[0].rounding, col[0].rht, col[1])]
        if row is not None:  # the tile kernel writes the rowwise copy first
            outputs.insert(0, ("rowwise", row[0].rounding, row[0].rht, row[1]))
        got = quantize_tile_cute(t, fmt, tuple(outputs), seed=seed)
        if got is not None:
            return (got[0], got[1]) if row is not None else (None, got[0])
    rowwise = None
    if row is not None:
        rowwise = quantize_operand(t, row[0], seed=seed, offset=row[1], backend=backend, mors=mors)
    columnwise = quantize_operand(
        t.t().contiguous(), col[0], seed=seed, offset=col[1], backend=backend, mors=mors
    )
    return rowwise, columnwise


def operand_matmul(a: Operand, b: Operand) -> torch.Tensor:
    """A @ B^T in fp32 for operands quantized (or kept) along the shared K dimension."""
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        return gemm(a, b)
    # Any other mix: exact values, float64 sum, one rounding. Two operands with the same RHT
    # are multiplied in the rotated space, where the transform cancels.
    rht_a, rht_b = _rht(a), _rht(b)
    if rht_a != rht_b:
        # A lone rotated operand would not cancel; the recipe validator forbids it, so this
        # only guards direct API use.
        raise FP4GenError("an operand with an RHT must be multiplied by one with the same RHT")
    va = _values(a)
    vb = _values(b)
    return (va @ vb.t()).to(torch.float32)


def _rht(t: Operand) -> RHTSpec | None:
    return t.rht if isinstance(t, QuantizedTensor | MoRTensor) else None


def _values(t: Operand) -> torch.Tensor:
    """Exact float64 values in the space the codes live in (rotated if there is an RHT)."""
    if isinstance(t, MoRTensor):
        return t.values()
    if isinstance(t, QuantizedTensor):
        return t.dequantize(rotated=True).to(torch.float64).reshape(t.rows, t.cols)
    return t.to(torch.float64)
