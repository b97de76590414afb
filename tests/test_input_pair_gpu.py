"""x's fprop operand and its wgrad copy from one tile launch (``Linear._input_pair``): a training
forward that keeps x's wgrad copy reads x once for both copies where one kernel serves them, and
every output and gradient is the two-launch path's, bit for bit, for every shipped block-format
recipe, eagerly and from layer graphs, and where sibling layers share x's wgrad copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fp4gen
from fp4gen.dsl import load_recipe
from fp4gen.runtime import linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

RECIPES = sorted(
    p.name for p in (Path(__file__).parent.parent / "recipes").glob("*.fp4r") if "mor" not in p.name
)

# recipes whose x copies one tile kernel serves (block targets, as nvfp4_4over6's, are not)
ONE_LAUNCH = (
    "fp8_blockwise.fp4r",
    "mxfp4.fp4r",
    "mxfp8.fp4r",
    "nvfp4.fp4r",
    "nvfp4_no_sr.fp4r",
    "nvfp4_small.fp4r",
)


class _Siblings(torch.nn.Module):
    """q, k and v read one x (they share its wgrad copy), then o reads their outputs."""

    def __init__(self, recipe: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        r = load_recipe(recipe)
        self.q, self.k, self.v = (
            fp4gen.nn.Linear(512, 256, recipe=r, seed=7 + n, device="cuda", name=name)
            for n, name in enumerate("qkv")
        )
        self.o = fp4gen.nn.Linear(768, 384, recipe=r, seed=11, device="cuda", name="o")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.cat([self.q(x), self.k(x), self.v(x)], -1))


def _steps(recipe: str, pairs: bool, monkeypatch, dtype: torch.dtype) -> list:
    """Three fwd+bwd steps with SGD between them; the outputs, dx and every gradient."""
    previous = linear.set_input_pair_launch(pairs)
    try:
        model = _Siblings(recipe)
        fp4gen.set_step(model, 0, total_steps=100)  # a schedule's switch needs a length
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        gen = torch.Generator(device="cuda").manual_seed(5)
        out = []
        for _ in range(3):
            x = torch.randn(256, 512, device="cuda", generator=gen).to(dtype).requires_grad_()
            dy = torch.randn(256, 384, device="cuda", generator=gen).to(dtype)
            y = model(x)
            y.backward(dy)
            out.append((y.detach(), x.grad, [p.grad.clone() for p in model.parameters()]))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return out
    finally:
        linear.set_input_pair_launch(previous)


@pytest.mark.parametrize("graphs", ["0", "1"], ids=["eager", "layer-graphs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe", RECIPES)
def test_one_launch_for_x_gives_the_two_launch_bits(
    recipe: str, dtype: torch.dtype, graphs: str, monkeypatch
) -> None:
    monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", graphs)
    served: list[bool] = []
    input_pair = linear.Linear._input_pair

    def counted(self, *args, **kw):
        got = input_pair(self, *args, **kw)
        served.append(got is not None)
        return got

    monkeypatch.setattr(linear.Linear, "_input_pair", counted)
    with_pairs = _steps(recipe, True, monkeypatch, dtype)
    pairs = sum(served)
    without = _steps(recipe, False, monkeypatch, dtype)
    assert sum(served) == pairs  # none in the second run
    for (ya, dxa, ga), (yb, dxb, gb) in zip(with_pairs, without, strict=True):
        assert torch.equal(ya, yb) and torch.equal(dxa, dxb)
        assert all(torch.equal(a, b) for a, b in zip(ga, gb, strict=True))
    if recipe in ONE_LAUNCH:
        assert pairs > 0, served
