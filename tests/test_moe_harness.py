"""The experts' comparison harness (tests/moe_harness.py) on the CPU: the GPU tests
(tests/test_moe_gpu.py) compare the CUDA run with the CPU's and the grouped path with the loop
through it, so here it must find two equal runs equal, report a flipped code by the GEMM and
the operand piece it is in, and report a product beyond its bound."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import fp4gen.runtime.grouped as grouped
from fp4gen.dsl.model import Operand
from fp4gen.runtime.experts import _ExpertGemm

sys.path.insert(0, str(Path(__file__).resolve().parent))
transformers = pytest.importorskip("transformers")

from moe_harness import (  # noqa: E402
    harnessed_run,
    operand_differences,
    result_differences,
    routing_grad_close,
)
from test_moe import ARCHS  # noqa: E402
from test_moe_grouped import pair, unequal_routing  # noqa: E402


def runs(arch: str, *, glue_on_cpu: bool = False):
    """The loop's and the grouped path's harnessed runs of one model's first experts module
    (the full NVFP4 recipe: stochastic rounding, RHT on wgrad), unequal groups, an empty
    expert, both checked."""
    loop, group = pair(arch, torch.bfloat16)
    index, weights = unequal_routing()
    hidden = torch.randn(70, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    args = (hidden, index, weights.to(torch.bfloat16))
    want = harnessed_run(loop, *args, check=True, glue_on_cpu=glue_on_cpu)
    got = harnessed_run(group, *args, check=True, glue_on_cpu=glue_on_cpu)
    return want, got


@pytest.mark.parametrize("glue_on_cpu", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_loop_and_the_grouped_path_are_equal_under_the_harness(
    arch: str, glue_on_cpu: bool
) -> None:
    """Every expert GEMM of the three experts with tokens recorded on both paths under the
    same keys, each product within its bound, and the results bit for bit."""
    want, got = runs(arch, glue_on_cpu=glue_on_cpu)
    keys = list(want.harness.operands)
    # 3 experts with tokens x 2 projections x (fprop, dgrad, wgrad)
    assert len(keys) == 18 and set(keys) == set(got.harness.operands)
    assert ("model.layers.0.mlp.experts.down_proj[3]", "wgrad", 0) in keys
    assert not any(name.endswith("[2]") for name, _, _ in keys)  # expert 2 had no tokens
    assert want.harness.checked == 18 and got.harness.checked == 6 * 3  # a product per group
    assert not want.harness.problems and not got.harness.problems
    assert not operand_differences(got.harness, want.harness)
    assert not result_differences(got, want)
    assert got.out.abs().sum() > 0


def test_a_flipped_code_is_named_by_its_gemm_and_piece(monkeypatch) -> None:
    """One code of expert 1's down projection input flipped on the grouped path: the harness
    names that GEMM's activation codes, and nothing earlier."""
    real = _ExpertGemm.quantize

    def faulty(self, t, operand, spec, call, *args, **kw):  # type: ignore[no-untyped-def]
        q = real(self, t, operand, spec, call, *args, **kw)
        if self.name.endswith("down_proj[1]") and operand == Operand.FPROP_ACTIVATION:
            codes = q.codes.clone()
            codes[0, 0] ^= 1
            q = dataclasses.replace(q, codes=codes)
        return q

    loop, group = pair("qwen3_moe", torch.bfloat16)
    index, weights = unequal_routing()
    hidden = torch.randn(70, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    args = (hidden, index, weights.to(torch.bfloat16))
    want = harnessed_run(loop, *args, check=False)
    monkeypatch.setattr(_ExpertGemm, "quantize", faulty)
    got = harnessed_run(group, *args, check=False)
    assert operand_differences(got.harness, want.harness) == [
        "model.layers.0.mlp.experts.down_proj[1] fprop (call 0): operand activation codes differ"
    ]
    assert "the output differs" in result_differences(got, want)


def test_a_product_beyond_its_bound_is_reported(monkeypatch) -> None:
    """A grouped product off by 2^-10 of its value: beyond the fp32 summation bound, reported
    per group; the values handed on (the float64 product) keep the runs equal."""
    real = grouped.group_rows
    monkeypatch.setattr(
        grouped, "group_rows", lambda a, b, ends, offs=None: real(a, b, ends, offs) * (1 + 2**-10)
    )
    want, got = runs("mixtral")
    assert not want.harness.problems
    assert got.harness.problems and all(
        p.startswith("grouped rows product, group ") for p in got.harness.problems
    )
    assert not result_differences(got, want)


def test_the_routing_gradient_tolerance() -> None:
    """Within one bf16 rounding of each side, plus 2^-12 of the largest entry: a one-ulp change
    passes, a 1% change does not."""
    g = torch.Generator().manual_seed(3)
    want = torch.randn(64, 2, generator=g).to(torch.bfloat16)
    ulp = 2.0 ** (want.float().abs().log2().floor() - 7)  # bf16 keeps 8 significant bits
    assert routing_grad_close((want.float() + ulp).to(torch.bfloat16), want)
    assert not routing_grad_close((want.float() * 1.01).to(torch.bfloat16), want)
    # sliced experts (Llama 4's) have no routing weights: empty stand-ins on both devices
    assert routing_grad_close(torch.zeros(0), torch.zeros(0))
    assert not routing_grad_close(torch.zeros(0), torch.zeros(1, 2))


# a global amax with ue7m0 block scales: decoded values up to 6 x 2^64, whose fp32 products
# overflow while the scaled result does not (such GEMMs run on the float64 reference)
OVERFLOWING = "format x = e2m1 block 1x1 global amax scale ue7m0\noperands {\n    * : x\n}\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_pairs_whose_fp32_products_overflow_are_handed_on_scaled(arch: str) -> None:
    """The harness hands on such a product with the global scales applied in float64 (an fp32
    product of the block values is inf): the recipe fuzzer drew one, and every comparison of
    its experts failed on the harness's own inf, never on the library's finite results."""
    from test_recipe_fuzz_gpu import experts_problems

    from fp4gen.dsl import parse_recipe

    recipe = parse_recipe(OVERFLOWING, base_dir=None)
    assert experts_problems(recipe, ARCHS.index(arch), "cpu") == []


@pytest.mark.parametrize(
    "recipe",
    ["operands {\n    * : nvfp4\n    dgrad : bf16\n}\n", "mor_tensor"],
    ids=["high-precision-dgrad", "mor"],
)
def test_gemms_with_a_high_precision_or_mor_operand_are_handed_on_from_the_cpu(
    recipe: str, monkeypatch
) -> None:
    """Such a GEMM is the library's float64 sum of exact values; the harness computes it on
    the CPU whatever the device (the recipe fuzzer's experts test skipped these tables, whose
    sums were each device's own), and the comparison holds on the CPU."""
    import moe_harness
    from test_recipe_fuzz_gpu import experts_problems

    import fp4gen
    from fp4gen.dsl import parse_recipe

    handed: list[int] = []
    real = moe_harness.operand_values
    monkeypatch.setattr(moe_harness, "operand_values", lambda t: handed.append(1) or real(t))
    parsed = parse_recipe(recipe, base_dir=None) if "{" in recipe else fp4gen.load_recipe(recipe)
    assert experts_problems(parsed, 1, "cpu") == []
    assert handed  # the harness's CPU sums ran
