"""A columnwise tile copy with an RHT whose last block reaches past M (the recipe fuzzer's GPU
finding, seed 20251 cases 49-52 and 90): the strip loads rows past M as duplicates of row M - 1,
which leave a plain block amax unchanged, but transformed they are not zero, so the kernels must
give the RHT the zero padding the reference transforms (docs/numerics.md 3). Each case against
the reference bit for bit (codes, scales, global scale), with the fuzz harness's comparison."""

from __future__ import annotations

import random

import pytest
import torch

from fp4gen.compiler.spec import QuantKernelSpec, QuantOutput
from fp4gen.dsl.model import RHTSpec
from fp4gen.formats import E2M1, E3M2, E4M3, UE8M0, ScaleSpec
from tests.test_recipe_fuzz_gpu import differences, kernel_copies, make_input, reference_copies

ON_GPU = torch.cuda.is_available()
MX = ScaleSpec(UE8M0, "up")
NV = ScaleSpec(E4M3)
RHT16 = RHTSpec(16)

CASES = {
    # (element, scale, global amax, outputs); blocks 1x32 along M, the RHT 16 rows
    "mx_e3m2_col_rz": (E3M2, MX, False, (("columnwise", "zero"),)),
    "mx_e2m1_col_sr16": (E2M1, MX, False, (("columnwise", "stochastic16"),)),
    "nv_e2m1_global_col_rne": (E2M1, NV, True, (("columnwise", "nearest"),)),
    "nv_e2m1_global_row_sr_col_sr": (
        E2M1,
        NV,
        True,
        (("rowwise", "stochastic"), ("columnwise", "stochastic")),
    ),
}


def tail_spec(name: str) -> QuantKernelSpec:
    element, scale, global_scale, outs = CASES[name]
    outputs = tuple(
        QuantOutput(d, r, RHT16 if d == "columnwise" else None)  # type: ignore[arg-type]
        for d, r in outs
    )
    return QuantKernelSpec(element, (1, 32), scale, global_scale, "bf16", outputs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [80, 48, 16, 128, 112])
@pytest.mark.parametrize("name", sorted(CASES))
def test_columnwise_rht_tail_matches_the_reference(name: str, rows: int) -> None:
    spec = tail_spec(name)
    rnd = random.Random(f"tail/{name}/{rows}")
    x = make_input((rows, 64), "cpu", rnd)
    # a large row at the end: its duplicates, transformed, would exceed the block's amax
    x[-1] = x[-1].abs() * 8
    offsets = tuple(7 * i for i in range(len(spec.outputs)))
    want = reference_copies(spec, x, 11, offsets)
    got = kernel_copies(spec, x.cuda(), 11, offsets, "cute")
    torch.cuda.synchronize()
    bad = [
        d
        for i, (g, w) in enumerate(zip(got, want, strict=True))
        for d in differences(g, w, f"copy {i}")
    ]
    assert not bad, bad[:6]
