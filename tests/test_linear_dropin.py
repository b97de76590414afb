"""fp4gen.nn.Linear where torch.nn.Linear code puts it: empty inputs and empty layers give
torch's results, a recipe given by name or path, a 0-d input refused in one line, a scheduled
recipe on a layer built by hand driven by fp4gen.set_step, and a double backward refused at
its first step (eager, the custom op, layer groups)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import fp4gen
from fp4gen.errors import FP4GenError, RecipeError, TensorError
from fp4gen.runtime import layer_groups
from fp4gen.settings import LAYER_GROUPS_VAR

SMALL = fp4gen.load_recipe("nvfp4_small")
RECIPES = Path(fp4gen.__file__).resolve().parent / "recipes"


def pair(in_f: int, out_f: int, **kwargs) -> tuple[fp4gen.nn.Linear, nn.Linear]:
    """An fp4gen Linear and a torch Linear with the same parameters."""
    torch.manual_seed(0)
    ours = fp4gen.nn.Linear(in_f, out_f, recipe=SMALL, name="ours", **kwargs)
    theirs = nn.Linear(in_f, out_f, **kwargs)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def step(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.sum().backward()
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize(
    ("in_f", "out_f", "shape"),
    [(64, 32, (0, 64)), (64, 32, (2, 0, 64)), (0, 32, (4, 0)), (64, 0, (4, 64))],
    ids=["no tokens", "no tokens 3-d", "no in_features", "no out_features"],
)
def test_empty_inputs_and_layers_give_torch_results(in_f: int, out_f: int, shape) -> None:
    ours, theirs = pair(in_f, out_f)
    x = torch.randn(shape)
    got, want = step(ours, x), step(theirs, x)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)
    y, dx, dw, db = got
    assert y.shape == (*shape[:-1], out_f)
    assert torch.equal(dw, torch.zeros(out_f, in_f))  # no product has a term
    assert dx.shape == shape and torch.count_nonzero(dx) == 0
    if shape[0] == 0:  # no tokens: a zero bias gradient too
        assert torch.equal(db, torch.zeros(out_f))
    if in_f == 0:  # y is the bias on every row
        assert torch.equal(y, ours.bias.detach().expand(4, out_f))


def test_empty_input_then_a_real_one_trains_as_before() -> None:
    ours, _ = pair(64, 32)
    ours(torch.randn(0, 64)).sum().backward()
    x = torch.randn(16, 64)
    y = ours(x)
    ref = fp4gen.nn.Linear(64, 32, recipe=SMALL, name="ours")
    ref.load_state_dict(ours.state_dict())
    assert torch.equal(y, ref(x))  # the empty call drew no random stream, changed no state


def test_empty_input_under_bf16_autocast_gives_bf16() -> None:
    ours, _ = pair(64, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ours(torch.randn(0, 64))
    assert y.shape == (0, 32) and y.dtype == torch.bfloat16


def test_a_recipe_by_shipped_name_or_path_is_the_loaded_recipe() -> None:
    x = torch.randn(16, 64)
    outputs = []
    for recipe in (
        SMALL,
        "nvfp4_small",
        RECIPES / "nvfp4_small.fp4r",
        str(RECIPES / "nvfp4_small.fp4r"),
    ):
        torch.manual_seed(0)
        layer = fp4gen.nn.Linear(64, 32, recipe=recipe)
        assert layer.operands == SMALL.operands
        outputs.append(layer(x))
    assert all(torch.equal(outputs[0], y) for y in outputs[1:])
    with pytest.raises(RecipeError, match="no_such_recipe"):
        fp4gen.nn.Linear(64, 32, recipe="no_such_recipe")


def test_a_0d_input_is_refused_naming_its_shape() -> None:
    ours, theirs = pair(64, 32)
    with pytest.raises(RuntimeError):  # torch refuses it too
        theirs(torch.tensor(1.0))
    with pytest.raises(TensorError, match=r"ours: input of shape \(\) is 0-d.*in_features=64"):
        ours(torch.tensor(1.0))


def test_a_1d_input_gives_a_1d_output() -> None:
    ours, _ = pair(64, 32)
    x = torch.randn(64)
    assert torch.equal(ours(x), ours(x[None])[0])
    assert ours(x).shape == (32,)


SWITCH = fp4gen.load_recipe("nvfp4_bf16_switch")  # at 82% forward : bf16


def test_set_step_drives_a_standalone_layers_schedule() -> None:
    layer = fp4gen.nn.Linear(64, 32, recipe=SWITCH)
    with pytest.raises(FP4GenError, match="pass total_steps .* fp4gen.set_step"):
        layer(torch.randn(4, 64))
    fp4gen.set_step(layer, 0, total_steps=100)
    assert layer.operands.fprop_activation.format.name == "nvfp4"
    fp4gen.set_step(layer, 82)  # ceil(0.82 * 100)
    assert layer.operands.fprop_activation.format.name == "bf16"
    assert layer.operands.wgrad_gradient.format.name == "nvfp4"  # backward unchanged
    x = torch.randn(4, 64)
    w = layer.weight.detach()
    # bf16 operands, an exact product summed in float64 and rounded once to fp32, the bias added
    want = (x.bfloat16().double() @ w.bfloat16().double().t()).float() + layer.bias.detach()
    assert torch.equal(layer(x), want)


def test_set_step_drives_every_layer_of_a_module_built_by_hand() -> None:
    model = nn.Sequential(
        fp4gen.nn.Linear(64, 64, recipe=SWITCH), nn.ReLU(), fp4gen.nn.Linear(64, 32, recipe=SWITCH)
    )
    fp4gen.set_step(model, 90, total_steps=100)
    assert [model[i].operands.fprop_weight.format.name for i in (0, 2)] == ["bf16", "bf16"]
    with pytest.raises(FP4GenError, match="Sequential holds no fp4gen layer"):
        fp4gen.set_step(nn.Sequential(nn.Linear(4, 4)), 1)


# --- double backward --------------------------------------------------------------------------


def double_backward(layer: nn.Module, x: torch.Tensor) -> None:
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    (g.pow(2).sum() + 0 * y.sum()).backward()


def test_double_backward_is_refused_at_the_first_backward() -> None:
    ours, theirs = pair(64, 32)
    x = torch.randn(8, 64)
    double_backward(theirs, x)
    assert float(theirs.weight.grad.norm()) > 0  # what a silent zero would have hidden
    with pytest.raises(FP4GenError, match="ours: a backward with create_graph=True"):
        double_backward(ours, x)
    assert ours.weight.grad is None
    # an ordinary backward afterwards works
    step(ours, x)
    assert float(ours.weight.grad.norm()) > 0


def test_double_backward_through_the_custom_op_is_refused() -> None:
    """torch.compile with the eager backend runs the custom op and its registered backward."""
    torch._dynamo.reset()
    ours, _ = pair(64, 32)
    with pytest.raises(FP4GenError, match="create_graph=True"):
        double_backward(torch.compile(ours, backend="eager"), torch.randn(8, 64))


class _QKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (
            fp4gen.nn.Linear(64, 64, recipe=SMALL, seed=i, name=n) for i, n in enumerate("qkv")
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h * 1.5
        return self.q(x) * self.k(x) + self.v(x)


def test_double_backward_through_a_layer_group_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(LAYER_GROUPS_VAR, "1")
    model = _QKV()
    for _ in range(3):  # two forwards show the run, the third runs it as a group
        model(torch.randn(8, 64)).square().mean().backward()
    assert layer_groups.group_of(model.q) is not None
    with pytest.raises(FP4GenError, match="layer group q\\+k\\+v: a backward with create_graph"):
        double_backward(model, torch.randn(8, 64))


# --- copies -----------------------------------------------------------------------------------


def test_a_deep_copy_runs_as_itself_not_as_the_original() -> None:
    """A copy's calls reach the copy's own state (its schedule clock here), and it outlives
    the original: the op looks a layer up by its id, so a copy needs an id of its own."""
    import copy
    import gc

    layer = fp4gen.nn.Linear(64, 32, recipe=SWITCH)
    fp4gen.set_step(layer, 0, total_steps=100)
    twin = copy.deepcopy(layer)
    fp4gen.set_step(twin, 90)  # the twin is past the switch (bf16), the original is not
    x = torch.randn(4, 64)
    w = twin.weight.detach()
    want = (x.bfloat16().double() @ w.bfloat16().double().t()).float() + twin.bias.detach()
    assert torch.equal(twin(x), want)
    assert not torch.equal(layer(x), want)  # nvfp4 still
    del layer
    gc.collect()
    assert torch.equal(twin(x), want)


def test_a_pickled_layer_runs_as_itself() -> None:
    """torch.save / torch.load of a whole layer (pickle) gives a layer with its own id."""
    import io

    layer = fp4gen.nn.Linear(64, 32, recipe=SMALL)
    x = torch.randn(4, 64)
    want = layer(x)
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    other = fp4gen.nn.Linear(64, 32, recipe=SWITCH)  # a layer made later takes a new id
    fp4gen.set_step(other, 90, total_steps=100)
    assert loaded._op_id != layer._op_id and loaded._op_id != other._op_id
    assert torch.equal(loaded(x), want)
