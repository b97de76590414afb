"""The tile quantize kernel class (fp4gen.kernels.quantize_tile) and its host code
(fp4gen.kernels.quantize_tile_host), on the CPU: the entries' named arguments, the order in which
the kernel splits them, the amax kernel's parameters derived from the quantize kernel's, and the
host's offsets and input rules. The kernels' numerics are the GPU tests'
(tests/test_quantize_kernels_gpu.py); their PTX is tests/ptx_identity.py's."""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("CUTE_DSL_NO_CACHE", "1")

from test_codegen_quantize import TILE_SPECS  # noqa: E402

from fp4gen.codegen import import_source  # noqa: E402
from fp4gen.codegen.quantize import render  # noqa: E402
from fp4gen.device_offset import DeviceOffset  # noqa: E402
from fp4gen.errors import TensorError  # noqa: E402
from fp4gen.kernels.tile import TileAmaxParams  # noqa: E402

# one spec per layout: 1D staged (two stochastic copies, the fold, the prepared constants),
# 1D rotated without a global scale (a stochastic columnwise copy with an RHT), 2D tiles
# (a global scale, no prepared constants), a 1D copy whose column block spans two warps
STAGED = "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8_col_sr8_rht16"
ROTATED = "mxfp4_colwise_rht32_sr_ocp"
TILES_2D = "quant_e2m1_16x16_e4m3rn_g_bf16_row_rne_col_rne"
WARPS = "quant_e4m3_1x128_fp32_nog_bf16_row_rne_col_rne"
FP8_TILES_2D = "quant_e4m3_128x128_fp32_nog_bf16_row_rne_col_rne"  # the FP8 weight's kernel
CASES = (STAGED, ROTATED, TILES_2D, WARPS)


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tile_class")
    cache: dict[str, object] = {}

    def load(name: str):
        if name not in cache:
            cache[name] = import_source(render(_spec(name)), folder)
        return cache[name]

    return load


def _spec(name: str):
    """A codegen test's tile spec; ``name:dtype`` is that spec from inputs of another dtype."""
    base, _, dtype = name.partition(":")
    if base not in TILE_SPECS:
        pytest.skip(f"{base} is not among the codegen tests' tile specs")
    return replace(TILE_SPECS[base], input_dtype=dtype) if dtype else TILE_SPECS[base]


@pytest.mark.parametrize("name", CASES)
def test_entries_name_every_argument(name: str, modules) -> None:
    """The compiled function's TVM-FFI wrapper takes the entry's parameter names (on a GPU
    machine cute.compile builds a keyword wrapper from them and refuses duplicates, so a
    ``*args`` entry, whose arguments have no names, would not compile there)."""
    _spec(name)
    mod = modules(name)
    classes = [mod.QuantizeKernel] + ([mod.AmaxKernel] if hasattr(mod, "AmaxKernel") else [])
    for cls in classes:
        for entry in (cls.__call__, cls.kernel):
            params = inspect.signature(inspect.unwrap(entry)).parameters.values()
            kinds = {p.kind for p in params}
            assert inspect.Parameter.VAR_POSITIONAL not in kinds, entry
            names = [p.name for p in params]
            assert len(set(names)) == len(names) and all(names), names


@pytest.mark.parametrize("name", CASES)
def test_the_keyword_wrapper_of_each_compiled_entry(name: str, modules, monkeypatch) -> None:
    """What cute.compile does with the entry's names on a GPU machine, done here: the TVM-FFI
    argument spec of every kernel of the module, then tvm_ffi's keyword wrapper built from it."""
    _spec(name)
    kwargs_wrapper = pytest.importorskip("tvm_ffi.utils.kwargs_wrapper")
    from cutlass.cutlass_dsl import CuTeDSL

    dsl = CuTeDSL._get_dsl()
    if not hasattr(dsl, "_tvm_ffi_args_spec_converter"):
        pytest.skip("this CuTe DSL builds the TVM-FFI argument spec elsewhere")
    from cutlass.cute._tvm_ffi_args_spec_converter import _tvm_ffi_args_spec_converter

    wrappers = []

    def spy(*args):
        out = _tvm_ffi_args_spec_converter(*args)
        wrappers.append(out[1])
        return out

    monkeypatch.setattr(dsl, "_tvm_ffi_args_spec_converter", spy)
    mod = modules(name)
    for kernel in mod.KERNELS:
        mod.compile_kernel(kernel, "sm_90a")
    assert len(wrappers) == len(mod.KERNELS)
    for spec in wrappers:
        assert spec.arg_names[0] == "mX"
        wrapper = kwargs_wrapper.make_kwargs_wrapper(
            lambda *a: a,
            arg_names=spec.arg_names,
            arg_defaults=spec.arg_defaults,
            kwonly_names=spec.kwonly_names,
            kwonly_defaults=spec.kwonly_defaults,
        )
        values = tuple(range(len(spec.arg_names)))
        assert wrapper(*values) == values


