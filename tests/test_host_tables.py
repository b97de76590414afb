"""``host_table``: host-built tables on the device, queued rather than waited for."""

from __future__ import annotations

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tables_do_not_wait_for_the_gpu() -> None:
    """torch's sync debug mode raises on any operation that synchronizes the stream: the
    pinned, non-blocking copy must not; the values arrive intact behind queued work."""
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            busy = busy @ busy  # work queued ahead of the copies
            busy = busy / busy.abs().amax().clamp_min(1.0)
        tables = [host_table(list(range(n)), torch.int32, "cuda") for n in (1, 7, 4096)]
        words = host_table([[0xFFFFFFFF, 3]], torch.int32, "cuda", host_dtype=torch.int64)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert [t.cpu().tolist() for t in tables] == [list(range(n)) for n in (1, 7, 4096)]
    assert words.cpu().tolist() == [[-1, 3]]
