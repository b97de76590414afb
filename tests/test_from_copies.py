"""``from`` copies whose source rounds stochastically: the backward's copy is quantized from
the very copy the forward used (dequantized), on the CPU and on CUDA.

A backward that needs ``dgrad.weight from fprop.weight`` (or ``wgrad.activation from
fprop.activation``, where the forward does not keep x's wgrad copy) quantizes the forward operand
again and dequantizes it. With a stochastically rounded source that re-quantization must draw the
forward call's random stream. On CUDA it read the forward pass's device counter, which the forward
had already advanced to the next call: the backward's copy was derived from another rounding of
the source than the forward used, on every kernel path and on the reference backend alike, so the
GPU recipe fuzzer (default against reference, both on CUDA) could not see it; its experts test,
which compares CUDA with the CPU, found it. The source is now re-derived with the backward
pass's counter (the forward's call count where forward and backward calls alternate), and a
backward that runs out of step with its forward says so once."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from device_params import CPU_AND_CUDA

import fp4gen
import fp4gen.runtime.linear as linear
from fp4gen.dsl import parse_recipe
from fp4gen.numerics.quantize import QuantizedTensor
from fp4gen.numerics.quantize import quantize as reference_quantize
from fp4gen.runtime.layer_quantize import _dequantized
from fp4gen.settings import LAYER_GRAPHS_VAR

# the sources (fprop operands) round stochastically; the derived copies round to nearest, so
# each derived copy is a function of the source copy alone
RECIPE = """
operands {
    *                : nvfp4 round stochastic
    dgrad.gradient   : round nearest
    wgrad.gradient   : round nearest
    dgrad.weight     : nvfp4 round nearest from fprop.weight
    wgrad.activation : nvfp4 round nearest from fprop.activation
}
"""
IN, OUT, TOKENS = 64, 48, 32  # whole 1x16 blocks: no padding

DEVICES = CPU_AND_CUDA


def recorded_gemms(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, Any]]:
    """Every quantized GEMM's (A, B), in call order (fprop, dgrad, wgrad per step)."""
    calls: list[tuple[Any, Any]] = []
    real = linear.gemm

    def recording(a: Any, b: Any, **kw: Any) -> torch.Tensor:
        if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
            calls.append((a, b))
        return real(a, b, **kw)

    monkeypatch.setattr(linear, "gemm", recording)
    return calls


def same(q: QuantizedTensor, want: QuantizedTensor) -> bool:
    return all(
        torch.equal(a.cpu(), b.cpu()) for a, b in ((q.codes, want.codes), (q.scales, want.scales))
    ) and torch.equal(q.global_scale.float().cpu(), want.global_scale.float().cpu())


def nearest(values: torch.Tensor) -> QuantizedTensor:
    return reference_quantize(values.cpu().contiguous(), "nvfp4", rounding="nearest")


@pytest.mark.parametrize("kept", [True, False], ids=["x-copy-kept", "x-copy-in-backward"])
@pytest.mark.parametrize("device", DEVICES)
def test_derived_copies_come_from_the_forwards_copy(
    device: str, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LAYER_GRAPHS_VAR, "0")  # every GEMM called from Python, recorded
    layer = make_layer(device, kept)
    calls = recorded_gemms(monkeypatch)
    for x, dy in batches(device):
        layer(x).backward(dy)
    assert len(calls) == 3 * STEPS
    for step in range(STEPS):
        (xq, w_row), (_, w_col), (_, xq_t) = calls[3 * step : 3 * step + 3]
        assert same(w_col, nearest(_dequantized(w_row).t())), f"step {step}: dgrad.weight"
        assert same(xq_t, nearest(_dequantized(xq).t())), f"step {step}: wgrad.activation"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kept", [True, False], ids=["x-copy-kept", "x-copy-in-backward"])
