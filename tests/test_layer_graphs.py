"""The host-side bookkeeping of fp4gen.runtime.layer_graphs and its setting (CPU; the graphs
themselves are tested on the GPU in tests/test_layer_graphs_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from fp4gen.errors import FP4GenError
from fp4gen.runtime import layer_graphs, ops
from fp4gen.settings import check_environment, layer_graphs_enabled


def test_static_buffers_are_shared_by_shape_and_freed_with_their_last_graph() -> None:
    claims: list = []
    cpu = torch.device("cpu")
    a = layer_graphs._static("in0", torch.Size([4, 8]), torch.float32, cpu, 7, claims)
    b = layer_graphs._static("in0", torch.Size([4, 8]), torch.float32, cpu, 7, claims)
    c = layer_graphs._static("in0", torch.Size([4, 8]), torch.float32, cpu, 8, claims)
    assert a is b and a is not c  # another stream gets its own buffer
    first = layer_graphs._Graph(None, (a,), (), (claims[0],))  # type: ignore[arg-type]
    second = layer_graphs._Graph(None, (b,), (), (claims[1],))  # type: ignore[arg-type]
    third = layer_graphs._Graph(None, (c,), (), (claims[2],))  # type: ignore[arg-type]
    first.release()
    assert claims[0] in layer_graphs._statics  # the second graph still reads it
    second.release()
    third.release()
    assert claims[0] not in layer_graphs._statics and claims[2] not in layer_graphs._statics


def test_a_deleted_layers_graphs_give_back_their_static_buffers_and_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A LayerGraphs that goes (its layer was deleted) releases its graphs: their static
    buffers are freed where no other graph uses them, and a pool's keeper goes with the last
    graph captured into it (a later capture on that stream makes a new pool); releasing twice
    changes nothing."""
    import gc

    cpu = torch.device("cpu")
    pool = (0, 99)
    monkeypatch.setitem(layer_graphs._pools, pool, ("pool", "its keeper"))
    monkeypatch.setattr(layer_graphs, "_pool_graphs", {})

    def graph(claims: list) -> layer_graphs._Graph:
        made = layer_graphs._Graph(None, None, None, tuple(claims))  # type: ignore[arg-type]
        made.pool = pool
        layer_graphs._pool_graphs[pool] = layer_graphs._pool_graphs.get(pool, 0) + 1
        return made

    shape = torch.Size([2, 3])
    mine: list = []
    layer_graphs._static("in0", shape, torch.float32, cpu, 99, mine)
    theirs: list = []
    layer_graphs._static("in0", shape, torch.float32, cpu, 99, theirs)
    layer_graphs._static("out0", shape, torch.float32, cpu, 99, mine)
    gone, kept = layer_graphs.LayerGraphs("gone"), layer_graphs.LayerGraphs("kept")
    gone.graphs["a"] = graph(mine)
    kept.graphs["b"] = graph(theirs)
    del gone
    gc.collect()
    assert theirs[0] in layer_graphs._statics  # still read by the live layer's graph
    assert mine[1] not in layer_graphs._statics  # only the deleted layer's graph used it
    assert layer_graphs._pools[pool] == ("pool", "its keeper")  # one graph of it lives on
    kept.graphs["b"].release()
    kept.graphs["b"].release()  # a second release: nothing more
    assert theirs[0] not in layer_graphs._statics
    assert pool not in layer_graphs._pools and pool not in layer_graphs._pool_graphs


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("on", True), ("0", False)])
def test_the_setting(monkeypatch, value: str | None, on: bool) -> None:
    if value is None:
        monkeypatch.delenv("FP4GEN_LAYER_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", value)
    assert layer_graphs_enabled() is on


def test_a_bad_setting_is_an_error(monkeypatch) -> None:
    monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", "maybe")
    with pytest.raises(FP4GenError, match="FP4GEN_LAYER_GRAPHS='maybe': expected 1, on, 0 or off"):
        check_environment()


