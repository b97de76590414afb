"""The reference numerics give the same bits on CUDA as on CPU (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from fp4gen.dsl.model import RHTSpec
from fp4gen.formats import E2M1, E2M3, E3M2, E4M3, E5M2, UE8M0, ElementFormat
from fp4gen.numerics import (
    decode,
    encode,
    encode_scale,
    error_stats,
    gemm_reference,
    grid_values,
    inverse_rht,
    quantize,
    random_bits,
    random_words,
    rht,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def data(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) / torch.rand(rows, cols, generator=g).clamp_min(1e-3)
    x = x * torch.exp2(torch.randint(-10, 10, (rows, 1), generator=g).float())
    x[3, 5] = 1e5  # outlier: subnormal and zero e4m3 scales elsewhere
    x[7, :40] = 0.0
    return x


FORMATS = [E2M1, E2M3, E3M2, E4M3, E5M2, UE8M0, ElementFormat(3, 4), ElementFormat(6, 1)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_minifloat_cuda(fmt: ElementFormat) -> None:
    codes = torch.arange(1 << fmt.bits, dtype=torch.uint8)
    assert torch.equal(
        decode(codes.cuda(), fmt).cpu().nan_to_num(7.0), decode(codes, fmt).nan_to_num(7.0)
    )
    g = grid_values(fmt).double()
    mids = ((g[:-1] + g[1:]) / 2).float()
    y = torch.cat([g.float(), mids, mids.nextafter(torch.tensor(0.0)), data(16, 64, 1).reshape(-1)])
    y = torch.cat([y, -y])
    bits = random_bits(y.numel(), 5)
    for rounding in ("nearest", "zero", "stochastic"):
        cpu = encode(y, fmt, rounding, bits)  # type: ignore[arg-type]
        gpu = encode(y.cuda(), fmt, rounding, bits.cuda())  # type: ignore[arg-type]
        assert torch.equal(gpu.cpu(), cpu), rounding
    for mode in ("nearest", "up", "down"):
        assert torch.equal(
            encode_scale(y.abs().cuda(), fmt, mode).cpu(), encode_scale(y.abs(), fmt, mode)
        )


def test_philox_and_rht_cuda() -> None:
    for seed, offset in [(0, 0), (2**64 - 1, 12345), (0xDEADBEEF, 2**40)]:
        assert torch.equal(
            random_bits(100_003, seed, offset, device="cuda").cpu(),
            random_bits(100_003, seed, offset),
        )
    idx = torch.tensor([0, 7, (5 << 34) + 6, 2**63 - 1])
    assert torch.equal(random_words(idx.cuda(), 3, 9).cpu(), random_words(idx, 3, 9))
    x = data(64, 512, 2)
    for spec in (RHTSpec(16), RHTSpec(256, "seeded", None, 4), RHTSpec(2, "none", None, None)):
        assert torch.equal(rht(x.cuda(), spec).cpu(), rht(x, spec))
        assert torch.equal(inverse_rht(x.cuda(), spec).cpu(), inverse_rht(x, spec))


CASES = [
    ("nvfp4", None, "nearest", None),
    ("nvfp4", (16, 16), "nearest", None),
    ("nvfp4", None, "stochastic", None),
    ("nvfp4", None, "stochastic", 16),
    ("mxfp4", None, "nearest", None),
    ("mxfp6_e3m2", None, "zero", None),
    ("mxfp8_e4m3", None, "stochastic", None),
    ("mxfp8_e5m2", None, "nearest", 32),
]


@pytest.mark.parametrize("name,block,rounding,had", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_cuda_matches_cpu(name, block, rounding, had, dtype) -> None:
    x = data(272, 304 if had != 32 else 320, 3).to(dtype)
    kw = dict(block=block, rounding=rounding, hadamard=had, seed=77, offset=3)
    cpu, gpu = quantize(x, name, **kw), quantize(x.cuda(), name, **kw)
    assert gpu.codes.is_cuda
    assert torch.equal(gpu.codes.cpu(), cpu.codes)
    assert torch.equal(gpu.scales.cpu(), cpu.scales)
    assert torch.equal(gpu.scale_codes.cpu(), cpu.scale_codes)
    assert gpu.global_scale.item() == cpu.global_scale.item()
    assert torch.equal(gpu.data.cpu(), cpu.data)
    assert torch.equal(gpu.swizzled_scales().cpu(), cpu.swizzled_scales())
    assert torch.equal(gpu.dequantize(rotated=True).cpu(), cpu.dequantize(rotated=True))
    assert torch.equal(gpu.dequantize().cpu(), cpu.dequantize())
    if block == (16, 16):
        assert torch.equal(gpu.transpose().codes.cpu(), cpu.transpose().codes)
    s_gpu, s_cpu = error_stats(x.cuda(), gpu), error_stats(x, cpu)
    assert s_gpu.saturated == s_cpu.saturated and s_gpu.flushed == s_cpu.flushed
    assert s_gpu.rel_error == pytest.approx(s_cpu.rel_error, rel=1e-12)


def test_gemm_cuda() -> None:
    a, b = data(96, 256, 4), data(80, 256, 5)
    qa, qb = quantize(a, "nvfp4"), quantize(b, "nvfp4", block=(16, 16))
    ga, gb = quantize(a.cuda(), "nvfp4"), quantize(b.cuda(), "nvfp4", block=(16, 16))
    # FP4 x e4m3 partial products are exact in float64 and so is their sum, in any order.
    assert torch.equal(gemm_reference(ga, gb).cpu(), gemm_reference(qa, qb))
