"""fp4gen.nn.Linear's drop-in behaviour on CUDA, as on a CPU (tests/test_linear_dropin.py,
tests/test_finite.py): empty inputs give torch's results, a double backward is refused at its
first step (layer graphs warm too), non-finite inputs propagate as NaN on the kernels' path and
the reference's alike, and the "raise" mode names the tensors as the caller gave them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp4gen
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.runtime import finite

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def layer_pair(recipe: str = "nvfp4_small", backend: str = "auto"):
    """The same layer on the CPU and on CUDA."""
    torch.manual_seed(0)
    cpu = fp4gen.nn.Linear(256, 128, recipe=recipe, name="lin", backend=backend)
    gpu = fp4gen.nn.Linear(256, 128, recipe=recipe, name="lin", backend=backend, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    return cpu, gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tokens_give_torch_results_on_cuda(dtype) -> None:
    _, ours = layer_pair()
    theirs = nn.Linear(256, 128, device="cuda")
    theirs.load_state_dict(ours.state_dict())
    for layer in (ours, theirs):
        x = torch.randn(0, 256, device="cuda", dtype=dtype, requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = layer(x)
        y.sum().backward()
        assert y.shape == (0, 128)
    assert torch.equal(ours.weight.grad, theirs.weight.grad)
    assert torch.equal(ours.weight.grad, torch.zeros_like(ours.weight))
    assert torch.equal(ours.bias.grad, torch.zeros_like(ours.bias))


def test_double_backward_is_refused_on_cuda_with_layer_graphs_warm() -> None:
    _, layer = layer_pair()
    x = torch.randn(64, 256, device="cuda")
    for _ in range(3):  # the shapes seen: the passes run from layer graphs
        layer(x).square().sum().backward()
    xg = x.clone().requires_grad_(True)
    y = layer(xg)
    with pytest.raises(FP4GenError, match="lin: a backward with create_graph=True"):
        torch.autograd.grad(y.pow(2).sum(), xg, create_graph=True)
    layer.weight.grad = None
    layer(x).square().sum().backward()  # an ordinary backward still works
    assert bool(torch.isfinite(layer.weight.grad).all())


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("recipe", ["nvfp4_small", "mxfp8", "nvfp4"])
def test_non_finite_values_propagate_on_cuda_as_on_the_cpu(recipe, backend, monkeypatch) -> None:
    monkeypatch.setattr(finite, "_layer_mode", ["propagate"])
    seen = []
    for layer in layer_pair(recipe, backend):
        device = layer.weight.device
        x = torch.randn(64, 256, device=device)
        x[3, 7] = float("nan")
        x.requires_grad_(True)
        y = layer(x)
        y.backward(torch.randn_like(y))
        seen.append(
            (
                bool(torch.isnan(y).all()),
                bool(torch.isnan(layer.weight.grad).all()),
                bool(torch.isfinite(x.grad).all()),
            )
        )
        x2 = torch.randn(64, 256, device=device, requires_grad=True)
        y2 = layer(x2)
        dy = torch.randn_like(y2)
        dy[0, 1] = float("inf")
        layer.weight.grad = None
        y2.backward(dy)
        seen.append((bool(torch.isnan(x2.grad).all()), bool(torch.isnan(layer.weight.grad).all())))
    cpu_forward, cpu_backward, gpu_forward, gpu_backward = seen
    assert cpu_forward == gpu_forward == (True, True, True)
    assert cpu_backward == gpu_backward == (True, True)


def test_raise_mode_names_the_given_tensors_on_cuda(monkeypatch) -> None:
    monkeypatch.setattr(finite, "_layer_mode", ["raise"])
    _, layer = layer_pair()
    x = torch.randn(2, 32, 256, device="cuda")
    x[1, 2, 3] = float("nan")
    with pytest.raises(TensorError, match=r"^lin: the input of shape \(2, 32, 256\) .*\(1, 2, 3\)"):
        layer(x)
    y = layer(torch.randn(2, 32, 256, device="cuda", requires_grad=True))
    dy = torch.randn_like(y)
    dy[0, 5, 9] = float("-inf")
    with pytest.raises(
        TensorError,
        match=r"^lin: the gradient of its output, of shape \(2, 32, 128\) .*\(0, 5, 9\)",
    ):
        y.backward(dy)
    with torch.no_grad():
        layer.weight[4, 8] = float("inf")
    with pytest.raises(TensorError, match=r"^lin: the weight of shape \(128, 256\) .*\(4, 8\)"):
        layer(torch.randn(16, 256, device="cuda"))


def test_non_finite_values_propagate_where_the_kernels_fall_back_to_the_reference(
    monkeypatch,
) -> None:
    """in_features 72 is not a multiple of NVFP4's 16-wide blocks: x's fprop operand and the
    16x16 weight are quantized by the kernels from zero-padded copies (where a shape cannot be
    padded, the reference, which refuses a NaN, quantizes it); the layer propagates a NaN in x
    either way."""
    monkeypatch.setattr(finite, "_layer_mode", ["propagate"])
    layer = fp4gen.nn.Linear(72, 128, recipe="nvfp4_small", name="edge", device="cuda")
    x = torch.randn(64, 72, device="cuda")
    x[2, 70] = float("nan")
    x.requires_grad_(True)
    y = layer(x)
    assert bool(torch.isnan(y).all())
    y.backward(torch.randn_like(y))
    assert bool(torch.isnan(layer.weight.grad).all()) and bool(torch.isfinite(x.grad).all())
