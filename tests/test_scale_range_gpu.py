"""Two-level scaling at the edges of the accepted range, generated kernels against the reference
bit for bit: wide scale formats that still take a global scale (ue7m0, e7m0, e5m2) and NVFP4,
at amaxes from where S_enc is capped at FLT_MAX (S_dec subnormal) to fp32's largest values
(docs/numerics.md, section 2.1).

Skipped without a CUDA GPU (marker ``gpu``); the kernels are compiled on first use.
"""

from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.formats import BUILTIN_FORMATS, E2M1, E4M3, E5M2, BlockFormat, ElementFormat, ScaleSpec
from fp4gen.numerics import quantize as reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

UE7M0 = ElementFormat(7, 0, signed=False)
E7M0 = ElementFormat(7, 0)

FORMATS = [
    BUILTIN_FORMATS["nvfp4"],
    BlockFormat("e5m2_ue7m0_up", E5M2, (1, 32), ScaleSpec(UE7M0, "up"), True),
    BlockFormat("e2m1_e7m0_rn", E2M1, (1, 16), ScaleSpec(E7M0, "nearest"), True),
    BlockFormat("e4m3_e5m2_down", E4M3, (1, 32), ScaleSpec(E5M2, "down"), True),
]
AMAXES = [1e-37, 1e-36, 1e-30, 1e-20, 1e-6, 62.0, 1e6, 1e30, 3.0e38]


@pytest.mark.parametrize("amax", AMAXES, ids=lambda a: f"{a:g}")
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_kernels_match_the_reference_across_amaxes(fmt: BlockFormat, amax: float) -> None:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(128, 256, generator=g, dtype=torch.float64)
    x = (x / x.abs().max() * amax).to(torch.float32)  # the tensor's amax is amax (rounded)
    want = reference(x, fmt)
    got = fp4gen.quantize(x.cuda(), fmt, backend="cute")
    assert torch.equal(
        got.global_scale.cpu().view(torch.int32), want.global_scale.view(torch.int32)
    )
    assert torch.equal(got.scale_codes.cpu(), want.scale_codes)
    assert torch.equal(got.codes.cpu(), want.codes)
    assert torch.isfinite(got.dequantize()).all()
