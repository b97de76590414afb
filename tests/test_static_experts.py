"""The experts' projection with every size on the device (``fp4gen.runtime.static_experts``).

CPU: the route's device tables are the host path's (row ends, padded ends, each real row's
padded row: ``grouped.real_rows``) for drawn routings; a routing with slots of no local expert
is refused on the device; the Philox offsets are the layers'; what the projection does not
serve is named. GPU (sm_90a): the projection's output and both gradients equal the grouped
path's (``grouped.GroupedProjection``) bit for bit for the same seeds and call counts, with
empty experts; one CUDA graph, captured once, replays its forward and backward for routings of
every shape, each replay the grouped path's bits.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fp4gen
from fp4gen.dsl.model import Operand, Recipe
from fp4gen.errors import FP4GenError
from fp4gen.runtime import grouped
from fp4gen.runtime.grouped_static import device_routing
from fp4gen.runtime.grouped_tile import padded_counts
from fp4gen.runtime.operand_slots import SLOT, STREAMS_PER_CALL
from fp4gen.runtime.static_experts import (
    StaticCalls,
    backward_multiple,
    route_of,
    static_calls,
    static_projection,
    static_route,
    table_reason,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sm90_fp8 import sm90_marks  # noqa: E402
from test_grouped_static import captured, draws  # noqa: E402

# the shipped method without its high-precision blocks (a one-block model), and MXFP4's
# operands alone (its recipe keeps the last 8 blocks in BF16)
RECIPES = {
    "nvfp4": "nvfp4_no_bf16",
    "fp8_blockwise": "fp8_blockwise",
    "mxfp8": "mxfp8",
    "mxfp4": "operands {\n * : mxfp4 round nearest\n gradient : round stochastic\n"
    " wgrad : rht 32 seed 0\n}\n",
}


def on_sm90(test):
    """The markers of a test that needs an sm_90 GPU."""
    for mark in sm90_marks("the static products are built for sm_90a"):
        test = mark(test)
    return test


def test_the_route_is_the_host_paths_tables() -> None:
    """Row ends, padded ends (and first rows), each row's expert and each real row's padded
    row: the host path's values (``itertools.accumulate``, ``grouped.real_rows``) for 200 drawn
    routings with empty experts anywhere."""
    for counts, multiple, _, _ in draws(200, seed=11):
        rows = sum(counts)
        route = static_route(torch.tensor(counts, dtype=torch.int32), rows, multiple)
        pads = padded_counts(counts, multiple)
        assert route.ends.tolist() == list(itertools.accumulate(counts))
        assert route.offsets.tolist() == [0, *itertools.accumulate(counts)]
        assert route.pad_ends.tolist() == list(itertools.accumulate(pads))
        assert route.pad_offsets.tolist() == [0, *itertools.accumulate(pads)]
        experts = [e for e, c in enumerate(counts) for _ in range(c)]
        assert route.row_expert.tolist() == experts
        assert route.padded_row.tolist() == grouped.real_rows(counts, pads, "cpu").tolist()
        assert route.present.tolist() == [c > 0 for c in counts]
        assert route.ends.dtype == route.padded_row.dtype == torch.int32


def test_a_routing_with_slots_of_no_local_expert_is_refused_on_the_device() -> None:
    """``route_of``: an expert-parallel sentinel id (outside [0, E)) fails the device assert
    (on the CPU at once); a routing to local experts gives the route of its counts."""
    index = torch.tensor([[0, 2], [1, 2], [2, 0]])
    route = route_of(device_routing(index, 3, 16), 3, 6)
    assert route.groups.counts.tolist() == [2, 1, 3]
    assert route.pad_ends.tolist() == [16, 32, 48]
    with pytest.raises(RuntimeError, match="local experts only"):
        route_of(device_routing(torch.tensor([[0, 3], [1, 2], [2, 0]]), 3, 16), 3, 6)


def experts_module(
    recipe: str | Recipe, device: str = "cpu", experts: int = 6, **convert: Any
) -> torch.nn.Module:
    """A converted Mixtral experts module at sizes the static launches take (hidden 256,
    intermediate 128: whole FP8 blocks), bf16; ``recipe`` a ``RECIPES`` key, recipe text or a
    Recipe; ``convert``: more of ``fp4gen.convert``'s keywords."""
    import transformers

    from fp4gen.dsl.parser import parse_recipe

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=2,
    )
    cfg._experts_implementation = "eager"
    model = transformers.MixtralForCausalLM(cfg).to(torch.bfloat16)
    found = RECIPES.get(recipe, recipe) if isinstance(recipe, str) else recipe
    if isinstance(found, str) and "{" in found:
        found = parse_recipe(found, base_dir=None)
    fp4gen.convert(model, found, **convert)
    return model.model.layers[0].mlp.experts.to(device)


