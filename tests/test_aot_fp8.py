"""``fp4gen compile`` and the generated block-scaled FP8 GEMMs (``fp4gen.kernels.gemm_sm90_fp8``).

CPU tests: the runtime plan holds, for sm_90a, one FP8 GEMM per output dtype and bias that
``fp4gen.nn.Linear`` passes for each FP8 pair of a recipe, keyed by the runtime's own
``fp8_gemm.cute_plan``; the printed routes and the manifest name them; and (with the CuTe DSL)
fp8_blockwise's FP8 GEMMs cross-compiled by ``compile_recipes`` are what the runtime's
``fp8_gemm.cute_kernel`` loads, compiling nothing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from fp4gen.codegen.gemm_fp8 import module_source
from fp4gen.compiler import jit
from fp4gen.compiler.aot import runtime_plan
from fp4gen.compiler.build import compile_recipes, manifest, prepare_builds
from fp4gen.compiler.cache import KernelCache, sha256_text
from fp4gen.dsl import load_recipe
from fp4gen.dsl.model import Operand
from fp4gen.runtime import fp8_gemm

CUTE_DSL = importlib.util.find_spec("cutlass") is not None
# (A, B) of each GEMM, and the (output dtype, bias) Linear passes for it in a bf16 model
PAIRS = {
    "fprop": (Operand.FPROP_ACTIVATION, Operand.FPROP_WEIGHT),
    "dgrad": (Operand.DGRAD_GRADIENT, Operand.DGRAD_WEIGHT),
    "wgrad": (Operand.WGRAD_GRADIENT, Operand.WGRAD_ACTIVATION),
}
FLAGS = {
    "fprop": ((torch.float32, False), (torch.bfloat16, True)),
    "dgrad": ((torch.bfloat16, False),),
    "wgrad": ((torch.bfloat16, False),),
}


def runtime_params(name: str) -> set[Any]:
    """The GemmSm90Fp8Params the runtime builds for a shipped recipe's GEMMs (bf16 model):
    a dense layer's, and the grouped experts' (fp8_grouped.grouped_plan for fprop, with and
    without a bias, and dgrad; fp8_kgrouped.k_grouped_plan for wgrad)."""
    from fp4gen.runtime.fp8_grouped import grouped_plan
    from fp4gen.runtime.fp8_kgrouped import k_grouped_plan

    ops = load_recipe(name).operands
    out = set()
    for gemm, (a, b) in PAIRS.items():
        fa, fb = ops[a].format, ops[b].format
        for out_dtype, bias in FLAGS[gemm]:
            # the default tile, and where it is wider than 128 the narrow one for the shapes
            # it suits (fp8_gemm.cute_tile)
            params = fp8_gemm.cute_plan(fa, fb, out_dtype, bias, False).params
            out.add(params)
            if params.tile_n > 128:
                out.add(fp8_gemm.cute_plan(fa, fb, out_dtype, bias, False, 128).params)
        if gemm == "wgrad":
            out.add(k_grouped_plan(fa, fb, torch.bfloat16).params)
        else:
            for bias in (False, True) if gemm == "fprop" else (False,):
                out.add(grouped_plan(fa, fb, torch.bfloat16, bias).params)
    return out


# fp8_blockwise: a dense layer's fprop fp32 and bf16 + bias, dgrad (each 192- and 128-wide),
# wgrad (1x128: 128-wide); the experts' grouped fprop (bf16; the dgrad's, the same pair) and
# fprop + bias, K-grouped wgrad
@pytest.mark.parametrize("name, count", [("fp8_blockwise", 10), ("mxfp8", 6)])
def test_plan_holds_the_fp8_gemms_the_runtime_builds(name: str, count: int) -> None:
    plan = runtime_plan(load_recipe(name))
    fp8 = plan.of_kind("gemm_sm90_fp8")
    assert {k.spec for k in fp8} == runtime_params(name)
    assert len(fp8) == count
    assert {k.archs for k in fp8} == {("sm_90a",)}
    assert not runtime_plan(load_recipe(name), archs=("sm_100a",)).of_kind("gemm_sm90_fp8")
    text = plan.gemm_text()
    assert text.count('backend="cute": generated block-scaled FP8 kernel') == 3
    uses = {u.text for k in fp8 for u in k.uses}
    if name == "fp8_blockwise":  # B in 128x128 tiles: two widths
        assert 'fprop: backend="cute", bf16 out, bias, 128x192 tiles' in uses
        assert 'fprop: backend="cute", bf16 out, bias, 128x128 tiles' in uses
    else:
        assert 'fprop: backend="cute", bf16 out, bias' in uses


def test_fp8_blockwise_routes_name_scaled_mm_for_auto() -> None:
    text = runtime_plan(load_recipe("fp8_blockwise"), archs=("sm_90a",)).gemm_text()
    assert "torch scaled_mm BlockWise1x128 x BlockWise128x128" in text
    assert "generated block-scaled FP8 kernel (e4m3 1x128 x e4m3 1x128 fp32, wgmma)" in text


def test_measured_table_puts_the_kernel_on_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pair in fp8_gemm.CUTE_AUTO_MIN_M: the route says from which M auto takes it."""
    monkeypatch.setitem(fp8_gemm.CUTE_AUTO_MIN_M, "e4m3 1x128 x e4m3 1x128 fp32", 512)
    plan = runtime_plan(load_recipe("fp8_blockwise"), archs=("sm_90a",))
    text = plan.gemm_text()
    assert "M >= 512: generated block-scaled FP8 kernel (e4m3 1x128 x e4m3 1x128 fp32" in text
    assert "M < 512: block-scaled FP8 GEMM: torch scaled_mm BlockWise1x128 x BlockWise1x128" in text
    wgrad = [u.when for k in plan.of_kind("gemm_sm90_fp8") for u in k.uses if u.gemm == "wgrad"]
    assert wgrad == [
        'backend="cute", auto for M >= 512, bf16 out',
        "MoE experts, K-grouped, bf16 out",
    ]


