"""fp4gen.gemm: every path computes the reference GEMM up to fp32 summation order."""

from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BUILTIN_FORMATS, HighPrecision
from fp4gen.gemm_dispatch import GemmChoice, choose_backend, gemm_path
from fp4gen.numerics import gemm_reference, quantize


def operands(fmt: str, m: int, n: int, k: int, seed: int = 0, block_b=None):
    g = torch.Generator().manual_seed(seed)
    a = quantize(torch.randn(m, k, generator=g), fmt)
    b = quantize(torch.randn(n, k, generator=g), fmt, block=block_b)
    return a, b


def summation_bound(a, b) -> torch.Tensor:
    """|fp32 sum - exact| <= K * 2^-24 * sum_k |a_k b_k| * alpha, plus 2 ulps for the alpha
    product and the final rounding: the products are exact, only the K additions round."""
    va, vb = a.dequantize_blockwise().double(), b.dequantize_blockwise().double()
    alpha = float(a.global_scale) * float(b.global_scale)
    magnitude = (va.abs() @ vb.abs().t()) * alpha
    exact = (va @ vb.t()) * alpha
    return a.cols * 2.0**-24 * magnitude + 2 * 2.0**-23 * exact.abs()


@pytest.mark.parametrize(
    ("fmt", "block_b"),
    [("nvfp4", None), ("nvfp4", (16, 16)), ("mxfp4", None), ("mxfp8_e4m3", None)],
)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 8, 16), (37, 50, 304), (128, 64, 1024)])
def test_dequant_path_matches_reference(fmt, block_b, m, n, k) -> None:
    a, b = operands(fmt, m, n, k, block_b=block_b)
    ref = fp4gen.gemm(a, b, backend="reference")
    assert torch.equal(ref, gemm_reference(a, b))
    got = fp4gen.gemm(a, b, backend="dequant")
    assert ((got.double() - ref.double()).abs() <= summation_bound(a, b)).all()


def test_auto_on_cpu_is_the_reference() -> None:
    a, b = operands("nvfp4", 16, 16, 64)
    assert torch.equal(fp4gen.gemm(a, b), gemm_reference(a, b))


def test_bias_accumulate_and_dtype() -> None:
    a, b = operands("nvfp4", 8, 12, 64)
    bias = torch.randn(12)
    acc = torch.randn(8, 12)
    c = fp4gen.gemm(a, b, bias=bias, accumulate=acc, out_dtype=torch.bfloat16)
    assert c.dtype == torch.bfloat16
    expected = (acc + gemm_reference(a, b, bias=bias)).bfloat16()
    assert torch.equal(c, expected)


def test_errors() -> None:
    a, b = operands("nvfp4", 8, 12, 64)
    with pytest.raises(FP4GenError, match="unknown GEMM backend 'cublas'"):
        fp4gen.gemm(a, b, backend="cublas")
    with pytest.raises(FP4GenError, match="CUDA"):
        fp4gen.gemm(a, b, backend="cute")
    with pytest.raises(TensorError, match="accumulate has shape"):
        fp4gen.gemm(a, b, accumulate=torch.zeros(3, 3))
    c, _ = operands("nvfp4", 8, 12, 32)
    with pytest.raises(TensorError, match="K mismatch"):
        fp4gen.gemm(c, b, backend="dequant")


@pytest.mark.parametrize("backend", ["auto", "reference", "dequant"])
def test_out_receives_the_result(backend: str) -> None:
    """``out=``: the result is written there and ``out`` itself is returned, with the bits of
    a call without it (bias and accumulate included)."""
    a, b = operands("nvfp4", 8, 12, 64)
    bias, acc = torch.randn(12), torch.randn(8, 12)
    for kw in ({}, {"bias": bias, "accumulate": acc}):
        want = fp4gen.gemm(a, b, out_dtype=torch.bfloat16, backend=backend, **kw)
        out = torch.full((8, 12), float("nan"), dtype=torch.bfloat16)
        got = fp4gen.gemm(a, b, out_dtype=torch.bfloat16, backend=backend, out=out, **kw)
        assert got is out and torch.equal(out, want)


