"""The tile kernel with block targets (Four Over Six, by MSE or MAE) and stochastic block scales
on 2D tiles (docs/numerics.md 11.1-11.2) on a CUDA GPU, bit-exact against the reference
``fp4gen.numerics.quantize``: the rowwise copy equals ``quantize(x, ...)`` and the columnwise
copy the kernel writes equals its transpose (``quantize(x, ...).transpose()``, what the dgrad
weight of a 2D-block layer is). Packed codes, scale codes and the global scale must be equal
bit for bit (no tolerance: the kernel follows the reference's order of operations, the error
tree included). Also: 16x16 and 32x32 tiles, bf16 and fp32 inputs, ragged M (a last tile of
fewer rows, M below one tile) and K (tiles of a CTA past K), adversarial values (ties between
the targets, equal values, zeros, subnormal scales, NaN / Inf), the seed and offset of the
stochastic scales, the runtime's routing with ``cute_backend.set_tile_option_kernels(True)``,
and a Linear with recipes/nvfp4_4over6.fp4r whose forward and backward equal the reference
backend's. Skipped without a CUDA GPU (marker ``gpu``); the kernels are compiled for the GPU's
arch first, in parallel worker processes.
"""

from __future__ import annotations

import dataclasses
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gpu_kernel_cache import compiled_cache

from fp4gen.compiler import jit
from fp4gen.compiler.cache import KernelCache
from fp4gen.compiler.plan import kernel_spec
from fp4gen.formats import BUILTIN_FORMATS, E4M3, UE8M0, BlockFormat, ScaleSpec
from fp4gen.numerics import quantize
from fp4gen.runtime.kernels import kernels_for
from fp4gen.spec import QuantKernelSpec, QuantOutput

sys.path.insert(0, str(Path(__file__).parent))
from test_quantize_kernels_gpu import compare_tile  # noqa: E402
from test_quantize_options_gpu import PATTERNS, option_input  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parent.parent
NVFP4 = BUILTIN_FORMATS["nvfp4"]
MXFP4 = BUILTIN_FORMATS["mxfp4"]
MXFP8 = BUILTIN_FORMATS["mxfp8_e4m3"]
SR_E4M3 = ScaleSpec(E4M3, "stochastic")
_TORCH = {"bf16": torch.bfloat16, "fp32": torch.float32}


def fmt(base: BlockFormat, block: int, **options) -> BlockFormat:
    return dataclasses.replace(base, name="tile_options", **options).with_block((block, block))


FOUR_OVER_SIX = fmt(NVFP4, 16, targets=(6.0, 4.0), global_bound=256.0)
# (format, element rounding, copies): "pair" = rowwise + columnwise, "row" = rowwise alone
CASES: dict[str, tuple[BlockFormat, str, str]] = {
    # nvfp4_4over6's weight
    "4over6_16x16": (FOUR_OVER_SIX, "nearest", "pair"),
    "4over6_mae_16x16": (
        fmt(NVFP4, 16, targets=(6.0, 4.0), global_bound=256.0, target_error="mae"),
        "nearest",
        "pair",
    ),
    "4over6_448_16x16_row": (fmt(NVFP4, 16, targets=(6.0, 4.0)), "nearest", "row"),
    "sr_scales_16x16": (fmt(NVFP4, 16, scale=SR_E4M3), "nearest", "pair"),
    "4over6_sr_scales_16x16": (
        fmt(NVFP4, 16, targets=(6.0, 4.0), global_bound=256.0, scale=SR_E4M3),
        "nearest",
        "pair",
    ),
    # stochastic codes too (the same random fields for both targets)
    "4over6_sr_scales_sr_16x16": (
        fmt(NVFP4, 16, targets=(6.0, 4.0), global_bound=256.0, scale=SR_E4M3),
        "stochastic",
        "pair",
    ),
    # 32x32 tiles over 8 lanes, no global scale
    "mxfp4_targets_32x32": (fmt(MXFP4, 32, targets=(6.0, 4.0)), "nearest", "pair"),
    "mxfp4_sr_scales_32x32": (
        fmt(MXFP4, 32, scale=ScaleSpec(UE8M0, "stochastic")),
        "nearest",
        "pair",
    ),
    "mxfp8_targets_mae_32x32": (
        fmt(MXFP8, 32, targets=(448.0, 256.0), target_error="mae"),
        "nearest",
        "pair",
    ),
}
DTYPES = ("bf16", "fp32")


