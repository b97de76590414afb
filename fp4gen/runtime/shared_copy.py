"""Sharing one quantized copy of x among the layers that read it in a row (a Llama's q, k and v
projections; gate and up): the eager route's wgrad copy (``LastCopy``, which also reports the
runs of layers that shared it to ``fp4gen.runtime.layer_groups``), and when a layer's copies of
x are the same as another layer's (``CopySharing``: the copy key, ``keeps_wgrad_input``,
``shares_fprop_input``)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fp4gen.dsl.model import Operand, OperandTable
from fp4gen.formats import BlockFormat, is_stochastic
from fp4gen.runtime import layer_groups
from fp4gen.runtime.operands import k_multiple


class LastCopy:
    """The wgrad copy of the last x a training forward quantized, for the next layer that reads
    the same x (a Llama's q, k and v projections; gate and up): one quantize pass and one saved
    copy instead of one per layer. It is the same x when its tensor (the base of x2's view) is
    alive, with the same address, layout and version counter (an in-place write bumps it), and
    the copy's key (``Linear._copy_key``) is equal. Holds x weakly: x's memory cannot be reused
    while the weak reference resolves, and the copy is dropped with the next one."""

    def __init__(self, plain: type) -> None:
        # the layer class whose runs (of its own instances, not subclasses') are reported
        self.plain = plain
        self.source: weakref.ref[torch.Tensor] | None = None
        self.key: tuple[Any, ...] = ()
        self.copy: Any = None
        # the layers that used the copy, in call order (held weakly): a run of two or more is
        # reported to the layer groups when the copy is replaced or dropped
        self.run: list[weakref.ref[Any]] = []

    @staticmethod
    def _identity(x2: torch.Tensor, key: tuple[Any, ...]) -> tuple[Any, ...]:
        return (x2.data_ptr(), x2._version, x2.shape, x2.stride(), x2.dtype, x2.device, key)

    def find(self, x2: torch.Tensor, key: tuple[Any, ...]) -> Any:
        source = None if self.source is None else self.source()
        if source is None or source is not _base(x2) or self.key != self._identity(x2, key):
            return None
        return self.copy

    def remember(self, x2: torch.Tensor, key: tuple[Any, ...], copy: Any, layer: Any) -> None:
        self.read_alone(x2)
        self._end_run()
        self.source = weakref.ref(_base(x2))
        self.key = self._identity(x2, key)
        self.copy = copy
        self.run = [weakref.ref(layer)]

    def join(self, layer: Any) -> None:
        """``layer`` used the copy too."""
        self.run.append(weakref.ref(layer))

    def read_alone(self, x2: torch.Tensor) -> None:
        """A layer read the copy's x without sharing the copy (another spec, a frozen weight):
        the run is not x's only readers, so it is not reported (a group's dx would be summed
        in another order than autograd sums the separate layers')."""
        source = None if self.source is None else self.source()
        if source is not None and source is _base(x2):
            self.run = []

    def forget(self) -> None:
        """Drop the copy (a backward has begun: the forward that could share it is over), so
        that it does not outlive training."""
        self._end_run()
        self.source, self.key, self.copy = None, (), None

    def _end_run(self) -> None:
        """Report the run of layers that shared the copy (plain Linears, two or more, alive)."""
        run = [ref() for ref in self.run]
        self.run = []
        if len(run) < 2 or not all(type(layer) is self.plain for layer in run):
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # a group forming would release graphs and buffers in the middle of a capture
        layer_groups.sighted(run)


def _base(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` is a view of (the caller's x, alive across its layers), or ``t``."""
    return t if t._base is None else t._base


class CopySharing:
    """When a layer keeps or shares a quantized copy of x (a ``Linear`` mixin)."""

    def _copy_key(self, table: OperandTable) -> tuple[Any, ...]:
        """What x's wgrad copy depends on besides x: its spec, the wgrad K multiple its tokens
        are padded to and the backend (a round-to-nearest copy draws no random stream). One
        tuple per (table, backend), so that comparing it with the last copy's is an identity
        check (the schedule hands over the same table object until it switches)."""
        last = self._copy_key_part  # [table, backend, key], mutated: no Module.__setattr__
        if last[0] is not table or last[1] != self.backend:
            wgrad_k = k_multiple(table.wgrad_gradient, table.wgrad_activation, blocks=True)
            last[:] = table, self.backend, (table.wgrad_activation, wgrad_k, self.backend)
        return last[2]

    def keeps_wgrad_input(self, table: OperandTable) -> bool:
        """Whether a training forward quantizes x's wgrad copy and saves it instead of x
        (``keep_quantized_input``, on by default): for a block format rounded to nearest (a
        stochastic copy draws from the backward call's stream), without an amax group on it
        (its all-reduce stays in the backward) or telemetry (which records x itself)."""
        spec = table.wgrad_activation
        return (
            self.keep_quantized_input
            and isinstance(spec.format, BlockFormat)
            and not is_stochastic(spec.rounding)
            and not self._reduced(Operand.WGRAD_ACTIVATION, spec)
            and not self.telemetry.every
        )

    def shares_fprop_input(self, table: OperandTable) -> bool:
        """Whether x's fprop operand made for another layer that reads the same x serves this
        one too, where its ``fprop_input_key`` is equal: a block format whose elements and
        scales round to nearest (no random stream, so the bits do not depend on which layer
        makes it), not quantized with an amax group's all-reduce."""
        spec = table.fprop_activation
        fmt = spec.format
        return (
            isinstance(fmt, BlockFormat)
            and not is_stochastic(spec.rounding)
            and fmt.scale.rounding != "stochastic"
            and not self._reduced(Operand.FPROP_ACTIVATION, spec)
        )

    def _shared_fprop_input(
        self, x2: torch.Tensor, table: OperandTable, call: int, copies: dict[Any, Any]
    ) -> Any:
        """x's fprop operand from ``copies`` (by ``fprop_input_key``) where another layer
        reading this x made the same one, else made now (``fprop_input``) and left there."""
        key = self.fprop_input_key(table)
        found = copies.get(key)
        if found is None:
            found = copies[key] = self.fprop_input(x2, table, call)
        return found
