"""Non-finite inputs on the quantize paths (``fp4gen.runtime.finite``): raised at once, read back
at the end of a block, or propagated into the global scale; run on CPU tensors (the reductions
are the same torch ops)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp4gen.errors import FP4GenError, TensorError
from fp4gen.runtime import finite


def test_check_raises_at_once_outside_a_block() -> None:
    finite.check(torch.ones(4, 4), "x")
    bad = torch.ones(4, 4)
    bad[2, 3] = float("inf")
    with pytest.raises(TensorError, match=r"x has 1 non-finite value.*index \(2, 3\)"):
        finite.check(bad, "x")


def test_deferred_checks_raise_when_the_block_ends() -> None:
    bad = torch.zeros(3, 5)
    bad[1, 4] = float("nan")
    reached = []
    second = r"second has 1 non-finite value.*index \(1, 4\)"
    with pytest.raises(TensorError, match=second), finite.deferred():
        finite.check(torch.ones(2, 2), "first")
        finite.check(bad, "second")
        reached.append(True)  # no read-back yet: the block runs to its end
    assert reached == [True]
    with finite.deferred():  # all finite: nothing raised, and the state is reset
        finite.check(torch.ones(2, 2), "first")
    with pytest.raises(TensorError):
        finite.check(bad, "outside")


def test_nested_blocks_share_the_outer_read_and_errors_pass_through() -> None:
    bad = torch.full((2,), float("-inf"))
    reached = []
    with pytest.raises(TensorError, match="inner"), finite.deferred():
        with finite.deferred():
            finite.check(bad, "inner")
        reached.append(True)  # the inner block ended without reading back
    assert reached == [True]
    with pytest.raises(ValueError, match="unrelated"), finite.deferred():
        finite.check(bad, "skipped")
        raise ValueError("unrelated")  # the block's own error wins; no check runs
    finite.check(torch.ones(1), "after")  # not deferred any more


def test_propagating_scope_returns_the_flag_and_poisons_the_global_scale() -> None:
    bad = torch.ones(4, 4)
    bad[0, 0] = float("nan")
    scale = torch.tensor(0.5)
    with finite.propagating():
        good_flag = finite.check(torch.ones(4, 4), "good")
        bad_flag = finite.check(bad, "bad")  # no error: the flag carries it
    assert bool(good_flag) and not bool(bad_flag)
    assert finite.poison(scale, good_flag).item() == 0.5
    assert torch.isnan(finite.poison(scale, bad_flag))
    assert finite.poison(scale, None) is scale
    assert finite.check(torch.ones(2), "outside") is None  # the scope has ended


def test_layer_mode_picks_the_scope(monkeypatch) -> None:
    bad = torch.full((3,), float("inf"))
    assert finite.layer_mode() == "propagate"  # the default
    with finite.layer_scope():
        assert finite.check(bad, "x") is not None
    monkeypatch.setattr(finite, "_layer_mode", ["propagate"])
    finite.set_layer_mode("raise")
    with pytest.raises(TensorError, match="x has 3 non-finite"), finite.layer_scope():
        assert finite.check(bad, "x") is None
    with pytest.raises(FP4GenError, match="expected one of propagate, raise"):
        finite.set_layer_mode("ignore")
    monkeypatch.setenv("FP4GEN_CHECK_FINITE", "sometimes")
    with pytest.raises(FP4GenError, match="FP4GEN_CHECK_FINITE='sometimes'"):
        finite.mode_from_env()
    monkeypatch.setattr(finite, "_layer_mode", [None])  # read on first use, not at import
    with pytest.raises(FP4GenError, match="FP4GEN_CHECK_FINITE='sometimes'"):
        finite.layer_mode()


def test_cli_reports_a_bad_setting_before_any_command(monkeypatch, capsys) -> None:
    from fp4gen.cli import main

    monkeypatch.setenv("FP4GEN_CHECK_FINITE", "bogus")
    assert main(["formats"]) == 1
    err = capsys.readouterr().err
    assert err == "fp4gen formats: FP4GEN_CHECK_FINITE='bogus': expected one of propagate, raise\n"


# --- fp4gen.nn.Linear: propagated on every device, or raised naming the tensor given -----------

LAYER_RECIPES = ["nvfp4_small", "mxfp8", "nvfp4"]  # 2D and 1D blocks, SR and RHT (nvfp4)


def _layer(recipe: str, device: str = "cpu"):
    import fp4gen

    torch.manual_seed(0)
    return fp4gen.nn.Linear(64, 32, recipe=recipe, name="lin", device=device)


def _bad(shape: tuple[int, ...], index: tuple[int, ...], value: float, device: str = "cpu"):
    t = torch.randn(shape, device=device)
    t[index] = value
    return t


@pytest.mark.parametrize("recipe", LAYER_RECIPES)
def test_a_layer_propagates_a_nan_input_as_nan_outputs_and_weight_gradient(
    recipe, monkeypatch
) -> None:
    monkeypatch.setattr(finite, "_layer_mode", ["propagate"])
    layer = _layer(recipe)
    x = _bad((8, 64), (1, 3), float("nan")).requires_grad_(True)
    y = layer(x)
    assert torch.isnan(y).all()  # x's quantized operand has a NaN global scale: every output
    y.backward(torch.randn_like(y))
    assert torch.isnan(layer.weight.grad).all()  # x's wgrad copy too
    assert torch.isfinite(x.grad).all()  # dgrad reads dy and W, both finite
    assert torch.isfinite(layer.bias.grad).all()


@pytest.mark.parametrize("recipe", LAYER_RECIPES)
def test_a_layer_propagates_an_inf_gradient_into_dx_and_dw(recipe, monkeypatch) -> None:
    monkeypatch.setattr(finite, "_layer_mode", ["propagate"])
    layer = _layer(recipe)
    x = torch.randn(2, 4, 64, requires_grad=True)
    y = layer(x)
    assert torch.isfinite(y).all()
    dy = torch.randn_like(y)
    dy[1, 2, 5] = float("inf")
    y.backward(dy)
    assert torch.isnan(x.grad).all() and torch.isnan(layer.weight.grad).all()


def test_a_finite_step_after_a_nan_one_is_bit_exact(monkeypatch) -> None:
    """The non-finite call changes no state: the next finite call gives what it gives alone."""
    monkeypatch.setattr(finite, "_layer_mode", ["propagate"])
    a, b = _layer("nvfp4_small"), _layer("nvfp4_small")
    a(_bad((8, 64), (0, 0), float("nan")))
    x = torch.randn(8, 64)
    b._forward_calls = a._forward_calls  # the same call count (round to nearest: no stream)
    assert torch.equal(a(x), b(x))


@pytest.mark.parametrize(
    ("shape", "index", "named"),
    [
        ((8, 64), (1, 3), r"\(8, 64\).*index \(1, 3\)"),
        ((2, 4, 64), (1, 2, 3), r"\(2, 4, 64\).*index \(1, 2, 3\)"),
    ],
)
def test_raise_mode_names_the_input_as_given(shape, index, named, monkeypatch) -> None:
    monkeypatch.setattr(finite, "_layer_mode", ["raise"])
    layer = _layer("nvfp4_small")
    with pytest.raises(TensorError, match=r"^lin: the input of shape " + named):
        layer(_bad(shape, index, float("nan")))


def test_raise_mode_names_the_weight_and_the_output_gradient(monkeypatch) -> None:
    monkeypatch.setattr(finite, "_layer_mode", ["raise"])
    layer = _layer("nvfp4_small")
    x = torch.randn(2, 4, 64, requires_grad=True)
    y = layer(x)
    dy = _bad(tuple(y.shape), (1, 2, 5), float("-inf"))
    with pytest.raises(
        TensorError,
        match=r"^lin: the gradient of its output, of shape \(2, 4, 32\) has 1 .*index \(1, 2, 5\)",
    ):
        y.backward(dy)
    with torch.no_grad():
        layer.weight[7, 9] = float("nan")
    with pytest.raises(
        TensorError, match=r"^lin: the weight of shape \(32, 64\) has 1 .*index \(7, 9\)"
    ):
        layer(torch.randn(8, 64))


def test_raise_mode_names_a_conv1d_weight_in_its_own_layout(monkeypatch) -> None:
    from fp4gen.runtime.linear import Conv1DLinear

    class Conv1D(torch.nn.Module):  # transformers' Conv1D as convert sees it: weight [in, out]
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(64, 32))
            self.bias = torch.nn.Parameter(torch.zeros(32))

    monkeypatch.setattr(finite, "_layer_mode", ["raise"])
    conv = Conv1D()
    with torch.no_grad():
        conv.weight[60, 2] = float("inf")
    layer = Conv1DLinear.from_conv1d(conv, operands=_layer("nvfp4_small").operands, name="c")
    with pytest.raises(TensorError, match=r"^c: the weight of shape \(64, 32\) .*index \(60, 2\)"):
        layer(torch.randn(8, 64))


def test_a_reference_fallback_that_refuses_a_nan_propagates_it(monkeypatch) -> None:
    """On CUDA a shape the kernels do not take falls back to the reference, which raises for a
    NaN: the layer then propagates it as the kernels would. Played on a CPU by handing the
    reference the input unguarded, as the CUDA "auto" path does."""
    guard = finite.reference_input
    monkeypatch.setattr(
        finite,
        "reference_input",
        lambda t, backend: guard(t, backend) if backend == "reference" else (t, None),
    )
    monkeypatch.setattr(finite, "_layer_mode", ["propagate"])
    layer = _layer("nvfp4")  # SR gradients and an RHT on the wgrad operands
    x = _bad((8, 64), (1, 3), float("nan")).requires_grad_(True)
    y = layer(x)
    assert torch.isnan(y).all()
    dy = _bad(tuple(y.shape), (0, 0), float("inf"))
    y.backward(dy)
    assert torch.isnan(x.grad).all() and torch.isnan(layer.weight.grad).all()
    monkeypatch.setattr(finite, "_layer_mode", ["raise"])  # and "raise" still raises
    with pytest.raises(TensorError, match="^lin: the input of shape"):
        layer(x)


class _DeviceReads(TorchDispatchMode):
    """Counts the reads of a tensor's value on the host (``aten._local_scalar_dense``: what
    ``int``, ``bool`` and ``item`` run), the reads a CUDA graph capture refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("fmt", "hadamard"), [("nvfp4", None), ("nvfp4", 16), ("mxfp8_e4m3", None), ("mxfp4", 32)]
)
def test_a_reference_fallback_inside_a_capture_reads_nothing(monkeypatch, fmt, hadamard) -> None:
    """Inside a CUDA graph capture (a layer graph or reduce-overhead, for a shape the kernels do
    not take) the reference's NaN/Inf check cannot read the device: in a propagating scope the
    input's NaN and Inf are zeroed and folded into the global scale with no read (a finite
    input: the reference's bits; a NaN or an Inf: a NaN global scale, the codes of the zeroed
    input, as the layer gives them outside a capture); outside one, a TensorError before any
    op. Played on a CPU with the capture stood in (``quantize_dispatch.capturing``)."""
    from fp4gen.numerics.quantize import quantize as reference
    from fp4gen.runtime import quantize_dispatch

    monkeypatch.setattr(quantize_dispatch, "capturing", lambda x: True)
    good = torch.randn(16, 256)
    for bad_value in (None, float("nan"), float("-inf")):
        x = good if bad_value is None else _bad(tuple(good.shape), (3, 17), bad_value)
        zeroed = torch.where(torch.isfinite(x), x, torch.zeros(()))
        want = reference(zeroed, fmt, hadamard=hadamard)
        with finite.propagating(), _DeviceReads() as counted:
            got = quantize_dispatch.quantize(x, fmt, hadamard=hadamard)
        assert counted.reads == 0
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
        if bad_value is None:
            assert torch.equal(got.global_scale, want.global_scale)
        else:
            assert torch.isnan(got.global_scale).all()
            assert torch.isnan(got.dequantize()).all()
    with pytest.raises(TensorError, match=r"shape \(16, 256\) .* inside a CUDA graph capture"):
        quantize_dispatch.quantize(good, fmt, hadamard=hadamard)


