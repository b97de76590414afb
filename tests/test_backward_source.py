"""``from GEMM.ROLE``: a backward operand quantized from the dequantized copy of another GEMM."""

from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.dsl import parse_recipe, print_recipe
from fp4gen.dsl.model import Operand
from fp4gen.errors import RecipeError
from fp4gen.numerics import gemm_reference, quantize

HEAD = "recipe t\noperands {\n    * : nvfp4 round nearest rht none\n"


def recipe_text(*lines: str) -> str:
    return HEAD + "".join(f"    {line}\n" for line in lines) + "}\n"


def test_parse_sets_the_source_of_each_allowed_pair() -> None:
    r = parse_recipe(
        recipe_text(
            "wgrad.activation : from fprop.activation",
            "dgrad.weight : from fprop.weight",
            "wgrad.gradient : from dgrad.gradient",
        )
    )
    t = r.operands
    assert t.wgrad_activation.source is Operand.FPROP_ACTIVATION
    assert t.dgrad_weight.source is Operand.FPROP_WEIGHT
    assert t.wgrad_gradient.source is Operand.DGRAD_GRADIENT
    for spec in (t.fprop_activation, t.fprop_weight, t.dgrad_gradient):
        assert spec.source is None
    # the other properties are untouched by the source
    assert t.wgrad_activation.format == t.fprop_activation.format


def test_from_none_clears_an_inherited_source_and_format_keeps_it() -> None:
    r = parse_recipe(
        recipe_text(
            "wgrad.activation : from fprop.activation",
            "wgrad.activation : mxfp4",  # a new format keeps the source (a separate property)
        )
    )
    assert r.operands.wgrad_activation.source is Operand.FPROP_ACTIVATION
    assert r.operands.wgrad_activation.format.name == "mxfp4"
    r = parse_recipe(recipe_text("wgrad.activation : from fprop.activation", "wgrad : from none"))
    assert r.operands.wgrad_activation.source is None


def test_print_round_trip() -> None:
    r = parse_recipe(
        recipe_text(
            "wgrad.activation : from fprop.activation",
            "dgrad.weight : from fprop.weight",
            "wgrad.gradient : mxfp4 from dgrad.gradient",
        )
    )
    text = print_recipe(r)
    assert "wgrad.activation : nvfp4 block 1x16 round nearest rht none from fprop.activation" in (
        text
    )
    assert "wgrad.gradient   : mxfp4 block 1x32 round nearest rht none from dgrad.gradient" in (
        text
    )
    assert "from" not in print_recipe(parse_recipe(recipe_text()))
    assert parse_recipe(text) == r


@pytest.mark.parametrize(
    ("line", "where", "message"),
    [
        (
            "fprop.activation : from wgrad.activation",
            "4:24",
            "fprop.activation cannot be quantized from wgrad.activation",
        ),
        (
            "wgrad.activation : from fprop.weight",
            "4:24",
            "wgrad.activation cannot be quantized from fprop.weight",
        ),
        ("activation : from fprop.activation", "4:18", "fprop.activation cannot be quantized"),
        ("wgrad.activation : from fprop.actvation", "4:29", "'from fprop.actvation' names no"),
        ("wgrad.activation : from wgrad.weight", "4:29", "'from wgrad.weight' names no"),
        (
            "wgrad.activation : from fprop.activation from none",
            "4:46",
            "'from' given twice in one statement",
        ),
    ],
)
def test_errors_at_line_and_column(line: str, where: str, message: str) -> None:
    with pytest.raises(RecipeError, match=message) as err:
        parse_recipe(recipe_text(line))
    first_line = str(err.value).splitlines()[0]
    assert first_line.startswith(f"<recipe>:{where}: ")
    assert message in first_line


def test_from_is_a_reserved_format_name() -> None:
    with pytest.raises(RecipeError, match="'from' is a keyword") as err:
        parse_recipe("recipe t\nformat from = nvfp4\n")
    assert "<recipe>:2:8:" in str(err.value)


def test_show_and_describe_name_the_source() -> None:
    from fp4gen import describe
    from fp4gen.cli import show_text

    r = parse_recipe(recipe_text("wgrad.gradient : from dgrad.gradient"))
    assert "nvfp4 from dgrad.gradient" in show_text(r, with_plan=False)
    assert describe.operand_json(r.operands.wgrad_gradient)["source"] == "dgrad.gradient"
    assert "source" not in describe.operand_json(r.operands.dgrad_gradient)


# --- runtime -------------------------------------------------------------------------------------

# 1x1 blocks with power-of-two scales: a value already on the grid quantizes to itself along
# either axis, so the wgrad copy of the dequantized fprop copy must hold the very same values
SR_1X1 = "recipe t\nformat f = mxfp4 block 1x1\noperands {\n    * : f round stochastic\n"


def _layer(text: str) -> fp4gen.nn.Linear:
    torch.manual_seed(1)
    return fp4gen.nn.Linear(64, 48, recipe=parse_recipe(text), seed=3, name="layer")


def test_wgrad_activation_copy_holds_the_fprop_copy_values_bit_for_bit() -> None:
    torch.manual_seed(2)
    x = torch.randn(32, 64)
    layer = _layer(SR_1X1 + "    wgrad.activation : from fprop.activation\n}\n")
    table = layer.operands
    fprop = layer.fprop_input(x, table, 0).dequantize()
    wgrad = layer.wgrad_activation(x, table, 0).dequantize()
    assert torch.equal(wgrad, fprop.t())
    # without the source the wgrad copy rounds x with its own random stream: other values
    plain = _layer(SR_1X1 + "}\n")
    own = plain.wgrad_activation(x, plain.operands, 0).dequantize()
    assert not torch.equal(own, fprop.t())


def _grads(layer: fp4gen.nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> tuple:
    x = x.clone().requires_grad_(True)
    layer(x).backward(dy)
    return x.grad, layer.weight.grad


def _q(t: torch.Tensor):
    return quantize(t.contiguous(), "nvfp4", rounding="nearest")


def test_dw_equals_a_hand_computation_from_the_dequantized_fprop_copy() -> None:
    torch.manual_seed(2)
    x, dy = torch.randn(32, 64), torch.randn(32, 48)
    layer = _layer(recipe_text("wgrad.activation : from fprop.activation"))
    _, dw = _grads(layer, x, dy)
    x_fprop = _q(x).dequantize()  # exact in fp32
    dw_ref = gemm_reference(_q(dy.t()), _q(x_fprop.t()))
    assert torch.equal(dw, dw_ref)
    assert not torch.equal(dw, gemm_reference(_q(dy.t()), _q(x.t())))


def test_dx_and_dw_from_the_dgrad_weight_and_gradient_copies() -> None:
    torch.manual_seed(2)
    x, dy = torch.randn(32, 64), torch.randn(32, 48)
    layer = _layer(
        recipe_text("dgrad.weight : from fprop.weight", "wgrad.gradient : from dgrad.gradient")
    )
    w = layer.weight.detach().clone()
    dx, dw = _grads(layer, x, dy)
    w_fprop = _q(w).dequantize()
    assert torch.equal(dx, gemm_reference(_q(dy), _q(w_fprop.t())))
    assert not torch.equal(dx, gemm_reference(_q(dy), _q(w.t())))
    dy_dgrad = _q(dy).dequantize()
    assert torch.equal(dw, gemm_reference(_q(dy_dgrad.t()), _q(x.t())))
    assert not torch.equal(dw, gemm_reference(_q(dy.t()), _q(x.t())))
