"""CUDA graphs and fp4gen.nn.Linear: per-layer graphs (fp4gen.runtime.layer_graphs) give the
eager layer's bits, stochastic rounding draws fresh bits on every replay of a captured step, and
torch.compile(mode="reduce-overhead") runs a converted layer."""

from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.dsl import load_recipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

RNE = "nvfp4_no_sr.fp4r"
SR = "nvfp4_small.fp4r"  # stochastic rounding and a 16-point RHT on the wgrad operands


def _pair(recipe: str, shapes=((256, 192),), seed: int = 3):
    """Two identical stacks of Linears: one with layer graphs, one without (eager)."""
    r = load_recipe(recipe)
    stacks = []
    for _ in range(2):
        torch.manual_seed(0)
        layers = [
            fp4gen.nn.Linear(i, o, recipe=r, seed=seed + n, device="cuda", name=f"l{n}")
            for n, (i, o) in enumerate(shapes)
        ]
        stacks.append(torch.nn.Sequential(*layers))
    return stacks


def _step(model, x, dy):
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(dy)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def _run(model, graphs: bool, monkeypatch, batches):
    monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", "1" if graphs else "0")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    out = []
    for x, dy in batches:
        y, dx, grads = _step(model, x, dy)
        out.append((y, dx, grads))
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        opt.step()  # the weights change in place: the graphs must read them as they are now
        model.zero_grad(set_to_none=True)
    return out


def _assert_same(a, b) -> None:
    for (ya, dxa, ga), (yb, dxb, gb) in zip(a, b, strict=True):
        assert torch.equal(ya, yb) and torch.equal(dxa, dxb)
        assert all(torch.equal(p, q) for p, q in zip(ga, gb, strict=True))


@pytest.mark.parametrize("recipe", [RNE, SR])
def test_layer_graphs_give_the_eager_bits(recipe: str, monkeypatch) -> None:
    """Three layers (two of one shape, sharing static buffers), five steps with the weights
    updated in place between them, a token count that changes and comes back: every output and
    gradient equals the eager run's, stochastic rounding included (its offsets advance on the
    device), and the later steps are served by replays."""
    shapes = ((256, 192), (192, 192), (192, 192))
    graphed, eager = _pair(recipe, shapes)
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens = (128, 128, 96, 128, 128)
    batches = [
        (
            torch.randn(t, 256, device="cuda", generator=gen),
            torch.randn(t, 192, device="cuda", generator=gen),
        )
        for t in tokens
    ]
    with_graphs = _run(graphed, True, monkeypatch, batches)
    without = _run(eager, False, monkeypatch, batches)
    _assert_same(with_graphs, without)
    assert all(not layer._graphs.failed for layer in graphed), [
        layer._graphs.failed for layer in graphed
    ]
    # steps 2, 4 and 5, forward and backward: 128 tokens warm up in step 1 and 96 in step 3. A
    # step may capture instead of replaying (x met at the same address twice gets an in-place
    # graph; where the allocator puts x varies), so count every call a graph served.
    served = [layer._graphs.graph_calls for layer in graphed]
    assert served == [6, 6, 6], served
    assert all(layer._graphs is None for layer in eager)


def test_stochastic_rounding_differs_between_calls_of_a_graphed_layer(monkeypatch) -> None:
    """The same dy twice: the wgrad operands round with fresh random bits each call."""
    (model,) = _pair(SR)[:1]
    monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", "1")
    x = torch.randn(128, 256, device="cuda")
    dy = torch.randn(128, 192, device="cuda")
    dws = [_step(model, x, dy)[2][0] for _ in range(4)]
    # served by graphs: replays, or captures where x met at one address again gets an in-place
    # graph (where the allocator puts x varies; replays alone were 1 once under xdist)
    assert model[0]._graphs.graph_calls >= 2
    assert not torch.equal(dws[2], dws[3])


