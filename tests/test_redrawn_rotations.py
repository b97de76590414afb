"""RHT signs drawn per layer or per layer and step (``rht N signs layer|step seed S``): syntax,
canonical text, the signs from the definition (docs/numerics.md section 12), fp4gen.nn.Linear
drawing them from its seed and the training step, and the routing to the reference."""

from __future__ import annotations

import pytest
import torch
from option_kernels import option_kernels_on  # noqa: F401  (a fixture)

import fp4gen
from fp4gen.compiler.plan import plan_recipe, redrawn_rht_reason
from fp4gen.dsl import parse_recipe
from fp4gen.dsl.model import Operand, RHTSpec
from fp4gen.dsl.printer import print_recipe
from fp4gen.errors import RecipeError, TensorError
from fp4gen.numerics import QuantizedTensor, quantize
from fp4gen.numerics.hadamard import rht_signs
from fp4gen.numerics.philox import random_bits

RECIPE = """recipe r "per-step signs on wgrad"
operands {
    *     : nvfp4 round nearest
    wgrad : rht 16 signs step seed 3
}
"""


def test_syntax_and_canonical_text() -> None:
    r = parse_recipe(RECIPE)
    assert r.operands.wgrad_gradient.rht == RHTSpec(16, "step", None, 3)
    assert r.operands.fprop_activation.rht is None
    layer = parse_recipe(RECIPE.replace("signs step seed 3", "signs layer"))
    assert layer.operands.wgrad_activation.rht == RHTSpec(16, "layer", None, 0)
    text = print_recipe(r)
    assert "wgrad.gradient   : nvfp4 block 1x16 round nearest rht 16 signs step seed 3" in text
    assert parse_recipe(text) == r


def test_a_seed_beyond_64_bits_is_an_error_at_the_seed() -> None:
    with pytest.raises(RecipeError) as info:
        parse_recipe(RECIPE.replace("seed 3", "seed 18446744073709551616"))
    assert str(info.value).startswith("<recipe>:4:36:"), str(info.value)


def test_signs_are_philox_words_of_the_layer_and_step_stream() -> None:
    spec = RHTSpec(16, "step", None, 3)
    with pytest.raises(TensorError, match=r"RHTSpec.at\(layer, step\)"):
        rht_signs(spec)
    at = spec.at(5, 7)
    assert at.stream == (5 << 40) | 7
    expected = 1.0 - 2.0 * (random_bits(16, 3, (5 << 40) | 7) >> 31).float()
    assert torch.equal(rht_signs(at), expected)
    # per step: another step, other signs; per layer: the same at every step
    assert not torch.equal(rht_signs(spec.at(5, 8)), rht_signs(at))
    per_layer = RHTSpec(16, "layer", None, 3)
    assert torch.equal(rht_signs(per_layer.at(5, 7)), rht_signs(per_layer.at(5, 900)))
    assert not torch.equal(rht_signs(per_layer.at(6, 7)), rht_signs(per_layer.at(5, 7)))
    assert RHTSpec(16).at(5, 7) == RHTSpec(16)  # a fixed transform is what it is


