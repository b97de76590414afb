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

Then the FP8 block-scaled GEMM: ``fp4gen.gemm(a, b)`` on fp8_blockwise's fprop pair (e4m3, A
1x128, B 128x128, fp32 scales) on each route ``backend="auto"`` takes on sm_90a, the
block-scaled ``scaled_mm`` (cuBLASLt) and the generated FP8 kernel, with one weight (its
operands kept per version) and with a new weight per call (a training step quantizes it anew),
a new activation per call either way; the calls after the first are prepared calls. The GEMM
is stood in for (counted, not run). Each line gives the microseconds of host path per call on
this CPU and the aten ops a call issues, counted with a TorchDispatchMode: views, allocations
and the ops that would launch GPU work. The op count is the figure that carries over to a GPU
host, where every launching op costs some 5-10 us and every op a trip through torch's
dispatcher; the microseconds compare before and after a change on one machine
(docs/gemm-sm90.md, "Host time of the FP8 GEMM").
``benchmarks/gemm.py --formats fp8_blockwise`` times the real calls on an H200.

    python benchmarks/host_keys.py [--recipe recipes/nvfp4_small.fp4r] [--size 256]
                                   [--calls 20000] [--profile 25]
                                   [--fp8-only] [--fp8-shape 256x256x512]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import pstats
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
    capture does); results at the same addresses per key; every layer's graphs are ``graphs``.
    Results and static outputs are zeros: no replay writes them, and values left in new memory
    would flow into the next layer's reference numerics (an overflow there raised at random)."""
    made: dict[Any, tuple] = {}

    def fresh(shapes: tuple, device: torch.device) -> tuple:
        if shapes not in made:
            made[shapes] = tuple(
                None if s is None else torch.zeros(s[0], dtype=s[1], device=device) for s in shapes
            )
        return made[shapes]

    def capture(fn, activations, params, results, stream, *, in_place, into=False):
        inputs = outputs = None
        if not in_place:  # a graph on static buffers, copied into and out of per call
            inputs = tuple(t.clone() for t in activations)
            outputs = tuple(None if r is None else torch.zeros_like(r) for r in results)
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
    # zeros, not new memory's leftovers: no replay writes them and they feed the next layer
    return tuple(None if s is None else torch.zeros(s[0], dtype=s[1]) for s in shapes)


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


# ----------------------------------------------------------------------------------------------
# The FP8 block-scaled GEMM (fp8_blockwise): scaled_mm and the generated kernel
# ----------------------------------------------------------------------------------------------
FP8_ROUTES = ("scaled_mm", "generated")
FP8_FOUND = """\
The FP8 GEMM's host path, found with this measure (fp8_blockwise fprop pair, 256x256x512, a new
activation per call; microseconds on a workstation core, aten ops per call, of which launching
GPU work, besides the GEMM; details in docs/gemm-sm90.md, "Host time of the FP8 GEMM"):

  route, weight                       before              after (prepared calls)
  scaled_mm, one weight               21.2 us, 7 ops, 1   10.6 us, 4 ops, 1
  scaled_mm, a new weight per call    31.0 us, 14 ops, 2  17.8 us, 10 ops, 2
  generated kernel, one weight        15.5 us, 3 ops, 0   5 ops, 1 (coalesced variant)
  generated kernel, new weight        17.8 us, 3 ops, 0   6 ops, 1 (coalesced variant)

The generated rows' after column is the coalesced variant, the default since it was measured
faster on the GPU (docs/gemm-sm90.md, "Switched on since"): A's scales go MN-major per call (a
buffer, a transposed view, one copy) until the quantize kernels write that layout; the
row-major variant's prepared calls took 8.6 / 10.9 us with 2 / 3 ops, none launching.

On a GPU host each launching op costs some 5-10 us and every op a trip through torch's
dispatcher: the op counts carry over, the microseconds do not. What is left with a new weight per
call: scaled_mm's two scale passes (A's scales M-major, B's tile scales, each with its S_dec
folded in: scaled_mm takes no alpha), and torch's own scaled_mm host time.
"""
# aten ops that launch nothing on a GPU: views and metadata (host time only) ...
VIEW_OPS = frozenset(
    {
        "aten.alias.default",
        "aten.as_strided.default",
        "aten.detach.default",
        "aten.expand.default",
        "aten.reshape.default",
        "aten._reshape_alias.default",
        "aten.select.int",
        "aten.slice.Tensor",
        "aten.split.Tensor",
        "aten.split_with_sizes.default",
        "aten.t.default",
        "aten.transpose.int",
        "aten.unbind.int",
        "aten.unsqueeze.default",
        "aten.view.default",
        "aten.view.dtype",
    }
)
# ... and allocations (the caching allocator: host time, no launch)
ALLOC_OPS = frozenset(
    {"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default"}
)


