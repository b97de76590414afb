"""The compiled backward's wgrad copy of x (``ops._backward_input``) from a layer graph.

Under torch.compile a layer's custom op saves x, and the first backward that reads an x
quantizes its wgrad copy Q(x^T; wgrad.activation) for the layers that share it. That copy was
quantized eagerly, its quantize passes launched from Python, while every other pass of the
compiled step ran from a layer graph; it now runs from the layer's graph too (one launch), its
pieces packed into one buffer as the eager forward's graph packs them.

On the CPU there are no layer graphs: ``FakeGraphs`` runs the graph path's function as
``LayerGraphs.run_with_meta`` does (a warm-up call, then calls into result tensors made from the
warm-up's shapes), so the packing and the hand-over to the backward are checked bit for bit; the
GPU test runs the real graphs in a compiled Llama against eager mode.
"""

from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.runtime import ops


class FakeGraphs:
    """``LayerGraphs.run_with_meta`` without CUDA graphs: the first call of a key runs ``fn``
    as it is (the warm-up), later calls run it with ``out=`` tensors shaped as the warm-up's
    results (what a capture writes into)."""

    def __init__(self) -> None:
        self.shapes: dict = {}
        self.keys: list = []

    def run_with_meta(self, key, fn, activations, params, *, into=False):
        self.keys.append(key)
        shapes = self.shapes.get(key)
        if shapes is None:
            results, meta = fn(*activations, *params)
            self.shapes[key] = [(r.shape, r.dtype) for r in results]
            return tuple(results), meta
        out = tuple(torch.empty(s, dtype=d) for s, d in shapes)
        results, meta = fn(*activations, *params, out=out)
        for r, o in zip(results, out, strict=True):
            assert r is o  # the pieces were packed into the given buffer: no copy needed
        return tuple(results), meta


def quantized_parts(q) -> list[torch.Tensor]:
    tensors, _ = q.split()
    return [t for t in tensors if t is not None]


@pytest.mark.parametrize("recipe", ["nvfp4_no_bf16", "mxfp4_small", "fp8_blockwise"])
@pytest.mark.parametrize("tokens", [32, 19])  # 19: padded to the wgrad GEMM's K multiple
def test_a_graphed_wgrad_copy_holds_the_eager_bits(recipe: str, tokens: int, monkeypatch) -> None:
    """The copy from the graph path, warm-up and replay alike, is one packed buffer whose
    pieces are the eager copy's bits."""
    torch.manual_seed(0)
    layer = fp4gen.nn.Linear(64, 48, recipe=recipe)
    table = layer.operands
    assert layer.keeps_wgrad_input(table)
    x2 = torch.randn(tokens, 64, dtype=torch.bfloat16)
    want = quantized_parts(layer.wgrad_activation(x2, table, 0))
    fake = FakeGraphs()
    monkeypatch.setattr(layer, "_graphs_for", lambda t, table, *, forward: fake)
    for _ in range(2):  # the warm-up, then a call into result tensors
        copy = ops._wgrad_copy(layer, x2, table)
        assert copy.packing is not None and len(copy.tensors) == 1
        assert copy.dtype == torch.bfloat16
        got = quantized_parts(copy.quantized)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert [k[0] for k in fake.keys] == ["wgrad copy", "wgrad copy"]


def test_without_graphs_the_copy_is_quantized_eagerly() -> None:
    """On the CPU (no layer graphs) the copy is the eager one, unpacked."""
    layer = fp4gen.nn.Linear(64, 48, recipe="nvfp4_no_bf16")
    x2 = torch.randn(32, 64)
    copy = ops._wgrad_copy(layer, x2, layer.operands)
    assert copy.packing is None
    want = quantized_parts(layer.wgrad_activation(x2, layer.operands, 0))
    for a, b in zip(quantized_parts(copy.quantized), want, strict=True):
        assert torch.equal(a, b)


def test_a_compiled_step_with_graphed_wgrad_copies_gives_eager_gradients(monkeypatch) -> None:
    """A converted 2-block Llama compiled with aot_eager, its wgrad copies made through the
    graph path (``FakeGraphs``) and handed packed to the backward: 4 copies per block and step
    (q, k, v share one x; gate and up another), and eager mode's gradients bit for bit over
    two steps (nvfp4_no_bf16: stochastic rounding on the gradients)."""
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
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    fake = FakeGraphs()
    original = ops._wgrad_copy

    def through_graph_path(layer, x2, table):
        layer._graphs_for = lambda t, table, *, forward: fake
        try:
            return original(layer, x2, table)
        finally:
            del layer._graphs_for

    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        fp4gen.convert(model, "nvfp4_no_bf16")
        torch._dynamo.reset()
        if compiled:
            monkeypatch.setattr(ops, "_wgrad_copy", through_graph_path)
            for block in model.model.layers:
                block.compile(backend="aot_eager", fullgraph=True)
        grads = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        runs.append(grads)
    torch._dynamo.reset()
    assert len(fake.keys) == 2 * 2 * 4
    for step_a, step_b in zip(*runs, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_llama_takes_its_wgrad_copies_from_layer_graphs() -> None:
    """A converted Llama (hidden 256, 2 blocks) compiled block by block on CUDA: three steps
    compute eager mode's loss and gradients bit for bit (stochastic rounding on: the same
    streams), and from the second step on the wgrad copies come from layer graphs (4 per block:
    q, k, v share one x, gate and up another, o and down read their own)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )
    config._attn_implementation = "eager"  # matmul and softmax: no atomics in the backward
    ids = torch.randint(0, 256, (2, 128), device="cuda")
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).cuda()
        fp4gen.convert(model, "nvfp4_no_bf16")
        torch._dynamo.reset()
        if compiled:
            for block in model.model.layers:
                block.compile(backend="aot_eager", fullgraph=True)
        losses, grads = [], []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in model.parameters()])
        runs.append((losses, grads, model))
    (want_losses, want_grads, _), (got_losses, got_grads, model) = runs
    for a, b in zip(got_losses, want_losses, strict=True):
        assert torch.equal(a, b)
    for step_a, step_b in zip(got_grads, want_grads, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            assert torch.equal(a, b)
    copies = 0
    for module in model.modules():
        graphs = getattr(module, "_graphs", None) if isinstance(module, fp4gen.nn.Linear) else None
        if graphs is not None:
            copies += sum(1 for g in graphs.graphs.values() if g.key[0] == "wgrad copy")
    assert copies >= 8, copies
    torch._dynamo.reset()
