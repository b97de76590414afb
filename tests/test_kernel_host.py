"""The host code of the generated modules (fp4gen.kernels.host, quantize_host, mor_host,
gemm_sm90_host), on the CPU: the shared checks and scalar words, the MoR kernels' entries for
each argument list (codes only, the range statistics), cross-compiled without a GPU, and the
GEMM hosts' operand rules."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from test_codegen_gemm import COMPILED

import fp4gen
from fp4gen.codegen import import_source
from fp4gen.codegen.mor import MoRKernelSpec, render
from fp4gen.compiler import cache as cache_mod
from fp4gen.device_offset import DeviceOffset
from fp4gen.dsl.model import Candidate, HighPrecision, Metric, MoRSpec, Partition
from fp4gen.errors import TensorError
from fp4gen.formats import E2M1, E4M3
from fp4gen.kernels import host, mor
from fp4gen.kernels.mor_host import grid_of
from fp4gen.runtime.quantize_dispatch import mor_quantize

RELERR = Metric("relerr", threshold=0.05)
BLOCK = Partition("block", (128, 128))
# a rule without a high-precision candidate, decided in the quantizing pass
CODES_FUSED = MoRKernelSpec(
    MoRSpec("cf", BLOCK, BLOCK, "gam", (Candidate(E2M1, RELERR), Candidate(E4M3)))
)
# per channel with the range metric, without a high-precision candidate: measure / decide / emit
CODES_RANGE = MoRKernelSpec(
    MoRSpec(
        "cs",
        Partition("channel"),
        Partition("channel"),
        "e8m0",
        (Candidate(E2M1, Metric("range")), Candidate(E4M3)),
    )
)
# decisions over 2x2 tiles with the range metric and a bf16 candidate
HIGH_RANGE = MoRKernelSpec(
    MoRSpec(
        "sr",
        Partition("block", (256, 256)),
        Partition("tensor"),
        "amax",
        (
            Candidate(E2M1, Metric("range")),
            Candidate(E4M3, RELERR),
            Candidate(HighPrecision("bf16")),
        ),
    )
)


# ----------------------------------------------------------------------------------------------
# kernels.host
# ----------------------------------------------------------------------------------------------
def test_compile_options_check_the_name_and_arch(tmp_path: Path) -> None:
    kernels, archs = ("amax", "quantize"), ("sm_90a", "sm_100a")
    assert host.compile_options("s", kernels, archs, "quantize", "sm_90a", None) == (
        "--enable-tvm-ffi --gpu-arch sm_90a"
    )
    dump = tmp_path / "new dir"
    options = host.compile_options("s", kernels, archs, "amax", "sm_100a", str(dump))
    assert options == f"--enable-tvm-ffi --gpu-arch sm_100a --keep-ptx --dump-dir '{dump}'"
    assert dump.is_dir()  # created
    with pytest.raises(ValueError, match=r"s has no kernel 'gemm'; kernels: \('amax'"):
        host.compile_options("s", kernels, archs, "gemm", "sm_90a", None)
    with pytest.raises(ValueError, match=r"unsupported arch 'sm_80'.*\(wgmma\)$"):
        host.compile_options("s", kernels, archs, "amax", "sm_80", None, arch_note=" (wgmma)")


def test_input_checks_name_the_rule_broken() -> None:
    def check(x, **kw):
        args = {"dtype": torch.bfloat16, "k_multiple": 16, "k_rule": "1x16 blocks", "rows": "M"}
        host.check_input_2d("spec", x, **(args | kw))

    with pytest.raises(TensorError, match="spec: expected a torch.Tensor, got list"):
        check([[1.0]])
    with pytest.raises(TensorError, match=r"2-D \[R, K\]; got shape \(16,\)"):
        check(torch.zeros(16, dtype=torch.bfloat16), rows="R")
    with pytest.raises(TensorError, match="must be torch.bfloat16; got .*dtype torch.float32"):
        check(torch.zeros(2, 16))
    with pytest.raises(TensorError, match=r"K must be a multiple of 16 \(1x16 blocks\)"):
        check(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(TensorError, match="cannot quantize an empty tensor"):
        check(torch.zeros(0, 16, dtype=torch.bfloat16))
    with pytest.raises(TensorError, match="must be contiguous"):
        check(torch.zeros(32, 2, dtype=torch.bfloat16).t())
    with pytest.raises(TensorError, match="on a CUDA device; got .*device cpu"):
        check(torch.zeros(2, 16, dtype=torch.bfloat16))


def test_scalar_words() -> None:
    assert host.i32(0x7FFFFFFF) == 2**31 - 1 and host.i32(0x80000000) == -(2**31)
    value = (0xDEADBEEF << 32) | 0x12345678
    assert host.u64_words(value) == [0x12345678, host.i32(0xDEADBEEF)]
    x = torch.zeros(1)
    assert host.offset_words("s", 5, x) == [5, 0, 0, 0, 0, 0]
    for bad in (-1, 1 << 64, True, 1.0):
        with pytest.raises(ValueError, match=r"offset must be an integer in \[0, 2\^64\)"):
            host.offset_words("s", bad, x)  # type: ignore[arg-type]
    counter = torch.zeros(1, dtype=torch.int64)
    words = host.offset_words("s", DeviceOffset(counter, (1 << 32) + 3, 7), x)
    assert words == [7, 0, *host.u64_words(counter.data_ptr()), 3, 1]
    with pytest.raises(ValueError, match="one output, one DeviceOffset slot"):
        host.offset_words("s", DeviceOffset(counter, 8, (1, 2)), x)
    host.check_offset(DeviceOffset(counter, 8, (1, 2)))  # no stochastic rounding: any slots
    with pytest.raises(ValueError):
        host.check_offset(-1)
    # 129 rows pad to 256, 5 columns to 8
    assert host.swizzled_bytes(129, 5) == 256 * 8 and host.swizzled_bytes(128, 4) == 512


# ----------------------------------------------------------------------------------------------
# kernels.mor entries and kernels.mor_host
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mor_modules(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("mor-host")
    return {
        name: import_source(render(spec), directory)
        for name, spec in (("codes", CODES_FUSED), ("range", CODES_RANGE), ("high", HIGH_RANGE))
    }


def test_mor_modules_name_the_entry_of_their_arguments(mor_modules) -> None:
    codes, ranged, high = mor_modules["codes"], mor_modules["range"], mor_modules["high"]
    assert codes.KERNELS == ("amax", "scales", "quantize")
    assert issubclass(codes.QuantizeKernel, mor.MoRQuantizeCodesKernel)
    assert ranged.KERNELS == ("amax", "scales", "measure", "decide", "emit")
    assert issubclass(ranged.MeasureKernel, mor.MoRMeasureRangeKernel)
    assert issubclass(ranged.DecideKernel, mor.MoRDecideRangeKernel)
    assert issubclass(ranged.EmitKernel, mor.MoREmitCodesKernel)
    assert not issubclass(high.EmitKernel, mor.MoREmitCodesKernel)
    assert issubclass(high.DecideKernel, mor.MoRDecideRangeKernel)
    assert high.HOST.entries["emit"] is high.EmitKernel
    assert high.HOST.high_torch == torch.bfloat16 and codes.HOST.high_torch is None


def _entry_params(fn) -> int:
    """The .param count of the one kernel in the PTX of a compiled function."""
    ptx = fn.__ptx__
    (entry,) = re.findall(r"\.entry \S+\((.*?)\)", ptx, flags=re.S)
    return entry.count(".param")


@pytest.mark.parametrize(
    ("module", "kernel", "params"),
    [
        # gX, gEnc, gDec, gQ, gChoice, gErr, gNz, R, K, tiles_k (no high-precision words)
        ("codes", "quantize", 10),
        # gP, gCnt, gPmax, gPmin, gChoice, gErr, gNz, R, K
        ("range", "decide", 9),
        # gX, gEnc, gDec, gP, gCnt, gPmax, gPmin, R, K, tiles_k
        ("range", "measure", 10),
        # gX, gEnc, gDec, gChoice, gQ, R, K, tiles_k
        ("range", "emit", 8),
        # gX, gEnc, gDec, gChoice, gQ, gH, R, K, tiles_k
        ("high", "emit", 9),
    ],
)
def test_mor_entries_cross_compile_with_the_rules_tensors(
    mor_modules, module: str, kernel: str, params: int, tmp_path: Path
) -> None:
    fn = mor_modules[module].compile_kernel(kernel, "sm_90a", dump_dir=str(tmp_path))
    assert _entry_params(fn) == params


def test_mor_host_checks_the_input(mor_modules) -> None:
    mod = mor_modules["range"]
    with pytest.raises(TensorError, match=r"K must be a multiple of 8 \(8-element loads\)"):
        mod.launches(torch.zeros(4, 12, dtype=torch.bfloat16))
    with pytest.raises(TensorError, match="on a CUDA device"):
        mod.run({}, torch.zeros(4, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="has no kernel 'quantize'"):
        mod.compile_kernel("quantize", "sm_90a")
    # units of a partition as shifts: 300 rows in 128-row blocks, a whole-tensor side
    assert grid_of(300, 64, 7, 31) == (3, 1) and mod.grid_of is grid_of


def mor_input(wide: bool) -> torch.Tensor:
    """bf16 [300, 264]: rows 0-255 of E2M1 grid values (1.5 to 6: inside E2M1's range, encoded
    exactly), the rest N(0, 1) * 1e-3; ``wide``: columns 0-127 of the rest spread over 12 decades
    (E4M3 loses them)."""
    g = torch.Generator().manual_seed(40)
    x = torch.randn(300, 264, generator=g)
    grid = torch.tensor([1.5, 2.0, 3.0, 4.0, 6.0])
    x[:256] = grid[torch.randint(0, 5, (256, 264), generator=g)] * torch.sign(x[:256])
    if wide:
        x[256:, :128] *= 10.0 ** (torch.rand(44, 128, generator=g) * 12 - 6)
        x[256:, 128:] *= 1e-3
    else:
        x[256:] *= 1e-3
    x[280:, ::3] = 0.0
    return x.to(torch.bfloat16)


# rule -> (its input, the candidates the reference picks for it)
MOR_CASES = {
    "codes": (CODES_FUSED, False, [0, 1]),
    "range": (CODES_RANGE, False, [0, 1]),
    "high": (HIGH_RANGE, True, [0, 2]),
}


@pytest.mark.parametrize("name", sorted(MOR_CASES))
def test_mor_inputs_take_several_candidates(name: str) -> None:
    """The GPU test's inputs exercise more than one candidate of each rule (the reference)."""
    spec, wide, picked = MOR_CASES[name]
    ref = mor_quantize(mor_input(wide), spec.rule, backend="reference")
    assert torch.unique(ref.choice).tolist() == picked


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(MOR_CASES))
def test_mor_entries_match_the_reference_on_the_gpu(name: str) -> None:
    """The codes-only and range entries run: every output bit for bit the reference's."""
    from test_mor_kernels_gpu import compare

    spec, wide, _ = MOR_CASES[name]
    x = mor_input(wide).cuda()
    got = mor_quantize(x, spec.rule, backend="cute")
    compare(got, x, spec.rule)


