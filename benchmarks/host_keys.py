"""The per-call Python of a graphed fp4gen.nn.Linear and of a small-M fp4gen.gemm, on any
machine (no GPU needed).

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

It then times three layers that read one x (a Llama's q, k and v) as a training step calls them:
module calls and autograd's backward included, one layer at a time and as one layer group
(``fp4gen.runtime.layer_groups``), per Linear forward + backward.

It then times ``fp4gen.gemm(a, b)`` at M = 16 on the small-M fused path, a new activation per
call and one weight, with the kernel launch, the CUDA device and the output allocation stood in
for: the full path (dispatch, plan lookups, checks) and a prepared call (docs/gemm-sm90.md,
"Prepared calls").

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
        # warm-up, static capture, in-place capture
        us = _timed_steps(step, warm=5, calls=calls, profile=profile) * 1e6
    return us, graphs


def _timed_steps(step: Any, warm: int, calls: int, profile: int) -> float:
    """Seconds per ``step()`` over ``calls`` calls after ``warm`` untimed ones; ``profile``:
    then print a cProfile of up to 2000 more by self time (its top ``profile`` entries)."""
    for _ in range(warm):
        step()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    seconds = (time.perf_counter() - start) / calls
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(min(calls, 2000)):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
    return seconds


def siblings(
    recipe: str, size: int, calls: int, grouped: bool, profile: int = 0
) -> tuple[float, Any]:
    """(microseconds of host time per Linear forward + backward, the group or None) for three
    layers that read one x (a Llama's q, k and v), called as modules and differentiated by
    autograd: everything a training step does per layer (the modules' calls, the autograd
    nodes, the passes' Python), as layer groups run them (``grouped``) or one layer at a time
    (``FP4GEN_LAYER_GROUPS=0``)."""
    from fp4gen.runtime import layer_groups

    torch.manual_seed(0)
    layers = [
        fp4gen.nn.Linear(size, size, recipe=fp4gen.load_recipe(recipe), name=n) for n in "qkv"
    ]
    base = torch.randn(size, size, requires_grad=True)
    dys = [torch.randn(size, size) for _ in layers]
    graphs = layer_graphs.LayerGraphs("host_keys")

    def step() -> None:
        x = base * 1.0  # a fresh x per step, as a norm's output is
        ys = [layer(x) for layer in layers]
        torch.autograd.backward(ys, dys)

    setting = "1" if grouped else "0"
    with contextlib.ExitStack() as stack:
        stack.enter_context(stand_ins(graphs))
        stack.enter_context(mock.patch.dict("os.environ", {"FP4GEN_LAYER_GROUPS": setting}))
        stack.enter_context(
            mock.patch.object(linear_module.Linear, "_graphable", lambda *a, **k: True)
        )
        # each call's results are tensors of its own (the three layers' outputs are alive at
        # once), and every call is met at the addresses of its key (an in-place replay)
        stack.enter_context(mock.patch.object(layer_graphs, "_fresh", _fresh_tensors))
        stack.enter_context(mock.patch.object(layer_graphs, "_addresses", _no_addresses))
        stack.enter_context(mock.patch.object(layer_graphs, "_result_addresses", _no_addresses))
        # sightings, then the group's warm-up and captures
        us = _timed_steps(step, warm=8, calls=calls, profile=profile) / len(layers) * 1e6
        group = layer_groups.group_of(layers[0])
        if group is not None:
            group.dissolve()  # the next measure starts from ungrouped layers
    base.grad = None
    return us, group


def _fresh_tensors(shapes: tuple, device: torch.device) -> tuple:
    return tuple(None if s is None else torch.empty(s[0], dtype=s[1]) for s in shapes)


def _no_addresses(tensors: tuple) -> tuple:
    return ()


class _FakeGemmModule:
    """A small-M GEMM module's stand-in: the constants ``fused_gemm`` reads, no kernel."""

    TILE_ELEMS = 1024
    K_MULTIPLE = 64

    @staticmethod
    def tiles(m: int, n: int) -> int:
        return 128


class _Launches:
    """A compiled kernel's stand-in: counts its launches."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, *args: Any) -> None:
        self.count += 1


@contextlib.contextmanager
def gemm_stand_ins(plan_key: tuple, launches: _Launches) -> Iterator[None]:
    """CUDA stood in for under ``fp4gen.gemm``'s small-M path while the block runs (everything
    put back after): the operands report device cuda:0 (sm_90a) but their tensors stay on the
    CPU, the plan of ``plan_key`` holds a kernel that only counts its launches, the split-K
    workspace is a CPU tensor pair on one stream, never capturing, and the output a CPU
    allocation."""
    from fp4gen.compiler import jit
    from fp4gen.runtime import cute_gemm

    cpu = torch.device("cpu")
    workspace = (torch.zeros(4), torch.zeros(4, dtype=torch.int32))
    plan = cute_gemm._Plan(
        spec=None,  # type: ignore[arg-type]
        module=_FakeGemmModule,  # type: ignore[arg-type]
        fn=launches,
        small=True,
        expand=1,
        out_dtype=torch.bfloat16,
        b_sf_rows=lambda rows: -(-rows // 16),
        k_multiple=_FakeGemmModule.K_MULTIPLE,
    )
    real_empty = torch.empty

    def empty(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return real_empty(*args, **kwargs)  # the output on the CPU, whatever device is asked

    def global_view(g: torch.Tensor, dev: torch.device) -> torch.Tensor:
        if g.dtype != torch.float32 or (g.device != dev and g.device.type == "cuda"):
            raise AssertionError("the stand-in's global scales are fp32 CPU tensors")
        return g.view(1)  # what ``_global`` does for an fp32 scale on the operands' device

    with contextlib.ExitStack() as torch_view:
        torch_view.enter_context(mock.patch.dict(jit._archs, {0: "sm_90a"}))
        torch_view.enter_context(mock.patch.dict(cute_gemm._plans, {plan_key: plan}))
        torch_view.enter_context(mock.patch.dict(cute_gemm._sms, {0: 132, None: 132}))
        torch_view.enter_context(
            mock.patch.object(cute_gemm, "one_cuda_device", lambda a, b, what: cpu)
        )
        torch_view.enter_context(
            mock.patch.object(cute_gemm, "_workspace", lambda *args: workspace)
        )
        torch_view.enter_context(mock.patch.object(cute_gemm, "_global", global_view))
        torch_view.enter_context(mock.patch.object(cute_gemm, "_current_stream", lambda dev: 0))
        torch_view.enter_context(mock.patch.object(cute_gemm, "capturing", lambda: False))
        # torch.empty itself while the block runs (the output is made through it)
        torch_view.enter_context(mock.patch.object(torch, "empty", empty))
        yield


def gemm_call(m: int, n: int, k: int, calls: int, prepared: bool = True) -> tuple[float, int]:
    """(microseconds of host path per ``fp4gen.gemm(a, b)`` call at M = ``m`` on the small-M
    fused path, a new NVFP4 activation A per call and one 16x16 weight B; the launches made).
    ``prepared=False`` times the full path (dispatch, plan lookups, checks) on every call."""
    from fp4gen import gemm_dispatch
    from fp4gen.codegen.gemm import pick_tile
    from fp4gen.numerics import quantize

    gen = torch.Generator().manual_seed(0)
    b = quantize(torch.randn(n, k, generator=gen), "nvfp4", block=(16, 16))
    acts = [quantize(torch.randn(m, k, generator=gen), "nvfp4") for _ in range(4)]
    cuda0 = torch.device("cuda", 0)
    for q in (b, *acts):
        q.__dict__["device"] = cuda0  # QuantizedTensor.device is a cached property
    key = (acts[0].format, b.format, pick_tile(m), True, False, False, "sm_90a")
    launches = _Launches()
    with contextlib.ExitStack() as stack:
        stack.enter_context(gemm_stand_ins(key, launches))
        if not prepared:  # prepared calls neither kept nor found
            stack.enter_context(mock.patch.object(gemm_dispatch, "_prepared", _Forgetful()))
        for i in range(8):  # the first calls meet B (and prepare)
            fp4gen.gemm(acts[i % 4], b, out_dtype=torch.bfloat16)
        start = time.perf_counter()
        for i in range(calls):
            fp4gen.gemm(acts[i % 4], b, out_dtype=torch.bfloat16)
        us = (time.perf_counter() - start) / calls * 1e6
        gemm_dispatch._prepared.pop(b, None)
    return us, launches.count


class _Forgetful(dict):
    """A registry of prepared calls that keeps none."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


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
    for grouped in (False, True):
        us, group = siblings(args.recipe, args.size, args.calls // 4, grouped)
        how = f"one layer group ({group.runs} group runs)" if group else "each layer alone"
        print(
            f"{Path(args.recipe).stem}: {us:.2f} us of host time per Linear forward + backward "
            f"for q, k and v reading one x, {how} (module calls and autograd included; "
            "allocations and replays stood in for)"
        )
    for prepared in (False, True):
        us, _ = gemm_call(16, 8192, 8192, args.calls, prepared)
        how = "a prepared call" if prepared else "the full path on every call"
        print(
            f"fp4gen.gemm M=16 N=K=8192 nvfp4: {us:.2f} us of host path per call ({how}; the "
            "launch stood in for, the output a CPU allocation)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