def test_passes_up_to_the_measured_sizes_are_graphed() -> None:
    """A pass is graphed while its GEMMs are within the sizes where graphs were measured to
    gain (MAX_GEMM_FLOPS: a Llama up to hidden 4096 at 8192 tokens); larger passes run
    eagerly."""
    assert layer_graphs.worth_graphing(8192, 1024, 2816)  # a Llama hidden-1024 MLP projection
    assert layer_graphs.worth_graphing(128, 256, 192)
    assert layer_graphs.worth_graphing(8192, 2048, 5632)  # hidden 2048's MLP
    assert layer_graphs.worth_graphing(8192, 4096, 11008)  # hidden 4096's MLP (7.4e11)
    assert not layer_graphs.worth_graphing(8192, 8192, 8192)  # not measured: eager


def test_the_address_log_says_met_on_the_second_sighting_and_stays_bounded() -> None:
    """A (key, addresses) pair is 'met' from its second sighting on, the cue for a graph that
    reads the activations in place; the log keeps the newest 2 * MAX_GRAPHS pairs, so
    addresses that never repeat cannot grow it."""
    log = layer_graphs._AddressLog()
    first = ("fprop", ((0x1000, (256, 1)),))
    assert not log.met(first)
    assert log.met(first) and log.met(first)
    for i in range(2 * layer_graphs.MAX_GRAPHS):  # fresh addresses every call
        assert not log.met(("fprop", ((0x2000 + 256 * i, (256, 1)),)))
    assert len(log.recent) == 2 * layer_graphs.MAX_GRAPHS
    assert not log.met(first)  # pushed out by newer pairs: met again from the next call
    assert log.met(first)


def test_in_place_addresses_name_strides_as_well() -> None:
    """Two views at one address with other strides are other inputs to a graph."""
    x = torch.zeros(4, 8)
    assert layer_graphs._addresses((x,)) != layer_graphs._addresses((x.t(),))
    assert layer_graphs._addresses((x,)) == layer_graphs._addresses((x.view(4, 8),))


def test_result_tensors_are_made_as_the_warm_up_gave_them_and_named_by_address() -> None:
    """A call's result tensors (made before its replay) have the warm-up's shapes and dtypes,
    absent results stay None, and their addresses name them (contiguous in the key's shapes,
    so the address alone: their strides follow)."""
    shapes = ((torch.Size([4, 8]), torch.bfloat16), None, (torch.Size([]), torch.float32))
    made = layer_graphs._fresh(shapes, torch.device("cpu"))
    assert made[1] is None
    assert made[0].shape == (4, 8) and made[0].dtype == torch.bfloat16
    assert made[2].shape == () and made[2].dtype == torch.float32
    assert all(t is None or t.is_contiguous() for t in made)
    assert layer_graphs._result_addresses(made) == (made[0].data_ptr(), None, made[2].data_ptr())


class _CudaLike:
    """What ``Linear._graphs_for`` reads of a pass's input: is_cuda and the token count."""

    is_cuda = True
    shape = (64, 64)


