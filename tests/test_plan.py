"""Lowering recipes to quantize-kernel plans (fp4gen.compiler.plan)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp4gen import describe
from fp4gen.compiler.plan import KernelPlan, plan_recipe
from fp4gen.dsl import load_recipe
from fp4gen.dsl.model import TE_SIGNS_16, Operand, RHTSpec
from fp4gen.formats import E2M1, E4M3, UE8M0, ScaleSpec
from fp4gen.spec import MoRKernelSpec, QuantKernelSpec, QuantOutput

RECIPES = Path(__file__).resolve().parent.parent / "fp4gen" / "recipes"
SHIPPED = sorted(RECIPES.glob("*.fp4r"))

RHT16 = RHTSpec(16, "fixed", TE_SIGNS_16)
NVFP4_SCALE = ScaleSpec(E4M3, "nearest")
MX_SCALE = ScaleSpec(UE8M0, "up")


def plan_of(name: str, **kw) -> KernelPlan:
    return plan_recipe(load_recipe(RECIPES / f"{name}.fp4r"), **kw)


def nvfp4_spec(block, *outputs: QuantOutput) -> QuantKernelSpec:
    return QuantKernelSpec(E2M1, block, NVFP4_SCALE, True, "bf16", outputs)


def row(rounding="nearest", rht=None) -> QuantOutput:
    return QuantOutput("rowwise", rounding, rht)


def col(rounding="nearest", rht=None) -> QuantOutput:
    return QuantOutput("columnwise", rounding, rht)


def users(plan: KernelPlan, spec: QuantKernelSpec) -> set[tuple[str, str]]:
    (k,) = [k for k in plan.kernels if k.spec == spec]
    return {(u.context, u.operand.selector) for u in k.uses}


# ----------------------------------------------------------------------------------------------
# The NVFP4 method
# ----------------------------------------------------------------------------------------------


def test_nvfp4_three_fused_kernels() -> None:
    plan = plan_of("nvfp4")
    x = nvfp4_spec((1, 16), row(), col(rht=RHT16))
    w = nvfp4_spec((16, 16), row(), col())
    dy = nvfp4_spec((1, 16), row("stochastic8"), col("stochastic8", RHT16))
    assert plan.specs == (x, w, dy)  # planning order: x, W, dy
    assert users(plan, x) == {
        ("operands", "fprop.activation"),
        ("operands", "wgrad.activation"),
    }
    assert users(plan, w) == {("operands", "fprop.weight"), ("operands", "dgrad.weight")}
    assert users(plan, dy) == {("operands", "dgrad.gradient"), ("operands", "wgrad.gradient")}
    assert [k.roles for k in plan.kernels] == [("activation",), ("weight",), ("gradient",)]
    # the names say what the kernels do
    assert x.name == "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne_col_rne_rht16"
    assert w.name == "quant_e2m1_16x16_e4m3rn_g_bf16_row_rne_col_rne"
    assert dy.name == "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8_col_sr8_rht16"


def test_nvfp4_outputs_rowwise_first_with_their_own_rounding_and_rht() -> None:
    plan = plan_of("nvfp4")
    for k in plan.kernels:
        assert [o.direction for o in k.spec.outputs] == ["rowwise", "columnwise"]
    dy = plan.kernel_for(Operand.WGRAD_GRADIENT)
    assert dy is not None
    assert dy.spec.outputs[0].rht is None and dy.spec.outputs[1].rht == RHT16
    assert {o.rounding for o in dy.spec.outputs} == {"stochastic8"}


def test_nvfp4_layer_rules_need_no_kernel_and_say_why() -> None:
    plan = plan_of("nvfp4")
    layer_skips = [s for s in plan.skipped if s.context.startswith("layers:")]
    assert [s.context for s in layer_skips] == [
        "layers: first 2 blocks : bf16",
        "layers: last 8 blocks : bf16",
        'layers: match "*lm_head" : bf16',
    ]
    for s in layer_skips:
        assert set(s.operands) == set(Operand)
        assert "bf16" in s.reason


def test_kernel_for_every_quantized_slot() -> None:
    plan = plan_of("nvfp4")
    for op in Operand:
        k = plan.kernel_for(op)
        assert k is not None
        assert op.role in k.roles
        assert op.use in {o.direction for o in k.spec.outputs}
    assert plan.kernel_for(Operand.FPROP_WEIGHT, context="no such context") is None


def test_ablations() -> None:
    # no SR: x and dy are quantized alike, so one kernel serves both tensors
    no_sr = plan_of("nvfp4_no_sr")
    shared = nvfp4_spec((1, 16), row(), col(rht=RHT16))
    assert len(no_sr.kernels) == 2
    assert no_sr.kernel_for(Operand.DGRAD_GRADIENT).spec == shared
    assert no_sr.kernel_for(Operand.FPROP_ACTIVATION).spec == shared
    assert no_sr.kernel_for(Operand.DGRAD_GRADIENT).roles == ("activation", "gradient")
    # no RHT: no output has a transform
    no_rht = plan_of("nvfp4_no_rht")
    assert all(o.rht is None for s in no_rht.specs for o in s.outputs)
    assert len(no_rht.kernels) == 3
    # 1D weights: one 1x16 kernel, both directions round to nearest, no RHT
    w1d = plan_of("nvfp4_1d_weights").kernel_for(Operand.DGRAD_WEIGHT)
    assert w1d.spec == nvfp4_spec((1, 16), row(), col())


def test_bf16_switch_schedule_adds_backward_only_kernels() -> None:
    plan = plan_of("nvfp4_bf16_switch")
    ctx = "schedule: at 82% forward : bf16"
    assert (plan.recipe, ctx) in plan.contexts()
    # after the switch: fprop slots are bf16, the backward copies still need kernels
    assert plan.kernel_for(Operand.FPROP_ACTIVATION, ctx) is None
    assert plan.kernel_for(Operand.FPROP_WEIGHT, ctx) is None
    assert plan.kernel_for(Operand.WGRAD_ACTIVATION, ctx).spec == nvfp4_spec(
        (1, 16), col(rht=RHT16)
    )
    assert plan.kernel_for(Operand.DGRAD_WEIGHT, ctx).spec == nvfp4_spec((16, 16), col())
    # the gradient is untouched by a forward switch: the same kernel as before
    dy = plan.kernel_for(Operand.DGRAD_GRADIENT, ctx)
    assert dy is plan.kernel_for(Operand.DGRAD_GRADIENT)
    assert (ctx, "wgrad.gradient") in users(plan, dy.spec)
    assert len(plan.kernels) == 5
    (skip,) = [s for s in plan.skipped if s.context == ctx]
    assert set(skip.operands) == {Operand.FPROP_ACTIVATION, Operand.FPROP_WEIGHT}
    assert "bf16" in skip.reason


# ----------------------------------------------------------------------------------------------
# Other shipped recipes
# ----------------------------------------------------------------------------------------------


def test_mxfp8_one_kernel_for_all_tensors() -> None:
    plan = plan_of("mxfp8")
    spec = QuantKernelSpec(E4M3, (1, 32), MX_SCALE, False, "bf16", (row(), col()))
    assert plan.specs == (spec,)
    (k,) = plan.kernels
    assert k.roles == ("activation", "weight", "gradient")
    assert set(k.operands) == set(Operand)
    assert plan.skipped == ()


def test_mxfp4_rht32_seeded_and_sr() -> None:
    plan = plan_of("mxfp4")
    rht32 = RHTSpec(32, "seeded", None, 0)
    spec = lambda *o: QuantKernelSpec(E2M1, (1, 32), MX_SCALE, False, "bf16", o)  # noqa: E731
    assert plan.specs == (
        spec(row(), col(rht=rht32)),
        spec(row(), col()),
        spec(row("stochastic"), col("stochastic", rht32)),
    )


def test_fp8_blockwise_2d_weights_fp32_scales() -> None:
    plan = plan_of("fp8_blockwise")
    fp32 = ScaleSpec(None, "nearest")
    act = QuantKernelSpec(E4M3, (1, 128), fp32, False, "bf16", (row(), col()))
    wgt = QuantKernelSpec(E4M3, (128, 128), fp32, False, "bf16", (row(), col()))
    assert plan.specs == (act, wgt)
    assert plan.kernel_for(Operand.WGRAD_GRADIENT).spec == act  # x and dy share it
    assert plan.kernels[0].roles == ("activation", "gradient")


@pytest.mark.parametrize("name", ["mor_tensor", "mor_subtensor_2way", "mor_subtensor_3way"])
def test_mor_recipes_plan_the_rules_kernels(name: str) -> None:
    """A MoR rule on every operand: one MoR kernel module (rule, rounding, input dtype) serves
    all six slots; nothing is skipped."""
    recipe = load_recipe(RECIPES / f"{name}.fp4r")
    plan = plan_recipe(recipe)
    (k,) = plan.kernels
    assert k.spec == MoRKernelSpec(recipe.mors[0], "nearest", "bf16")
    assert set(k.operands) == set(Operand)
    assert plan.skipped == ()
    assert k.spec.name.startswith("mor_")
    assert f"MoR rule {recipe.mors[0].name}" in describe.plan_text(plan)
    entry = plan.to_json()["kernels"][0]["spec"]
    assert entry["kind"] == "mor" and entry["candidates"][-1] == "bf16"
    # fp32 inputs: another module
    assert plan_recipe(recipe, input_dtype="fp32").kernels[0].spec.input_dtype == "fp32"


def test_mor_operand_with_an_rht_runs_the_reference(tmp_path: Path) -> None:
    text = (RECIPES / "mor_tensor.fp4r").read_text()
    rht = "\n    wgrad.activation : rht 16\n    wgrad.gradient : rht 16"
    text = text.replace("* : mor tensor_e4m3", "* : mor tensor_e4m3" + rht)
    path = tmp_path / "mor_rht.fp4r"
    path.write_text(text)
    plan = plan_recipe(load_recipe(path))
    (k,) = plan.kernels
    assert set(k.operands) == set(Operand) - {Operand.WGRAD_GRADIENT, Operand.WGRAD_ACTIVATION}
    (skip,) = plan.skipped
    assert set(skip.operands) == {Operand.WGRAD_GRADIENT, Operand.WGRAD_ACTIVATION}
    assert "with an RHT" in skip.reason and "reference" in skip.reason


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_recipe_plans_consistently(path: Path) -> None:
    plan = plan_recipe(load_recipe(path))
    assert len(set(plan.specs)) == len(plan.specs)  # deduplicated
    for k in plan.kernels:
        if isinstance(k.spec, QuantKernelSpec):
            directions = {o.direction for o in k.spec.outputs}
            for use in k.uses:
                assert use.operand.use in directions
        assert all(k.spec.input_dtype == "bf16" for k in plan.kernels)
    # every slot of every context is either served by a kernel or skipped with a reason
    for recipe, context in plan.contexts():
        for op in Operand:
            served = plan.kernel_for(op, context, recipe) is not None
            skipped = any(
                op in s.operands for s in plan.skipped if (s.recipe, s.context) == (recipe, context)
            )
            assert served != skipped, (recipe, context, op)
    json.dumps(plan.to_json())  # JSON-ready
    assert plan.recipe in describe.plan_text(plan)


# ----------------------------------------------------------------------------------------------
# Parameters, layer rules with formats and recipes
# ----------------------------------------------------------------------------------------------


def test_input_dtype_parameter() -> None:
    plan = plan_of("nvfp4", input_dtype="fp32")
    assert {s.input_dtype for s in plan.specs} == {"fp32"}
    mixed = plan_of("nvfp4", input_dtype={"weight": "fp32"})
    assert mixed.kernel_for(Operand.FPROP_WEIGHT).spec.input_dtype == "fp32"
    assert mixed.kernel_for(Operand.FPROP_ACTIVATION).spec.input_dtype == "bf16"
    assert "_fp32_" in mixed.kernel_for(Operand.FPROP_WEIGHT).spec.name
    # mxfp8 shares one kernel across tensors only while their dtypes agree
    assert len(plan_of("mxfp8", input_dtype={"weight": "fp32"}).kernels) == 2
    with pytest.raises(ValueError, match="input dtype"):
        plan_of("nvfp4", input_dtype="int8")
    with pytest.raises(ValueError, match="per role"):
        plan_of("nvfp4", input_dtype={"bias": "bf16"})


def test_scale_layout_parameter() -> None:
    plan = plan_of("nvfp4", scale_layout="swizzled")
    assert {o.scale_layout for s in plan.specs for o in s.outputs} == {"swizzled"}
    assert plan.specs[0].name.endswith("_swz")
    with pytest.raises(ValueError, match="scale_layout"):
        plan_of("nvfp4", scale_layout="tiled")


def test_layer_rules_with_formats_and_recipes(tmp_path: Path) -> None:
    (tmp_path / "inner.fp4r").write_text(
        'recipe inner "inner"\noperands {\n    * : mxfp4 round nearest\n}\n'
    )
    (tmp_path / "outer.fp4r").write_text(
        'recipe outer "outer"\n'
        "operands {\n    * : nvfp4 round nearest\n}\n"
        "layers {\n"
        "    first 1 blocks : mxfp8_e4m3\n"
        '    last 1 blocks : recipe "inner.fp4r"\n'
        '    match "*head" : bf16\n'
        "}\n"
    )
    plan = plan_recipe(load_recipe(tmp_path / "outer.fp4r"))
    nv = nvfp4_spec((1, 16), row(), col())
    mx8 = QuantKernelSpec(E4M3, (1, 32), MX_SCALE, False, "bf16", (row(), col()))
    mx4 = QuantKernelSpec(E2M1, (1, 32), MX_SCALE, False, "bf16", (row(), col()))
    assert plan.specs == (nv, mx8, mx4)  # deduplicated across x, W, dy in each context
    assert {u.context for u in plan.kernels[1].uses} == {"layers: first 1 blocks : mxfp8_e4m3"}
    assert {(u.recipe, u.context) for u in plan.kernels[2].uses} == {("inner", "operands")}
    assert ("outer", 'layers: last 1 blocks : recipe "inner.fp4r"') in plan.contexts()
    reasons = {s.context: s.reason for s in plan.skipped}
    assert "inner" in reasons['layers: last 1 blocks : recipe "inner.fp4r"']
    assert "bf16" in reasons['layers: match "*head" : bf16']
    assert "recipe inner: " in describe.plan_text(plan)


def test_schedule_applies_to_layer_contexts_and_recipes(tmp_path: Path) -> None:
    (tmp_path / "late.fp4r").write_text(
        'recipe late "late"\noperands {\n    * : mxfp8_e4m3 round nearest\n}\n'
    )
    (tmp_path / "main.fp4r").write_text(
        'recipe main "main"\n'
        "operands {\n    * : nvfp4 round nearest\n}\n"
        "layers {\n    first 1 blocks : mxfp4\n}\n"
        "schedule {\n"
        "    at 50% backward : bf16\n"
        '    at 90% forward : recipe "late.fp4r"\n'
        "}\n"
    )
    plan = plan_recipe(load_recipe(tmp_path / "main.fp4r"))
    contexts = [c for _, c in plan.contexts()]
    half = "schedule: at 50% backward : bf16"
    late = 'schedule: at 90% forward : recipe "late.fp4r"'
    assert half in contexts
    assert f"{half}; {late}" in contexts  # cumulative, in the order written
    assert f"layers: first 1 blocks : mxfp4; {half}" in contexts
    # from 50% on only the rowwise fprop copies remain: x and W rowwise-only kernels
    k = plan.kernel_for(Operand.FPROP_ACTIVATION, half)
    assert k.spec == nvfp4_spec((1, 16), row())
    assert plan.kernel_for(Operand.DGRAD_GRADIENT, half) is None
    # from 90% on the forward pass uses the late recipe's fprop slots (and its plan is in)
    mx8_row = QuantKernelSpec(E4M3, (1, 32), MX_SCALE, False, "bf16", (row(),))
    assert plan.kernel_for(Operand.FPROP_WEIGHT, f"{half}; {late}").spec == mx8_row
    assert ("late", "operands") in plan.contexts()


def test_shared_spec_is_one_kernel_across_contexts(tmp_path: Path) -> None:
    (tmp_path / "r.fp4r").write_text(
        'recipe r "r"\n'
        "operands {\n    * : mxfp8_e4m3 round nearest\n}\n"
        "layers {\n    first 1 blocks : mxfp8_e4m3\n}\n"
    )
    plan = plan_recipe(load_recipe(tmp_path / "r.fp4r"))
    (k,) = plan.kernels
    assert len(k.uses) == 12  # six slots in two contexts
