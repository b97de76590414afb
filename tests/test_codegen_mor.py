"""MoR codegen: render the shipped MoR rules and hand-made ones (any ExMy candidate, every
partition kind and scaling), check the source, reject what the kernels do not cover, and
cross-compile every kernel for sm_90a and sm_100a on the CPU (PTX read back)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fp4gen.codegen import import_source
from fp4gen.codegen.mor import ARCHS, ElementRep, MoRKernelSpec, check, context, render
from fp4gen.dsl import load_recipe
from fp4gen.dsl.model import Candidate, Metric, MoRSpec, Partition
from fp4gen.formats import E2M1, E3M2, E4M3, E5M2, ElementFormat, HighPrecision
from fp4gen.numerics.mor import representations

BF16, FP16, FP32 = HighPrecision("bf16"), HighPrecision("fp16"), HighPrecision("fp32")
SHIPPED = {
    name: load_recipe(f"{name}.fp4r").mors[0]
    for name in ("mor_tensor", "mor_subtensor_2way", "mor_subtensor_3way")
}
BLOCK = Partition("block", (128, 128))


def rule(name, decide, scale, scaling, *candidates) -> MoRSpec:
    return MoRSpec(name, decide, scale, scaling, tuple(candidates))


def relerr(t: float) -> Metric:
    return Metric("relerr", threshold=t)


HAND = {
    # a 4.5% threshold per 128x128 block (decided in the quantizing pass)
    "block_threshold": MoRKernelSpec(
        rule("bt", BLOCK, BLOCK, "gam", Candidate(E4M3, relerr(0.045)), Candidate(BF16))
    ),
    # per channel: decisions span the row's tiles (measure / decide / emit), e8m0 row scales
    "channel_e8m0_fp32in": MoRKernelSpec(
        rule(
            "ch",
            Partition("channel"),
            Partition("channel"),
            "e8m0",
            Candidate(E4M3, relerr(0.045)),
            Candidate(BF16),
        ),
        input_dtype="fp32",
    ),
    # exotic element formats from their parameters, 16x32 decisions inside a tile, FP32-amax
    # scales on 32x16 blocks, fp16 kept values
    "exotic_16x32_amax_fp16": MoRKernelSpec(
        rule(
            "ex",
            Partition("block", (16, 32)),
            Partition("block", (32, 16)),
            "amax",
            Candidate(E3M2, Metric("relerr_vs", versus=E5M2)),
            Candidate(E2M1, Metric("range")),
            Candidate(FP16),
        ),
        input_dtype="fp16",
    ),
    # 256x256 decisions over several tiles, one tensor scale, two high-precision candidates
    # (their values kept in fp32), truncation
    "wide_two_high_rz": MoRKernelSpec(
        rule(
            "wide",
            Partition("block", (256, 256)),
            Partition("tensor"),
            "e8m0",
            Candidate(ElementFormat(3, 3, special="fn"), relerr(0.03)),
            Candidate(BF16, relerr(0.002)),
            Candidate(FP32),
        ),
        rounding="zero",
    ),
}
SPECS = {f"{n}_bf16": MoRKernelSpec(r) for n, r in SHIPPED.items()} | HAND
# 8 row segments per thread (CTAs of 256 threads) instead of 4 (512)
SPECS["mor_subtensor_3way_s8"] = MoRKernelSpec(SHIPPED["mor_subtensor_3way"], segments=8)
SPECS["mor_tensor_fp32_s8"] = MoRKernelSpec(SHIPPED["mor_tensor"], input_dtype="fp32", segments=8)


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SPECS))
def test_render_is_valid_deterministic_python(name: str) -> None:
    spec = SPECS[name]
    src = render(spec)
    assert src == render(spec)
    tree = ast.parse(src)
    kernels = next(
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "KERNELS"
    )
    ctx = context(spec)
    assert kernels == ctx.kernels
    assert ("QuantizeKernel" in src) == ctx.fused
    assert ("DecideKernel" in src) != ctx.fused
    assert f'SPEC_NAME = "{spec.name}"' in src
    # every representation measured, the element formats with their encode constants (the
    # encodes are fp4gen.kernels.mor's)
    n_elem = sum(isinstance(r, ElementFormat) for r in representations(spec.rule))
    assert src.count('mor.Rep(\n        "elem",') == n_elem
    assert src.count("mor.Rep(") == len(representations(spec.rule))
    assert f"N_REPS = {len(representations(spec.rule))}" in src


def test_shipped_rules_shape_the_module() -> None:
    tensor = context(MoRKernelSpec(SHIPPED["mor_tensor"]))
    assert not tensor.fused and (tensor.urs, tensor.ucs) == (31, 31)
    assert (tensor.srs, tensor.scs) == (7, 7) and tensor.scaling == "gam"
    two = context(MoRKernelSpec(SHIPPED["mor_subtensor_2way"]))
    assert two.fused and [r.name for r in two.reps] == ["e4m3", "bf16", "e5m2"]
    assert [c.rep.name for c in two.cands] == ["e4m3", "bf16"]
    assert two.cands[0].versus == 2  # e5m2 is only the yardstick
    three = context(MoRKernelSpec(SHIPPED["mor_subtensor_3way"]))
    range_rep = three.cands[1].rep
    assert three.uses_range and isinstance(range_rep, ElementRep)
    assert range_rep.range_bound == "939524096.0"
    assert three.high is not None and three.high.name == "bf16"
    wide = context(HAND["wide_two_high_rz"])
    assert wide.high is not None and wide.high.name == "fp32"
    assert wide.high_cands == ("bf16", "fp32")
    assert (wide.upr_shift, wide.upc_shift) == (1, 1)  # 2x2 tiles per decision


def test_element_constants_come_from_the_format() -> None:
    src = render(HAND["exotic_16x32_amax_fp16"])
    # e3m2 (bias 3): max 28, emin = -2 -> biased 125; e2m1 (bias 1): max 6, emin 0 -> 127
    assert "E0_MAX = 28.0" in src and "E0_EMIN_BIASED = 125" in src and "E0_MAN_BITS = 2" in src
    assert "E1_MAX = 6.0" in src and "E1_EMIN_BIASED = 127" in src and "E1_MAN_BITS = 1" in src
    assert "E2_MAX = 57344.0" in src  # the yardstick, e5m2
    assert "E1_RANGE_BOUND = 6.0" in src  # e2m1: 6 / 2^0
    assert 'high="fp16",' in src and "HIGH_TORCH = torch.float16" in src  # kernels.mor rounds


def test_generated_sources_are_ruff_clean(tmp_path: Path) -> None:
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    for name, spec in SPECS.items():
        (tmp_path / f"{name}.py").write_text(render(spec))
    config = Path(__file__).resolve().parent.parent / "pyproject.toml"
    for args in (["check"], ["format", "--check"]):
        proc = subprocess.run(
            [ruff, *args, "--config", str(config), str(tmp_path)], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_unsupported_rules_are_rejected_clearly() -> None:
    base = SHIPPED["mor_subtensor_2way"]
    with pytest.raises(NotImplementedError, match="rounding 'stochastic'"):
        check(MoRKernelSpec(base, rounding="stochastic"))
    odd = rule("odd", Partition("block", (48, 96)), BLOCK, "gam", *base.candidates)
    with pytest.raises(NotImplementedError, match=r"48x96: the kernels take power-of-two"):
        check(MoRKernelSpec(odd))
    narrow = rule("narrow", BLOCK, Partition("block", (1, 4)), "gam", *base.candidates)
    with pytest.raises(NotImplementedError, match="at least 8 columns"):
        check(MoRKernelSpec(narrow))
    only_high = rule("hp", BLOCK, BLOCK, "gam", Candidate(BF16, relerr(0.1)), Candidate(FP32))
    with pytest.raises(NotImplementedError, match="without element candidates"):
        render(MoRKernelSpec(only_high))
    with pytest.raises(NotImplementedError, match="2 segments per thread"):
        check(MoRKernelSpec(base, segments=2))


def test_spec_names_are_unique_and_stable() -> None:
    names = {s.name for s in SPECS.values()}
    assert len(names) == len(SPECS)
    spec = MoRKernelSpec(SHIPPED["mor_tensor"])
    assert spec.name == MoRKernelSpec(SHIPPED["mor_tensor"]).name
    assert spec.name.startswith("mor_tensor_e4m3_bf16_nearest_")
    assert MoRKernelSpec(SHIPPED["mor_tensor"], input_dtype="fp32").name != spec.name
    assert "_s4_" in spec.name and "_s8_" in MoRKernelSpec(spec.rule, segments=8).name


# ----------------------------------------------------------------------------------------------
# Cross-compilation (CPU only) and PTX
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("generated")
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
@pytest.mark.parametrize("name", sorted(SPECS))
def test_cross_compile(name: str, arch: str, modules, tmp_path: Path) -> None:
    mod = modules(name)
    spec = SPECS[name]
    reps = representations(spec.rule)
    # representations whose error needs a division (fp32 is exact)
    divided = sum(not (isinstance(r, HighPrecision) and r.name == "fp32") for r in reps)
    for kernel in mod.KERNELS:
        ptx = _ptx(mod.compile_kernel(kernel, arch, dump_dir=str(tmp_path / kernel)))
        assert f".target {arch}" in ptx
        assert not re.search(r"\.local\b", ptx), f"{kernel} uses local memory (spills)"
        assert not re.search(r"\.approx|\.ftz", ptx), "approximate or flush-to-zero math"
        if kernel == "amax":
            assert "atom.global.max.s32" in ptx  # per scale block and for the tensor
        seg = spec.segments
        if kernel in ("quantize", "measure"):
            # one correctly rounded float64 division per element and representation (8 * seg
            # elements per thread), plus a relerr mean per unit the thread decides (<= seg)
            extra = seg * any(c.metric and c.metric.kind == "relerr" for c in spec.rule.candidates)
            assert 8 * seg * divided <= ptx.count("div.rn.f64") <= 8 * seg * divided + extra
            assert "shfl.sync.bfly.b32" in ptx  # the tree across lanes
        if kernel == "scales":
            assert "div.rn.f32" in ptx  # q_max / amax
            if spec.rule.scaling == "gam":
                assert "cvt.rn.f32.f64" in ptx  # fp32(m_g * 2^e)
        if kernel == "decide":
            assert "bar.sync" in ptx  # one tree level per barrier
        if kernel in ("quantize", "measure", "emit"):
            # seg rows of 8 elements, 128-bit loads (the quantize kernel reads its tile twice)
            loads = seg * (2 if spec.input_dtype == "fp32" else 1)
            assert ptx.count("ld.global.v4") == loads * (2 if kernel == "quantize" else 1)
        if kernel in ("quantize", "emit"):
            assert "st.global" in ptx


def test_compile_kernel_rejects_unknown_names(modules) -> None:
    mod = modules("mor_tensor_bf16")
    with pytest.raises(ValueError, match="no kernel 'quantize'"):
        mod.compile_kernel("quantize", "sm_90a")
    with pytest.raises(ValueError, match="unsupported arch"):
        mod.compile_kernel("amax", "sm_80")


def test_run_validates_the_input(modules) -> None:
    import torch

    from fp4gen.errors import TensorError

    mod = modules("mor_subtensor_2way_bf16")
    with pytest.raises(TensorError, match="must be 2-D"):
        mod.check_input(torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(TensorError, match="must be torch.bfloat16"):
        mod.check_input(torch.zeros(2, 8))
    with pytest.raises(TensorError, match="multiple of 8"):
        mod.check_input(torch.zeros(2, 12, dtype=torch.bfloat16))
    with pytest.raises(TensorError, match="CUDA device"):
        mod.check_input(torch.zeros(2, 16, dtype=torch.bfloat16))
    assert mod.grid_of(300, 1000, 7, 31) == (3, 1)
    assert mod.grid_of(300, 1000, 0, 31) == (300, 1)
