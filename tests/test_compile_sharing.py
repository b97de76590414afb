"""Under torch.compile the fp4gen layers that read one x share its quantized copies where the
graph proves it is one x (``fp4gen.runtime.compile_sharing``: an inductor pass merges their ops),
and nowhere else. The ops once shared by the tensor's identity at run time (object, address,
version counter), and inductor broke that: it writes a later tensor into a buffer it reuses,
the same Python object at the same address, with no version bump, so a layer was served
another x's copy (a max error of 27: ``test_inductor_reusing_an_input_buffer_gives_eager_bits``)."""

from __future__ import annotations

import operator
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fp4gen
from fp4gen.dsl.model import Operand
from fp4gen.runtime import compile_sharing, linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_compile_graph_breaks import llama  # noqa: E402  (a converted 2-block Llama)


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


def third_llama_steps(compile_model, *counted: list) -> list[tuple[tuple[list, ...], Any, list]]:
    """A third training step of a 2-block Llama (nvfp4_no_bf16: x's copies rounded to nearest,
    the gradients stochastically), eagerly, then compiled by ``compile_model(model)`` (which
    returns what to run): (the calls each of ``counted`` saw in that step, loss, gradients) of
    each."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    results = []
    for compiled in (False, True):
        model = llama("nvfp4_no_bf16")
        torch._dynamo.reset()
        run = compile_model(model) if compiled else model
        for step in range(3):  # eager groups form after two forwards (layer_groups.SIGHTINGS)
            fp4gen.set_step(model, step)
            model.zero_grad()
            for calls in counted:
                calls.clear()
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
        seen = tuple(list(calls) for calls in counted)
        results.append((seen, loss.detach(), [p.grad for p in model.parameters()]))
    torch._dynamo.reset()
    return results


def test_aot_eager_llama_steps_give_eager_bits_sharing_nothing(quantized) -> None:
    """Compiled with aot_eager (no inductor, so no sharing pass): the loss and every gradient
    are eager mode's bit for bit; eagerly x is quantized for fprop once per layer group (8 a
    step: q/k/v, o, gate/up, down per block), compiled once per layer (14)."""
    ((eager_calls,), eager_loss, eager_grads), ((calls,), loss, grads) = third_llama_steps(
        lambda model: torch.compile(model, backend="aot_eager"), quantized
    )
    assert (len(fprop_activations(eager_calls)), len(fprop_activations(calls))) == (8, 14)
    assert torch.equal(loss, eager_loss)
    for a, b in zip(eager_grads, grads, strict=True):
        assert torch.equal(a, b)


@pytest.fixture
def wgrad_copies(monkeypatch) -> list[str]:
    """The layers whose ``Linear.wgrad_activation`` (x's wgrad copy) ran, in order."""
    made: list[str] = []
    real = linear.Linear.wgrad_activation

    def counted(self, *args, **kwargs):
        made.append(self.name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(linear.Linear, "wgrad_activation", counted)
    return made


class Siblings(nn.Module):
    """a, b and c read one x (a Llama's q, k and v), o reads their outputs side by side: every
    op outside fp4gen's is exact (a concatenation), so y and dW are eager's bit for bit."""

    def __init__(self, recipe: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (
            fp4gen.nn.Linear(64, 32, recipe=recipe, seed=i, name=name)
            for i, name in enumerate("abc")
        )
        self.o = fp4gen.nn.Linear(96, 64, recipe=recipe, seed=3, name="o")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.cat([self.a(x), self.b(x), self.c(x)], -1))


def eager_and_inductor_steps(make, x: torch.Tensor, dy: torch.Tensor, record):
    """One training step of a fresh ``make()`` eagerly, then of another compiled with inductor
    (CPU; the same call counts, so stochastic rounding draws the same streams): (y, dx,
    parameter names and gradients) of each, and ``record()`` after each."""
    out = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = make()
        run = torch.compile(model) if compiled else model
        x_in = x.clone().requires_grad_(True)
        record(None)
        y = run(x_in)
        y.backward(dy)
        grads = [(n, p.grad) for n, p in model.named_parameters()]
        out.append((y.detach(), x_in.grad, grads))
        record(compiled)
    torch._dynamo.reset()
    return out


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "nvfp4_no_sr", "mxfp8", "nvfp4_small"])
def test_inductor_layers_reading_one_x_share_its_copies(quantized, wgrad_copies, recipe) -> None:
    """Compiled by inductor, a, b and c (one x) take a's fprop operand and one wgrad copy,
    where eagerly (a first step, before layer groups form) each makes its own; y and every
    weight gradient are eager's bit for bit (each GEMM's operands are the same bits;
    nvfp4_small's gradients round stochastically, from the same streams: fresh models, the
    same call counts); dx sums three layers' dx, which inductor adds in its own order: equal
    up to fp32 rounding of three terms (2 ulps of the largest)."""
    x = torch.randn(2, 16, 64)
    dy = torch.randn(2, 16, 64) * 0.01
    counts = {}

    def record(compiled):
        if compiled is None:
            quantized.clear()
            wgrad_copies.clear()
        else:
            counts[compiled] = (fprop_activations(quantized), sorted(wgrad_copies))

    (y0, dx0, g0), (y1, dx1, g1) = eager_and_inductor_steps(lambda: Siblings(recipe), x, dy, record)
    assert counts[False][0] == ["a", "b", "c", "o"]
    assert counts[True][0] == ["a", "o"]
    assert counts[True][1] == [counts[True][1][0], "o"] and counts[True][1][0] in "abc"
    assert torch.equal(y0, y1)
    for (name, a), (_, b) in zip(g0, g1, strict=True):
        if name.endswith("weight"):
            assert torch.equal(a, b), name
        else:  # a bias gradient: dy summed over the tokens by inductor, in its own order
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx1, dx0, rtol=0, atol=2 * float(dx0.abs().max()) * 2**-23)


