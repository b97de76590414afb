"""TFLOP/s of the GEMM paths on block-scaled operands (Hopper): fp4gen.gemm (auto), the fused
kernel, the block-scaled FP8 scaled_mm and generated FP8 kernel, cuBLAS BF16 and dequantize +
cuBLAS.

    python benchmarks/gemm.py [--shapes 8192x8192x8192,16x8192x8192]
                              [--formats nvfp4,mxfp4,fp8_blockwise,mxfp8,fp8_e5m2_e4m3]
                              [--tiles small,mid] [--no-dequant] [--host-detail] [--log FILE]
                              [--warm 0.5]   # every figure at the GPU's sustained clock
    python benchmarks/gemm.py --shapes 16x8192x8192 --profile 5   # for ncu / nsys
    python benchmarks/gemm.py --shapes 8192x8192x8192 --formats fp8_blockwise --profile 1 \
        --fp8-variant coalesced,overlap,c2                          # an FP8 kernel variant

Per shape MxNxK and format, C = A @ B^T with A [M, K] and B [N, K]:

  cuBLAS bf16           torch.matmul of bf16 [M, K] by [N, K]^T, bf16 out (the target)
  cuBLAS bf16->fp32     torch.mm(out_dtype=float32) on the same operands: what the dequant path
                        runs (fp32 accumulation and output)
  dequantize + cuBLAS   fp4gen.gemm(backend="dequant", bf16 out): the generated dequantize
                        kernel on A (and on B once: its values are remembered per tensor, as a
                        weight's), cuBLAS bf16->fp32, alpha and the bf16 cast in one pass
  dequant, B per call   the same with B decoded on every call (a fresh B tensor each call)
  dequantize kernel     the generated kernel alone on B [N, K] (one code per byte; "packed":
                        two per byte), bytes read + written per second and the ratio to a
                        torch device-to-device copy of as many bytes
  fused <tile> [xS]     the generated fused kernel alone: its compiled TVM-FFI function called
                        on arguments prepared beforehand (launch_args), bf16 out; the tile
                        fp4gen.gemm picks for M, then those named by --tiles (fp4gen.codegen.gemm
                        TILES, or CANDIDATES by tile name); xS: the split-K ways of a small-M
                        tile
  block-scaled scaled_mm
                        FP8 pairs with fp32 1x128 / 128x128 block scales (fp8_blockwise: A 1x128,
                        B 128x128, the fprop / dgrad pair; fp8_blockwise_1d: both 1x128, the
                        wgrad pair): torch.nn.functional.scaled_mm alone on operands converted
                        beforehand (fp4gen.runtime.fp8_gemm.Operands), bf16 out, and
                        fp4gen.gemm(backend="block_scaled") end to end (with the conversion)
  generated FP8 kernel  the same pairs, MXFP8's and those scaled_mm refuses (fp8_e5m2_e4m3: an
                        e5m2 A; fp8_1x64, fp8_1x256: 1x64 / 1x256 A and 64x64 / 256x256 B
                        blocks) on the generated block-scaled FP8 kernel
                        (fp4gen.kernels.gemm_sm90_fp8): alone (compiled function, arguments made
                        beforehand) and fp4gen.gemm(backend="cute") end to end; timed in turns
                        with the scaled_mm lines, then the host time of each; the kernel's other
                        variants alone too (overlapped promotion on / off, 1 or 2 CTAs per
                        cluster, row-major or "coalesced": MN-major scales read by 16-byte
                        copies and whole-sector stores, and each half of it alone:
                        fp8_gemm.CUTE_OVERLAP, CUTE_CLUSTER_M, CUTE_MN_MAJOR_SCALES,
                        CUTE_WIDE_STORES), 128 x 192 tiles where B comes in tiles
                        (CUTE_TILE_N); the coalesced variant end to end, and its per-call
                        transpose of A's scales alone (the "TFLOP/s" of that line is the
                        GEMM's count over the transpose's time: read its microseconds)
  fp4gen.gemm auto      end to end (dispatch, checks, launch), bf16 out; A is a fresh
                        QuantizedTensor every call (as an activation: the small-M kernels read
                        its codes as they are, the wgmma kernels pack them per call), B the same
                        one (a weight: prepared once)
  host                  the CPU time of one fp4gen.gemm call (the loop of calls timed without
                        waiting for the GPU: what a call adds when the kernel is shorter);
                        --host-detail: also its parts (dispatch, fused_gemm, the compiled
                        function alone, the output allocation, ...)

with the ratios to cuBLAS and to dequantize + cuBLAS. Inputs: random codes (all 16 nibbles; for
8-bit elements every code but NaN), block scales 1.0, global scales 1; NVFP4's B has 16x16
blocks (the recipe's weight), MXFP4's and MXFP8's 1x32 (MXFP8 on Hopper: no block-scaled
scaled_mm, torch runs MX scaling on sm_100+ only, so auto is dequantize + cuBLAS). Every method
rotates over enough input sets that the operands of consecutive calls are not in L2 (at least
2 x 50 MB of quantized operands; bf16 likewise). CUDA events, best of 3 runs of N
calls after a warm-up. Needs an sm_90 GPU for the fused kernel (other GPUs: the rest).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

import fp4gen
from fp4gen.formats import BUILTIN_FORMATS, BlockFormat, ScaleSpec
from fp4gen.gemm_dispatch import auto_backend, fused_support
from fp4gen.numerics import QuantizedTensor
from fp4gen.numerics.minifloat import decode
from fp4gen.runtime import fp8_gemm

SHAPES = "8192x8192x8192,16x8192x8192,128x8192x8192,1024x8192x8192"
L2_BYTES = 50 * 2**20
ONE = {"e4m3": 0x38, "ue8m0": 127}  # the scale code of 1.0
FP8_BLOCK = BlockFormat(
    "fp8_block", BUILTIN_FORMATS["mxfp8_e4m3"].element, (1, 128), ScaleSpec(None)
)
FP8_E5M2_BLOCK = BlockFormat(
    "fp8_e5m2_block", BUILTIN_FORMATS["mxfp8_e5m2"].element, (1, 128), ScaleSpec(None)
)
FORMATS = {
    "nvfp4": (BUILTIN_FORMATS["nvfp4"], BUILTIN_FORMATS["nvfp4"].with_block((16, 16))),
    "mxfp4": (BUILTIN_FORMATS["mxfp4"], BUILTIN_FORMATS["mxfp4"]),
    "mxfp8": (BUILTIN_FORMATS["mxfp8_e4m3"], BUILTIN_FORMATS["mxfp8_e4m3"]),
    "fp8_blockwise": (FP8_BLOCK, FP8_BLOCK.with_block((128, 128))),
    "fp8_blockwise_1d": (FP8_BLOCK, FP8_BLOCK),
    # pairs scaled_mm does not take, for the generated FP8 kernel (backend="cute")
    "fp8_e5m2_e4m3": (FP8_E5M2_BLOCK, FP8_BLOCK.with_block((128, 128))),
    "fp8_1x64": (FP8_BLOCK.with_block((1, 64)), FP8_BLOCK.with_block((64, 64))),
    "fp8_1x256": (FP8_BLOCK.with_block((1, 256)), FP8_BLOCK.with_block((256, 256))),
}


# Seconds of calls before each timing (``--warm``): an H200 at its 700 W limit runs the FP8
# tensor cores at 1980 MHz for the first few milliseconds and at about 1400 MHz after some
# 0.3 s (measured: the generated FP8 kernel at 8192^3 1181 -> 1028-1040 TFLOP/s, scaled_mm
# 1284-1292 -> 1105), so a timing that starts on an idle GPU measures the boost clock and one
# after a heavy timing the sustained clock. Warmed, every figure is the sustained one: what
# a training step sees (docs/gemm-sm90.md, "The power limit").
WARM_S = [0.0]


def bench(fn, iters: int) -> float:
    """Seconds per call: CUDA events, best of 3 runs of ``iters`` calls (fn(i), i rotating),
    after calls for ``WARM_S`` seconds."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    if WARM_S[0] > 0:
        t0, i = time.perf_counter(), 0
        while time.perf_counter() - t0 < WARM_S[0]:
            fn(i)
            i += 1
            if i % 8 == 0:
                torch.cuda.synchronize()  # time on the GPU, not in its queue
        torch.cuda.synchronize()
    best = math.inf
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(i)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / iters * 1e-3)
    return best


