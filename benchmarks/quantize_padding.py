"""What the quantize kernels' zero-padding costs: an input whose shape the kernels refuse (K not
a multiple of their K, or M of a tile kernel's M) is padded, launched once and cut back
(docs/quantize-kernels.md, "Inputs of any M and K").

Per shape, in one run (CUDA, bf16, fp8 1x128 blocks; us per call, host time included, mean of
``--calls``): the rowwise copy through ``quantize_cute`` (padded where it must be) against the
torch reference, and the tile launch of both copies (rowwise + columnwise) through
``quantize_tile_cute`` against the copies one by one (what a refused tile launch ran before:
the rowwise copy and the columnwise one of ``x.t()``); a torch copy of x is the baseline.

    python benchmarks/quantize_padding.py [--shapes 8192x576,8100x640,8192x640] [--calls 20]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

from fp4gen.formats import E4M3, BlockFormat, ScaleSpec  # noqa: E402
from fp4gen.numerics.quantize import quantize as reference  # noqa: E402
from fp4gen.runtime.cute_backend import quantize_cute, quantize_tile_cute  # noqa: E402

FP8_1X128 = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec(None, "nearest"), False)


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192x576,8100x640,8192x640", help="MxK,...")
    parser.add_argument("--calls", type=int, default=20, help="timed calls per figure")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    fmt = FP8_1X128
    copies = (("rowwise", "nearest", None, 0), ("columnwise", "nearest", None, 1))
    print(f"fp8 1x128, bf16 input, us per call (mean of {args.calls}), host time included")
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        copy = per_call_us(lambda x=x: x.clone(), args.calls)

        def row(x=x):
            return quantize_cute(
                x, fmt, rounding="nearest", rht=None, seed=1, offset=0, required=True
            )

        def tile(x=x):
            return quantize_tile_cute(x, fmt, copies, seed=1)

        def one_by_one(x=x):
            row(x)
            return quantize_cute(
                x.t().contiguous(), fmt, rounding="nearest", rht=None, seed=1, offset=1,
                required=False,
            )  # fmt: skip

        rowwise, ref = per_call_us(row, args.calls), per_call_us(lambda x=x: reference(x, fmt), 3)
        both, separate = per_call_us(tile, args.calls), per_call_us(one_by_one, args.calls)
        print(
            f"  {m}x{k}: copy of x {copy:7.1f} | rowwise {rowwise:7.1f} "
            f"(reference {ref:8.1f}, {ref / rowwise:.1f}x) | row + col one launch {both:7.1f}, "
            f"one by one {separate:7.1f} ({separate / both:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
