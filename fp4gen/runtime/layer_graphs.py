"""Per-layer CUDA graphs: a Linear's forward (or backward) GEMMs as one graph launch.

Why: an ``fp4gen.nn.Linear`` forward + backward on CUDA launches about 30 kernels (quantize
passes, decode passes, GEMMs) through Python, and the host spends milliseconds per layer
doing so while the GPU needs a fraction of that (docs/training-step.md). Replaying a captured
graph costs one launch.

What: ``LayerGraphs.run(key, fn, activations, params)`` calls ``fn(*activations, *params)``. The
first call with a key runs it eagerly (a warm-up: kernels are compiled and loaded, cuBLASLt plans
made, outside any capture). Later calls make the result tensors first (``torch.empty``, shaped as
the warm-up's results) and run a captured graph:

* on the activations (the input x, the output gradient dy) and the results where they are, once
  a key has met the same activation and result addresses twice (``_AddressLog``): a training
  loop's caching allocator hands each layer the same addresses step after step, so from the
  third step on its graphs read x and dy and write y, dx and dW with no copy in or out (one graph
  per address set, up to ``MAX_GRAPHS`` per layer and ``MAX_IN_PLACE_CAPTURES`` captures, after
  which addresses that keep changing stop being captured);
* until then, and for addresses that do not repeat, on static buffers: the activations copied
  in, the results copied out into the new tensors (a key's graph on static buffers is dropped
  when its first in-place graph is captured, so a training loop holds no static buffers from
  its third step on);

and the parameters (weight, bias) in place either way: their addresses are part of the key, so
a graph only ever reads the tensor the call was given (an optimizer or FSDP2 all-gather that
writes a parameter in place is seen; a parameter that moved is a new key). A graph that writes
results in place keeps their addresses only, not the tensors: it replays only into tensors this
call has just made at those addresses, so a result the caller still holds is never written.
A replay launches the same kernels with the same arguments as the eager call, so the results are
the same bits (tests/test_layer_graphs_gpu.py); stochastic rounding reads its Philox offset from
the layer's device counter, which the graph advances (``Linear.slot``).

Memory: every layer graph of a device and stream allocates its intermediates from one private
pool, and static buffers are shared by every graph with the same (role, shape, dtype). Sharing is
safe because the graphs of one stream run one after another and nothing a graph computes is
read after its results are copied out; graphs captured for one stream replay only on that
stream. So the graphs add the static buffers and the largest graph's intermediates, not one
copy per layer. A static buffer is freed with the last graph that uses it (graphs beyond
``MAX_GRAPHS`` per layer are dropped least recently used first), so shapes that keep changing
do not pile up, and a pool goes with the last graph captured into it. A deleted layer's
graphs are released with it, so building model after model in one process (a sweep, a
benchmark) does not keep the static buffers and pools of the models before.

When not: the caller decides what may be graphed (``Linear``: CUDA tensors, block formats, the
kernels' backend, no telemetry, non-finite inputs propagated rather than raised, a pass small
enough to gain: ``worth_graphing``, its GEMMs at most ``MAX_GEMM_FLOPS``); here, a call
made while a stream is being captured (an outer graph or torch.compile's cudagraphs records the
eager kernels instead), a key whose capture failed (it runs eagerly from then on, logged once),
and beyond ``MAX_GRAPHS`` keys per layer (shapes that keep changing: the least recently used
graph is dropped). ``FP4GEN_LAYER_GRAPHS=0`` turns layer graphs off (``fp4gen.settings``).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fp4gen.runtime.device_memory import persistent

log = logging.getLogger("fp4gen.runtime")

MAX_GRAPHS = 8  # per layer: keys beyond this evict the least recently used graph
# Graph a layer's pass only while one of its GEMMs has at most this many FLOPs (2 * tokens *
# in * out). A graph that reads and writes in place adds no GPU work (the GEMMs write their
# results into the call's tensors, layers reading one x share its wgrad copy), so graphs pay
# at every size measured: a Llama at 8192 tokens on an H100 (docs/training-step.md), hidden
# 2048 (GEMMs up to 1.9e11) eagerly 1.15x -> 1.11x BF16 with host time 844 -> 136 us per
# Linear, hidden 4096 (up to 7.4e11) 1.06x either way with 782 -> 156 us. Larger passes were
# not measured and stay eager: the limit covers hidden 4096 at 8192 tokens.
MAX_GEMM_FLOPS = 1e12
# (device, stream) -> the private memory pool of its graphs and an empty graph captured into it
# that keeps the pool alive: once every graph of a pool is gone, torch's device and pinned-host
# allocators refuse another capture into it (an internal assert) while any block of it lives on.
_pools: dict[tuple[int, int], tuple[Any, torch.cuda.CUDAGraph]] = {}
_capture_streams: dict[int, torch.cuda.Stream] = {}
_pool_graphs: dict[tuple[int, int], int] = {}  # (device, stream) -> graphs alive in its pool
# (device, stream, role, shape, dtype) -> [buffer, graphs using it]: freed with its last graph
_statics: dict[tuple[Any, ...], list[Any]] = {}
MAX_SEEN = 256  # per layer: keys remembered as warmed up (shapes that keep changing)
# per layer: graphs captured on the activations' own addresses, at most (addresses that recur
# in more sets than MAX_GRAPHS would otherwise be captured again and again, evicting each other)
MAX_IN_PLACE_CAPTURES = 4 * MAX_GRAPHS
_logged: set[str] = set()


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    # static activation and result buffers, copied into and out of per call; None: the graph
    # reads the activations and writes the results in place (at its key's addresses)
    inputs: tuple[torch.Tensor, ...] | None
    outputs: tuple[torch.Tensor | None, ...] | None
    statics: tuple[tuple[Any, ...], ...]  # the keys of its static buffers (released with it)
    meta: Any = None  # what fn returned besides its tensors when captured (run_with_meta)
    key: Hashable = None  # the caller's key (tests, benchmarks)
    used: int = 0  # the layer's call count when it last served a call (evicted: the lowest)
    pool: tuple[int, int] | None = None  # the (device, stream) pool it was captured into

    def release(self) -> None:
        """Drop this graph's claims (once): on its static buffers, a buffer no graph uses
        being freed, and on its pool, whose keeper goes with the pool's last graph (the
        memory the graphs reserved in it is then freed with them)."""
        for key in self.statics:
            entry = _statics.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _statics[key]
        self.statics = ()
        if self.pool is not None:
            left = _pool_graphs.get(self.pool, 0) - 1
            if left > 0:
                _pool_graphs[self.pool] = left
            else:
                _pool_graphs.pop(self.pool, None)
                _pools.pop(self.pool, None)  # the next capture on that stream makes a new one
            self.pool = None


def _release_all(graphs: dict[Hashable, _Graph]) -> None:
    """A layer's graphs released when its LayerGraphs goes (the layer was deleted): their
    static buffers and pools are not kept for layers that no longer exist."""
    for graph in graphs.values():
        graph.release()
    graphs.clear()


def _static(
    role: str,
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    stream: int,
    claims: list[tuple[Any, ...]],
) -> torch.Tensor:
    """The static buffer shared by every graph of this stream for ``role``, ``shape`` and
    ``dtype`` (allocated outside any graph pool); the caller's claim is appended to ``claims``
    and holds the buffer until ``_Graph.release``."""
    key = (device, stream, role, tuple(shape), dtype)
    entry = _statics.get(key)
    if entry is None:
        made = persistent(lambda: torch.empty(shape, dtype=dtype, device=device), device)
        entry = _statics[key] = [made, 0]
    entry[1] += 1
    claims.append(key)
    return entry[0]


Result = tuple[torch.Tensor | None, ...]
MetaFn = Callable[..., tuple[Sequence[torch.Tensor | None], Any]]


class _Key:
    """A layer call's key (the caller's, and the stream) with its hash computed once: a call
    looks it up several times, alone and inside the (key, addresses) pairs, and a tuple's hash
    is computed anew each time."""

    __slots__ = ("hash", "parts")

    def __init__(self, parts: tuple[Hashable, ...]) -> None:
        self.parts = parts
        self.hash = hash(parts)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, _Key) and self.hash == other.hash and self.parts == other.parts
        )


class LayerGraphs:
    """The captured graphs of one layer, by key (module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.graphs: dict[Hashable, _Graph] = {}
        # a deleted layer's graphs give back their static buffers and pools
        weakref.finalize(self, _release_all, self.graphs).atexit = False
        self.calls = 0  # calls made of a graph (replays and captures): the graphs' clock
        # keys run once eagerly (warmed up) -> (that key object, (shape, dtype) of each result
        # or None): later calls use the stored key object, which the graphs' keys hold, so
        # their lookups compare it by identity
        self.seen: dict[_Key, tuple[_Key, tuple[tuple[torch.Size, torch.dtype] | None, ...]]] = {}
        self.failed: dict[Hashable, str] = {}  # keys whose capture failed (why): always eager
        self.addresses = _AddressLog()
        self.in_place_captures = 0
        self.replays = 0  # calls served by a replay of an earlier capture (tests, benchmarks)
        self.graph_calls = 0  # calls served by a graph: those replays, and each capture's first run
        self.in_place_replays = 0  # of those, replays that read the activations in place

    def clear(self) -> None:
        """Release every graph (static buffers and pool claims) and forget the keys seen: the
        layer's passes run elsewhere from now on (a layer group's graph), so its own graphs
        would only hold memory; a later call starts over with a warm-up."""
        _release_all(self.graphs)
        self.seen.clear()
        self.failed.clear()
        self.addresses = _AddressLog()
        self.in_place_captures = 0

    def run(
        self,
        key: Hashable,
        fn: Callable[..., Sequence[torch.Tensor | None]],
        activations: tuple[torch.Tensor, ...],
        params: tuple[Any, ...],
        *,
        into: bool = False,
    ) -> Result:
        """``fn(*activations, *params)``, a tuple of tensors or None, eagerly or from a graph.
        ``fn`` must do all its work on the GPU (its host-side effects happen only when it runs
        eagerly or is captured); ``key`` must name everything else ``fn`` depends on. ``into``:
        ``fn`` also takes ``out=`` (the tensors the results go to, or None), and a result it
        returns as that very tensor needs no copy in the graph."""

        def with_meta(*args: Any, out: Result | None = None) -> tuple[Any, None]:
            return (fn(*args, out=out) if into else fn(*args)), None

        return self.run_with_meta(key, with_meta, activations, params, into=into)[0]

    def run_with_meta(
        self,
        key: Hashable,
        fn: MetaFn,
        activations: tuple[torch.Tensor, ...],
        params: tuple[Any, ...],
        *,
        into: bool = False,
    ) -> tuple[Result, Any]:
        """``run`` for an ``fn`` that returns (tensors, meta): ``meta`` describes the tensors
        (e.g. what a quantized tensor's pieces are) and must follow from ``key`` alone; a replay
        returns the meta of the call that was captured."""
        if torch.cuda.is_current_stream_capturing():
            results, meta = fn(*activations, *params)
            return tuple(results), meta
        device = activations[0].device
        key = _Key((key, _current_stream_id(device)))
        seen = self.seen.get(key)
        if seen is None or key in self.failed:
            results, meta = fn(*activations, *params)
            results = tuple(results)
            if len(self.seen) >= MAX_SEEN:
                self.seen.clear()
            shapes = tuple(None if r is None else (r.shape, r.dtype) for r in results)
            self.seen[key] = (key, shapes)
            return results, meta
        key, shapes = seen
        # the results are made here, before the replay: a graph that met these activation and
        # result addresses before writes the results where they are (no copy in or out)
        results = _fresh(shapes, device)
        where = (key, _addresses(activations), _result_addresses(results))
        found = self.graphs.get(where)
        self.calls += 1
        if found is not None:
            found.used = self.calls
            self.replays += 1
            self.graph_calls += 1
            self.in_place_replays += 1
            found.graph.replay()
            return results, found.meta
        if self.addresses.met(where) and self.in_place_captures < MAX_IN_PLACE_CAPTURES:
            self.in_place_captures += 1
            made = self._capture(
                where, fn, activations, params, results, device, in_place=True, into=into
            )
        else:
            found = self.graphs.get(key)
            if found is not None:
                found.used = self.calls
                self.replays += 1
                self.graph_calls += 1
                _replay_static(found, activations, results)
                return results, found.meta
            made = self._capture(
                key, fn, activations, params, results, device, in_place=False, into=into
            )
        if made is None:  # the capture failed (logged): this key runs eagerly from now on
            results, meta = fn(*activations, *params)
            return tuple(results), meta
        if made.inputs is None:
            # the key's graph on static copies has served its one call (the one between the
            # warm-up and the in-place capture, in a training loop): its static buffers go
            # (captured again should other addresses come)
            static = self.graphs.pop(key, None)
            if static is not None:
                static.release()
        return results, made.meta

    def _capture(
        self,
        key: Hashable,
        fn: MetaFn,
        activations: tuple[torch.Tensor, ...],
        params: tuple[Any, ...],
        results: Result,
        device: torch.device,
        *,
        in_place: bool,
        into: bool,
    ) -> _Graph | None:
        """Capture a graph for ``key`` and replay it once into ``results`` (the capture itself
        runs nothing): the graph, or None when the capture failed (the key then always runs
        eagerly): ``in_place``, a graph on the activations and results where they are (``key``
        names their addresses); else one on static buffers."""
        stream = torch.cuda.current_stream(device)
        base = key[0] if in_place else key  # (the caller's key, stream)
        try:
            found = _capture(fn, activations, params, results, stream, in_place=in_place, into=into)
        except Exception as err:  # e.g. an operation a capture cannot take: stay eager
            why = f"{type(err).__name__}: {err}"
            self.failed[base] = why
            message = f"{self.name or 'fp4gen.nn.Linear'}: no layer graph, runs eagerly ({why})"
            if message not in _logged:
                _logged.add(message)
                log.warning("%s", message)
            return None
        found.key = base.parts[0]
        found.used = self.calls
        if len(self.graphs) >= MAX_GRAPHS:  # drop the least recently used
            oldest = min(self.graphs, key=lambda k: self.graphs[k].used)
            self.graphs.pop(oldest).release()
        self.graphs[key] = found
        self.graph_calls += 1
        if in_place:
            found.graph.replay()
        else:
            _replay_static(found, activations, results)
        return found


def worth_graphing(tokens: int, in_features: int, out_features: int) -> bool:
    """Whether a pass of a [tokens, in] x [in, out] layer is small enough to gain from a graph
    (``MAX_GEMM_FLOPS``)."""
    return 2 * tokens * in_features * out_features <= MAX_GEMM_FLOPS


def _current_stream_id(device: torch.device) -> int:
    """The current stream's handle on ``device``, as ``Stream.cuda_stream`` gives it, without
    making a Stream object (this runs twice per layer and step)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)


class _AddressLog:
    """The (key, activation addresses) pairs a layer met lately, the newest ``2 * MAX_GRAPHS``
    kept: ``met`` says whether a pair was met before, the cue to capture a graph that reads the
    activations in place."""

    def __init__(self) -> None:
        self.recent: OrderedDict[Hashable, None] = OrderedDict()

    def met(self, where: Hashable) -> bool:
        if where in self.recent:
            self.recent.move_to_end(where)
            return True
        self.recent[where] = None
        if len(self.recent) > 2 * MAX_GRAPHS:
            self.recent.popitem(last=False)
        return False


def _addresses(tensors: tuple[torch.Tensor | None, ...]) -> tuple[tuple[Any, ...] | None, ...]:
    """Where a graph that reads (or writes) ``tensors`` in place finds them: address and
    strides (the key names shapes and dtypes)."""
    return tuple([None if t is None else (t.data_ptr(), t.stride()) for t in tensors])


def _result_addresses(results: Result) -> tuple[int | None, ...]:
    """Where a graph that writes ``results`` in place finds them: their addresses only, as
    ``_fresh`` makes them contiguous in the key's shapes (so their strides follow)."""
    return tuple([None if t is None else t.data_ptr() for t in results])


def _fresh(
    shapes: tuple[tuple[torch.Size, torch.dtype] | None, ...], device: torch.device
) -> Result:
    """New tensors for a call's results, of the shapes and dtypes its warm-up call gave."""
    return tuple(
        None if s is None else torch.empty(s[0], dtype=s[1], device=device) for s in shapes
    )


def _replay_static(found: _Graph, activations: tuple[torch.Tensor, ...], results: Result) -> None:
    """Replay a graph on static buffers: the activations copied in, the results copied out."""
    assert found.inputs is not None and found.outputs is not None
    for static, t in zip(found.inputs, activations, strict=True):
        static.copy_(t)
    found.graph.replay()
    for t, static in zip(results, found.outputs, strict=True):
        if t is not None:
            t.copy_(static)


def _capture(
    fn: MetaFn,
    activations: tuple[torch.Tensor, ...],
    params: tuple[Any, ...],
    results: Result,
    stream: torch.cuda.Stream,
    *,
    in_place: bool,
    into: bool = False,
) -> _Graph:
    """Capture ``fn`` into a new graph: on ``activations`` where they are, its results written
    into ``results`` (``in_place``: the graph keeps their addresses, not the tensors), or on
    static copies of the activations with results in static buffers shaped as ``results``.
    ``into``: ``fn`` takes those result tensors as ``out=`` (``LayerGraphs.run``)."""
    device = activations[0].device
    index = device.index if device.index is not None else torch.cuda.current_device()
    sid = stream.cuda_stream
    # every static buffer is made before the capture: outside the pool, shared by shape
    claims: list[tuple[Any, ...]] = []
    inputs = outputs = None
    if not in_place:
        inputs = tuple(
            _static(f"in{i}", t.shape, t.dtype, device, sid, claims)
            for i, t in enumerate(activations)
        )
        outputs = tuple(
            None if r is None else _static(f"out{i}", r.shape, r.dtype, device, sid, claims)
            for i, r in enumerate(results)
        )
    made = _Graph(torch.cuda.CUDAGraph(), inputs, outputs, tuple(claims))
    try:
        targets = results if in_place else outputs
        _record(made, fn, activations, params, targets, stream, index, into)
    except BaseException:
        made.release()
        _reset_capture_state(index, sid)
        raise
    made.pool = (index, sid)
    _pool_graphs[made.pool] = _pool_graphs.get(made.pool, 0) + 1
    return made


def _reset_capture_state(index: int, sid: int) -> None:
    """After a failed capture, leave torch as a capture that ended would have:

    * torch's capture_end can raise before it stops routing allocations to the graph's pool,
      and a pool left in that state fails every later capture into it: stop the routing (best
      effort: where the capture did end, there is nothing to stop) and give later captures a
      fresh pool and side stream (graphs captured before keep theirs);
    * a capture that fails after it began leaves the device's default CUDA generator in capture
      mode, and every later random draw outside a capture raises ("Offset increment outside
      graph capture"): a user's dropout would fail steps later. An empty capture on a fresh
      stream takes it through capture and back out."""
    pool = _pools.pop((index, sid), None)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if pool is not None and end is not None:
        with contextlib.suppress(RuntimeError):  # the routing had ended with the capture
            end(index, pool[0])
    _capture_streams.pop(index, None)
    _empty_graph(torch.cuda.Stream(index), None)


def _empty_graph(stream: torch.cuda.Stream, pool: Any) -> torch.cuda.CUDAGraph:
    """A graph captured on ``stream`` (into ``pool``; None: a new one) with nothing in it."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the CUDA graph is empty": it is meant to be
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        graph.capture_end()
    return graph


def _record(
    made: _Graph,
    fn: MetaFn,
    activations: tuple[torch.Tensor, ...],
    params: tuple[Any, ...],
    targets: Result,
    stream: torch.cuda.Stream,
    index: int,
    into: bool = False,
) -> None:
    """Capture ``fn`` on ``made``'s static inputs (or on ``activations`` for a graph that reads
    them in place) into ``made.graph``, its results copied into ``targets`` (static buffers, or
    the call's own result tensors); with ``into``, ``fn`` is given ``out=targets``, and a
    result it wrote there itself (returned as the target tensor) is not copied."""
    graph = made.graph
    sid = stream.cuda_stream
    inputs = activations
    if made.inputs is not None:
        inputs = made.inputs
        for static, t in zip(inputs, activations, strict=True):
            static.copy_(t)
    side = _capture_streams.get(index)
    if side is None:
        side = _capture_streams[index] = torch.cuda.Stream(index)
    found = _pools.get((index, sid))
    if found is None:
        pool = torch.cuda.graph_pool_handle()
        found = _pools[(index, sid)] = (pool, _empty_graph(side, pool))
    pool = found[0]
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            if into:
                found_results, made.meta = fn(*inputs, *params, out=targets)
            else:
                found_results, made.meta = fn(*inputs, *params)
            computed = tuple(found_results)
            if len(computed) != len(targets):
                raise RuntimeError("the results changed in number since the warm-up call")
            for target, r in zip(targets, computed, strict=True):
                if target is not None and r is not target:
                    target.copy_(r)  # a shape or dtype that changed raises here
        finally:
            graph.capture_end()
    stream.wait_stream(side)


__all__ = ["MAX_GEMM_FLOPS", "MAX_GRAPHS", "MAX_IN_PLACE_CAPTURES", "LayerGraphs", "worth_graphing"]
