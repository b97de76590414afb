"""Non-finite inputs poison S_dec inside the generated quantize kernels, on a CUDA GPU.

For each kind of shipped quantize kernel (NVFP4 1x16 with a global scale, 16x16 2D, the RHT
variants, tile row + column, MX ue8m0 without a global scale, FP8 1x128 and 128x128 with fp32
scales) and input dtype: an input holding a NaN, a +Inf or a -Inf (first element, last element,
the first and last of a padded edge tile, the middle) gives a NaN S_dec in every copy the module
writes (``NONFINITE_TO_NAN_SCALE``); an all-finite input gives every output bit for bit as the
reference quantizer (``fp4gen.numerics.quantize``, the oracle), also right after a
non-finite call on the same kernels.

The kernels are called directly (``kernels_for``), as in test_quantize_kernels_gpu.py. Skipped
without a CUDA GPU (marker ``gpu``).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from gpu_kernel_cache import compiled_cache

from fp4gen.codegen.quantize import choose_mapping, is_rowwise, render, spec_tile_mapping
from fp4gen.compiler.cache import KernelCache
from fp4gen.compiler.spec import QuantKernelSpec, QuantOutput
from fp4gen.dsl.model import RHTSpec
from fp4gen.formats import E2M1, E4M3, UE8M0, BlockFormat, ScaleSpec
from fp4gen.numerics import quantize
from fp4gen.runtime.kernels import kernels_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NV = ScaleSpec(E4M3, "nearest")
MX = ScaleSpec(UE8M0, "up")
FP32 = ScaleSpec(None)
TE16 = RHTSpec(16)
SEEDED32 = RHTSpec(32, "seeded", None, 0)
ROW, COL = "rowwise", "columnwise"
SR, SR8 = "stochastic", "stochastic8"


def out(direction, rounding="nearest", rht=None, layout="compact"):
    return QuantOutput(direction, rounding, rht, layout)  # type: ignore[arg-type]


# kind -> (element, block, scale, global scale, outputs)
KINDS = {
    # NVFP4: 1x16, e4m3 scales, global amax (rowwise template)
    "nvfp4_row": (E2M1, (1, 16), NV, True, (out(ROW),)),
    "nvfp4_row_sr8": (E2M1, (1, 16), NV, True, (out(ROW, SR8),)),
    "nvfp4_row_swizzled": (E2M1, (1, 16), NV, True, (out(ROW, layout="swizzled"),)),
    # the RHT variants
    "nvfp4_row_rht16_sr8": (E2M1, (1, 16), NV, True, (out(ROW, SR8, TE16),)),
    "nvfp4_col_rht16": (E2M1, (1, 16), NV, True, (out(COL, rht=TE16),)),
    "mxfp4_row_rht32_sr": (E2M1, (1, 32), MX, False, (out(ROW, SR, SEEDED32),)),
    "mxfp4_col_rht32": (E2M1, (1, 32), MX, False, (out(COL, rht=SEEDED32),)),
    # tile row + column (x, dy of a layer)
    "nvfp4_x": (E2M1, (1, 16), NV, True, (out(ROW), out(COL, rht=TE16))),
    "nvfp4_dy_sr8": (E2M1, (1, 16), NV, True, (out(ROW, SR8), out(COL, SR8, TE16))),
    "nvfp4_x_no_rht": (E2M1, (1, 16), NV, True, (out(ROW), out(COL))),
    # 16x16 2D (weights)
    "nvfp4_w_16x16": (E2M1, (16, 16), NV, True, (out(ROW), out(COL))),
    "nvfp4_w_16x16_row": (E2M1, (16, 16), NV, True, (out(ROW),)),
    # MX (ue8m0, no global scale)
    "mxfp4_row": (E2M1, (1, 32), MX, False, (out(ROW),)),
    "mxfp4_row_sr": (E2M1, (1, 32), MX, False, (out(ROW, SR),)),
    "mxfp4_dy": (E2M1, (1, 32), MX, False, (out(ROW, SR), out(COL, SR, SEEDED32))),
    "mxfp8_row": (E4M3, (1, 32), MX, False, (out(ROW, layout="swizzled"),)),
    "mxfp8_tile": (E4M3, (1, 32), MX, False, (out(ROW), out(COL))),
    # FP8 blockwise: fp32 scales, no global scale
    "fp8_1x128_row": (E4M3, (1, 128), FP32, False, (out(ROW),)),
    "fp8_1x128_tile": (E4M3, (1, 128), FP32, False, (out(ROW), out(COL))),
    "fp8_1x128_col": (E4M3, (1, 128), FP32, False, (out(COL),)),
    "fp8_128x128": (E4M3, (128, 128), FP32, False, (out(ROW), out(COL))),
}
# bf16 everywhere (the packed bf16x2 max), fp32 inputs (the fp32 max) for a few
DTYPES = {kind: ("bf16",) for kind in KINDS} | {
    kind: ("bf16", "fp32")
    for kind in ("nvfp4_row", "nvfp4_x", "nvfp4_w_16x16", "mxfp4_dy", "fp8_1x128_tile")
}
CASES = [(kind, dtype) for kind in KINDS for dtype in DTYPES[kind]]
_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BAD_VALUES = (math.nan, math.inf, -math.inf)


def make_spec(kind: str, dtype: str) -> QuantKernelSpec:
    element, block, scale, global_scale, outputs = KINDS[kind]
    return QuantKernelSpec(element, block, scale, global_scale, dtype, outputs)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def arch() -> str:
    major, _ = torch.cuda.get_device_capability()
    if major not in (9, 10):
        pytest.skip(f"no sm_90a/sm_100a kernels for compute capability {major}.x")
    return {9: "sm_90a", 10: "sm_100a"}[major]


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory, arch: str) -> KernelCache:
    """Every kernel of this file, compiled up front by worker processes (kept across sessions in
    $FP4GEN_GPU_TEST_CACHE when that is set)."""
    cache = compiled_cache(
        tmp_path_factory,
        "nonfinite-cache",
        [make_spec(kind, dtype) for kind, dtype in CASES],
        render,
        arch,
    )
    return cache


@pytest.fixture(scope="module")
def kernels(kernel_cache: KernelCache, arch: str):
    def get(kind: str, dtype: str):
        spec = make_spec(kind, dtype)
        return spec, kernels_for(spec, arch, cache=kernel_cache)

    return get


def shape(spec: QuantKernelSpec) -> tuple[int, int]:
    """M and K that are not multiples of the CTA tile (a padded edge tile in both directions)
    but are what the kernel takes."""
    if is_rowwise(spec):
        rht = spec.outputs[0].rht
        km = choose_mapping(spec.block[1], rht.size if rht else None, 2).k_multiple
        return 1000, km * 19
    m = spec_tile_mapping(spec)
    rows = m.m_multiple * max(1, -(-(m.tile_m + m.tile_m // 2) // m.m_multiple))
    cols = m.k_multiple * max(1, -(-(m.tile_k + m.tile_k // 2) // m.k_multiple))
    return rows + m.m_multiple, cols + m.k_multiple


def positions(spec: QuantKernelSpec, rows: int, cols: int) -> list[tuple[int, int]]:
    """First and last element, the first and the last element of the padded edge tile (the CTA
    tile holding the last row and column), and one in the middle."""
    if is_rowwise(spec):
        tm = tk = 1
    else:
        m = spec_tile_mapping(spec)
        tm, tk = m.tile_m, m.tile_k
    edge = ((rows - 1) // tm * tm, (cols - 1) // tk * tk)
    return sorted({(0, 0), (rows - 1, cols - 1), edge, (rows - 1, edge[1]), (rows // 2, cols // 2)})


def finite_input(spec: QuantKernelSpec, rows: int, cols: int, salt: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(salt)
    x = torch.randn(rows, cols, generator=g, device="cuda")
    x = x * torch.exp2(torch.randint(-8, 9, (rows, 1), generator=g, device="cuda").float())
    return x.to(_TORCH[spec.input_dtype]).contiguous()


def offsets_of(spec: QuantKernelSpec) -> tuple[int, ...]:
    return tuple((5 << 32) + 3 + i for i in range(len(spec.outputs)))


def run(spec: QuantKernelSpec, loaded, x: torch.Tensor, seed: int) -> dict:
    offsets = offsets_of(spec)
    offset = offsets[0] if is_rowwise(spec) else offsets
    got = loaded.module.run(loaded.fns, x, seed=seed, offset=offset)
    torch.cuda.synchronize()
    return got


def references(spec: QuantKernelSpec, x: torch.Tensor, seed: int) -> dict:
    """The reference of each copy, by output-key prefix ("" rowwise, "col_" columnwise)."""
    fmt = BlockFormat("test", spec.element, spec.block, spec.scale, spec.global_scale)
    offsets = offsets_of(spec)
    refs = {}
    if spec.block[0] != 1:  # one set of codes; the columnwise copy is its transpose
        o = spec.outputs[0]
        q = quantize(x, fmt, rounding=o.rounding, seed=seed, offset=offsets[0])
        for o in spec.outputs:
            refs["" if o.direction == ROW else "col_"] = q if o.direction == ROW else q.transpose()
        return refs
    for o, offset in zip(spec.outputs, offsets, strict=True):
        src = x if o.direction == ROW else x.t().contiguous()
        refs["" if o.direction == ROW else "col_"] = quantize(
            src,
            fmt,
            rounding=o.rounding,
            hadamard=o.rht,
            seed=seed,
            offset=offset,
        )
    return refs


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def differences(spec: QuantKernelSpec, got: dict, refs: dict) -> list[str]:
    bad = []
    for o in spec.outputs:
        p = "" if o.direction == ROW else "col_"
        ref = refs[p]
        want_scales = ref.scales if spec.scale.element is None else ref.scale_codes
        checks = [
            ("data", got[p + "data"], ref.data),
            ("scales", bits(got[p + "scales"]), bits(want_scales)),
            (
                "global_scale",
                bits(got[p + "global_scale"].reshape(1)),
                bits(ref.global_scale.reshape(1)),
            ),
        ]
        if o.scale_layout == "swizzled":
            checks.append(("scales_swizzled", got[p + "scales_swizzled"], ref.swizzled_scales()))
        for name, have, want in checks:
            if have.shape != want.shape or not torch.equal(have, want):
                bad.append(f"{p}{name} differs")
    return bad


def decode_scales(spec: QuantKernelSpec, got: dict) -> dict[str, float]:
    """Every copy's S_dec (``global_scale``, ``col_global_scale``)."""
    keys = [("" if o.direction == ROW else "col_") + "global_scale" for o in spec.outputs]
    return {key: got[key].item() for key in keys}


