"""Fused GEMM codegen (Hopper): render every supported GemmKernelSpec configuration, check the
source, and cross-compile a covering set for sm_90a on the CPU (PTX read back: wgmma on bf16,
TMA, no local memory, no approximate math; ptxas spills when a ptxas is on PATH)."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fp4gen.codegen import import_source
from fp4gen.codegen.gemm import (
    CANDIDATES,
    MAX_SPLITS,
    SMEM_CAP,
    SMEM_PER_SM,
    TILES,
    SmallMTile,
    SmallTileConstants,
    check_gemm,
    choose_splits,
    pick_tile,
    render_gemm,
    tile_constants,
)
from fp4gen.errors import TensorError
from fp4gen.formats import E2M1, E4M3, E5M2, UE8M0, ElementFormat
from fp4gen.spec import GemmKernelSpec, GemmTile

ROOT = Path(__file__).resolve().parent.parent

# (A element, A block, A scale, B element, B block, B scale) of every supported pair
PAIRS = {
    "nvfp4_b2d": (E2M1, (1, 16), E4M3, E2M1, (16, 16), E4M3),
    "nvfp4_b1d": (E2M1, (1, 16), E4M3, E2M1, (1, 16), E4M3),
    "mxfp4": (E2M1, (1, 32), UE8M0, E2M1, (1, 32), UE8M0),
}


def make(pair: str, tile: str, out: str = "bf16", bias=False, acc=False) -> GemmKernelSpec:
    return GemmKernelSpec(*PAIRS[pair], out, bias, acc, TILES[tile])  # type: ignore[arg-type]


# every supported configuration: pair x tile x output dtype x bias x accumulate
ALL = {
    s.name: s
    for s in (
        make(p, t, o, bias, acc)
        for p, t, o, bias, acc in itertools.product(
            PAIRS, TILES, ("bf16", "fp32"), (False, True), (False, True)
        )
    )
}
# cross-compiled: each pair with each tile, the flags rotated so each value meets each tile
FLAGS = [("bf16", False, False), ("fp32", True, True), ("bf16", True, False)]
COMPILED = {
    s.name: s
    for s in (
        make(p, t, *FLAGS[(i + j) % len(FLAGS)])
        for i, p in enumerate(PAIRS)
        for j, t in enumerate(TILES)
    )
}


# ----------------------------------------------------------------------------------------------
# Specs, tiles, source
# ----------------------------------------------------------------------------------------------
def test_spec_names_and_tiles() -> None:
    s = make("nvfp4_b2d", "small")
    assert s.name == "gemm_e2m1_1x16_e4m3_x_e2m1_16x16_e4m3_bf16_m64n64w1a4s12"
    assert make("mxfp4", "mid", "fp32", True, True).name == (
        "gemm_e2m1_1x32_ue8m0_x_e2m1_1x32_ue8m0_fp32_bias_acc_m128n64w2s16"
    )
    assert make("nvfp4_b2d", "r16").name == (
        "gemm_e2m1_1x16_e4m3_x_e2m1_16x16_e4m3_bf16_r16n64w1x1x4k1s12c3"
    )
    assert TILES["r64"].name == "r64n128w2x2x1k2s4c2"
    assert len(ALL) == 3 * len(TILES) * 8 and len({s.digest for s in ALL.values()}) == len(ALL)
    assert pick_tile(1) is pick_tile(16) is TILES["r16"]
    assert pick_tile(17) is pick_tile(32) is TILES["r32"]
    assert pick_tile(33) is pick_tile(64) is TILES["r64"]
    assert pick_tile(65) is pick_tile(128) is pick_tile(256) is TILES["mid"]
    assert pick_tile(257) is TILES["large"]
    with pytest.raises(ValueError, match="multiple of mma_n_split"):
        GemmTile(64, 64, mma_warpgroups=1, stages_fp4=4, mma_n_split=2)
    with pytest.raises(ValueError, match="tile"):
        GemmTile(256, 64, mma_warpgroups=1, stages_fp4=4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(tile_m=128, tile_n=64), "tile_m"),
        (dict(tile_m=16, tile_n=48), "multiple of warp_n"),
        (dict(tile_m=16, tile_n=192), "do not split"),  # 3 warps along N of 4
        (dict(tile_m=16, tile_n=64, mma_warpgroups=2), "chunks"),  # 128 chunks, 256 threads
        (dict(tile_m=16, tile_n=64, warp_m=32), "multiple of warp_m"),
        (dict(tile_m=16, tile_n=64, acc_sets=2), "accumulator sets"),
        (dict(tile_m=16, tile_n=64, ktiles_per_stage=3), "k-tiles per stage"),
        # 4 warps along K each read every 4th stage: 10 stages would let a stage change
        # readers (a parity wait passing on a phase two rounds old), 6 with a stride of 2 too
        (dict(tile_m=32, tile_n=64, warp_m=32, stages_fp4=10), "a multiple of 4"),
        (dict(tile_m=16, tile_n=64, ktiles_per_stage=2, stages_fp4=5), "a multiple of 2"),
    ],
)
def test_small_tiles_are_validated(kwargs: dict, match: str) -> None:
    args = {"mma_warpgroups": 1, "stages_fp4": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        SmallMTile(**args)


def test_every_stage_is_always_read_by_the_same_warps() -> None:
    """Each small-M tile's warps along K walk the stages with a stride that divides the stage
    count, so a warp waits on every phase of its stages' barriers in turn (the r32 tile had 10
    stages for a stride of 4: a silent wrong product under load, now 12)."""
    for tile in [*TILES.values(), *CANDIDATES.values()]:
        if isinstance(tile, SmallMTile):
            tc = tile_constants(tile, b_sf_2d=False)
            assert tile.stages_fp4 % tc.stage_step == 0, tile.name
            reader = {}  # stage -> the first warp along K that reads it, over 3 rounds
            for i in range(3 * tile.stages_fp4):
                warp = i % tc.stage_step  # stage i of the CTA: warp (i mod stride) reads it
                assert reader.setdefault(i % tile.stages_fp4, warp) == warp, tile.name
    assert TILES["r32"].stages_fp4 == 12


def test_split_k_fills_one_wave() -> None:
    r16, r32, r64 = TILES["r16"], TILES["r32"], TILES["r64"]
    # 16 x 8192 x 8192 on 132 SMs: 128 tiles of 16 x 64, 3 CTAs per SM -> 3 ways (384 CTAs)
    assert r16.ctas_per_sm == 3 and choose_splits(r16, 16, 8192, 8192, 132) == 3
    assert r32.ctas_per_sm == 2 and choose_splits(r32, 32, 8192, 8192, 132) == 2
    # a narrow N: as many ways as the k-tiles allow (>= 8 each, whole stages), <= MAX_SPLITS
    assert choose_splits(r32, 1, 200, 4096, 132) == 8  # 64 k-tiles in stages of 1
    k4 = next(t for t in CANDIDATES.values() if t.ktiles_per_stage == 4)
    assert choose_splits(k4, 1, 200, 4096, 132) == 8  # 16 stages of 4 k-tiles, >= 2 each
    assert choose_splits(k4, 1, 200, 2048, 132) == 4
    assert choose_splits(r16, 1, 64, 65536, 132) == MAX_SPLITS
    # normalised so that no split is empty: 20 k-tiles in 2 ways of 10
    assert choose_splits(r32, 16, 64, 1280, 132) == 2
    # more tiles than a wave, short K, or a wgmma tile: no split
    assert choose_splits(r16, 16, 65536, 8192, 132) == 1
    assert choose_splits(r16, 16, 64, 512, 132) == 1
    assert choose_splits(TILES["mid"], 128, 64, 8192, 132) == 1
    for tile, m, n, k in itertools.product(
        (r16, r32, r64, k4), (1, 16, 61), (1, 64, 200, 8192), (16, 64, 4096, 8192)
    ):
        s = choose_splits(tile, m, n, k, 132)
        stages = -(-k // (64 * tile.ktiles_per_stage))
        per = -(-stages // s)
        assert 1 <= s <= MAX_SPLITS and (s - 1) * per < stages  # every split has stages


def test_tiles_fit_in_shared_memory() -> None:
    for tile, b2d in itertools.product(TILES.values(), (False, True)):
        tc = tile_constants(tile, b_sf_2d=b2d)
        assert tc.smem_bytes <= SMEM_CAP
        assert tc.threads == 128 * tile.mma_warpgroups + 32
        if isinstance(tile, SmallMTile):  # the CTAs per SM it is launched for fit
            assert isinstance(tc, SmallTileConstants)
            assert tile.ctas_per_sm * (tc.smem_bytes + 1024) <= SMEM_PER_SM
            assert tc.epi_steps * tc.compute_threads * 8 == tile.tile_m * tile.tile_n
    # small: about 104 KiB, so two CTAs of 160 threads share an SM
    assert tile_constants(TILES["small"], b_sf_2d=True).smem_bytes < SMEM_CAP // 2
    too_big = GemmTile(128, 256, mma_warpgroups=2, stages_fp4=9)
    with pytest.raises(ValueError, match="shared memory"):
        check_gemm(GemmKernelSpec(*PAIRS["nvfp4_b1d"], "bf16", False, False, too_big))


@pytest.mark.parametrize("name", sorted(ALL))
def test_render_is_valid_deterministic_python(name: str) -> None:
    s = ALL[name]
    src = render_gemm(s)
    compile(src, f"<{s.name}>", "exec")
    assert render_gemm(s) == src
    assert f'SPEC_NAME = "{s.name}"' in src and s.name in src.split('"""')[1]
    assert 'KERNELS: tuple[str, ...] = ("gemm",)' in src
    assert f"TILE_M = {s.tile.tile_m}\n" in src and f"TILE_N = {s.tile.tile_n}\n" in src
    assert f"HAS_BIAS = {s.bias}\n" in src and f"ACCUMULATE = {s.accumulate}\n" in src
    assert f'OUT_NAME = "{s.out_dtype}"' in src
    mx = s.a_scale == UE8M0
    assert f'DECODE = "{"lut" if mx else "arith"}"' in src
    assert ("SCALE_EXPAND = 2" in src) == mx
    assert ("EPILOGUE_SCALE" in src) == (not mx)
    assert f"B_SF_2D = {s.b_block[0] > 1}" in src
    small = isinstance(s.tile, SmallMTile)
    # the kernel class the spec's subclass binds: with a bias, the one whose launch takes it
    kernel = ("GemmSm90Small" if small else "GemmSm90") + ("BiasKernel" if s.bias else "Kernel")
    assert f"({kernel}):" in src
    # the decode the spec picks, imported from fp4gen.kernels.sm90_decode
    assert f"import decode8_{'lut' if mx else 'arith'} as decode8\n" in src
    assert f"import scale_pair_{'lut' if mx else 'arith'} as scale_pair\n" in src
    assert ('A_OPERAND = "codes"' in src) == small


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_generated_sources_are_ruff_clean(tmp_path: Path) -> None:
    for s in ALL.values():
        (tmp_path / f"{s.name}.py").write_text(render_gemm(s))
    for args in (["check", "--select", "E,F,W,I,UP,B,SIM"], ["format", "--check"]):
        proc = subprocess.run(
            ["ruff", *args, "--line-length", "100", "--no-cache", str(tmp_path)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


UE5M0 = ElementFormat(5, 0, signed=False)


@pytest.mark.parametrize(
    ("operands", "match"),
    [
        ((E4M3, (1, 32), UE8M0, E4M3, (1, 32), UE8M0), "e4m3 elements"),
        ((E2M1, (1, 16), E4M3, E5M2, (1, 16), E4M3), "B has e5m2 elements"),
        ((E2M1, (1, 16), None, E2M1, (1, 16), None), "fp32 block scales"),
        ((E2M1, (1, 16), UE5M0, E2M1, (1, 16), UE5M0), "ue5m0 block scales"),
        ((E2M1, (1, 16), E4M3, E2M1, (1, 32), UE8M0), "different scale formats"),
        ((E2M1, (16, 16), E4M3, E2M1, (16, 16), E4M3), "A has 16x16 blocks"),
        ((E2M1, (1, 32), E4M3, E2M1, (1, 16), E4M3), "A has 1x32 blocks"),
        ((E2M1, (1, 16), E4M3, E2M1, (32, 32), E4M3), "B has 32x32 blocks"),
        ((E2M1, (1, 32), UE8M0, E2M1, (32, 32), UE8M0), "takes 1x32"),
    ],
)
def test_unsupported_pairs_are_rejected_clearly(operands, match: str) -> None:
    spec = GemmKernelSpec(*operands, "bf16", False, False, TILES["small"])
    with pytest.raises(NotImplementedError, match=match):
        render_gemm(spec)


# ----------------------------------------------------------------------------------------------
# Cross-compilation for sm_90a (CPU only)
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("generated_gemm")
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = import_source(render_gemm(COMPILED[name]), directory)
        return cache[name]

    return get


def _ptx(fn) -> str:
    ptx = fn.__ptx__
    assert isinstance(ptx, str) and ".entry" in ptx, "PTX not kept"
    return "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith("//"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMPILED))
def test_cross_compile_sm90a(name: str, modules, tmp_path: Path) -> None:
    mod = modules(name)
    s = COMPILED[name]
    fn = mod.compile_kernel("gemm", "sm_90a", dump_dir=str(tmp_path))
    ptx = _ptx(fn)
    assert ".target sm_90a" in ptx
    small = isinstance(s.tile, SmallMTile)
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.f32\.bf16\.bf16", ptx)
    mma = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    if small:
        # a warp's k-tiles of one stage (unrolled): 4 k16 steps of (warp_m / 16) x
        # (warp_n / 8) atoms each, fp32 accumulation
        tc = tile_constants(s.tile, b_sf_2d=s.b_block[0] > 1)
        assert isinstance(tc, SmallTileConstants)
        subs = tc.subs
        assert not wgmma and mma == subs * 4 * (s.tile.warp_m // 16) * (s.tile.warp_n // 8)
        # split-K: partial tiles through L2, an acq_rel counter, no proxy fence in the mainloop
        assert "atom.acq_rel.gpu.global.add.u32" in ptx and "ld.global.cg.v4.f32" in ptx
        assert "fence.proxy.async" not in ptx
        assert f".minnctapersm {s.tile.ctas_per_sm}" in ptx
    else:
        n = s.tile.tile_n // s.tile.mma_n_split
        assert wgmma == [f"m64n{n}k16"] * 4 and not mma  # one k-tile: 4 x k16
        assert "fence.proxy.async" in ptx
    assert not re.search(r"\.local\b", ptx), "local memory (spills or indexed arrays)"
    assert not re.search(r"\.approx|\.ftz", ptx), "approximate or flush-to-zero math"
    # TMA of the A and B codes, for each k-tile of a stage
    kps = s.tile.ktiles_per_stage if small else 1
    assert ptx.count("cp.async.bulk.tensor.2d") == 2 * kps
    assert "cp.async.mbarrier.arrive.noinc" in ptx
    assert "mul.rn.bf16x2" in ptx
    # the small-M kernels gather A's byte codes with prmt in both decodes
    assert ("prmt.b32" in ptx) == (small or s.a_scale == UE8M0)
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == (s.a_scale == E4M3)
    ptxas = shutil.which("ptxas")
    files = list(tmp_path.glob("*.sm_90a.ptx"))
    if ptxas and files:
        proc = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", str(files[0]), "-o", os.devnull],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode == 0:  # an older ptxas may not know this PTX version
            assert "bytes spill" not in proc.stderr.replace("0 bytes spill", "")
            regs = int(re.search(r"Used (\d+) registers", proc.stderr).group(1))
            ctas = s.tile.ctas_per_sm if small else 1
            assert regs * (128 * s.tile.mma_warpgroups + 32) * ctas <= 65536 and regs <= 255


def test_compile_kernel_rejects_unknown_names_and_archs(modules) -> None:
    mod = modules(sorted(COMPILED)[0])
    assert mod.KERNELS == ("gemm",) and mod.ARCHS == ("sm_90a",)
    with pytest.raises(ValueError, match="no kernel"):
        mod.compile_kernel("quantize", "sm_90a")
    with pytest.raises(ValueError, match="arch"):
        mod.compile_kernel("gemm", "sm_100a")


@pytest.mark.parametrize("small", [False, True], ids=["wgmma", "small_m"])
def test_launch_args_validate_the_operands(modules, small: bool) -> None:
    import torch

    name = next(
        n
        for n, s in COMPILED.items()
        if s.b_block == (16, 16) and not s.bias and isinstance(s.tile, SmallMTile) == small
    )
    mod = modules(name)
    M, N, K = 3, 40, 64
    u8 = torch.uint8
    a_name = "a_codes" if small else "a_data"  # the small-M kernels read one code per byte
    ok = {
        a_name: torch.zeros(M, K if small else K // 2, dtype=u8),
        "a_scales": torch.zeros(M, K // 16, dtype=u8),
        "a_global": torch.ones(()),
        "b_data": torch.zeros(N, K // 2, dtype=u8),
        "b_scales": torch.zeros(3, K // 16, dtype=u8),
        "b_global": torch.ones(()),
    }
    out = torch.empty(M, N, dtype=mod.OUT_TORCH)
    with pytest.raises(TensorError, match="CUDA"):
        mod.launch_args(**ok, k=K, out=out)
    with pytest.raises(TensorError, match=a_name):
        mod.launch_args(**{**ok, a_name: torch.zeros(K // 2, dtype=u8)}, k=K, out=out)
    if small:  # the split-K workspace: [splits, tiles * tile elements] fp32, [tiles] int32
        ws, counters = mod.workspace(M, N, 3, "cpu")
        assert tuple(ws.shape) == (3, mod.tiles(M, N) * mod.TILE_ELEMS) == (3, 1 * 1 * 1024)
        assert counters.dtype == torch.int32 and int(counters.abs().sum()) == 0


# ----------------------------------------------------------------------------------------------
# Through the kernel cache: compile once, a second process loads
# ----------------------------------------------------------------------------------------------
LOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from fp4gen.codegen.gemm import TILES
    from fp4gen.compiler.cache import KernelCache
    from fp4gen.spec import GemmKernelSpec
    from fp4gen.formats import E2M1, E4M3
    from fp4gen.runtime import kernels_for

    spec = GemmKernelSpec(E2M1, (1, 16), E4M3, E2M1, (16, 16), E4M3, "bf16", False, False,
                          TILES["small"])
    k = kernels_for(spec, "sm_90a", cache=KernelCache(sys.argv[1]))
    s = k.stats
    print(json.dumps({"compiled": s.compiled, "loaded": s.loaded, "names": list(k),
                      "spec": k.module.SPEC_NAME, "callable": callable(k["gemm"])}))
    """
)


@pytest.mark.slow
def test_kernels_for_compiles_once_then_loads_in_a_new_process(tmp_path: Path) -> None:
    script = tmp_path / "load.py"
    script.write_text(LOAD_SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }

    def run() -> dict:
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "cache")],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = run()
    assert first == {**first, "compiled": 1, "loaded": 0, "names": ["gemm"], "callable": True}
    assert first["spec"] == "gemm_e2m1_1x16_e4m3_x_e2m1_16x16_e4m3_bf16_m64n64w1a4s12"
    second = run()
    assert second == {**second, "compiled": 0, "loaded": 1, "callable": True}
