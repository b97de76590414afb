"""Bandwidth of the generated quantize kernels against a device-to-device copy.

    python benchmarks/quantize.py [--shapes 8192x8192,16384x8192] [--iters 50] [--no-reference]
                                  [--eager-reference] [--deadline 300] [--options]

``--options``: the rowwise kernels with the block-scale options of docs/numerics.md 11 (Four
Over Six: targets 6 4 by MSE, global bound 256; stochastic block scales; per-row global scales;
MS-EDEN) beside the plain NVFP4 kernel of the same rounding and RHT, the tile kernel's option
variants on 16x16 weights (Four Over Six, stochastic tile scales) beside the plain 2D kernel,
and RHT signs drawn per step (numerics.md 12) beside fixed ones, each one's quantize-kernel
time and run() time as a ratio to the other's ("4over6 <= 1.5x plain", "per-step signs at the
cost of fixed ones" are the goals), measured in the same run.

For each kernel (rowwise: NVFP4 RNE, NVFP4 SR + RHT16, MXFP4, MXFP8; tile kernels: the NVFP4
gradient's rowwise SR + columnwise SR/RHT16 copies in one launch, the activation's rowwise RNE +
columnwise RNE/RHT16, the 16x16 2D weight kernel's rowwise + transposed copies) and each bf16
input of 64 MiB and more it prints the bytes the quantize kernel moves per second (input read
once + every copy's codes and scales written) as a ratio to ``torch`` copying the same input in
the same run (read + write: "x copy"), and as the ratio of times to a ``torch`` copy that moves
as many bytes as the kernel ("x copy of the same bytes": a buffer of half of them read and
written; smaller than the input copy, so its fixed costs weigh a little more), and the speedup
of the whole quantization (``run``: allocations, amax kernel if any, quantize kernel) over the
reference ``fp4gen.numerics.quantize`` (one call per copy; the columnwise copy from ``x.t()``)
under ``torch.compile`` (eager if that fails, or with ``--eager-reference``: compiling the tile
kernels' references takes minutes).

Phase 1 times the kernels (every output checked bit for bit against the reference first) and
prints a line per shape; phase 2 times the reference, compiled once per format with M dynamic,
until ``--deadline`` seconds after the start; the summary lines come last. Needs a CUDA GPU.

``--profile N``: for a profiler, each kernel (amax and quantize) launched N times per shape after
one checked launch, and a torch copy of the input N times, nothing timed; only those launches lie
between cudaProfilerStart and Stop:

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        python benchmarks/quantize.py --profile 1 --shapes 8192x8192 --configs "fp8 1x128 row + col"
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
from fp4gen.compiler.plan import kernel_spec
from fp4gen.compiler.spec import QuantKernelSpec, QuantOutput
from fp4gen.dsl.model import RHTSpec
from fp4gen.formats import E2M1, E4M3, UE8M0, BlockFormat, ScaleSpec
from fp4gen.numerics import quantize

NVFP4 = (E2M1, (1, 16), ScaleSpec(E4M3, "nearest"), True)
NVFP4_2D = (E2M1, (16, 16), ScaleSpec(E4M3, "nearest"), True)
MXFP4 = (E2M1, (1, 32), ScaleSpec(UE8M0, "up"), False)
MXFP8 = (E4M3, (1, 32), ScaleSpec(UE8M0, "up"), False)
FP8_BLOCK = (E4M3, (1, 128), ScaleSpec(None), False)
FP8_TILE = (E4M3, (128, 128), ScaleSpec(None), False)
SR, SR8, TE16 = "stochastic", "stochastic8", RHTSpec(16)
ROW, COL = "rowwise", "columnwise"
# label -> (format, outputs as (direction, rounding, rht))
CONFIGS = {
    "nvfp4 rowwise rne": (NVFP4, ((ROW, "nearest", None),)),
    "nvfp4 rowwise sr+rht16": (NVFP4, ((ROW, SR, TE16),)),
    "mxfp4 rowwise rne": (MXFP4, ((ROW, "nearest", None),)),
    "mxfp8 rowwise rne": (MXFP8, ((ROW, "nearest", None),)),
    "nvfp4 rowwise sr8+rht16": (NVFP4, ((ROW, SR8, TE16),)),
    # the shipped recipe's gradient kernel (8 random bits per value), and with 32
    "nvfp4 gradient row sr8 + col sr8+rht16": (NVFP4, ((ROW, SR8, None), (COL, SR8, TE16))),
    "nvfp4 gradient row sr + col sr+rht16": (NVFP4, ((ROW, SR, None), (COL, SR, TE16))),
    "nvfp4 activation row rne + col rne+rht16": (
        NVFP4,
        ((ROW, "nearest", None), (COL, "nearest", TE16)),
    ),
    "nvfp4 weight 2d 16x16 row + col": (NVFP4_2D, ((ROW, "nearest", None), (COL, "nearest", None))),
    "fp8 1x128 row + col": (FP8_BLOCK, ((ROW, "nearest", None), (COL, "nearest", None))),
    "fp8 weight 128x128 row + col": (FP8_TILE, ((ROW, "nearest", None), (COL, "nearest", None))),
    "mxfp8 1x32 row + col": (MXFP8, ((ROW, "nearest", None), (COL, "nearest", None))),
    "mxfp4 1x32 row + col": (MXFP4, ((ROW, "nearest", None), (COL, "nearest", None))),
}
STEP16 = RHTSpec(16, "step", None, 1)  # signs drawn per layer and step
STEP128 = RHTSpec(128, "step", None, 1)
LAYER, STEP = 3, 5  # the benchmark's layer and step


def resolved(rht: RHTSpec | None) -> RHTSpec | None:
    """The transform as a call at LAYER, STEP takes it (signs drawn per layer or step)."""
    return rht.at(LAYER, STEP) if rht is not None else None


def signs_of(label: str) -> RHTSpec | None:
    """The ``signs`` argument of a rowwise module whose RHT signs are its arguments."""
    outs = CONFIGS[label][1]
    rht = outs[0][2]
    return resolved(rht) if len(outs) == 1 and rht is not None and rht.redrawn else None


# the block-scale options (docs/numerics.md 11) beside the plain kernel of the same copy
FOUR_OVER_SIX = BlockFormat(
    "nvfp4_4over6", *NVFP4, targets=(6.0, 4.0), target_error="mse", global_bound=256.0
)
SR_SCALES = BlockFormat("nvfp4_sr_scales", E2M1, (1, 16), ScaleSpec(E4M3, "stochastic"), True)
ROWS = BlockFormat("nvfp4_row", *NVFP4, global_rows=True)  # one global scale per row
EDEN = BlockFormat(  # Quartet II's backward format (with a 16-point RHT: 128 is the reference's)
    "nvfp4_eden",
    E2M1,
    (1, 16),
    ScaleSpec(E4M3, "stochastic"),
    True,
    global_bound=384.0,
    eden_group=128,
)
OPTION_CONFIGS = {
    "4over6 rowwise rne": (FOUR_OVER_SIX, ((ROW, "nearest", None),)),
    "4over6 rowwise sr8+rht16": (FOUR_OVER_SIX, ((ROW, SR8, TE16),)),
    "4over6 rowwise sr+rht16": (FOUR_OVER_SIX, ((ROW, SR, TE16),)),
    "nvfp4 sr-scales rowwise rne": (SR_SCALES, ((ROW, "nearest", None),)),
    # RHT signs drawn per step (docs/numerics.md 12): the kernels' arguments, at layer 3, step 5
    "nvfp4 per-row rowwise rne": (ROWS, ((ROW, "nearest", None),)),
    "nvfp4 eden128 sr-scales rowwise rne+rht16": (EDEN, ((ROW, "nearest", TE16),)),
    # Quartet II's backward operands: a 128-point RHT over 4 lanes, signs drawn per step
    "quartet2 backward rowwise rne+rht128 step-signs": (EDEN, ((ROW, "nearest", STEP128),)),
    "nvfp4 rowwise sr8+rht16 step-signs": (NVFP4, ((ROW, SR8, STEP16),)),
    "4over6 rowwise sr8+rht16 step-signs": (FOUR_OVER_SIX, ((ROW, SR8, STEP16),)),
    # 2D tiles with options (the tile kernel's option variants): nvfp4_4over6's weight pair
    "4over6 weight 2d 16x16 row + col": (
        FOUR_OVER_SIX.with_block((16, 16)),
        ((ROW, "nearest", None), (COL, "nearest", None)),
    ),
    "nvfp4 sr-scales weight 2d 16x16 row + col": (
        SR_SCALES.with_block((16, 16)),
        ((ROW, "nearest", None), (COL, "nearest", None)),
    ),
}
# option config -> the plain config it is compared with
PLAIN_OF = {
    "4over6 rowwise rne": "nvfp4 rowwise rne",
    "4over6 rowwise sr8+rht16": "nvfp4 rowwise sr8+rht16",
    "4over6 rowwise sr+rht16": "nvfp4 rowwise sr+rht16",
    "nvfp4 sr-scales rowwise rne": "nvfp4 rowwise rne",
    "nvfp4 per-row rowwise rne": "nvfp4 rowwise rne",
    "nvfp4 eden128 sr-scales rowwise rne+rht16": "nvfp4 rowwise rne+rht16",
    "quartet2 backward rowwise rne+rht128 step-signs": "nvfp4 rowwise rne+rht128",
    "nvfp4 rowwise sr8+rht16 step-signs": "nvfp4 rowwise sr8+rht16",
    "4over6 rowwise sr8+rht16 step-signs": "4over6 rowwise sr8+rht16",
    "4over6 weight 2d 16x16 row + col": "nvfp4 weight 2d 16x16 row + col",
    "nvfp4 sr-scales weight 2d 16x16 row + col": "nvfp4 weight 2d 16x16 row + col",
}
# plain kernels the option kernels are compared with that the default run does not time
PLAIN_FOR_OPTIONS = {
    "nvfp4 rowwise rne+rht16": (NVFP4, ((ROW, "nearest", TE16),)),
    "nvfp4 rowwise rne+rht128": (NVFP4, ((ROW, "nearest", RHTSpec(128, "seeded", None, 1)),)),
}
CONFIGS.update(OPTION_CONFIGS)
CONFIGS.update(PLAIN_FOR_OPTIONS)
OFFSETS = (2, 3)  # one Philox offset per copy


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


INPUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_x(m: int, k: int, dtype: str = "bf16") -> torch.Tensor:
    """The benchmark input: standard normal of ``dtype``, the same for a shape in both phases."""
    g = torch.Generator(device="cuda").manual_seed(m * 131 + k)
    return torch.randn(m, k, device="cuda", dtype=INPUT_DTYPES[dtype], generator=g)


def block_format(label: str) -> BlockFormat:
    """The format of a config: a BlockFormat (with options) or (element, block, scale, global)."""
    fmt = CONFIGS[label][0]
    return fmt if isinstance(fmt, BlockFormat) else BlockFormat(label, *fmt)


def make_spec(label: str, dtype: str = "bf16") -> QuantKernelSpec:
    outs = CONFIGS[label][1]
    outputs = tuple(QuantOutput(d, r, h) for d, r, h in outs)  # type: ignore[arg-type]
    return kernel_spec(block_format(label), dtype, outputs)


def reference_fn(label: str):
    """The reference of every copy: (key, tensor) pairs named like the kernels' outputs."""
    fmt = block_format(label)
    block, outs = fmt.block, CONFIGS[label][1]

    def ref_fn(x):
        out = []
        if block[0] != 1:  # 2D: one quantization, the columnwise copy its transpose
            q = quantize(x, fmt, rounding=outs[0][1], seed=1, offset=OFFSETS[0])
            copies = [(d, q if d == ROW else q.transpose()) for d, _, _ in outs]
        else:
            copies = [
                (
                    d,
                    quantize(
                        x if d == ROW else x.t().contiguous(),
                        fmt,
                        rounding=r,
                        hadamard=resolved(h),
                        seed=1,
                        offset=OFFSETS[i] if len(outs) > 1 else OFFSETS[0],
                    ),
                )
                for i, (d, r, h) in enumerate(outs)
            ]
        for d, q in copies:
            p = "" if d == ROW else "col_"
            scales = q.scales if q.scale_codes is None else q.scale_codes  # fp32 scales: values
            out += [(p + "data", q.data), (p + "scales", scales)]
            out.append((p + "global_scale", q.global_scale))
        return out

    return ref_fn