def test_layer_graphs_give_the_eager_bits(kept: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replayed backward graphs re-derive the sources from the backward pass's device counter
    as the eager backward does: dx and dW bit for bit, step after step."""
    runs = []
    for graphs in (False, True):
        monkeypatch.setenv(LAYER_GRAPHS_VAR, "1" if graphs else "0")
        layer = make_layer("cuda", kept)
        got = []
        for x, dy in batches("cuda"):
            x = x.requires_grad_()
            layer(x).backward(dy)
            got.append((x.grad.clone(), layer.weight.grad.clone()))
            layer.weight.grad = None
        runs.append(got)
        if graphs:
            assert layer._graphs is not None and layer._graphs.graph_calls > 0
    for step, ((dx, dw), (want_dx, want_dw)) in enumerate(zip(runs[1], runs[0], strict=True)):
        assert torch.equal(dx, want_dx) and torch.equal(dw, want_dw), step


STEPS = 4


def make_layer(device: str, kept: bool) -> fp4gen.nn.Linear:
    torch.manual_seed(0)
    recipe = parse_recipe(RECIPE, base_dir=None)
    layer = fp4gen.nn.Linear(IN, OUT, recipe=recipe, seed=3, device=device, bias=False)
    if not kept:  # x's wgrad copy made in the backward, from the fprop copy made again
        layer.keeps_wgrad_input = lambda table: False  # type: ignore[method-assign]
    return layer


def batches(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(TOKENS, IN, generator=g).to(device),
            torch.randn(TOKENS, OUT, generator=g).to(device),
        )
        for _ in range(STEPS)
    ]


@pytest.mark.parametrize("kept", [True, False], ids=["x-copy-kept", "x-copy-in-backward"])
@pytest.mark.parametrize("device", DEVICES)
def test_an_eager_backward_after_a_no_grad_forward_uses_its_forwards_copy(
    device: str, kept: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A no_grad forward between steps (an evaluation) moves the forward count past the
    backward's. The eager backward knows its forward's call and re-derives that call's copy:
    every derived copy is still the re-quantization of the copy its forward used, and nothing
    is logged."""
    monkeypatch.setenv(LAYER_GRAPHS_VAR, "0")
    monkeypatch.setattr(linear, "_warned_out_of_step", set())
    layer = make_layer(device, kept)
    calls = recorded_gemms(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="fp4gen"):
        for x, dy in batches(device):
            with torch.no_grad():
                layer(x)  # an evaluation forward: one more forward call
            layer(x).backward(dy)
    assert not caplog.records
    assert (layer._forward_calls, layer._backward_calls) == (2 * STEPS, STEPS)
    assert len(calls) == 4 * STEPS
    for step in range(STEPS):
        _, (xq, w_row), (_, w_col), (_, xq_t) = calls[4 * step : 4 * step + 4]
        assert same(w_col, nearest(_dequantized(w_row).t())), f"step {step}: dgrad.weight"
        assert same(xq_t, nearest(_dequantized(xq).t())), f"step {step}: wgrad.activation"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_layer_graph_out_of_step_with_its_forward_is_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A replayed backward graph reads the backward pass's counter: after a no_grad forward
    its derived copies draw another call's stream, which is logged once."""
    monkeypatch.setenv(LAYER_GRAPHS_VAR, "1")
    monkeypatch.setattr(linear, "_warned_out_of_step", set())
    layer = make_layer("cuda", kept=False)
    with caplog.at_level(logging.WARNING, logger="fp4gen"):
        for step, (x, dy) in enumerate(batches("cuda")):
            if step == STEPS - 1:
                with torch.no_grad():
                    layer(x)
            layer(x).backward(dy)
    assert layer._graphs is not None and layer._graphs.graph_calls > 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "from a layer graph" in lines[0], lines


def test_a_compiled_backward_after_a_no_grad_forward_is_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Compiled, the backward op is not told its forward's call: once the forward count runs
    ahead of the backward's (a no_grad forward in between) that is logged once, nothing
    before."""
    monkeypatch.setattr(linear, "_warned_out_of_step", set())
    layer = make_layer("cpu", kept=False)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    (x, dy), *rest = batches("cpu")
    with caplog.at_level(logging.WARNING, logger="fp4gen"):
        compiled(x).backward(dy)
        assert not caplog.records
        with torch.no_grad():
            compiled(x)
        for x, dy in rest:
            compiled(x).backward(dy)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "runs after 3 forward calls" in lines[0], lines