def test_a_pass_with_a_mor_operand_is_never_graphed_also_after_the_table_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_graphs_for`` remembers its MoR answer per pass and operand table: a table with a MoR
    operand (its kernels decide on the host) gets no graph, the block-format table does, and a
    switch between them is seen in both directions."""
    import fp4gen
    from fp4gen.runtime import finite

    monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", "1")
    plain = fp4gen.load_recipe("recipes/nvfp4_no_sr.fp4r").operands
    mor = fp4gen.load_recipe("recipes/mor_tensor.fp4r")
    layer = fp4gen.nn.Linear(64, 64, recipe=mor)
    t = _CudaLike()
    with finite.propagating():
        for forward in (True, False):
            assert layer._graphs_for(t, mor.operands, forward=forward) is None
            assert layer._graphs_for(t, plain, forward=forward) is not None
            assert layer._graphs_for(t, mor.operands, forward=forward) is None
            assert layer._graphs_for(t, plain, forward=forward) is layer._graphs


class _ReplayedFn:
    """Stands in for a CUDA graph on the CPU: a replay runs the captured function again on
    the static inputs and writes its results into the static outputs, as a graph would."""

    def __init__(self, fn, inputs, params, outputs) -> None:
        self.fn, self.inputs, self.params, self.outputs = fn, inputs, params, outputs

    def replay(self) -> None:
        results, _ = self.fn(*self.inputs, *self.params)
        for out, r in zip(self.outputs, results, strict=True):
            if out is not None:
                out.copy_(r)


def _cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """LayerGraphs on the CPU: one stream, never capturing, captures on static buffers made by
    ``_ReplayedFn``; returns the list each capture appends its kind to."""
    captured: list[str] = []

    def capture(fn, activations, params, results, stream, *, in_place, into=False):
        captured.append("in place" if in_place else "static")
        if in_place:  # reads the activations and writes the results where they are
            graph = _ReplayedFn(fn, activations, params, results)
            made = layer_graphs._Graph(graph, None, None, ())  # type: ignore[arg-type]
        else:
            inputs = tuple(t.clone() for t in activations)
            outputs = tuple(None if r is None else torch.empty_like(r) for r in results)
            graph = _ReplayedFn(fn, inputs, params, outputs)
            made = layer_graphs._Graph(graph, inputs, outputs, ())  # type: ignore[arg-type]
        made.meta = fn(*activations, *params)[1]  # a capture records the meta of its run
        return made

    monkeypatch.setattr(layer_graphs, "_current_stream_id", lambda device: 7)
    monkeypatch.setattr(layer_graphs, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return captured


def test_graphs_serve_a_key_from_its_second_call_with_the_functions_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first call of a key runs eagerly, the second captures (here on static buffers), the
    later ones replay; every call returns what the function computes of its own inputs, and
    a key holds the stream and hashes once (``_Key``: equal parts, equal keys)."""
    captured = _cpu_graphs(monkeypatch)
    graphs = layer_graphs.LayerGraphs("test")
    w = torch.tensor([2.0, 3.0])
    for step in range(5):
        x = torch.full((2,), float(step))  # new values (and addresses) every call
        (y,), meta = graphs.run_with_meta(("k",), lambda a, b: ((a * b,), "meta"), (x,), (w,))
        assert torch.equal(y, x * w) and meta == "meta"
    assert captured == ["static"] and graphs.replays == 3 and graphs.graph_calls == 4
    assert layer_graphs._Key((("k",), 7)) == layer_graphs._Key((("k",), 7))
    assert layer_graphs._Key((("k",), 7)) != layer_graphs._Key((("k",), 8))