@pytest.mark.parametrize("name", CASES)
def test_split_args_follows_the_entry(name: str, modules) -> None:
    """The kernel's body splits the entry's tensors in the order the module spells them."""
    _spec(name)
    mod = modules(name)
    kernel = mod.QuantizeKernel("sm_90a")
    params = list(inspect.signature(inspect.unwrap(mod.QuantizeKernel.kernel)).parameters)
    names = params[2:-3]  # after self and gX, before M, K and tiles_k
    p = mod.QUANT_PARAMS
    tensors = names[: len(names) - p.philox_args]
    philox = names[len(tensors) :]
    row, col, const, amaxes, sdecs, philox_args = kernel.split_args(tensors, philox)
    by_tag = {"row": row, "col": col}
    for c in p.copies:
        sfx = "" if c.tag == "row" else "c"
        want = (f"mQ{sfx}", f"mS{sfx}", f"mSwz{sfx}" if c.swizzled else None)
        assert by_tag[c.tag] == want
    assert (const == "mConst") == p.prep
    if not p.prep:
        assert sdecs == [f"mSdec_{c.tag}" for c in p.copies]
        assert amaxes == ([f"mAmax{s}" for s in range(p.slots)] if p.global_scale else [])
    assert (philox_args is not None) == p.sr
    if p.sr:
        assert philox_args[:2] == ["seed_lo", "seed_hi"] and philox_args[-1] == "stride_hi"
        assert len(philox_args) == 2 * (3 + p.n_sr)


def test_the_amax_params_come_from_the_quantize_params(modules) -> None:
    """AMAX_PARAMS = QUANT_PARAMS.amax_params(): the slots (|x|, the column RHT's), the copies
    and what the last CTA prepares."""
    _spec(STAGED)
    staged = modules(STAGED)
    assert (
        TileAmaxParams(
            strip=staged.TILE,
            slot_rht=(False, True),
            prep=True,
            copies=(("row", 0), ("col", 1)),
            fold=("row", "col"),
            fold_sdec_max=staged.FOLD_SDEC_MAX,
            half_scale=staged.ELEMENT.half_scale,
            inv_max=staged.INV_ELEM_MAX,
            global_num=staged.GLOBAL_NUM,
        )
        == staged.AMAX_PARAMS
    )
    _spec(TILES_2D)
    tiles = modules(TILES_2D)
    assert TileAmaxParams(strip=tiles.TILE, slot_rht=(False,), prep=False) == tiles.AMAX_PARAMS
    _spec(ROTATED)
    assert not hasattr(modules(ROTATED), "AMAX_PARAMS")  # no global scale


