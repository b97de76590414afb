"""Repeat the fused small-M GEMM under load and count the calls whose bits differ from the first.

    python benchmarks/gemm_stress.py [--procs 8] [--calls 1500] [--splits 1,2,4] [--m 32]

A fused GEMM must give the same bits on every call (its sums run in a fixed order, split-K
included). Races show only under load: this script starts ``--procs`` processes on one GPU at
once; each builds the same NVFP4 operands (A [M, 4096] 1x16, B [8192, 4096] 16x16, values spread
over 2^+-12 as tests/test_gemm_kernels_gpu.py's "wide" pattern), and for each split-K count
calls ``fp4gen.gemm(..., backend="cute")`` ``--calls`` times with and without accumulate,
comparing every result with its first and the first with the float64 reference's error bound.
Each process prints one line per configuration: calls, wrong calls, and where the first wrong
one differs (rows, columns). Exit status 1 when any call differed.

This is how the r32 tile's stage-reader defect was found (docs/gemm-sm90.md, "Every stage has
fixed readers"): 8 processes, 1,500 calls each, split-K 2 and 4 gave wrong calls in every
process before the fix.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

N, K = 8192, 4096


def operands(m: int):
    """A [m, K] (NVFP4 1x16) and B [N, K] (NVFP4 16x16), the "wide" pattern, seeded."""
    import torch

    from fp4gen.formats import BUILTIN_FORMATS
    from fp4gen.numerics import quantize

    nvfp4 = BUILTIN_FORMATS["nvfp4"]
    g = torch.Generator(device="cuda").manual_seed(m)

    def wide(rows: int) -> torch.Tensor:
        x = torch.randn(rows, K, generator=g, device="cuda")
        e = torch.randint(-12, 13, (rows, 1), generator=g, device="cuda").float()
        return x * torch.exp2(e)

    a = quantize(wide(m), nvfp4)
    b = quantize(wide(N), nvfp4.with_block((16, 16)), block=(16, 16))
    return a, b


def worker(m: int, calls: int, splits: list[int], tag: str) -> int:
    """One process's runs; the number of wrong calls."""
    import torch

    import fp4gen
    from fp4gen.numerics import gemm_reference
    from fp4gen.runtime import cute_gemm

    a, b = operands(m)
    acc = torch.randn(m, N, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda")
    ref = gemm_reference(a, b).double()
    va = a.dequantize_blockwise().double().abs()
    vb = b.dequantize_blockwise().double().abs()
    mag = (va @ vb.t()) * (float(a.global_scale) * float(b.global_scale))  # sum |a_k b_k|
    u = 2.0**-24
    wrong_total = 0
    chooser = cute_gemm.choose_splits
    try:
        for ways in splits:
            cute_gemm._splits.clear()
            cute_gemm.choose_splits = lambda *_args, ways=ways: ways
            for accumulate in (None, acc):
                kw = {} if accumulate is None else {"accumulate": accumulate}
                first = fp4gen.gemm(a, b, out_dtype=torch.float32, backend="cute", **kw)
                want = ref if accumulate is None else ref + accumulate.double()
                extra = 0.0 if accumulate is None else accumulate.double().abs()
                bound = 2 * u * K * mag + 8 * u * (want.abs() + extra) + 1e-30
                worst = float(((first.double() - want).abs() / bound).max())
                wrong, where = 0, ""
                for _ in range(calls):
                    got = fp4gen.gemm(a, b, out_dtype=torch.float32, backend="cute", **kw)
                    if not torch.equal(got, first):
                        wrong += 1
                        if not where:
                            d = (got != first).nonzero()
                            rows = sorted(set(d[:, 0].tolist()))
                            where = (
                                f"; first wrong call: {len(d)} elements, rows {rows[0]}-{rows[-1]}"
                                f", columns {int(d[:, 1].min())}-{int(d[:, 1].max())}"
                            )
                torch.cuda.synchronize()
                wrong_total += wrong + (worst > 1.0)
                print(
                    f"[{tag}] M={m} split-K {ways} {'accumulate' if kw else 'plain':10s} "
                    f"calls {calls}  wrong {wrong}  first call err/bound {worst:.3g}{where}",
                    flush=True,
                )
    finally:
        cute_gemm.choose_splits = chooser
    return wrong_total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=8, help="processes on the GPU at once (8)")
    ap.add_argument("--calls", type=int, default=1500, help="calls per configuration (1500)")
    ap.add_argument("--splits", default="1,2,4", help="split-K counts to force (1,2,4)")
    ap.add_argument("--m", type=int, default=32, help="rows of A: 17-32 take the r32 tile (32)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    splits = [int(s) for s in args.splits.split(",")]
    if args.worker is not None:
        return 1 if worker(args.m, args.calls, splits, args.worker) else 0
    base = [sys.executable, __file__, "--calls", str(args.calls), "--splits", args.splits]
    base += ["--m", str(args.m)]
    procs = [subprocess.Popen([*base, "--worker", f"p{i}"]) for i in range(args.procs)]
    codes = [p.wait() for p in procs]
    failed = sum(c != 0 for c in codes)
    print(f"{args.procs} processes, {failed} saw a wrong call" if failed else "no wrong call")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
