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
    """A CUDA device (named by its index; the capture is faked) while captured: the made
    buffer is not cached. A CPU device has no captures: its buffer is cached."""
    monkeypatch.setattr(device_memory, "capturing", lambda: True)
    cache: dict = {}
    first = device_memory.kept(cache, "k", lambda: torch.zeros(2), 0)
    second = device_memory.kept(cache, "k", lambda: torch.zeros(2), 0)
    assert cache == {} and first is not second
    on_cpu = device_memory.kept(cache, "k", lambda: torch.zeros(2), CPU)
    assert cache == {"k": on_cpu}


def test_pooled_sees_a_capture_and_torch_compiles_cuda_graph_warm_up(monkeypatch) -> None:
    """``pooled``: True while the current stream is captured, or while it is the stream of
    torch.compile's CUDA graph tree manager (its warm-up routes the thread's allocations into
    the graphs' pool: a copy kept then made reduce-overhead refuse to record); a CPU device
    never. The tree manager is faked: the CPU build has no CUDA streams."""
    import sys
    import types

    class Manager:
        stream = "the manager's stream"

    trees = types.ModuleType("torch._inductor.cudagraph_trees")
    trees.get_manager = lambda index, create_if_none_exists=True: Manager()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", trees)
    monkeypatch.setattr(device_memory, "capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current = {"stream": "the user's stream"}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: current["stream"])
    assert not device_memory.pooled(0)
    current["stream"] = Manager.stream  # inside the warm-up
    assert device_memory.pooled(0)
    assert not device_memory.pooled(CPU)
    monkeypatch.setattr(device_memory, "capturing", lambda: True)
    current["stream"] = "the user's stream"
    assert device_memory.pooled(0)
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees")  # never compiled
    monkeypatch.setattr(device_memory, "capturing", lambda: False)
    assert not device_memory.pooled(0)
