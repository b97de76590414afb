"""A layer's amax group: the operands quantized with the amax of the whole tensor the ranks of a
process group hold token slices of, and the per-rank Philox seed of its data operands
(``fp4gen.runtime.global_amax`` does the all-reduce; docs/distributed.md)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from fp4gen.dsl.model import Operand, OperandSpec
from fp4gen.errors import FP4GenError
from fp4gen.formats import BlockFormat
from fp4gen.runtime.device_memory import captures
from fp4gen.runtime.global_amax import (
    RANK_SEED_STRIDE,
    check_reducible,
    group_amax,
    resolve_operands,
)
from fp4gen.runtime.operand_slots import SLOT


class SharedGroup:
    """A process group as a layer holds it: a deep copy of the layer (an EMA copy, a reference
    model) shares it, as it is a handle to the ranks' communicator (a ProcessGroup cannot be
    copied or pickled)."""

    __slots__ = ("group",)

    def __init__(self, group: Any) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedGroup:
        return self


class AmaxGroupMember:
    """A layer's amax group and the seeds it implies (a ``Linear`` mixin: it reads
    ``_amax_group``, ``amax_operands``, ``_group_rank``, ``seed`` and ``schedule``)."""

    def set_amax_group(self, group: Any, operands: Iterable[Operand | str] | None = None) -> None:
        """Quantize ``operands`` (default: fprop.activation and dgrad.gradient) with the amax
        of the whole tensor the ranks of the process group ``group`` hold token slices of (one
        all-reduce MAX per tensor and call), and round this rank's activation and gradient
        operands with its own stream (``data_seed``). FP4GenError for an operand, in any table
        the precision schedule can switch to, that cannot be reduced exactly
        (``fp4gen.runtime.global_amax.check_reducible``). ``None`` turns it off. Every rank of
        the group must then call the layer's forward and backward in step (collectives)."""
        if group is None:
            self._amax_group, self._group_rank = SharedGroup(None), 0
            self.amax_operands = frozenset()
            return
        chosen = resolve_operands(operands)
        tables = self.schedule.tables()
        for table in tables:
            for op in sorted(chosen, key=SLOT.__getitem__):
                check_reducible(op, getattr(table, op.name.lower()), self.name or "this layer")
        rank = dist.get_rank(group)
        if rank < 0:
            raise FP4GenError(f"{self.name or 'this layer'}: this process is not in amax_group")
        self._amax_group, self.amax_operands, self._group_rank = SharedGroup(group), chosen, rank

    @property
    def amax_group(self) -> Any:
        """The process group whose amax the reduced operands use (None: off)."""
        return self._amax_group.group

    @property
    def data_seed(self) -> int:
        """The Philox seed of the activation and gradient operands: the layer's seed, plus
        rank * RANK_SEED_STRIDE under an amax group (those tensors differ per rank, so every
        rank draws its own stream; the weight, the same on every rank, keeps ``seed``)."""
        return self.seed + self._group_rank * RANK_SEED_STRIDE

    def _seed_of(self, op: Operand) -> int:
        return self.seed if op.role == "weight" else self.data_seed

    def _group_amax(self, t: torch.Tensor) -> torch.Tensor:
        """The group's amax of the tensor ``t`` is a slice of (one all-reduce). Refused while a
        CUDA graph is being captured (a captured step, torch.compile's cudagraphs): a collective
        inside a captured graph is not proven safe here."""
        if captures(t):
            raise FP4GenError(
                f"{self.name or 'fp4gen.nn.Linear'}: a layer with an amax_group all-reduces "
                "in every call, which is not supported inside a CUDA graph capture; run it "
                "eagerly (or without CUDA graphs)"
            )
        return group_amax(t, self.amax_group)

    def _reduced(self, op: Operand, spec: OperandSpec) -> bool:
        """Whether ``op`` is quantized with its group's amax in this table (a high-precision
        operand has no scale to share)."""
        return op in self.amax_operands and isinstance(spec.format, BlockFormat)
