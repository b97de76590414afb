"""fp4gen.runtime.device_memory.kept: the caches' one rule for buffers kept across calls (CPU;
the CUDA-graph cases run in tests/test_layer_graphs_gpu.py)."""

from __future__ import annotations

import torch

from fp4gen.runtime import device_memory

CPU = torch.device("cpu")


def test_a_kept_buffer_is_made_once_per_key_and_the_oldest_goes_first(monkeypatch) -> None:
    monkeypatch.setattr(device_memory, "capturing", lambda: False)
    cache: dict = {}
    made: list[int] = []

    def make(n: int):
        return lambda: made.append(n) or torch.full((1,), float(n))

    a = device_memory.kept(cache, "a", make(1), CPU, limit=2)
    assert device_memory.kept(cache, "a", make(9), CPU, limit=2) is a and made == [1]
    device_memory.kept(cache, "b", make(2), CPU, limit=2)
    device_memory.kept(cache, "c", make(3), CPU, limit=2)  # full: "a" is dropped
    assert list(cache) == ["b", "c"] and made == [1, 2, 3]


def test_during_a_capture_the_buffer_is_the_graphs_not_the_caches(monkeypatch) -> None:
    monkeypatch.setattr(device_memory, "capturing", lambda: True)
    cache: dict = {}
    first = device_memory.kept(cache, "k", lambda: torch.zeros(2), CPU)
    second = device_memory.kept(cache, "k", lambda: torch.zeros(2), CPU)
    assert cache == {} and first is not second
