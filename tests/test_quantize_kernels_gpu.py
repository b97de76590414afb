"""Generated quantize kernels on a CUDA GPU, bit-exact against the reference
``fp4gen.numerics.quantize``: packed codes, scale codes (fp32 scales by bits), the global scale and
the swizzled scale layout, over formats, shapes, input dtypes and value patterns.

Rowwise kernels against ``quantize(x)``; tile kernels (rowwise + columnwise in one launch, a
columnwise copy alone, 2D tiles) per copy: the rowwise copy against ``quantize(x)``, a 1D
columnwise copy against ``quantize(x.t().contiguous())`` (its Philox index is the transposed
one), a 2D columnwise copy against ``quantize(x, block=(B, B)).transpose()``.

Skipped without a CUDA GPU (marker ``gpu``). The kernels are compiled for the GPU's arch: sm_90a on
Hopper (where every 4- and 6-bit encode is the software path) or sm_100a on Blackwell, all of them
first, in parallel worker processes, into a kernel cache for the session.
"""

from __future__ import annotations

import zlib
from dataclasses import replace

import pytest
import torch
from gpu_kernel_cache import compiled_cache

from fp4gen.codegen.quantize import choose_mapping, render, spec_tile_mapping
from fp4gen.compiler.cache import KernelCache
from fp4gen.compiler.spec import QuantKernelSpec, QuantOutput
from fp4gen.dsl.model import RHTSpec
from fp4gen.errors import TensorError
from fp4gen.formats import (
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    UE8M0,
    BlockFormat,
    ElementFormat,
    ScaleSpec,
)
from fp4gen.kernels.tile import MAX_GRID_Y
from fp4gen.numerics import quantize
from fp4gen.runtime.kernels import kernels_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NVFP4_SCALE = ScaleSpec(E4M3, "nearest")
MX_SCALE = ScaleSpec(UE8M0, "up")
TE16 = RHTSpec(16)
SEEDED32 = RHTSpec(32, "seeded", None, 0)  # the mxfp4 recipe's "rht 32 seed 0"

E3M3FN = ElementFormat(3, 3, special="fn")
UE5M0 = ElementFormat(5, 0, signed=False)
E2M0, E3M0, E1M1 = ElementFormat(2, 0), ElementFormat(3, 0), ElementFormat(1, 1)


def case(element, block, scale, global_scale, rounding="nearest", rht=None, layout="compact"):
    return element, block, scale, global_scale, rounding, rht, layout


