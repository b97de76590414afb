"""``fp4gen compile`` ahead of time: every kernel a training run loads, compiled before it runs.

CPU tests (no GPU): the runtime plan (``fp4gen.compiler.aot``) against the runtime's own spec
builders; rendering is deterministic (the same bytes twice, whatever the cache holds); one small
recipe compiled for real once per session (module fixture, about 35 kernels on both archs), after
which every kernel the runtime's loaders ask for is a cache hit with compiling forbidden, and
the kept PTX holds the wgmma and tcgen05 block-scaled MMAs. GPU test (marker ``gpu``): a fresh
process trains a converted model's first steps after ``fp4gen compile`` and compiles nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from fp4gen.compiler import jit
from fp4gen.compiler.aot import runtime_plan, tile_buckets
from fp4gen.compiler.build import compile_recipes
from fp4gen.compiler.cache import KernelCache
from fp4gen.dsl import load_recipe
from fp4gen.dsl.model import Operand
from fp4gen.spec import QuantOutput

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "fp4gen" / "recipes"
SHIPPED = sorted(RECIPES.glob("*.fp4r"))

# NVFP4 with 1x16 blocks everywhere, round to nearest, no RHT: one operand pair, so its GEMM
# kernels are few (3 quantize modules, 2 dequantize, 15 sm_90a and 2 sm_100a GEMMs)
SMALL = """\
recipe aot_small "NVFP4, 1x16 blocks everywhere: the smallest recipe with fused GEMMs"
operands {
    * : nvfp4 round nearest
}
"""


def env_with(root: Path) -> dict[str, str]:
    """This checkout first on the path, the kernel cache (and the DSL's) under ``root``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {
        **os.environ,
        "PYTHONPATH": path,
        "FP4GEN_CACHE_DIR": str(root),
        "CUTE_DSL_CACHE_DIR": str(root / "cute-dsl"),
    }