def test_a_full_layer_drops_its_least_recently_used_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beyond ``MAX_GRAPHS`` keys the graph that served a call longest ago is dropped, not the
    one captured first: a key used on every step keeps its graph."""
    _cpu_graphs(monkeypatch)
    graphs = layer_graphs.LayerGraphs("test")
    x, w = torch.ones(2), torch.ones(2)

    def call(name: str) -> None:
        graphs.run((name,), lambda a, b: (a + b,), (x,), (w,))

    def held() -> set[str]:
        return {graph.key[0] for graph in graphs.graphs.values()}

    for i in range(layer_graphs.MAX_GRAPHS):
        call(f"k{i}")  # warm-up
        call(f"k{i}")  # capture
    assert held() == {f"k{i}" for i in range(layer_graphs.MAX_GRAPHS)}
    call("k0")  # k0 serves a call: k1 is now the least recently used
    call("new")
    call("new")  # captured: one graph must go
    assert "k0" in held() and "k1" not in held() and "new" in held()
    assert len(graphs.graphs) == layer_graphs.MAX_GRAPHS


def test_a_wgrad_copys_layout_keys_a_backward_graph_by_value_without_its_offset() -> None:
    """``Linear._described``: layouts equal but for their Philox offset give the same key part
    (one interned object, compared by identity), other layouts another, also once the intern
    table starts over."""
    import importlib

    import fp4gen

    quantize = importlib.import_module("fp4gen.numerics.quantize").quantize
    layer = fp4gen.nn.Linear(64, 64, recipe=fp4gen.load_recipe("recipes/nvfp4_no_sr.fp4r"))
    x = torch.randn(32, 64)
    first = quantize(x, "nvfp4", offset=0).split()[1]
    later = quantize(x, "nvfp4", offset=8).split()[1]  # the next call's copy: a new object
    other = quantize(torch.randn(64, 64), "nvfp4").split()[1]  # more tokens
    part = layer._described(first, None)
    assert layer._described(later, None) is part and layer._described(first, None) is part
    assert layer._described(other, None) is not part and layer._described(other, None) != part
    # a packed copy (a layer graph's forward): its packing is part of the key, by value
    tensors = quantize(x, "nvfp4").split()[0]
    packing, same = ops.Packing.of(tensors), ops.Packing.of(tensors)
    packed = layer._described(first, packing)
    assert packed is not part and layer._described(later, same) is packed
    layer._layout_parts.clear()  # as when MAX_LAYOUT_PARTS is reached
    again = layer._described(later, None)
    assert again is not part and again != part  # a new key: captured anew, never a stale graph
    assert again.obj == part.obj  # the same layout value


def test_addresses_met_twice_get_a_graph_that_works_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An activation and results at the same addresses on every call (a training loop's
    allocator) are captured in place from their second sighting, and the replays compute the
    new values written there; the key's graph on static copies goes then, and other addresses
    get one again."""
    captured = _cpu_graphs(monkeypatch)
    results = (torch.empty(2),)  # the allocator handing back the same block every call
    monkeypatch.setattr(layer_graphs, "_fresh", lambda shapes, device: results)
    graphs = layer_graphs.LayerGraphs("test")
    x, w = torch.empty(2), torch.tensor([2.0, 3.0])
    for step in range(6):
        x.copy_(torch.tensor([step, -step], dtype=torch.float32))  # new values, same address
        (y,) = graphs.run(("k",), lambda a, b: (a * b,), (x,), (w,))
        assert torch.equal(y, x * w), step
    assert captured == ["static", "in place"]
    assert graphs.in_place_replays == 3 and graphs.replays == 3
    # the graph on static copies served its one call and went with the in-place capture
    assert [g.inputs for g in graphs.graphs.values()] == [None]
    x2 = torch.empty(2)  # another address: on static copies again (a new capture)
    x2.copy_(torch.tensor([7.0, 8.0]))
    (y,) = graphs.run(("k",), lambda a, b: (a * b,), (x2,), (w,))
    assert torch.equal(y, x2 * w) and captured == ["static", "in place", "static"]


_MOR_SR_GRADIENTS = """
recipe mor_sr "MoR on every operand, gradients rounded stochastically"
mor tensor_e4m3 {
    decide tensor
    scale block 128x128 gam
    try e4m3 if relerr < 4.5%
    else bf16
}
operands {
    *        : mor tensor_e4m3
    gradient : round stochastic
}
"""