def test_a_wrong_out_is_refused_before_any_work() -> None:
    a, b = operands("nvfp4", 8, 12, 64)
    for bad, rule in (
        (torch.empty(8, 13), r"\[8, 12\]"),
        (torch.empty(8, 12, dtype=torch.bfloat16), "float32"),
        (torch.empty(12, 8).t(), "not contiguous"),
    ):
        with pytest.raises(TensorError, match=rule):
            fp4gen.gemm(a, b, out=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("m", "backend"), [(16, "cute"), (300, "dequant"), (300, "auto")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernels_write_into_out(m: int, backend: str, dtype: torch.dtype, monkeypatch) -> None:
    """The fused kernel and the dequantize + cuBLASLt path write the result into ``out``
    directly (the path returns ``out`` itself: nothing copied into it afterwards; fp32 through
    cuBLASLt where it serves), with the bits of a call without it."""
    import fp4gen.gemm_dispatch as gd

    a, b = operands("nvfp4", m, 256, 1024, block_b=(16, 16))
    a = quantize(a.dequantize().cuda(), "nvfp4")
    b = quantize(b.dequantize().cuda(), "nvfp4", block=(16, 16))
    want = fp4gen.gemm(a, b, out_dtype=dtype, backend=backend)
    direct: list[bool] = []
    real = gd._into
    monkeypatch.setattr(gd, "_into", lambda c, out: (direct.append(c is out), real(c, out))[1])
    out = torch.full((m, 256), float("nan"), dtype=dtype, device="cuda")
    got = fp4gen.gemm(a, b, out_dtype=dtype, backend=backend, out=out)
    assert got is out and torch.equal(out, want)
    from fp4gen.runtime import cublaslt

    if backend == "cute" or (dtype == torch.bfloat16 and cublaslt.available()):
        assert direct == [True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e4m3", "mxfp6_e3m2"])
def test_cuda_dequant_matches_reference(fmt: str) -> None:
    a, b = operands(fmt, 300, 200, 4096)
    a, b = (quantize(t.dequantize().cuda(), fmt) for t in (a, b))
    got = fp4gen.gemm(a, b)  # auto on CUDA: bf16 cuBLAS with fp32 accumulation
    ref = gemm_reference(a, b)
    assert ((got.double() - ref.double()).abs() <= summation_bound(a, b)).all()


# ----------------------------------------------------------------------------------------------
# backend="auto": which path for which shape, format and arch (pure logic, no GPU)
# ----------------------------------------------------------------------------------------------
NVFP4 = BUILTIN_FORMATS["nvfp4"]
NVFP4_2D = NVFP4.with_block((16, 16))
MXFP4 = BUILTIN_FORMATS["mxfp4"]


@pytest.mark.parametrize(
    ("a", "b", "m", "arch", "backend", "fallback", "why"),
    [
        (NVFP4, NVFP4_2D, 1, "sm_90a", "cute", False, "fused kernel"),
        (NVFP4, NVFP4_2D, 16, "sm_90a", "cute", False, "fused kernel"),
        (NVFP4, NVFP4_2D, 64, "sm_90a", "cute", False, "fused kernel"),
        (NVFP4, NVFP4, 65, "sm_90a", "dequant", False, "M = 65 > 64: dequantize kernels"),
        (NVFP4, NVFP4, 128, "sm_90a", "dequant", False, "dequantize kernels + cuBLAS"),
        (NVFP4, NVFP4_2D, 8192, "sm_90a", "dequant", False, "dequantize kernels + cuBLAS"),
        (MXFP4, MXFP4, 16, "sm_90a", "cute", False, "fused kernel"),
        (MXFP4, MXFP4, 1024, "sm_90a", "dequant", False, "dequantize kernels + cuBLAS"),
        (NVFP4, NVFP4_2D, 16, "sm_120a", "dequant", True, "sm_90a only"),  # sm_100a: blackwell
        (NVFP4, NVFP4_2D, 16, "sm_80", "dequant", True, "sm_90a only"),
        (NVFP4_2D, NVFP4, 16, "sm_90a", "dequant", True, "A has 16x16 blocks"),
        (NVFP4, MXFP4, 16, "sm_90a", "dequant", True, "different scale formats"),
        (MXFP4, MXFP4.with_block((32, 32)), 16, "sm_90a", "dequant", True, "B has 32x32"),
        (
            BUILTIN_FORMATS["mxfp8_e4m3"],
            BUILTIN_FORMATS["mxfp8_e4m3"],
            16,
            "sm_90a",
            "dequant",
            True,
            "e4m3 elements",
        ),
        (HighPrecision("bf16"), NVFP4, 16, "sm_90a", "dequant", True, "high precision"),
    ],
)
def test_auto_backend_choice(a, b, m, arch, backend, fallback, why) -> None:
    choice = choose_backend(a, b, m, 4096, 4096, device="cuda", arch=arch)
    assert (choice.backend, choice.fallback) == (backend, fallback)
    assert why in choice.why
    assert choose_backend(a, b, m, 64, 64, device="cpu", arch=None).backend == "reference"


def test_auto_backend_falls_back_for_32_bit_indexing() -> None:
    choice = choose_backend(NVFP4, NVFP4, 16, 2**27, 64, device="cuda", arch="sm_90a")
    assert choice == GemmChoice("dequant", choice.why, fallback=True) and "2^31" in choice.why
    big_k = choose_backend(NVFP4, NVFP4, 16, 64, 2**32, device="cuda", arch="sm_90a")
    assert big_k.backend == "dequant"


def test_gemm_path_names_the_fused_kernel_and_why() -> None:
    path, why = gemm_path(NVFP4, NVFP4_2D)
    assert path.startswith("dequantize to bf16 + cuBLAS")
    assert "the fused CuTe kernel on sm_90a" in path
    assert "6 significant bits" in why and "the fused kernel reads the 4-bit operands" in why
    path, why = gemm_path(BUILTIN_FORMATS["mxfp8_e4m3"], BUILTIN_FORMATS["mxfp8_e4m3"])
    assert "fused" not in path and "no fused kernel: A has e4m3 elements" in why
    assert "fused CuTe kernel" in gemm_path(MXFP4, MXFP4)[0]
    # the generated dequantize kernel serves every exact pair; fp32 scales decode with torch
    assert "the generated dequantize kernel decodes each operand once" in why
    assert "the fused CuTe kernel on sm_90a for M <= 64" in gemm_path(NVFP4, NVFP4_2D)[0]


def test_fused_max_m_is_the_small_m_kernels_range() -> None:
    from fp4gen.codegen.gemm import SmallMTile, pick_tile
    from fp4gen.codegen.gemm_configs import FUSED_MAX_M

    # auto takes the fused kernel only where it is the split-K small-M kernel
    assert isinstance(pick_tile(FUSED_MAX_M), SmallMTile)
    for m in (1, 16, 32, FUSED_MAX_M):
        assert choose_backend(NVFP4, NVFP4_2D, m, 8192, 8192, device="cuda", arch="sm_90a") == (
            GemmChoice("cute", "fused kernel: reads the 4-bit operands, decodes in the mainloop")
        )


def test_auto_fallback_is_logged_once(monkeypatch, caplog) -> None:
    import fp4gen.gemm_dispatch as gd

    a, b = operands("nvfp4", 8, 12, 64)
    expected = fp4gen.gemm(a, b, backend="dequant")
    monkeypatch.setattr(gd, "_logged", set())
    # a fused kernel that cannot be had (e.g. no CuTe DSL): dequant, logged once
    monkeypatch.setattr(gd, "auto_backend", lambda a, b: GemmChoice("cute", "test"))

    def unavailable(*args):
        raise FP4GenError("the fused GEMM kernel is not available: test")

    monkeypatch.setattr(gd, "_fused", unavailable)
    with caplog.at_level("INFO", logger="fp4gen.gemm_dispatch"):
        for _ in range(3):
            assert torch.equal(fp4gen.gemm(a, b), expected)
    (record,) = caplog.records
    assert record.getMessage() == (
        "gemm(backend='auto') uses dequantize + cuBLAS: "
        "the fused GEMM kernel is not available: test"
    )

    def bad_shapes(*args):
        raise TensorError("K mismatch")  # an operand error is the caller's, not a fallback

    monkeypatch.setattr(gd, "_fused", bad_shapes)
    with pytest.raises(TensorError, match="K mismatch"):
        fp4gen.gemm(a, b)
    # an unsupported pair on a GPU: dequant, the reason logged once
    caplog.clear()
    monkeypatch.setattr(
        gd, "auto_backend", lambda a, b: GemmChoice("dequant", "no fused GEMM kernel: x", True)
    )
    with caplog.at_level("INFO", logger="fp4gen.gemm_dispatch"):
        fp4gen.gemm(a, b)
        fp4gen.gemm(a, b)
    assert len(caplog.records) == 1 and "no fused GEMM kernel: x" in caplog.records[0].getMessage()


def test_fused_gemm_checks_its_operands() -> None:
    from fp4gen.codegen.gemm import gemm_spec
    from fp4gen.runtime.cute_gemm import fused_gemm

    a, b = operands("nvfp4", 8, 12, 64)
    with pytest.raises(TensorError, match="CUDA"):
        fused_gemm(a, b, out_dtype=torch.float32, bias=None, accumulate=None, arch="sm_90a")
    c, _ = operands("nvfp4", 8, 12, 32)
    with pytest.raises(TensorError, match="K mismatch"):
        fused_gemm(c, b, out_dtype=torch.float32, bias=None, accumulate=None, arch="sm_90a")
    spec = gemm_spec(NVFP4, NVFP4_2D, 100, out_dtype="bf16", bias=True)
    assert spec.name == "gemm_e2m1_1x16_e4m3_x_e2m1_16x16_e4m3_bf16_bias_m128n64w2s16"


# ----------------------------------------------------------------------------------------------
# the prepared small-M call (cute_gemm.PreparedGemm): what it launches, and when it steps aside
# ----------------------------------------------------------------------------------------------
class _RecordingFn:
    """A compiled kernel's stand-in: records the arguments of each launch."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, *args) -> None:
        self.calls.append(args)


def _prepared_on_cpu(monkeypatch, fmt: str = "nvfp4", expand: int = 1, a_native: bool = False):
    """A PreparedGemm for a CPU pair (its kernel a recorder, the split-K workspace a stand-in),
    and the pair."""
    from fp4gen.runtime import cute_gemm

    workspace = (torch.zeros(4), torch.zeros(4, dtype=torch.int32))
    monkeypatch.setattr(cute_gemm, "_workspace", lambda plan, m, n, splits, dev: workspace)
    monkeypatch.setattr(cute_gemm, "_current_stream", lambda dev: 7)
    monkeypatch.setattr(cute_gemm, "capturing", lambda: False)
    a, b = operands(fmt, 16, 48, 96, block_b=(16, 16) if fmt == "nvfp4" else None)
    plan = cute_gemm._Plan(
        spec=None,  # type: ignore[arg-type]
        module=None,  # type: ignore[arg-type]
        fn=_RecordingFn(),
        small=True,
        expand=expand,
        out_dtype=torch.bfloat16,
        b_sf_rows=lambda rows: -(-rows // b.format.block[0]),
        k_multiple=64,
        # A's 1x32 scale codes as they are (the small-M kernels), or repeated as B's
        a_expand=1 if a_native else expand,
        a_sf_cols=(lambda kp: -(-(kp // 32) // 4) * 4) if a_native else (lambda kp: kp // 16),
    )
    return cute_gemm.PreparedGemm(a, b, torch.bfloat16, plan, 128, 3), a, b, workspace


@pytest.mark.parametrize(
    ("fmt", "expand", "a_native"), [("nvfp4", 1, False), ("mxfp4", 2, False), ("mxfp4", 2, True)]
)
def test_a_prepared_call_launches_what_the_full_path_does(
    monkeypatch, fmt, expand, a_native
) -> None:
    """A new A of the prepared format and shape: the kernel gets A's codes and scale codes
    padded to the kernel's K (scales repeated ``expand`` times along K), B's prepared operands,
    the two global scales, a new [M, N] output and the workspace, in the kernel's order."""
    from fp4gen.runtime import cute_gemm

    prepared, a, b, workspace = _prepared_on_cpu(monkeypatch, fmt, expand, a_native)
    a2 = quantize(torch.randn(16, 96), fmt)  # the next activation
    out = prepared(a2, b, torch.bfloat16)
    assert out is not None and out.shape == (16, 48) and out.dtype == torch.bfloat16
    (args,) = prepared.plan.fn.calls
    want = [
        cute_gemm._k_padded(a2.codes, 128),
        cute_gemm._scale_codes(a2, 16, 96, prepared.plan.a_sf_cols(128), prepared.plan.a_expand),
        *cute_gemm._b_operand(b, prepared.plan, 128)[:2],
        a2.global_scale.view(1),
        b.global_scale.view(1),
        out,
        *workspace,
    ]
    assert len(args) == len(want)
    assert args[6] is out and args[7] is workspace[0]  # the output: new, unwritten here
    assert out.is_contiguous() and out.stride() == (48, 1)
    for i, (got, expected) in enumerate(zip(args, want, strict=True)):
        assert got.shape == expected.shape and (i == 6 or torch.equal(got, expected)), i
    # A's scale codes by value: 1x32 codes as they are, 3 of them padded to 4 (whole 4-byte
    # words per row), or repeated to one per 16 values and padded to 128 / 16
    sc = a2.scale_codes if a_native else a2.scale_codes.repeat_interleave(expand, dim=1)
    cols = 4 if a_native else 128 // 16
    assert torch.equal(args[1], torch.nn.functional.pad(sc, (0, cols - sc.shape[1])))


def test_a_prepared_call_keeps_its_workspace_per_stream(monkeypatch) -> None:
    """The split-K workspace is looked up once per stream and kept; a call on another stream
    looks it up again; one looked up while capturing a graph (the graph's own) is not kept."""
    from fp4gen.runtime import cute_gemm

    prepared, a, b, _ = _prepared_on_cpu(monkeypatch)
    looked: list[int] = []
    stream = [1]
    pairs = {s: (torch.zeros(4), torch.zeros(4, dtype=torch.int32)) for s in (1, 2, 3)}

    def lookup(plan, m, n, splits, dev):
        looked.append(stream[0])
        return pairs[stream[0]]

    monkeypatch.setattr(cute_gemm, "_workspace", lookup)
    monkeypatch.setattr(cute_gemm, "_current_stream", lambda dev: stream[0])
    capture = [False]
    monkeypatch.setattr(cute_gemm, "capturing", lambda: capture[0])
    for s, capturing in ((1, False), (1, False), (2, False), (2, False), (3, True), (3, True)):
        stream[0], capture[0] = s, capturing
        assert prepared(a, b, torch.bfloat16) is not None
        assert prepared.plan.fn.calls[-1][7] is pairs[s][0]
    assert looked == [1, 2, 3, 3]


@pytest.mark.parametrize(("cols", "expand", "kp"), [(6, 2, 192), (4, 2, 128), (8, 1, 256)])
def test_scale_codes_for_the_kernel_are_repeated_and_zero_padded(cols, expand, kp) -> None:
    """The kernel's scale operand: each code ``expand`` times along K, then zeros up to one
    code per 16 of the padded K; contiguous (equal to repeat_interleave and a zero pad)."""
    from fp4gen.runtime import cute_gemm

    sc = torch.randint(1, 256, (5, cols), dtype=torch.uint8)
    got = cute_gemm._scales_for_kernel(sc, kp // 16, expand)
    want = torch.nn.functional.pad(
        sc.repeat_interleave(expand, dim=1), (0, kp // 16 - cols * expand)
    )
    assert got.is_contiguous() and torch.equal(got, want)


def _other_activations(a) -> list[tuple]:
    """(A, output dtype) pairs a call prepared for the NVFP4 ``a`` and bf16 is not: another
    format, M, RHT or output dtype, or a tensor that is not quantized."""
    m, k = a.rows, a.cols
    return [
        (quantize(torch.randn(m, k), "mxfp4"), torch.bfloat16),
        (quantize(torch.randn(m + 1, k), "nvfp4"), torch.bfloat16),
        (quantize(torch.randn(m, k), "nvfp4", hadamard=16), torch.bfloat16),
        (a, torch.float32),
        (torch.randn(m, k), torch.bfloat16),
    ]


def test_a_prepared_call_steps_aside_for_anything_else(monkeypatch) -> None:
    """Another A format, shape, RHT or output dtype, or a B changed in place since: None (the
    full path runs, checks and prepares again); nothing is launched."""
    prepared, a, b, _ = _prepared_on_cpu(monkeypatch)
    for other, dtype in _other_activations(a):
        assert prepared(other, b, dtype) is None
    b.global_scale.mul_(1.0)  # an in-place write: B's version moves on
    assert prepared(a, b, torch.bfloat16) is None
    assert prepared.plan.fn.calls == []


def test_gemm_takes_a_prepared_call_only_for_auto_without_extras(monkeypatch) -> None:
    """``fp4gen.gemm`` asks B's prepared call first for backend="auto" without bias, accumulate
    or out, and takes the full path when it steps aside (returns None)."""
    import fp4gen.gemm_dispatch as gd

    a, b = operands("nvfp4", 8, 12, 64)
    marker = torch.full((8, 12), 7.0)
    answers: list[torch.Tensor | None] = [marker]

    def prepared(a_, b_, out_dtype):
        assert b_ is b
        return answers[0]

    monkeypatch.setattr(gd, "_prepared", {b: prepared})
    assert fp4gen.gemm(a, b) is marker
    ref = gemm_reference(a, b)
    assert torch.equal(fp4gen.gemm(a, b, backend="reference"), ref)
    assert torch.equal(fp4gen.gemm(a, b, bias=torch.zeros(12)), ref)
    answers[0] = None  # not the prepared call: the full path (the reference on a CPU)
    assert torch.equal(fp4gen.gemm(a, b), ref)


# ----------------------------------------------------------------------------------------------
# the prepared dequantize + cuBLASLt call (dequant.PreparedDequantGemm)
# ----------------------------------------------------------------------------------------------
def _dequant_on_cpu(monkeypatch) -> list[tuple]:
    """CUDA stood in for under dequant_gemm: the operands' "dequantized values" are their
    blockwise values in bf16, cuBLASLt a recorder returning a marker; the calls recorded."""
    from fp4gen.runtime import cublaslt, dequant

    calls: list[tuple] = []

    def values(q, *, arch=None):
        calls.append(("dequantize", q))
        return q.dequantize_blockwise().to(torch.bfloat16)

    def matmul(va, vb, alpha, *, out_dtype, bias=None, accumulate=None, out=None):
        calls.append(("matmul", va, vb, alpha, out_dtype))
        return torch.full((va.shape[0], vb.shape[0]), 3.0, dtype=out_dtype)

    monkeypatch.setattr(dequant, "dequantize_bf16", values)
    monkeypatch.setattr(dequant, "one_cuda_device", lambda a, b, what: torch.device("cpu"))
    monkeypatch.setattr(cublaslt, "matmul", matmul)
    return calls


def test_dequant_gemm_prepares_for_a_b_met_before_without_extras(monkeypatch) -> None:
    """dequant_gemm leaves a PreparedDequantGemm for B in ``keep`` from B's second call on
    (its values remembered), and never for a call with a bias, accumulate or out."""
    from fp4gen.runtime import dequant

    _dequant_on_cpu(monkeypatch)
    a, b = operands("nvfp4", 8, 12, 64)
    keep: dict = {}
    run = dict(out_dtype=torch.bfloat16, accumulate=None, arch="sm_90a")
    dequant.dequant_gemm(a, b, bias=None, keep=keep, **run)
    assert keep == {}  # B met once
    dequant.dequant_gemm(a, b, bias=torch.zeros(12), keep=keep, **run)
    assert keep == {}  # a bias: not the prepared kind of call
    given = torch.empty(8, 12, dtype=torch.bfloat16)
    dequant.dequant_gemm(a, b, bias=None, out=given, keep=keep, **run)
    assert keep == {}
    dequant.dequant_gemm(a, b, bias=None, keep=keep, **run)
    assert isinstance(keep[b], dequant.PreparedDequantGemm)


def test_a_prepared_dequant_call_runs_the_dequant_path_and_steps_aside(monkeypatch) -> None:
    """A new A of the prepared format and shape: A dequantized, B's remembered values, one
    cuBLASLt call with alpha = S_a * S_b; another format, shape, RHT, output dtype or a
    tensor that is not quantized: None, with nothing run."""
    from fp4gen.runtime import dequant

    calls = _dequant_on_cpu(monkeypatch)
    a, b = operands("nvfp4", 8, 12, 64)
    prepared = dequant.PreparedDequantGemm(a, torch.bfloat16, "sm_90a")
    a2 = quantize(torch.randn(8, 64), "nvfp4")
    dequant.cached_bf16(b)  # B's values remembered, as the call that prepared left them
    calls.clear()
    got = prepared(a2, b, torch.bfloat16)
    assert got is not None and torch.equal(got, torch.full((8, 12), 3.0, dtype=torch.bfloat16))
    assert [c[0] for c in calls] == ["dequantize", "matmul"]  # B: remembered, not decoded
    _, va, vb, alpha, out_dtype = calls[-1]
    assert torch.equal(va, a2.dequantize_blockwise().to(torch.bfloat16))
    assert torch.equal(vb, b.dequantize_blockwise().to(torch.bfloat16))
    assert alpha.dtype == torch.float32 and torch.equal(alpha, a2.global_scale * b.global_scale)
    assert out_dtype == torch.bfloat16
    calls.clear()
    for other, dtype in _other_activations(a2):
        assert prepared(other, b, dtype) is None
    assert calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_auto_small_m_calls_after_the_first_are_prepared_and_follow_b(fmt: str) -> None:
    """backend="auto" at M = 16: the second call with a B prepares, the next ones launch from
    the prepared call with the bits of the fused kernel called directly; a B changed in place
    is seen (the next call prepares again); a B met once is never prepared. MXFP4: A's 1x32
    scale codes go to the kernel as they are."""
    import fp4gen.gemm_dispatch as gd

    g = torch.Generator().manual_seed(5)
    block = (16, 16) if fmt == "nvfp4" else None
    b = quantize(torch.randn(256, 1024, generator=g).cuda(), fmt, block=block)
    once = quantize(torch.randn(256, 1024, generator=g).cuda(), fmt, block=block)
    a = quantize(torch.randn(16, 1024, generator=g).cuda(), fmt)
    fp4gen.gemm(a, once, out_dtype=torch.bfloat16)
    assert once not in gd._prepared
    for step in range(4):
        a = quantize(torch.randn(16, 1024, generator=g).cuda(), fmt)
        got = fp4gen.gemm(a, b, out_dtype=torch.bfloat16)
        want = fp4gen.gemm(a, b, out_dtype=torch.bfloat16, backend="cute")
        assert torch.equal(got, want), step
        assert (b in gd._prepared) == (step > 0)  # B met before the auto call: prepared
    first = gd._prepared[b]
    b.global_scale.mul_(2.0)
    a = quantize(torch.randn(16, 1024, generator=g).cuda(), fmt)
    got = fp4gen.gemm(a, b, out_dtype=torch.bfloat16)
    assert torch.equal(got, fp4gen.gemm(a, b, out_dtype=torch.bfloat16, backend="cute"))
    assert gd._prepared[b] is not first  # prepared again for the changed B


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_dequant_calls_after_the_first_are_prepared_and_follow_b() -> None:
    """backend="auto" at M = 128 (dequantize + cuBLASLt): from B's second call on the calls
    launch from a PreparedDequantGemm, with the bits of backend="dequant"; B's scale codes and
    global scale changed in place are seen (compared with a new tensor holding B's pieces,
    whose values are decoded afresh)."""
    import dataclasses

    import fp4gen.gemm_dispatch as gd
    from fp4gen.runtime import cublaslt
    from fp4gen.runtime.dequant import PreparedDequantGemm

    if not cublaslt.available():  # a call is prepared only where cuBLASLt serves it
        pytest.skip(f"cuBLASLt unavailable: {cublaslt.unavailable()}")

    g = torch.Generator().manual_seed(6)
    b = quantize(torch.randn(256, 1024, generator=g).cuda(), "nvfp4", block=(16, 16))
    for step in range(3):
        a = quantize(torch.randn(128, 1024, generator=g).cuda(), "nvfp4")
        got = fp4gen.gemm(a, b, out_dtype=torch.bfloat16)
        want = fp4gen.gemm(a, dataclasses.replace(b), out_dtype=torch.bfloat16, backend="dequant")
        assert torch.equal(got, want), step
        assert isinstance(gd._prepared.get(b), PreparedDequantGemm) == (step > 0)
    b.scale_codes[:, :8] = b.scale_codes[:, 8:16].clone()  # other values, in place
    b.global_scale.mul_(2.0)
    a = quantize(torch.randn(128, 1024, generator=g).cuda(), "nvfp4")
    got = fp4gen.gemm(a, b, out_dtype=torch.bfloat16)
    want = fp4gen.gemm(a, dataclasses.replace(b), out_dtype=torch.bfloat16, backend="dequant")
    assert torch.equal(got, want)


WIDE = "format up = e7m0 fn scale ue2m0 block 1x4 global amax 2"  # elem_max x cap = 2^65


def wide_format(tmp_path):
    from fp4gen.dsl import load_recipe

    path = tmp_path / "wide.fp4r"
    path.write_text(f"recipe wide\n{WIDE}\noperands {{ * : up round nearest }}\n")
    return load_recipe(str(path)).operands.fprop_activation.format


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_a_pair_whose_fp32_accumulator_can_overflow_runs_on_the_reference(tmp_path, arch) -> None:
    """A global amax maps every tensor's amax onto elem_max x the scale cap, so the decoded
    values (element x block scale, summed in fp32 before the global scales apply) reach 2^65
    for e7m0 elements whatever the data: the products pass fp32's range at K = 1, and every
    fp32-accumulating kernel would give inf where the result is finite (the GPU recipe fuzzer
    found it on the dequantize path). On CUDA ``auto`` takes the float64 reference for such
    pairs, said as a fallback; NVFP4, whose decoded values stay below 2688, is unchanged even
    at K = 2^30."""
    from fp4gen.gemm_dispatch import accumulator_overflow_reason

    up = wide_format(tmp_path)
    choice = choose_backend(up, up, 64, 48, 100, device="cuda", arch=arch)
    assert choice.backend == "reference" and choice.fallback
    assert "could overflow" in choice.why and "K = 100" in choice.why
    nvfp4 = BUILTIN_FORMATS["nvfp4"]
    assert accumulator_overflow_reason(nvfp4, nvfp4, 2**30) is None
    assert choose_backend(nvfp4, nvfp4, 64, 48, 2**30, device="cuda", arch=arch).backend != (
        "reference"
    )
    # one side without a global scale: its decoded values are the data's own magnitudes
    assert accumulator_overflow_reason(up, BUILTIN_FORMATS["mxfp8_e4m3"], 100) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_pair_whose_fp32_accumulator_can_overflow_gives_the_reference_on_cuda(
    tmp_path, caplog, monkeypatch
) -> None:
    """On CUDA the e7m0 pair above: ``auto`` gives the float64 reference's finite result bit
    for bit (the dequantize path gave inf), and says so once."""
    from log_records import fresh_log_records

    fresh_log_records(monkeypatch)
    up = wide_format(tmp_path)
    g = torch.Generator().manual_seed(3)
    a = quantize(torch.randn(64, 100, generator=g).cuda(), up)
    b = quantize(torch.randn(48, 100, generator=g).cuda(), up)
    with caplog.at_level("INFO", logger="fp4gen"):
        got = [fp4gen.gemm(a, b) for _ in range(2)]
    want = fp4gen.gemm(a, b, backend="reference")
    assert torch.isfinite(want).all()
    assert all(torch.equal(g_, want) for g_ in got)
    said = [r for r in caplog.records if "uses the float64 reference" in r.getMessage()]
    assert len(said) == 1


def test_experts_whose_fp32_accumulator_can_overflow_run_per_expert(tmp_path) -> None:
    """The grouped products accumulate in fp32 as well: a recipe with such a pair runs its
    experts' GEMMs one by one (each dispatched by its own K), with the reason."""
    from fp4gen.dsl import load_recipe
    from fp4gen.runtime.grouped import pass_reason

    path = tmp_path / "wide.fp4r"
    path.write_text(f"recipe wide\n{WIDE}\noperands {{ * : up round nearest }}\n")
    reason = pass_reason(load_recipe(str(path)).operands)
    assert reason is not None and "overflow an fp32 accumulator" in reason
    assert pass_reason(load_recipe("nvfp4_no_sr").operands) is None


def test_the_plan_names_where_the_reference_takes_the_gemm(tmp_path) -> None:
    """fp4gen show / compile plan the reference for a pair whose accumulator overflows at every
    K (e7m0 x e7m0 with global scales: K >= 1), with the documented reason."""
    from fp4gen.compiler.build import prepare_builds
    from fp4gen.dsl import load_recipe
    from fp4gen.formats import overflow_k

    path = tmp_path / "wide.fp4r"
    path.write_text(f"recipe wide\n{WIDE}\noperands {{ * : up round nearest }}\n")
    recipe = load_recipe(str(path))
    up = recipe.operands.fprop_activation.format
    assert overflow_k(up, up) == 1
    nvfp4 = BUILTIN_FORMATS["nvfp4"]
    assert overflow_k(nvfp4, nvfp4) is None
    build = prepare_builds([recipe], out=tmp_path / "gen")[0]
    routes = {(r.gemm, arch): what for r in build.runtime.gemms for arch, what in r.routes}
    assert routes[("fprop", "all")].startswith("K >= 1: the float64 reference (an fp32")
    assert not [k for k in routes if k[0] == "fprop" and k[1] != "all"]