def fake_quant_matmul(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """sum_k (q_a s_a)(q_b s_b) in float64, times both global scales, rounded once to fp32."""
    va, vb = a.dequantize_blockwise().double(), b.dequantize_blockwise().double()
    return ((va @ vb.t()) * (a.global_scale.double() * b.global_scale.double())).float()


def test_linear_draws_new_signs_every_step_from_its_seed() -> None:
    recipe = parse_recipe(RECIPE)
    torch.manual_seed(0)
    layer = fp4gen.nn.Linear(64, 48, recipe=recipe, seed=5, name="layer")
    x, dy = torch.randn(32, 64), torch.randn(32, 48)
    grads = []
    for step in (0, 1, 2, 1):
        fp4gen.set_step(layer, step)
        layer.weight.grad = None
        layer(x).backward(dy)
        spec = recipe.operands.wgrad_gradient.rht.at(5, step)  # type: ignore[union-attr]
        assert layer.operands.wgrad_gradient.rht == spec
        assert layer.operands.wgrad_activation.rht == spec
        fmt = recipe.operands.wgrad_gradient.format
        expected = fake_quant_matmul(
            quantize(dy.t(), fmt, hadamard=spec), quantize(x.t(), fmt, hadamard=spec)
        )
        assert torch.equal(layer.weight.grad, expected)
        grads.append(layer.weight.grad.clone())
    assert not torch.equal(grads[0], grads[1]) and not torch.equal(grads[1], grads[2])
    assert torch.equal(grads[1], grads[3])  # reproducible: step 1 again, the same signs


def test_the_planner_gives_them_the_rowwise_kernel(option_kernels_on: None) -> None:  # noqa: F811
    """Signs drawn per layer or step: the rowwise kernel takes them as arguments (one kernel
    per RHT size); the tile kernel compiles its signs in, so a fused pair of copies falls back to
    its single-output stand-ins (the columnwise copy by the rowwise kernel on the transpose)."""
    from fp4gen.compiler.build import render_plan
    from fp4gen.compiler.plan import kernel_rht, redrawn_tile_reason

    plan = plan_recipe(parse_recipe(RECIPE))
    fused = plan.kernel_for(Operand.WGRAD_GRADIENT)
    assert fused is not None
    drawn = [o.rht for o in fused.spec.outputs if o.rht is not None]
    assert drawn == [kernel_rht(RHTSpec(16, "step", None, 3))] == [RHTSpec(16, "layer", None, 0)]
    assert not any(Operand.WGRAD_GRADIENT in s.operands for s in plan.skipped)
    made = {r.planned.spec.name for r in render_plan(plan) if r.source is not None}
    assert "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne_rht16drawn" in made
    reason = redrawn_tile_reason(RHTSpec(16, "step", None, 3))
    assert reason is not None and "drawn per layer and step" in reason
    # the MoR kernels do not transform: the reason stays
    mor_reason = redrawn_rht_reason(RHTSpec(16, "step", None, 3))
    assert mor_reason is not None and "reference" in mor_reason
    assert plan.kernel_for(Operand.FPROP_ACTIVATION) is not None

    from fp4gen.formats import BUILTIN_FORMATS
    from fp4gen.runtime import cute_backend
    from fp4gen.runtime.loader import Unsupported

    # a tile launch is refused; a rowwise one is not (test_quantize_options_gpu runs it)
    copies = (("columnwise", "nearest", RHTSpec(16, "step", None, 3).at(1, 2)),)
    launch = cute_backend._launch(BUILTIN_FORMATS["nvfp4"], copies, torch.zeros(16, 32))  # type: ignore[arg-type]
    assert isinstance(launch.kernels, Unsupported) and "drawn per layer" in launch.kernels.reason


def test_only_per_step_tables_stay_out_of_graphs() -> None:
    recipe = parse_recipe(RECIPE)
    assert recipe.operands.redrawn(per_step=True)
    per_layer = parse_recipe(RECIPE.replace("signs step", "signs layer")).operands
    assert per_layer.redrawn() and not per_layer.redrawn(per_step=True)
    assert not parse_recipe(RECIPE.replace("signs step seed 3", "signs te")).operands.redrawn()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_linear_draws_the_cpu_signs() -> None:
    recipe = parse_recipe(RECIPE)
    torch.manual_seed(1)
    layer = fp4gen.nn.Linear(256, 128, recipe=recipe, seed=9, name="layer").cuda()
    x, dy = torch.randn(256, 256, device="cuda"), torch.randn(256, 128, device="cuda")
    for step in range(3):
        fp4gen.set_step(layer, step)
        layer.weight.grad = None
        layer(x).backward(dy)
        spec = recipe.operands.wgrad_gradient.rht.at(9, step)  # type: ignore[union-attr]
        fmt = recipe.operands.wgrad_gradient.format
        qa = quantize(dy.t().cpu(), fmt, hadamard=spec)
        qb = quantize(x.t().cpu(), fmt, hadamard=spec)
        expected = fake_quant_matmul(qa, qb)
        magnitude = (
            qa.dequantize_blockwise().double().abs() @ qb.dequantize_blockwise().double().abs().t()
        )
        magnitude = magnitude * float(qa.global_scale) * float(qb.global_scale)
        # an fp32-accumulating GEMM over K = 256 against the float64 sum: 256 * 2^-24 of sum |ab|
        err = (layer.weight.grad.cpu().double() - expected.double()).abs()
        assert bool((err <= 2e-5 * magnitude + 1e-6).all()), step


UNNESTED = """recipe u "an RHT size that does not nest with the blocks"
format b24 = nvfp4 block 1x24
operands {
    *     : b24 round nearest
    fprop : rht 32 seed 2
}
"""


def test_an_rht_size_need_not_nest_with_the_block_length() -> None:
    from torch.nn import functional as F

    from fp4gen.compiler.plan import unnested_rht_reason
    from fp4gen.numerics.gemm import gemm_reference

    recipe = parse_recipe(UNNESTED)
    spec = recipe.operands.fprop_activation
    assert spec.rht == RHTSpec(32, "seeded", None, 2) and spec.format.block == (1, 24)
    reason = unnested_rht_reason(spec.format, spec.rht)
    assert reason is not None and "rht 32 with 1x24 blocks" in reason
    assert plan_recipe(recipe).kernel_for(Operand.FPROP_ACTIVATION) is None
    torch.manual_seed(3)
    layer = fp4gen.nn.Linear(100, 52, recipe=recipe, seed=1, name="layer")
    x = torch.randn(37, 100)
    y = layer(x)
    # K = 100 padded with zeros to 128, a multiple of the RHT size: chunks of 32 are rotated,
    # then quantized in 1x24 blocks (the last block of a row holds 8 values)
    xq = quantize(F.pad(x, (0, 28)), spec.format, hadamard=spec.rht)
    wq = quantize(F.pad(layer.weight.detach(), (0, 28)), spec.format, hadamard=spec.rht)
    assert torch.equal(y.detach(), gemm_reference(xq, wq) + layer.bias.detach())