@pytest.mark.parametrize(("kind", "dtype"), CASES)
def test_non_finite_input_gives_nan_decode_scales(kind: str, dtype: str, kernels) -> None:
    spec, loaded = kernels(kind, dtype)
    assert loaded.module.NONFINITE_TO_NAN_SCALE is True
    rows, cols = shape(spec)
    salt = zlib.crc32(f"nonfinite/{kind}/{dtype}".encode())
    x = finite_input(spec, rows, cols, salt)
    refs = references(spec, x, salt)
    diffs = differences(spec, run(spec, loaded, x, salt), refs)
    assert not diffs, f"{spec.name} {rows}x{cols}, all finite: {diffs}"
    failures = []
    for r, c in positions(spec, rows, cols):
        for value in BAD_VALUES:
            bad = x.clone()
            bad[r, c] = value
            scales = decode_scales(spec, run(spec, loaded, bad, salt))
            if not all(math.isnan(s) for s in scales.values()):
                failures.append(f"x[{r}, {c}] = {value}: {scales}")
    assert not failures, f"{spec.name} {rows}x{cols}: " + "; ".join(failures[:6])
    # the same kernels, finite input again: every bit as the reference (no state left behind)
    diffs = differences(spec, run(spec, loaded, x, salt), refs)
    assert not diffs, f"{spec.name}, finite after non-finite: {diffs}"


