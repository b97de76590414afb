"""fp4gen.nn.Linear takes any token count and any feature size (docs/numerics.md, section 3,
"Padding K in fp4gen.nn.Linear"): the wgrad operands are zero-padded along the tokens to a
multiple of lcm(block length, RHT size), an fprop or dgrad K to its RHT size, and the results
equal a reference that pads explicitly, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fp4gen
from fp4gen.dsl import load_recipe, parse_recipe
from fp4gen.dsl.model import Operand
from fp4gen.numerics import QuantizedTensor, quantize
from fp4gen.runtime import linear as linear_module
from fp4gen.runtime import operands as operands_module

NO_SR = load_recipe("nvfp4_no_sr.fp4r")  # RHT 16 on both wgrad operands, round to nearest
NVFP4 = load_recipe("nvfp4.fp4r")  # the same with stochastic rounding on the gradients
MXFP4 = load_recipe("mxfp4.fp4r")  # RHT 32, 1x32 blocks, stochastic rounding
# an RHT on every GEMM: fprop's K (in_features) and dgrad's (out_features) need it too
RHT_ALL = parse_recipe(
    "operands {\n * : nvfp4\n gradient : round stochastic\n * : rht 16 signs te\n}\n"
)


def fake_quant_matmul(a: QuantizedTensor, b: QuantizedTensor) -> torch.Tensor:
    """A @ B^T from the GEMM definition (numerics.md section 6): float64 sum, one rounding."""
    va, vb = a.dequantize_blockwise().double(), b.dequantize_blockwise().double()
    return ((va @ vb.t()) * (a.global_scale.double() * b.global_scale.double())).float()


def pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def make_layer(recipe, in_f: int = 32, out_f: int = 32, seed: int = 0) -> fp4gen.nn.Linear:
    torch.manual_seed(1)
    return fp4gen.nn.Linear(in_f, out_f, recipe=recipe, seed=seed, name="layer")


def run_layer(layer, x: torch.Tensor, dy: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def data(tokens: int, in_f: int = 32, out_f: int = 32, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, in_f, generator=g), torch.randn(tokens, out_f, generator=g)


def reference(recipe, x, w, b, dy):
    """y, dx, dW, db of a Linear with the recipe's operands, quantized with fp4gen.quantize
    after padding explicitly: tokens to lcm(block length, RHT size) of the wgrad operands,
    fprop's K and dgrad's K to their RHT size. 2D weights with one spec for fprop and dgrad
    give the dgrad weight as the transposed fprop codes (numerics.md section 3)."""
    t = recipe.operands

    def q(v: torch.Tensor, spec) -> QuantizedTensor:
        return quantize(v, spec.format, rounding=spec.rounding, hadamard=spec.rht)

    def unit(spec, blocks: bool) -> int:
        rht = spec.rht.size if spec.rht else 1
        return math.lcm(spec.format.block_len, rht) if blocks else rht

    tokens, in_f = x.shape
    out_f = w.shape[0]
    tp = round_up(tokens, math.lcm(unit(t.wgrad_gradient, True), unit(t.wgrad_activation, True)))
    kf = round_up(in_f, math.lcm(unit(t.fprop_activation, False), unit(t.fprop_weight, False)))
    kd = round_up(out_f, math.lcm(unit(t.dgrad_gradient, False), unit(t.dgrad_weight, False)))
    xq, wq = q(pad(x, tokens, kf), t.fprop_activation), q(pad(w, out_f, kf), t.fprop_weight)
    y = fake_quant_matmul(xq, wq)
    dy_p = pad(dy, tp, kd)
    if t.fprop_weight == t.dgrad_weight and t.dgrad_weight.format.is_2d:
        w_col = q(w, t.fprop_weight).transpose()  # 2D weights: the same codes, transposed
    else:
        w_col = q(pad(w.t(), in_f, kd), t.dgrad_weight)
    dx = fake_quant_matmul(q(dy_p, t.dgrad_gradient), w_col)[:tokens]
    dw = fake_quant_matmul(
        q(dy_p.t().contiguous(), t.wgrad_gradient), q(pad(x, tp, in_f).t(), t.wgrad_activation)
    )[:out_f]
    return y + b, dx, dw, dy.sum(0)


@pytest.mark.parametrize("tokens", [1, 7, 257, 4111])
def test_odd_token_counts_match_the_explicit_padding_reference(tokens: int) -> None:
    layer = make_layer(NO_SR)
    x, dy = data(tokens)
    got = run_layer(layer, x, dy)
    want = reference(NO_SR, x, layer.weight.detach(), layer.bias.detach(), dy)
    for name, a, b in zip(("y", "dx", "dW", "db"), got, want, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("recipe", [NO_SR, NVFP4, MXFP4], ids=lambda r: r.name)
@pytest.mark.parametrize("tokens", [1, 7, 257])
def test_padding_inside_equals_a_padded_input(recipe, tokens: int) -> None:
    """A layer given T tokens computes what a layer given the same tokens plus zero tokens up to
    the multiple computes, bit for bit, stochastic rounding included: the padded tensors, their
    Philox streams (row * columns + column of the padded tensor) and the call offsets are the
    same."""
    multiple = 32 if recipe is MXFP4 else 16
    padded = round_up(tokens, multiple)
    x, dy = data(tokens)
    y, dx, dw, db = run_layer(make_layer(recipe, seed=5), x, dy)
    x_p, dy_p = pad(x, padded, 32), pad(dy, padded, 32)
    y_p, dx_p, dw_p, _ = run_layer(make_layer(recipe, seed=5), x_p, dy_p)
    assert torch.equal(y, y_p[:tokens])
    assert torch.equal(dx, dx_p[:tokens])
    assert torch.equal(dw, dw_p)
    assert torch.equal(db, dy.sum(0))
    assert torch.isfinite(dw).all() and dw.abs().sum() > 0


def test_the_issue_shape_16_sequences_of_257_tokens() -> None:
    """4112 tokens with MXFP4's wgrad RHT of size 32 (4112 = 128 * 32 + 16)."""
    layer = make_layer(MXFP4)
    x = torch.randn(16, 257, 32, requires_grad=True)
    layer(x).square().mean().backward()
    assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()
    assert layer.weight.grad.shape == (32, 32) and torch.isfinite(layer.weight.grad).all()


