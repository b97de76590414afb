"""fp4gen.nn.Linear on CUDA gives the CPU reference's numbers (GEMMs up to fp32 summation order)."""

from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.dsl import load_recipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def grads(layer, x, dy):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return y.detach().double().cpu(), x.grad.double().cpu(), layer.weight.grad.double().cpu()


@pytest.mark.parametrize("recipe", ["nvfp4.fp4r", "nvfp4_no_sr.fp4r", "mxfp4.fp4r", "mxfp8.fp4r"])
def test_cuda_matches_cpu(recipe: str) -> None:
    r = load_recipe(recipe)
    torch.manual_seed(0)
    cpu = fp4gen.nn.Linear(256, 192, recipe=r, seed=3)
    gpu = fp4gen.nn.Linear(256, 192, recipe=r, seed=3, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    x, dy = torch.randn(128, 256), torch.randn(128, 192)
    for a, b, k in zip(
        grads(cpu, x, dy), grads(gpu, x.cuda(), dy.cuda()), (256, 192, 128), strict=True
    ):
        # same codes and scales (the reference quantizer is device-independent, SR included);
        # the GEMMs differ only in fp32 summation order: |err| <= K 2^-24 sum|a b| per entry,
        # bounded here through the entry's magnitude scale.
        scale = a.abs().max().clamp_min(1e-30)
        assert float((a - b).abs().max() / scale) <= k * 2.0**-24 * 8


@pytest.mark.parametrize("recipe", ["nvfp4.fp4r", "nvfp4_no_sr.fp4r", "mxfp4.fp4r"])
@pytest.mark.parametrize("tokens", [1, 7, 257, 4111])
def test_cuda_odd_token_counts_match_cpu(recipe: str, tokens: int) -> None:
    """Token counts the wgrad block and RHT do not divide are zero-padded the same way on both
    devices; the tolerance is test_cuda_matches_cpu's (fp32 summation order)."""
    r = load_recipe(recipe)
    torch.manual_seed(1)
    cpu = fp4gen.nn.Linear(128, 96, recipe=r, seed=5)
    gpu = fp4gen.nn.Linear(128, 96, recipe=r, seed=5, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    x, dy = torch.randn(tokens, 128), torch.randn(tokens, 96)
    for a, b, k in zip(
        grads(cpu, x, dy), grads(gpu, x.cuda(), dy.cuda()), (128, 96, tokens), strict=True
    ):
        scale = a.abs().max().clamp_min(1e-30)
        assert float((a - b).abs().max() / scale) <= max(k, 16) * 2.0**-24 * 8


def test_cuda_torch_compile() -> None:
    r = load_recipe("nvfp4_no_sr.fp4r")
    layer = fp4gen.nn.Linear(256, 192, recipe=r, device="cuda")
    x, dy = torch.randn(64, 256, device="cuda"), torch.randn(64, 192, device="cuda")
    eager = grads(layer, x, dy)
    layer.weight.grad = layer.bias.grad = None
    compiled = grads(torch.compile(layer, fullgraph=True), x, dy)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


def test_non_finite_inputs_propagate_or_raise(monkeypatch) -> None:
    """fp4gen.runtime.finite: by default a NaN or Inf input makes the quantized operand's global
    scale NaN (no read-back), so the GEMMs it feeds give NaN; with the "raise" mode each custom
    op reads its checks back once and raises: a NaN activation fails the forward, an Inf
    gradient the backward."""
    from fp4gen.errors import TensorError
    from fp4gen.runtime import finite

    layer = fp4gen.nn.Linear(256, 192, recipe=load_recipe("nvfp4.fp4r"), device="cuda")
    x = torch.randn(128, 256, device="cuda")
    dy = torch.randn(128, 192, device="cuda")
    bad_x = x.clone()
    bad_x[5, 7] = float("nan")
    bad_dy = dy.clone()
    bad_dy[0, 1] = float("inf")
    y = layer(bad_x)
    assert bool(torch.isnan(y).all())
    xg = x.clone().requires_grad_(True)
    layer(xg).backward(bad_dy)
    assert bool(torch.isnan(xg.grad).all()) and bool(torch.isnan(layer.weight.grad).all())
    assert bool(torch.isfinite(layer(x)).all())  # the layer itself is unharmed

    monkeypatch.setattr(finite, "_layer_mode", ["raise"])
    with pytest.raises(TensorError, match=r"1 non-finite value.*index \(5, 7\)"):
        layer(bad_x)
    y = layer(x.clone().requires_grad_(True))
    with pytest.raises(TensorError, match=r"1 non-finite value.*index \(0, 1\)"):
        y.backward(bad_dy)


def _graph_step(layer, x, dy):
    """Forward + backward captured in one CUDA graph (after a warm-up on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            layer.weight.grad = None
            layer(x).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    layer.weight.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
        y.backward(dy)
    return graph, y


def test_cuda_graph_of_a_round_to_nearest_step_equals_eager() -> None:
    r = load_recipe("nvfp4_no_sr.fp4r")
    torch.manual_seed(2)
    layer = fp4gen.nn.Linear(256, 192, recipe=r, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, 192, device="cuda", dtype=torch.bfloat16)
    y_eager = layer(x)
    y_eager.backward(dy)
    # keep no autograd graph of the eager step alive: its AccumulateGrad nodes belong to the
    # default stream, which a capture on another stream must not touch
    y_eager = y_eager.detach()
    dx_eager, dw_eager = x.grad.clone(), layer.weight.grad.clone()
    x.grad = None
    graph, y = _graph_step(layer, x, dy)
    for _ in range(2):  # every replay gives the eager step's bits
        x.grad.zero_()
        layer.weight.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, y_eager)
        assert torch.equal(x.grad, dx_eager) and torch.equal(layer.weight.grad, dw_eager)