def make_spec(case: str, dtype: str) -> QuantKernelSpec:
    f, rounding, copies = CASES[case]
    outputs = [QuantOutput("rowwise", rounding, None)]
    if copies == "pair":
        outputs.append(QuantOutput("columnwise", rounding, None))
    return kernel_spec(f, dtype, tuple(outputs))  # type: ignore[arg-type]


def shapes(spec: QuantKernelSpec) -> list[tuple[int, int]]:
    """M: below one tile, a ragged last tile, whole tiles, many CTAs (272: ragged for 32x32);
    K: one tile, a CTA's tiles past K (3 tiles), many."""
    b = spec.block[1]
    # a columnwise copy needs M % 8 == 0 (its store words); the rowwise copy alone any M
    ms = (5, b + 3) if len(spec.outputs) == 1 else (8, b + 8)
    return [(m, k) for m in (*ms, 4 * b, 272) for k in (b, 3 * b, 64 * b)]


@pytest.fixture(scope="session")
def arch() -> str:
    major, _ = torch.cuda.get_device_capability()
    if major not in (9, 10):
        pytest.skip(f"no sm_90a/sm_100a kernels for compute capability {major}.x")
    return {9: "sm_90a", 10: "sm_100a"}[major]


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory, arch: str) -> KernelCache:
    """Every kernel of this file, compiled by worker processes."""
    specs = [make_spec(c, d) for c in CASES for d in DTYPES]
    return compiled_cache(tmp_path_factory, "tile-options-cache", specs, jit.render_source, arch)


@pytest.fixture(scope="module")
def kernels(kernel_cache: KernelCache, arch: str):
    def get(spec: QuantKernelSpec):
        return kernels_for(spec, arch, cache=kernel_cache)

    return get


@pytest.fixture
def tile_options_on() -> Iterator[None]:
    from fp4gen.runtime import cute_backend

    previous = cute_backend.set_tile_option_kernels(True)
    options = cute_backend.set_option_kernels(True)
    yield
    cute_backend.set_tile_option_kernels(previous)
    cute_backend.set_option_kernels(options)


def references(case: str, x: torch.Tensor, seed: int, offset: int) -> dict:
    """The reference's rowwise copy and its transpose (the columnwise copy of 2D tiles): the
    codes and the tiles' words draw from the first copy's stream."""
    f, rounding, _ = CASES[case]
    row = quantize(x, f, rounding=rounding, seed=seed, offset=offset)
    return {"rowwise": row, "columnwise": row.transpose()}


