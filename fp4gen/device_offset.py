"""A Philox offset that the quantize kernels read from device memory at run time.

Stochastic rounding draws its random bits from Philox4x32-10 with a 64-bit ``offset``
(docs/numerics.md section 5). Passed as a host int, the offset is baked into each launch, and so
into a captured CUDA graph: every replay would draw the same bits. A ``DeviceOffset`` instead
names a CUDA int64 counter: copy ``i`` of a generated quantize module's ``run(fns, x, seed=,
offset=DeviceOffset(counter, stride, slots))`` draws with the offset

    counter[0] * stride + slots[i]   (mod 2^64, counter[0] read as an unsigned 64-bit value)

read by the kernel when it runs. A graph that also advances the counter on the device (e.g. a
captured ``counter.add_(1)``) draws fresh bits on every replay, and with counter[0] == c the
codes are bit for bit those of the int offsets c * stride + slots[i].

The kernels take the counter's address, so the counter must stay alive (at the same address) for
as long as launches or graphs that read it may run. Kernels without stochastic rounding ignore
the offset. This module imports nothing from fp4gen, so generated modules and the runtime both
import it without cycles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_U64 = 1 << 64


def _u64(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _U64:
        raise ValueError(f"{name} must be an integer in [0, 2^64), got {value!r}")
    return value


@dataclass(frozen=True, eq=False)
class DeviceOffset:
    """Copy i's Philox offset is ``counter[0] * stride + slots[i]`` (mod 2^64), read on the device.

    ``counter``: a CUDA ``torch.int64`` tensor whose first element (in memory) is the count;
    ``stride``: an int in [0, 2^64); ``slots``: one int in [0, 2^64) per output copy of the
    module (an int is one slot). A tile module with several copies also takes a single slot,
    shared by every copy, as it does an int offset."""

    counter: Any  # torch.Tensor (torch is not imported here)
    stride: int
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        slots = (self.slots,) if isinstance(self.slots, int) else tuple(self.slots)
        object.__setattr__(self, "slots", slots)
        _u64("DeviceOffset stride", self.stride)
        if not slots:
            raise ValueError("DeviceOffset needs at least one slot")
        for s in slots:
            _u64("a DeviceOffset slot", s)
        c = self.counter
        if str(getattr(c, "dtype", None)) != "torch.int64" or not hasattr(c, "data_ptr"):
            raise ValueError(
                f"DeviceOffset counter must be a torch.int64 tensor, got {type(c).__name__} "
                f"{getattr(c, 'dtype', '')}".rstrip()
            )
        if c.numel() < 1:
            raise ValueError("DeviceOffset counter must hold at least one element")

    def offsets(self, count: int | None = None) -> tuple[int, ...]:
        """The int offsets the kernels would use now (one per slot, or ``count`` copies of a
        single slot). Reads the counter on the host: a device sync, for tests and reporting."""
        slots = self.slots if count is None or len(self.slots) != 1 else self.slots * count
        c = int(self.counter.reshape(-1)[0].item()) % _U64
        return tuple((c * self.stride + s) % _U64 for s in slots)


__all__ = ["DeviceOffset"]