def tree(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


# ----------------------------------------------------------------------------------------------
# The runtime plan: what the runtime's dispatch can pick, keyed as the runtime keys it
# ----------------------------------------------------------------------------------------------


def test_nvfp4_runtime_plan_counts_and_keys() -> None:
    plan = runtime_plan(load_recipe(RECIPES / "nvfp4.fp4r"))
    assert Counter(k.kind for k in plan.kernels) == {
        "quantize": 7,  # x and W forward, dy tile + 2 singles, x columnwise tile + single
        "dequant": 4,  # 1x16 and 16x16, bytes and packed
        "gemm_sm90": 20,  # (fprop fp32, fprop bf16 + bias, dgrad bf16) x 5 tiles, wgrad x 5
        "gemm_sm100": 2,  # one MMA (e2m1 x e2m1, ue4m3 16), fp32 out (global scales), 2 tiles
    }
    assert {k.archs for k in plan.kernels if k.kind == "gemm_sm90"} == {("sm_90a",)}
    assert {k.archs for k in plan.kernels if k.kind == "gemm_sm100"} == {("sm_100a",)}
    assert len({k.spec for k in plan.kernels}) == len(plan.kernels)
    assert any("148 SMs" in note for note in plan.notes)
    only_90 = runtime_plan(load_recipe(RECIPES / "nvfp4.fp4r"), archs=("sm_90a",))
    assert not only_90.of_kind("gemm_sm100") and len(only_90.of_kind("gemm_sm90")) == 20


def test_runtime_plan_matches_the_runtime_spec_builders() -> None:
    """Each key the runtime builds for the nvfp4 recipe's Linear (bf16 model, layers with a
    bias) is in the plan: the same builders, called as the runtime calls them."""
    from fp4gen.codegen.gemm import gemm_spec, pick_tile
    from fp4gen.codegen.gemm_configs import DEFAULT_SM_COUNT, gemm_config, mma_plan
    from fp4gen.runtime import cute_backend, dequant

    recipe = load_recipe(RECIPES / "nvfp4.fp4r")
    specs = {k.spec for k in runtime_plan(recipe).kernels}
    ops = recipe.operands
    bf16 = torch.bfloat16
    for op in (Operand.FPROP_ACTIVATION, Operand.FPROP_WEIGHT, Operand.DGRAD_WEIGHT):
        s = ops[op]
        assert cute_backend.spec_for(s.format, s.rounding, s.rht, bf16) in specs
    dg, wg, wa = (
        ops[Operand.DGRAD_GRADIENT],
        ops[Operand.WGRAD_GRADIENT],
        ops[Operand.WGRAD_ACTIVATION],
    )
    tile_dy = (
        QuantOutput("rowwise", dg.rounding, dg.rht),
        QuantOutput("columnwise", wg.rounding, wg.rht),
    )
    assert cute_backend._spec(dg.format, bf16, tile_dy) in specs  # quantize_tile_cute's key
    tile_x = (QuantOutput("columnwise", wa.rounding, wa.rht),)
    assert cute_backend._spec(wa.format, bf16, tile_x) in specs
    for s in (dg, wg, wa):  # the copies one by one, for shapes the tile kernel does not take
        assert cute_backend.spec_for(s.format, s.rounding, s.rht, bf16) in specs
    pairs = {
        "fprop": (ops[Operand.FPROP_ACTIVATION].format, ops[Operand.FPROP_WEIGHT].format),
        "dgrad": (dg.format, ops[Operand.DGRAD_WEIGHT].format),
        "wgrad": (wg.format, wa.format),
    }
    flags = {"fprop": [("fp32", False), ("bf16", True)], "dgrad": [("bf16", False)]}
    flags["wgrad"] = flags["dgrad"]
    for gemm, (a, b) in pairs.items():
        for fmt in (a, b):
            for codes in ("bytes", "packed"):
                assert dequant._spec(fmt, codes) in specs
        for m in (1, 16, 17, 32, 33, 64, 65, 256, 257, 8192):
            for out, bias in flags[gemm]:
                spec = gemm_spec(a, b, m, out_dtype=out, bias=bias, tile=pick_tile(m))
                assert spec in specs, (gemm, m, out, bias)
            mma = mma_plan(a, b)
            assert not isinstance(mma, str)
            config = gemm_config(mma, m, out_dtype="Float32", sm_count=DEFAULT_SM_COUNT)
            assert config in specs, (gemm, m)


def test_tile_buckets_follow_pick_tile() -> None:
    from fp4gen.codegen.gemm import TILES, pick_tile

    buckets = tile_buckets(pick_tile)
    assert [(lo, hi) for lo, hi, _ in buckets] == [
        (1, 16), (17, 32), (33, 64), (65, 256), (257, None),
    ]  # fmt: skip
    assert [t for *_, t in buckets] == [TILES[n] for n in ("r16", "r32", "r64", "mid", "large")]


def test_mx_formats_get_bf16_native_kernels_and_mor_none() -> None:
    mxfp4 = runtime_plan(load_recipe(RECIPES / "mxfp4.fp4r"))
    outs = Counter(k.spec.out_dtype for k in mxfp4.of_kind("gemm_sm100"))
    assert outs == {"Float32": 2, "BFloat16": 2}  # no global scale: bf16 straight out (N % 8)
    mor = runtime_plan(load_recipe(RECIPES / "mor_tensor.fp4r"))
    assert mor.kernels == ()  # MoR mixes: MoR kernels (the plan's) and no GEMM kernel
    blockwise = runtime_plan(load_recipe(RECIPES / "fp8_blockwise.fp4r"))
    # fp32 scales: torch GEMMs for auto, the generated FP8 GEMMs for backend="cute" (sm_90a)
    assert {k.kind for k in blockwise.kernels} == {"quantize", "gemm_sm90_fp8"}


# ----------------------------------------------------------------------------------------------
# Deterministic output
# ----------------------------------------------------------------------------------------------


def test_rendering_is_deterministic(tmp_path: Path) -> None:
    """Every shipped recipe rendered twice into one folder, with two different caches, gives
    the same bytes: no timings, paths or cache state in the manifests, and nothing rewritten
    differently (``fp4gen compile`` of a shipped recipe leaves generated/ as it is)."""
    recipes = [load_recipe(p) for p in SHIPPED]
    out = tmp_path / "out"
    compile_recipes(recipes, out=out, compile=False, cache=KernelCache(tmp_path / "c1"))
    first = tree(out)
    compile_recipes(recipes, out=out, compile=False, cache=KernelCache(tmp_path / "c2"))
    assert tree(out) == first
    manifests = [data.decode() for path, data in first.items() if path.endswith("manifest.json")]
    assert len(manifests) == len(SHIPPED)
    for text in manifests:
        assert str(tmp_path) not in text
        assert '"seconds"' not in text and '"cached"' not in text


# ----------------------------------------------------------------------------------------------
# One recipe compiled for real (both archs, PTX kept), once per session
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("cutlass")
    root = tmp_path_factory.mktemp("aot")
    recipe = root / "aot_small.fp4r"
    recipe.write_text(SMALL)
    out, cache = root / "out", root / "cache"
    argv = [sys.executable, "-m", "fp4gen", "compile", str(recipe), "--out", str(out)]
    argv += ["--keep-ptx", "--gemm-sources"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env_with(cache), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"recipe": recipe, "out": out, "cache": cache, "stdout": proc.stdout, "argv": argv}


@pytest.mark.slow
def test_compile_prints_the_plan_and_what_it_built(compiled: dict[str, Any]) -> None:
    stdout = compiled["stdout"]
    assert "fprop  A = x (nvfp4 1x16), B = W (nvfp4 1x16)" in stdout
    assert "kernels: 3 quantize, 2 dequantize, 15 sm_90a GEMM, 2 sm_100a GEMM" in stdout
    assert "compiled 33 kernel(s), 0 from the cache, for sm_90a, sm_100a" in stdout
    rows = re.findall(r"^  (\S+) (\S+)\s+(sm_\d+a)\s+compiled\s+(\d+\.\d\d)s$", stdout, re.M)
    assert len(rows) == 33
    assert {arch for _, _, arch, _ in rows} == {"sm_90a", "sm_100a"}
    m = json.loads((compiled["out"] / "manifest.json").read_text())
    kinds = Counter(k["kind"] for k in m["kernels"])
    assert kinds == {"quantize": 3, "dequant": 2, "gemm_sm90": 15, "gemm_sm100": 2}
    assert all(k["status"] == "ok" for k in m["kernels"])
    assert m["not_compiled"] and m["gemms"][0]["gemm"] == "fprop"


@pytest.mark.slow
def test_kept_ptx_has_the_wgmma_and_tcgen05_block_scaled_mmas(compiled: dict[str, Any]) -> None:
    ptx = compiled["out"] / "ptx"
    wgmma = [p for p in (ptx / "sm_90a").rglob("*.ptx") if "wgmma.mma_async" in p.read_text()]
    # the two wgmma tiles of each of the three fused-GEMM variants
    assert len({p.relative_to(ptx).parts[1] for p in wgmma}) == 6
    tcgen05 = [
        p
        for p in (ptx / "sm_100a").rglob("*.ptx")
        if re.search(r"tcgen05\.mma\S*block_scale", p.read_text())
    ]
    assert len({p.relative_to(ptx).parts[1] for p in tcgen05}) == 2
    small_m = ptx / "sm_90a" / "gemm_e2m1_1x16_e4m3_x_e2m1_1x16_e4m3_bf16_r16n64w1x1x4k1s12c3"
    assert any("mma.sync.aligned.m16n8k16" in p.read_text() for p in small_m.rglob("*.ptx"))


@pytest.mark.slow
def test_every_listed_kernel_is_in_the_cache(compiled: dict[str, Any]) -> None:
    """What a fresh process would ask for: each module, kernel and arch of the manifest has a
    valid cache entry under the key the loaders compute."""
    cache = KernelCache(compiled["cache"])
    m = json.loads((compiled["out"] / "manifest.json").read_text())
    count = 0
    for k in m["kernels"]:
        source = (compiled["out"] / k["file"]).read_text()
        for arch in k["archs"]:
            for name in k["kernels"]:
                key, _ = jit.kernel_key(cache, source, name, arch)
                assert cache.lookup(key) is not None, (k["name"], name, arch)
                count += 1
    assert count == 33


@pytest.mark.slow
def test_runtime_loaders_find_everything_without_compiling(
    compiled: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime's own loaders, asked for every kernel a bf16 Linear with this recipe can
    use (each M bucket, with and without a bias), load from the cache: compiling is forbidden
    (``jit.compile_kernel`` raises), and the compile count does not move."""
    from fp4gen.codegen.gemm import pick_tile
    from fp4gen.codegen.gemm_configs import DEFAULT_SM_COUNT, gemm_config, mma_plan
    from fp4gen.runtime import blackwell_gemm, cute_backend, cute_gemm, dequant, kernels

    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(compiled["cache"]))
    monkeypatch.setenv("CUTE_DSL_CACHE_DIR", str(compiled["cache"] / "cute-dsl"))
    for module in (kernels, blackwell_gemm):  # no memo of another cache
        monkeypatch.setattr(module, "_loaded", {})
    for module in (cute_gemm, dequant, blackwell_gemm):  # nor a remembered load or failure
        monkeypatch.setattr(module._loader, "loaded", {})
        monkeypatch.setattr(module._loader, "failed", {})
    monkeypatch.setattr(dequant, "_by_format", {})

    def forbidden(module: Any, name: str, arch: str, **_: Any) -> Any:
        raise AssertionError(f"compiled {Path(module.__file__).name} {name} for {arch}")

    monkeypatch.setattr(jit, "compile_kernel", forbidden)
    before = (jit.compile_count(), jit.load_count())
    fmt = load_recipe(compiled["recipe"]).operands[Operand.FPROP_ACTIVATION].format
    row = QuantOutput("rowwise", "nearest", None)
    col = QuantOutput("columnwise", "nearest", None)
    for arch in ("sm_90a", "sm_100a"):
        for outputs in ((row,), (row, col), (col,)):  # singles, the dy tile, the x tile
            spec = cute_backend._spec(fmt, torch.bfloat16, outputs)
            assert list(kernels.kernels_for(spec, arch)) == ["amax", "quantize"]
        for codes in ("bytes", "packed"):
            dequant.kernels(fmt, arch, codes)
    for m in (1, 16, 17, 32, 33, 64, 65, 256, 257, 8192):
        # fprop without a bias (fp32), with one (bf16 out); dgrad and wgrad (bf16 out)
        for bf16, bias in ((False, False), (True, True), (True, False)):
            plan = cute_gemm._plan(fmt, fmt, pick_tile(m), bf16, bias, False, "sm_90a")
            assert plan.spec.tile == pick_tile(m)
        mma = mma_plan(fmt, fmt)
        assert not isinstance(mma, str)
        config = gemm_config(mma, m, out_dtype="Float32", sm_count=DEFAULT_SM_COUNT)
        blackwell_gemm.gemm_kernel(config, "sm_100a")
    assert jit.compile_count() == before[0]
    assert jit.load_count() - before[1] == 33  # every kernel once (the loaders memoize)


@pytest.mark.slow
def test_recompiling_finds_everything_cached_and_writes_the_same_bytes(
    compiled: dict[str, Any],
) -> None:
    out = compiled["out"]
    before = {p: b for p, b in tree(out).items() if not p.startswith("ptx")}
    argv = [a for a in compiled["argv"] if a != "--keep-ptx"]  # PTX is a compile, not a lookup
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=env_with(compiled["cache"]), timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "compiled 0 kernel(s), 33 from the cache" in proc.stdout
    assert not re.search(r"\[\s*\d+/\d+\]", proc.stderr)  # no worker, no progress
    assert {p: b for p, b in tree(out).items() if not p.startswith("ptx")} == before


# ----------------------------------------------------------------------------------------------
# The GPU check: a fresh process trains and compiles nothing
# ----------------------------------------------------------------------------------------------

STEP = textwrap.dedent(
    """
    import json, sys
    import torch
    import fp4gen
    from fp4gen.compiler import jit
    from fp4gen.demo.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(layers=2, width=128, heads=4, context=64)
    model = GPT(cfg).to(device="cuda", dtype=torch.bfloat16)
    fp4gen.convert(model, fp4gen.load_recipe(sys.argv[1]), total_steps=10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    # 32 tokens: the fused small-M GEMMs on sm_90a; 256: dequantize + cuBLAS
    for step, (batch, seq) in enumerate(((2, 16), (4, 64))):
        fp4gen.set_step(model, step)
        tokens = torch.randint(0, cfg.vocab, (batch, seq + 1), device="cuda")
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    torch.cuda.synchronize()
    print(json.dumps({"compiles": jit.compile_count(), "compiled": jit.compiled_kernels(),
                      "loads": jit.load_count(), "losses": losses}))
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_first_training_steps_after_compile_compile_nothing(tmp_path: Path) -> None:
    arch = jit.detect_arch()
    if arch not in jit.ARCHS:
        pytest.skip(f"no generated kernels for {arch}")
    env = env_with(tmp_path / "cache")
    recipe = "nvfp4_small"  # the last block and the head stay in BF16; the first is NVFP4
    compile_cmd = [sys.executable, "-m", "fp4gen", "compile", recipe, "--arch", arch]
    compile_cmd += ["--out", str(tmp_path / "out")]
    proc = subprocess.run(compile_cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    script = tmp_path / "step.py"
    script.write_text(STEP)
    proc = subprocess.run(
        [sys.executable, str(script), recipe], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["compiles"] == 0, result["compiled"]
    assert result["loads"] > 0  # the kernels ran (loaded from the cache), not the reference
    assert all(torch.isfinite(torch.tensor(result["losses"])))


# ----------------------------------------------------------------------------------------------
# The README's commands
# ----------------------------------------------------------------------------------------------


def test_readme_quick_start_compiles_and_installs_cpu_torch() -> None:
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert 'pip install -e ".[dev]" && fp4gen compile recipes/nvfp4.fp4r' in quick
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in quick
    assert "| `fp4gen compile RECIPE..." in text
