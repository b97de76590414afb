"""Prepared FP8 GEMM calls (fp4gen.runtime.fp8_gemm.PreparedBlockScaled, PreparedCuteFp8), on the
CPU with CUDA stood in for (benchmarks/host_keys.fp8_stand_ins): ``fp4gen.gemm(a, b)`` with a
weight met a second time leaves a prepared call, which hands scaled_mm or the generated kernel
the same arguments as the full path (values, dtypes, strides) and gives the same result bit for
bit, and steps aside for anything it was not prepared for."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fp4gen
from fp4gen import gemm_dispatch
from fp4gen.numerics import quantize
from fp4gen.runtime import fp8_gemm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import host_keys  # noqa: E402

CUDA0 = torch.device("cuda", 0)
FA, FB = host_keys.fp8_blockwise_formats()


# prepared FP8 calls are off by default until their GPU test passes: on for each test here
pytestmark = pytest.mark.usefixtures("fp8_prepared_on")


def on_cuda0(q: Any) -> Any:
    """A new QuantizedTensor of ``q``'s tensors that says it is on cuda:0 (the stand-ins keep
    its tensors on the CPU)."""
    q = dataclasses.replace(q)
    q.__dict__["device"] = CUDA0  # QuantizedTensor.device is a cached property
    return q


class ComputingScaledMm:
    """scaled_mm's stand-in that computes what cuBLASLt computes (the block-scaled product of
    the operands it is given, summed in float64: the same value for the same arguments) and
    records each call's arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kwargs: Any):
        self.calls.append((mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, kwargs))
        qa, qb = mat_a.double(), mat_b.t().double()  # [Mp, Kp], [Np, Kp]
        kb = qa.shape[1] // 128
        sa = scale_a.double().repeat_interleave(128, 1)[:, : qa.shape[1]]
        if recipe_b == torch.nn.functional.ScalingType.BlockWise1x128:  # [Np, KB]
            sb = scale_b.double().repeat_interleave(128, 1)
        else:  # 128x128: [L4, NB] (strides (1, L4)), element [kb, j]
            sb = scale_b.t()[:, :kb].double().repeat_interleave(128, 0)
            sb = sb.repeat_interleave(128, 1)[: qb.shape[0]]
        return ((qa * sa) @ (qb * sb[:, : qb.shape[1]]).t()).to(kwargs["output_dtype"])