@pytest.mark.parametrize("kind", ["nvfp4_row", "nvfp4_dy_sr8", "mxfp4_dy", "fp8_128x128"])
def test_all_values_non_finite(kind: str, kernels) -> None:
    """A whole tensor of NaN (or of Inf): NaN decode scales, and no fault."""
    spec, loaded = kernels(kind, "bf16")
    rows, cols = shape(spec)
    for value in BAD_VALUES:
        x = torch.full((rows, cols), value, dtype=torch.bfloat16, device="cuda")
        scales = decode_scales(spec, run(spec, loaded, x, 1))
        assert all(math.isnan(s) for s in scales.values()), (value, scales)


@pytest.mark.parametrize("kind", ["nvfp4_x", "mxfp4_dy", "fp8_1x128_tile", "nvfp4_w_16x16"])
def test_many_ctas_one_non_finite_value(kind: str, kernels) -> None:
    """A large tensor (thousands of CTAs) with one NaN deep inside: still NaN in every copy;
    the same tensor finite: the reference's bits."""
    spec, loaded = kernels(kind, "bf16")
    m = 1 if is_rowwise(spec) else spec_tile_mapping(spec).m_multiple
    rows, cols = 4096 // m * m, 4096
    x = finite_input(spec, rows, cols, 3)
    assert not differences(spec, run(spec, loaded, x, 3), references(spec, x, 3))
    x[rows - 77, 1234] = math.inf
    x[1234, cols - 77] = math.nan
    scales = decode_scales(spec, run(spec, loaded, x, 3))
    assert all(math.isnan(s) for s in scales.values()), scales
