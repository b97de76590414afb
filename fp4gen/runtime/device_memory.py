"""Device buffers the runtime keeps across calls (workspaces, constants, counters), made where a
CUDA graph's memory pool cannot claim them.

Why: a buffer kept in a module cache outlives any one call. Made while a CUDA graph is being
captured, or while torch.compile's CUDA graphs warm up (they route every allocation of the
current thread into their pool without capturing), it would land in a graph's private pool:
torch.compile then refuses to record ("tensor in the cudagraph pool not tracked as outputs"),
and a pool whose graphs are gone but which still holds the buffer can never be captured into
again (an internal assert in torch's allocator). A capture routes by stream, the warm-up by
thread, so a buffer made by a thread of our own on a stream of our own lands in the ordinary
pool.

``persistent(make, device)`` runs ``make`` there, outside any capture; while the current stream
is being captured a kept buffer cannot be made at all (the capturing stream could not wait for
its initialisation). ``kept(cache, key, make, device)`` is what the caches use: the cached
buffer, made by ``persistent`` on first use, or during a capture an uncached one that the graph
owns (made in its pool, initialised by the graph on every replay), so no cached buffer ever
outlives its graph.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

_streams: dict[int, torch.cuda.Stream] = {}  # device index -> the stream kept buffers are made on
# the thread kept buffers are made by (one, made on first use)
_maker: list[ThreadPoolExecutor] = []


def capturing() -> bool:
    """Whether the current stream is being captured into a CUDA graph."""
    return torch.cuda.is_current_stream_capturing()


def captures(t: torch.Tensor) -> bool:
    """Whether the work on ``t`` is being captured into a CUDA graph (no device read may run
    there); False for a tensor off CUDA, without asking CUDA."""
    return t.is_cuda and capturing()


def pooled(device: torch.device | int) -> bool:
    """Whether an allocation on ``device`` now would land in a CUDA graph's private pool: a
    capture of the current stream, or torch.compile's CUDA graph warm-up (mode="reduce-overhead"
    runs a graph's first call eagerly on its tree manager's stream, every allocation of the
    thread routed into the graphs' pool; a tensor kept from such a call and not among the
    graph's outputs makes torch.compile refuse to record). Callers keep nothing across calls
    while it holds."""
    if isinstance(device, torch.device) and device.type != "cuda":
        return False
    if not torch.cuda.is_available():
        return False  # no CUDA (tests standing it in on the CPU): no graph's pool
    if capturing():
        return True
    trees = sys.modules.get("torch._inductor.cudagraph_trees")  # not imported: no warm-up
    if trees is None:
        return False
    index = _index(device)
    try:
        manager = trees.get_manager(index, create_if_none_exists=False)
    except Exception:  # noqa: BLE001 (a torch without these internals: no warm-up to see)
        return False
    stream = getattr(manager, "stream", None)
    return stream is not None and stream == torch.cuda.current_stream(index)


def _index(device: torch.device | int) -> int:
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def persistent(make: Callable[[], T], device: torch.device | int) -> T:
    """``make()``, whose tensors are allocated outside every CUDA-graph pool; the current stream
    waits for any work ``make`` issued (fills, copies), and the caching allocator will not reuse
    the memory, once freed, before the current stream's work on it is done. Raises while the
    current stream is being captured (callers check ``capturing()`` first). On a CPU device,
    plainly ``make()``."""
    if isinstance(device, torch.device) and device.type != "cuda":
        return make()
    if capturing():
        raise RuntimeError("a kept device buffer cannot be made during a CUDA graph capture")
    index = _index(device)
    current = torch.cuda.current_stream(index)
    side = _streams.get(index)
    if side is None:
        side = _streams[index] = torch.cuda.Stream(index)
    side.wait_stream(current)  # work that make() issues sees what the current stream wrote

    def make_there() -> T:
        torch.cuda.set_device(index)
        with torch.cuda.stream(side):
            return make()

    if not _maker:
        _maker.append(ThreadPoolExecutor(1, thread_name_prefix="fp4gen-buffers"))
    made = _maker[0].submit(make_there).result()
    current.wait_stream(side)
    for t in made if isinstance(made, tuple) else (made,):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(current)
    return made


def kept(
    cache: dict[Hashable, T],
    key: Hashable,
    make: Callable[[], T],
    device: torch.device | int,
    *,
    limit: int | None = None,
) -> T:
    """``cache[key]``, made by ``make`` outside every graph pool on first use (the oldest entry
    dropped first when ``limit`` entries are kept); while the current stream is being captured,
    a fresh ``make()`` the graph owns, not cached (module docstring)."""
    found = cache.get(key)
    if found is not None:
        return found
    on_cuda = not (isinstance(device, torch.device) and device.type != "cuda")
    if on_cuda and capturing():  # a CPU device has no pools and no captures
        return make()
    if limit is not None and len(cache) >= limit:
        cache.pop(next(iter(cache)))
    made = cache[key] = persistent(make, device) if on_cuda else make()
    return made


__all__ = ["capturing", "kept", "persistent", "pooled"]