class RecordingKernel:
    """The generated kernel's stand-in: records its arguments and writes a value made of them
    into C (so that a result can be compared), as the kernel writes C."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, *args: Any) -> None:
        self.calls.append(args)
        a_codes, a_scales, b_codes, b_scales, sa, sb, c = args[:7]
        # proportional to B's scales (a change of them shows in a bf16 C), A's data in it too
        a_part = 1 + (a_codes.double().sum() % 61) / 64 + (b_codes.double().sum() % 29) / 32
        c.fill_(float(b_scales.double().sum() * sa * sb * (a_part + a_scales.double().sum())))


def same_tensor(got: Any, want: Any) -> bool:
    """Equal values, dtype, shape and strides (a tensor), or equal (anything else)."""
    if not isinstance(want, torch.Tensor):
        return got == want
    if not isinstance(got, torch.Tensor):
        return False
    if (got.dtype, got.shape, got.stride()) != (want.dtype, want.shape, want.stride()):
        return False
    if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    return torch.equal(got, want)


def operands(m: int, n: int, k: int, seed: int = 0, fb: Any = FB) -> tuple[Any, list[Any]]:
    gen = torch.Generator().manual_seed(seed)
    b = on_cuda0(quantize(torch.randn(n, k, generator=gen), fb))
    acts = [on_cuda0(quantize(torch.randn(m, k, generator=gen), FA)) for _ in range(3)]
    return b, acts


def prepared_for(a: Any, b: Any, out_dtype: torch.dtype, bias_dtype: Any = None) -> Any:
    """The prepared FP8 call ``fp4gen.gemm(a, b)`` would ask first, or None."""
    return gemm_dispatch._prepared_fp8.get(gemm_dispatch._fp8_key(a, b, out_dtype, bias_dtype))


@pytest.mark.parametrize("fb", [FB, FA], ids=["128x128 B", "1x128 B"])  # fprop / dgrad, wgrad
@pytest.mark.parametrize("fresh_weight", [False, True])
@pytest.mark.parametrize("shape", [(128, 256, 512), (40, 72, 200)])  # aligned, padded M, N, K
def test_a_prepared_scaled_mm_call_is_the_full_path_bit_for_bit(shape, fresh_weight, fb) -> None:
    """One weight, or a new weight per call (new tensors: a training step's quantize)."""
    m, n, k = shape
    b, (a0, a1, a2) = operands(m, n, k, fb=fb)
    b2 = on_cuda0(quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(9)), fb))
    scaled_mm = ComputingScaledMm()
    gemm_dispatch._prepared_fp8.clear()
    with host_keys.fp8_stand_ins("scaled_mm", scaled_mm, host_keys._Launches()):
        fp4gen.gemm(a0, b, out_dtype=torch.bfloat16)  # the full path: prepares
        assert isinstance(prepared_for(a0, b, torch.bfloat16), fp8_gemm.PreparedBlockScaled)
        fp4gen.gemm(a1, b, out_dtype=torch.bfloat16)  # prepared (B kept from here on)
        weight = b2 if fresh_weight else b
        prepared = fp4gen.gemm(a2, weight, out_dtype=torch.bfloat16)
        gemm_dispatch._prepared_fp8.clear()
        full = fp4gen.gemm(a2, weight, out_dtype=torch.bfloat16)  # the full path again
        gemm_dispatch._prepared_fp8.clear()
    assert prepared.dtype == torch.bfloat16 and prepared.is_contiguous()
    assert tuple(prepared.shape) == (m, n)
    assert torch.equal(prepared.view(torch.int16), full.view(torch.int16))  # bit for bit
    by_prepared, by_full = scaled_mm.calls[2], scaled_mm.calls[3]
    for got, want in zip(by_prepared[:6], by_full[:6], strict=True):
        assert same_tensor(got, want)
    assert by_prepared[6] == by_full[6]  # bias None, the output dtype, no fast accumulation
    if not fresh_weight:  # B's operands kept per weight version
        assert by_prepared[1] is by_full[1] and by_prepared[4] is by_full[4]


@pytest.mark.parametrize("fb", [FB, FA], ids=["128x128 B", "1x128 B"])
@pytest.mark.parametrize("fresh_weight", [False, True])
@pytest.mark.parametrize("shape", [(128, 256, 512), (40, 72, 200)])
def test_a_prepared_generated_kernel_call_is_the_full_path(shape, fresh_weight, fb) -> None:
    """The same arguments in the same order (C a new contiguous [M, N] of the kernel's output
    dtype), the same result, for bf16 (the kernel's own) and fp16 outputs (fp32 from the
    kernel, rounded after)."""
    m, n, k = shape
    b, (a0, a1, a2) = operands(m, n, k, seed=1, fb=fb)
    b2 = on_cuda0(quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(8)), fb))
    kernel = RecordingKernel()
    for out_dtype in (torch.bfloat16, torch.float16):
        kernel.calls.clear()
        gemm_dispatch._prepared_fp8.clear()
        with host_keys.fp8_stand_ins("generated", host_keys._ScaledMm(), kernel):
            fp4gen.gemm(a0, b, out_dtype=out_dtype)
            assert isinstance(prepared_for(a0, b, out_dtype), fp8_gemm.PreparedCuteFp8)
            fp4gen.gemm(a1, b, out_dtype=out_dtype)
            weight = b2 if fresh_weight else b
            prepared = fp4gen.gemm(a2, weight, out_dtype=out_dtype)
            gemm_dispatch._prepared_fp8.clear()
            full = fp4gen.gemm(a2, weight, out_dtype=out_dtype)
            gemm_dispatch._prepared_fp8.clear()
        by_prepared, by_full = kernel.calls[2], kernel.calls[3]
        assert len(by_prepared) == len(by_full) == 8
        for i, (got, want) in enumerate(zip(by_prepared, by_full, strict=True)):
            if i == 6:  # C: a new tensor of the same kind
                assert got is not want and got.is_contiguous()
                assert (got.dtype, got.shape) == (want.dtype, want.shape)
            else:
                assert same_tensor(got, want)
        if not fresh_weight:
            assert by_prepared[2] is by_full[2] and by_prepared[3] is by_full[3]  # B's kept
        assert prepared.dtype == full.dtype == out_dtype and prepared.is_contiguous()
        assert torch.equal(prepared, full)