def operand(rows: int, k: int, fmt, g: torch.Generator) -> QuantizedTensor:
    """Random codes (no NaN), block scales 1.0, S_dec = 1."""
    bits = fmt.element.bits
    codes = torch.randint(0, 1 << bits, (rows, k), generator=g, device="cuda", dtype=torch.uint8)
    if bits == 8:  # no NaN (or Inf) codes: e4m3's are 0x7f and 0xff, e5m2's exponent 31
        special = 0x7C if fmt.element.exp_bits == 5 else 0x7F
        codes = torch.where((codes & special) == special, torch.zeros_like(codes), codes)
    br, bc = fmt.block
    blocks = (-(-rows // min(br, rows)), -(-k // min(bc, k)))
    if fmt.scale.element is None:  # fp32 block scales
        sc, scales = None, torch.ones(blocks, device="cuda")
    else:
        sc = torch.full(blocks, ONE[fmt.scale.name], dtype=torch.uint8, device="cuda")
        scales = decode(sc, fmt.scale.element)
    return QuantizedTensor(
        codes=codes,
        scales=scales,
        scale_codes=sc,
        global_scale=torch.ones((), device="cuda"),
        format=fmt,
        rounding="nearest",
        rht=None,
        seed=0,
        offset=0,
        shape=torch.Size((rows, k)),
        dtype=torch.float32,
    )


def host_time(fn, iters: int) -> float:
    """Seconds of CPU time per call of fn(i): the calls are timed without synchronizing (after
    a garbage collection, so that no earlier garbage is collected on the clock)."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    gc.collect()
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(iters):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / iters)
        torch.cuda.synchronize()
    return best


def run_shape(
    m: int,
    n: int,
    k: int,
    fmt_name: str,
    out: list[str],
    tiles: list[str],
    dequant: bool,
    host_detail: bool,
    units: list[tuple[int, int]],
) -> None:
    fa, fb = FORMATS[fmt_name]
    flops = 2.0 * m * n * k
    tag = f"{m}x{n}x{k} {fmt_name}"

    def line(name: str, t: float, ref: dict[str, float], extra: str = "") -> None:
        text = f"{tag}: {name:<28} {t * 1e6:9.1f} us {flops / t / 1e12:7.1f} TFLOP/s"
        for label, base in ref.items():
            text += f"  x{base / t:5.2f} {label}"
        print(text + extra, flush=True)
        out.append(text + extra)

    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    q_bytes = (m + n) * k * max(fa.element.bits, fb.element.bits) // 8
    nset = max(1, min(8, math.ceil(2 * L2_BYTES / q_bytes)))
    sets = [(operand(m, k, fa, g), operand(n, k, fb, g)) for _ in range(nset)]
    bf_bytes = (m + n) * k * 2
    nbf = max(1, min(4, math.ceil(2 * L2_BYTES / bf_bytes)))
    abf = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(nbf)]
    bbf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(nbf)]

    def cublas(i: int = 0):
        return torch.matmul(abf[i % nbf], bbf[i % nbf].t())

    cublas(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    cublas(1)
    torch.cuda.synchronize()
    iters = max(3, min(200, int(0.02 / max(time.perf_counter() - t0, 1e-5))))

    t_cublas = bench(cublas, iters)
    line("cuBLAS bf16 torch.matmul", t_cublas, {})

    def cublas_fp32(i: int = 0):
        return torch.mm(abf[i % nbf], bbf[i % nbf].t(), out_dtype=torch.float32)

    line("cuBLAS bf16->fp32 torch.mm", bench(cublas_fp32, iters), {"cuBLAS": t_cublas})

    ref = {"cuBLAS": t_cublas}
    if dequant:

        def dequant_gemm(i: int = 0):
            a, b = sets[i % nset]
            return fp4gen.gemm(a, b, out_dtype=torch.bfloat16, backend="dequant")

        t_dq = bench(dequant_gemm, iters)
        line("dequantize + cuBLAS", t_dq, {"cuBLAS": t_cublas})
        ref["dequant+cuBLAS"] = t_dq

        def dequant_fresh_b(i: int = 0):
            a, b = sets[i % nset]
            b = dataclasses.replace(b)  # a new tensor: its values are not remembered
            return fp4gen.gemm(a, b, out_dtype=torch.bfloat16, backend="dequant")

        line("dequant, B per call", bench(dequant_fresh_b, iters), {"cuBLAS": t_cublas})
        dequant_kernel_lines(sets, n, k, tag, out, units)

    def host_line(name: str, seconds: float) -> None:
        text = f"{tag}: {name:<28} {seconds * 1e6:9.1f} us per call"
        print(text, flush=True)
        out.append(text)

    if torch.cuda.get_device_capability() == (9, 0):
        fp8_lines(fa, fb, sets, nset, iters, line, ref, host_line)

    picked = None  # (fn, args) of the tile fp4gen.gemm picks
    if torch.cuda.get_device_capability() == (9, 0) and fused_support(fa, fb) is None:
        from fp4gen.codegen.gemm import CANDIDATES, TILES, pick_tile

        named = [TILES[t] if t in TILES else CANDIDATES[t] for t in tiles]
        for tile in dict.fromkeys([pick_tile(m), *named]):
            fn, args, label, note = fused_launch(fa, fb, m, n, k, tile, sets)
            picked = picked or (fn, args)

            def fused(i: int = 0, fn=fn, args=args):
                fn(*args[i % nset])

            t_fused = bench(fused, iters)
            line(label, t_fused, ref, note)

    choice = auto_backend(*sets[0])

    # a fresh activation per call (made beforehand: the copy is not part of the call), for the
    # warm-up's calls too (at most 4 per cuBLAS BF16 call's time)
    made = 2 * (3 + 3 * iters) + int(4 * WARM_S[0] / t_cublas)
    fresh = [dataclasses.replace(sets[i % nset][0]) for i in range(made)]

    def auto(i: int = 0):
        # a fresh one while they last (the warm-up may use them up: then set i's again)
        a = fresh.pop() if fresh else dataclasses.replace(sets[i % nset][0])
        return fp4gen.gemm(a, sets[i % nset][1], out_dtype=torch.bfloat16)

    t_auto = bench(auto, iters)
    line(f"fp4gen.gemm auto ({choice.backend})", t_auto, ref)

    host_line("host time of fp4gen.gemm", host_time(auto, iters))
    if host_detail and picked is not None:
        host_steps(sets[0], picked, iters, host_line)
    for held in (sets, abf, bbf):  # free before the next shape
        held.clear()
    torch.cuda.empty_cache()


def fp8_lines(fa, fb, sets, nset: int, iters: int, line, ref: dict[str, float], host_line):
    """The block-scaled FP8 GEMMs of the pair, bf16 out: scaled_mm alone on operands converted
    beforehand (fp4gen.runtime.fp8_gemm.Operands) and fp4gen.gemm(backend="block_scaled") end
    to end, where scaled_mm takes the pair; the generated FP8 kernel alone (its compiled
    function on arguments made beforehand, fp8_gemm.cute_launch) and fp4gen.gemm(
    backend="cute") end to end, where the kernel takes it. Timed in turns, best of each, then
    each one's host time per call."""
    import torch.nn.functional as F

    methods = {}
    if fp8_gemm.support(fa, fb) is None:
        ops = [fp8_gemm.Operands(a, b) for a, b in sets]

        def scaled_mm_alone(i: int = 0):
            o = ops[i % nset]
            return F.scaled_mm(
                o.mat_a,
                o.mat_b,
                o.scale_a,
                o.recipe_a,
                o.scale_b,
                o.recipe_b,
                output_dtype=torch.bfloat16,
                use_fast_accum=False,
            )

        def block_scaled(i: int = 0):
            a, b = sets[i % nset]
            return fp4gen.gemm(a, b, out_dtype=torch.bfloat16, backend="block_scaled")

        methods["block-scaled scaled_mm alone"] = scaled_mm_alone
        methods["fp4gen.gemm block_scaled"] = block_scaled
    if fp8_gemm.cute_support(fa, fb) is None:
        t0 = time.perf_counter()
        launches = [
            fp8_gemm.cute_launch(a, b, out_dtype=torch.bfloat16)[:2] for a, b in sets
        ]  # the first compiles the kernel
        print(f"generated FP8 kernel ready in {time.perf_counter() - t0:.1f} s", flush=True)

        def cute_alone(i: int = 0):
            fn, args = launches[i % nset]
            fn(*args)

        def cute(i: int = 0):
            a, b = sets[i % nset]
            return fp4gen.gemm(a, b, out_dtype=torch.bfloat16, backend="cute")

        a, b = sets[0]
        tile_n = fp8_gemm.cute_tile_n(fa, fb, a.rows, b.rows, a.device)  # the shape's width
        params = fp8_gemm.cute_plan(fa, fb, torch.bfloat16, False, False, tile_n).params
        methods[f"generated FP8 kernel alone (128x{params.tile_n} by shape)"] = cute_alone
        methods["fp4gen.gemm cute (FP8)"] = cute
        methods.update(fp8_variant_methods(fa, fb, sets, nset))
    # timed in turns, best of each: at 8192^3 the FP8 tensor cores draw enough power for the
    # clock to fall from one timing to the next, which one after the other would charge to
    # whichever ran second
    times = dict.fromkeys(methods, math.inf)
    for _ in range(3):
        for name, fn in methods.items():
            times[name] = min(times[name], bench(fn, iters))
    for name in methods:
        line(name, times[name], ref)
    for name, fn in methods.items():
        host_line(f"host: {name}", host_time(fn, iters))


# The generated FP8 kernel's variants timed alone beside the one calls take: (overlap,
# cluster_m, mn_major_scales, wide_stores, tile_n). The row-major and the coalesced variant
# (GemmSm90Fp8Params.mn_major_scales + wide_stores) of each overlap / cluster setting; each
# half of the coalesced variant alone at overlap + cluster 2x1 (which of the two gains what);
# 192-wide tiles (no overlap; pairs with B in tiles only, the others are left out).
FP8_VARIANTS = (
    [
        (overlap, cluster_m, coalesced, coalesced, 128)
        for coalesced in (False, True)
        for overlap in (False, True)
        for cluster_m in (1, 2)
    ]
    + [(True, 2, True, False, 128), (True, 2, False, True, 128)]
    + [(False, 1, False, False, 192), (False, 1, True, True, 192), (False, 2, True, True, 192)]
)
_FLAGS = (
    "CUTE_OVERLAP",
    "CUTE_CLUSTER_M",
    "CUTE_MN_MAJOR_SCALES",
    "CUTE_WIDE_STORES",
    "CUTE_TILE_N",
)


def fp8_variant_label(overlap: bool, cluster_m: int, mn_major: bool, wide: bool, n: int) -> str:
    label = ("overlap" if overlap else "one partial") + f", cluster {cluster_m}x1"
    label += f", 128x{n}" if n != 128 else ""
    if mn_major and wide:
        return label + ", coalesced"
    if mn_major or wide:
        return label + (", MN-major scales" if mn_major else ", wide stores")
    return label


class FP8Flags:
    """fp8_gemm's variant settings (``_FLAGS``) set to ``values`` inside the block, the tile
    width that one at every shape (``CUTE_TILE_BY_SHAPE`` off)."""

    def __init__(self, values: tuple) -> None:
        self.values = (*values, False)

    def __enter__(self) -> None:
        self.kept = tuple(getattr(fp8_gemm, f) for f in (*_FLAGS, "CUTE_TILE_BY_SHAPE"))
        for flag, value in zip((*_FLAGS, "CUTE_TILE_BY_SHAPE"), self.values, strict=True):
            setattr(fp8_gemm, flag, value)

    def __exit__(self, *exc) -> None:
        for flag, value in zip((*_FLAGS, "CUTE_TILE_BY_SHAPE"), self.kept, strict=True):
            setattr(fp8_gemm, flag, value)


def fp8_variant_methods(fa, fb, sets, nset: int) -> dict:
    """The kernel's other variants (``FP8_VARIANTS``), each alone on arguments made beforehand
    by ``fp8_gemm.cute_launch`` with the variant's settings (the coalesced variant's MN-major
    scales included); the coalesced variant end to end too (fp4gen.gemm backend="cute": its
    host path transposes A's scales per call), and that transpose alone."""
    current = tuple(getattr(fp8_gemm, f) for f in _FLAGS)
    a, b = sets[0]  # the calls' own kernel: the width their shape takes
    tile_n = fp8_gemm.cute_tile_n(fa, fb, a.rows, b.rows, a.device)
    seen = {fp8_gemm.cute_plan(fa, fb, torch.bfloat16, False, False, tile_n).params}
    methods = {}
    for flags in FP8_VARIANTS:
        label = fp8_variant_label(*flags)
        with FP8Flags(flags):
            params = fp8_gemm.cute_plan(fa, fb, torch.bfloat16, False, False).params
        if params in seen:  # the calls' own, or a setting the pair does not take
            continue
        seen.add(params)
        try:
            with FP8Flags(flags):
                calls = [fp8_gemm.cute_launch(a, b, out_dtype=torch.bfloat16)[:2] for a, b in sets]
        except (ValueError, fp4gen.errors.FP4GenError) as err:
            print(f"no FP8 kernel variant {label}: {err}", flush=True)
            continue

        def cute_other(i: int = 0, calls=calls):
            fn, args = calls[i % nset]
            fn(*args)

        methods[f"FP8 kernel, {label}"] = cute_other
    coalesced = (current[0], current[1], True, True, current[4])
    if coalesced != current:

        def cute_coalesced(i: int = 0, flags=coalesced):
            a, b = sets[i % nset]
            with FP8Flags(flags):
                return fp4gen.gemm(a, b, out_dtype=torch.bfloat16, backend="cute")

        methods["fp4gen.gemm cute (FP8), coalesced"] = cute_coalesced
        ue8m0 = fa.scale.element is not None

        def transpose_a(i: int = 0):
            return fp8_gemm.cute_scales_mn_major(sets[i % nset][0], ue8m0)

        methods["A scales MN-major (transpose)"] = transpose_a
    return methods


def dequant_kernel_lines(
    sets, n: int, k: int, tag: str, out: list[str], units: list[tuple[int, int]]
) -> None:
    """The dequantize kernel alone on B [N, K]: GB/s and the ratio to a copy of as many bytes."""
    from fp4gen.codegen.dequant import spec_for
    from fp4gen.compiler.jit import detect_arch
    from fp4gen.runtime import kernels_for
    from fp4gen.runtime.cute_gemm import packed_codes

    b = sets[0][1]
    variants = [("bytes", None), ("packed", None)]
    variants += [("bytes", v) for v in units]
    for layout, variant in variants:
        spec = spec_for(b.format, layout)
        if isinstance(spec, str):
            continue
        render = None
        if variant is not None:  # another unit size / units per thread (a rendered variant)
            import fp4gen.codegen.dequant as codegen

            saved = codegen.UNIT, codegen.UNITS_PER_THREAD
            codegen.UNIT, codegen.UNITS_PER_THREAD = variant
            try:
                source = codegen.render_dequant(spec)
            finally:
                codegen.UNIT, codegen.UNITS_PER_THREAD = saved
            render = lambda s, source=source: source  # noqa: E731
        kernels = kernels_for(spec, detect_arch(), render=render)  # type: ignore[arg-type]
        codes = [s[1].codes if layout == "bytes" else packed_codes(s[1]) for s in sets]
        unit = kernels.module.UNIT
        kp = -(-k // unit) * unit
        outs = [torch.empty(n, kp, dtype=torch.bfloat16, device="cuda") for _ in sets]
        args = [
            kernels.module.launch_args(c, s[1].scale_codes, cols=k, out=o)
            for c, s, o in zip(codes, sets, outs, strict=True)
        ]
        fn = kernels["dequant"]
        t = bench(lambda i, fn=fn, args=args: fn(*args[i % len(args)]), 20)
        nbytes = codes[0].numel() + b.scale_codes.numel() + outs[0].numel() * 2
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t_copy = bench(lambda i, dst=dst, src=src: dst.copy_(src), 20)
        name = f"dequantize kernel, {layout}"
        if variant is not None:
            name += f" {variant[0]}x{variant[1]}"
        text = (
            f"{tag}: {name:<28} {t * 1e6:9.1f} us "
            f"{nbytes / t / 1e9:7.0f} GB/s  x{t_copy / t:5.2f} copy of the same bytes"
        )
        print(text, flush=True)
        out.append(text)


def fused_launch(fa, fb, m: int, n: int, k: int, tile, sets) -> tuple:
    """(compiled function, its arguments per input set, label, note) of the fused kernel with
    ``tile``, bf16 out, the split-K ways fp4gen.gemm takes (one workspace for all calls)."""
    from fp4gen.codegen.gemm import SmallMTile, choose_splits, gemm_spec
    from fp4gen.runtime import kernels_for
    from fp4gen.runtime.cute_gemm import packed_codes

    spec = gemm_spec(fa, fb, m, out_dtype="bf16", tile=tile)
    t0 = time.perf_counter()
    kernels = kernels_for(spec, "sm_90a")
    load = time.perf_counter() - t0
    how = "compiled" if kernels.stats.compiled else "loaded from the cache"
    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    small = isinstance(tile, SmallMTile)
    extra: dict = {}
    label = f"fused {tile.name}"
    if small:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        splits = choose_splits(tile, m, n, k, sms)
        extra = {"splits": splits, "ws": kernels.module.workspace(m, n, splits, "cuda")}
        label += f" x{splits}"
    args = [
        kernels.module.launch_args(
            a.codes if small else packed_codes(a),
            a.scale_codes,
            a.global_scale,
            packed_codes(b),
            b.scale_codes,
            b.global_scale,
            k=k,
            out=c,
            **extra,
        )
        for a, b in sets
    ]
    return kernels["gemm"], args, label, f"  ({how} in {load:.1f} s)"


def host_steps(operands, picked, iters: int, host_line) -> None:
    """CPU time of the parts of one fp4gen.gemm call (each timed alone, best of 3)."""
    from fp4gen.compiler.jit import detect_arch
    from fp4gen.runtime.cute_gemm import fused_gemm

    a, b = operands
    fn, args = picked
    dev = a.device
    kw = dict(out_dtype=torch.bfloat16, bias=None, accumulate=None, arch=detect_arch())
    steps = {
        "  dispatch (auto_backend)": lambda i: auto_backend(a, b),
        "  cute_gemm.fused_gemm": lambda i: fused_gemm(a, b, **kw),
        "  compiled function alone": lambda i: fn(*args[0]),
        "  torch.empty (the output)": lambda i: torch.empty(
            (a.rows, b.rows), dtype=torch.bfloat16, device=dev
        ),
        "  current_stream(device)": lambda i: torch.cuda.current_stream(dev).cuda_stream,
        "  global_scale.view(1)": lambda i: a.global_scale.view(1),
    }
    for name, step in steps.items():
        host_line(name, host_time(step, iters))


def fp8_variant_flags(text: str) -> tuple:
    """``--fp8-variant``: comma-separated of overlap, c2 (2-CTA clusters), coalesced (or its
    halves mn, ws), n192; the flags of ``_FLAGS`` (unnamed: off, 1, 128)."""
    words = {w for w in text.split(",") if w}
    unknown = words - {"overlap", "c2", "coalesced", "mn", "ws", "n192"}
    if unknown:
        raise SystemExit(f"--fp8-variant: unknown {sorted(unknown)}")
    coalesced = "coalesced" in words
    return (
        "overlap" in words,
        2 if "c2" in words else 1,
        coalesced or "mn" in words,
        coalesced or "ws" in words,
        192 if "n192" in words else 128,
    )


def profile_shape(m: int, n: int, k: int, fmt_name: str, calls: int, fp8_variant: str = "") -> None:
    """Only the fused kernel fp4gen.gemm picks, ``calls`` launches (for a profiler); for the
    FP8 pairs the generated FP8 kernel, of the variant ``fp8_variant`` names."""
    from fp4gen.codegen.gemm import pick_tile

    fa, fb = FORMATS[fmt_name]
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    sets = [(operand(m, k, fa, g), operand(n, k, fb, g))]
    if fused_support(fa, fb) is not None and fp8_gemm.cute_support(fa, fb) is None:
        with FP8Flags(fp8_variant_flags(fp8_variant)):
            fn, args, _ = fp8_gemm.cute_launch(*sets[0], out_dtype=torch.bfloat16)
            name = fp8_gemm.cute_plan(fa, fb, torch.bfloat16, False, False).params.name
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
        print(f"{m}x{n}x{k} {fmt_name}: {name}: {calls} launches", flush=True)
        return
    fn, args, label, _ = fused_launch(fa, fb, m, n, k, pick_tile(m), sets)
    for _ in range(calls):
        fn(*args[0])
    torch.cuda.synchronize()
    print(f"{m}x{n}x{k} {fmt_name}: {label}: {calls} launches", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help=f"MxNxK,... (default {SHAPES})")
    ap.add_argument(
        "--formats",
        default="nvfp4",
        help=f"comma-separated, of {', '.join(FORMATS)} (default nvfp4)",
    )
    ap.add_argument(
        "--tiles", default="", help="more fused tiles to time (names in TILES or CANDIDATES)"
    )
    ap.add_argument("--no-dequant", action="store_true", help="skip dequantize + cuBLAS")
    ap.add_argument(
        "--dequant-units",
        default="",
        help="also time the dequantize kernel rendered with UNITxUNITS_PER_THREAD, e.g. 16x4",
    )
    ap.add_argument(
        "--host-detail", action="store_true", help="also time the parts of one fp4gen.gemm call"
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="only launch the fused kernel N times per shape (for ncu / nsys); FP8 pairs: "
        "the generated FP8 kernel",
    )
    ap.add_argument(
        "--fp8-variant",
        default="",
        help="with --profile: the FP8 kernel's variant, comma-separated of overlap, c2, "
        "coalesced (or mn, ws), n192 (default: the row-major one, one partial, one CTA)",
    )
    ap.add_argument(
        "--fp8-prepared",
        action="store_true",
        help="FP8 pairs: auto keeps prepared calls (gemm_dispatch.set_fp8_prepared, the "
        "default; kept for older command lines), so 'host time of fp4gen.gemm' times them",
    )
    ap.add_argument(
        "--fp8-full-path",
        action="store_true",
        help="FP8 pairs: auto takes the whole dispatch every call "
        "(gemm_dispatch.set_fp8_prepared(False))",
    )
    ap.add_argument(
        "--warm",
        type=float,
        default=0.0,
        metavar="S",
        help="run each method S seconds before timing it (0.5: every figure at the clock the "
        "GPU sustains under load; default 0: figures of a GPU that may be at its boost clock)",
    )
    ap.add_argument("--log", default="", help="also write the result lines to this file")
    args = ap.parse_args()
    WARM_S[0] = args.warm
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    if args.fp8_prepared or args.fp8_full_path:
        from fp4gen.gemm_dispatch import set_fp8_prepared

        set_fp8_prepared(not args.fp8_full_path)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    lines: list[str] = []
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            m, n, k = (int(v) for v in shape.lower().split("x"))
            if args.profile:
                profile_shape(m, n, k, fmt, args.profile, args.fp8_variant)
                continue
            tiles = [t for t in args.tiles.split(",") if t]
            units = [
                tuple(int(v) for v in u.split("x")) for u in args.dequant_units.split(",") if u
            ]
            run_shape(m, n, k, fmt, lines, tiles, not args.no_dequant, args.host_detail, units)
    if args.log:
        Path(args.log).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