def test_inductor_llama_blocks_share_as_eager_layer_groups(quantized, wgrad_copies) -> None:
    """A 2-block Llama compiled block by block with inductor (CPU): x quantized for fprop 8
    times a step and 8 wgrad copies, as the eager route's layer groups do (q/k/v, o, gate/up,
    down per block), not 14 each; the loss is eager's up to inductor's own fp32 arithmetic
    around the layers (norms, softmax: 1e-5 relative)."""
    pytest.importorskip("transformers")

    def per_block(model):
        for block in model.model.layers:
            block.compile()
        return model

    eager, compiled = third_llama_steps(per_block, quantized, wgrad_copies)
    (eager_calls, eager_copies), eager_loss, _ = eager
    (calls, copies), loss, _ = compiled
    assert len(fprop_activations(eager_calls)) == len(fprop_activations(calls)) == 8
    assert len(eager_copies) == len(copies) == 8
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)


def backward_graph(layers, x, dys) -> torch.fx.GraphModule:
    """dx, dW of three layers' backward ops on views of one x (each node's ``val`` meta as
    inductor's graphs carry it), where c's dy depends on a's dx (so c cannot wait for a group
    with a), and a node between a and b uses a's dx (so it must move after b's)."""
    graph = torch.fx.Graph()
    x_in = graph.placeholder("x")
    x_in.meta["val"] = x
    dy_in = []
    for i, dy in enumerate(dys):
        dy_in.append(graph.placeholder(f"dy{i}"))
        dy_in[-1].meta["val"] = dy
    weights = []
    for i, layer in enumerate(layers):
        weights.append(graph.placeholder(f"w{i}"))
        weights[-1].meta["val"] = layer.weight.detach()
    aten, fp4 = torch.ops.aten, torch.ops.fp4gen

    def node(target, *args):
        return graph.call_function(target, args)

    def view():
        v = node(aten.view.default, x_in, [-1, x.shape[-1]])
        v.meta["val"] = x.view(-1, x.shape[-1])
        return v

    a = node(fp4.linear_backward.default, dy_in[0], view(), weights[0], layers[0]._op_id)
    a.meta["val"] = (x, layers[0].weight)
    a_dx, a_dw = node(operator.getitem, a, 0), node(operator.getitem, a, 1)
    a_dx.meta["val"], a_dw.meta["val"] = x, layers[0].weight
    scaled = node(aten.mul.Tensor, a_dx, 2.0)  # uses a's result, feeds no later op
    scaled.meta["val"] = x
    b = node(fp4.linear_backward.default, dy_in[1], view(), weights[1], layers[1]._op_id)
    b.meta["val"] = (x, layers[1].weight)
    b_dx, b_dw = node(operator.getitem, b, 0), node(operator.getitem, b, 1)
    b_dx.meta["val"], b_dw.meta["val"] = x, layers[1].weight
    dy_c = node(aten.add.Tensor, dy_in[2], node(aten.sum.default, a_dx))  # depends on a
    dy_c.meta["val"] = dys[2]
    c = node(fp4.linear_backward.default, dy_c, view(), weights[2], layers[2]._op_id)
    c.meta["val"] = (x, layers[2].weight)
    c_dx, c_dw = node(operator.getitem, c, 0), node(operator.getitem, c, 1)
    outs = [scaled, a_dw, b_dx, b_dw, c_dx, c_dw]
    graph.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_the_pass_groups_backward_ops_where_no_later_input_depends_on_an_earlier_result() -> None:
    """The backward merge on a hand-made graph: a and b become one group op where b was; c,
    whose dy depends on a's dx, stays alone; the node between a and b that reads a's dx moves
    after the group; the graph is valid and computes the unmerged graph's values bit for bit."""
    torch.manual_seed(0)
    layers = [fp4gen.nn.Linear(64, 32, recipe="fp8_blockwise", seed=i) for i in range(3)]
    x = torch.randn(16, 64)
    dys = [torch.randn(16, 32) for _ in layers]
    args = (x, *dys, *(layer.weight.detach() for layer in layers))
    want = backward_graph(layers, x, dys)(*args)
    module = backward_graph(layers, x, dys)
    compile_sharing.SharingPass()(module.graph)
    module.recompile()
    targets = [n.target for n in module.graph.nodes if n.op == "call_function"]
    grouped = torch.ops.fp4gen.linear_backward_group.default
    assert targets.count(grouped) == 1
    assert targets.count(torch.ops.fp4gen.linear_backward.default) == 1  # c
    group = next(n for n in module.graph.nodes if n.target is grouped)
    assert len(group.args[2]) == 2
    order = list(module.graph.nodes)
    mul = next(n for n in order if n.target is torch.ops.aten.mul.Tensor)
    assert order.index(mul) > order.index(group)
    got = module(*args)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("lists", [True, False])
