"""Under torch.compile the layers that read one x (a Llama's q, k and v; gate and up) share x's
fprop operand, as the eager route's layer groups do: the custom op runs each layer alone, and
the first one's Q(x; fprop.activation) serves the next ones whose operand is the same
(``Linear.shares_fprop_input``, ``fp4gen.runtime.ops.SharedCopy``), with eager mode's bits."""

from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.dsl.model import Operand
from fp4gen.runtime import linear, ops


def llama(recipe: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    fp4gen.convert(model, recipe, total_steps=10)
    return model


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


def compiled_and_eager_steps(
    quantized: list[tuple[str, Operand]], device: str
) -> tuple[tuple[int, int], tuple[int, int]]:
    """A third training step of a 2-layer Llama (nvfp4_no_bf16: x's fprop operand rounded to
    nearest, the gradients stochastically), eager and compiled (aot_eager): (fprop operands,
    all quantize calls) of each step; asserts the loss and every gradient are eager mode's bit
    for bit (no tolerance: the same operands and GEMMs)."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4)).to(device)
    results = []
    for compiled in (False, True):
        model = llama("nvfp4_no_bf16").to(device)
        torch._dynamo.reset()
        run = torch.compile(model, backend="aot_eager") if compiled else model
        for step in range(3):  # eager groups form after two forwards (layer_groups.SIGHTINGS)
            fp4gen.set_step(model, step)
            model.zero_grad()
            quantized.clear()
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
        counts = (len(fprop_activations(quantized)), len(quantized))
        results.append((counts, loss.detach(), [p.grad for p in model.parameters()]))
    (eager_counts, eager_loss, eager_grads), (counts, loss, grads) = results
    assert torch.equal(loss, eager_loss)
    for a, b in zip(eager_grads, grads, strict=True):
        assert torch.equal(a, b)
    return eager_counts, counts


def test_compiled_llama_quantizes_each_input_once_for_fprop(quantized) -> None:
    """x is quantized for fprop 8 times a step compiled, as eager does once its layer groups
    formed (q/k/v, o, gate/up, down per decoder layer), instead of 14 (one per layer); every
    quantize call of the step is eager's (the same count: 58, against 64 before)."""
    eager_counts, counts = compiled_and_eager_steps(quantized, "cpu")
    assert eager_counts[0] == 8
    assert counts == eager_counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_llama_quantizes_each_input_once_for_fprop_on_cuda(quantized, monkeypatch) -> None:
    """On CUDA (the kernels' backend), with layer graphs off (a layer's own graph quantizes x
    itself): the same counts as eager, eager's bits."""
    monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", "0")
    eager_counts, counts = compiled_and_eager_steps(quantized, "cuda")
    assert eager_counts[0] == 8
    assert counts == eager_counts


def layer_pair(recipe: str) -> tuple[fp4gen.nn.Linear, fp4gen.nn.Linear]:
    torch.manual_seed(3)
    return (
        fp4gen.nn.Linear(64, 32, recipe=recipe, seed=1, name="a"),
        fp4gen.nn.Linear(64, 48, recipe=recipe, seed=2, name="b"),
    )


def forward_op(layer: fp4gen.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.fp4gen.linear_forward(x, layer.weight, layer.bias, layer._op_id, x.dtype)


def test_the_forward_op_shares_x_until_it_changes(quantized) -> None:
    """The forward op (what torch.compile runs) quantizes x once for two layers that read it
    in a row, and again after an in-place write to x (its version counter), for another x, or
    once a backward began; each output is the one the layer computes alone (bit for bit)."""
    a, b = layer_pair("nvfp4_no_sr")
    ops._forward_copy.forget()
    x = torch.randn(2, 16, 64).view(-1, 64)
    alone = []
    for layer in (a, b):
        ops._forward_copy.forget()
        alone.append(forward_op(layer, x))
    quantized.clear()
    ops._forward_copy.forget()
    ya, yb = forward_op(a, x), forward_op(b, x)
    assert fprop_activations(quantized) == ["a"]  # b took a's operand
    assert torch.equal(ya, alone[0]) and torch.equal(yb, alone[1])

    quantized.clear()
    with torch.no_grad():
        x.mul_(2)  # in place: the version counter moves
    forward_op(b, x)
    forward_op(a, x.clone())  # another tensor with the same values
    assert fprop_activations(quantized) == ["b", "a"]

    quantized.clear()
    dy = torch.randn(32, 48)
    torch.ops.fp4gen.linear_backward(dy, x, b.weight.detach(), b._op_id)
    assert ops._forward_copy.copy is None  # a backward drops it
    forward_op(a, x)
    assert fprop_activations(quantized) == ["a"]


def test_stochastic_fprop_operands_are_not_shared(quantized) -> None:
    """A stochastically rounded fprop activation draws each layer's own stream: each layer
    quantizes x itself, as eager mode does."""
    recipe = fp4gen.parse_recipe("operands {\n    * : nvfp4 round stochastic\n}\n")
    a, b = layer_pair(recipe)
    assert not a.shares_fprop_input(a.operands, torch.empty(0))
    ops._forward_copy.forget()
    x = torch.randn(16, 64)
    forward_op(a, x)
    forward_op(b, x)
    assert fprop_activations(quantized) == ["a", "b"]