class OpCount(TorchDispatchMode):
    """The aten ops run while it is active, by name (on a GPU every op that is neither a view
    nor an allocation is a kernel launch, some 5-10 us of host time each)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    @property
    def launching(self) -> list[str]:
        """The ops that would launch GPU work (neither views nor allocations)."""
        return [op for op in self.ops if op not in VIEW_OPS and op not in ALLOC_OPS]


class _ScaledMm:
    """``torch.nn.functional.scaled_mm``'s stand-in: counts its calls and returns an output of
    the shape and dtype the real one makes (one tensor per shape, made on its first call, so
    that a counted call allocates nothing here: the real call's output is cuBLASLt's own)."""

    def __init__(self) -> None:
        self.count = 0
        self.outputs: dict[tuple, torch.Tensor] = {}

    def __call__(self, mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kwargs: Any):
        self.count += 1
        key = (mat_a.shape[0], mat_b.shape[1], kwargs["output_dtype"])
        out = self.outputs.get(key)
        if out is None:
            out = self.outputs[key] = torch.zeros(key[:2], dtype=key[2])
        return out


@contextlib.contextmanager
def fp8_stand_ins(route: str, scaled_mm: _ScaledMm, launches: _Launches) -> Iterator[None]:
    """CUDA stood in for under ``fp4gen.gemm``'s FP8 paths while the block runs (everything put
    back after): the operands report device cuda:0 (sm_90a) but their tensors stay on the CPU,
    this torch build has the block-scaled scaled_mm, ``scaled_mm`` is ``scaled_mm`` and every
    generated FP8 kernel ``launches`` (132 SMs); ``route="generated"``: ``backend="auto"``
    takes the generated kernel for fp8_blockwise's pairs (the measured table filled from
    M = 1), else scaled_mm."""
    from fp4gen import gemm_dispatch
    from fp4gen.compiler import jit
    from fp4gen.runtime import fp8_gemm

    if route not in FP8_ROUTES:
        raise ValueError(f"route must be one of {FP8_ROUTES}, got {route!r}")
    cpu = torch.device("cpu")
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(jit._archs, {0: "sm_90a"}))
        # the choices and prepared calls made here go when the block ends
        stack.enter_context(mock.patch.dict(gemm_dispatch._choices))
        stack.enter_context(mock.patch.dict(gemm_dispatch._prepared_fp8, clear=True))
        # prepared FP8 calls are off by default until their GPU test passes: measured on here
        stack.enter_context(mock.patch.object(gemm_dispatch, "_fp8_prepared_on", [True]))
        stack.enter_context(mock.patch.object(fp8_gemm, "one_cuda_device", lambda a, b, what: cpu))
        stack.enter_context(mock.patch.object(fp8_gemm, "torch_reason", lambda: None))
        stack.enter_context(mock.patch.object(fp8_gemm.F, "scaled_mm", scaled_mm, create=True))
        stack.enter_context(
            mock.patch.object(fp8_gemm, "cute_kernel", lambda params, cache=None: launches)
        )
        stack.enter_context(mock.patch.object(fp8_gemm, "sm_count", lambda dev, cluster=1: 132))
        table = {}
        if route == "generated":
            from fp4gen.codegen.gemm_fp8 import pair_name

            fa, fb = fp8_blockwise_formats()
            table = {pair_name(fa, fb): 1, pair_name(fa, fa): 1}  # fprop / dgrad, wgrad
        stack.enter_context(mock.patch.dict(fp8_gemm.CUTE_AUTO_MIN_M, table, clear=True))
        yield


def fp8_blockwise_formats() -> tuple[Any, Any]:
    """(A's format, B's format) of fp8_blockwise's fprop GEMM: e4m3 1x128 x e4m3 128x128, fp32
    block scales."""
    from fp4gen.dsl.model import Operand

    recipe = fp4gen.load_recipe("fp8_blockwise")
    return (
        recipe.operands[Operand.FPROP_ACTIVATION].format,
        recipe.operands[Operand.FPROP_WEIGHT].format,
    )


class Fp8Measure(NamedTuple):
    """One FP8 route's host path per ``fp4gen.gemm`` call."""

    us: float  # microseconds of host path per call (this machine's CPU)
    ops: int  # aten ops a call issues (views and allocations included)
    launching: int  # of which would launch GPU work (the GEMM itself not counted)
    gemms: int  # stood-in GEMM launches (scaled_mm or the generated kernel) per call
    names: tuple[str, ...]  # the ops of one call, in order


