"""Small host-built tables (group offsets, CTA tables, Philox words, expert indices) sent to the
device without waiting for it.

``torch.tensor(values, device="cuda")`` copies from pageable memory, which torch follows with a
stream synchronize: the host waits until the GPU has run everything queued before the copy. The
grouped experts' path builds a dozen such tables per layer pass, and on an H200 those waits were
most of its host time (docs/moe.md, "Where the time goes"). A copy from pinned memory with
``non_blocking=True`` is queued like a kernel.

The pinned memory is one staging buffer per device (``_Staging``), handed out in consecutive
slices: a table costs a numpy fill of its slice and one queued copy, where a pinned tensor of its
own cost a CPU tensor, a pinned allocation and a copy into it (some 60 us of host time per table
on the GPU machine). A slice is reused only once the copies that read it have run: the buffer is
used in two halves, and before the writes move into a half, the events recorded when the half
was last left (one per stream that copied from it) are waited for. The GPU is then a whole
half-buffer of tables behind at most, so in practice that wait is over at once.

A table larger than half the buffer grows the device's buffer (to the next power of two that
holds two such tables, at most ``_MAX_STAGING_BYTES``): an MoE layer's CTA tables reach
hundreds of KiB (64 experts, top-8, 8192 tokens: 786 KiB), and a pinned allocation of their own
took about 1.4 ms of host time each on the GPU machine. The old buffer is dropped: torch's
pinned-memory allocator keeps it until the copies queued from it have run.

While the current stream is being captured into a CUDA graph a table is copied from the
device's capture buffer (``_CaptureStaging``), never the staging buffer: a captured copy reads
its source again at every replay, and a staging slice is reused. torch refuses a captured copy
from pageable memory, and pinning memory inside a capture can synchronize with the legacy
stream, which invalidates the capture; so the capture buffer is pinned on the device's first
eager table (outside any capture, ``CAPTURE_STAGING_BYTES``), and its slices are handed out once
each and kept for the process: a graph reads its tables at every replay.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fp4gen.errors import FP4GenError
from fp4gen.runtime.device_memory import capturing, persistent

__all__ = ["built_on_device", "host_table", "set_device_built_rows", "spread_groups"]

_NUMPY = {
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float32: np.float32,
    torch.uint8: np.uint8,
}
_ALIGN = 16  # each slice starts 16-byte aligned


class _Staging:
    """One device's pinned staging buffer (module docstring), ``size`` bytes in two halves."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self.array = self.host.numpy()  # the same memory, written by numpy
        self.half = 0  # the half being written
        self.pos = 0
        self.streams: list[set[Any]] = [set(), set()]  # per half: the streams that copied
        self.done: list[list[torch.cuda.Event]] = [[], []]  # per half: when it was last left
        self.lock = threading.Lock()

    def copy(self, values: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``values`` (C-contiguous, ``dtype``'s numpy type) on ``device``, queued on the current
        stream from a slice of this buffer."""
        n = values.nbytes
        with self.lock:
            if self.pos + n > (self.half + 1) * (self.size // 2):
                self._enter(1 - self.half)
            start = self.pos
            self.array[start : start + n] = values.reshape(-1).view(np.uint8)
            self.streams[self.half].add(torch.cuda.current_stream(device))
            host = self.host[start : start + n].view(dtype).view(values.shape)
            out = host.to(device, non_blocking=True)
            self.pos = start + -(-n // _ALIGN) * _ALIGN
        return out

    def _enter(self, half: int) -> None:
        """Move the writes to the start of ``half``: mark the half left (an event on each stream
        that copied from it), then wait for the copies that last read ``half``."""
        left = self.half
        self.done[left] = [torch.cuda.Event() for _ in self.streams[left]]
        for event, stream in zip(self.done[left], self.streams[left], strict=True):
            event.record(stream)
        self.streams[left] = set()
        for event in self.done[half]:
            event.synchronize()
        self.done[half] = []
        self.half, self.pos = half, half * (self.size // 2)


# the pinned bytes per device that the tables made inside CUDA graph captures can take in all
# (never reused: graphs read them at every replay). An MoE block's static experts take some
# hundreds of KiB per capture (their weights' CTA tables at 64 experts, hidden 2048).
CAPTURE_STAGING_BYTES = 1 << 24


class _CaptureStaging:
    """A device's pinned buffer for the tables copied inside CUDA graph captures: each table a
    slice of its own, handed out once (module docstring)."""

    def __init__(self, size: int) -> None:
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self.array = self.host.numpy()
        self.pos = 0
        self.lock = threading.Lock()

    def copy(self, values: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = values.nbytes
        with self.lock:
            if self.pos + n > self.host.numel():
                raise FP4GenError(
                    f"the tables made inside CUDA graph captures need more than the "
                    f"{self.host.numel()} pinned bytes kept for them on {device} "
                    "(host_tables.CAPTURE_STAGING_BYTES: raise it before the first CUDA call)"
                )
            start = self.pos
            self.array[start : start + n] = values.reshape(-1).view(np.uint8)
            self.pos = start + -(-n // _ALIGN) * _ALIGN
        host = self.host[start : start + n].view(dtype).view(values.shape)
        return host.to(device, non_blocking=True)


_capture_staging: dict[int, _CaptureStaging] = {}


def _capture_staging_of(device: torch.device) -> _CaptureStaging | None:
    """The device's capture buffer; made here outside a capture where it is missing (None
    inside one: it cannot be pinned there)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _capture_staging.get(index)
    if found is None and not capturing():
        with _staging_lock:
            found = _capture_staging.setdefault(index, _CaptureStaging(CAPTURE_STAGING_BYTES))
    return found


_STAGING_BYTES = 1 << 20  # per device at first: a half holds some thousands of small tables
_MAX_STAGING_BYTES = 1 << 26  # the most a device's buffer grows to (larger tables: pinned alone)
_staging: dict[int, _Staging] = {}
_staging_lock = threading.Lock()


def staging_bytes(nbytes: int, current: int) -> int:
    """The size of a staging buffer whose half holds a table of ``nbytes``: ``current``
    where it does, else the next power of two of twice the table (at least twice
    ``current``); above ``_MAX_STAGING_BYTES`` none (0)."""
    if nbytes <= current // 2:
        return current
    size = max(2 * current, 1 << (2 * nbytes - 1).bit_length())
    return size if size <= _MAX_STAGING_BYTES else 0


def _staging_of(device: torch.device, nbytes: int) -> _Staging | None:
    """The device's staging buffer, grown where a table of ``nbytes`` does not fit in its
    half; None where no buffer may be that large."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    staging = _staging.get(index)
    if staging is not None and nbytes <= staging.size // 2:
        return staging
    with _staging_lock:
        staging = _staging.get(index)
        size = staging_bytes(nbytes, _STAGING_BYTES if staging is None else staging.size)
        if not size:
            return None
        if staging is None or staging.size != size:
            staging = _staging[index] = _Staging(size)
    return staging


# (device, columns) -> an int32 zero table of at least as many rows as asked for (``unread_table``)
_unread: dict[tuple[torch.device, int], torch.Tensor] = {}


def unread_table(device: torch.device, rows: int, columns: int) -> torch.Tensor:
    """An int32 [rows, columns] table of zeros on ``device``: the argument of a kernel that
    never reads it (a launch without stochastic rounding reads no Philox words; its shape must
    still match the launch's groups), a view of one buffer kept per device and width (grown to
    the next power of two of rows), in place of a table built and copied per launch."""
    key = (device, columns)
    found = _unread.get(key)
    if found is None or found.shape[0] < rows:
        size = 1 << max(rows - 1, 0).bit_length()
        if device.type == "cuda" and capturing():  # not kept: made in the capture's pool
            return torch.zeros((rows, columns), dtype=torch.int32, device=device)
        found = _unread[key] = persistent(
            lambda: torch.zeros((size, columns), dtype=torch.int32, device=device), device
        )
    return found[:rows]


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
    if device.type == "cuda" and dtype in _NUMPY:
        if isinstance(values, torch.Tensor):
            array = values.numpy()
        else:
            array = np.asarray(values, dtype=_NUMPY.get(host_dtype or dtype))
        # numpy's cast wraps as torch's does (an int64 word above 2**31 keeps its bit pattern)
        array = np.ascontiguousarray(array.astype(_NUMPY[dtype], copy=False))
        captures = _capture_staging_of(device)  # made on the first eager table
        if capturing():
            if captures is None:
                raise FP4GenError(
                    "a table was made inside a CUDA graph capture before any eager CUDA call "
                    "of fp4gen: run one step eagerly before capturing"
                )
            return captures.copy(array, dtype, device)
        staging = _staging_of(device, array.nbytes) if array.nbytes else None
        if staging is not None:
            return staging.copy(array, dtype, device)
    if isinstance(values, torch.Tensor):
        host = values.to(host_dtype or dtype)
    else:
        host = torch.tensor(values, dtype=host_dtype or dtype)
    if host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda":
        return host.to(device)
    if capturing():  # a dtype numpy does not hold: the capture cannot copy it
        raise FP4GenError(f"a {dtype} table cannot be copied inside a CUDA graph capture")
    return host.pin_memory().to(device, non_blocking=True)


# From this many CTA rows on, a per-CTA table (``spread_groups``) is built on its CUDA device: a
# numpy table of 50k rows (an MoE layer's grouped quantize at 8192 tokens, top-8) took about
# 1 ms of the GPU machine's host time to fill plus its 786 KiB copy, where the device build is
# six to eight queued ops on one small copy whatever its length. Below it numpy is as cheap.
DEVICE_BUILT_ROWS = 4096
_device_built_rows = [DEVICE_BUILT_ROWS]


def set_device_built_rows(rows: int | None) -> int | None:
    """From how many rows a per-CTA table is built on its CUDA device (``spread_groups``);
    None builds every table with numpy on the host (benchmarks/moe.py --numpy-tables compares
    the two). Returns the previous setting."""
    previous = _device_built_rows[0]
    _device_built_rows[0] = rows
    return previous


def built_on_device(rows: int, device: torch.device) -> bool:
    """Whether a per-CTA table of ``rows`` rows for ``device`` is built there."""
    limit = _device_built_rows[0]
    return device.type == "cuda" and limit is not None and rows >= limit


def spread_groups(
    tiles: np.ndarray, columns: np.ndarray, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For groups of ``tiles[g]`` rows each (one per CTA, group after group): each row's group,
    its index within its group, and its group's ``columns[:, g]`` (int32 [rows], [rows] and
    [C, rows] on ``device``), built by torch ops on ``device`` from one small copy of the
    per-group values: the groups' first rows, then ``columns`` ([C, groups]). A row finds its
    group as the last one whose first row is at or before it, which skips the empty groups
    (they share their first row with the next group's)."""
    first = np.cumsum(tiles) - tiles
    rows = int(first[-1] + tiles[-1]) if len(tiles) else 0
    small = host_table(torch.from_numpy(np.vstack((first, columns))), torch.int32, device)
    index = torch.arange(rows, dtype=torch.int32, device=device)
    group = torch.searchsorted(small[0], index, right=True, out_int32=True).sub_(1)
    picked = small.index_select(1, group)
    return group, index.sub_(picked[0]), picked[1:]