def test_a_transform_that_overflows_inside_a_capture_gives_a_nan_global_scale(
    monkeypatch,
) -> None:
    """The reference's second check, of the RHT's output (finite values near the float32 maximum
    can overflow in the butterflies), is folded in too."""
    from fp4gen.runtime import quantize_dispatch

    monkeypatch.setattr(quantize_dispatch, "capturing", lambda x: True)
    x = torch.full((4, 64), 3e38)
    with finite.propagating():
        got = quantize_dispatch.quantize(x, "nvfp4", hadamard=16)
    assert torch.isnan(got.global_scale).all()


def test_a_mor_rule_inside_a_capture_is_refused_before_any_op(monkeypatch) -> None:
    """Mixture of Representations reads the device to choose each block's format, which a
    CUDA graph capture refuses (and a failed capture leaves torch's generator in capture mode):
    under a capture it raises a TensorError naming the way out, and runs nothing."""
    from fp4gen.dsl import load_recipe
    from fp4gen.runtime import quantize_dispatch

    rule = load_recipe("mor_tensor").mors[0]
    monkeypatch.setattr(quantize_dispatch, "capturing", lambda x: True)
    with _DeviceReads() as counted, pytest.raises(TensorError, match="inside a CUDA graph capture"):
        quantize_dispatch.mor_quantize(torch.randn(8, 128), rule)
    assert counted.reads == 0


def test_raise_mode_propagates_inside_a_capture_and_says_so(monkeypatch, caplog) -> None:
    """FP4GEN_CHECK_FINITE=raise reads each op's flags when it ends, which a CUDA graph capture
    (torch.compile's reduce-overhead) refuses: inside one the op's scope propagates instead,
    warned once; outside one it still defers and raises."""
    monkeypatch.setattr(finite, "_layer_mode", ["raise"])
    monkeypatch.setattr(finite, "_logged", set())
    with finite.layer_scope():
        assert not finite.propagates() and finite.checks_given()
    monkeypatch.setattr(finite, "_capturing", lambda: True)
    with caplog.at_level("WARNING", logger="fp4gen.runtime"):
        for _ in range(2):
            with finite.layer_scope():
                assert finite.propagates()
    warned = [r for r in caplog.records if "inside a CUDA graph capture" in r.getMessage()]
    assert len(warned) == 1
    assert not finite.propagates()  # the scope restored the state it found
