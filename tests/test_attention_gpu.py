"""fp4gen.runtime.attention.MultiheadAttention on a GPU: a converted nn.TransformerEncoder
trains as its reference path does, and layer graphs give the eager bits.

The reference run converts the same model with ``backend="reference"`` (the torch quantize
and the float64 GEMM, on the GPU's tensors). The default run's GEMMs are checked against the
reference product of their operands (within numerics.md 6's bound, with Hopper's FP8 adder
term where the FP8 tensor cores ran) and then return it (tests/test_recipe_fuzz_gpu.py's
harness), so every quantized operand, output, gradient and trained weight must be the
reference run's bit for bit: the attention's own ops (scores, softmax, the weighted sum) are
torch's on the same device in both runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fp4gen
from fp4gen.runtime.attention import MultiheadAttention
from fp4gen.settings import LAYER_GRAPHS_VAR, LAYER_GROUPS_VAR

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_conformance import environment  # noqa: E402
from test_recipe_fuzz_gpu import TrainRun, bits, gemms_of  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

RECIPES = ["nvfp4_small", "fp8_blockwise", "mxfp8"]
WIDTH, HEADS, TOKENS, BATCH, STEPS = 256, 4, 96, 2, 3
DEVICE = "cuda"


def encoder(recipe: str, backend: str = "auto") -> nn.TransformerEncoder:
    """Three bf16 encoder layers (the last kept in bf16 by the small recipes), converted."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    model = model.to(device=DEVICE, dtype=torch.bfloat16)
    fp4gen.convert(model, recipe, total_steps=STEPS, backend=backend, seed=11)
    assert isinstance(model.layers[0].self_attn, MultiheadAttention)
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device=DEVICE).manual_seed(5)
    shape = (BATCH, TOKENS, WIDTH)
    return [
        (
            torch.randn(shape, device=DEVICE, generator=g, dtype=torch.bfloat16),
            torch.randn(shape, device=DEVICE, generator=g),
        )
        for _ in range(STEPS)
    ]


def train(model: nn.Module, run: TrainRun, mask: torch.Tensor | None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (x, target) in enumerate(batches()):
        fp4gen.set_step(model, step)
        opt.zero_grad()
        y = model(x, mask=mask)
        loss = (y.float() - target).square().mean()
        loss.backward()
        run.record_step(model, y, loss)
        opt.step()
    run.params = {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "causal"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_converted_encoder_trains_as_its_reference_path(recipe: str, masked: bool) -> None:
    mask = nn.Transformer.generate_square_subsequent_mask(TOKENS, device=DEVICE) if masked else None
    runs = {}
    for default in (False, True):
        run = TrainRun([], [], [], {})
        model = encoder(recipe, "auto" if default else "reference")
        # every GEMM through linear.gemm, where the harness checks and replaces it
        with environment(**{LAYER_GROUPS_VAR: "0", LAYER_GRAPHS_VAR: "0"}), gemms_of(default, run):
            train(model, run, mask)
        runs[default] = run
    got, want = runs[True], runs[False]
    assert len(got.operands) == len(want.operands) > 0
    for i, (g, w) in enumerate(zip(got.operands, want.operands, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True)), f"GEMM call {i}"
    worst = max(got.gemms, key=lambda c: c.ratio)
    assert worst.ratio <= 1.0, worst
    for step in range(STEPS):
        assert torch.equal(bits(got.outputs[step]), bits(want.outputs[step])), step
        for name, grad in want.grads[step].items():
            assert torch.equal(bits(got.grads[step][name]), bits(grad)), (step, name)
    for name, p in want.params.items():
        assert torch.equal(bits(got.params[name]), bits(p)), name


@pytest.mark.parametrize("recipe", ["nvfp4_small", "fp8_blockwise"])
def test_layer_graphs_give_a_converted_encoder_its_eager_bits(recipe: str) -> None:
    """The attention's projections are layers like any other: served by their graphs from the
    second step on (their in_proj reads the layer's input, out_proj the attention's output),
    with every output, gradient and trained weight the eager run's."""
    runs = {}
    for graphs in (False, True):
        run = TrainRun([], [], [], {})
        model = encoder(recipe)
        with environment(**{LAYER_GRAPHS_VAR: "1" if graphs else "0"}):
            train(model, run, None)
        runs[graphs] = (run, model)
    (got, graphed), (want, _) = runs[True], runs[False]
    for step in range(STEPS):
        assert torch.equal(bits(got.outputs[step]), bits(want.outputs[step])), step
        for name, grad in want.grads[step].items():
            assert torch.equal(bits(got.grads[step][name]), bits(grad)), (step, name)
    attn = graphed.layers[0].self_attn
    served = [p._graphs.graph_calls for p in (attn.in_proj, attn.out_proj)]
    assert all(n > 0 for n in served), served