def test_the_pass_runs_after_a_pass_the_user_set(monkeypatch, lists: bool) -> None:
    """``install`` keeps a pass the user put in inductor's slot, running it first: after it in
    the list where torch takes a list of passes, else wrapping it (the graph cache keyed on
    both); once."""
    import torch._inductor.config as inductor_config
    from torch._inductor import custom_graph_pass

    seen = []

    def users_pass(graph):
        seen.append(graph)

    if lists and not hasattr(custom_graph_pass, "get_custom_graph_passes"):
        pytest.skip("this torch takes one pass in the slot, not a list")
    # torch's own config patch, not monkeypatch: the config module keeps its values outside
    # its __dict__, and a pytest whose undo deletes what it did not find there (9.2) removed the
    # setting for every later test of the process
    with inductor_config.patch(post_grad_custom_pre_pass=users_pass):
        if not lists:
            monkeypatch.delattr(custom_graph_pass, "get_custom_graph_passes", raising=False)
        compile_sharing.install()
        installed = inductor_config.post_grad_custom_pre_pass
        compile_sharing.install()  # once
        assert inductor_config.post_grad_custom_pre_pass == installed
        graph = torch.fx.Graph()
        graph.output(())
        if lists:
            assert installed[0] is users_pass and isinstance(
                installed[1], compile_sharing.SharingPass
            )
            for each in installed:
                each(graph)
        else:
            assert isinstance(installed, compile_sharing.SharingPass)
            assert installed.first == (users_pass,)
            assert installed.uuid()[1] == (repr(users_pass),)
            installed(graph)
        assert seen == [graph]


def test_inductor_sharing_with_dynamic_shapes_autocast_and_no_grad(quantized) -> None:
    """The pass under dynamic shapes (symbolic sizes in the views it compares), for token
    counts that need padding (19, 40 tokens); then no_grad (a forward graph only) and bf16
    autocast: a, b and c still quantize x once for fprop, and y is eager's bit for bit."""
    model = Siblings("fp8_blockwise")
    compiled = torch.compile(model, dynamic=True)
    torch._dynamo.reset()
    try:
        for tokens in (19, 40):
            x = torch.randn(2, tokens, 64)
            want = model(x)
            quantized.clear()
            got = compiled(x)
            assert fprop_activations(quantized) == ["a", "o"], tokens
            assert torch.equal(got, want)
        x = torch.randn(2, 16, 64)
        for context in (torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16)):
            with context:
                want = model(x)
                quantized.clear()
                got = compiled(x)
            assert fprop_activations(quantized) == ["a", "o"]
            assert got.dtype == want.dtype and torch.equal(got, want)
    finally:
        torch._dynamo.reset()