def test_a_stochastic_mor_operand_refuses_a_cuda_graph_capture_in_its_pass_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MoR kernels take their Philox offset from the host, so a captured pass would draw the
    same bits on every replay: the pass whose MoR operand rounds stochastically (the backward,
    with its gradients) raises while a capture runs; the forward, round-to-nearest, does not.
    ``_pass_mors`` answers per pass and table, and sees a table switch."""
    import fp4gen
    from fp4gen.runtime import linear

    sr = fp4gen.load_recipe(_MOR_SR_GRADIENTS)
    mor = fp4gen.load_recipe("recipes/mor_tensor.fp4r")
    plain = fp4gen.load_recipe("recipes/nvfp4_no_sr.fp4r").operands
    layer = fp4gen.nn.Linear(64, 64, recipe=sr)
    assert layer._pass_mors(sr.operands, forward=True) == (True, False)
    assert layer._pass_mors(sr.operands, forward=False) == (True, True)
    assert layer._pass_mors(plain, forward=False) == (False, False)
    assert layer._pass_mors(mor.operands, forward=False) == (True, False)
    assert layer._pass_mors(sr.operands, forward=False) == (True, True)

    checked: list[int] = []  # the passes that ask: the backward's four operands only
    monkeypatch.setattr(
        linear, "_refuse_sr_capture", lambda t, specs, name: checked.append(len(specs))
    )
    x, dy = torch.randn(8, 64), torch.randn(8, 64)
    layer.forward_gemm(x, layer.weight, None, torch.float32)
    layer.backward_gemms(dy, x, layer.weight)
    assert checked == [4]
    monkeypatch.undo()

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    table = sr.operands
    backward = (table.dgrad_gradient, table.dgrad_weight, table.wgrad_gradient)
    with pytest.raises(FP4GenError, match="rounds stochastically"):
        linear._refuse_sr_capture(_CudaLike(), backward, "layer")
    linear._refuse_sr_capture(_CudaLike(), (table.fprop_activation, table.fprop_weight), "layer")


def test_graphed_layers_on_one_x_share_its_wgrad_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers reading the same x (a Llama's q, k and v), each run from its layer graphs: only
    the first layer's forward graph quantizes x's wgrad copy, the others' graphs leave it out
    and their backward graphs read that copy; every step (warm-up, capture, replays) gives the
    bits of layers that save x and quantize it in their own backward, eagerly."""
    import fp4gen
    from fp4gen.runtime import linear

    recipe = fp4gen.load_recipe("recipes/nvfp4_small.fp4r")
    _cpu_graphs(monkeypatch)
    monkeypatch.setenv("FP4GEN_LAYER_GROUPS", "0")  # each layer's own graphs (not a group's)
    made_by: list[str] = []
    real = linear.Linear.wgrad_activation

    def counting(self, *args, **kw):
        made_by.append(self.name)
        return real(self, *args, **kw)

    def graphs_for(self, t, table, *, forward):
        if self._graphs is None:
            self._graphs = layer_graphs.LayerGraphs(self.name)
        return self._graphs

    def run(graphed: bool) -> list[list[torch.Tensor]]:
        with monkeypatch.context() as patch:
            if graphed:
                patch.setattr(linear.Linear, "_graphs_for", graphs_for)
                patch.setattr(linear.Linear, "wgrad_activation", counting)
            torch.manual_seed(0)
            layers = [
                fp4gen.nn.Linear(64, 32, recipe=recipe, seed=5, name=f"l{i}") for i in range(3)
            ]
            for layer in layers:
                layer.keep_quantized_input = graphed
            gen = torch.Generator().manual_seed(2)
            steps = []
            for _ in range(5):
                x = torch.randn(32, 64, generator=gen).requires_grad_(True)
                h = x * 1.0  # a non-leaf, as a norm's output would be
                ys = [layer(h.reshape(4, 8, 64)) for layer in layers]
                sum((y * (i + 1)).sum() for i, y in enumerate(ys)).backward()
                steps.append([*(y.detach() for y in ys), x.grad, *(m.weight.grad for m in layers)])
                for layer in layers:
                    layer.weight.grad = None
            if graphed:
                keys = [g.key for m in layers for g in m._graphs.graphs.values()]
                assert sum(1 for k in keys if k[0] == "fprop" and k[-1]) == 1  # l0's only
                assert sum(1 for k in keys if k[0] == "fprop" and not k[-1]) == 2
            return steps

    shared, separate = run(True), run(False)
    assert made_by and set(made_by) == {"l0"}
    for step, (a, b) in enumerate(zip(shared, separate, strict=True)):
        for u, v in zip(a, b, strict=True):
            assert torch.equal(u, v), step