def _capture_step(model, x, dy):
    """Forward + backward of ``model`` captured in one CUDA graph after two eager warm-ups on a
    side stream; the gradients accumulate into .grad, zeroed before each replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(x).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    for p in model.parameters():
        p.grad.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(x).backward(dy)
    return graph


def test_a_captured_step_with_stochastic_rounding_draws_fresh_bits(monkeypatch) -> None:
    """A whole step captured in one graph: each replay equals the eager step with the same call
    count (the Philox offset is read from the layer's device counter, which the graph
    advances), and replays draw fresh, independent bits."""
    graphed, eager = _pair(SR)
    monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", "0")
    x = torch.randn(128, 256, device="cuda")
    dy = torch.randn(128, 192, device="cuda")
    graph = _capture_step(graphed, x, dy)
    expected = []
    for _ in range(2 + 3):  # the warm-ups, then one eager step per replay below
        expected.append(_step(eager, x, dy)[2][0])
    replays = []
    for _ in range(3):
        graphed[0].weight.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        replays.append(graphed[0].weight.grad.clone())
    for got, want in zip(replays, expected[2:], strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(replays[0], replays[1])
    # fresh, independent draws: the means of two sets of 16 replays differ by about a quarter
    # of what two single replays differ by (sqrt(1/8) of the noise's spread); a replay that
    # reused its bits would make the sets equal, correlated ones would not shrink
    draws = []
    for _ in range(32):
        graphed[0].weight.grad.zero_()
        graph.replay()
        draws.append(graphed[0].weight.grad.clone())
    spread = (draws[0] - draws[1]).norm()
    means = (torch.stack(draws[:16]).mean(0) - torch.stack(draws[16:]).mean(0)).norm()
    assert 0 < means < spread / 2, (float(means), float(spread))


def test_a_captured_round_to_nearest_step_equals_eager(monkeypatch) -> None:
    graphed, eager = _pair(RNE)
    monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", "0")
    x = torch.randn(128, 256, device="cuda")
    dy = torch.randn(128, 192, device="cuda")
    graph = _capture_step(graphed, x, dy)
    want = _step(eager, x, dy)[2]
    for _ in range(2):
        for p in graphed.parameters():
            p.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(p.grad, w) for p, w in zip(graphed.parameters(), want, strict=True))


def test_torch_compile_reduce_overhead_equals_eager(monkeypatch) -> None:
    graphed, eager = _pair(RNE)
    compiled = torch.compile(graphed, mode="reduce-overhead")
    x = torch.randn(128, 256, device="cuda")
    dy = torch.randn(128, 192, device="cuda")
    want = _step(eager, x, dy)
    for _ in range(4):  # warm-up, recording, then replays
        got = _step(compiled, x, dy)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        (dw, db), (want_dw, want_db) = got[2], want[2]
        assert torch.equal(dw, want_dw)  # fp4gen's ops: the same kernels, the same bits
        # the bias gradient is dy summed over the tokens, a reduction inductor compiles itself:
        # another fp32 summation order over 128 terms (a few ulps of the largest partial sum)
        torch.testing.assert_close(db, want_db, rtol=1e-5, atol=1e-5 * float(dy.abs().sum(0).max()))


def _reduce_overhead_steps_equal(model, want, x, dy) -> None:
    """Four steps of ``model`` under torch.compile(mode="reduce-overhead") (the warm-up, the
    recording, then replays): y, dx and every weight's gradient equal ``want`` (an eager
    step's) bit for bit (the bias gradient is inductor's own reduction: not compared)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead")
    names = [n for n, _ in model.named_parameters()]
    for _ in range(4):
        got = _step(compiled, x, dy)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        for name, g, w in zip(names, got[2], want[2], strict=True):
            if name.endswith("weight"):
                assert torch.equal(g, w), name
    torch._dynamo.reset()


@pytest.mark.parametrize("recipe", ["mor_tensor.fp4r", "mor_subtensor_2way.fp4r"])
def test_reduce_overhead_runs_mor_layers_between_its_graphs(monkeypatch, recipe: str) -> None:
    """A Mixture-of-Representations layer reads its values on the host to choose each block's
    format, which a capture refuses: compiled, it runs as the ops tagged cudagraph_unsafe, so
    torch.compile(mode="reduce-overhead") records its graphs around the layers and runs them
    between replays (it raised inside the recording before). Four steps give eager's y, dx and
    dW bit for bit (ReLU between the layers: exact either way), and torch's RNG still works."""
    monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", "0")
    r = load_recipe(recipe)
    stacks = []
    for _ in range(2):
        torch.manual_seed(0)
        stacks.append(
            torch.nn.Sequential(
                fp4gen.nn.Linear(256, 192, recipe=r, seed=3, device="cuda", name="a"),
                torch.nn.ReLU(),
                fp4gen.nn.Linear(192, 128, recipe=r, seed=4, device="cuda", name="b"),
            )
        )
    eager, graphed = stacks
    x = torch.randn(128, 256, device="cuda")
    dy = torch.randn(128, 128, device="cuda")
    want = _step(eager, x, dy)
    _reduce_overhead_steps_equal(graphed, want, x, dy)
    torch.rand(16, device="cuda")  # torch's generator left usable


