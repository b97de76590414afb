"""The rowwise kernels with the block-scale options of docs/numerics.md 11 on a CUDA GPU,
bit-exact against the reference ``fp4gen.numerics.quantize``: block targets (Four Over Six, by
MSE or MAE; ties to the first), a global bound, stochastic block scales, the MS-EDEN correction,
per-row global scales, with and without an RHT
and stochastic element rounding, and RHT signs drawn per layer or step (numerics.md 12, the
kernels' arguments: one kernel for every layer and step). Packed codes, scale codes and the
global scale must be equal bit for bit (no tolerance: the kernels follow the reference's order
of operations).

Also: the tile kernel with a global bound alone (the bound only changes S_enc's numerator), the
runtime's routing (``fp4gen.quantize(..., backend="cute")`` and the columnwise copy of a Four
Over Six operand, which the rowwise kernel quantizes from the transpose) and the non-finite
policy (S_dec NaN; per row: that row's). Skipped without a CUDA GPU (marker ``gpu``); the
kernels are compiled for the GPU's arch first, in parallel worker processes.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import zlib
from pathlib import Path

import pytest
import torch
from gpu_kernel_cache import compiled_cache

from fp4gen.compiler import jit
from fp4gen.compiler.cache import KernelCache
from fp4gen.compiler.plan import kernel_spec
from fp4gen.dsl.model import RHTSpec
from fp4gen.formats import BUILTIN_FORMATS, E4M3, UE8M0, BlockFormat, ScaleSpec
from fp4gen.numerics import quantize
from fp4gen.numerics.minifloat import decode
from fp4gen.numerics.quantize import tree_sum
from fp4gen.runtime.kernels import kernels_for
from fp4gen.spec import QuantKernelSpec, QuantOutput

sys.path.insert(0, str(Path(__file__).parent))
from option_kernels import option_kernels_on  # noqa: F401  (a fixture)
from test_quantize_kernels_gpu import compare, make_input  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NVFP4 = BUILTIN_FORMATS["nvfp4"]
MXFP4 = BUILTIN_FORMATS["mxfp4"]
MXFP6 = BUILTIN_FORMATS["mxfp6_e2m3"]
MXFP8 = BUILTIN_FORMATS["mxfp8_e4m3"]
SR, SR16, SR8 = "stochastic", "stochastic16", "stochastic8"
TE16 = RHTSpec(16)


def fmt(base: BlockFormat, **options) -> BlockFormat:
    assert isinstance(base, BlockFormat)
    return dataclasses.replace(base, name="options", **options)


FOUR_OVER_SIX = fmt(NVFP4, targets=(6.0, 4.0), global_bound=256.0)
SR_SCALES = ScaleSpec(E4M3, "stochastic")
# (format, rounding, rht)
CASES: dict[str, tuple[BlockFormat, str, RHTSpec | None]] = {
    # the shipped recipes' (nvfp4_4over6, nvfp4_4over6_rht)
    "4over6": (FOUR_OVER_SIX, "nearest", None),
    "4over6_rht16": (FOUR_OVER_SIX, "nearest", TE16),
    "4over6_sr8": (FOUR_OVER_SIX, SR8, None),
    "4over6_rht16_sr8": (FOUR_OVER_SIX, SR8, TE16),
    # beyond them
    "4over6_sr": (FOUR_OVER_SIX, SR, None),
    "4over6_mae_448": (fmt(NVFP4, targets=(6.0, 4.0), target_error="mae"), "nearest", None),
    "4over6_sr_scales_sr16": (
        fmt(NVFP4, targets=(6.0, 4.0), global_bound=256.0, scale=SR_SCALES),
        SR16,
        None,
    ),
    "sr_scales": (fmt(NVFP4, scale=SR_SCALES), "nearest", None),
    "sr_scales_rht16_sr8": (fmt(NVFP4, scale=SR_SCALES), SR8, TE16),
    "bound256": (fmt(NVFP4, global_bound=256.0), "nearest", None),
    "mxfp4_targets_643": (fmt(MXFP4, targets=(6.0, 4.0, 3.0)), "nearest", None),
    "mxfp4_sr_scales_rht32": (
        fmt(MXFP4, scale=ScaleSpec(UE8M0, "stochastic")),
        SR,
        RHTSpec(32, "none", None),
    ),
    "mxfp6_targets": (fmt(MXFP6, targets=(7.5, 6.0)), "nearest", None),
    "mxfp8_targets": (fmt(MXFP8, targets=(448.0, 256.0), target_error="mae"), "nearest", None),
    # lanes sharing a block (butterflies over the error), a block of 48 (a padded tree)
    "b64_targets_sr_scales_sr8": (
        fmt(NVFP4, block=(1, 64), targets=(6.0, 4.0), scale=SR_SCALES),
        SR8,
        None,
    ),
    "b48_targets": (fmt(NVFP4, block=(1, 48), targets=(6.0, 4.0)), "nearest", None),
    # RHT signs drawn per layer or step (docs/numerics.md 12): the kernels' arguments
    "step_signs_rht16_sr8": (NVFP4, SR8, RHTSpec(16, "step", None, 1)),
    "4over6_layer_signs_rht16": (FOUR_OVER_SIX, "nearest", RHTSpec(16, "layer", None, 7)),
    "mxfp4_step_signs_rht32_sr": (MXFP4, SR, RHTSpec(32, "step", None, 0)),
    "step_signs_rht8_b32": (fmt(NVFP4, block=(1, 32)), "nearest", RHTSpec(8, "step", None, 2)),
    # the MS-EDEN correction (docs/numerics.md 11.3): a group within a thread or across lanes,
    # stochastic scales (the codes with the nearest scale), block targets, drawn signs
    "eden32_sr8": (fmt(NVFP4, eden_group=32), SR8, None),
    "eden128_sr_scales_step_signs": (
        fmt(NVFP4, scale=SR_SCALES, global_bound=384.0, eden_group=128),
        "nearest",
        RHTSpec(16, "step", None, 1),
    ),
    "eden256_b64_lanes": (
        fmt(NVFP4, block=(1, 64), scale=SR_SCALES, eden_group=256),
        "nearest",
        None,
    ),
    "mxfp4_eden64_targets_sr_scales": (
        fmt(MXFP4, scale=ScaleSpec(UE8M0, "stochastic"), targets=(6.0, 4.0), eden_group=64),
        SR,
        RHTSpec(32, "none", None),
    ),
    "eden16_4over6_rows": (
        fmt(NVFP4, targets=(6.0, 4.0), global_bound=256.0, global_rows=True, eden_group=16),
        "nearest",
        None,
    ),
    # an RHT wider than a thread's values: a chunk over 4 or 8 lanes (xor-shuffle butterflies)
    "rht128_seeded_sr8": (NVFP4, SR8, RHTSpec(128, "seeded", None, 3)),
    "rht256_b32_none": (fmt(NVFP4, block=(1, 32)), "nearest", RHTSpec(256, "none", None)),
    # Quartet II's backward operands (nvfp4_quartet2.fp4r): MS-EDEN over 128, stochastic e4m3
    # scales, global bound 384, a 128-point RHT with signs drawn per step
    "quartet2_backward": (
        fmt(NVFP4, scale=SR_SCALES, global_bound=384.0, eden_group=128),
        "nearest",
        RHTSpec(128, "step", None, 1),
    ),
    # one global scale per row (docs/numerics.md 11.4): [M] amax and S_dec
    "rows": (fmt(NVFP4, global_rows=True), "nearest", None),
    "rows_rht16_sr8": (fmt(NVFP4, global_rows=True), SR8, TE16),
    "rows_4over6_b64_sr_step_signs": (
        fmt(NVFP4, block=(1, 64), global_rows=True, targets=(6.0, 4.0), global_bound=256.0),
        SR,
        RHTSpec(16, "step", None, 4),
    ),
    "rows_sr_scales_b32": (
        fmt(NVFP4, block=(1, 32), global_rows=True, scale=SR_SCALES),
        SR16,
        None,
    ),
}
PATTERNS = (
    "randn",
    "zeros",
    "outliers",
    "subnormal_scales",
    "tiny",
    "huge",
    "signed_zero",
    "equal_blocks",
    "target_ties",
)
MS = (1, 7, 128, 272)
_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPES = {case: ("bf16", "fp32") for case in CASES}


def make_spec(case: str, dtype: str) -> QuantKernelSpec:
    f, rounding, rht = CASES[case]
    return kernel_spec(f, dtype, (QuantOutput("rowwise", rounding, rht),))  # type: ignore[arg-type]


def k_values(spec: QuantKernelSpec) -> list[int]:
    rht = spec.outputs[0].rht
    base = math.lcm(spec.block[1], rht.size if rht else 1, spec.eden_group or 1)
    return [base, 3 * base, 2048 if 2048 % base == 0 else 48 * base]


@pytest.fixture(autouse=True)
def all_option_kernels_on(option_kernels_on: None) -> None:  # noqa: F811
    """This module tests the option kernels themselves: on for each test (the default; made
    sure of here: fp4gen.runtime.cute_backend.set_option_kernels)."""


@pytest.fixture(scope="session")
def arch() -> str:
    major, _ = torch.cuda.get_device_capability()
    if major not in (9, 10):
        pytest.skip(f"no sm_90a/sm_100a kernels for compute capability {major}.x")
    return {9: "sm_90a", 10: "sm_100a"}[major]


def tile_bound_spec(dtype: str) -> QuantKernelSpec:
    outputs = (QuantOutput("rowwise", "nearest", None), QuantOutput("columnwise", SR8, TE16))
    return kernel_spec(fmt(NVFP4, global_bound=256.0), dtype, outputs)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory, arch: str) -> KernelCache:
    """Every kernel of this file, compiled by worker processes."""
    specs = [make_spec(c, d) for c in CASES for d in DTYPES[c]] + [tile_bound_spec("bf16")]
    specs += [make_spec(c, "fp16") for c in FP16_CASES]
    cache = compiled_cache(tmp_path_factory, "options-cache", specs, jit.render_source, arch)
    return cache


def reference(case: str, x: torch.Tensor, seed: int, offset: int, signs=None):
    f, rounding, rht = CASES[case]
    rht = signs if signs is not None else rht
    return quantize(x, f, rounding=rounding, hadamard=rht, seed=seed, offset=offset)


def drawn(case: str, layer: int, step: int) -> RHTSpec | None:
    """The case's transform at (layer, step) where its signs are drawn per layer or step (the
    kernels take them as arguments), else None."""
    rht = CASES[case][2]
    return rht.at(layer, step) if rht is not None and rht.redrawn else None


def option_input(spec: QuantKernelSpec, pattern: str, m: int, k: int, salt: int) -> torch.Tensor:
    """The patterns of test_quantize_kernels_gpu, and two that make the targets tie:
    ``equal_blocks`` (every value of a block equal, blocks of every sign and magnitude) and
    ``target_ties`` (blocks of zeros and +-amax only, the block amax at the tensor's, so both
    targets decode every value exactly: equal errors, the first target wins)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(salt)
    b = spec.block[1]
    if pattern == "equal_blocks":
        v = torch.randn(m, k // b, 1, generator=g, device=dev)
        v = v * torch.exp2(torch.randint(-20, 21, (m, k // b, 1), generator=g, device=dev).float())
        x = v.expand(m, k // b, b).reshape(m, k)
    elif pattern == "target_ties":
        pick = torch.randint(0, 3, (m, k), generator=g, device=dev).float() - 1.0
        x = pick * 3.0
        x.view(m, k // b, b)[:, :, 0] = 3.0
    elif pattern == "huge" and spec.outputs[0].rht is not None:
        # 1e37 over the RHT's size: its sums stay finite (the reference refuses an overflow)
        size = spec.outputs[0].rht.size
        x = torch.randn(m, k, generator=g, device=dev) * (1e37 / size)
    else:
        return make_input(spec, pattern, m, k, salt)
    return x.to(_TORCH[spec.input_dtype]).contiguous()


@pytest.fixture(scope="module")
def kernels(kernel_cache: KernelCache, arch: str):
    def get(spec: QuantKernelSpec):
        loaded = kernels_for(spec, arch, cache=kernel_cache)
        return loaded.module, loaded.fns

    return get


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(
    ("case", "dtype"), [(c, d) for c in sorted(CASES) for d in DTYPES[c]], ids=str
)
def test_bit_exact(case: str, dtype: str, pattern: str, kernels) -> None:
    spec = make_spec(case, dtype)
    mod, fns = kernels(spec)
    failures = []
    for m in MS:
        for k in k_values(spec):
            salt = zlib.crc32(f"{case}/{dtype}/{pattern}/{m}/{k}".encode())
            x = option_input(spec, pattern, m, k, salt)
            # seeds and offsets above 2^32 exercise every Philox key and counter word
            seed, offset = (salt, 0) if m % 2 else ((salt << 32) | 0x5EED, (3 << 32) + m)
            # layers and steps of every size of stream word (mod 2^24, 2^40)
            signs = drawn(case, salt % (1 << 24), (salt << 8) % (1 << 40) + k)
            got = mod.run(fns, x, seed=seed, offset=offset, signs=signs)
            torch.cuda.synchronize()
            for msg in compare(spec, got, reference(case, x, seed, offset, signs), x):
                failures.append(f"{m}x{k}: {msg}")
    assert not failures, f"{spec.name}, {pattern}: " + "; ".join(failures[:5])


FP16_CASES = ("4over6", "4over6_rht16_sr8", "sr_scales", "step_signs_rht16_sr8")


@pytest.mark.parametrize("case", FP16_CASES)
def test_fp16_input(case: str, kernels) -> None:
    spec = make_spec(case, "fp16")
    mod, fns = kernels(spec)
    for m, k in [(7, 2048), (272, 384)]:
        x = option_input(spec, "randn", m, k, m + k)
        signs = drawn(case, m, k)  # the step-signs case: fp16 pairs take the sign masks
        got = mod.run(fns, x, seed=11, offset=3, signs=signs)
        assert not compare(spec, got, reference(case, x, 11, 3, signs), x)


def _candidate_errors(x: torch.Tensor, target: float) -> torch.Tensor:
    """The reference's per-block MSE of the one-target quantization (numerics.md 11.1)."""
    q = quantize(x, fmt(FOUR_OVER_SIX, targets=(target,)))
    s_enc = torch.tensor(256.0 * 6.0, device=x.device) / x.float().abs().max()  # S_enc, bound 256
    z = x.float() * s_enc
    d = decode(q.codes, q.element) * q.block_values(q.scales) - z
    return tree_sum((d * d).reshape(x.shape[0], -1, 16))


def test_target_ties_keep_the_first_target(kernels) -> None:
    """The ``target_ties`` input makes both targets' errors equal in most blocks (checked with
    the reference's one-target quantizations), and there the kernel keeps the 6-target scale."""
    spec = make_spec("4over6", "bf16")
    mod, fns = kernels(spec)
    x = option_input(spec, "target_ties", 64, 256, 1)
    e6, e4 = _candidate_errors(x, 6.0), _candidate_errors(x, 4.0)
    assert (e6 == e4).float().mean() > 0.5
    got = mod.run(fns, x)
    ref = quantize(x, FOUR_OVER_SIX)
    assert not compare(spec, got, ref, x)
    six = quantize(x, fmt(FOUR_OVER_SIX, targets=(6.0,)))
    tie = e6 == e4
    assert torch.equal(got["scales"][tie], six.scale_codes[tie])


def test_both_targets_are_chosen(kernels) -> None:
    """On Gaussian data each target wins some blocks, so neither candidate path is dead."""
    spec = make_spec("4over6_rht16_sr8", "bf16")
    mod, fns = kernels(spec)
    x = option_input(spec, "randn", 256, 1024, 2)
    got = mod.run(fns, x, seed=3, offset=4)
    f, rounding, rht = CASES["4over6_rht16_sr8"]
    six = quantize(x, fmt(f, targets=(6.0,)), rounding=rounding, hadamard=rht, seed=3, offset=4)
    frac6 = (got["scales"] == six.scale_codes).float().mean().item()
    assert 0.05 < frac6 < 0.95, frac6


def test_large_tensor_and_repeat_calls(kernels) -> None:
    spec = make_spec("4over6_rht16_sr8", "bf16")
    mod, fns = kernels(spec)
    for scale in (1.0, 1e-3):
        x = option_input(spec, "randn", 4096, 4096, 5) * scale
        got = mod.run(fns, x, seed=7, offset=1)
        assert not compare(spec, got, reference("4over6_rht16_sr8", x, 7, 1), x)


def test_stochastic_scales_depend_on_seed_and_offset(kernels) -> None:
    spec = make_spec("sr_scales", "bf16")
    mod, fns = kernels(spec)
    x = option_input(spec, "randn", 64, 1024, 1)
    a = mod.run(fns, x, seed=1, offset=0)["scales"]
    assert not torch.equal(a, mod.run(fns, x, seed=2, offset=0)["scales"])
    assert not torch.equal(a, mod.run(fns, x, seed=1, offset=1)["scales"])
    assert torch.equal(a, mod.run(fns, x, seed=1, offset=0)["scales"])


def test_per_row_scales_of_a_row_with_a_nan(kernels) -> None:
    """Per-row global scales: a NaN or an Inf makes its own row's S_dec NaN and leaves the
    other rows' bits as for a finite input; the module says so (NONFINITE_TO_NAN_SCALE False),
    so the runtime checks the input itself, as for the reference."""
    spec = make_spec("rows", "bf16")
    mod, fns = kernels(spec)
    assert mod.NONFINITE_TO_NAN_SCALE is False
    x = option_input(spec, "randn", 16, 256, 9)
    clean = mod.run(fns, x)["global_scale"]
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[3, 17] = bad
        got = mod.run(fns, y)["global_scale"]
        assert got.shape == (16, 1) and torch.isnan(got[3, 0]).item()
        keep = torch.arange(16, device="cuda") != 3
        assert torch.equal(got[keep].view(torch.int32), clean[keep].view(torch.int32))


@pytest.mark.parametrize("case", ["4over6", "4over6_rht16_sr8", "sr_scales", "mxfp4_targets_643"])
def test_a_nan_or_an_inf_makes_the_decode_scale_nan(case: str, kernels) -> None:
    """docs/numerics.md 7: S_dec is NaN iff the input holds a NaN or an Inf (the reference
    rejects such inputs; the kernels' codes are then meaningless)."""
    spec = make_spec(case, "bf16")
    mod, fns = kernels(spec)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = option_input(spec, "randn", 16, 256, 9)
        x[3, 17] = bad
        assert torch.isnan(mod.run(fns, x, seed=1)["global_scale"]).item()
    x = option_input(spec, "randn", 16, 256, 9)
    assert torch.isfinite(mod.run(fns, x, seed=1)["global_scale"]).item()


def test_tile_kernel_with_a_global_bound(kernels) -> None:
    """A global bound alone changes only S_enc's numerator, which the tile kernel takes too:
    both copies of one launch equal the reference's (the columnwise one that of x^T)."""
    spec = tile_bound_spec("bf16")
    mod, fns = kernels(spec)
    f = fmt(NVFP4, global_bound=256.0)
    for m, k in [(16, 256), (272, 1024), (1024, 4096)]:
        x = option_input(spec, "randn", m, k, m + k)
        got = mod.run(fns, x, seed=5, offset=(0, 9))
        row = quantize(x, f)
        col = quantize(x.t().contiguous(), f, rounding=SR8, hadamard=TE16, seed=5, offset=9)
        assert torch.equal(got["data"], row.data) and torch.equal(got["scales"], row.scale_codes)
        assert torch.equal(got["col_data"], col.data)
        assert torch.equal(got["col_scales"], col.scale_codes)
        assert torch.equal(
            got["global_scale"].view(torch.int32), row.global_scale.view(torch.int32)
        )


def test_one_kernel_serves_every_step(kernels) -> None:
    """Per-step signs: each step's codes are the reference's with that step's transform, the
    steps differ, and a step repeated gives the same bits (one compiled kernel for all)."""
    case = "step_signs_rht16_sr8"
    spec = make_spec(case, "bf16")
    mod, fns = kernels(spec)
    x = option_input(spec, "randn", 128, 1024, 3)
    got = []
    for step in (0, 1, 2, 1):
        signs = drawn(case, 5, step)
        out = mod.run(fns, x, seed=4, offset=2, signs=signs)
        assert not compare(spec, out, reference(case, x, 4, 2, signs), x), step
        got.append(out["data"])
    assert not torch.equal(got[0], got[1]) and torch.equal(got[1], got[3])
    with pytest.raises(ValueError, match="per layer or step"):
        mod.run(fns, x, seed=4, offset=2)  # the signs are required


def test_runtime_routes_four_over_six_to_the_rowwise_kernel() -> None:
    """fp4gen.quantize(backend="cute") runs the rowwise kernel; the Four Over Six operand pair of
    a linear layer (rowwise and columnwise copies) equals the reference's, the columnwise copy
    quantized by the rowwise kernel from the transpose (the tile kernel has no targets)."""
    import fp4gen
    from fp4gen.dsl.model import OperandSpec
    from fp4gen.runtime.operands import quantize_operand_pair

    x = torch.randn(256, 512, device="cuda").to(torch.bfloat16)
    got = fp4gen.quantize(x, FOUR_OVER_SIX, rounding=SR8, hadamard=TE16, seed=3, backend="cute")
    ref = quantize(x, FOUR_OVER_SIX, rounding=SR8, hadamard=TE16, seed=3)
    assert torch.equal(got.data, ref.data) and torch.equal(got.scale_codes, ref.scale_codes)
    row = (OperandSpec(FOUR_OVER_SIX, "nearest", None), 0)
    col = (OperandSpec(FOUR_OVER_SIX, SR8, TE16), 7)
    a, b = quantize_operand_pair(x, row, col, seed=11, backend="cute")
    ra = quantize(x, FOUR_OVER_SIX)
    rb = quantize(x.t().contiguous(), FOUR_OVER_SIX, rounding=SR8, hadamard=TE16, seed=11, offset=7)
    assert torch.equal(a.data, ra.data) and torch.equal(a.scale_codes, ra.scale_codes)
    assert torch.equal(b.data, rb.data) and torch.equal(b.scale_codes, rb.scale_codes)
    assert torch.equal(b.global_scale, rb.global_scale)
    # signs drawn per step: the rowwise kernel, the copies of a pair one by one
    step = RHTSpec(16, "step", None, 3).at(2, 9)
    got = fp4gen.quantize(x, FOUR_OVER_SIX, rounding=SR8, hadamard=step, seed=3, backend="cute")
    ref = quantize(x, FOUR_OVER_SIX, rounding=SR8, hadamard=step, seed=3)
    assert torch.equal(got.data, ref.data) and torch.equal(got.scale_codes, ref.scale_codes)
    rows = fmt(NVFP4, global_rows=True)
    got = fp4gen.quantize(x, rows, rounding=SR8, hadamard=TE16, seed=3, backend="cute")
    ref = quantize(x, rows, rounding=SR8, hadamard=TE16, seed=3)
    assert got.global_scale.shape == ref.global_scale.shape == (256, 1)
    assert torch.equal(got.global_scale, ref.global_scale) and torch.equal(got.data, ref.data)
    a, b = quantize_operand_pair(
        x, (OperandSpec(NVFP4, SR8, step), 1), (OperandSpec(NVFP4, SR8, step), 2), seed=5
    )
    ra = quantize(x, NVFP4, rounding=SR8, hadamard=step, seed=5, offset=1)
    rb = quantize(x.t().contiguous(), NVFP4, rounding=SR8, hadamard=step, seed=5, offset=2)
    assert torch.equal(a.data, ra.data) and torch.equal(b.data, rb.data)
    assert torch.equal(b.scale_codes, rb.scale_codes)
