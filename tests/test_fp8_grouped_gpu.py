"""The grouped block-scaled FP8 GEMM (fp4gen.runtime.fp8_grouped) on a Hopper GPU.

* Against the dense generated kernel (``fp4gen.gemm(..., backend="cute")``) per group, bit for
  bit: the grouped kernel is the dense class with ``grouped=True``; each output element's
  K-blocks, wgmma and promotions are the dense kernel's in the same order, whatever row of a
  tile it sits in, so no tolerance: unequal and empty groups, more tiles than SMs, e4m3 / e5m2,
  fp32 and ue8m0 scales, 1xN and NxN B, a bias, bf16 / fp32 / fp16 outputs.
* In an experts module (fp8_blockwise, grouped=True): with the loop's dense GEMMs on the same
  generated kernel, a training step's output and every gradient equal the loop's bit for bit
  (the operands are the loop's bits; fprop and dgrad grouped, wgrad per expert); with the loop's
  default (scaled_mm, cuBLAS), every grouped product is within numerics.md 6.1's bound of the
  float64 block-scaled reference, as scaled_mm's is (the bound of tests/test_fp8_gemm_sm90_gpu).

Run on an sm_90 GPU: pytest -m gpu tests/test_fp8_grouped_gpu.py
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from sm90_fp8 import E4M3, MARKS

import fp4gen
import fp4gen.runtime.linear as linear_module
from fp4gen.formats import BUILTIN_FORMATS, BlockFormat, ScaleSpec
from fp4gen.gemm_dispatch import gemm
from fp4gen.numerics import gemm_block_scaled_reference
from fp4gen.runtime import fp8_grouped

pytestmark = MARKS

E5M2 = BUILTIN_FORMATS["mxfp8_e5m2"].element
MXFP8 = BUILTIN_FORMATS["mxfp8_e4m3"]


def fp8(element, block: tuple[int, int]) -> BlockFormat:
    return BlockFormat("fp8_test", element, block, ScaleSpec(None))


ROW, TILE = fp8(E4M3, (1, 128)), fp8(E4M3, (128, 128))
# (A, B, output dtype, bias, group sizes, N, K): the fp8_blockwise pairs, e5m2 x e4m3, MXFP8's
# ue8m0 1x32, 1x64 blocks; N and K not whole tiles / blocks; empty groups first, between and
# last; one case with more tiles than SMs
CASES = {
    "fprop bf16": (ROW, TILE, torch.bfloat16, False, [0, 1, 300, 129, 0, 64], 200, 320),
    "fprop bias": (ROW, TILE, torch.bfloat16, True, [5, 0, 260], 384, 256),
    "wgrad fp32": (ROW, ROW, torch.float32, False, [128, 7, 0], 96, 1000),
    "e5m2 x e4m3 bias fp32": (fp8(E5M2, (1, 128)), ROW, torch.float32, True, [33, 200], 144, 384),
    "mxfp8 ue8m0": (MXFP8, MXFP8, torch.bfloat16, True, [70, 0, 1, 129], 160, 160),
    "1x64 fp16": (fp8(E4M3, (1, 64)), fp8(E4M3, (64, 64)), torch.float16, False, [3, 90], 64, 192),
    "many tiles": (ROW, TILE, torch.bfloat16, False, [0, 4000, 3, 2500, 0], 1024, 512),
}


def operands(case: str):
    fa, fb, out_dtype, with_bias, sizes, n, k = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(len(case))

    def data(rows: int) -> torch.Tensor:  # normal values with a few outliers per row
        x = torch.randn(rows, k, device="cuda", generator=g)
        return x + 30 * (torch.rand(rows, k, device="cuda", generator=g) < 0.01)

    a = [fp4gen.quantize(data(m), fa) if m else None for m in sizes]
    b = [fp4gen.quantize(data(n), fb) for _ in sizes]
    bias = torch.randn(len(sizes), n, device="cuda", generator=g) if with_bias else None
    return a, b, out_dtype, bias, sizes


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_is_the_dense_kernel_per_group_bit_for_bit(case) -> None:
    a, b, out_dtype, bias, sizes = operands(case)
    got = fp8_grouped.grouped_block_scaled(a, b, out_dtype=out_dtype, bias=bias)
    assert got.dtype == out_dtype and got.shape == (sum(sizes), b[0].rows)
    start = 0
    for g, (a_g, b_g) in enumerate(zip(a, b, strict=True)):
        if a_g is None:
            continue
        bias_g = None if bias is None else bias[g]
        want = gemm(a_g, b_g, backend="cute", out_dtype=out_dtype, bias=bias_g)
        rows = got[start : start + a_g.rows]
        assert torch.equal(rows, want), f"{case}, group {g}: {(rows - want).abs().max()}"
        start += a_g.rows
    assert got.abs().sum() > 0


def test_global_scales_per_group() -> None:
    """S_a[g] S_b[g] per group in the epilogue: a NaN global scale (an input that held a NaN)
    makes its group's rows NaN and no other's."""
    a, b, out_dtype, bias, sizes = operands("fprop bf16")
    a[2].global_scale.fill_(float("nan"))
    got = fp8_grouped.grouped_block_scaled(a, b, out_dtype=out_dtype, bias=bias)
    offsets = fp8_grouped.offsets_of(sizes)
    assert got[offsets[2] : offsets[3]].isnan().all()
    assert not got[: offsets[2]].isnan().any() and not got[offsets[3] :].isnan().any()


# ----------------------------------------------------------------------------------------------
# In an experts module
# ----------------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")

from test_moe import routing, run  # noqa: E402
from test_moe_grouped import pair, unequal_routing  # noqa: E402

GROUPED = fp8_grouped.grouped_block_scaled  # the function itself, uncounted


@pytest.fixture
def grouped_calls(monkeypatch) -> Iterator[list]:
    """The grouped kernel's calls (each: the groups' A and B, the output dtype, the result),
    with the grouped kernel turned on for the test."""
    calls: list = []
    previous = fp8_grouped.set_grouped_fp8(True)

    def counted(a, b, **kw):
        out = GROUPED(a, b, **kw)
        calls.append((a, b, kw["out_dtype"], out))
        return out

    monkeypatch.setattr(fp8_grouped, "grouped_block_scaled", counted)
    yield calls
    fp8_grouped.set_grouped_fp8(previous)


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
# "every": no expert empty, the grouped launches' wholes and S_dec tables are the kernel's
# arguments (a strided S_dec column once failed the launch)
@pytest.mark.parametrize("routed", ["top2", "unequal", "every"])
def test_experts_step_equals_the_loop_on_the_same_kernel(
    arch, routed, monkeypatch, grouped_calls
) -> None:
    """fp8_blockwise, bf16 model: the loop's dense GEMMs on the generated kernel; output, dx,
    the routing weights' gradient and every parameter's gradient (gpt-oss: biases, transposed
    weights) equal the grouped path's bit for bit; the grouped kernel ran fprop and dgrad of
    both projections (4 calls)."""
    monkeypatch.setattr(linear_module, "gemm", lambda a, b, **kw: gemm(a, b, backend="cute", **kw))
    loop, group = pair(arch, torch.bfloat16, "fp8_blockwise", device="cuda")
    if routed == "unequal":
        index, weights = unequal_routing()
    else:
        index, weights = routing(40, empty=1 if routed == "top2" else None)
    hidden = torch.randn(index.shape[0], 64).to(torch.bfloat16).cuda()
    index, weights = index.cuda(), weights.to(torch.bfloat16).cuda()
    want = run(loop, hidden, index, weights)
    got = run(group, hidden, index, weights)
    assert len(grouped_calls) == 4
    for a, b in zip(got[:3], want[:3], strict=True):
        assert torch.equal(a, b)
    for name, grad in want[3].items():
        assert torch.equal(got[3][name], grad), name
    assert got[0].abs().sum() > 0


def test_experts_products_within_the_bound_of_the_default_loop(grouped_calls) -> None:
    """With the loop's default dense GEMM (scaled_mm): the grouped path's operands are the
    loop's bits, and each product the grouped kernel computed (asked again in fp32) is within
    numerics.md 6.1's bound plus the tensor cores' in-block term of the float64 block-scaled
    reference, the bound scaled_mm's products meet (tests/test_fp8_gemm_sm90_gpu.py: bound)."""
    from test_fp8_gemm_sm90_gpu import bound, check_within

    loop, group = pair("qwen3_moe", torch.bfloat16, "fp8_blockwise", device="cuda")
    index, weights = unequal_routing()
    hidden = torch.randn(index.shape[0], 64).to(torch.bfloat16).cuda()
    index, weights = index.cuda(), weights.to(torch.bfloat16).cuda()
    run(loop, hidden, index, weights)
    run(group, hidden, index, weights)
    assert len(grouped_calls) == 4
    for a, b, _, _ in grouped_calls:
        c = GROUPED(a, b, out_dtype=torch.float32)
        start = 0
        for a_g, b_g in zip(a, b, strict=True):
            ref = gemm_block_scaled_reference(a_g, b_g)
            rows = c[start : start + a_g.rows]
            check_within(rows, ref, bound(a_g, b_g, ref, torch.float32), "grouped product")
            start += a_g.rows
