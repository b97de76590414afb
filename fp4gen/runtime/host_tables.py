"""Small host-built tables (group offsets, CTA tables, Philox words, expert indices) sent to the
device without waiting for it.

``torch.tensor(values, device="cuda")`` copies from pageable memory, which torch follows with a
stream synchronize: the host waits until the GPU has run everything queued before the copy. The
grouped experts' path builds a dozen such tables per layer pass, and on an H200 those waits were
most of its host time (docs/moe.md, "Where the time goes"). A copy from pinned memory with
``non_blocking=True`` is queued like a kernel; torch's pinned-memory cache keeps the host buffer
until the copy has run, so the table may be dropped at once.

While the current stream is being captured into a CUDA graph the copy stays the plain one: a
captured copy would read the pinned buffer again at every replay, after the cache has handed it
to someone else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fp4gen.runtime.device_memory import capturing

__all__ = ["host_table"]


def host_table(
    values: Sequence[Any] | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    host_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``values`` (nested ints or floats, or a CPU tensor) as a ``dtype`` tensor on ``device``,
    queued on the current stream rather than waited for. ``host_dtype`` is the type the values
    are built in before the cast to ``dtype`` (e.g. int64 for 32-bit words above 2**31 that
    ``dtype`` int32 keeps as their bit pattern)."""
    device = torch.device(device)
    if isinstance(values, torch.Tensor):
        host = values.to(host_dtype or dtype)
    else:
        host = torch.tensor(values, dtype=host_dtype or dtype)
    if host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda" or capturing():
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
