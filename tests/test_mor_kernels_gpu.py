"""Generated MoR kernels on a CUDA GPU, bit for bit against the reference ``fp4gen.numerics.mor``
computed on the CPU: decisions, codes, high-precision values, every candidate's scales (encode
scale, decode factor, exponent, group mantissa), the float64 error sums and the non-zero counts.

Cases: hand-built tensors whose mean relative error sits one fp32 step under and over the 4.5%
threshold (per tensor, per 128x128 block, per channel), and random shapes and value patterns for
every shipped MoR recipe and for hand-made rules (exotic element formats, every partition and
scaling, truncation, fp16 / fp32 inputs). Then the dispatch: ``mor_quantize`` and the training
runtime take the kernels on CUDA and fall back (logged once) where they do not apply.

Skipped without a CUDA GPU (marker ``gpu``). Every kernel is compiled first, in parallel worker
processes, into a kernel cache for the session ($FP4GEN_GPU_TEST_CACHE keeps it).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from gpu_kernel_cache import compiled_cache

import fp4gen
from fp4gen.codegen.mor import MoRKernelSpec, render
from fp4gen.compiler.cache import KernelCache
from fp4gen.dsl import load_recipe
from fp4gen.dsl.model import Candidate, Metric, MoRSpec, Partition
from fp4gen.errors import TensorError
from fp4gen.numerics.mor import MoRTensor
from fp4gen.runtime import mor_kernels
from fp4gen.runtime.loader import LogOnce
from fp4gen.runtime.quantize_dispatch import mor_quantize  # backend= picks kernels or oracle

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_codegen_mor import HAND, SHIPPED  # noqa: E402  (the same hand-made rules)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
E4M3 = SHIPPED["mor_tensor"].candidates[0].format
BF16 = SHIPPED["mor_tensor"].candidates[1].format
BLOCK = Partition("block", (128, 128))
# 4.5% per 128x128 block, decided in the quantizing pass; and per channel (spanning tiles)
BLOCK_RULE = HAND["block_threshold"].rule
CHANNEL_RULE = MoRSpec(
    "ch_gam",
    Partition("channel"),
    BLOCK,
    "gam",
    (Candidate(E4M3, Metric("relerr", threshold=0.045)), Candidate(BF16)),
)


def every_spec() -> list[MoRKernelSpec]:
    specs = [MoRKernelSpec(r, "nearest", d) for r in SHIPPED.values() for d in ("bf16", "fp32")]
    specs += [MoRKernelSpec(SHIPPED["mor_subtensor_3way"], "nearest", "fp16")]
    specs += [MoRKernelSpec(SHIPPED["mor_tensor"], "zero", "bf16")]
    specs += [MoRKernelSpec(CHANNEL_RULE, "nearest", d) for d in ("bf16", "fp32")]
    specs += list(HAND.values())
    specs += [MoRKernelSpec(BLOCK_RULE, "nearest", "fp32")]
    specs += [MoRKernelSpec(r, "nearest", "bf16", segments=8) for r in SHIPPED.values()]
    specs += [MoRKernelSpec(CHANNEL_RULE, "nearest", "fp32", segments=8)]
    return list(dict.fromkeys(specs))


@pytest.fixture(scope="session")
def arch() -> str:
    major, _ = torch.cuda.get_device_capability()
    if major not in (9, 10):
        pytest.skip(f"no sm_90a/sm_100a kernels for compute capability {major}.x")
    return {9: "sm_90a", 10: "sm_100a"}[major]


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory, arch: str) -> KernelCache:
    """Every kernel of this file, compiled by worker processes into one cache."""
    cache = compiled_cache(tmp_path_factory, "mor-cache", every_spec(), render, arch)
    return cache


@pytest.fixture(scope="module")
def run(kernel_cache: KernelCache, arch: str):
    """run(x, rule, rounding="nearest") -> the MoRTensor of the kernels."""

    def go(x: torch.Tensor, rule: MoRSpec, rounding: str = "nearest") -> MoRTensor:
        spec = MoRKernelSpec(rule, rounding, {v: k for k, v in DTYPES.items()}[x.dtype])
        mor_kernels.mor_kernels_for(spec, arch, cache=kernel_cache)  # loaded from the cache
        mt = mor_quantize(x, rule, rounding=rounding, backend="cute")
        assert mt.codes.is_cuda and mt.choice.is_cuda
        return mt

    return go


def bits(t: torch.Tensor) -> torch.Tensor:
    """The exact bits of a float tensor (so -0.0, NaN and float64 sums compare exactly)."""
    view = {torch.float64: torch.int64, torch.float32: torch.int32}
    return t.contiguous().view(view[t.dtype]) if t.dtype in view else t


def compare(got: MoRTensor, x: torch.Tensor, rule: MoRSpec, rounding: str = "nearest") -> None:
    """Every field of the kernels' MoRTensor equals the CPU reference's, bit for bit."""
    ref = mor_quantize(x.cpu(), rule, rounding=rounding, backend="reference")
    bad = []

    def check(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
        a, b = a.cpu(), b.cpu()
        if a.shape != b.shape:
            bad.append(f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}")
        elif not torch.equal(bits(a), bits(b)):
            diff = (bits(a) != bits(b)).nonzero()
            i = tuple(diff[0].tolist())
            bad.append(f"{what}: {diff.shape[0]} differ, first {i}: {a[i]!r} vs {b[i]!r}")

    check("choice", got.choice, ref.choice)
    check("codes", got.codes, ref.codes)
    check("high", got.high.float(), ref.high)
    check("error_sum", got.error_sum, ref.error_sum)
    check("nonzero", got.nonzero, ref.nonzero)
    assert got.evaluated == ref.evaluated and got.unit == ref.unit
    for i, (a, b) in enumerate(zip(got.scales, ref.scales, strict=True)):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert (a.block, a.group) == (b.block, b.group)
        check(f"scales[{i}].encode", a.encode, b.encode)
        check(f"scales[{i}].decode", a.decode, b.decode)
        for field in ("exponent", "mantissa"):
            fa, fb = getattr(a, field), getattr(b, field)
            assert (fa is None) == (fb is None), field
            if fa is not None:
                check(f"scales[{i}].{field}", fa, fb)
    assert not bad, f"{rule.name} on {tuple(x.shape)} {x.dtype}: " + "; ".join(bad[:4])
    # telemetry, computed by torch on each device from the same decisions and sums: a fraction
    # of units is a count times 1/n on CUDA (two roundings) and count / n on the CPU (one), so
    # at most 1 fp32 ulp (2^-23 relative) apart; the overall mean adds the units' float64 sums
    # in each device's order, at most units * 2^-53 relative apart (< 1e-12 for 9000 units)
    stats, want = got.stats(), ref.stats()
    assert stats.pop("mean_rel_error") == pytest.approx(want.pop("mean_rel_error"), rel=1e-12)
    assert stats.pop("fallback") == pytest.approx(want.pop("fallback"), rel=2**-23)
    assert stats.pop("formats") == pytest.approx(want.pop("formats"), rel=2**-23)
    assert stats == want
    assert torch.equal(got.dequantize().cpu(), ref.dequantize())


# ----------------------------------------------------------------------------------------------
# The threshold: one fp32 step under and over 4.5%
# ----------------------------------------------------------------------------------------------


def threshold_values(shape: tuple[int, int]) -> tuple[float, float]:
    """(v_under, v_over): adjacent fp32 values v for which a unit of this shape holding 448 at
    its first element and v elsewhere has a mean relative error just under / over 4.5%, as the
    reference computes it. (The 128x128 GAM scale of the block holding the 448 is 1 and that of
    blocks of v is 2^8, so Q(v) = 1.0 everywhere; the mean is about (n - 1) / n * (v - 1) / v.
    A unit inside a larger tensor sums in the same order as the unit alone, so the crossing
    found on the unit alone is the crossing inside the tensor.)"""
    rule = MoRSpec("t", Partition("tensor"), BLOCK, "gam", BLOCK_RULE.candidates)
    n = shape[0] * shape[1]

    def mean(v: torch.Tensor) -> float:
        x = torch.full(shape, float(v))
        x[0, 0] = 448.0
        return float(mor_quantize(x, rule, backend="reference").mean_rel_error()[0, 0, 0])

    v = torch.tensor(1.0 / (1.0 - 0.045 * n / (n - 1)), dtype=torch.float32)
    for _ in range(16):  # walk along the fp32 grid to the crossing
        up = mean(v) < 0.045
        step = torch.nextafter(v, torch.tensor(2.0 if up else 0.0))
        if (mean(step) < 0.045) != up:
            return (float(v), float(step)) if up else (float(step), float(v))
        v = step
    raise AssertionError("no crossing found")


def threshold_units(rows: int, cols: int, unit: tuple[int, int], pattern) -> torch.Tensor:
    """A tensor of units, each 448 at its first element and v elsewhere, v the crossing's
    value under ("u") or over ("o") per pattern[i][j]."""
    ur, uc = unit
    under, over = threshold_values(unit)
    x = torch.zeros(rows, cols)
    for i in range(rows // ur):
        for j in range(cols // uc):
            x[i * ur : (i + 1) * ur, j * uc : (j + 1) * uc] = (
                under if pattern[i][j] == "u" else over
            )
            x[i * ur, j * uc] = 448.0
    return x


def test_threshold_per_block(run) -> None:
    # fp32 input: the crossing values near 1.047 are fp32 neighbours, not bf16 values
    x = threshold_units(256, 384, (128, 128), ["uou", "ouu"]).cuda()
    mt = run(x, BLOCK_RULE)
    assert mt.choice.tolist() == [[0, 1, 0], [1, 0, 0]]
    compare(mt, x, BLOCK_RULE)
    err = mt.mean_rel_error()[0].cpu()
    assert ((err < 0.045) == (mt.choice.cpu() == 0)).all()
    # one fp32 step of v (2^-23 * 1.05) moves the mean by about 2^-23 / v: < 2e-7 around 4.5%
    assert float((err - 0.045).abs().max()) < 2e-7


def test_threshold_per_tensor(run) -> None:
    rule = MoRSpec("t", Partition("tensor"), BLOCK, "gam", BLOCK_RULE.candidates)
    for shape, side in (((128, 256), 0), ((128, 256), 1), ((300, 200), 0), ((300, 200), 1)):
        x = torch.full(shape, threshold_values(shape)[side])
        x[0, 0] = 448.0
        x = x.cuda()
        mt = run(x, rule)
        assert mt.choice.tolist() == [[side]]
        compare(mt, x, rule)


def test_threshold_per_channel(run) -> None:
    rows, cols = 6, 1024
    under, over = threshold_values((1, cols))
    x = torch.full((rows, cols), under)
    x[1::2] = over
    x[:, 0] = 448.0
    x = x.cuda()
    mt = run(x, CHANNEL_RULE)
    assert mt.choice.reshape(-1).tolist() == [0, 1, 0, 1, 0, 1]
    compare(mt, x, CHANNEL_RULE)


# ----------------------------------------------------------------------------------------------
# Random shapes and value patterns
# ----------------------------------------------------------------------------------------------

SHAPES = [(1, 8), (7, 40), (128, 128), (130, 264), (256, 384)]
LARGE = [(300, 1000), (1024, 2048)]  # "mixed" (and "randn" for the first) only
PATTERNS = ("mixed", "randn", "outliers", "zeros", "tiny", "huge", "signed_zero")


def make_input(pattern: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """fp32 patterns on the GPU. "mixed": each 128x128 block one kind: Gaussian, magnitudes
    uniform in [1, 5) (a narrow range: formats with the same mantissa width tie), log-uniform
    over 2^20 (fits e5m2's range, e4m3 flushes) or over 2^34 (fits neither), so every candidate
    wins somewhere. "randn": blocks of magnitudes 2^[-20, 20]. "outliers". "zeros": with -0.0
    and one exactly representable value. "tiny": fp32 subnormals. "huge": near the fp32 max.
    "signed_zero": magnitudes 2^0 .. 2^-149, three in four negative, among -0.0 and +0.0, and a
    few outliers up to 2^100: negative values that round to zero encode as negative zero, -0.0
    as code 0 (docs/numerics.md 1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows, cols = shape
    dev = "cuda"
    x = torch.randn(rows, cols, generator=g, device=dev)
    nb = ((rows + 127) // 128, (cols + 127) // 128)

    def per_block(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]

    if pattern == "mixed":
        u = torch.rand(rows, cols, generator=g, device=dev)
        kind = per_block(torch.randint(0, 4, nb, generator=g, device=dev))
        mag = torch.stack([x.abs(), 1 + 4 * u, torch.exp2(-20 * u), torch.exp2(-34 * u)]).gather(
            0, kind[None]
        )[0]
        x = torch.where(x < 0, -mag, mag)
    elif pattern == "randn":
        x = x * per_block(torch.exp2(torch.randint(-20, 21, nb, generator=g, device=dev).float()))
    elif pattern == "outliers":
        flat = x.view(-1)
        n = max(1, flat.numel() // 500)
        flat[torch.randint(0, flat.numel(), (n,), generator=g, device=dev)] *= 1e4
    elif pattern == "zeros":
        x = torch.zeros(rows, cols, device=dev)
        x[:, 1::3] = -0.0
        if rows * cols > 16:
            x[0, 3] = 2.5
    elif pattern == "tiny":
        x = x * 1e-40
    elif pattern == "huge":
        x = x * 1e37
    elif pattern == "signed_zero":
        mag = torch.exp2(-torch.randint(0, 150, (rows, cols), generator=g, device=dev).float())
        x = torch.where(torch.rand(rows, cols, generator=g, device=dev) < 0.75, -mag, mag)
        flat = x.view(-1)
        n = max(1, flat.numel() // 300)
        idx = torch.randint(0, flat.numel(), (n,), generator=g, device=dev)
        flat[idx] = flat[idx].sign() * torch.exp2(
            torch.randint(-4, 101, (n,), generator=g, device=dev).float()
        )
        flat[1::5] = -0.0
        flat[2::7] = 0.0
    return x


RULES = {
    **{n: (r, "nearest") for n, r in SHIPPED.items()},
    "mor_tensor_rz": (SHIPPED["mor_tensor"], "zero"),
    "channel_gam": (CHANNEL_RULE, "nearest"),
    "block_threshold": (BLOCK_RULE, "nearest"),
    **{n: (s.rule, s.rounding) for n, s in HAND.items()},
}
DTYPES_OF = {
    "mor_tensor": ("bf16", "fp32"),
    "mor_subtensor_2way": ("bf16", "fp32"),
    "mor_subtensor_3way": ("bf16", "fp32", "fp16"),
    "channel_gam": ("bf16", "fp32"),
    "block_threshold": ("fp32",),
    "channel_e8m0_fp32in": ("fp32",),
    "exotic_16x32_amax_fp16": ("fp16",),
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_random_shapes_match_the_reference(run, name: str) -> None:
    rule, rounding = RULES[name]
    seen: set[int] = set()
    for dtype in DTYPES_OF.get(name, ("bf16",)):
        cases = [(s, p) for s in SHAPES for p in PATTERNS]
        cases += [(LARGE[0], "mixed"), (LARGE[0], "randn")]
        if name in SHIPPED and dtype == "bf16":
            cases.append((LARGE[1], "mixed"))
        for i, (shape, pattern) in enumerate(cases):
            x = make_input(pattern, shape, seed=i)
            if dtype == "fp16":  # stay inside fp16's range (max 65504): inf would be rejected
                x = x.clamp(-6e4, 6e4)
            x = x.to(DTYPES[dtype])
            mt = run(x, rule, rounding)
            compare(mt, x, rule, rounding)
            seen.update(mt.choice.unique().tolist())
    if name.startswith("mor_subtensor") or name == "exotic_16x32_amax_fp16":
        assert seen == set(range(len(rule.candidates)))  # every candidate was chosen somewhere


@pytest.mark.parametrize("name", [*sorted(SHIPPED), "channel_gam"])
def test_eight_segments_per_thread_match_too(kernel_cache, arch, name: str) -> None:
    """The 256-thread layout (8 row segments per thread) computes the same, bit for bit."""
    rule = CHANNEL_RULE if name == "channel_gam" else SHIPPED[name]
    dtype = "fp32" if name == "channel_gam" else "bf16"
    spec = MoRKernelSpec(rule, "nearest", dtype, segments=8)
    kernels = mor_kernels.mor_kernels_for(spec, arch, cache=kernel_cache)
    for i, (shape, pattern) in enumerate(
        [(s, p) for s in SHAPES for p in PATTERNS] + [(LARGE[0], "mixed")]
    ):
        x = make_input(pattern, shape, seed=50 + i).to(DTYPES[dtype])
        compare(mor_kernels.run_kernels(kernels, x), x, rule)


# ----------------------------------------------------------------------------------------------
# Dispatch: mor_quantize(backend="auto"), the runtime, the fallbacks
# ----------------------------------------------------------------------------------------------


def test_auto_takes_the_kernels_and_falls_back_once(run, caplog, monkeypatch) -> None:
    # a fresh log-once record: under pytest-xdist another test in this worker may have met the
    # same fallback first, and the process-wide one would then (rightly) stay silent here
    once = mor_kernels._log_once
    monkeypatch.setattr(mor_kernels, "_log_once", LogOnce(once.log, once.message))
    rule = SHIPPED["mor_subtensor_2way"]
    x = make_input("mixed", (256, 512), seed=5).to(torch.bfloat16)
    run(x, rule)  # loaded
    auto = mor_quantize(x, rule)
    assert isinstance(auto.high, torch.Tensor) and auto.high.dtype == torch.bfloat16  # kernels
    compare(auto, x, rule)
    caplog.set_level(logging.INFO, logger="fp4gen.runtime")
    for _ in range(2):
        sr = mor_quantize(x, rule, rounding="stochastic", seed=3)
        assert sr.high.dtype == torch.float32  # the reference
    messages = [r.getMessage() for r in caplog.records if "uses the reference" in r.getMessage()]
    assert len(messages) == 1 and "stochastic" in messages[0]
    with pytest.raises(fp4gen.FP4GenError, match="not available"):
        mor_quantize(x, rule, rounding="stochastic", backend="cute")
    odd = torch.randn(16, 12, device="cuda", dtype=torch.bfloat16)  # K % 8 != 0
    compare(mor_quantize(odd, rule), odd, rule)  # the reference, logged


def test_non_finite_input_raises(run) -> None:
    rule = SHIPPED["mor_tensor"]
    x = torch.randn(64, 64, device="cuda")
    run(x, rule)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[3, 5] = bad
        with pytest.raises(TensorError, match="non-finite"):
            mor_quantize(y, rule, backend="cute")


def test_linear_on_cuda_matches_the_reference_backend(run) -> None:
    recipe = load_recipe("mor_subtensor_3way.fp4r")
    for dtype in (torch.bfloat16, torch.float32):  # load the kernels from the session's cache
        run(torch.zeros(8, 8, device="cuda", dtype=dtype), recipe.mors[0])
    outs = []
    for backend in ("auto", "reference"):
        torch.manual_seed(0)
        layer = fp4gen.nn.Linear(256, 384, recipe=recipe, backend=backend).cuda()
        x = make_input("mixed", (128, 256), seed=9).requires_grad_(True)
        y = layer(x)
        y.backward(make_input("randn", (128, 384), seed=10))
        outs.append((y.detach(), x.grad, layer.weight.grad))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