def offsets_for(spec: QuantKernelSpec):
    """The run() offset argument: an int for a rowwise kernel, one per copy for a tile kernel."""
    return (
        OFFSETS[0]
        if len(spec.outputs) == 1 and spec.block[0] == 1
        else OFFSETS[: len(spec.outputs)]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes",
        default="4096x8192,8192x8192,16384x8192",
        help="MxK inputs (the targets are for 64 MiB and up: 4096x8192 bf16 is 64 MiB)",
    )
    ap.add_argument(
        "--dtype",
        choices=sorted(INPUT_DTYPES),
        default="bf16",
        help="the inputs' dtype (fp32: a master weight quantized directly, as a model with fp32 "
        "weights under autocast does)",
    )
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument(
        "--configs",
        default=",".join(c for c in CONFIGS if c not in OPTION_CONFIGS | PLAIN_FOR_OPTIONS),
        help="comma-separated names",
    )
    ap.add_argument(
        "--options",
        action="store_true",
        help="the block-scale option kernels and the plain ones they are compared with, ratios "
        "printed (instead of --configs)",
    )
    ap.add_argument("--no-reference", action="store_true", help="skip the reference timing")
    ap.add_argument(
        "--eager-reference",
        action="store_true",
        help="time the reference eagerly instead of under torch.compile (compiling the fused "
        "tile references takes minutes)",
    )
    ap.add_argument(
        "--deadline",
        type=float,
        default=300.0,
        help="seconds after the start past which the reference is no longer timed",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="launch each kernel and a copy of the input N times per shape (after one launch "
        "checked against the reference), time nothing: for Nsight Compute or nsys",
    )
    args = ap.parse_args()
    start = time.perf_counter()
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
    labels = args.configs.split(",")
    if args.options:
        labels = list(dict.fromkeys(x for o in OPTION_CONFIGS for x in (PLAIN_OF[o], o)))
    gen_dir = tempfile.mkdtemp(prefix="fp4gen_bench_")
    warnings.filterwarnings("ignore")  # dynamo's graph-break notes on the reference
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    logging.getLogger("torch.fx.experimental.symbolic_shapes").setLevel(logging.ERROR)
    ok = True

    # ---- phase 1: the generated kernels (checked bit for bit), copy in the same run
    results: dict[tuple[str, int, int], dict[str, float | bool]] = {}
    for label in labels:
        spec = make_spec(label, args.dtype)
        global_scale = spec.global_scale
        t0 = time.perf_counter()
        mod = import_source(render(spec), gen_dir)
        t1 = time.perf_counter()
        fns, times = {}, []
        for name in mod.KERNELS:
            t = time.perf_counter()
            fns[name] = mod.compile_kernel(name, arch)
            times.append(f"{name} {time.perf_counter() - t:.2f} s")
        print(f"{label}: {spec.name}: render+import {t1 - t0:.2f} s, compile " + ", ".join(times))
        ref_fn = reference_fn(label)
        offset = offsets_for(spec)
        drawn = {"signs": signs_of(label)} if signs_of(label) is not None else {}
        for m, k in shapes:
            x = make_x(m, k, args.dtype)
            in_bytes = x.numel() * x.element_size()
            dst = torch.empty_like(x)
            t_copy = bench(partial(dst.copy_, x), args.iters)
            res, plan = mod.launches(x, seed=1, offset=offset, **drawn)
            for name, kargs in plan:
                fns[name](*kargs)
            want = ref_fn(x)
            exact = all(same(res[key].reshape(w.shape), w) for key, w in want)
            ok &= exact
            if args.profile:
                torch.cuda.synchronize()
                torch.cuda.profiler.start()  # ncu --profile-from-start off sees these alone
                for _ in range(args.profile):
                    dst.copy_(x)
                    for name, kargs in plan:
                        fns[name](*kargs)
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
                print(f"  {m}x{k}: {'bit-exact' if exact else 'NOT BIT-EXACT'}, profiled")
                del x, dst, res, plan, want
                torch.cuda.empty_cache()
                continue
            out_bytes = sum(
                res[key].numel() * res[key].element_size()
                for key in ("data", "scales", "col_data", "col_scales")
                if key in res
            )
            kernel_t = {name: bench(partial(fns[name], *kargs), args.iters) for name, kargs in plan}
            t_run = bench(partial(mod.run, fns, x, seed=1, offset=offset, **drawn), args.iters)
            bw_copy = 2 * in_bytes / t_copy
            # a copy that moves as many bytes as the kernel (reads and writes half each)
            same_src = torch.empty(
                (in_bytes + out_bytes) // 4, dtype=torch.bfloat16, device=x.device
            )
            same_dst = torch.empty_like(same_src)
            t_same = bench(partial(same_dst.copy_, same_src), args.iters)
            ratio_same = t_same / kernel_t["quantize"]
            del same_src, same_dst
            bw_q = (in_bytes + out_bytes) / kernel_t["quantize"]
            run_bytes = (2 if global_scale else 1) * in_bytes + out_bytes  # amax reads x too
            detail = ", ".join(f"{n} kernel {t * 1e6:.1f} us" for n, t in kernel_t.items())
            print(
                f"  {m}x{k}: {bw_q / 1e9:.0f} GB/s = {bw_q / bw_copy:.2f} x copy, "
                f"{ratio_same:.2f} x copy of the same bytes "
                f"({'bit-exact' if exact else 'NOT BIT-EXACT'}); copy {t_copy * 1e6:.1f} us "
                f"({bw_copy / 1e9:.0f} GB/s), {detail}, run() {t_run * 1e6:.1f} us "
                f"({run_bytes / t_run / 1e9:.0f} GB/s)"
            )
            results[(label, m, k)] = {
                "bw": bw_q,
                "ratio": bw_q / bw_copy,
                "same": ratio_same,
                "run": t_run,
                "quantize": kernel_t["quantize"],
            }
            del x, dst, res, plan, want
            torch.cuda.empty_cache()

    if args.profile:
        print("all outputs bit-exact" if ok else "SOME OUTPUTS DIFFER FROM THE REFERENCE")
        return 0 if ok else 1

    # ---- phase 2: the reference, compiled once per format (M dynamic), eager if that fails
    ref_text: dict[tuple[str, int, int], str] = {}
    for label in [] if args.no_reference else labels:
        ref_fn = reference_fn(label)
        torch._dynamo.reset()  # formats differ in Python ints that dynamo would make symbolic
        fn, kind = ref_fn, "eager"
        if not args.eager_reference:
            fn, kind = torch.compile(ref_fn), "compiled"
        for m, k in shapes:
            if time.perf_counter() - start > args.deadline:
                ref_text[(label, m, k)] = "reference not timed (deadline)"
                continue
            x = make_x(m, k, args.dtype)
            if kind == "compiled":
                try:
                    torch._dynamo.mark_dynamic(x, 0)
                    t = time.perf_counter()
                    fn(x)
                    torch.cuda.synchronize()
                    print(f"  reference {label} compiled in {time.perf_counter() - t:.1f} s")
                except Exception as exc:
                    print(f"  torch.compile of the reference failed ({type(exc).__name__}): eager")
                    fn, kind = ref_fn, "eager"
            t_ref = bench(partial(fn, x), max(1, args.iters // 10))
            speedup = t_ref / results[(label, m, k)]["run"]
            ref_text[(label, m, k)] = f"{speedup:.0f}x reference({kind})"
            print(f"  reference {label} {m}x{k}: {t_ref * 1e3:.2f} ms ({kind})")
            del x
            torch.cuda.empty_cache()

    # ---- summary
    for label in labels:
        for m, k in shapes:
            r = results[(label, m, k)]
            ref = ref_text.get((label, m, k), "reference skipped")
            print(
                f"{label} {m}x{k} bf16: {r['bw'] / 1e9:.0f} GB/s = {r['ratio']:.2f} x copy, "
                f"{r['same']:.2f} x copy of the same bytes; {ref}"
            )
    for label in labels:
        plain = PLAIN_OF.get(label)
        if plain is None or plain not in labels:
            continue
        for m, k in shapes:
            r, p = results[(label, m, k)], results[(plain, m, k)]
            print(
                f"{label} / {plain} {m}x{k}: quantize kernel "
                f"{r['quantize'] / p['quantize']:.2f}x, run() {r['run'] / p['run']:.2f}x"
            )
    print("all outputs bit-exact" if ok else "SOME OUTPUTS DIFFER FROM THE REFERENCE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
