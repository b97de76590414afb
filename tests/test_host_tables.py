"""``host_table``: host-built tables on the device, queued rather than waited for."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from fp4gen.runtime.host_tables import host_table


def test_values_and_types_on_the_cpu() -> None:
    table = host_table([[1, 2], [3, 4]], torch.int32, "cpu")
    assert table.dtype == torch.int32 and table.tolist() == [[1, 2], [3, 4]]
    assert host_table([], torch.int64, "cpu").shape == (0,)
    # 32-bit words above 2**31 keep their bit pattern in int32 (the Philox words' case)
    words = host_table([0xFFFFFFFF, 0x80000000, 5], torch.int32, "cpu", host_dtype=torch.int64)
    assert words.tolist() == [-1, -(2**31), 5]
    from_tensor = host_table(torch.arange(3), torch.int32, torch.device("cpu"))
    assert from_tensor.dtype == torch.int32 and from_tensor.tolist() == [0, 1, 2]


@contextlib.contextmanager
def _behind_queued_work_without_waits() -> Iterator[None]:
    """GPU work queued ahead of what runs inside, under torch's sync debug mode "error" (it
    raises on any operation that synchronizes the stream)."""
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            busy = busy @ busy
            busy = busy / busy.abs().amax().clamp_min(1.0)
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tables_do_not_wait_for_the_gpu() -> None:
    """The pinned, non-blocking copy does not synchronize; the values arrive intact behind
    queued work."""
    with _behind_queued_work_without_waits():
        tables = [host_table(list(range(n)), torch.int32, "cuda") for n in (1, 7, 4096)]
        words = host_table([[0xFFFFFFFF, 3]], torch.int32, "cuda", host_dtype=torch.int64)
    assert [t.cpu().tolist() for t in tables] == [list(range(n)) for n in (1, 7, 4096)]
    assert words.cpu().tolist() == [[-1, 3]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staging_slices_are_reused_only_after_their_copies_ran() -> None:
    """A small staging buffer wrapped many times behind slow queued work, on two streams: every
    table arrives with its own values (a slice rewritten before its copy ran would not)."""
    import numpy as np

    from fp4gen.runtime.host_tables import _Staging

    staging = _Staging(4096)  # halves of 2 KiB: a few tables each
    side = torch.cuda.Stream()
    busy = torch.randn(2048, 2048, device="cuda")
    got, want = [], []
    for i in range(200):
        stream = side if i % 3 == 0 else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            if i % 17 == 0:
                busy = busy @ busy  # keep the GPU behind the host
                busy = busy / busy.abs().amax().clamp_min(1.0)
            values = np.arange(i, i + 1 + (i * 37) % 300, dtype=np.int32)
            got.append((stream, staging.copy(values, torch.int32, torch.device("cuda"))))
            want.append(values.tolist())
    torch.cuda.synchronize()
    assert [t.cpu().tolist() for _, t in got] == want


def test_a_large_table_grows_the_staging_buffer_to_a_power_of_two() -> None:
    from fp4gen.runtime import host_tables

    mib = 1 << 20
    assert host_tables.staging_bytes(1000, mib) == mib  # fits in a half
    assert host_tables.staging_bytes(mib // 2, mib) == mib
    # an MoE layer's CTA table (32768 CTAs x 6 int32 words): two of them, rounded up
    assert host_tables.staging_bytes(32768 * 6 * 4, mib) == 2 * mib
    assert host_tables.staging_bytes(3 * mib, mib) == 8 * mib
    assert host_tables.staging_bytes(mib // 2 + 1, 4 * mib) == 4 * mib
    limit = host_tables._MAX_STAGING_BYTES
    assert host_tables.staging_bytes(limit // 2, mib) == limit
    assert host_tables.staging_bytes(limit // 2 + 1, mib) == 0  # pinned on its own


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tables_larger_than_the_staging_half_grow_it_and_do_not_wait() -> None:
    """A table of several MiB behind queued work: the device's buffer grows instead of a
    pinned allocation of its own (which synchronizes nothing either, but costs the host a
    millisecond), and earlier, smaller tables still arrive intact."""
    import numpy as np

    from fp4gen.runtime import host_tables

    with _behind_queued_work_without_waits():
        small = host_table(list(range(1000)), torch.int32, "cuda")
        big_values = np.arange(3 * (1 << 20) // 4, dtype=np.int32)  # 3 MiB
        big = host_table(torch.from_numpy(big_values), torch.int32, "cuda")
        again = host_table(list(range(7)), torch.int32, "cuda")
    staging = host_tables._staging[torch.cuda.current_device()]
    assert staging.size >= 6 << 20
    assert small.cpu().tolist() == list(range(1000))
    assert torch.equal(big.cpu(), torch.from_numpy(big_values))
    assert again.cpu().tolist() == list(range(7))