@pytest.mark.parametrize("route", host_keys.FP8_ROUTES)
def test_a_prepared_call_steps_aside_for_anything_it_was_not_prepared_for(route) -> None:
    """Another output dtype, shape or format of A or B, another RHT, B's scales of another
    dtype, another kernel variant, or another FP8 semantics: the full path runs. B changed in
    place (scales, codes, global scale) is served with B's new values."""
    b, (a0, a1, a2) = operands(128, 256, 512, seed=2)
    kind = fp8_gemm.PreparedBlockScaled if route == "scaled_mm" else fp8_gemm.PreparedCuteFp8
    served: list[bool] = []
    real = kind.__call__

    def counting(self, a, b, out_dtype, bias=None):
        c = real(self, a, b, out_dtype, bias)
        served.append(c is not None)
        return c

    def gemm(a: Any, b: Any, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return fp4gen.gemm(a, b, out_dtype=out_dtype)

    scaled_mm, kernel = ComputingScaledMm(), RecordingKernel()
    gemm_dispatch._prepared_fp8.clear()
    with host_keys.fp8_stand_ins(route, scaled_mm, kernel):
        kind.__call__ = counting  # type: ignore[method-assign]
        try:
            gemm(a0, b)
            first = gemm(a1, b)
            assert served == [True]
            gemm(a2, b, torch.float32)  # another output dtype: another key, none prepared
            assert served == [True]
            gemm(a2, b, torch.float32)
            assert served[-1] is True
            b_tile = prepared_for(a2, b, torch.bfloat16).b
            other = on_cuda0(quantize(torch.randn(64, 512), FA))  # another M: another key
            gemm(other, b)
            assert len(served) == 2
            # B of another format object with the same values and shape: the entry's own
            # check (the key holds ids only)
            twin = on_cuda0(dataclasses.replace(b, format=dataclasses.replace(FB)))
            assert twin.format is not FB and b_tile.matches(a1, twin, twin.scales) is False
            # B with another RHT than A: refused by the check, the full path raises
            from fp4gen.dsl.model import RHTSpec

            rotated = on_cuda0(dataclasses.replace(b, rht=RHTSpec(16)))
            assert b_tile.matches(a1, rotated, rotated.scales) is False
            with pytest.raises(fp4gen.errors.TensorError, match="Hadamard"):
                gemm(a1, rotated)
            # B's scales in fp16: refused by the check
            assert b_tile.matches(a1, b, b.scales.half()) is False
            # A's scales in float64: the entry steps aside, the full path converts them
            count = len(served)
            wide = on_cuda0(dataclasses.replace(a2, scales=a2.scales.double()))
            assert torch.equal(gemm(wide, b), gemm(a2, b))
            assert served[count:] == [False, True]
            # B changed in place: still served, with B's new values (kept per version)
            count = len(served)
            b.scales.mul_(2.0)
            changed = gemm(a1, b)
            assert served[count:] == [True] and not torch.equal(changed, first)
            gemm_dispatch._prepared_fp8.clear()
            assert torch.equal(gemm(a1, b), changed)  # the full path: the same
            with gemm_dispatch.fp8_semantics("exact"):  # clears every prepared FP8 call
                assert not gemm_dispatch._prepared_fp8
            if route == "generated":
                gemm(a1, b)  # prepared again
                with host_keys.mock.patch.object(fp8_gemm, "CUTE_OVERLAP", True):
                    entry = prepared_for(a1, b, torch.bfloat16)
                    assert fp8_gemm.cute_settings() != entry.settings
                    assert entry(a2, b, torch.bfloat16) is None
        finally:
            kind.__call__ = real  # type: ignore[method-assign]
            gemm_dispatch._prepared_fp8.clear()


def test_a_weight_met_once_is_only_noted() -> None:
    """The generated route keeps B's arguments from B's second call: a weight quantized anew
    per call costs one note, no versions, no kept tensors."""
    b, (a0, a1, _) = operands(128, 256, 512, seed=3)
    with host_keys.fp8_stand_ins("generated", host_keys._ScaledMm(), RecordingKernel()):
        fp4gen.gemm(a0, b, out_dtype=torch.bfloat16)
        assert fp8_gemm._cute_b_operands[b] is None
        fp4gen.gemm(a1, b, out_dtype=torch.bfloat16)
        key, kept = fp8_gemm._cute_b_operands[b]
        assert kept[0] is b.codes and kept[1] is b.scales  # aligned: the tensors as they are
    gemm_dispatch._prepared_fp8.clear()


def test_fp8_codes_take_the_dtype_of_their_element_format() -> None:
    """The FP8 dtype is looked up by the element format's identity: equal formats that are
    distinct objects, and e4m3 / e5m2 alternating, each get their own dtype."""
    from fp4gen.formats import BUILTIN_FORMATS

    e4m3 = quantize(torch.randn(16, 128), FA)
    e5m2 = quantize(torch.randn(16, 128), BUILTIN_FORMATS["mxfp8_e5m2"])
    twin = dataclasses.replace(FA, element=dataclasses.replace(FA.element))
    assert twin.element is not FA.element and twin.element == FA.element
    copy = quantize(torch.randn(16, 128), twin)
    for _ in range(2):
        for q, dtype in ((e4m3, torch.float8_e4m3fn), (e5m2, torch.float8_e5m2)):
            got = fp8_gemm.fp8_codes(q, 16, 128)
            assert got.dtype == dtype and torch.equal(got.view(torch.uint8), q.codes)
        assert fp8_gemm.fp8_codes(copy, 16, 128).dtype == torch.float8_e4m3fn


def test_only_cuda_calls_are_prepared() -> None:
    """A CPU call reaches a kernel path only where a test stands CUDA in: none is kept (a
    prepared call for CPU operands would serve the next CPU call instead of the reference)."""
    a = quantize(torch.randn(16, 128), FA)
    b = quantize(torch.randn(16, 128), FB)
    before = dict(gemm_dispatch._prepared_fp8)
    gemm_dispatch._keep_fp8(a, b, torch.bfloat16, None, "a prepared call")
    assert gemm_dispatch._prepared_fp8 == before
    a_cuda, b_cuda = on_cuda0(a), on_cuda0(b)
    gemm_dispatch._keep_fp8(a_cuda, b_cuda, torch.bfloat16, None, "a prepared call")
    assert prepared_for(a_cuda, b_cuda, torch.bfloat16) == "a prepared call"
    gemm_dispatch._prepared_fp8.pop(gemm_dispatch._fp8_key(a_cuda, b_cuda, torch.bfloat16))


@pytest.mark.parametrize("route", host_keys.FP8_ROUTES)
@pytest.mark.parametrize(
    "out_dtype, bias_dtype",
    [
        (torch.bfloat16, torch.bfloat16),  # scaled_mm: in cuBLASLt's epilogue
        (torch.bfloat16, torch.float32),  # scaled_mm: fp32 out, the shared epilogue adds it
        (torch.float32, torch.float32),
    ],
)
@pytest.mark.parametrize("shape", [(128, 256, 512), (40, 72, 200)])
def test_a_prepared_call_with_a_bias_is_the_full_path(route, out_dtype, bias_dtype, shape) -> None:
    """A call with a bias (a layer's fprop) is prepared per bias dtype: the same arguments
    (the bias where the full path puts it) and the same result bits, with a new weight and
    a new bias per call; a call without a bias or with another bias dtype, shape or device
    is not served by it."""
    m, n, k = shape
    b, (a0, a1, a2) = operands(m, n, k, seed=5)
    b2 = on_cuda0(quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(7)), FB))
    biases = [torch.randn(n, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    biases = [x.to(bias_dtype) for x in biases]
    kind = fp8_gemm.PreparedBlockScaled if route == "scaled_mm" else fp8_gemm.PreparedCuteFp8
    scaled_mm, kernel = ComputingScaledMm(), RecordingKernel()
    calls = scaled_mm.calls if route == "scaled_mm" else kernel.calls
    gemm_dispatch._prepared_fp8.clear()
    with host_keys.fp8_stand_ins(route, scaled_mm, kernel):
        fp4gen.gemm(a0, b, out_dtype=out_dtype, bias=biases[0])  # the full path: prepares
        entry = prepared_for(a0, b, out_dtype, bias_dtype)
        assert isinstance(entry, kind)
        assert prepared_for(a0, b, out_dtype) is None  # no bias: another key
        served = entry(a1, b2, out_dtype, biases[1])
        assert served is not None
        prepared = fp4gen.gemm(a1, b2, out_dtype=out_dtype, bias=biases[1])
        gemm_dispatch._prepared_fp8.clear()
        full = fp4gen.gemm(a1, b2, out_dtype=out_dtype, bias=biases[1])
        entry = prepared_for(a0, b, out_dtype, bias_dtype)
        wrong_shape = torch.zeros(n + 1, dtype=bias_dtype)
        assert entry(a2, b, out_dtype, wrong_shape) is None
        assert entry(a2, b, out_dtype, None) is None
        other = torch.float16 if bias_dtype != torch.float16 else torch.float32
        assert entry(a2, b, out_dtype, biases[2].to(other)) is None
        assert entry(a2, b, out_dtype, biases[2].to("meta")) is None  # another device
        gemm_dispatch._prepared_fp8.clear()
    for c in (served, prepared):
        assert c.dtype == full.dtype == out_dtype and c.is_contiguous()
        assert torch.equal(c, full)  # bit for bit (the same ops on the same values)
    by_served, by_prepared, by_full = calls[1], calls[2], calls[3]
    if route == "scaled_mm":
        for got in (by_served, by_prepared):
            for x, want in zip(got[:6], by_full[:6], strict=True):
                assert same_tensor(x, want)
            assert set(got[6]) == set(by_full[6])
            for key, want in by_full[6].items():
                assert same_tensor(got[6][key], want) if want is not None else got[6][key] is None
        fused = bias_dtype == out_dtype and out_dtype != torch.float32
        assert (by_full[6]["bias"] is not None) == fused
    else:
        for got in (by_served, by_prepared):
            assert len(got) == len(by_full) == 9  # ..., C, the bias as fp32 [N], the SMs
            for i, (x, want) in enumerate(zip(got, by_full, strict=True)):
                if i != 6:
                    assert same_tensor(x, want)


def test_no_prepared_call_is_kept_inside_a_cuda_graph_pool(monkeypatch) -> None:
    """A prepared FP8 call made inside a CUDA graph's pool (a capture, or torch.compile's CUDA
    graph warm-up, where it would hold tensors the graph's pool owns: reduce-overhead then
    fails with "tensor(s) in the cudagraph pool not tracked as outputs") is not kept; outside
    one it is. CUDA operands stood in."""
    from types import SimpleNamespace

    cuda = torch.device("cuda", 0)
    a = SimpleNamespace(format=object(), rows=128, cols=256, device=cuda)
    b = SimpleNamespace(format=object(), rows=64)
    gemm_dispatch._prepared_fp8.clear()
    try:
        for inside, kept in ((True, False), (False, True)):
            monkeypatch.setattr(gemm_dispatch, "pooled", lambda device, inside=inside: inside)
            gemm_dispatch._keep_fp8(a, b, torch.bfloat16, None, "the prepared call")
            assert bool(gemm_dispatch._prepared_fp8) is kept
    finally:
        gemm_dispatch._prepared_fp8.clear()
