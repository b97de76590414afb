"""The cost of Mixture-of-Representations quantization on the GPU, against plain E4M3.

    python benchmarks/mor.py [--shapes 4096x4096,8192x8192] [--repeats 20] [--no-reference]
                             [--no-wide]

For each bf16 input shape it times, with CUDA events (median of ``--repeats`` after a warm-up):

* ``copy``: torch copying the input (read + write of the same bytes), the memory-bound floor;
* ``e4m3``: fp4gen's generated E4M3 quantize kernel (MXFP8: 1x32 blocks, ue8m0 scales rounded
  up; the reference ``quantize`` on the GPU if the kernel is unavailable);
* each shipped MoR recipe through its generated kernels (``run``: output allocation and every
  launch: amax, scales, then quantize, or measure / decide / emit for tensor-level decisions),
  with the time of each kernel on its own, and (unless ``--no-wide``) the same with 256-thread
  CTAs (8 row segments per thread instead of 4);
* (unless ``--no-reference``) the MoR reference ``fp4gen.numerics.mor`` in torch ops on the GPU.

and prints the ratios MoR / E4M3 and MoR / copy. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

from benchmarks.common import cuda_time_ms, require_cuda  # noqa: E402
from fp4gen.codegen.mor import MoRKernelSpec  # noqa: E402
from fp4gen.dsl import load_recipe  # noqa: E402
from fp4gen.formats import BUILTIN_FORMATS  # noqa: E402
from fp4gen.numerics import quantize  # noqa: E402
from fp4gen.numerics.mor import mor_quantize  # noqa: E402
from fp4gen.runtime.mor_kernels import mor_kernels_for  # noqa: E402

RECIPES = ("mor_tensor", "mor_subtensor_2way", "mor_subtensor_3way")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]  # type: ignore[misc]


def e4m3_quantizer(x: torch.Tensor):
    """(label, callable) of the plain E4M3 quantization of x: the generated kernel if it loads."""
    fmt = BUILTIN_FORMATS["mxfp8_e4m3"]
    try:
        from fp4gen.runtime.cute_backend import spec_for
        from fp4gen.runtime.kernels import kernels_for

        kernels = kernels_for(spec_for(fmt, "nearest", None, x.dtype))
        kernels.run(x)
        return "e4m3 kernel (mxfp8 1x32)", lambda: kernels.run(x)
    except Exception as err:  # the benchmark still measures MoR; say what was compared
        print(f"  (the generated e4m3 kernel is unavailable: {err}; using the reference)")
        return "e4m3 reference (mxfp8 1x32)", lambda: quantize(x, fmt)


def bench_shape(shape: tuple[int, int], repeats: int, reference: bool, wide: bool) -> list[str]:
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    nbytes = x.numel() * x.element_size()
    y = torch.empty_like(x)
    copy_ms = cuda_time_ms(lambda: y.copy_(x), repeats=repeats)
    label, e4m3 = e4m3_quantizer(x)
    e4m3_ms = cuda_time_ms(e4m3, repeats=repeats)
    head = f"{shape[0]}x{shape[1]} bf16 ({nbytes / 2**20:.0f} MiB)"
    lines = [
        f"{head}: copy {copy_ms:.3f} ms ({2 * nbytes / copy_ms / 1e6:.0f} GB/s), "
        f"{label} {e4m3_ms:.3f} ms ({e4m3_ms / copy_ms:.2f}x copy)"
    ]
    print(lines[0], flush=True)
    for name in RECIPES:
        rule = load_recipe(f"{name}.fp4r").mors[0]
        kernels = mor_kernels_for(MoRKernelSpec(rule))
        mor_ms = cuda_time_ms(lambda k=kernels: k.run(x), repeats=repeats)
        _, plan = kernels.module.launches(x)
        parts = []
        for kernel, args in plan:
            fn = kernels.fns[kernel]
            ms = cuda_time_ms(lambda fn=fn, args=args: fn(*args), repeats=repeats)
            parts.append(f"{kernel} {ms:.3f}")
        line = (
            f"  {name}: {mor_ms:.3f} ms = {mor_ms / e4m3_ms:.2f}x e4m3, "
            f"{mor_ms / copy_ms:.2f}x copy [{', '.join(parts)} ms]"
        )
        if wide:
            s8 = mor_kernels_for(MoRKernelSpec(rule, segments=8))
            s8_ms = cuda_time_ms(lambda k=s8: k.run(x), repeats=repeats)
            line += f"; 256-thread CTAs (8 rows per thread) {s8_ms:.3f} ms"
        if reference:
            ref_ms = cuda_time_ms(lambda r=rule: mor_quantize(x, r), warmup=1, repeats=3)
            line += f"; reference {ref_ms:.1f} ms ({ref_ms / mor_ms:.0f}x the kernels)"
        print(line, flush=True)
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4096x4096,8192x8192")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument(
        "--no-wide", action="store_true", help="skip the 256-thread-CTA variant (8 rows per thread)"
    )
    args = parser.parse_args(argv)
    require_cuda()
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    lines = []
    for shape in parse_shapes(args.shapes):
        lines += bench_shape(shape, args.repeats, not args.no_reference, not args.no_wide)
    print("\nsummary")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