@pytest.mark.parametrize("setting", ["check-finite-raise", "telemetry"])
def test_reduce_overhead_with_host_reading_settings(monkeypatch, caplog, setting: str) -> None:
    """Two settings read the device on the host at each op's end: FP4GEN_CHECK_FINITE=raise
    (the op's NaN/Inf flags) and telemetry (its error statistics). Inside reduce-overhead's
    recording the first propagates (warned once) and the second records nothing (logged once
    per layer), so the recording succeeds: four steps give eager's y, dx and dW bit for bit,
    and torch's RNG still works afterwards. (A read inside the capture failed it, and the
    failed capture left torch's CUDA generator in capture mode.)"""
    from fp4gen.runtime import finite, telemetry

    monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", "0")
    if setting == "check-finite-raise":
        monkeypatch.setattr(finite, "_layer_mode", ["raise"])
        monkeypatch.setattr(finite, "_logged", set())
    else:
        monkeypatch.setattr(telemetry, "_skipped", set())
    eager, graphed = _pair(RNE, ((256, 192), (192, 192)))
    if setting == "telemetry":
        for layer in (*eager, *graphed):
            layer.telemetry.every = 1
    x = torch.randn(128, 256, device="cuda")
    dy = torch.randn(128, 192, device="cuda")
    want = _step(eager, x, dy)
    with caplog.at_level("INFO", logger="fp4gen.runtime"):
        _reduce_overhead_steps_equal(graphed, want, x, dy)
    said = [r for r in caplog.records if "inside a CUDA graph capture" in r.getMessage()]
    assert len(said) == (1 if setting == "check-finite-raise" else 2), caplog.text  # per layer
    if setting == "telemetry":
        # the warm-up step ran eagerly and recorded; the recording and the replays did not
        assert all(layer.telemetry.records for layer in graphed)
    torch.rand(16, device="cuda")


class _Siblings(torch.nn.Module):
    """Three layers that read one x (a Llama's q, k and v), side by side into a fourth."""

    def __init__(self, recipe: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        r = load_recipe(recipe)
        self.a, self.b, self.c = (
            fp4gen.nn.Linear(256, 192, recipe=r, seed=7 + n, device="cuda", name=name)
            for n, name in enumerate("abc")
        )
        self.o = fp4gen.nn.Linear(576, 192, recipe=r, seed=11, device="cuda", name="o")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.cat([self.a(x), self.b(x), self.c(x)], -1))


# fp8_blockwise: o's K of 576 is not whole 1x128 blocks, so the kernels quantize x for o padded
# to 640 (cute_backend._zero_padded), inside the recorded graph too
@pytest.mark.parametrize("recipe", [RNE, "fp8_blockwise.fp4r"])
def test_reduce_overhead_shares_x_copies_inside_the_graph(monkeypatch, recipe: str) -> None:
    """Under torch.compile(mode="reduce-overhead") the layers reading one x run as one op
    (fp4gen.runtime.compile_sharing) and share x's fprop operand and wgrad copy inside the
    recorded graph: the warm-up and the recording quantize x once for fprop for a, b and c and
    once for o, and make one wgrad copy for a, b and c and one for o; the graph is recorded (no
    cudagraph skips) and every step, replays included, is eager's bit for bit in y and dW (dx
    sums three layers' dx in inductor's order: 2 ulps of the largest)."""
    from torch._dynamo.utils import counters

    from fp4gen.dsl.model import Operand
    from fp4gen.runtime import linear

    monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", "0")
    fprops: list[str] = []
    copies: list[str] = []
    quantize, wgrad = linear.Linear.quantize, linear.Linear.wgrad_activation

    def counted_quantize(self, t, op, *args, **kwargs):
        if op is Operand.FPROP_ACTIVATION:
            fprops.append(self.name)
        return quantize(self, t, op, *args, **kwargs)

    def counted_wgrad(self, *args, **kwargs):
        copies.append(self.name)
        return wgrad(self, *args, **kwargs)

    monkeypatch.setattr(linear.Linear, "quantize", counted_quantize)
    monkeypatch.setattr(linear.Linear, "wgrad_activation", counted_wgrad)
    eager, graphed = _Siblings(recipe), _Siblings(recipe)
    x = torch.randn(128, 256, device="cuda")
    dy = torch.randn(128, 192, device="cuda")
    want = _step(eager, x, dy)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(graphed, mode="reduce-overhead")
    per_step = []
    for _ in range(4):  # warm-up, recording, then replays
        fprops.clear()
        copies.clear()
        got = _step(compiled, x, dy)
        per_step.append((len(fprops), len(copies)))
        assert torch.equal(got[0], want[0])
        scale = float(want[1].abs().max())
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=2 * scale * 2**-23)
        names = [n for n, _ in graphed.named_parameters()]
        for name, g, w in zip(names, got[2], want[2], strict=True):
            if name.endswith("weight"):
                assert torch.equal(g, w), name
    torch._dynamo.reset()
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert per_step[:2] == [(2, 2), (2, 2)]  # the warm-up, the recording: shared
    assert per_step[2:] == [(0, 0), (0, 0)]  # replays: no Python