SR, SR16, SR8 = "stochastic", "stochastic16", "stochastic8"
CASES = {
    "nvfp4_rne": case(E2M1, 16, NVFP4_SCALE, True),
    "nvfp4_sr": case(E2M1, 16, NVFP4_SCALE, True, SR),
    "nvfp4_rht16_sr": case(E2M1, 16, NVFP4_SCALE, True, SR, TE16),
    "nvfp4_rht16_rne": case(E2M1, 16, NVFP4_SCALE, True, "nearest", TE16),
    "nvfp4_rne_swizzled": case(E2M1, 16, NVFP4_SCALE, True, layout="swizzled"),
    "mxfp4_rne": case(E2M1, 32, MX_SCALE, False),
    "mxfp4_sr": case(E2M1, 32, MX_SCALE, False, SR),
    "mxfp4_rht32_sr": case(E2M1, 32, MX_SCALE, False, SR, SEEDED32),
    "mxfp4_rht32_rne": case(E2M1, 32, MX_SCALE, False, "nearest", SEEDED32, "swizzled"),
    "mxfp8_e4m3": case(E4M3, 32, MX_SCALE, False),
    "mxfp8_e5m2": case(E5M2, 32, MX_SCALE, False, layout="swizzled"),
    "e3m2_b8_rne": case(E3M2, 8, NVFP4_SCALE, True),
    "e3m2_b8_sr": case(E3M2, 8, NVFP4_SCALE, True, SR),
    "nvfp4_sr8": case(E2M1, 16, NVFP4_SCALE, True, SR8),
    "nvfp4_rht16_sr8": case(E2M1, 16, NVFP4_SCALE, True, SR8, TE16),
    "mxfp4_sr16": case(E2M1, 32, MX_SCALE, False, SR16),
    "e3m2_b8_sr8": case(E3M2, 8, NVFP4_SCALE, True, SR8),
    "e4m3_b128_sr16_fp32_scales": case(E4M3, 128, ScaleSpec(None), False, SR16),
    "fp8_block_1x128": case(E4M3, 128, ScaleSpec(None), False),
    # beyond the shipped recipes
    "mxfp6_e2m3": case(E2M3, 32, MX_SCALE, False),
    "mxfp4_ocp": case(E2M1, 32, ScaleSpec(UE8M0, "ocp"), False),
    "e5m2_ue8m0_down_saturates": case(E5M2, 32, ScaleSpec(UE8M0, "down"), False),
    "e4m3_ue8m0_down_saturates": case(E4M3, 32, ScaleSpec(UE8M0, "down"), False),
    # ue8m0 and fp32 block scales take no global scale (numerics.md 2.1 refuses the pair)
    "e4m3_sr_ue8m0_nearest": case(E4M3, 32, ScaleSpec(UE8M0, "nearest"), False, SR),
    "e3m3fn_ue5m0_up": case(E3M3FN, 16, ScaleSpec(UE5M0, "up"), False),
    "e2m0_b24_e4m3_up": case(E2M0, 24, ScaleSpec(E4M3, "up"), False),
    "e3m0_rz_e3m0_scales": case(E3M0, 16, ScaleSpec(E3M0), True, "zero"),
    "e1m1_b8_sr_e5m2_scales": case(E1M1, 8, ScaleSpec(E5M2), False, SR),
    "e5m2_b128_fp32_scales_sr": case(E5M2, 128, ScaleSpec(None), False, SR),
    "nvfp4_b128_rht32_seeded_sr": case(
        E2M1, 128, ScaleSpec(E4M3, "down"), True, SR, RHTSpec(32, "seeded", None, 5)
    ),
    "nvfp4_b16_rht32_rne": case(
        E2M1, 16, NVFP4_SCALE, True, "nearest", RHTSpec(32, "none", None), "swizzled"
    ),
}
PATTERNS = (
    "randn",
    "zeros",
    "outliers",
    "subnormal_scales",
    "ties",
    "tiny",
    "huge",
    "flt_max",
    "signed_zero",
)
MS = (1, 7, 128, 272, 1000)


def make_spec(case: str, dtype: str) -> QuantKernelSpec:
    element, block, scale, global_scale, rounding, rht, layout = CASES[case]
    out = QuantOutput("rowwise", rounding, rht, layout)
    return QuantKernelSpec(element, (1, block), scale, global_scale, dtype, (out,))  # type: ignore[arg-type]


def k_values(spec: QuantKernelSpec) -> list[int]:
    rht = spec.outputs[0].rht
    km = choose_mapping(spec.block[1], rht.size if rht else None, 2).k_multiple
    ks = {km, 3 * km, 2048 if 2048 % km == 0 else 16 * km}
    if 304 % km == 0:
        ks.add(304)
    return sorted(ks)


_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture(scope="session")
def arch() -> str:
    major, _ = torch.cuda.get_device_capability()
    if major not in (9, 10):
        pytest.skip(f"no sm_90a/sm_100a kernels for compute capability {major}.x")
    return {9: "sm_90a", 10: "sm_100a"}[major]


def every_spec() -> list[QuantKernelSpec]:
    """The specs of every test in this file (compiled up front, in parallel)."""
    specs = [make_spec(case, dtype) for case in CASES for dtype in ("bf16", "fp32")]
    specs += [make_spec(case, "fp16") for case in FP16_CASES]
    specs += [tile_spec(case, dtype) for case in TILE_CASES for dtype in TILE_DTYPES[case]]
    return specs


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory, arch: str) -> KernelCache:
    """A kernel cache holding every kernel of this file, compiled by worker processes (kept
    across sessions in $FP4GEN_GPU_TEST_CACHE when that is set)."""
    cache = compiled_cache(tmp_path_factory, "quantize-cache", every_spec(), render, arch)
    return cache


@pytest.fixture(scope="module")
def kernels(kernel_cache: KernelCache, arch: str):
    def get(case: str, dtype: str):
        spec = make_spec(case, dtype)
        loaded = kernels_for(spec, arch, cache=kernel_cache)
        return spec, loaded.module, loaded.fns

    return get


def reference(spec: QuantKernelSpec, x: torch.Tensor, seed: int, offset: int):
    out = spec.outputs[0]
    fmt = BlockFormat("test", spec.element, spec.block, spec.scale, spec.global_scale)
    return quantize(
        x,
        fmt,
        rounding=out.rounding,
        hadamard=out.rht,
        seed=seed,
        offset=offset,
    )


