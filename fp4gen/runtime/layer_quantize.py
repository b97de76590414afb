"""How a layer quantizes one operand: through its slot, seed and amax group (``quantize``), and
where the torch reference quantizes in a propagating scope, a NaN or an Inf turned into a NaN
global scale as the kernels give it (``_quantize_operand``); the fprop GEMM's K and what x's
fprop operand depends on (``fprop_k``, ``fprop_input_key``); and the weight rules the copies
follow (``_transposable``: the dgrad weight as the transpose of the fprop codes;
``_gathered_operand``: FSDP2's all-gathered quantized weight). The copies each GEMM pass reads
(x's fprop operand and wgrad copy, the columnwise weight, dy's pair) are made in
``fp4gen.runtime.linear``, beside the passes."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from fp4gen.device_offset import DeviceOffset
from fp4gen.dsl.model import Operand, OperandSpec, OperandTable
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat
from fp4gen.numerics import QuantizedTensor
from fp4gen.runtime import finite
from fp4gen.runtime.global_amax import quantize_with_amax
from fp4gen.runtime.operands import (
    k_multiple,
    quantize_operand,
    round_up,
)


class OperandQuantizer:
    """A layer's quantization of one operand (a ``Linear`` mixin: it reads ``backend``,
    ``mors``, ``in_features`` and the slot, seed and amax methods of the other mixins)."""

    def quantize(
        self,
        t: torch.Tensor,
        op: Operand,
        spec: OperandSpec,
        call: int,
        amax: torch.Tensor | None = None,
        *,
        source_in_backward: bool = False,
        host_offset: bool = False,
    ) -> Any:
        """Q(t) for operand slot ``op`` in this call; a reduced operand (``set_amax_group``)
        with the group's amax (``amax`` when the caller has it already, else all-reduced now).
        ``source_in_backward`` / ``host_offset``: a forward operand made again in a backward
        (``slot``)."""
        _, offset = self.slot(
            op, spec, call, t, source_in_backward=source_in_backward, host_offset=host_offset
        )
        seed = self._seed_of(op)
        if self._reduced(op, spec):
            if amax is None:
                amax = self._group_amax(t)
            return quantize_with_amax(t, spec, amax, seed=seed, offset=offset, backend=self.backend)
        return self._quantize_operand(t, spec, offset, seed=seed)

    def _quantize_operand(
        self, t: torch.Tensor, spec: OperandSpec, offset: int | DeviceOffset, *, seed: int
    ) -> Any:
        """``quantize_operand`` of ``t``. In a propagating scope a block format's input that
        the torch reference quantizes (``finite.reference_input``: a CPU tensor, the
        "reference" backend, or on CUDA a shape the kernels do not take, found when the
        reference refuses it) gets a NaN global scale for a NaN or an Inf, as the kernels give
        it, rather than an error."""
        flag = None
        if isinstance(spec.format, BlockFormat):
            t, flag = finite.reference_input(t, self.backend)
        quantize = partial(
            quantize_operand, spec=spec, seed=seed, offset=offset, backend=self.backend
        )
        try:
            q = quantize(t, mors=self.mors)
        except TensorError:
            if flag is not None or not isinstance(spec.format, BlockFormat):
                raise
            if not _refused_non_finite(t):
                raise
            t, flag = finite.reference_input(t, "reference")
            q = quantize(t, mors=self.mors)
        return finite.poisoned(q, flag)

    def fprop_k(self, table: OperandTable, in_features: int | None = None) -> int:
        """The fprop GEMM's K: in_features (the weight's, where given), zero-padded to the fprop
        RHT size where it is not a multiple of it."""
        fprop_k = k_multiple(table.fprop_activation, table.fprop_weight, blocks=False)
        return round_up(self.in_features if in_features is None else in_features, fprop_k)

    def fprop_input_key(self, table: OperandTable) -> tuple[Any, ...]:
        """What x's fprop operand depends on besides x, for a round-to-nearest spec (a layer
        group has no other: ``fp4gen.runtime.layer_groups``): layers with equal keys get the
        same bits from one ``fprop_input``."""
        return (table.fprop_activation, self.fprop_k(table), self.backend)


def _refused_non_finite(t: torch.Tensor) -> bool:
    """Whether a quantizer's TensorError for ``t`` is the torch reference refusing a NaN or an
    Inf in a propagating scope (on CUDA, for a shape the kernels do not take): then the layer
    propagates it as the kernels do. One read, on a path that raised already."""
    return finite.propagates() and not bool(torch.isfinite(t).all())


def _rows_contiguous(w: torch.Tensor) -> torch.Tensor:
    """``w`` with contiguous rows: a Conv1D's weight reaches the ops as the view W^T, and the
    quantizer reads along rows (a transient copy; a plain Linear's weight is never copied)."""
    return w if w.is_contiguous() else w.contiguous()


def _dequantized(copy: Any) -> torch.Tensor:
    """The values of a quantized operand copy in fp32 (a high-precision one as it is), for an
    operand quantized from another GEMM's copy (``from GEMM.ROLE``)."""
    if isinstance(copy, torch.Tensor):
        return copy.float()
    return copy.dequantize()


def _transposable(fprop: OperandSpec, dgrad: OperandSpec) -> bool:
    """Whether dgrad's weight is the transpose of fprop's codes: 2D blocks, one spec, no RHT."""
    return (
        isinstance(fprop.format, BlockFormat)
        and fprop.format.is_2d
        and fprop == dgrad
        and fprop.rht is None
    )


def _gathered_operand(
    weight: torch.Tensor, table: OperandTable, name: str
) -> QuantizedTensor | None:
    """The quantized operand of a weight FSDP2 all-gathered as codes and scales (a
    ``fp4gen.runtime.fsdp.GatheredWeight``, which has ``quantized_weight``), else None. Its spec
    must be the fprop weight spec in force, transposable to the dgrad one."""
    get = getattr(weight, "quantized_weight", None)
    if get is None:
        return None
    q: QuantizedTensor = get()
    spec = table.fprop_weight
    if not _transposable(spec, table.dgrad_weight) or (q.format, q.rounding) != (
        spec.format,
        spec.rounding,
    ):
        raise FP4GenError(
            f"{name or 'fp4gen.nn.Linear'}: the all-gathered quantized weight is not the "
            "recipe's fprop weight operand in force now"
        )
    return q