def test_the_calls_are_the_layers_offsets() -> None:
    """``static_calls``: each expert layer's data seed and call counts; an operand's offsets
    are STREAMS_PER_CALL x call + its slot, the layers' own (``operand_slots``)."""
    module = experts_module("nvfp4")
    layers = [pair[0] for pair in module.gemms]
    for i, layer in enumerate(layers):
        layer.__dict__["_forward_calls"] = 3 * i
        layer.__dict__["_backward_calls"] = 3 * i + 1
    calls = static_calls(layers, torch.device("cpu"))
    assert calls.data_seeds.tolist() == [layer.data_seed for layer in layers]
    for op in Operand:
        want = [STREAMS_PER_CALL * 3 * i + SLOT[op] for i in range(len(layers))]
        assert calls.offsets(op, forward=True).tolist() == want
        assert calls.offsets(op, forward=False).tolist() == [w + STREAMS_PER_CALL for w in want]


def test_what_the_projection_does_not_serve_is_named() -> None:
    """``table_reason``: NVFP4 (RHT, SR gradients, 2D weights), FP8 blockwise, MXFP8 and MXFP4
    are served at whole blocks; a bias, columns that would need padding, gradient copies of two
    formats, stochastically rounded weights are named; on the CPU the projection raises."""
    for recipe in RECIPES:
        table = experts_module(recipe).gemms[0][0].operands
        assert table_reason(table, 256, 256, bias=False) is None, recipe
    table = experts_module("nvfp4").gemms[0][0].operands
    assert "a bias" in table_reason(table, 256, 256, bias=True)
    assert "not multiples of 16" in table_reason(table, 264, 256, bias=False)
    mixed = "operands {\n * : nvfp4\n dgrad.gradient : mxfp8_e4m3\n}\n"
    table = experts_module(mixed).gemms[0][0].operands
    assert "differ in format" in table_reason(table, 256, 256, bias=False)
    sr_weights = "operands {\n * : mxfp8_e4m3\n fprop.weight : round stochastic\n}\n"
    table = experts_module(sr_weights).gemms[0][0].operands
    assert "fprop.weight rounds stochastically" in table_reason(table, 256, 256, bias=False)
    module = experts_module("nvfp4")
    groups = all_groups(module, 0)
    route = static_route(torch.tensor([4, 0, 4, 0, 0, 0]), 8, 16)
    calls = static_calls(groups.layers, torch.device("cpu"))
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    with pytest.raises(FP4GenError, match="CPU tensors"):
        static_projection(x, module.gate_up_proj, route, calls, groups)


def all_groups(module: torch.nn.Module, proj: int, hit: list[int] | None = None) -> Any:
    """The ``grouped.Groups`` of projection ``proj`` over the experts ``hit`` (every expert)."""
    lay = module.layout
    every = [pair[proj] for pair in module.gemms]
    hit = list(range(len(every))) if hit is None else hit
    return grouped.Groups(
        hit,
        [0] * len(hit),
        [every[e] for e in hit],
        lay.transposed,
        torch.bfloat16,
        f"experts.{lay.weights[proj]}",
        every,
    )


def grouped_path(module, proj: int, x, counts: list[int], dy) -> tuple[torch.Tensor, ...]:
    """y, dx and dW of projection ``proj`` by the grouped path (``GroupedProjection``) over the
    experts with rows (advances their call counts as a layer pass does)."""
    hit = [e for e, c in enumerate(counts) if c]
    groups = all_groups(module, proj, hit)
    groups.counts = [counts[e] for e in hit]
    x = x.detach().requires_grad_()
    w = getattr(module, module.layout.weights[proj]).detach().requires_grad_()
    y = grouped.GroupedProjection.apply(x, w, None, groups)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def static_path(module, proj: int, x, route, calls, dy) -> tuple[torch.Tensor, ...]:
    x = x.detach().requires_grad_()
    w = getattr(module, module.layout.weights[proj]).detach().requires_grad_()
    y = static_projection(x, w, route, calls, all_groups(module, proj))
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y.detach(), dx, dw


ROUTINGS = {  # rows per expert of 6: unequal with empty experts, every row in one, even
    "unequal": [37, 0, 100, 1, 0, 62],
    "one": [0, 0, 0, 200, 0, 0],
    "even": [33, 33, 34, 33, 33, 34],
}