def make_input(spec: QuantKernelSpec, pattern: str, m: int, k: int, salt: int) -> torch.Tensor:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(salt)
    dtype = _TORCH[spec.input_dtype]
    b = spec.block[1]
    x = torch.randn(m, k, generator=g, device=dev)
    if pattern == "randn":  # rows over a range of magnitudes
        x = x * torch.exp2(torch.randint(-8, 9, (m, 1), generator=g, device=dev).float())
    elif pattern == "zeros":
        x = torch.zeros(m, k, device=dev)
        x[:, 1::3] = -0.0
    elif pattern == "outliers":  # tiny, subnormal and zero block scales around the outliers
        flat = x.view(-1)
        n = max(1, flat.numel() // 5000)
        idx = torch.randint(0, flat.numel(), (n,), generator=g, device=dev)
        flat[idx] *= 1e4
        flat[idx[:1]] = 3e6
    elif pattern == "subnormal_scales":  # block magnitudes spread over 2^0 .. 2^-40
        xb = x.view(m, k // b, b)
        xb *= torch.exp2(torch.randint(-40, 1, (m, k // b, 1), generator=g, device=dev).float())
        x.view(-1)[0] = 8.0
    elif pattern == "ties":
        x = _ties(spec, m, k, g)
    elif pattern == "tiny":  # subnormal inputs: S_enc = A / ... overflows to FLT_MAX
        x = x * 1e-39
    elif pattern == "huge":
        x = x * 1e37
    elif pattern == "flt_max":
        x = _near_max(spec, m, k, g)
    elif pattern == "signed_zero":
        x = _signed_zeros(m, k, b, g)
    return x.to(dtype).contiguous()


def _signed_zeros(m: int, k: int, b: int, g: torch.Generator) -> torch.Tensor:
    """Negative values that round to zero (docs/numerics.md 1: negative zero, sign bit set),
    among -0.0 (code 0), +0.0 and tiny positives: magnitudes 2^0 .. 2^-133 (bf16's smallest
    subnormal), three in four negative, and about one outlier per block of 2^-4 .. 2^100, so
    that many values round to zero and some products x * e_b underflow to -0.0 (the sign of x
    is kept there too)."""
    dev = torch.device("cuda")
    mag = torch.exp2(-torch.randint(0, 134, (m, k), generator=g, device=dev).float())
    mag = mag * (1 + torch.rand(m, k, generator=g, device=dev))
    sign = torch.where(torch.rand(m, k, generator=g, device=dev) < 0.75, -1.0, 1.0)
    x = sign * mag
    n = max(1, m * k // b)
    idx = torch.randint(0, m * k, (n,), generator=g, device=dev)
    top = torch.exp2(torch.randint(-4, 101, (n,), generator=g, device=dev).float())
    x.view(-1)[idx] = top * sign.view(-1)[idx]
    x.view(-1)[1::5] = -0.0
    x.view(-1)[2::7] = 0.0
    return x


def _near_max(spec: QuantKernelSpec, m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Magnitudes from the input dtype's largest finite value down to 2^-12 of it, every 7th
    value exactly +-max, mixed with tiny values and zeros: block scales saturate at SCALE_CAP
    (docs/numerics.md 2). With an RHT the values stay below max / size, where the reference's
    butterflies do not overflow (it rejects what would)."""
    dev = torch.device("cuda")
    top = torch.finfo(_TORCH[spec.input_dtype]).max
    rhts = [o.rht.size for o in spec.outputs if o.rht is not None]
    top = top / max(rhts) if rhts else top
    mag = (1 + torch.rand(m, k, generator=g, device=dev, dtype=torch.float64)) / 2
    mag = mag * torch.exp2(-torch.randint(0, 13, (m, k), generator=g, device=dev).double())
    sign = torch.where(torch.rand(m, k, generator=g, device=dev) < 0.5, -1.0, 1.0).double()
    x = sign * mag * top
    x.view(-1)[::7] = sign.view(-1)[::7] * top
    x.view(-1)[3::11] = 1e-30
    x.view(-1)[5::13] = 0.0
    return x.float()


def _ties(spec: QuantKernelSpec, m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Blocks whose scaled values land on the element grid, its midpoints (RNE ties) and their
    fp32 neighbours: one element fixes each block's amax, the others are pool / e_b with e_b the
    reference's encode factor of that skeleton (exact when e_b is a power of two)."""
    dev = torch.device("cuda")
    fmt, b = spec.element, spec.block[1]
    n_mag = 1 << (fmt.bits - 1)
    grid = torch.tensor([fmt.value(c) for c in range(n_mag)], dtype=torch.float64)
    grid = grid[torch.isfinite(grid)]
    pool = torch.cat([grid, (grid[1:] + grid[:-1]) / 2]).float()
    pool = torch.cat([pool, torch.nextafter(pool, torch.zeros_like(pool))]).to(dev)
    nb = k // b
    mult = torch.tensor([1.0, 1.25, 1.5, 3.0], device=dev)
    bmax = torch.exp2(torch.randint(-6, 7, (m, nb), generator=g, device=dev).float())
    bmax = bmax * mult[torch.randint(0, 4, (m, nb), generator=g, device=dev)]
    sign = torch.where(torch.rand(m, nb, b, generator=g, device=dev) < 0.5, -1.0, 1.0)
    x = torch.zeros(m, nb, b, device=dev)
    x[:, :, 0] = bmax * sign[:, :, 0]
    dtype = _TORCH[spec.input_dtype]
    e_b = reference(spec, x.reshape(m, k).to(dtype), 0, 0).encode_scales  # [m, nb]
    fill = pool[torch.randint(0, pool.numel(), (m, nb, b), generator=g, device=dev)]
    fill = fill * sign / e_b[:, :, None]
    fill = torch.where(fill.abs() < bmax[:, :, None], fill, torch.zeros_like(fill))
    x[:, :, 1:] = fill[:, :, 1:]
    return x.reshape(m, k)


def compare(spec: QuantKernelSpec, got: dict, ref, x: torch.Tensor) -> list[str]:
    bad = []
    if not torch.equal(got["data"], ref.data):
        diff = (got["data"] != ref.data).nonzero()
        r, c = diff[0].tolist()
        per_byte = 8 / spec.element.bits
        lo = int(c * per_byte)
        bad.append(
            f"data: {diff.shape[0]} bytes differ, first [{r}, {c}]: "
            f"got {int(got['data'][r, c]):#04x} want {int(ref.data[r, c]):#04x}; "
            f"x[{r}, {lo}:{lo + 2}] = {x[r, lo : lo + 2].float().tolist()}"
        )
    if spec.scale.element is None:
        ok = torch.equal(got["scales"].view(torch.int32), ref.scales.view(torch.int32))
    else:
        ok = torch.equal(got["scales"], ref.scale_codes)
    if not ok:
        want = ref.scales if spec.scale.element is None else ref.scale_codes
        i = (got["scales"] != want).nonzero()[0].tolist()
        bad.append(f"scales differ, first {i}: got {got['scales'][tuple(i)]} want {want[tuple(i)]}")
    if not torch.equal(got["global_scale"].view(torch.int32), ref.global_scale.view(torch.int32)):
        bad.append(f"global scale {got['global_scale'].item()!r} != {ref.global_scale.item()!r}")
    if spec.outputs[0].scale_layout == "swizzled" and not torch.equal(
        got["scales_swizzled"], ref.swizzled_scales()
    ):
        bad.append("swizzled scales differ")
    return bad


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bit_exact(case: str, dtype: str, pattern: str, kernels) -> None:
    spec, mod, fns = kernels(case, dtype)
    failures = []
    for m in MS:
        for k in k_values(spec):
            salt = zlib.crc32(f"{case}/{dtype}/{pattern}/{m}/{k}".encode())
            x = make_input(spec, pattern, m, k, salt)
            # seeds and offsets above 2^32 exercise every Philox key and counter word
            seed, offset = (salt, 0) if m % 2 else ((salt << 32) | 0x5EED, (3 << 32) + m)
            got = mod.run(fns, x, seed=seed, offset=offset)
            torch.cuda.synchronize()
            for msg in compare(spec, got, reference(spec, x, seed, offset), x):
                failures.append(f"{m}x{k}: {msg}")
    assert not failures, f"{spec.name}, {pattern}: " + "; ".join(failures[:5])


FP16_CASES = ("nvfp4_rne", "mxfp4_rht32_sr", "e3m2_b8_sr", "fp8_block_1x128")


@pytest.mark.parametrize("case", FP16_CASES)
def test_fp16_input(case: str, kernels) -> None:
    spec, mod, fns = kernels(case, "fp16")
    for m, k in [(7, 2048), (272, 384)]:
        x = make_input(spec, "randn", m, k, m + k)
        got = mod.run(fns, x, seed=11, offset=3)
        assert not compare(spec, got, reference(spec, x, 11, 3), x)


def test_large_tensor_and_repeat_calls(kernels) -> None:
    """Many CTAs and a second call on the same compiled kernels (fresh amax buffer each run)."""
    spec, mod, fns = kernels("nvfp4_rht16_sr", "bf16")
    for scale in (1.0, 100.0):
        x = make_input(spec, "randn", 4096, 4096, 5) * scale
        got = mod.run(fns, x, seed=7, offset=1)
        assert not compare(spec, got, reference(spec, x, 7, 1), x)


def test_stochastic_rounding_depends_on_seed_and_offset(kernels) -> None:
    spec, mod, fns = kernels("nvfp4_sr", "bf16")
    x = make_input(spec, "randn", 64, 1024, 1)
    a = mod.run(fns, x, seed=1, offset=0)["data"]
    assert not torch.equal(a, mod.run(fns, x, seed=2, offset=0)["data"])
    assert not torch.equal(a, mod.run(fns, x, seed=1, offset=1)["data"])
    assert torch.equal(a, mod.run(fns, x, seed=1, offset=0)["data"])


def test_run_rejects_bad_inputs_on_the_gpu(kernels) -> None:
    spec, mod, fns = kernels("nvfp4_rne", "bf16")
    buf = torch.zeros(64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(TensorError, match="aligned"):
        mod.run(fns, buf[1:49].view(3, 16))  # contiguous, but 2 bytes past an aligned address
    with pytest.raises(TensorError, match="bfloat16"):
        mod.run(fns, buf.view(4, 16).float())


# ----------------------------------------------------------------------------------------------
# Tile kernels: rowwise + columnwise in one launch, a columnwise copy alone, 2D tiles
# ----------------------------------------------------------------------------------------------
ROW, COL = "rowwise", "columnwise"


def out(direction, rounding="nearest", rht=None, layout="compact"):
    return direction, rounding, rht, layout


NVFP4 = (E2M1, NVFP4_SCALE, True)
MXFP4 = (E2M1, MX_SCALE, False)
TILE_CASES = {
    # what the shipped recipes plan (every planned spec's format, block, rounding and RHT)
    "nvfp4_x": (*NVFP4, (1, 16), (out(ROW), out(COL, rht=TE16))),
    "nvfp4_dy": (*NVFP4, (1, 16), (out(ROW, SR), out(COL, SR, TE16))),
    "nvfp4_x_no_rht": (*NVFP4, (1, 16), (out(ROW), out(COL))),
    "nvfp4_dy_no_rht": (*NVFP4, (1, 16), (out(ROW, SR), out(COL, SR))),
    "nvfp4_x_col_only": (*NVFP4, (1, 16), (out(COL, rht=TE16),)),
    "nvfp4_w_16x16": (*NVFP4, (16, 16), (out(ROW), out(COL))),
    "nvfp4_w_16x16_col_only": (*NVFP4, (16, 16), (out(COL),)),
    "nvfp4_w_16x16_row_only": (*NVFP4, (16, 16), (out(ROW),)),  # quantize(w, block=(16, 16))
    "mxfp4_x": (*MXFP4, (1, 32), (out(ROW), out(COL, rht=SEEDED32))),
    "mxfp4_dy": (*MXFP4, (1, 32), (out(ROW, SR), out(COL, SR, SEEDED32))),
    "mxfp4_w": (*MXFP4, (1, 32), (out(ROW), out(COL))),
    "mxfp8": (E4M3, MX_SCALE, False, (1, 32), (out(ROW), out(COL))),
    "e3m2_b8_rne": (E3M2, NVFP4_SCALE, True, (1, 8), (out(ROW), out(COL))),
    "e3m2_b8_sr": (E3M2, NVFP4_SCALE, True, (1, 8), (out(ROW, SR), out(COL, SR))),
    "nvfp4_dy_sr8": (*NVFP4, (1, 16), (out(ROW, SR8), out(COL, SR8, TE16))),
    "nvfp4_dy_no_rht_sr8": (*NVFP4, (1, 16), (out(ROW, SR8), out(COL, SR8))),
    "e3m2_b8_sr8": (E3M2, NVFP4_SCALE, True, (1, 8), (out(ROW, SR8), out(COL, SR8))),
    "fp8_1x128": (E4M3, ScaleSpec(None), False, (1, 128), (out(ROW), out(COL))),
    "fp8_1x128_col_only": (E4M3, ScaleSpec(None), False, (1, 128), (out(COL),)),
    "fp8_128x128": (E4M3, ScaleSpec(None), False, (128, 128), (out(ROW), out(COL))),
    "fp8_64x64": (E4M3, ScaleSpec(None), False, (64, 64), (out(ROW), out(COL))),  # 4 lanes on M
    "fp8_128x128_row_only": (E4M3, ScaleSpec(None), False, (128, 128), (out(ROW),)),
    # beyond them: swizzled scales, SR with 2D tiles, other scale formats and roundings
    "nvfp4_swizzled": (
        *NVFP4,
        (1, 16),
        (out(ROW, SR, None, "swizzled"), out(COL, "nearest", TE16, "swizzled")),
    ),
    "nvfp4_2d_sr_swizzled": (
        *NVFP4,
        (16, 16),
        (out(ROW, SR, None, "swizzled"), out(COL, SR, None, "swizzled")),
    ),
    "mxfp8_2d_32": (E4M3, MX_SCALE, False, (32, 32), (out(ROW), out(COL))),
    "mxfp4_ocp_col_sr_swizzled": (
        E2M1,
        ScaleSpec(UE8M0, "ocp"),
        False,
        (1, 32),
        (out(COL, SR, SEEDED32, "swizzled"),),
    ),
    "e5m2_1x128_fp32": (  # fp32 block scales take no global scale (numerics.md 2.1)
        E5M2,
        ScaleSpec(None),
        False,
        (1, 128),
        (out(ROW, SR), out(COL, "zero")),
    ),
    "e2m3_e5m2_scales": (E2M3, ScaleSpec(E5M2), False, (1, 32), (out(ROW), out(COL, SR))),
    "e3m2_2d_e4m3_up": (E3M2, ScaleSpec(E4M3, "up"), True, (16, 16), (out(ROW), out(COL))),
    "nvfp4_2d_sr8_swizzled": (
        *NVFP4,
        (16, 16),
        (out(ROW, SR8, None, "swizzled"), out(COL, SR8, None, "swizzled")),
    ),
    "mxfp4_dy_sr16": (*MXFP4, (1, 32), (out(ROW, SR16), out(COL, SR16, SEEDED32))),
    "nvfp4_row_sr8_col_sr32": (*NVFP4, (1, 16), (out(ROW, SR8), out(COL, SR, TE16))),
    "e2m3_col_sr8_only": (E2M3, MX_SCALE, False, (1, 32), (out(COL, SR8),)),
}
TILE_DTYPES = {case: ("bf16", "fp32") for case in TILE_CASES} | {
    "nvfp4_swizzled": ("fp16", "bf16"),
    "e2m3_e5m2_scales": ("fp16",),
}
TILE_PATTERNS = (
    "randn",
    "zeros",
    "outliers",
    "subnormal_scales",
    "tiny",
    "huge",
    "flt_max",
    "signed_zero",
)
TILE_MS = (16, 272, 1000, 4096)


def tile_spec(case: str, dtype: str) -> QuantKernelSpec:
    element, scale, global_scale, block, outs = TILE_CASES[case]
    outputs = tuple(QuantOutput(*o) for o in outs)  # type: ignore[arg-type]
    return QuantKernelSpec(element, block, scale, global_scale, dtype, outputs)  # type: ignore[arg-type]


def tile_mapping(spec: QuantKernelSpec):
    return spec_tile_mapping(spec)


def tile_shapes(spec: QuantKernelSpec) -> list[tuple[int, int]]:
    """M in TILE_MS, K in {K_MULTIPLE, 304 where allowed, 1024}, as far as the spec allows."""
    m = tile_mapping(spec)
    ks = sorted({m.k_multiple, 1024} | ({304} if 304 % m.k_multiple == 0 else set()))
    ms = [v for v in TILE_MS if v % m.m_multiple == 0]
    return [(mm, k) for mm in ms for k in ks if mm * k <= 4096 * 1024]


def tile_input(spec: QuantKernelSpec, pattern: str, m: int, k: int, salt: int) -> torch.Tensor:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(salt)
    b = spec.block[1]
    if pattern == "subnormal_scales":  # magnitudes 2^0 .. 2^-40 per B x B tile: blocks along
        # either direction, and the 2D tiles, get tiny, subnormal and zero scales
        x = torch.randn(m, k, generator=g, device=dev)
        e = torch.randint(-40, 1, (-(-m // b), -(-k // b)), generator=g, device=dev).float()
        x *= torch.exp2(e).repeat_interleave(b, 0)[:m].repeat_interleave(b, 1)[:, :k]
        x.view(-1)[0] = 8.0
        return x.to(_TORCH[spec.input_dtype]).contiguous()
    if spec.input_dtype == "fp16":  # outliers past fp16's range would be inf: clamp them
        x = make_input(replace(spec, input_dtype="fp32"), pattern, m, k, salt)
        return x.clamp(-60000.0, 60000.0).to(torch.float16)
    return make_input(spec, pattern, m, k, salt)


@pytest.fixture(scope="module")
def tile_kernels(kernel_cache: KernelCache, arch: str):
    def get(case: str, dtype: str):
        spec = tile_spec(case, dtype)
        return spec, kernels_for(spec, arch, cache=kernel_cache)

    return get


def tile_references(spec: QuantKernelSpec, x: torch.Tensor, seed: int, offsets: tuple[int, ...]):
    """The reference of each copy, by direction."""
    fmt = BlockFormat("test", spec.element, spec.block, spec.scale, spec.global_scale)
    refs = {}
    if spec.block[0] != 1:  # one set of codes, in the input's orientation
        o = spec.outputs[0]
        q = quantize(x, fmt, rounding=o.rounding, seed=seed, offset=offsets[0])
        for o in spec.outputs:
            refs[o.direction] = q if o.direction == ROW else q.transpose()
        return refs
    for o, offset in zip(spec.outputs, offsets, strict=True):
        src = x if o.direction == ROW else x.t().contiguous()
        refs[o.direction] = quantize(
            src,
            fmt,
            rounding=o.rounding,
            hadamard=o.rht,
            seed=seed,
            offset=offset,
        )
    return refs


def compare_tile(spec: QuantKernelSpec, got: dict, refs: dict) -> list[str]:
    bad = []
    for o in spec.outputs:
        ref = refs[o.direction]
        p = "" if o.direction == ROW else "col_"
        tag = o.direction
        if not torch.equal(got[p + "data"], ref.data):
            diff = (got[p + "data"] != ref.data).nonzero()
            r, c = diff[0].tolist()
            bad.append(
                f"{tag} data: {diff.shape[0]} bytes differ, first [{r}, {c}]: "
                f"got {int(got[p + 'data'][r, c]):#04x} want {int(ref.data[r, c]):#04x}"
            )
        if spec.scale.element is None:
            want = ref.scales
            ok = torch.equal(got[p + "scales"].view(torch.int32), want.view(torch.int32))
        else:
            want = ref.scale_codes
            ok = torch.equal(got[p + "scales"], want)
        if not ok:
            if got[p + "scales"].shape != want.shape:
                bad.append(
                    f"{tag} scales shape {tuple(got[p + 'scales'].shape)} != {tuple(want.shape)}"
                )
            else:
                i = (got[p + "scales"] != want).nonzero()[0].tolist()
                bad.append(
                    f"{tag} scales differ, first {i}: got {got[p + 'scales'][tuple(i)]} "
                    f"want {want[tuple(i)]}"
                )
        gs = got[p + "global_scale"].reshape(()).view(torch.int32)
        if not torch.equal(gs, ref.global_scale.view(torch.int32)):
            have, want_s = got[p + "global_scale"].item(), ref.global_scale.item()
            bad.append(f"{tag} global scale {have!r} != {want_s!r}")
        if o.scale_layout == "swizzled" and not torch.equal(
            got[p + "scales_swizzled"], ref.swizzled_scales()
        ):
            bad.append(f"{tag} swizzled scales differ")
    return bad


@pytest.mark.parametrize("pattern", TILE_PATTERNS)
@pytest.mark.parametrize(
    ("case", "dtype"), [(c, d) for c in sorted(TILE_CASES) for d in TILE_DTYPES[c]]
)
def test_tile_bit_exact(case: str, dtype: str, pattern: str, tile_kernels) -> None:
    spec, loaded = tile_kernels(case, dtype)
    failures = []
    for m, k in tile_shapes(spec):
        salt = zlib.crc32(f"tile/{case}/{dtype}/{pattern}/{m}/{k}".encode())
        x = tile_input(spec, pattern, m, k, salt)
        # seeds and offsets above 2^32 exercise every Philox key and counter word; the copies get
        # different offsets (the runtime gives each operand slot its own stream)
        seed = salt if m % 3 else (salt << 32) | 0x5EED
        offsets = tuple((3 << 32) + m + i if m % 2 == 0 else i for i in range(len(spec.outputs)))
        got = loaded.run(x, seed=seed, offset=offsets)
        torch.cuda.synchronize()
        for msg in compare_tile(spec, got, tile_references(spec, x, seed, offsets)):
            failures.append(f"{m}x{k}: {msg}")
    assert not failures, f"{spec.name}, {pattern}: " + "; ".join(failures[:5])


def test_tile_one_offset_serves_both_copies_and_repeat_calls(tile_kernels) -> None:
    """An int offset is every copy's; a second call on the same kernels (fresh amax buffers)
    gives the same bits; many CTAs."""
    spec, loaded = tile_kernels("nvfp4_dy", "bf16")
    for scale in (1.0, 300.0):
        x = tile_input(spec, "randn", 4096, 4096, 9) * scale
        got = loaded.run(x, seed=5, offset=7)
        assert not compare_tile(spec, got, tile_references(spec, x, 5, (7, 7)))
        again = loaded.run(x, seed=5, offset=7)
        assert torch.equal(got["col_data"], again["col_data"])


@pytest.mark.parametrize("case", ["nvfp4_dy_sr8", "nvfp4_x"])
def test_tile_one_dimensional_grid_past_max_grid_y(case: str, tile_kernels) -> None:
    """More than MAX_GRID_Y tile rows: the grid falls back to one dimension and each CTA
    divides its index (the amax kernel's CTA count for the prepared constants included)."""
    spec, loaded = tile_kernels(case, "bf16")
    mod = loaded.module
    m, k = (MAX_GRID_Y + 1) * mod.TILE.tile_m, tile_mapping(spec).k_multiple
    x = tile_input(spec, "randn", m, k, 17)
    offsets = (3, 4)
    got = loaded.run(x, seed=11, offset=offsets)
    assert not compare_tile(spec, got, tile_references(spec, x, 11, offsets))


def test_tile_amax_kernel_resets_its_cta_counter(tile_kernels) -> None:
    """The last CTA of the amax kernel sets the counter back to 0, so a plan can be launched
    again on the same buffers (as benchmarks do) and its last CTA still prepares the constants."""
    spec, loaded = tile_kernels("nvfp4_dy_sr8", "bf16")
    mod = loaded.module
    x = tile_input(spec, "randn", 1008, 1024, 3)
    out, plan = mod.launches(x, seed=2, offset=(5, 6))
    amax_args = plan[0][1]  # (x, amaxes..., counter, constants, S_dec...)
    count, consts = amax_args[1 + mod.AMAX_SLOTS], amax_args[2 + mod.AMAX_SLOTS]
    for _ in range(2):
        consts.fill_(float("nan"))
        for name, args in plan:
            loaded.fns[name](*args)
        torch.cuda.synchronize()
        assert int(count.item()) == 0
        assert not compare_tile(spec, out, tile_references(spec, x, 2, (5, 6)))


def test_tile_stochastic_rounding_depends_on_each_offset(tile_kernels) -> None:
    spec, loaded = tile_kernels("nvfp4_dy", "bf16")
    x = tile_input(spec, "randn", 256, 1024, 1)
    a = loaded.run(x, seed=1, offset=(0, 0))
    b = loaded.run(x, seed=1, offset=(0, 1))
    assert torch.equal(a["data"], b["data"]) and not torch.equal(a["col_data"], b["col_data"])


def test_tile_rejects_bad_shapes_on_the_gpu(tile_kernels) -> None:
    spec, loaded = tile_kernels("nvfp4_dy", "bf16")
    with pytest.raises(TensorError, match="M must be a multiple of 16"):
        loaded.run(torch.zeros(1000, 64, dtype=torch.bfloat16, device="cuda"))
    spec, loaded = tile_kernels("nvfp4_w_16x16", "bf16")
    with pytest.raises(TensorError, match="M must be a multiple of 8"):
        loaded.run(torch.zeros(1004, 64, dtype=torch.bfloat16, device="cuda"))