def test_manifest_lists_the_fp8_gemms_with_the_runtime_source(tmp_path: Path) -> None:
    recipe = load_recipe("fp8_blockwise")
    (build,) = prepare_builds([recipe], archs=("sm_90a", "sm_100a"), out=tmp_path)
    items = [k for k in build.kernels if k.kind == "gemm_sm90_fp8"]
    assert {k.planned.spec for k in items} == runtime_params("fp8_blockwise")
    for item in items:
        assert item.source == module_source(item.planned.spec)  # cute_kernel's text: one key
        assert item.kernels == ("gemm",) and item.archs == ("sm_90a",)
    data = manifest(build, ("sm_90a", "sm_100a"), template="t")
    entries = {k["name"]: k for k in data["kernels"] if k["kind"] == "gemm_sm90_fp8"}
    assert sorted(entries) == sorted(
        [
            # the coalesced variant (MN-major scales, wide stores) in 2-CTA clusters; 192-wide
            # tiles where B comes in 128x128 tiles, 128 for the 1x128 x 1x128 wgrad pair
            "fp8gemm_e4m3_1x128_e4m3_128x128_fp32_fp32_c2x1_mn_ws_m128n192s5",
            "fp8gemm_e4m3_1x128_e4m3_128x128_fp32_bf16_bias_c2x1_mn_ws_m128n192s5",
            "fp8gemm_e4m3_1x128_e4m3_128x128_fp32_bf16_c2x1_mn_ws_m128n192s5",
            # and 128-wide, for the shapes whose 192-wide tiles leave a partial last wave
            "fp8gemm_e4m3_1x128_e4m3_128x128_fp32_fp32_c2x1_mn_ws_m128n128s6",
            "fp8gemm_e4m3_1x128_e4m3_128x128_fp32_bf16_bias_c2x1_mn_ws_m128n128s6",
            "fp8gemm_e4m3_1x128_e4m3_128x128_fp32_bf16_c2x1_mn_ws_m128n128s6",
            "fp8gemm_e4m3_1x128_e4m3_1x128_fp32_bf16_c2x1_mn_ws_m128n128s6",
            # the grouped experts' (fprop and dgrad share a pair; row-major scales: a group's
            # first row may be any row), K-grouped wgrad (MN-major scales, wide stores)
            "fp8gemm_e4m3_1x128_e4m3_128x128_fp32_bf16_ws_grouped_m128n192s5",
            "fp8gemm_e4m3_1x128_e4m3_128x128_fp32_bf16_bias_ws_grouped_m128n192s5",
            "fp8gemm_e4m3_1x128_e4m3_1x128_fp32_bf16_mn_ws_kgrouped_m128n128s6",
        ]
    )
    bias = entries["fp8gemm_e4m3_1x128_e4m3_128x128_fp32_bf16_bias_c2x1_mn_ws_m128n192s5"]
    assert bias["archs"] == ["sm_90a"] and bias["file"] is None  # written with --gemm-sources
    assert bias["status"] == "ok"
    assert bias["spec"]["block_k"] == 128 and bias["spec"]["b_2d"] and bias["spec"]["bias"]
    assert bias["spec"]["out"] == "bf16" and bias["spec"]["num_stages"] == 5
    assert bias["uses"] == [
        {"recipe": "fp8_blockwise", "context": "operands", "gemm": "fprop",
         "when": 'backend="cute", bf16 out, bias, 128x192 tiles'}
    ]  # fmt: skip
    source = module_source(next(k.planned.spec for k in items if k.name == bias["name"]))
    assert bias["source_sha256"] == sha256_text(source)


