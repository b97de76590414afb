"""Under torch.compile each fp4gen layer quantizes its own x: the compiled ops share no
quantized copy among the layers that read one x (``fp4gen.runtime.ops``). They once did, by
the tensor's identity (object, address, version counter), and inductor broke that: it writes a
later tensor into a buffer it reuses, the same Python object at the same address, with no
version bump, so a layer was served another x's copy (a max error of 27 in the test below)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp4gen
from fp4gen.dsl.model import Operand
from fp4gen.runtime import linear


@pytest.fixture
def quantized(monkeypatch) -> list[tuple[str, Operand]]:
    """Every ``Linear.quantize`` call of the test, as (layer name, operand)."""
    calls: list[tuple[str, Operand]] = []
    real = linear.Linear.quantize

    def counting(self, t, op, *args, **kwargs):
        calls.append((self.name, op))
        return real(self, t, op, *args, **kwargs)

    monkeypatch.setattr(linear.Linear, "quantize", counting)
    return calls


def fprop_activations(calls: list[tuple[str, Operand]]) -> list[str]:
    return [name for name, op in calls if op is Operand.FPROP_ACTIVATION]


class ReusedBuffer(nn.Module):
    """b's input is written by inductor into the buffer of a's input (dead after a): the same
    tensor object, address, shape and version counter, other values. Every op is exact in
    fp32, so the compiled output is eager's bit for bit."""

    def __init__(self, recipe: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = fp4gen.nn.Linear(64, 64, recipe=recipe, name="a")
        self.b = fp4gen.nn.Linear(64, 64, recipe=recipe, name="b")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x * 2.0)
        return self.b(x * 3.0 + y[:, :1]) + y


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "nvfp4_no_sr", "mxfp8"])
def test_inductor_reusing_an_input_buffer_gives_eager_bits(quantized, recipe: str) -> None:
    """Inductor (CPU) reuses a's input buffer for b's input; b quantizes its own x and the
    compiled output equals eager's bit for bit."""
    model = ReusedBuffer(recipe)
    x = torch.randn(32, 64)
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(x)
        quantized.clear()
        got = torch.compile(model)(x)
    torch._dynamo.reset()
    assert fprop_activations(quantized) == ["a", "b"]
    assert torch.equal(got, want), float((got - want).abs().max())


def test_compiled_llama_steps_give_eager_bits(quantized) -> None:
    """A third training step of a 2-layer Llama (nvfp4_no_bf16: x's fprop operand rounded to
    nearest, the gradients stochastically), eager and compiled (aot_eager): the loss and every
    gradient bit for bit; eagerly x is quantized for fprop once per layer group (8 a step:
    q/k/v, o, gate/up, down per block), compiled once per layer (14)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=64,
    )
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        fp4gen.convert(model, "nvfp4_no_bf16", total_steps=10)
        torch._dynamo.reset()
        run = torch.compile(model, backend="aot_eager") if compiled else model
        for step in range(3):  # eager groups form after two forwards (layer_groups.SIGHTINGS)
            fp4gen.set_step(model, step)
            model.zero_grad()
            quantized.clear()
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
        fprops = len(fprop_activations(quantized))
        results.append((fprops, loss.detach(), [p.grad for p in model.parameters()]))
    torch._dynamo.reset()
    (eager_fprops, eager_loss, eager_grads), (fprops, loss, grads) = results
    assert (eager_fprops, fprops) == (8, 14)
    assert torch.equal(loss, eager_loss)
    for a, b in zip(eager_grads, grads, strict=True):
        assert torch.equal(a, b)