def tile_input(spec: QuantKernelSpec, pattern: str, m: int, k: int, salt: int) -> torch.Tensor:
    """test_quantize_options_gpu's patterns, with ``equal_blocks`` and ``target_ties`` made per
    BxB tile (every value of a tile equal; tiles of zeros and +-amax only, so that both targets
    decode every value exactly: equal errors, the first target wins)."""
    b = spec.block[1]
    if pattern not in ("equal_blocks", "target_ties"):
        return option_input(spec, pattern, m, k, salt)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(salt)
    tm = -(-m // b)
    if pattern == "equal_blocks":
        v = torch.randn(tm, 1, k // b, 1, generator=g, device=dev)
        v = v * torch.exp2(torch.randint(-20, 21, v.shape, generator=g, device=dev).float())
        x = v.expand(tm, b, k // b, b).reshape(tm * b, k)[:m]
    else:
        pick = torch.randint(0, 3, (m, k), generator=g, device=dev).float() - 1.0
        x = pick * 3.0
        x[0::b, 0::b] = 3.0  # every tile's amax at the tensor's
    return x.to(_TORCH[spec.input_dtype]).contiguous()


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(("case", "dtype"), [(c, d) for c in sorted(CASES) for d in DTYPES])
def test_bit_exact(case: str, dtype: str, pattern: str, kernels) -> None:
    spec = make_spec(case, dtype)
    loaded = kernels(spec)
    failures = []
    for m, k in shapes(spec):
        salt = zlib.crc32(f"tile-options/{case}/{dtype}/{pattern}/{m}/{k}".encode())
        x = tile_input(spec, pattern, m, k, salt)
        # seeds and offsets above 2^32 exercise every Philox key and counter word; the second
        # copy's offset is ignored (2D: one set of codes and scales)
        seed, offset = (salt, m) if m % 2 else ((salt << 32) | 0x5EED, (3 << 32) + m)
        offsets = (offset, offset + 17)[: len(spec.outputs)]
        got = loaded.run(x, seed=seed, offset=offsets)
        torch.cuda.synchronize()
        for msg in compare_tile(spec, got, references(case, x, seed, offset)):
            failures.append(f"{m}x{k}: {msg}")
    assert not failures, f"{spec.name}, {pattern}: " + "; ".join(failures[:5])


def test_target_ties_keep_the_first_target(kernels) -> None:
    """Tiles of zeros and +-amax: both targets decode every value exactly (equal errors), and
    the kernel keeps the 6-target scale there, as the reference."""
    spec = make_spec("4over6_16x16", "bf16")
    loaded = kernels(spec)
    x = tile_input(spec, "target_ties", 64, 256, 1)
    got = loaded.run(x)
    assert not compare_tile(spec, got, references("4over6_16x16", x, 0, 0))
    six = quantize(x, fmt(NVFP4, 16, targets=(6.0,), global_bound=256.0))
    assert torch.equal(got["scales"], six.scale_codes)


def test_both_targets_are_chosen(kernels) -> None:
    """On Gaussian data (rows of magnitudes 2^-8 .. 2^8) each target wins some tiles, so
    neither candidate path is dead: the reference keeps the 6-target scale in about 88% of the
    2048 tiles of this input (measured on the CPU), so the bounds leave a wide margin."""
    spec = make_spec("4over6_16x16", "bf16")
    loaded = kernels(spec)
    x = tile_input(spec, "randn", 512, 1024, 2)
    got = loaded.run(x)
    six = quantize(x, fmt(NVFP4, 16, targets=(6.0,), global_bound=256.0))
    frac6 = (got["scales"] == six.scale_codes).float().mean().item()
    assert 0.5 < frac6 < 0.99, frac6


def test_stochastic_scales_depend_on_seed_and_offset(kernels) -> None:
    spec = make_spec("sr_scales_16x16", "bf16")
    loaded = kernels(spec)
    x = tile_input(spec, "randn", 64, 1024, 1)
    a = loaded.run(x, seed=1, offset=0)["scales"]
    assert not torch.equal(a, loaded.run(x, seed=2, offset=0)["scales"])
    assert not torch.equal(a, loaded.run(x, seed=1, offset=1)["scales"])
    assert torch.equal(a, loaded.run(x, seed=1, offset=0)["scales"])


def test_large_tensor_and_repeat_calls(kernels) -> None:
    spec = make_spec("4over6_sr_scales_16x16", "bf16")
    loaded = kernels(spec)
    for scale in (1.0, 1e-3):
        x = tile_input(spec, "randn", 4096, 4096, 5) * scale
        got = loaded.run(x, seed=7, offset=(1, 2))
        assert not compare_tile(spec, got, references("4over6_sr_scales_16x16", x, 7, 1))


@pytest.mark.parametrize("case", ["4over6_16x16", "sr_scales_16x16", "mxfp4_targets_32x32"])
def test_a_nan_or_an_inf_makes_the_decode_scale_nan(case: str, kernels) -> None:
    """docs/numerics.md 7: each copy's S_dec is NaN iff the input holds a NaN or an Inf (the
    reference rejects such inputs; the kernel's codes are then meaningless)."""
    spec = make_spec(case, "bf16")
    loaded = kernels(spec)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = tile_input(spec, "randn", 64, 256, 9)
        x[3, 17] = bad
        got = loaded.run(x, seed=1)
        assert torch.isnan(got["global_scale"]).item() and torch.isnan(got["col_global_scale"])
    x = tile_input(spec, "randn", 64, 256, 9)
    assert torch.isfinite(loaded.run(x, seed=1)["global_scale"]).item()


def test_runtime_routes_2d_options_to_the_tile_kernel(tile_options_on: None) -> None:
    """With the switch on, fp4gen.quantize(backend="cute") quantizes a 16x16 Four Over Six
    tensor (and one with stochastic tile scales) with the tile kernel, bit for bit the
    reference; an operand pair runs copy by copy (the columnwise copy is x.t()'s quantization,
    not the transpose, with these options), each equal to the reference's."""
    import fp4gen
    from fp4gen.dsl.model import OperandSpec
    from fp4gen.runtime import cute_backend
    from fp4gen.runtime.operands import quantize_operand_pair

    x = torch.randn(272, 512, device="cuda").to(torch.bfloat16)
    for f in (FOUR_OVER_SIX, CASES["4over6_sr_scales_16x16"][0]):
        got = fp4gen.quantize(x, f, seed=3, offset=5, backend="cute")
        ref = quantize(x, f, seed=3, offset=5)
        assert torch.equal(got.data, ref.data) and torch.equal(got.scale_codes, ref.scale_codes)
        assert torch.equal(got.global_scale, ref.global_scale)
        a, b = quantize_operand_pair(
            x, (OperandSpec(f, "nearest", None), 1), (OperandSpec(f, "nearest", None), 2), seed=4
        )
        ra = quantize(x, f, seed=4, offset=1)
        rb = quantize(x.t().contiguous(), f, seed=4, offset=2)
        assert torch.equal(a.data, ra.data) and torch.equal(a.scale_codes, ra.scale_codes)
        assert torch.equal(b.data, rb.data) and torch.equal(b.scale_codes, rb.scale_codes)
    served = [
        launch
        for _, _, launch in cute_backend._launches.values()
        if launch.spec.block == (16, 16) and launch.spec.targets
    ]
    assert served and not any(isinstance(s.kernels, cute_backend.Unsupported) for s in served)


def test_linear_with_four_over_six_equals_the_reference_backend(tile_options_on: None) -> None:
    """recipes/nvfp4_4over6.fp4r: forward and backward of a Linear (bf16) with the default
    backend, its 16x16 weight quantized by the tile kernel, equal the reference backend's bit
    for bit. Both runs multiply on the reference GEMM (the GEMM kernels may sum in another
    order, docs/numerics.md 6), so the difference tested is the quantization alone."""
    from test_conformance import environment

    import fp4gen
    from fp4gen.dsl import load_recipe
    from fp4gen.runtime import cute_backend, linear
    from fp4gen.settings import LAYER_GRAPHS_VAR, LAYER_GROUPS_VAR

    recipe = load_recipe(ROOT / "recipes" / "nvfp4_4over6.fp4r")
    real = linear.gemm

    def reference_gemm(a, b, **kw):
        return real(a, b, **{**kw, "backend": "reference"})

    outs = []
    linear.gemm = reference_gemm  # type: ignore[assignment]
    try:
        with environment(**{LAYER_GROUPS_VAR: "0", LAYER_GRAPHS_VAR: "0"}):
            for backend in ("auto", "reference"):
                torch.manual_seed(0)
                layer = fp4gen.nn.Linear(256, 384, recipe=recipe, backend=backend)
                layer = layer.to(device="cuda", dtype=torch.bfloat16)
                g = torch.Generator(device="cuda").manual_seed(9)
                x = torch.randn(128, 256, device="cuda", generator=g).to(torch.bfloat16)
                x.requires_grad_(True)
                y = layer(x)
                dy = torch.randn(128, 384, device="cuda", generator=g).to(torch.bfloat16)
                y.backward(dy)
                outs.append((y.detach(), x.grad, layer.weight.grad))
    finally:
        linear.gemm = real  # type: ignore[assignment]
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    weights = [
        launch
        for _, _, launch in cute_backend._launches.values()
        if launch.spec.block == (16, 16) and launch.spec.targets
    ]
    assert weights and not any(isinstance(w.kernels, cute_backend.Unsupported) for w in weights)