def test_graphs_capture_again_after_earlier_graphs_are_gone(monkeypatch) -> None:
    """Layers graphed, run and deleted, then new layers of other recipes graphed in the same
    process: every capture succeeds. (A buffer kept by a cache but made during a capture
    stayed in the shared pool after its graphs died, and torch's allocator then refused any
    capture into that pool; the small-M GEMM workspace did so at 128 tokens.)"""
    for recipe in (RNE, SR, RNE):
        graphed, eager = _pair(recipe, ((256, 192), (192, 192)))
        batches = [(torch.randn(128, 256, device="cuda"), torch.randn(128, 192, device="cuda"))]
        batches *= 6  # graphs on static copies from the 2nd call, on x's own address from the 3rd
        _assert_same(
            _run(graphed, True, monkeypatch, batches), _run(eager, False, monkeypatch, batches)
        )
        assert all(not layer._graphs.failed for layer in graphed), recipe
        # calls 2 to 6, forward and backward (the first warms up)
        assert [layer._graphs.graph_calls for layer in graphed] == [10, 10], recipe
        del graphed, eager
        torch.cuda.synchronize()


def test_deleted_layers_leave_no_graph_memory_behind(monkeypatch) -> None:
    """Graphed layers built, run and deleted again and again in one process (a sweep, a
    benchmark): after the first round (which makes the buffers fp4gen keeps per device and
    stream), each round leaves the allocated memory where it was, and the layer graphs' static
    buffers and pools are gone with their layers.
    (They were kept: 0.34 GiB more per model of hidden 1024 at 8192 tokens.)"""
    import gc

    from fp4gen.runtime import layer_graphs

    monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", "1")
    gc.collect()  # layers of earlier tests that are garbage already: released now
    # the graphs alive per pool before: layers an earlier test still holds may share a pool
    statics, pools = set(layer_graphs._statics), dict(layer_graphs._pool_graphs)

    def graphs_beyond_before() -> int:
        now = layer_graphs._pool_graphs
        return sum(max(0, count - pools.get(key, 0)) for key, count in now.items())

    left = []
    for _ in range(3):
        graphed, _ = _pair(RNE, ((256, 192), (192, 192)))
        batches = [(torch.randn(128, 256, device="cuda"), torch.randn(128, 192, device="cuda"))]
        _run(graphed, True, monkeypatch, batches * 6)
        assert all(layer._graphs.graph_calls == 10 for layer in graphed)
        assert graphs_beyond_before() > 0  # the layers' graphs live in a pool
        del graphed, _
        gc.collect()
        torch.cuda.synchronize()
        assert set(layer_graphs._statics) <= statics
        assert graphs_beyond_before() == 0  # and are gone with their layers
        left.append(torch.cuda.memory_allocated())
    assert left[1] == left[0] and left[2] == left[0], left


