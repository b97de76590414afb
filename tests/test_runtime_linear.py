"""fp4gen.nn.Linear against a plain-torch fake-quant reference of the same recipe semantics."""

from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.dsl import load_recipe, parse_recipe
from fp4gen.errors import TensorError
from fp4gen.numerics import QuantizedTensor, quantize

NO_SR = load_recipe("nvfp4_no_sr.fp4r")
NVFP4 = load_recipe("nvfp4.fp4r")


def fake_quant_matmul(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """sum_k (q_a s_a)(q_b s_b) in float64, times both global scales, rounded once to fp32.

    Written from the GEMM definition (docs/numerics.md section 6) with plain torch ops."""
    va = a.dequantize_blockwise().double()  # q * s_b: rotated space, no global scale
    vb = b.dequantize_blockwise().double()
    return ((va @ vb.t()) * (a.global_scale.double() * b.global_scale.double())).float()


def reference_grads(recipe, x, w, b, dy):
    """y, dx, dW, db of a Linear with the recipe's operand table, without fp4gen's runtime."""
    t = recipe.operands
    q = lambda v, spec: quantize(v, spec.format, rounding=spec.rounding, hadamard=spec.rht)  # noqa: E731
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    y = fake_quant_matmul(q(x2, t.fprop_activation), q(w, t.fprop_weight)) + b
    w_col = q(w, t.fprop_weight).transpose()  # 2D weights: the same codes, transposed
    dx = fake_quant_matmul(q(dy2, t.dgrad_gradient), w_col)
    dw = fake_quant_matmul(q(dy2.t(), t.wgrad_gradient), q(x2.t(), t.wgrad_activation))
    return y, dx, dw, dy2.sum(0)


def make_layer(recipe, in_f=64, out_f=48, seed=0):
    torch.manual_seed(1)
    return fp4gen.nn.Linear(in_f, out_f, recipe=recipe, seed=seed, name="layer")


def run_layer(layer, x, dy):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def test_grads_bit_exact_with_sr_off() -> None:
    layer = make_layer(NO_SR)
    torch.manual_seed(2)
    x, dy = torch.randn(2, 16, 64), torch.randn(2, 16, 48)
    y, dx, dw, db = run_layer(layer, x, dy)
    y_ref, dx_ref, dw_ref, db_ref = reference_grads(
        NO_SR, x, layer.weight.detach(), layer.bias.detach(), dy
    )
    assert torch.equal(y.reshape(-1, 48), y_ref)
    assert torch.equal(dx.reshape(-1, 64), dx_ref)
    assert torch.equal(dw, dw_ref)
    assert torch.equal(db, db_ref)


def test_sr_grads_reproducible_and_seed_dependent() -> None:
    torch.manual_seed(3)
    x, dy = torch.randn(32, 64), torch.randn(32, 48)
    a = run_layer(make_layer(NVFP4, seed=7), x, dy)
    b = run_layer(make_layer(NVFP4, seed=7), x, dy)
    c = run_layer(make_layer(NVFP4, seed=8), x, dy)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert not torch.equal(a[2], c[2])  # another seed draws other rounding bits


def test_sr_grads_unbiased() -> None:
    """E[dW] over SR draws is the exact dW. MXFP4's round-up power-of-two scales never saturate
    and e_b * s_b == 1 exactly, so with SR on the gradient only (and bf16 for x),
    E[dW] = dy^T x_bf16 exactly. Tolerance: every entry of the mean of 64 draws within 6 standard
    errors (a Bonferroni-style bound over the 3072 entries; the seeds are fixed, so the test is
    deterministic)."""
    recipe = parse_recipe("operands {\n * : bf16\n wgrad.gradient : mxfp4 round stochastic\n}\n")
    torch.manual_seed(4)
    x, dy = torch.randn(32, 64), torch.randn(32, 48)
    draws = torch.stack([run_layer(make_layer(recipe, seed=s), x, dy)[2] for s in range(64)])
    exact = dy.t().double() @ x.bfloat16().double()
    mean, sem = draws.double().mean(0), draws.double().std(0) / 8
    z = (mean - exact).abs() / sem.clamp_min(1e-12)
    assert float(z.max()) < 6.0
    assert float(draws.std(0).mean()) > 0  # each draw really is stochastic


def test_2d_weight_dgrad_is_the_transpose_of_fprop_codes() -> None:
    layer = make_layer(NVFP4)
    w, table = layer.weight.detach(), layer.operands
    rowwise = layer.quantize(w, fp4gen.Operand.FPROP_WEIGHT, table.fprop_weight, 0)
    columnwise = layer.columnwise_weight(w, table, 0)
    assert torch.equal(columnwise.codes, rowwise.codes.t())
    assert torch.equal(columnwise.scales, rowwise.scales.t())


def test_weight_changed_in_place_without_a_version_bump_is_requantized() -> None:
    """FSDP2 writes each all-gather into the same storage with the version counter preserved:
    a quantized weight must never outlive the values it was made from."""
    layer = make_layer(NO_SR)
    x, dy = torch.randn(16, 64), torch.randn(16, 48)
    y1, _, dw1, _ = run_layer(layer, x, dy)
    before = (layer.weight._version, layer.weight.data_ptr())
    new_w = torch.randn_like(layer.weight)
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(layer.weight):
        layer.weight.copy_(new_w)
    assert (layer.weight._version, layer.weight.data_ptr()) == before
    layer.weight.grad = None
    y2, dx2, _, _ = run_layer(layer, x, dy)
    y_ref, dx_ref, _, _ = reference_grads(NO_SR, x, new_w, layer.bias.detach(), dy)
    assert not torch.equal(y1, y2)
    assert torch.equal(y2, y_ref) and torch.equal(dx2, dx_ref)


def test_torch_jit_script_says_it_is_unsupported() -> None:
    layer = make_layer(NO_SR)
    with pytest.raises(fp4gen.FP4GenError, match="torch.jit.script is not supported"):
        torch.jit.script(torch.nn.Sequential(layer))


def test_bf16_autocast() -> None:
    layer = make_layer(NVFP4)
    x = torch.randn(16, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    assert torch.isfinite(layer.weight.grad).all()


def test_accumulation_adds_exactly_with_sr_off() -> None:
    layer = make_layer(NO_SR)
    x, dy = torch.randn(16, 64), torch.randn(16, 48)
    layer(x).backward(dy)
    g1 = layer.weight.grad.clone()
    layer(x).backward(dy)
    assert torch.equal(layer.weight.grad, g1 + g1)


def test_state_dict_compatible() -> None:
    plain = torch.nn.Linear(64, 48)
    layer = fp4gen.nn.Linear(64, 48, recipe=NVFP4)
    layer.load_state_dict(plain.state_dict())
    assert set(layer.state_dict()) == {"weight", "bias"}
    assert torch.equal(layer.weight, plain.weight)


def test_bad_inputs() -> None:
    layer = make_layer(NVFP4)
    with pytest.raises(TensorError, match="does not end in in_features=64"):
        layer(torch.randn(4, 63))
    layer(torch.randn(10, 64)).sum().backward()  # any token count: wgrad pads (test_any_shape)
    with pytest.raises(ValueError, match="exactly one of recipe= or operands="):
        fp4gen.nn.Linear(4, 4)


def test_mor_rules_must_be_given_with_an_operand_table() -> None:
    recipe = load_recipe("mor_tensor.fp4r")
    fp4gen.nn.Linear(64, 48, recipe=recipe)  # the recipe brings its rules
    with pytest.raises(fp4gen.FP4GenError, match="'tensor_e4m3', which is not among the rules"):
        fp4gen.nn.Linear(64, 48, operands=recipe.operands)
    fp4gen.nn.Linear(64, 48, operands=recipe.operands, mors=recipe.mors)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_matches_eager(backend: str) -> None:
    """The quantize + GEMM steps are custom ops with fake implementations, so the layer compiles
    with fullgraph=True and gives eager mode's bits (SR off, so calls are comparable)."""
    layer = make_layer(NO_SR)
    torch.manual_seed(5)
    x, dy = torch.randn(32, 64), torch.randn(32, 48)
    eager = run_layer(layer, x, dy)
    layer.weight.grad = layer.bias.grad = None
    torch._dynamo.reset()
    compiled = run_layer(torch.compile(layer, backend=backend, fullgraph=True), x, dy)
    for a, b in zip(eager[:3], compiled[:3], strict=True):  # y, dx, dW: inside the custom ops
        assert torch.equal(a, b)
    # db = dy.sum(0) is traced, and inductor may sum in another order: |error| <= 32 * 2^-24 *
    # sum|dy| per column (32 fp32 additions).
    bound = 32 * 2.0**-24 * dy.abs().sum(0)
    assert ((eager[3] - compiled[3]).abs() <= bound).all()


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    """The recomputed forward quantizes the same weight and input again (round to nearest:
    the same codes), so checkpointing changes no bit of the gradients."""
    layer = make_layer(NO_SR)
    x, dy = torch.randn(16, 64), torch.randn(16, 48)
    _, dx, dw, db = run_layer(layer, x, dy)
    layer.weight.grad = layer.bias.grad = None
    xc = x.clone().requires_grad_(True)
    torch.utils.checkpoint.checkpoint(layer, xc, use_reentrant=False).backward(dy)
    assert torch.equal(xc.grad, dx)
    assert torch.equal(layer.weight.grad, dw) and torch.equal(layer.bias.grad, db)


def test_load_state_dict_takes_effect_at_once() -> None:
    layer = make_layer(NO_SR)
    x = torch.randn(16, 64)
    layer(x)
    other = torch.nn.Linear(64, 48)
    layer.load_state_dict(other.state_dict())
    y_ref, _, _, _ = reference_grads(
        NO_SR, x, other.weight.detach(), other.bias.detach(), torch.zeros(16, 48)
    )
    assert torch.equal(layer(x).detach(), y_ref)


def test_eager_route_equals_the_custom_op_bit_for_bit() -> None:
    """Eager mode runs the layer through a plain autograd.Function (less host time); the custom
    op that torch.compile sees must give the same output and gradients bit for bit, SR on."""
    from fp4gen.runtime import ops

    torch.manual_seed(5)
    recipe = load_recipe("nvfp4_small.fp4r")  # RHT and stochastic rounding in the backward
    results = []
    for route in (ops.linear, ops.linear_forward):
        layer = fp4gen.nn.Linear(64, 48, recipe=recipe, seed=3)
        torch.manual_seed(6)
        layer.reset_parameters()
        x = torch.randn(40, 64, generator=torch.Generator().manual_seed(7), requires_grad=True)
        y = route(x, layer.weight, layer.bias, layer._op_id, torch.float32)
        y.backward(torch.randn(40, 48, generator=torch.Generator().manual_seed(8)))
        results.append((y.detach(), x.grad, layer.weight.grad, layer.bias.grad))
    for eager, op in zip(*results, strict=True):
        assert torch.equal(eager, op)


def test_schedule_keeps_one_table_object_per_phase() -> None:
    """What a layer derives from its operand table is kept by the table's identity: the active
    table must be the same object while the schedule stays in a phase, and change with it."""
    from fp4gen.runtime.schedule import TrainingClock

    clock = TrainingClock(total_steps=100)
    layer = fp4gen.nn.Linear(64, 64, recipe=load_recipe("nvfp4_bf16_switch.fp4r"), clock=clock)
    first = layer.operands
    assert layer.operands is first
    clock.step = 99  # past the switch of the forward pass to BF16
    late = layer.operands
    assert late is not first and late is layer.operands and late != first
    clock.step = 0
    assert layer.operands is first


def test_the_output_of_a_2d_input_is_not_a_view() -> None:
    """As nn.Linear's: FSDP2 warns when a sharded module returns a view."""
    layer = fp4gen.nn.Linear(64, 32, recipe=fp4gen.load_recipe("nvfp4_no_sr.fp4r"))
    y = layer(torch.randn(4, 64))
    assert y.shape == (4, 32) and not y._is_view()
    assert layer(torch.randn(2, 3, 64)).shape == (2, 3, 32)