def test_host_offsets_and_input_rules(modules) -> None:
    _spec(STAGED)
    mod = modules(STAGED)
    host = mod.HOST
    assert host.tags == ("row", "col") and host.slots == 2
    assert host.const_len == mod.CONST_LEN == 2 * (256 + 2)
    assert host.offsets(7) == (7, 7) and host.offsets((1, 2)) == (1, 2)
    with pytest.raises(ValueError, match=r"one offset per output \('rowwise', 'columnwise'\)"):
        host.offsets((1, 2, 3))
    with pytest.raises(ValueError, match=r"offset must be an integer in \[0, 2\^64\)"):
        host.offsets(-1)
    counter = torch.zeros(1, dtype=torch.int64)
    stride = (5 << 32) + 3
    words = host.counter_args(DeviceOffset(counter, stride, (0, 1)), counter)
    assert words[2:] == [3, 5]  # the stride's (lo, hi) words
    assert host.counter_args(4, counter) == [0, 0, 0, 0]
    # the M rule follows the K rule and names its reason (the column RHT of 16 rows)
    with pytest.raises(TensorError, match=r"M must be a multiple of 16 \(the columnwise copy "):
        host.check_input(torch.zeros(8, 32, dtype=torch.bfloat16))
    with pytest.raises(TensorError, match=r"K must be a multiple of 16 \(8-value loads, 1x16"):
        host.check_input(torch.zeros(16, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="has no kernel"):
        host.compile_kernel("dequantize", "sm_90a")


@pytest.mark.parametrize("name", CASES)
def test_launches_match_the_entries(name: str, modules, monkeypatch) -> None:
    """The host's launch plan passes each kernel exactly the arguments its entry names, in its
    order: tensors where the entry takes a tensor (the outputs with their shapes and dtypes),
    ints where it takes an Int32 (on the CPU: the input rules need a CUDA tensor, skipped)."""
    spec = _spec(name)
    mod = modules(name)
    host = mod.HOST
    monkeypatch.setattr(type(host), "check_input", lambda self, x: None)
    p = mod.QUANT_PARAMS
    m, k = 2 * mod.M_MULTIPLE * mod.TILE.tile_m, mod.K_MULTIPLE * mod.TILE.tile_k
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    x = torch.zeros(m, k, dtype=dtype[spec.input_dtype])
    out, plan = host.launches(x, seed=(1 << 40) + 5, offset=7)
    assert [kernel for kernel, _ in plan] == list(mod.KERNELS)
    for kernel, args in plan:
        cls = mod.QuantizeKernel if kernel == "quantize" else mod.AmaxKernel
        params = list(inspect.signature(inspect.unwrap(cls.__call__)).parameters.values())
        params = params[1:-1]  # self ... stream
        assert len(args) == len(params), kernel
        assert args[0] is x
        for param, arg in zip(params[1:], args[1:], strict=True):
            want = torch.Tensor if param.annotation in ("cute.Tensor",) else int
            assert isinstance(arg, want), (kernel, param.name, type(arg))
    entry = list(inspect.signature(mod.QuantizeKernel.__call__).parameters)[1:-1]
    quant = dict(zip(entry, plan[-1][1], strict=True))
    bits = p.elem.bits
    if p.copy("row") is not None:
        assert quant["mQ"].shape == (m, k * bits // 8) and quant["mQ"] is out["data"]
        assert quant["mS"] is out["scales"]
    if p.copy("col") is not None:
        assert quant["mQc"].shape == (k, m * bits // 8) and quant["mQc"] is out["col_data"]
        assert quant["mSc"] is out["col_scales"]
    if p.sr:
        assert quant["seed_lo"] == 5 and quant["seed_hi"] == 1 << 8
        assert quant["offset0_lo"] == 7 and quant["ctr_lo"] == 0  # an int offset: no counter


@pytest.mark.parametrize(
    ("name", "col_vector", "row_vector"),
    [
        (WARPS, "st.global.v4.u32", "st.global.v2.u32"),
        (FP8_TILES_2D, "st.global.v4.u32", "st.global.v2.u32"),
        (TILES_2D, "st.global.v2.u32", None),
        # fp32 inputs: strips of 32 rows, a column strip's 32 codes as two 16-byte stores
        (FP8_TILES_2D + ":fp32", "st.global.v4.u32", None),
        (WARPS + ":fp32", "st.global.v4.u32", None),
    ],
)
def test_code_strips_are_stored_as_whole_vectors(
    name: str, col_vector: str, row_vector: str | None, modules, tmp_path
) -> None:
    """Column strips and row segments of packed codes go as one vector store each (word by word
    only where the address is not aligned or the strip reaches past the row's end), in the 1D
    layout (FP8 1x128: a column strip of 16 codes is one 16-byte store, a row segment of 8 one
    8-byte store) and in the 2D one (FP8 128x128 the same; NVFP4 16x16: a column strip of 16
    4-bit codes is one 8-byte store): each warp store instruction then writes whole 32-byte
    sectors, where word stores were partial-sector writes per lane pair. From fp32 inputs a
    column strip holds 32 8-bit codes: each 16 of them one store (the FP8 weight kernel from an
    fp32 master weight, 0.35 -> 0.86x copy on the H200)."""
    _spec(name)
    keep = tmp_path / "ptx"
    modules(name).compile_kernel("quantize", "sm_90a", dump_dir=str(keep))
    (ptx,) = keep.glob("*.sm_90a.ptx")
    text = ptx.read_text()
    assert text.count(col_vector) >= 1  # the column strips
    if row_vector is not None:
        assert text.count(row_vector) >= 1  # the row segments
    assert "st.global.u32" in text  # the word-by-word fallback and the scales