# ----------------------------------------------------------------------------------------------
# kernels.gemm_sm90_host
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("small", [False, True], ids=["wgmma", "small_m"])
def test_gemm_host_requires_the_bias_it_was_generated_with(small: bool, tmp_path: Path) -> None:
    from fp4gen.codegen.gemm import SmallMTile, render_gemm

    spec = next(s for s in COMPILED.values() if s.bias and isinstance(s.tile, SmallMTile) == small)
    mod = import_source(render_gemm(spec), tmp_path)
    assert mod.HOST.params.bias and mod.KERNELS == ("gemm",)
    M, N, K = 2, 16, 64
    u8 = torch.uint8
    meta = torch.device("meta")
    a = torch.zeros(M, K if small else K // 2, dtype=u8, device=meta)
    b_rows = -(-N // 16) if spec.b_block[0] > 1 else N
    operands = (
        a,
        torch.zeros(M, K // spec.a_block[1], dtype=u8, device=meta),
        torch.ones((), device=meta),
        torch.zeros(N, K // 2, dtype=u8, device=meta),
        torch.zeros(b_rows, K // spec.b_block[1], dtype=u8, device=meta),
        torch.ones((), device=meta),
    )
    out = torch.empty(M, N, dtype=mod.OUT_TORCH, device=meta)
    with pytest.raises(TensorError, match="on a CUDA device; got meta"):
        mod.launch_args(*operands, k=K, out=out)
    # the operand checks after the device's (meta tensors pass them: data_ptr() is 0)
    rest = dict(M=M, N=N, k=K, has_bias=True)
    with pytest.raises(TensorError, match="bias must be a torch.Tensor, got NoneType"):
        mod.HOST.check_rest(meta, *operands[1:3], *operands[4:], out, None, **rest)
    bias = torch.zeros(N, device=meta)
    mod.HOST.check_rest(meta, *operands[1:3], *operands[4:], out, bias, **rest)
    with pytest.raises(TensorError, match=r"bias must be torch.float32 \[16\]"):
        mod.HOST.check_rest(meta, *operands[1:3], *operands[4:], out, bias[:8], **rest)
    with pytest.raises(TensorError, match="was generated without a bias"):
        mod.HOST.check_rest(
            meta, *operands[1:3], *operands[4:], out, bias, **(rest | {"has_bias": False})
        )
    if small:
        assert mod.a_scale_cols(128) == (8 if spec.a_block[1] == 16 else 4)
        # one tile per CTA's output; one split needs one tile of workspace, three need each's
        assert mod.tiles(M, N) == 1 and mod.tiles(100, 200) == -(-100 // mod.TILE_M) * -(
            -200 // mod.TILE_N
        )
        assert mod.workspace(M, N, 1, "cpu")[0].shape == (1, mod.TILE_ELEMS)
        ws, counters = mod.workspace(100, 200, 3, "cpu")
        assert ws.shape == (3, mod.tiles(100, 200) * mod.TILE_ELEMS)
        assert counters.dtype == torch.int32 and not counters.any()


# ----------------------------------------------------------------------------------------------
# The kernel cache's key
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["host", "quantize_host", "mor_host", "gemm_sm90_host"])
def test_the_template_version_covers_the_host_modules(
    name: str, tmp_path: Path, monkeypatch
) -> None:
    """Generated modules import their host code from fp4gen/kernels: a change there is a new
    template version, so a cached kernel is never loaded beside host code it was not built
    with."""
    pkg = Path(fp4gen.__file__).resolve().parent
    copy = tmp_path / "fp4gen"
    for folder in cache_mod._TEMPLATE_DIRS:
        shutil.copytree(pkg / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "__init__.py").write_text("")
    monkeypatch.setattr(fp4gen, "__file__", str(copy / "__init__.py"))
    cache_mod.template_version.cache_clear()
    try:
        before = cache_mod.template_version()
        module = copy / "kernels" / f"{name}.py"
        module.write_text(module.read_text() + "\n# a change\n")
        cache_mod.template_version.cache_clear()
        assert cache_mod.template_version() != before
    finally:
        cache_mod.template_version.cache_clear()
