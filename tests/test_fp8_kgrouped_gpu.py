"""The K-grouped block-scaled FP8 GEMM (fp4gen.runtime.fp8_kgrouped) on a Hopper GPU.

* Against the dense generated kernel (``fp4gen.gemm(..., backend="cute")``) per group, bit for
  bit: the K-grouped kernel is the dense class with ``k_grouped=True``; each group's K-blocks,
  wgmma and promotions are the dense kernel's in the same order, so no tolerance: unequal and
  empty groups, more tiles than SMs, fp32 and ue8m0 scales, bf16 / fp32 / fp16 outputs.
* In an experts module (fp8_blockwise, grouped=True, the K-grouped wgrad on): with the loop's
  dense GEMMs on the same generated kernel, a training step's output and every gradient equal
  the loop's bit for bit; the K-grouped kernel ran the wgrad of both projections.

Run on an sm_90 GPU: pytest -m gpu tests/test_fp8_kgrouped_gpu.py
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
from fp4gen.runtime import fp8_grouped, fp8_kgrouped

pytestmark = MARKS

MXFP8 = BUILTIN_FORMATS["mxfp8_e4m3"]
ROW = BlockFormat("fp8_test", E4M3, (1, 128), ScaleSpec(None))
# (format, output dtype, each group's K, M, N): fp8_blockwise's wgrad pair, MXFP8's ue8m0 1x32;
# empty groups first, between and last; M and N not whole tiles; more tiles than SMs
CASES = {
    "wgrad fp32": (ROW, torch.float32, [128, 0, 384, 1024], 200, 300),
    "wgrad bf16": (ROW, torch.bfloat16, [0, 256, 128, 0], 96, 1000),
    "mxfp8 ue8m0": (MXFP8, torch.bfloat16, [96, 32, 0, 160], 160, 130),
    "fp16": (ROW, torch.float16, [512, 128], 64, 64),
    "many tiles": (ROW, torch.bfloat16, [256] * 12, 1024, 768),
}


def operands(case: str):
    fmt, out_dtype, ks, m, n = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(len(case))

    def data(rows: int, k: int) -> torch.Tensor:  # normal values with a few outliers per row
        x = torch.randn(rows, k, device="cuda", generator=g)
        return x + 30 * (torch.rand(rows, k, device="cuda", generator=g) < 0.01)

    a = [fp4gen.quantize(data(m, k), fmt) if k else None for k in ks]
    b = [fp4gen.quantize(data(n, k), fmt) if k else None for k in ks]
    return a, b, out_dtype


@pytest.fixture(params=[True, False], ids=["coalesced", "row-major"])
def variant(request) -> Iterator[bool]:
    """Both K-grouped variants (MN-major scales and whole-sector stores, the default; row-major
    scales and the plain epilogue)."""
    previous = fp8_kgrouped.set_k_grouped_coalesced(request.param)
    yield request.param
    fp8_kgrouped.set_k_grouped_coalesced(previous)


@pytest.mark.parametrize("case", list(CASES))
def test_k_grouped_is_the_dense_kernel_per_group_bit_for_bit(case, variant) -> None:
    a, b, out_dtype = operands(case)
    got = fp8_kgrouped.k_grouped_block_scaled(a, b, out_dtype=out_dtype)
    m, n = next(q for q in a if q is not None).rows, next(q for q in b if q is not None).rows
    assert got.dtype == out_dtype and got.shape == (len(a), m, n)
    for g, (a_g, b_g) in enumerate(zip(a, b, strict=True)):
        if a_g is None:
            assert not got[g].any(), f"{case}: empty group {g} is not zero"
            continue
        want = gemm(a_g, b_g, backend="cute", out_dtype=out_dtype)
        assert torch.equal(got[g], want), f"{case}, group {g}: {(got[g] - want).abs().max()}"
    assert got.abs().sum() > 0


def test_global_scales_per_group() -> None:
    """S_a[g] S_b[g] per group in the epilogue: a NaN global scale makes its group NaN only."""
    a, b, out_dtype = operands("wgrad fp32")
    a[2].global_scale.fill_(float("nan"))
    got = fp8_kgrouped.k_grouped_block_scaled(a, b, out_dtype=out_dtype)
    assert got[2].isnan().all()
    assert not got[0].isnan().any() and not got[3].isnan().any()


# ----------------------------------------------------------------------------------------------
# In an experts module
# ----------------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")

from test_moe import routing, run  # noqa: E402
from test_moe_grouped import pair, unequal_routing  # noqa: E402

K_GROUPED = fp8_kgrouped.k_grouped_block_scaled  # the function itself, uncounted


@pytest.fixture
def k_grouped_calls(monkeypatch) -> Iterator[list]:
    """The K-grouped kernel's calls, with it (and the M-grouped kernel) on for the test."""
    calls: list = []
    previous = fp8_kgrouped.set_k_grouped_fp8(True)
    previous_m = fp8_grouped.set_grouped_fp8(True)

    def counted(a, b, **kw):
        out = K_GROUPED(a, b, **kw)
        calls.append((a, b, kw["out_dtype"]))
        return out

    monkeypatch.setattr(fp8_kgrouped, "k_grouped_block_scaled", counted)
    yield calls
    fp8_kgrouped.set_k_grouped_fp8(previous)
    fp8_grouped.set_grouped_fp8(previous_m)


@pytest.mark.parametrize("from_sides", [False, True])
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("routed", ["top2", "unequal", "every"])
def test_experts_step_equals_the_loop_on_the_same_kernel(
    arch, routed, from_sides, monkeypatch, k_grouped_calls
) -> None:
    """fp8_blockwise, bf16 model: the loop's dense GEMMs on the generated kernel; output, dx,
    the routing weights' gradient and every parameter's gradient equal the grouped path's bit
    for bit, with the wgrad of both projections one K-grouped launch each (2 calls); the
    launch's arguments from the groups or from the launches' side-by-side copies
    (``set_k_grouped_from_sides``)."""
    monkeypatch.setattr(fp8_kgrouped, "_from_sides", [from_sides])
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
    assert len(k_grouped_calls) == 2
    for a, b in zip(got[:3], want[:3], strict=True):
        assert torch.equal(a, b)
    for name, grad in want[3].items():
        assert torch.equal(got[3][name], grad), name
    assert got[0].abs().sum() > 0