def fp8_gemm_call(
    route: str,
    m: int,
    n: int,
    k: int,
    calls: int,
    *,
    fresh_weight: bool = False,
    profile: int = 0,
) -> Fp8Measure:
    """``fp4gen.gemm(a, b, out_dtype=bf16)`` on the fp8_blockwise fprop pair (A [m, k] 1x128,
    B [n, k] 128x128) on ``route`` ("scaled_mm": the block-scaled ``scaled_mm``, what
    ``backend="auto"`` takes on sm_90a; "generated": the generated FP8 kernel, as auto takes it
    where its measured table says so), a new activation A per call (a new QuantizedTensor, as a
    layer's quantize makes one per call) and one weight B, or a new B per call too with
    ``fresh_weight`` (a training step quantizes its weight anew). The GEMM is stood in for
    (counted, not run); the host path per call timed, and one call's aten ops counted (after
    8 calls: the calls are prepared ones, ``gemm_dispatch._prepared_fp8``).
    ``profile``: then a cProfile of up to 2000 more calls by self time (its top entries)."""
    from fp4gen.numerics import quantize

    fa, fb = fp8_blockwise_formats()
    gen = torch.Generator().manual_seed(0)
    b = quantize(torch.randn(n, k, generator=gen), fb)
    acts = [quantize(torch.randn(m, k, generator=gen), fa) for _ in range(4)]
    cuda0 = torch.device("cuda", 0)

    def fresh(q: Any) -> Any:  # a new QuantizedTensor of the same tensors, on "cuda:0"
        q = dataclasses.replace(q)
        q.__dict__["device"] = cuda0  # QuantizedTensor.device is a cached property
        return q

    b = fresh(b)
    scaled_mm, launches = _ScaledMm(), _Launches()
    seconds = 0.0
    with fp8_stand_ins(route, scaled_mm, launches):
        for i in range(8):  # the first calls meet B (and prepare)
            a, weight = fresh(acts[i % 4]), fresh(b) if fresh_weight else b
            fp4gen.gemm(a, weight, out_dtype=torch.bfloat16)
        a, weight = fresh(acts[0]), fresh(b) if fresh_weight else b
        before = scaled_mm.count + launches.count
        with OpCount() as counted:
            fp4gen.gemm(a, weight, out_dtype=torch.bfloat16)
        gemms = scaled_mm.count + launches.count - before
        for i in range(calls):
            a, weight = fresh(acts[i % 4]), fresh(b) if fresh_weight else b
            start = time.perf_counter()
            fp4gen.gemm(a, weight, out_dtype=torch.bfloat16)
            seconds += time.perf_counter() - start
        if profile:
            prof = cProfile.Profile()
            for i in range(min(calls, 2000)):
                a, weight = fresh(acts[i % 4]), fresh(b) if fresh_weight else b
                prof.enable()
                fp4gen.gemm(a, weight, out_dtype=torch.bfloat16)
                prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
    return Fp8Measure(
        seconds / calls * 1e6,
        len(counted.ops),
        len(counted.launching),
        gemms,
        tuple(counted.ops),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=FP8_FOUND, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="recipes/nvfp4_small.fp4r")
    parser.add_argument("--size", type=int, default=256, help="tokens = in = out features")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument(
        "--fp8-only", action="store_true", help="only the FP8 GEMM's routes (fp8_blockwise)"
    )
    parser.add_argument(
        "--fp8-shape",
        default="256x256x512",
        metavar="MxNxK",
        help="the FP8 GEMM's shape (small: the stood-in ops run on this CPU)",
    )
    args = parser.parse_args(argv)
    if not args.fp8_only:
        nvfp4_lines(args)
    m, n, k = (int(v) for v in args.fp8_shape.lower().split("x"))
    for route in FP8_ROUTES:
        for fresh_weight in (False, True):
            got = fp8_gemm_call(
                route, m, n, k, args.calls // 4, fresh_weight=fresh_weight, profile=args.profile
            )
            weight = "a new weight per call" if fresh_weight else "one weight"
            print(
                f"fp4gen.gemm {m}x{n}x{k} fp8_blockwise, {route} ({weight}): {got.us:.2f} us of "
                f"host path per call; {got.ops} aten ops per call, {got.launching} of them "
                f"launching GPU work, besides the GEMM ({got.gemms} stood-in launch): "
                + ", ".join(got.names)
            )
    return 0


def nvfp4_lines(args: argparse.Namespace) -> None:
    """The layer-graphed Linear, the q/k/v siblings and the NVFP4 small-M GEMM lines."""
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


if __name__ == "__main__":
    raise SystemExit(main())
