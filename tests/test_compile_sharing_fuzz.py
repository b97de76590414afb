"""The compile-sharing pass (``fp4gen.runtime.compile_sharing``) on generated wirings: random
modules of fp4gen Linears reading the input, views of it (slices, reshapes and their
round trips), exact elementwise results of it (scaled by powers of two, sums, concatenations)
and other layers' outputs, compiled by inductor on the CPU. Whatever the pass merges, every
output and weight gradient must be eager's bit for bit: a layer handed another value's copy
(as inductor's buffer reuse once caused, test_compile_sharing.py) gives other bits.

Each wiring is exact outside fp4gen's ops: a value a layer made is read once (a gradient summed
over two readers would be summed in inductor's order, and its layer's weight gradient would
differ by the rounding), values made from x alone any number of times (only x's gradient sums
them: compared to the rounding of that sum). nvfp4_small's gradients round stochastically,
from the same streams in both runs (fresh models, the same call counts).
``FP4GEN_WIRING_SEEDS=N`` runs N more seeds (40 passed when it was written)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from torch import nn

import fp4gen

RECIPES = ("fp8_blockwise", "nvfp4_no_sr", "mxfp8", "nvfp4_small")
TOKENS, WIDE, NARROW = 16, 128, 64


def wiring(rng: random.Random) -> list[tuple]:
    """A random plan: steps over values (0 is x, [TOKENS, WIDE]); each step makes one value.
    ("linear", src, view, out), ("scale", src, power), ("add", a, b), ("cat", a, b)."""
    widths = [WIDE]
    pure = [True]  # made from x alone (may be read again)
    read: set[int] = set()
    steps: list[tuple] = []

    def readable(i: int) -> bool:
        return pure[i] or i not in read

    for _ in range(rng.randint(4, 9)):
        choices = [i for i in range(len(widths)) if readable(i)]
        kind = rng.choice(["linear", "linear", "linear", "scale", "add", "cat"])
        src = rng.choice(choices)
        if kind == "linear":
            view = rng.choice(["same", "same", "reshape", "first_half"] if widths[src] == WIDE
                              else ["same", "reshape"])  # fmt: skip
            width_in = NARROW if view == "first_half" else widths[src]
            out = rng.choice([NARROW, WIDE])
            steps.append(("linear", src, view, width_in, out))
            widths.append(out)
            pure.append(False)
        elif kind == "scale":
            steps.append(("scale", src, rng.choice([0.5, 2.0, 4.0])))
            widths.append(widths[src])
            pure.append(pure[src])
        else:
            partners = [i for i in choices if i != src or pure[i]]
            other = rng.choice(partners)
            if kind == "add" and widths[other] != widths[src]:
                continue
            if kind == "cat" and widths[src] + widths[other] > WIDE:
                continue
            if not pure[src] and src == other:
                continue
            steps.append((kind, src, other))
            widths.append(widths[src] if kind == "add" else widths[src] + widths[other])
            pure.append(pure[src] and pure[other])
            read.add(other)
        read.add(src)
    return steps


class Wiring(nn.Module):
    """The module a plan describes: its layers made in order from one seed."""

    def __init__(self, steps: list[tuple], recipes: list[str]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.steps = steps
        self.layers = nn.ModuleList(
            fp4gen.nn.Linear(s[3], s[4], recipe=r, seed=n, name=f"l{n}")
            for n, (s, r) in enumerate(
                zip([s for s in steps if s[0] == "linear"], recipes, strict=True)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, read, layers = [x], set(), iter(self.layers)
        for step in self.steps:
            kind, src = step[0], values[step[1]]
            read.add(step[1])
            if kind == "linear":
                view = step[2]
                if view == "reshape":  # a round trip through another shape: the same layout
                    src = src.reshape(2, -1, src.shape[-1]).reshape(-1, src.shape[-1])
                elif view == "first_half":
                    src = src[:, :NARROW]
                values.append(next(layers)(src))
            elif kind == "scale":
                values.append(src * step[2])
            else:
                read.add(step[2])
                other = values[step[2]]
                values.append(src + other if kind == "add" else torch.cat([src, other], -1))
        unread = [v for i, v in enumerate(values) if i not in read and i > 0] or values[-1:]
        return torch.cat([v[:, :NARROW] for v in unread], -1)


def _step(model: nn.Module, run, x: torch.Tensor):
    x_in = x.clone().requires_grad_(True)
    y = run(x_in)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)) * 0.01)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return y.detach(), x_in.grad, grads


SEEDS = list(range(3)) + list(range(100, 100 + int(os.environ.get("FP4GEN_WIRING_SEEDS", 0))))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_compiled_wiring_gives_eager_bits(seed: int) -> None:
    rng = random.Random(seed)
    steps = wiring(rng)
    recipes = [rng.choice(RECIPES) for s in steps if s[0] == "linear"]
    assert any(s[0] == "linear" for s in steps) or pytest.skip("a wiring without layers")
    x = torch.randn(TOKENS, WIDE, generator=torch.Generator().manual_seed(seed))
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = Wiring(steps, recipes)
        results.append(_step(model, torch.compile(model) if compiled else model, x))
    torch._dynamo.reset()
    (y0, dx0, g0), (y1, dx1, g1) = results
    assert torch.equal(y0, y1), steps
    assert g0.keys() == g1.keys()
    for name in g0:
        if name.endswith("weight"):
            assert torch.equal(g0[name], g1[name]), (name, steps)
        else:  # a bias gradient: dy summed over the tokens, in inductor's order
            torch.testing.assert_close(g1[name], g0[name], rtol=1e-6, atol=1e-7)
    if dx0 is not None:  # x's gradient sums its readers' in inductor's order: 8 ulps of the max
        scale = float(dx0.abs().max())
        torch.testing.assert_close(dx1, dx0, rtol=0, atol=8 * scale * 2**-23)
