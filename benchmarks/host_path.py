"""Host time of fp4gen's per-call path, piece by piece, against plain torch calls.

Small shapes (the GPU finishes each kernel before the host queues the next), so the wall time
per call is the host's: a torch allocation, an elementwise op, nn.Linear forward + backward in
BF16, and fp4gen's quantize, GEMM and Linear forward + backward. ``--profile N`` adds a cProfile
of the Linear forward + backward loop sorted by self time (where the host time is spent, not
what it is spent under); ``--torch-profile N`` the N ops with the most host and GPU time
(torch.profiler, C++ included); ``--pieces`` the wall time of the runtime's per-call pieces
(autograd wrappers, forward_gemm / backward_gemms, the layer-graph replay), each wrapped in a
timer; ``--gc`` runs the timings with Python's garbage collector frozen or off.

    python benchmarks/host_path.py [--recipe recipes/nvfp4_small.fp4r] [--size 256]
                                   [--calls 300] [--profile 40] [--torch-profile 30]
                                   [--pieces] [--gc on|freeze|off]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

import fp4gen  # noqa: E402
from fp4gen.dsl.model import Operand  # noqa: E402


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Wall microseconds per call, the GPU idle before and drained after."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def piece_times(step: Callable[[], object], calls: int) -> list[tuple[str, float]]:
    """Wall microseconds per ``step`` spent in each of the runtime's per-call pieces, each
    wrapped in a timer for the duration (nested pieces are counted in their callers too)."""
    from fp4gen.runtime import layer_graphs, linear, ops

    pieces = [
        (linear.Linear, "forward", "Linear.forward (autograd wrapper)"),
        (ops._EagerLinear, "backward", "_EagerLinear.backward"),
        (linear.Linear, "forward_gemm", "Linear.forward_gemm"),
        (linear.Linear, "backward_gemms", "Linear.backward_gemms"),
        (layer_graphs.LayerGraphs, "run_with_meta", "LayerGraphs.run_with_meta"),
        (layer_graphs, "_fresh", "layer_graphs._fresh (result tensors)"),
        (layer_graphs, "_replay_static", "layer_graphs._replay_static"),
        (torch.cuda.CUDAGraph, "replay", "CUDAGraph.replay"),
    ]
    spent = {label: 0 for _, _, label in pieces}
    saved = []
    for owner, name, label in pieces:
        original = owner.__dict__[name]
        saved.append((owner, name, original))
        fn = original.__func__ if isinstance(original, staticmethod) else original

        def timed(*args, _fn=fn, _label=label, **kwargs):
            start = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_label] += time.perf_counter_ns() - start

        setattr(owner, name, staticmethod(timed) if isinstance(original, staticmethod) else timed)
    try:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        spent.update((label, 0) for label in spent)  # the warm-up calls do not count
        start = time.perf_counter_ns()
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        total = time.perf_counter_ns() - start
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    return [(label, ns / 1e3 / calls) for label, ns in (("whole fwd+bwd", total), *spent.items())]


class _gc_timer:  # noqa: N801 (a callback holder)
    """Counts Python's garbage collections by generation and the time they take."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._start

    def summary(self) -> str:
        return f"{self.count} by generation, {self.seconds * 1e3:.1f} ms in all"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/nvfp4_small.fp4r")
    parser.add_argument("--size", type=int, default=256, help="tokens = in = out features")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument(
        "--pieces",
        action="store_true",
        help="also time the pieces of the Linear fwd+bwd (each wrapped in a wall-clock timer)",
    )
    parser.add_argument(
        "--torch-profile",
        type=int,
        default=0,
        metavar="N",
        help="also list the N ops (C++ included) with the most host time in the Linear loop",
    )
    parser.add_argument(
        "--gc",
        choices=["on", "freeze", "off"],
        default="on",
        help="Python's garbage collector while timing: as it is, gc.freeze() after setup (the "
        "objects alive then are never scanned again), or disabled",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    n = args.size
    recipe = fp4gen.load_recipe(args.recipe)
    table = recipe.operands
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    plain = torch.nn.Linear(n, n, device="cuda", dtype=torch.bfloat16)
    layer = fp4gen.nn.Linear(n, n, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    xd = x.detach()
    spec = table.fprop_activation
    xq = layer.quantize(xd, Operand.FPROP_ACTIVATION, spec, 0)
    wq = layer.quantize(layer.weight.detach(), Operand.FPROP_WEIGHT, table.fprop_weight, 0)

    def plain_step() -> None:
        plain(x).backward(dy)

    def fp4gen_step() -> None:
        layer(x).backward(dy)

    @torch.library.custom_op("fp4gen_bench::copy", mutates_args=())
    def copy_op(t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    # the pieces of one quantize call (fp4gen.runtime.cute_backend.quantize_cute)
    from fp4gen.runtime import cute_backend, finite

    def forward_direct() -> None:  # the layer's fprop without the custom op around it
        with torch.no_grad(), finite.layer_scope():  # the op's scope (layer graphs need it)
            layer.forward_gemm(xd, layer.weight, layer.bias, torch.bfloat16)

    def backward_direct() -> None:
        with torch.no_grad(), finite.layer_scope():
            layer.backward_gemms(dy, xd, layer.weight)

    qspec = cute_backend.spec_for(spec.format, spec.rounding, spec.rht, xd.dtype)
    kernels = cute_backend._kernels(qspec)
    out, plan = kernels.module.launches(xd)

    def launch_only() -> None:
        for name, kargs in plan:
            kernels.fns[name](*kargs)

    def check_only() -> None:
        with finite.propagating():
            finite.check(xd, "x")

    def wrap_only() -> None:
        cute_backend._quantized(
            out, "", spec.format, n, spec.rounding, spec.rht, 0, 0, xd.shape, xd.dtype, None
        )

    rows = [
        (
            "quantize: kernel lookup",
            lambda: cute_backend._kernels(
                cute_backend.spec_for(spec.format, spec.rounding, spec.rht, xd.dtype)
            ),
        ),
        ("quantize: finite check", check_only),
        ("quantize: launches() (checks, allocations)", lambda: kernels.module.launches(xd)),
        (f"quantize: the {len(plan)} kernel calls alone", launch_only),
        ("quantize: QuantizedTensor wrap", wrap_only),
        ("a custom op that clones its input", lambda: copy_op(xd)),
        ("fp4gen fprop, no custom op", forward_direct),
        ("fp4gen dgrad + wgrad, no custom op", backward_direct),
        ("torch.empty (cuda)", lambda: torch.empty(n, n, device="cuda")),
        ("x + 1", lambda: xd + 1),
        ("nn.Linear fwd+bwd (bf16)", plain_step),
        (
            "fp4gen quantize (fprop activation)",
            lambda: layer.quantize(xd, Operand.FPROP_ACTIVATION, spec, 0),
        ),
        ("fp4gen.gemm (fprop)", lambda: fp4gen.gemm(xq, wq, out_dtype=torch.bfloat16)),
        ("fp4gen Linear forward", lambda: layer(xd)),
        ("fp4gen Linear fwd+bwd", fp4gen_step),
    ]
    print(f"{args.recipe}, {n} x {n}, {torch.cuda.get_device_name()}, gc {args.gc}")
    for _name, fn in rows:  # warm up everything (kernel loads, captures) before gc settings
        host_us(fn, 3)
    gc_time = _gc_timer()
    if args.gc == "freeze":
        gc.freeze()
    elif args.gc == "off":
        gc.disable()
    base = None
    for name, fn in rows:
        us = host_us(fn, args.calls)
        base = us if name.startswith("nn.Linear") else base
        extra = f"  ({us / base:.1f}x nn.Linear)" if base and "Linear" in name else ""
        print(f"  {name:40} {us:9.1f} us{extra}")
    print(f"  garbage collections while timing: {gc_time.summary()}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            fp4gen_step()
        torch.cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
        print("cProfile of 50 fp4gen Linear fwd+bwd, by self time:")
        print(out.getvalue())
    if args.pieces:
        print("wall time of the pieces of one fp4gen Linear fwd+bwd (nested: a piece includes")
        print("the pieces it calls):")
        for name, us in piece_times(fp4gen_step, args.calls):
            print(f"  {name:36} {us:8.1f} us")
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
            for _ in range(50):
                fp4gen_step()
            torch.cuda.synchronize()
        for what, key in (("host", "self_cpu_time_total"), ("GPU", "self_device_time_total")):
            print(f"torch.profiler of 50 fp4gen Linear fwd+bwd, {what} time by op:")
            print(tprof.key_averages().table(sort_by=key, row_limit=args.torch_profile))
    if layer._graphs is not None:
        g = layer._graphs
        print(
            f"layer graphs: {g.replays} replays ({g.in_place_replays} in place), "
            f"{len(g.graphs)} graphs, failed: {list(g.failed.values()) or 'none'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
