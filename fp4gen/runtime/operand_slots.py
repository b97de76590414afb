"""The operand slots of a layer's calls and their Philox offsets.

Every GEMM operand of a ``Linear`` call has a slot (``SLOT``: its index in ``Operand``); a
stochastically rounded operand draws the Philox stream STREAMS_PER_CALL * (the layer's forward or
backward call count) + its slot, keyed by the layer's seed, so no two operands of any call share
random bits and a rerun gives the same bits. On CUDA the call count a block format's kernels read
is a device counter per pass (``DeviceOffset``), advanced on the device by every call, so a CUDA
graph draws fresh bits on every replay. ``_refuse_sr_capture`` refuses the one case that cannot
be captured: a Mixture-of-Representations operand that rounds stochastically."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fp4gen.device_offset import DeviceOffset
from fp4gen.dsl.model import MoRRef, Operand, OperandSpec
from fp4gen.errors import FP4GenError
from fp4gen.formats import BlockFormat, is_stochastic
from fp4gen.runtime.device_memory import captures, persistent

SLOT = {op: i for i, op in enumerate(Operand)}
FORWARD_OPERANDS = (Operand.FPROP_ACTIVATION, Operand.FPROP_WEIGHT)
# Philox offsets reserved per layer call: one stream per operand slot (six used, two spare), so
# no two operands of any forward or backward call of a layer share random bits.
STREAMS_PER_CALL = 8


class OperandSlots:
    """The slot and Philox offset of each operand of a layer's calls (a ``Linear`` mixin:
    it reads ``_forward_calls``, ``_backward_calls``, ``_counters`` and ``_device_offsets``)."""

    def slot(
        self,
        op: Operand,
        spec: OperandSpec,
        call: int,
        t: torch.Tensor,
        *,
        source_in_backward: bool = False,
        host_offset: bool = False,
    ) -> tuple[OperandSpec, int | DeviceOffset]:
        """An operand slot's spec and Philox offset in this call (a stream per slot and call):
        STREAMS_PER_CALL * call + slot. For a stochastically rounded CUDA operand of a block
        format the offset is a DeviceOffset on the layer's device counter of that pass, which
        holds ``call`` (module docstring), so a CUDA graph draws fresh bits on every replay.

        ``source_in_backward``: a forward operand quantized again in backward call ``call``,
        as the source of a ``from`` copy (dgrad.weight from fprop.weight, wgrad.activation
        from fprop.activation): the forward's stream of call ``call`` (forward and backward
        calls alternate in training), on CUDA read from the backward pass's counter, which
        holds ``call`` there; the forward pass's counter has moved on to the next call.

        ``host_offset``: call ``call``'s offset as a host int on every device: an eager
        backward that re-derives the source of another call than its own count (its forward's,
        where a no_grad forward came in between); no graph replays it."""
        if host_offset:
            return spec, STREAMS_PER_CALL * call + SLOT[op]
        fmt = spec.format
        if (
            t.is_cuda
            and isinstance(fmt, BlockFormat)
            and (is_stochastic(spec.rounding) or fmt.scale.rounding == "stochastic")
        ):  # stochastic block scales draw from the slot's stream too (numerics.md 11.2)
            forward = op in FORWARD_OPERANDS and not source_in_backward
            return spec, self._device_offset(op, t.device, forward)
        return spec, STREAMS_PER_CALL * call + SLOT[op]

    def _device_offset(self, op: Operand, device: torch.device, forward: bool) -> DeviceOffset:
        key = (op, device, forward)
        found = self._device_offsets.get(key)
        if found is None:
            counter = self._philox_counter(forward, device)
            found = DeviceOffset(counter, STREAMS_PER_CALL, (SLOT[op],))
            self._device_offsets[key] = found
        return found

    def _philox_counter(self, forward: bool, device: torch.device) -> torch.Tensor:
        """The device copy of the forward (or backward) call count: int64 [1], made from the
        host count on first use and advanced on the device with every call that reads it."""
        key = (forward, device)
        counter = self._counters.get(key)
        if counter is None:
            if torch.cuda.is_current_stream_capturing():
                raise FP4GenError(
                    f"{self.name or 'fp4gen.nn.Linear'}: its stochastic rounding counter is made "
                    "on the first eager call; run one step eagerly before capturing a CUDA graph"
                )
            calls = self._forward_calls if forward else self._backward_calls
            # kept for the layer's life: made outside any CUDA-graph pool (torch.compile's
            # CUDA graphs may be warming up the current stream)
            counter = persistent(
                lambda: torch.tensor([calls], dtype=torch.int64, device=device), device
            )
            self._counters[key] = counter
        return counter

    def _pass_counters(self, forward: bool) -> list[torch.Tensor]:
        """The device counters of the forward (or backward) pass, one per device."""
        return [c for (is_forward, _), c in self._counters.items() if is_forward == forward]

    def _advance_device(self, forward: bool) -> None:
        """Count a forward (or backward) call on every device counter of that pass (the host
        counts in forward_gemm / backward_gemms; a replayed layer graph advances these)."""
        for counter in self._pass_counters(forward):
            counter.add_(1)


def advance_devices(layers: Iterable[Any], forward: bool) -> None:
    """``_advance_device`` of every layer in ``layers``, in one launch for all their counters
    (``torch._foreach_add_``): the grouped experts' path advances every expert's layer per
    pass, where a launch per expert and counter would cost more than the GEMMs at 64 experts."""
    counters = [counter for layer in layers for counter in layer._pass_counters(forward)]
    if counters:
        torch._foreach_add_(counters, 1)


def _refuse_sr_capture(t: torch.Tensor, specs: tuple[OperandSpec, ...], name: str) -> None:
    """FP4GenError when a CUDA graph is being captured and a Mixture-of-Representations operand
    rounds stochastically: its kernels take the Philox offset from the host, so every replay
    would draw the same bits (a biased rounding, silently). Block formats read their offset
    from a device counter (``Linear.slot``) and capture like round-to-nearest."""
    for spec in specs:  # the specs first: asking CUDA whether it captures costs more
        if isinstance(spec.format, MoRRef) and is_stochastic(spec.rounding) and captures(t):
            raise FP4GenError(
                f"{name or 'fp4gen.nn.Linear'}: a Mixture-of-Representations operand rounds "
                f"stochastically ({spec.rounding}), which cannot be captured in a CUDA graph "
                "(every replay would draw the same random bits); run it eagerly"
            )
