"""Bandwidth of the generated rowwise quantize kernels against a device-to-device copy.

    python benchmarks/quantize.py [--shapes 8192x8192,16384x8192] [--iters 50] [--no-reference]

For each format (NVFP4 RNE, NVFP4 SR + RHT16, MXFP4, MXFP8) and each bf16 input of 64 MiB and
more it prints the bytes the quantize kernel moves per second (input read + codes and scales
written) as a ratio to ``torch`` copying the same input in the same run (read + write), and the
speedup of the whole quantization (``run``: allocations, amax kernel if any, quantize kernel)
over the reference ``fp4gen.numerics.quantize`` under ``torch.compile`` (eager if that fails).
Every timed output is first checked bit for bit against the reference. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

from fp4gen.codegen import import_source
from fp4gen.codegen.quantize import render
from fp4gen.compiler.spec import QuantKernelSpec, QuantOutput
from fp4gen.dsl.model import RHTSpec
from fp4gen.formats import E2M1, E4M3, UE8M0, BlockFormat, ScaleSpec
from fp4gen.numerics import quantize

NVFP4 = (E2M1, (1, 16), ScaleSpec(E4M3, "nearest"), True)
MXFP4 = (E2M1, (1, 32), ScaleSpec(UE8M0, "up"), False)
MXFP8 = (E4M3, (1, 32), ScaleSpec(UE8M0, "up"), False)
CONFIGS = {
    "nvfp4 rowwise rne": (NVFP4, "nearest", None),
    "mxfp4 rowwise rne": (MXFP4, "nearest", None),
    "mxfp8 rowwise rne": (MXFP8, "nearest", None),
    "nvfp4 rowwise sr+rht16": (NVFP4, "stochastic", RHTSpec(16)),
}


def bench(fn, iters: int) -> float:
    """Seconds per call: CUDA events, best of 3 runs of ``iters`` calls after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / iters * 1e-3)
    return best


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and torch.equal(a, b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8192x8192,16384x8192")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    ap.add_argument("--no-reference", action="store_true", help="skip the reference timing")
    ap.add_argument(
        "--reference-budget", type=float, default=240.0, help="seconds of torch.compile at most"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to benchmark")
        return 0
    major, _ = torch.cuda.get_device_capability()
    arch = {9: "sm_90a", 10: "sm_100a"}.get(major)
    if arch is None:
        print(f"no kernels for compute capability {major}.x")
        return 0
    print(f"device {torch.cuda.get_device_name()} ({arch}), torch {torch.__version__}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    gen_dir = tempfile.mkdtemp(prefix="fp4gen_bench_")
    warnings.filterwarnings("ignore")  # dynamo's graph-break notes on the reference
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    logging.getLogger("torch.fx.experimental.symbolic_shapes").setLevel(logging.ERROR)
    ok = True
    compile_spent = 0.0

    for label in args.configs.split(","):
        (element, block, scale, global_scale), rounding, rht = CONFIGS[label]
        out = QuantOutput("rowwise", rounding, rht)
        spec = QuantKernelSpec(element, block, scale, global_scale, "bf16", (out,))
        t0 = time.perf_counter()
        mod = import_source(render(spec), gen_dir)
        t1 = time.perf_counter()
        fns, times = {}, []
        for name in mod.KERNELS:
            t = time.perf_counter()
            fns[name] = mod.compile_kernel(name, arch)
            times.append(f"{name} {time.perf_counter() - t:.2f} s")
        print(f"{label}: {spec.name}: render+import {t1 - t0:.2f} s, compile " + ", ".join(times))
        fmt = BlockFormat(label, element, block, scale, global_scale)

        def ref_fn(x, fmt=fmt, rounding=rounding, rht=rht):
            q = quantize(
                x, fmt, rounding=rounding, hadamard=rht, seed=1, offset=2, backend="reference"
            )
            return q.data, q.scale_codes, q.global_scale

        compiled = None
        ref_kind = "eager"
        if not args.no_reference:
            try:
                compiled = torch.compile(ref_fn)
                ref_kind = "compiled"
            except Exception as exc:  # torch.compile unavailable
                print(f"  torch.compile of the reference failed ({exc!r}); timing it eagerly")

        for m, k in shapes:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            in_bytes = x.numel() * x.element_size()
            dst = torch.empty_like(x)
            t_copy = bench(partial(dst.copy_, x), args.iters)
            bw_copy = 2 * in_bytes / t_copy

            res, plan = mod.launches(x, seed=1, offset=2)
            for name, kargs in plan:
                fns[name](*kargs)
            want = ref_fn(x)
            exact = (
                same(res["data"], want[0])
                and same(res["scales"], want[1])
                and same(res["global_scale"], want[2])
            )
            ok &= exact
            out_bytes = res["data"].numel() + res["scales"].numel() * res["scales"].element_size()
            kernel_t = {name: bench(partial(fns[name], *kargs), args.iters) for name, kargs in plan}
            t_q = kernel_t["quantize"]
            bw_q = (in_bytes + out_bytes) / t_q
            t_run = bench(partial(mod.run, fns, x, seed=1, offset=2), args.iters)

            ref_txt = "reference skipped"
            if not args.no_reference:
                fn, kind = (compiled, ref_kind) if compiled is not None else (ref_fn, "eager")
                if kind == "compiled" and compile_spent > args.reference_budget:
                    fn, kind = ref_fn, "eager (compile budget spent)"
                try:
                    t = time.perf_counter()
                    if kind == "compiled":
                        torch._dynamo.mark_dynamic(x, 0)  # one graph for every M
                    fn(x)
                    torch.cuda.synchronize()
                    if kind == "compiled":
                        first = time.perf_counter() - t
                        compile_spent += first
                        print(f"    reference first call (compiles): {first:.1f} s")
                except Exception as exc:
                    print(f"  compiled reference failed on {m}x{k} ({exc!r}); timing it eagerly")
                    fn, kind, compiled = ref_fn, "eager", None
                t_ref = bench(partial(fn, x), max(1, args.iters // 10))
                ref_txt = f"{t_ref / t_run:.0f}x reference({kind})"
            print(
                f"{label} {m}x{k} bf16: {bw_q / 1e9:.0f} GB/s = {bw_q / bw_copy:.2f} x copy; "
                f"{ref_txt}{'' if exact else '  NOT BIT-EXACT'}"
            )
            detail = ", ".join(f"{n} kernel {t * 1e6:.1f} us" for n, t in kernel_t.items())
            run_bytes = (2 if global_scale else 1) * in_bytes + out_bytes  # amax reads x too
            print(
                f"    copy {t_copy * 1e6:.1f} us ({bw_copy / 1e9:.0f} GB/s), {detail}, "
                f"run() {t_run * 1e6:.1f} us ({run_bytes / t_run / 1e9:.0f} GB/s)"
                + (f", reference {t_ref * 1e3:.2f} ms" if not args.no_reference else "")
            )
            del x, dst, res, plan, want
            torch.cuda.empty_cache()
    print("all outputs bit-exact" if ok else "SOME OUTPUTS DIFFER FROM THE REFERENCE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
