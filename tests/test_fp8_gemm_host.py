"""The FP8 GEMM path's cached host pieces (fp4gen.runtime.fp8_gemm), on the CPU: B's scaled_mm
operands converted once per weight and again after any in-place change, the format checks
remembered per pair of format objects, the torch build checked once; every cached value equal
to what the uncached path computes."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import fp4gen
from fp4gen import gemm_dispatch
from fp4gen.compiler import jit
from fp4gen.formats import BUILTIN_FORMATS, BlockFormat, ScaleSpec
from fp4gen.numerics import gemm_block_scaled_reference, quantize
from fp4gen.runtime import fp8_gemm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import host_keys  # noqa: E402  (its OpCount: the aten ops a call issues)

E4M3 = BUILTIN_FORMATS["mxfp8_e4m3"].element
ROW = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec(None))
TILE = ROW.with_block((128, 128))


def fresh_b_operand(b, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``b_operand`` computed before it remembered anything."""
    mat_b = fp8_gemm.fp8_codes(b, rows, cols).t()
    folded = b.global_scale.to(torch.float32)
    if b.format.block == (128, 128):
        return mat_b, fp8_gemm.tile_scales(b.scales, folded)
    return mat_b, fp8_gemm.outer_major_scales(b.scales, rows, folded)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of an FP8 or fp32 tensor, comparable bit for bit (NaN included)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


