"""The per-call Python of a graphed fp4gen.nn.Linear, on any machine (no GPU needed).

A layer-graphed ``Linear`` forward + backward on CUDA is, per call: the runtime's Python
(``forward_gemm`` / ``backward_gemms``: the operand table, the checks, the graph key), the
layer graphs' bookkeeping (``LayerGraphs.run_with_meta``: key lookups, result addresses), the
result tensors' allocations and one graph replay per pass. This times the Python parts alone:
the layer runs on the CPU with CUDA stood in for (one stream, never capturing, a "graph" that
does nothing when replayed, the result tensors handed back at the same addresses as a training
loop's allocator does), so every call after the first few is an in-place replay, as on a GPU
from the third step on. ``--profile N`` adds a cProfile of the calls by self time. What it
measures is host work only: compare before and after a change on one machine
(docs/training-step.md item 16); ``benchmarks/host_path.py --pieces`` times the real path on a GPU.

    python benchmarks/host_keys.py [--recipe recipes/nvfp4_small.fp4r] [--size 256]
                                   [--calls 20000] [--profile 25]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

import fp4gen  # noqa: E402
from fp4gen.runtime import finite, layer_graphs  # noqa: E402
from fp4gen.runtime import linear as linear_module  # noqa: E402


class _NoGraph:
    """A captured graph's stand-in: replaying it does nothing (its GPU work is not timed)."""

    def replay(self) -> None:
        pass


@contextlib.contextmanager
def stand_ins(graphs: layer_graphs.LayerGraphs) -> Iterator[None]:
    """CUDA stood in for while the block runs (everything put back after): one stream, never
    capturing; captures make a ``_NoGraph`` (running the function once for its meta, as a
    capture does); results at the same addresses per key; every layer's graphs are ``graphs``."""
    made: dict[Any, tuple] = {}

    def fresh(shapes: tuple, device: torch.device) -> tuple:
        if shapes not in made:
            made[shapes] = tuple(
                None if s is None else torch.empty(s[0], dtype=s[1], device=device) for s in shapes
            )
        return made[shapes]

    def capture(fn, activations, params, results, stream, *, in_place, into=False):
        inputs = outputs = None
        if not in_place:  # a graph on static buffers, copied into and out of per call
            inputs = tuple(t.clone() for t in activations)
            outputs = tuple(None if r is None else torch.empty_like(r) for r in results)
        found = layer_graphs._Graph(_NoGraph(), inputs, outputs, ())  # type: ignore[arg-type]
        found.meta = fn(*activations, *params)[1]
        return found

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(layer_graphs, "_current_stream_id", lambda d: 7))
        stack.enter_context(mock.patch.object(layer_graphs, "_capture", capture))
        stack.enter_context(mock.patch.object(layer_graphs, "_fresh", fresh))
        stack.enter_context(
            mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False)
        )
        stack.enter_context(
            mock.patch.object(torch.cuda, "current_stream", lambda device=None: None)
        )
        stack.enter_context(
            mock.patch.object(
                linear_module.Linear,
                "_graphs_for",
                lambda self, t, table, *, forward: graphs,
            )
        )
        yield


def keying(recipe: str, size: int, calls: int, profile: int = 0) -> tuple[float, Any]:
    """(microseconds of Python per forward_gemm + backward_gemms, the layer's LayerGraphs)."""
    layer = fp4gen.nn.Linear(size, size, recipe=fp4gen.load_recipe(recipe))
    x, dy = torch.randn(size, size), torch.randn(size, size)
    graphs = layer_graphs.LayerGraphs("host_keys")

    def step() -> None:
        with finite.propagating():
            _, kept = layer.forward_gemm(
                x, layer.weight, layer.bias, torch.float32, keep_wgrad_input=True
            )
            layer.backward_gemms(dy, x if kept is None else kept, layer.weight)

    with stand_ins(graphs):
        for _ in range(5):  # warm-up, static capture, in-place capture
            step()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        us = (time.perf_counter() - start) / calls * 1e6
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(min(calls, 2000)):
                step()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
    return us, graphs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/nvfp4_small.fp4r")
    parser.add_argument("--size", type=int, default=256, help="tokens = in = out features")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args(argv)
    us, graphs = keying(args.recipe, args.size, args.calls, args.profile)
    print(
        f"{Path(args.recipe).stem}: {us:.2f} us of Python per forward_gemm + backward_gemms "
        f"(layer graphs: {graphs.replays} replays, {graphs.in_place_replays} in place; "
        "allocations and replays stood in for)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
