"""The host-side bookkeeping of fp4gen.runtime.layer_graphs and its setting (CPU; the graphs
themselves are tested on the GPU in tests/test_layer_graphs_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from fp4gen.errors import FP4GenError
from fp4gen.runtime import layer_graphs
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


def test_only_passes_small_enough_to_gain_are_graphed() -> None:
    """A pass is graphed while its GEMMs are small enough for the host's launches to be the
    bottleneck (MAX_GEMM_FLOPS); larger passes run eagerly (their copies would cost more)."""
    assert layer_graphs.worth_graphing(8192, 1024, 2816)  # a Llama hidden-1024 MLP projection
    assert layer_graphs.worth_graphing(128, 256, 192)
    assert not layer_graphs.worth_graphing(8192, 2048, 2048)  # hidden 2048: eager is faster
    assert not layer_graphs.worth_graphing(8192, 4096, 4096)
    assert not layer_graphs.worth_graphing(8192, 8192, 8192)


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
    absent results stay None, and their addresses name them like the activations'."""
    shapes = ((torch.Size([4, 8]), torch.bfloat16), None, (torch.Size([]), torch.float32))
    made = layer_graphs._fresh(shapes, torch.device("cpu"))
    assert made[1] is None
    assert made[0].shape == (4, 8) and made[0].dtype == torch.bfloat16
    assert made[2].shape == () and made[2].dtype == torch.float32
    where = layer_graphs._addresses(made)
    assert where[1] is None
    assert where[0] == (made[0].data_ptr(), (8, 1)) and where[2] == (made[2].data_ptr(), ())


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