@pytest.mark.parametrize("fmt, shape", [(TILE, (256, 384)), (ROW, (200, 300)), (TILE, (72, 100))])
def test_b_operand_is_converted_once_per_weight_version(fmt, shape) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(1)
    b = quantize(torch.randn(n, k, generator=g), fmt)
    rows, cols = fp8_gemm.round_up(n, 16), fp8_gemm.round_up(k, 128)
    first = fp8_gemm.b_operand(b, rows, cols)
    again = fp8_gemm.b_operand(b, rows, cols)
    assert again[0] is first[0] and again[1] is first[1]  # kept: no conversion, no launch
    want = fresh_b_operand(b, rows, cols)
    for got, expected in zip(first, want, strict=True):
        assert got.stride() == expected.stride()
        assert torch.equal(_bits(got), _bits(expected))

    b.scales.mul_(2.0)  # an in-place change of each kept input is seen
    assert torch.equal(
        _bits(fp8_gemm.b_operand(b, rows, cols)[1]), _bits(fresh_b_operand(b, rows, cols)[1])
    )
    b.global_scale.fill_(float("nan"))  # a NaN input: S_dec NaN, folded into every scale
    assert fp8_gemm.b_operand(b, rows, cols)[1][: (k + 127) // 128].isnan().all()
    b.codes.zero_()
    assert (fp8_gemm.b_operand(b, rows, cols)[0].view(torch.uint8) == 0).all()


def test_operands_use_the_kept_b_and_convert_a_per_call() -> None:
    g = torch.Generator().manual_seed(2)
    b = quantize(torch.randn(256, 256, generator=g), TILE)
    a1 = quantize(torch.randn(64, 256, generator=g), ROW)
    a2 = quantize(torch.randn(64, 256, generator=g), ROW)
    o1, o2 = fp8_gemm.Operands(a1, b), fp8_gemm.Operands(a2, b)
    assert o1.scale_b is o2.scale_b and o1.mat_b is o2.mat_b
    assert not torch.equal(o1.scale_a, o2.scale_a)
    assert torch.equal(o2.scale_a, fp8_gemm.outer_major_scales(a2.scales, 64, a2.global_scale))


def test_format_checks_are_remembered_per_format_object() -> None:
    fp8_gemm._support_ids.clear()
    assert fp8_gemm.support(ROW, TILE) is None
    assert (id(ROW), id(TILE)) in fp8_gemm._support_ids
    twin = BlockFormat("fp8_block", E4M3, (1, 64), ScaleSpec(None))
    assert "1x64 blocks" in fp8_gemm.support(twin, TILE)
    assert fp8_gemm.support(ROW, TILE) is None  # the other pair's entry did not replace it
    fp8_gemm._cute_support_ids.clear()
    assert fp8_gemm.cute_support(twin, twin.with_block((64, 64))) is None
    assert "1x64 needs" in fp8_gemm.cute_support(twin, TILE)


def test_torch_build_is_checked_once() -> None:
    with mock.patch.object(fp8_gemm, "_torch_reason", []):
        with mock.patch.object(fp8_gemm, "_find_torch_reason", return_value="why") as find:
            assert fp8_gemm.torch_reason() == "why"
            assert fp8_gemm.torch_reason() == "why"
        assert find.call_count == 1


def stand_in_product(mat_a, mat_b, scale_a, scale_b) -> torch.Tensor:
    """The block-scaled product of scaled_mm's operands, as cuBLASLt computes it (float64)."""
    qa = mat_a.float()
    qb = mat_b.t().float()
    sa = scale_a[: qa.shape[0]].double().repeat_interleave(128, 1)[:, : qa.shape[1]]
    sb = scale_b.t()[:, : qa.shape[1] // 128].double()
    sb = sb.repeat_interleave(128, 0).repeat_interleave(128, 1)[: qb.shape[0], : qa.shape[1]]
    return (qa.double() * sa) @ (qb.double() * sb).t()


def cuda_stood_in(stack: contextlib.ExitStack, scaled_mm) -> None:
    """The FP8 path on CPU tensors: an sm_90a device, the torch build accepted, ``scaled_mm``
    in place of F.scaled_mm."""
    stack.enter_context(mock.patch.dict(jit._archs, {0: "sm_90a"}))
    stack.enter_context(
        mock.patch.object(fp8_gemm, "one_cuda_device", lambda a, b, w: torch.device("cpu"))
    )
    stack.enter_context(mock.patch.object(fp8_gemm, "torch_reason", lambda: None))
    stack.enter_context(mock.patch.object(fp8_gemm.F, "scaled_mm", scaled_mm, create=True))


@pytest.mark.parametrize("m", [128, 100])  # 100: M padded to 112 for scaled_mm
def test_out_is_written_by_the_op_where_nothing_follows_the_product(m: int) -> None:
    """fp4gen.gemm(..., out=t) on the fp8_blockwise pair (CUDA stood in): where the product
    is the result (no fp32 step after it, M and N unpadded) the op's out variant writes it
    into t (``scaled_mm_into``: a layer graph then copies nothing), else F.scaled_mm's result
    is copied into t; t is returned with the bits of the call without ``out``."""
    g = torch.Generator().manual_seed(m)
    b = quantize(torch.randn(256, 384, generator=g), TILE)
    a = quantize(torch.randn(m, 384, generator=g), ROW)
    for q in (a, b):
        q.__dict__["device"] = torch.device("cuda", 0)
    calls: list[str] = []

    def scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kwargs):
        calls.append("functional")
        return stand_in_product(mat_a, mat_b, scale_a, scale_b).to(kwargs["output_dtype"])

    def out_op(mat_a, mat_b, scales_a, recipes_a, swz_a, scales_b, recipes_b, swz_b, bias,
               dtype, dims, fast, *, out):  # fmt: skip
        calls.append("out")
        assert recipes_a == [fp8_gemm._recipe(ROW).value] and swz_a == swz_b == [] == dims
        assert recipes_b == [fp8_gemm._recipe(TILE).value] and not fast and dtype == out.dtype
        return out.copy_(stand_in_product(mat_a, mat_b, scales_a[0], scales_b[0]))

    with contextlib.ExitStack() as stack:
        cuda_stood_in(stack, scaled_mm)
        stack.enter_context(mock.patch.object(fp8_gemm, "scaled_mm_out_op", lambda: out_op))
        # out is a CPU tensor standing in for one on the operands' (stood-in) CUDA device
        stack.enter_context(mock.patch.object(gemm_dispatch, "check_out", lambda *args: None))
        want = fp4gen.gemm(a, b, out_dtype=torch.float32, backend="block_scaled")
        buf = torch.full((m, 256), float("nan"))
        got = fp4gen.gemm(a, b, out_dtype=torch.float32, backend="block_scaled", out=buf)
    assert got is buf and torch.equal(buf, want)
    assert calls == ["functional", "out" if m % 16 == 0 else "functional"]


def test_a_call_with_a_known_weight_launches_only_the_a_scale_pass_and_the_gemm() -> None:
    """fp4gen.gemm on the fp8_blockwise pair with CUDA stood in for (CPU tensors, scaled_mm
    replaced by the oracle): the same result as before the caching, and per call after the
    first one elementwise pass (A's scales) besides the GEMM: B's scales (zero fill + fold)
    are not converted again."""
    g = torch.Generator().manual_seed(3)
    b = quantize(torch.randn(256, 384, generator=g), TILE)
    acts = [quantize(torch.randn(128, 384, generator=g), ROW) for _ in range(2)]
    cuda0 = torch.device("cuda", 0)
    for q in (b, *acts):
        q.__dict__["device"] = cuda0  # QuantizedTensor.device is a cached property
    seen = []

    def scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kwargs):
        seen.append((scale_a, scale_b))
        return stand_in_product(mat_a, mat_b, scale_a, scale_b).to(kwargs["output_dtype"])

    with contextlib.ExitStack() as stack:
        cuda_stood_in(stack, scaled_mm)
        first = fp4gen.gemm(acts[0], b, out_dtype=torch.float32, backend="block_scaled")
        with host_keys.OpCount() as counted:
            second = fp4gen.gemm(acts[1], b, out_dtype=torch.float32, backend="block_scaled")
        fp8_gemm._b_operands.clear()  # the uncached path: B converted again
        uncached = fp4gen.gemm(acts[1], b, out_dtype=torch.float32, backend="block_scaled")
    assert torch.equal(second, uncached)  # bit for bit
    assert seen[0][1] is seen[1][1] and seen[2][1] is not seen[1][1]
    assert torch.equal(seen[2][1], seen[1][1])
    computing = [op for op in counted.ops if op in ("aten.mul.out", "aten.zeros.default")]
    assert computing == ["aten.mul.out"]  # A's scales (layout + folded S_dec), nothing for B
    for a, got in ((acts[0], first), (acts[1], second)):
        for q in (a, b):
            q.__dict__["device"] = torch.device("cpu")
        # the stand-in sums all products in float64: the oracle's value up to float64 order
        want = gemm_block_scaled_reference(a, b)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