def test_graphs_follow_the_fp8_semantics_setting(monkeypatch) -> None:
    """A layer graphed under the default FP8 GEMM semantics (block-scaled) and then run under
    ``fp8_semantics("exact")`` computes the exact products, the eager layer's bits, from graphs
    of its own: the setting is part of a graph's key (a graph captured under one semantics
    replayed under the other before). Both settings' graphs capture without a failure."""
    import fp4gen.gemm_dispatch as gd

    graphed, eager = _pair("fp8_blockwise.fp4r", ((384, 256),))
    batches = [(torch.randn(128, 384, device="cuda"), torch.randn(128, 256, device="cuda"))] * 5
    _run(graphed, True, monkeypatch, batches)
    _run(eager, False, monkeypatch, batches)
    with gd.fp8_semantics("exact"):
        _assert_same(
            _run(graphed, True, monkeypatch, batches), _run(eager, False, monkeypatch, batches)
        )
    layer = graphed[0]
    assert not layer._graphs.failed and layer._graphs.replays >= 2
    semantics = {
        part[-1]
        for graph in layer._graphs.graphs.values()
        for part in graph.key
        if isinstance(part, tuple) and part and part[-1] in ("block_scaled", "exact")
    }
    assert semantics == {"block_scaled", "exact"}


@pytest.mark.parametrize(("recipe", "k"), [("fp8_blockwise.fp4r", 576), (RNE, 200)])
def test_a_shape_the_kernels_refuse_is_captured_with_the_reference(
    recipe: str, k: int, monkeypatch
) -> None:
    """A layer whose in_features the quantize kernels do not take (576: not whole 1x128 blocks;
    200: not whole 16-blocks) is quantized by the torch reference, inside its layer graphs too:
    the reference's NaN/Inf check folds into the global scale there instead of reading the
    device (a read failed the capture before), so the graphs capture and replay with the eager
    layer's bits. (test_compile_sharing's fp8 case runs the same under reduce-overhead.) The
    kernels' zero-padding, which now serves these shapes, is turned off here: the reference is
    what a shape the kernels cannot pad (a stochastic copy, an RHT not dividing K) runs on."""
    from fp4gen.runtime import cute_backend

    monkeypatch.setattr(cute_backend, "_zero_padded", lambda *args, **kwargs: None)
    graphed, eager = _pair(recipe, ((k, 192),))
    batches = [(torch.randn(128, k, device="cuda"), torch.randn(128, 192, device="cuda"))] * 5
    _assert_same(
        _run(graphed, True, monkeypatch, batches), _run(eager, False, monkeypatch, batches)
    )
    layer = graphed[0]
    assert not layer._graphs.failed and layer._graphs.replays >= 2
    torch.rand(16, device="cuda")  # torch's generator left usable


def test_a_failed_capture_leaves_torch_usable() -> None:
    """A layer graph whose capture fails (here: a host sync inside the captured work) runs
    eagerly with the right result, and afterwards torch's random numbers and later captures
    work (a capture that failed once left the default CUDA generator in capture mode: every
    later random draw, a user's dropout included, raised)."""
    from fp4gen.runtime.layer_graphs import LayerGraphs

    x = torch.randn(1024, device="cuda")

    def syncs_when_captured(t: torch.Tensor) -> tuple[torch.Tensor]:
        if torch.cuda.is_current_stream_capturing():
            t.sum().item()  # a host sync: not allowed in a capture
        return (t * 2,)

    failing = LayerGraphs("failing")
    for _ in range(3):
        (got,) = failing.run("k", syncs_when_captured, (x,), ())
        assert torch.equal(got, x * 2)
    assert failing.failed and failing.replays == 0
    torch.rand(16, device="cuda")  # raised "Offset increment outside graph capture" before
    torch.nn.functional.dropout(x, 0.5)
    working = LayerGraphs("working")
    for _ in range(3):
        (got,) = working.run("k", lambda t: (t + 1,), (x,), ())
        assert torch.equal(got, x + 1)
    assert not working.failed and working.replays == 1  # the 3rd call; the 2nd captured


