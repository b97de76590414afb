"""Non-finite inputs poison S_dec inside the generated quantize kernels (CPU only: render and
cross-compile for sm_90a and sm_100a, PTX read back; the behaviour on a GPU is in
test_nonfinite_kernels_gpu.py).

With a global scale the amax kernel's reduction is NaN-propagating (max.NaN.f32, and
max.NaN.xorsign.abs.bf16x2 for bf16 inputs) and a non-finite amax maps to S_dec = NaN; without one
the quantize kernel stores NaN over the 1.0 S_dec of a copy whose block amaxes were not finite.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from test_codegen_quantize import ALL_SPECS, PLANNED_SPECS, TILE_SPECS  # noqa: E402

from fp4gen.codegen import import_source
from fp4gen.codegen.quantize import ARCHS, render
from fp4gen.kernels import quantize as kernels_quantize
from fp4gen.kernels import quantize_tile as kernels_quantize_tile
from fp4gen.kernels import quantize_tile_host
from fp4gen.kernels import scale as kernels_scale

ROOT = Path(__file__).resolve().parent.parent
NAN_BITS = "0f7FFFFFFF"  # the NaN stored as S_dec, as a PTX fp32 literal
NAN_INT = "2147483647"  # the same bits as an integer (the tile kernels' predicated stores)

# every kind of kernel the change touches: rowwise and tile templates, with and without a global
# scale (prepared constants or not), 1D and 2D blocks, an RHT copy, several warps per column
# block, stochastic rounding
CASES = [
    "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8",  # rowwise, global, SR
    "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne_rht16",  # rowwise, global, row RHT
    "quant_e4m3_1x128_fp32_nog_bf16_row_rne",  # rowwise, no global, 4 lanes per block
    "quant_e2m1_1x32_ue8m0ru_nog_bf16_row_sr",  # rowwise, no global (MXFP4), SR
    "e3m3fn_ue5m0_fp32in",  # rowwise, fp32 input (fp32 absmax)
    "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8_col_sr8_rht16",  # tile, global, prepared, staged
    "quant_e2m1_16x16_e4m3rn_g_bf16_row_rne_col_rne",  # tile, global, 2D
    "e5m2_1x128_fp32scales_global_sr",  # tile, global, not prepared, 4 warps per column block
    "quant_e2m1_1x32_ue8m0ru_nog_bf16_row_sr_col_sr_rht32",  # tile, no global, column RHT
    "quant_e4m3_1x128_fp32_nog_bf16_row_rne_col_rne",  # tile, no global, 4 warps per block
    "quant_e4m3_128x128_fp32_nog_bf16_row_rne_col_rne",  # tile, no global, 2D
    "mxfp8_2d_32_fp32in",  # tile, no global, 2D, fp32 input
]
SPECS = ALL_SPECS | TILE_SPECS


def test_every_generated_module_exports_the_constant() -> None:
    """The runtime drops its separate finite check for modules with the constant: every
    rendered quantize module has it (and the checked-in ones)."""
    for spec in [*SPECS.values(), *PLANNED_SPECS.values()]:
        try:
            src = render(spec)
        except NotImplementedError:  # a planned tile spec the build replaces by stand-ins
            continue
        # per-row global scales: the runtime checks the input itself (one S_dec per row)
        want = "False" if spec.global_rows else "True"
        assert f"\nNONFINITE_TO_NAN_SCALE = {want}\n" in src, spec.name
    checked_in = sorted(ROOT.glob("generated/*/quant_*.py"))
    assert checked_in
    for path in checked_in:
        want = "False" if "_grow_" in path.name else "True"  # per-row global scales
        assert f"\nNONFINITE_TO_NAN_SCALE = {want}\n" in path.read_text(), path.name


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("nonfinite")
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = import_source(render(SPECS[name]), directory)
        return cache[name]

    return get


def _ptx(fn) -> str:
    ptx = fn.__ptx__
    assert isinstance(ptx, str) and ".entry" in ptx, "PTX not kept"
    return "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith("//"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", CASES)
def test_kernels_poison_the_decode_scale(name: str, arch: str, modules, tmp_path: Path) -> None:
    mod = modules(name)
    spec = SPECS[name]
    assert mod.NONFINITE_TO_NAN_SCALE is True
    bf16 = spec.input_dtype == "bf16"
    ptx = {k: _ptx(mod.compile_kernel(k, arch, dump_dir=str(tmp_path / k))) for k in mod.KERNELS}
    for kernel, text in ptx.items():
        assert f".target {arch}" in text
        assert not re.search(r"\.local\b", text), f"{kernel} uses local memory (spills)"
        # a plain packed max would drop a NaN of the input
        assert "max.xorsign.abs.bf16x2" not in text
    if spec.global_scale:
        amax = ptx["amax"]
        # every max of the global amax reduction propagates NaN
        assert "max.NaN.f32" in amax
        assert not re.search(r"\bmax\.f32\b", amax), "a max of the amax reduction drops NaN"
        if bf16 and any(o.direction == "rowwise" and o.rht is None for o in spec.outputs):
            assert "max.NaN.xorsign.abs.bf16x2" in amax  # the packed max of bf16 inputs
        # the atomic max on the bits, one per CTA (per amax slot)
        assert "atom.global" in amax or "red.global" in amax
        # the NaN S_dec where the global scales are prepared (the last CTA of the amax kernel,
        # or every quantize thread)
        prepared = hasattr(mod, "CONST_LEN")
        assert NAN_BITS in (amax if prepared else ptx["quantize"])
    else:
        assert mod.KERNELS == ("quantize",)
        quant = ptx["quantize"]
        # the block amaxes propagate NaN; a thread with a non-finite one stores NaN into S_dec
        assert "max.NaN.f32" in quant
        if bf16 and any(o.direction == "rowwise" and o.rht is None for o in spec.outputs):
            assert "max.NaN.xorsign.abs.bf16x2" in quant
        assert NAN_BITS in quant or NAN_INT in quant


def test_tile_kernels_without_a_global_scale_store_nan_per_copy(modules) -> None:
    """One predicated NaN store per copy, on S_dec tensors the quantize kernel takes."""
    for name in (
        "quant_e2m1_1x32_ue8m0ru_nog_bf16_row_sr_col_sr_rht32",
        "quant_e4m3_128x128_fp32_nog_bf16_row_rne_col_rne",
    ):
        src = render(SPECS[name])
        for tag in ("row", "col"):
            assert f"mSdec_{tag}: cute.Tensor" in src
    # the tile kernel class: a predicated NaN store per copy, over that copy's S_dec
    stores = inspect.getsource(kernels_quantize_tile.TileQuantizeKernel.nan_stores)
    assert "for i in range(len(self.p.copies)):" in stores
    assert "store_if(sdecs[i].iterator.toint(), Uint32(NAN_BITS), bad, 4)" in stores
    # S_dec = 1.0 from launches(), one allocation for both copies
    launches = inspect.getsource(quantize_tile_host.TileHost.launches)
    assert "s_dec = torch.ones(copies, dtype=torch.float32, device=dev)" in launches


def test_rowwise_kernel_without_a_global_scale_takes_its_decode_scale() -> None:
    src = render(SPECS["quant_e4m3_1x128_fp32_nog_bf16_row_rne"])
    from fp4gen.kernels.quantize_host import RowwiseHost

    # the host (kernels.quantize_host) passes S_dec = 1.0 for the kernel to overwrite
    launches = inspect.getsource(RowwiseHost.launches)
    assert "s_dec = torch.ones(1, dtype=torch.float32, device=dev)" in launches
    assert "GLOBAL_SCALE = False" in src and "global_scale=GLOBAL_SCALE," in src
    # the rowwise kernel class: a thread with a non-finite block amax stores NaN over the 1.0
    body = inspect.getsource(kernels_quantize.RowwiseQuantizeKernel.body)
    assert "mSdec[0] = Uint32(NAN_BITS).bitcast(Float32)" in body
    assert "seen = fmax_nan(seen, seen_v)" in body


def test_global_scales_map_a_non_finite_amax_to_nan() -> None:
    src = render(SPECS["quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8"])
    assert "global_num=GLOBAL_NUM," in src  # the rowwise kernel takes kernels.scale's
    body = inspect.getsource(kernels_scale.global_scales)
    assert "amax.bitcast(Uint32) < Uint32(NONFINITE_BITS)" in body
    assert "NAN_BITS" in body
