"""Conformance of the experts' GEMMs (docs/numerics.md 6.2) on the CPU, as tests/test_conformance.py
checks fp4gen.nn.Linear, with its bound: for every expert of a projection run grouped
(fp4gen.runtime.grouped: torch._grouped_mm on fp32 block values) and expert by expert on the
float64 reference path (the CPU default), y, dx, dW and db of each expert against

(a) the reference path: within 2 (K + 8) u sum |a b| entry-wise (fp32 summation order, both
    sides) plus one rounding of each side to the output dtype;
(b) plain fp32 math (y = x W^T + b, dx = dy W, dW = dy^T x, db = sum dy): the Frobenius
    conformance bound sqrt(V) + ||D||_F of the expert's operands under the recipe's specs.

Unequal groups (37, 0, 5 and 60 tokens), with the biases and transposed weights of gpt-oss."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import fp4gen
from fp4gen.runtime.grouped import GroupedProjection, Groups

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_conformance import GEMMS, U32, UNIT, error_model, gemm_bound, lcm_k  # noqa: E402
from test_moe import build, experts_of  # noqa: E402

COUNTS = [37, 0, 5, 60]  # tokens per expert: an empty expert, very unequal groups


def projection_runs(arch: str, recipe: str, proj: int):
    """(module, x, dy, grouped run, reference run): each run is (y, dx, dW, db) for one
    projection of the first experts module over the groups of COUNTS."""
    modules = [experts_of(fp4gen.convert(build(arch), recipe, seed=3)) for _ in range(2)]
    lay = modules[0].layout
    fan_in = lay.hidden if proj == 0 else lay.inner
    fan_out = lay.up_features if proj == 0 else lay.hidden
    g = torch.Generator().manual_seed(11)
    x = torch.randn(sum(COUNTS), fan_in, generator=g)
    dy = torch.randn(sum(COUNTS), fan_out, generator=g)
    hit = [e for e, n in enumerate(COUNTS) if n]
    runs = []
    for module, grouped in zip(modules, (True, False), strict=True):
        module.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        weight = getattr(module, lay.weights[proj])
        bias = None if lay.biases is None else getattr(module, lay.biases[proj])
        if grouped:
            groups = Groups(
                hit,
                [COUNTS[e] for e in hit],
                [module.gemms[e][proj] for e in hit],
                lay.transposed,
                torch.float32,
                "experts",
            )
            y = GroupedProjection.apply(xi, weight, bias, groups)
        else:
            ys, start = [], 0
            for e in hit:
                ys.append(module._gemm(e, proj, xi[start : start + COUNTS[e]]))
                start += COUNTS[e]
            y = torch.cat(ys)
        y.backward(dy)
        db = None if bias is None else bias.grad
        runs.append((y.detach(), xi.grad, weight.grad, db))
    return modules[0], x, dy, runs[0], runs[1]


def bound_of(table, name: str, a: torch.Tensor, b: torch.Tensor):
    _, op_a, op_b = next(gm for gm in GEMMS if gm[0] == name)
    spec_a, spec_b = getattr(table, op_a.name.lower()), getattr(table, op_b.name.lower())
    unit = lcm_k(spec_a, spec_b)
    k = -(-a.shape[1] // unit) * unit
    return gemm_bound(
        error_model(a.contiguous(), spec_a, {}, k), error_model(b.contiguous(), spec_b, {}, k)
    )


def ratios(got: torch.Tensor, ref: torch.Tensor, bound, shift=None) -> tuple[float, float]:
    """(error against the reference path / its bound, error against fp32 math / its bound)."""
    f, r = got.double(), ref.double()
    unit = U32  # fp32 outputs
    limit = 2 * (bound.exact.shape[1] + 8) * U32 * bound.magnitude
    limit = limit + unit * (f.abs() + r.abs()) / (1 - unit)
    to_ref = float(((f - r).abs() / limit.clamp_min(1e-300)).max())
    exact = bound.exact if shift is None else bound.exact + shift
    fixed = bound.fixed + (unit + 8 * U32) * exact.abs()
    to_fp32 = float((f - exact).norm()) / (math.sqrt(bound.variance) + float(fixed.norm()))
    return to_ref, to_fp32


@pytest.mark.parametrize("recipe", ["nvfp4_no_bf16", "mxfp8"])
@pytest.mark.parametrize("proj", [0, 1], ids=["up", "down"])
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_grouped_experts_conform(arch: str, proj: int, recipe: str) -> None:
    module, x, dy, got, ref = projection_runs(arch, recipe, proj)
    lay = module.layout
    table = module.operands
    weight = getattr(module, lay.weights[proj]).detach()
    bias = None if lay.biases is None else getattr(module, lay.biases[proj]).detach()
    worst = 0.0
    start = 0
    for e, n in enumerate(COUNTS):
        rows = slice(start, start + n)
        start += n
        dw_got, dw_ref = got[2][e], ref[2][e]
        if lay.transposed:
            dw_got, dw_ref = dw_got.t(), dw_ref.t()
        if n == 0:  # no tokens: no gradient, as the loop
            assert not dw_got.any() and not dw_ref.any()
            continue
        w = (weight[e].t() if lay.transposed else weight[e]).double()
        xe, dye = x[rows].double(), dy[rows].double()
        shift = None if bias is None else bias[e].double()
        checks = [
            ratios(got[0][rows], ref[0][rows], bound_of(table, "fprop", xe, w), shift),
            ratios(got[1][rows], ref[1][rows], bound_of(table, "dgrad", dye, w.t())),
            ratios(dw_got, dw_ref, bound_of(table, "wgrad", dye.t(), xe.t())),
        ]
        for what, (to_ref, to_fp32) in zip(("y", "dx", "dW"), checks, strict=True):
            assert to_ref <= 1 and to_fp32 <= 1, (e, what, to_ref, to_fp32)
            worst = max(worst, to_fp32)
        if bias is not None:  # db: a plain fp32 sum of dy, per expert, on both paths
            want = dye.sum(0)
            limit = n * U32 * dye.abs().sum(0) + UNIT[torch.float32] * want.abs()
            assert torch.equal(got[3][e], ref[3][e])
            assert float(((got[3][e].double() - want).abs() / limit).max()) <= 1
    assert worst > 0.3  # not vacuous: quantized GEMMs measure 0.6 to 0.8 of the bound here