def inputs(proj: int, counts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = sum(counts)
    k, n = (256, 256) if proj == 0 else (128, 256)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    return x, dy


def assert_equal(got, want, what: str) -> None:
    for name, a, b in zip(("y", "dx", "dW"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name)
        assert torch.equal(a, b), (what, name, (a.float() - b.float()).abs().max().item())


@on_sm90
@pytest.mark.parametrize("proj", [0, 1])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("routed", list(ROUTINGS))
def test_cuda_the_static_projection_is_the_grouped_paths(recipe, proj, routed) -> None:
    """y, dx and dW of either projection: the grouped path's bits for the same call counts,
    with empty experts (their dW zero), every row in one expert, an even split."""
    module = experts_module(recipe, "cuda")
    counts = ROUTINGS[routed]
    x, dy = inputs(proj, counts, 1)
    groups = all_groups(module, proj)
    multiple = backward_multiple(groups.layers[0].operands)
    route = static_route(torch.tensor(counts, device="cuda"), sum(counts), multiple)
    calls = static_calls(groups.layers, x.device)
    got = static_path(module, proj, x, route, calls, dy)
    want = grouped_path(module, proj, x, counts, dy)
    assert_equal(got, want, f"{recipe} {routed}")
    assert got[0].abs().sum() > 0 and got[2].abs().sum() > 0


@on_sm90
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_cuda_one_graph_replays_the_projection_for_any_routing(recipe) -> None:
    """Forward and backward of the gate/up projection captured once (the route built inside
    the graph from a device counts buffer), replayed for three routings with their own inputs
    and call counts: each replay equals the grouped path's bits for that routing."""
    module = experts_module(recipe, "cuda")
    groups = all_groups(module, 0)
    multiple = backward_multiple(groups.layers[0].operands)
    rows = 200
    counts_buf = torch.zeros(6, dtype=torch.int32, device="cuda")
    x_buf = torch.zeros(rows, 256, dtype=torch.bfloat16, device="cuda")
    dy_buf = torch.zeros(rows, 256, dtype=torch.bfloat16, device="cuda")
    start = static_calls(groups.layers, x_buf.device)
    calls = StaticCalls(start.data_seeds, start.forward.clone(), start.backward.clone())
    counts_buf.copy_(torch.tensor(ROUTINGS["even"]))
    weight = module.gate_up_proj

    def body():
        route = static_route(counts_buf, rows, multiple)
        return static_path(module, 0, x_buf, route, calls, dy_buf)

    graph, out = captured(body)  # compiled and warmed up outside the capture first
    for seed, (routed, counts) in enumerate(ROUTINGS.items()):
        x, dy = inputs(0, counts, seed + 5)
        now = static_calls(groups.layers, x.device)
        counts_buf.copy_(torch.tensor(counts))
        x_buf.copy_(x)
        dy_buf.copy_(dy)
        calls.forward.copy_(now.forward)
        calls.backward.copy_(now.backward)
        graph.replay()
        want = grouped_path(module, 0, x, counts, dy)
        assert_equal(out, want, f"{recipe} replay {routed}")
    assert weight.grad is None  # the graph's dW is its own output


def routed(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [tokens, 256] bf16, a top-2 routing over 6 experts that leaves experts 1 and 4
    without tokens, and its weights (CUDA)."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor([0, 2, 3, 5])
    index = used[torch.rand(tokens, 4, generator=g).topk(2, dim=1).indices]
    weights = torch.rand(tokens, 2, generator=g).softmax(-1)
    hidden = torch.randn(tokens, 256, generator=g)
    return hidden.to(torch.bfloat16).cuda(), index.cuda(), weights.to(torch.bfloat16).cuda()


def step(module, hidden, index, weights, dout) -> list[torch.Tensor]:
    """Output, dx, the routing weights' gradient and both weights' gradients of one step."""
    hidden = hidden.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(hidden, index, weights)
    out.backward(dout)
    return [out, hidden.grad, weights.grad, module.gate_up_proj.grad, module.down_proj.grad]


@on_sm90
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_cuda_the_static_module_step_is_the_grouped_modules(recipe) -> None:
    """``GroupedExperts.static``: a first training step (every call count 0) of a routing
    with empty experts gives the grouped module's output and gradients bit for bit; the
    static pass counts a call of every expert, routed or not."""
    grouped_module = experts_module(recipe, "cuda")
    static_module = experts_module(recipe, "cuda")
    static_module.static = True
    hidden, index, weights = routed(96, 3)
    dout = torch.randn_like(hidden)
    want = step(grouped_module, hidden, index, weights, dout)
    got = step(static_module, hidden, index, weights, dout)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), (recipe, i)
    assert [pair[0]._forward_calls for pair in static_module.gemms] == [1] * 6
    assert [pair[0]._forward_calls for pair in grouped_module.gemms] == [1, 0, 1, 1, 0, 1]


def assert_steps_as_twin(run, module, twin, seeds, label) -> None:
    """For each routing of ``seeds``: ``run`` (the module captured or compiled) takes a
    training step of ``module``, whose output and gradients equal the eager ``twin``'s step
    bit for bit."""
    for seed in seeds:
        hidden, index, weights = routed(96, seed)
        dout = torch.randn_like(hidden)
        want = step(twin, hidden, index, weights, dout)
        h, w = hidden.detach().requires_grad_(), weights.detach().requires_grad_()
        module.zero_grad(set_to_none=True)
        out = run(h, index, w)
        out.backward(dout)
        got = [out, h.grad, w.grad, module.gate_up_proj.grad, module.down_proj.grad]
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), (label, seed, i)


@on_sm90
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_cuda_a_graphed_static_module_replays_the_eager_steps(recipe) -> None:
    """The static module captured by ``torch.cuda.make_graphed_callables`` (its forward and
    backward), then run for three routings: each step's output and gradients equal an eager
    static twin's, whose device counters took the same warm-up passes (the graph's replays
    advance the counters: fresh stochastic rounding draws every step)."""
    graphed_module = experts_module(recipe, "cuda")
    twin = experts_module(recipe, "cuda")
    graphed_module.static = twin.static = True
    sample = routed(96, 0)
    dout = torch.randn_like(sample[0])
    warmups = 3
    for _ in range(warmups):  # the twin's counters follow the graph's warm-up passes
        step(twin, *sample, dout)
    args = (sample[0].detach().requires_grad_(), sample[1], sample[2].detach().requires_grad_())
    graphed = torch.cuda.make_graphed_callables(graphed_module, args, num_warmup_iters=warmups)
    assert_steps_as_twin(graphed, graphed_module, twin, (5, 6, 7), recipe)


@on_sm90
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cuda_a_compiled_static_module_steps_as_the_eager_one(backend) -> None:
    """``torch.compile`` of a static experts module: the experts' pass runs where the compiled
    graph breaks for it (``torch.compiler.disable``), so two steps (the second with other
    counts) equal an eager static twin's bit for bit."""
    compiled_module = experts_module("fp8_blockwise", "cuda")
    twin = experts_module("fp8_blockwise", "cuda")
    compiled_module.static = twin.static = True
    compiled = torch.compile(compiled_module, backend=backend)
    assert_steps_as_twin(compiled, compiled_module, twin, (3, 4), backend)


@on_sm90
def test_cuda_a_module_that_trained_grouped_captures_static() -> None:
    """A module whose first training step ran the grouped path (its outputs dropped), then
    made static and captured by ``make_graphed_callables``, replays what an eager twin with
    the same history computes (docs/moe.md: a kept output's autograd graph, not the grouped
    path, is what breaks a capture)."""
    graphed_module = experts_module("fp8_blockwise", "cuda")
    twin = experts_module("fp8_blockwise", "cuda")
    sample = routed(96, 0)
    dout = torch.randn_like(sample[0])
    for module in (graphed_module, twin):
        step(module, *sample, dout)  # a grouped step, its outputs dropped
        module.static = True
    warmups = 3
    for _ in range(warmups):
        step(twin, *sample, dout)
    args = (sample[0].detach().requires_grad_(), sample[1], sample[2].detach().requires_grad_())
    graphed = torch.cuda.make_graphed_callables(graphed_module, args, num_warmup_iters=warmups)
    assert_steps_as_twin(graphed, graphed_module, twin, (5,), "after a grouped step")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_the_benchmark_names_what_it_needs(capsys) -> None:
    """benchmarks/moe_static.py without a GPU: a usage error that says why."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import moe_static

    with pytest.raises(SystemExit) as exit_:
        moe_static.main(["--steps", "1"])
    assert exit_.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_static_module_names_what_it_does_not_serve() -> None:
    """``GroupedExperts.static`` on what it does not serve raises FP4GenError with the reason,
    never runs another path: CPU tensors; a recipe that keeps every operand in the tensors'
    dtype; sliced experts (Llama 4)."""
    from test_moe import build, experts_of

    module = experts_module("nvfp4")
    module.static = True
    hidden, index = torch.randn(8, 256, dtype=torch.bfloat16), torch.randint(0, 6, (8, 2))
    with pytest.raises(FP4GenError, match="static = True is not served: CPU tensors"):
        module(hidden, index, torch.rand(8, 2, dtype=torch.bfloat16))
    keep = experts_module("operands {\n * : bf16\n}\n")
    keep.static = True
    assert keep.static_reason(hidden) == "the recipe keeps every operand in high precision"
    sliced = experts_of(fp4gen.convert(build("llama4"), "nvfp4_no_bf16"))
    sliced.static = True
    with pytest.raises(FP4GenError, match="sliced experts"):
        sliced(torch.randn(4 * 3, 64))