@pytest.mark.slow
@pytest.mark.skipif(not CUTE_DSL, reason="needs the CuTe DSL (nvidia-cutlass-dsl)")
def test_compiled_fp8_gemms_load_without_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp8_blockwise for sm_90a with the quantize template stood in (a stub: only the FP8 GEMMs
    are real compiles, about 2-5 s each on two cores); then the runtime's loader finds each of
    its ten kernels in the cache with compiling forbidden."""
    from kernel_stub import render_stub

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    cache = KernelCache(tmp_path / "cache")
    report = compile_recipes(
        [load_recipe("fp8_blockwise")],
        archs=("sm_90a",),
        out=tmp_path / "out",
        cache=cache,
        render=render_stub,
        jobs=2,
    )
    fp8 = [r for r in report.results if r.kind == "gemm_sm90_fp8"]
    assert len(fp8) == 10 and all(r.status == "ok" and not r.cached for r in fp8), fp8

    def forbidden(module: Any, name: str, arch: str, **_: Any) -> Any:
        raise AssertionError(f"compiled {Path(module.__file__).name} {name} for {arch}")

    monkeypatch.setattr(jit, "compile_kernel", forbidden)
    monkeypatch.setattr(fp8_gemm, "_cute_compiled", {})
    monkeypatch.setattr(fp8_gemm, "_cute_loaded", {})
    before = jit.compile_count()
    for params in runtime_params("fp8_blockwise"):
        assert callable(fp8_gemm.cute_kernel(params, cache))
        stats = fp8_gemm._cute_loaded[params]
        assert (stats.compiled, stats.loaded) == (0, 1), params.name
    assert jit.compile_count() == before


# A fresh process on an sm_90a GPU after ``fp4gen compile fp8_blockwise``: the FP8 GEMMs a
# bf16 Linear's three GEMMs take with backend="cute" load from the cache, compile nothing, and
# compute within numerics.md 6.1's bound (tests/test_fp8_gemm_sm90_gpu.py's ``bound``: the
# oracle's fp32 bound, the tensor cores' in-block adder term and the output rounding).
GEMMS_AFTER_COMPILE = """
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
import fp4gen
from fp4gen.compiler import jit
from fp4gen.dsl.model import Operand
from fp4gen.numerics import gemm_block_scaled_reference
from fp4gen.runtime.quantize_dispatch import quantize
from test_fp8_gemm_sm90_gpu import bound, check_within

ops = fp4gen.load_recipe("fp8_blockwise").operands
g = torch.Generator(device="cuda").manual_seed(0)
def q(rows, op):
    x = torch.randn(rows, 1024, generator=g, device="cuda").to(torch.bfloat16)
    return quantize(x, ops[op].format, rounding=ops[op].rounding)
x, w = q(512, Operand.FPROP_ACTIVATION), q(384, Operand.FPROP_WEIGHT)
dy, xt = q(256, Operand.WGRAD_GRADIENT), q(384, Operand.WGRAD_ACTIVATION)
bias = torch.randn(384, generator=g, device="cuda").to(torch.bfloat16)
cases = [  # (A, B, out dtype, bias): fprop fp32, fprop bf16 + bias, dgrad / wgrad bf16
    (x, w, torch.float32, None), (x, w, torch.bfloat16, bias), (x, w, torch.bfloat16, None),
    (dy, xt, torch.bfloat16, None),
]
for a, b, out_dtype, b_ in cases:
    got = fp4gen.gemm(a, b, out_dtype=out_dtype, bias=b_, backend="cute")
    ref = gemm_block_scaled_reference(a, b).double()
    if b_ is not None:
        ref = ref + b_.double()
    check_within(got, ref, bound(a, b, ref, out_dtype), f"{out_dtype} bias={b_ is not None}")
print(json.dumps({"compiles": jit.compile_count(), "compiled": jit.compiled_kernels(),
                  "loads": jit.load_count()}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_gemms_after_compile_compile_nothing(tmp_path: Path) -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FP8 wgmma: sm_90a only")
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    cache = tmp_path / "cache"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        "FP4GEN_CACHE_DIR": str(cache),
        "CUTE_DSL_CACHE_DIR": str(cache / "cute-dsl"),
    }
    argv = [sys.executable, "-m", "fp4gen", "compile", "fp8_blockwise", "--arch", "sm_90a"]
    argv += ["--out", str(tmp_path / "out")]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "10 sm_90a FP8 GEMM" in proc.stdout  # a dense layer's 7 (two widths), the experts' 3
    script = tmp_path / "gemms.py"
    script.write_text(GEMMS_AFTER_COMPILE)
    tests = str(Path(__file__).resolve().parent)
    proc = subprocess.run(
        [sys.executable, str(script), tests], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["compiles"] == 0, result["compiled"]
    assert result["loads"] >= 4  # the four FP8 GEMMs (and the quantize kernels) from the cache


def test_the_runtime_and_the_plan_share_the_fp8_settings() -> None:
    """The measured table is one dict; the variant the runtime takes by default is the one
    ``fp4gen compile`` compiles; both plan for the same arch."""
    from fp4gen.codegen import gemm_fp8
    from fp4gen.compiler.aot import FP8_ARCHS

    assert fp8_gemm.CUTE_AUTO_MIN_M is gemm_fp8.AUTO_MIN_M
    assert fp8_gemm.CUTE_OVERLAP == gemm_fp8.OVERLAP
    assert fp8_gemm.CUTE_CLUSTER_M == gemm_fp8.CLUSTER_M
    assert fp8_gemm.CUTE_TILE_N == gemm_fp8.TILE_N
    assert fp8_gemm.CUTE_TILE_BY_SHAPE == gemm_fp8.TILE_BY_SHAPE
    assert FP8_ARCHS == fp8_gemm.CUTE_ARCHS