@pytest.mark.parametrize("tokens", [16, 32, 256])
def test_no_padding_needed_makes_no_copy_and_matches_the_reference(tokens, monkeypatch) -> None:
    copies: list[tuple[int, ...]] = []
    real = operands_module.pad_to

    def spy(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        out = real(t, rows, cols)
        if out is not t:
            copies.append(tuple(t.shape))
        return out

    monkeypatch.setattr(linear_module, "pad_to", spy)
    layer = make_layer(NO_SR, 64, 48)
    x, dy = data(tokens, 64, 48)
    got = run_layer(layer, x, dy)
    assert copies == []
    want = reference(NO_SR, x, layer.weight.detach(), layer.bias.detach(), dy)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("in_f", "out_f"), [(72, 32), (40, 24), (100, 100), (32, 72), (24, 40)])
@pytest.mark.parametrize("tokens", [7, 48])
def test_odd_feature_sizes_with_2d_weight_blocks(in_f: int, out_f: int, tokens: int) -> None:
    """16x16 2D weight blocks on a weight whose sides are not multiples of 16: the quantizer's
    edge blocks (numerics.md section 3); the dgrad weight is still the transposed fprop codes."""
    layer = make_layer(NO_SR, in_f, out_f)
    x, dy = data(tokens, in_f, out_f)
    got = run_layer(layer, x, dy)
    want = reference(NO_SR, x, layer.weight.detach(), layer.bias.detach(), dy)
    for name, a, b in zip(("y", "dx", "dW", "db"), got, want, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(("in_f", "out_f", "tokens"), [(40, 24, 7), (72, 100, 33), (32, 48, 16)])
def test_rht_on_fprop_and_dgrad_pads_their_k(in_f: int, out_f: int, tokens: int) -> None:
    """fprop's K (in_features) and dgrad's K (out_features) padded to the RHT size 16; with SR
    on the gradients the explicit reference (fp4gen.quantize with seed 0, offset 0 for every
    operand) differs in its Philox streams, so the gradients are compared with RNE and only
    shapes and finiteness with SR."""
    rne = parse_recipe("operands {\n * : nvfp4\n * : rht 16 signs te\n}\n")
    layer = make_layer(rne, in_f, out_f)
    x, dy = data(tokens, in_f, out_f)
    got = run_layer(layer, x, dy)
    want = reference(rne, x, layer.weight.detach(), layer.bias.detach(), dy)
    for name, a, b in zip(("y", "dx", "dW", "db"), got, want, strict=True):
        assert torch.equal(a, b), name
    y, dx, dw, _ = run_layer(make_layer(RHT_ALL, in_f, out_f), x, dy)
    assert dx.shape == (tokens, in_f) and dw.shape == (out_f, in_f)
    assert all(torch.isfinite(t).all() for t in (y, dx, dw))


def test_3d_inputs_equal_their_2d_view() -> None:
    x, dy = data(3 * 37)
    flat = run_layer(make_layer(NVFP4, seed=3), x, dy)
    batched = run_layer(make_layer(NVFP4, seed=3), x.reshape(3, 37, 32), dy.reshape(3, 37, 32))
    assert batched[0].shape == (3, 37, 32) and batched[1].shape == (3, 37, 32)
    for a, b in zip(flat, batched, strict=True):
        assert torch.equal(a, b.reshape(a.shape))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("tokens", [1, 7, 257])
def test_eval_forward_quantizes_only_the_fprop_operands(mode: str, tokens: int, monkeypatch):
    layer = make_layer(MXFP4).eval()
    x, _ = data(tokens)
    y_train = layer(x.reshape(1, tokens, 32)).detach()
    layer = make_layer(MXFP4).eval()
    seen: list[Operand] = []
    real_quantize = linear_module.Linear.quantize

    def quantize_spy(self, t, op, spec, call, **kw):
        seen.append(op)
        return real_quantize(self, t, op, spec, call, **kw)

    def pair_spy(*args, **kwargs):
        raise AssertionError("a forward pass quantized a backward operand")

    monkeypatch.setattr(linear_module.Linear, "quantize", quantize_spy)
    monkeypatch.setattr(linear_module, "quantize_operand_pair", pair_spy)
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        y = layer(x.reshape(1, tokens, 32))
    assert seen == [Operand.FPROP_ACTIVATION, Operand.FPROP_WEIGHT]
    assert not y.requires_grad and torch.equal(y, y_train)  # fprop is round to nearest


def test_mor_recipe_with_odd_tokens() -> None:
    layer = make_layer(load_recipe("mor_tensor.fp4r"))
    x, dy = data(7)
    _, dx, dw, _ = run_layer(layer, x, dy)
    assert dx.shape == (7, 32) and torch.isfinite(dw).all()


def test_telemetry_records_padded_operands() -> None:
    layer = make_layer(NVFP4)
    layer.telemetry.every = 1
    x, dy = data(7)
    run_layer(layer, x, dy)
    ops = {r["operand"] for r in layer.telemetry.records}
    assert ops == {op.selector for op in Operand}
    assert all(0 <= r["rel_error"] < 0.5 for r in layer.telemetry.records)


def test_telemetry_records_nothing_inside_a_capture_and_says_so(monkeypatch, caplog) -> None:
    """Telemetry's statistics are read on the host, which a CUDA graph capture refuses: a call
    made inside one (the capture stood in) records nothing and logs that once per layer; the
    calls outside record as before, with the same output."""
    from fp4gen.runtime import telemetry

    monkeypatch.setattr(telemetry, "_skipped", set())
    layer = make_layer(NVFP4)
    layer.telemetry.every = 1
    x, dy = data(7)
    monkeypatch.setattr(telemetry, "_captured", lambda t: True)
    with caplog.at_level("INFO", logger="fp4gen.runtime"):
        captured = run_layer(layer, x, dy)
        run_layer(layer, x, dy)
    assert layer.telemetry.records == []
    said = [r for r in caplog.records if "inside a CUDA graph capture" in r.getMessage()]
    assert len(said) == 1
    monkeypatch.setattr(telemetry, "_captured", lambda t: False)
    eager = run_layer(layer, x, dy)
    assert len(layer.telemetry.records) == len(Operand)
    assert torch.equal(captured[0], eager[0])  # y (the gradients round stochastically per call)


def test_torch_compile_with_odd_token_counts() -> None:
    layer = make_layer(NO_SR)
    x, dy = data(7)
    eager = run_layer(layer, x, dy)
    layer.weight.grad = layer.bias.grad = None
    torch._dynamo.reset()
    compiled = run_layer(torch.compile(layer, backend="aot_eager", fullgraph=True), x, dy)
    for a, b in zip(eager[:3], compiled[:3], strict=True):
        assert torch.equal(a, b)