def test_a_graphed_forward_saves_x_s_wgrad_copy_packed_in_one_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From a layer graph the forward hands over x's wgrad copy as one byte buffer
    (``ops.Packing``: one result tensor per call instead of one per piece), which autograd saves
    beside the weight; the backward graph reads the pieces from it, and every step gives the
    bits of an eager layer that never packs."""
    import fp4gen
    from fp4gen.runtime import linear

    recipe = fp4gen.load_recipe("recipes/nvfp4_small.fp4r")
    _cpu_graphs(monkeypatch)

    def graphs_for(self, t, table, *, forward):
        if self._graphs is None:
            self._graphs = layer_graphs.LayerGraphs(self.name)
        return self._graphs

    def kept_by(kept: list[torch.Tensor]):
        return lambda t: kept.append(t) or t

    def run(graphed: bool) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        with monkeypatch.context() as patch:
            if graphed:
                patch.setattr(linear.Linear, "_graphs_for", graphs_for)
            torch.manual_seed(0)
            layer = fp4gen.nn.Linear(64, 32, recipe=recipe, seed=5)
            gen = torch.Generator().manual_seed(2)
            steps, saved = [], []
            for _ in range(5):
                x = torch.randn(32, 64, generator=gen).requires_grad_(True)
                kept: list[torch.Tensor] = []
                with torch.autograd.graph.saved_tensors_hooks(kept_by(kept), lambda t: t):
                    y = layer(x * 1.0)
                (y * 3).sum().backward()
                steps.append([y.detach(), x.grad, layer.weight.grad])
                saved.append(kept)
                layer.weight.grad = None
            return steps, saved

    (graphed, saved), (eager, eager_saved) = run(True), run(False)
    for step, (a, b) in enumerate(zip(graphed, eager, strict=True)):
        for u, v in zip(a, b, strict=True):
            assert torch.equal(u, v), step
    assert len(eager_saved[-1]) > 2  # the pieces, one saved tensor each
    for kept in saved[1:]:  # a layer graph from the second call on (capture, then replays)
        weight, packed = kept
        assert weight.shape == (32, 64) and packed.dtype == torch.uint8 and packed.dim() == 1
        pieces = [t for t in eager_saved[-1] if t.shape != (32, 64)]
        assert packed.numel() >= sum(t.numel() * t.element_size() for t in pieces)


def test_packing_lays_the_pieces_out_aligned_and_gives_them_back() -> None:
    """``ops.Packing``: each piece at a 16-byte boundary in order, absent pieces None, the
    views of a packed buffer equal to the pieces; a non-contiguous piece is not packed."""
    codes = torch.arange(30, dtype=torch.uint8).reshape(3, 10)
    scales = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float32)
    global_scale = torch.tensor(0.75)
    tensors = (codes, None, scales, global_scale)
    packing = ops.Packing.of(tensors)
    assert packing is not None
    assert [p and p[0] for p in packing.pieces] == [0, None, 32, 48]
    assert packing.nbytes == 52
    buffer = packing.pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.shape == (52,)
    back = packing.unpack(buffer)
    assert back[1] is None
    for original, view in zip((codes, scales, global_scale), back[::2] + back[3:], strict=True):
        assert view.dtype == original.dtype and view.shape == original.shape
        assert torch.equal(view, original)
    assert ops.Packing.of((codes.t(), scales)) is None
    into = torch.zeros(52, dtype=torch.uint8)  # a given buffer (a layer graph's result tensor)
    assert packing.pack(tensors, into) is into
    gaps = torch.ones(52, dtype=torch.bool)
    gaps[:30] = gaps[32:44] = gaps[48:] = False
    assert torch.equal(into[~gaps], buffer[~gaps]) and not into[gaps].any()