def test_direct_gemm_calls_outside_a_layer_scope_run_eagerly(caplog) -> None:
    """``forward_gemm`` called directly (not through the layer's op, so outside the scope that
    propagates non-finite inputs) checks its input on the host: it runs eagerly, without a
    capture that would fail on that read (it did, logging "no layer graph"), and gives the op's
    bits; the same layer called as a module replays its graph."""
    from fp4gen.runtime import finite

    torch.manual_seed(0)
    layer = fp4gen.nn.Linear(256, 256, recipe=load_recipe(RNE), device="cuda", name="direct")
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        direct = [
            layer.forward_gemm(x, layer.weight, layer.bias, torch.float32)[0] for _ in range(3)
        ]
        assert layer._graphs is None or (not layer._graphs.failed and not layer._graphs.graphs)
        with finite.layer_scope():
            scoped = [
                layer.forward_gemm(x, layer.weight, layer.bias, torch.float32)[0] for _ in range(3)
            ]
    assert layer._graphs is not None and layer._graphs.replays == 1 and not layer._graphs.failed
    assert all(torch.equal(d, direct[0]) for d in direct + scoped)
    assert "no layer graph" not in caplog.text


def test_graphs_read_activations_in_place_where_they_met_them_twice(monkeypatch) -> None:
    """A training loop that hands a layer its activations at the same addresses every step
    (what the caching allocator does), and frees each step's results before the next, gets
    graphs that read the activations and write the results in place, with no copy in or out;
    new values at those addresses give the eager bits, and a result still held when the next
    step runs keeps its values."""
    graphed, eager = _pair(RNE, shapes=((256, 192), (192, 128)))
    x = torch.empty(256, 256, device="cuda", requires_grad=True)
    dy = torch.empty(256, 128, device="cuda")
    torch.manual_seed(1)
    held = want = None
    for step in range(10):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            dy.copy_(torch.randn_like(dy))
        got = []
        for model, graphs in ((graphed, "1"), (eager, "0")):
            monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", graphs)
            y = model(x)
            y.backward(dy)
            got.append((y.detach(), x.grad.clone(), [p.grad.clone() for p in model.parameters()]))
            x.grad = None
            model.zero_grad(set_to_none=True)
        _assert_same([got[0]], [got[1]])
        if step == 8:  # the graphed output of step 9, held through step 10
            held, want = got[0][0], got[1][0].clone()
    assert held is not None and torch.equal(held, want)
    first = graphed[0]._graphs
    # graphs on x's, dy's and the results' own addresses: met twice from the 3rd step on and
    # replayed after; where the allocator cycles through several address sets (it places the
    # eager stack's tensors in between, and other tests' blocks stay cached in a shared
    # process) a set is captured at its second meeting and replayed at its third, so fewer
    # steps replay (3 of 10 seen in a full parallel run)
    assert first is not None and first.in_place_replays >= 2, first.in_place_replays


def test_graphed_layers_reading_one_x_share_its_wgrad_copy(monkeypatch) -> None:
    """q, k and v on one x, each run from its layer graphs: the first layer's forward graph
    quantizes x's wgrad copy, the others' graphs leave it out and their backward graphs read
    that copy; every step gives the bits of eager layers that save x itself."""
    monkeypatch.setenv("FP4GEN_LAYER_GROUPS", "0")  # each layer's own graphs (not a group's)
    r = load_recipe(RNE)
    stacks = []
    for graphed in (True, False):
        torch.manual_seed(0)
        layers = [
            fp4gen.nn.Linear(256, o, recipe=r, seed=3, device="cuda", name=f"l{n}")
            for n, o in enumerate((256, 128, 128))
        ]
        for layer in layers:
            layer.keep_quantized_input = graphed
        stacks.append(layers)
    x = torch.empty(512, 256, device="cuda", requires_grad=True)
    torch.manual_seed(1)
    for step in range(6):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
        got = []
        for layers, graphs in zip(stacks, ("1", "0"), strict=True):
            monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", graphs)
            h = x * 1.0  # a non-leaf, as a norm's output would be
            ys = [layer(h) for layer in layers]
            sum((y.float() * (i + 1)).sum() for i, y in enumerate(ys)).backward()
            got.append([*(y.detach() for y in ys), x.grad, *(m.weight.grad for m in layers)])
            x.grad = None
            for m in layers:
                m.weight.grad = m.bias.grad = None
        for u, v in zip(*got, strict=True):
            assert torch.equal(u, v), step
    owns = [
        [g.key[-1] for g in m._graphs.graphs.values() if g.key[0] == "fprop"] for m in stacks[0]
    ]
    assert owns[0] and all(owns[0]), owns  # the first layer's graphs make the copy
    assert owns[1] and owns[2] and not any(owns[1] + owns[2]), owns  # the others' read it
