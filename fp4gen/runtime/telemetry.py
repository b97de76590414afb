"""Quantization telemetry of a layer: per-operand error records, every N-th call."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from fp4gen.dsl.model import Operand
from fp4gen.numerics import QuantizedTensor, error_stats
from fp4gen.numerics.mor import MoRTensor
from fp4gen.runtime import device_memory
from fp4gen.runtime.operands import pad_to

log = logging.getLogger("fp4gen.runtime")
_skipped: set[str | None] = set()  # the layers whose captured calls went unrecorded (logged)


_captured = device_memory.captures  # a module attribute: tests stand a capture in here


@dataclass
class Telemetry:
    """Per-operand quantization error, recorded every ``every`` calls when enabled."""

    every: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)


class TelemetryRecorder:
    """Records a layer's quantized operands in its ``telemetry`` (a ``Linear`` mixin)."""

    def record(self, op: Operand, source: torch.Tensor, quantized: Any, call: int) -> None:
        """Append one telemetry record for a quantized operand (high-precision ones have none):
        error statistics for block formats, decisions and error histograms for MoR."""
        every = self.telemetry.every
        if not every or call % every:
            return
        if _captured(source):
            # its statistics are read on the host, which a CUDA graph capture refuses (and a
            # graph's replays run no Python): records come from the calls outside a capture
            if self.name not in _skipped:
                _skipped.add(self.name)
                log.info(
                    "%s: telemetry records no call made inside a CUDA graph capture",
                    self.name or "Linear",
                )
            return
        if isinstance(quantized, QuantizedTensor):
            if source.shape != quantized.shape:  # an unpadded source: padded only when recorded
                source = pad_to(source, *quantized.shape)
            stats = vars(error_stats(source, quantized))
        elif isinstance(quantized, MoRTensor):
            stats = quantized.stats()
        else:
            return
        self.telemetry.records.append(
            {"layer": self.name, "call": call, "operand": op.selector, **stats}
        )
