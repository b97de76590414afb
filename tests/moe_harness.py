"""The recipe fuzzer's comparison (tests/test_recipe_fuzz_gpu.py, "Three training steps against
the reference path") for an experts module: one forward and backward of a ``GroupedExperts``
with every expert GEMM's operands recorded and every product checked and handed on.

``harnessed_run(module, hidden, index, weights, check=...)`` runs the module under ``Harness``:

- **Operands.** Every expert GEMM's two quantized operands (codes, scales and global scale of
  each, on the CPU) are recorded under (the expert's GEMM layer name, "fprop" / "dgrad" /
  "wgrad", the layer's call count): on the per-expert loop at its ``fp4gen.gemm`` call (the
  layer found from the ``forward_gemm`` / ``backward_gemms`` call it is in), on the grouped path
  at ``fp4gen.runtime.grouped.observe_pair``. Two runs are then compared key by key, bit for
  bit (``operand_differences``): a failure names the first GEMM, in the reference run's order,
  whose operands differ, and which of its pieces.
- **Products.** Each product is checked against the float64 product of the same block values
  (with ``check``): a loop GEMM within the bound of docs/numerics.md 6 as the fuzzer states it
  (``gemm_bound_ratio``); a grouped product within the fp32 summation bound (K + 8) u sum |a b|
  per group, plus, for the default BF16 grouped product on CUDA, one rounding to bf16 of the
  accumulator (2^-8 of |product| + the bound, times 1 + 2^-9 for the bound's own rounding).
- **Hand-on.** Then every GEMM returns the same value on every path and device: the float64
  product of the block values (computed on the CPU) rounded once to fp32, followed by the
  shared dense epilogue (``fp4gen.runtime.epilogue``: global scales, bias, one rounding to the
  output dtype), which is what the grouped path's epilogue computes from that product. So the
  downstream operands (the down projection's input, the gradients) are the same values in both
  runs, and a difference found is a quantize's, never a product's summation order.
- **Glue on the CPU** (``glue_on_cpu``, for a CUDA run against a CPU run): the epilogue, the
  activation and the bias gradients' sums run on the CPU, so that torch's elementwise kernels
  (sigmoid, fused multiply-adds) and reductions, which may differ in the last bit between CPU
  and CUDA, do not move an operand. What remains on the device is exact on both (gathers,
  correctly rounded products by the routing weights, ``index_add_`` of top-2 into zeros)
  except the routing weights' gradient, a torch reduction over the hidden size
  (``routing_grad_close``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import fp4gen.gemm_dispatch as gd
import fp4gen.runtime.grouped as grouped
import fp4gen.runtime.linear as linear
from fp4gen.numerics.quantize import QuantizedTensor
from fp4gen.runtime import epilogue, ops
from fp4gen.runtime.experts import GroupedExperts, _ExpertGemm
from fp4gen.runtime.operands import _values as operand_values
from fp4gen.settings import LAYER_GRAPHS_VAR, LAYER_GROUPS_VAR

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_conformance import U32, environment  # noqa: E402
from test_recipe_fuzz_gpu import bits, gemm_bound_ratio, operand_pieces  # noqa: E402

# the two operands of each GEMM, as the messages name them
OPERAND_NAMES = {
    "fprop": ("activation", "weight"),
    "dgrad": ("gradient", "weight"),
    "wgrad": ("gradient", "activation"),
}
PIECES = ("codes", "scales", "global scale")
Key = tuple[str, str, int]  # (expert GEMM layer, GEMM, call)


@dataclass
class Harness:
    """What one harnessed run recorded: operands per GEMM key (in the order met), the products
    beyond their bound, and how many products were checked."""

    check: bool
    glue_on_cpu: bool
    operands: dict[Key, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    checked: int = 0
    # (the loop) the GEMM keys of the forward_gemm / backward_gemms call now running
    _pending: list[list[Key]] = field(default_factory=list)

    def record(self, key: Key, a: QuantizedTensor, b: QuantizedTensor) -> None:
        if key in self.operands:
            self.problems.append(f"{describe(key)}: its operands were quantized twice")
        self.operands[key] = operand_pieces(a, b)


def describe(key: Key) -> str:
    name, gemm, call = key
    return f"{name} {gemm} (call {call})"


def exact_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T in float64 on the CPU (block values: every product exact, the sum almost always
    exact; the same on any device because it is computed on one)."""
    return a.detach().double().cpu() @ b.detach().double().cpu().transpose(-1, -2)


def sum_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(K + 8) u sum_k |a_k b_k| in float64: an fp32 sum of K exact products in any order
    against the float64 sum rounded once (docs/numerics.md 6)."""
    k = a.shape[-1]
    return (k + 8) * U32 * (a.detach().double().abs().cpu() @ b.detach().double().abs().cpu().t())


def _hand_on(harness: Harness, a: QuantizedTensor, b: QuantizedTensor, **kw: Any) -> torch.Tensor:
    """The value every path's GEMM returns (module docstring): fp32(float64 product of the
    block values), then the dense epilogue (on the CPU with ``glue_on_cpu``). Where that fp32
    product could overflow while the result does not (a pair with both global scales whose
    decoded values reach past fp32 at this K, ``gd.accumulator_overflow_reason``: the float64
    reference computes such GEMMs), the global scales are applied in float64 first."""
    c64 = exact_product(a.dequantize_blockwise(), b.dequantize_blockwise())
    scaled = (
        gd.accumulator_overflow_reason(a.format, b.format, a.cols) is not None
        and a.global_scale.numel() == b.global_scale.numel() == 1
    )
    if scaled:
        c64 = c64 * a.global_scale.double().cpu() * b.global_scale.double().cpu()
    c = c64.float()
    bias, accumulate = kw.get("bias"), kw.get("accumulate")
    if harness.glue_on_cpu:
        bias = None if bias is None else bias.detach().cpu()
        accumulate = None if accumulate is None else accumulate.detach().cpu()
    else:
        c = c.to(a.device)
    out_dtype = kw.get("out_dtype", torch.float32)
    y = epilogue.finish(
        epilogue.GemmProduct(c, scaled=scaled),
        a,
        b,
        bias=bias,
        accumulate=accumulate,
        out_dtype=out_dtype,
        backend="harness",
    )
    return y.to(a.device)


def _grouped_bound_check(
    harness: Harness, kind: str, got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ends: list
) -> torch.Tensor:
    """The grouped product ``got`` against the float64 one per group (module docstring); returns
    the float64 product [M, N] (rows) or [G, N, M] (k)."""
    starts = [0, *ends[:-1]]
    exact_groups = []
    bf16 = grouped.product_dtype(a.device) == torch.bfloat16
    for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
        ga, gb = (a[s:e], b[g]) if kind == "rows" else (a[:, s:e], b[:, s:e])
        exact = exact_product(ga, gb)
        exact_groups.append(exact)
        if not harness.check:
            continue
        bound = sum_bound(ga, gb)
        if bf16:
            bound = (bound + 2.0**-8 * (exact.abs() + bound)) * (1 + 2.0**-9)
        piece = got[s:e] if kind == "rows" else got[g]
        excess = (piece.double().cpu() - exact).abs() - bound
        harness.checked += 1
        if (excess > 0).any():
            harness.problems.append(
                f"grouped {kind} product, group {g}: {int((excess > 0).sum())} entries beyond "
                "the summation bound"
            )
    if kind == "rows":
        return torch.cat(exact_groups) if exact_groups else torch.zeros(0, b.shape[1])
    return torch.stack(exact_groups)


@contextlib.contextmanager
def harnessed(harness: Harness) -> Iterator[Harness]:
    """Every expert GEMM recorded, checked and handed on (module docstring) while inside."""
    real_gemm = linear.gemm
    real_forward, real_backward = _ExpertGemm.forward_gemm, _ExpertGemm.backward_gemms
    real_rows, real_k = grouped.group_rows, grouped.group_k
    real_operand_matmul = linear.operand_matmul

    def forward_gemm(self: _ExpertGemm, *args: Any, **kw: Any) -> Any:
        harness._pending.append([(self.name, "fprop", self.next_forward_call())])
        try:
            return real_forward(self, *args, **kw)
        finally:
            harness._pending.pop()

    def backward_gemms(self: _ExpertGemm, *args: Any, **kw: Any) -> Any:
        call = self._backward_calls
        harness._pending.append([(self.name, "dgrad", call), (self.name, "wgrad", call)])
        try:
            return real_backward(self, *args, **kw)
        finally:
            harness._pending.pop()

    def gemm(a: Any, b: Any, **kw: Any) -> torch.Tensor:
        quantized = isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor)
        if not (quantized and harness._pending and harness._pending[-1]):
            return real_gemm(a, b, **kw)
        key = harness._pending[-1].pop(0)  # dgrad, then wgrad (Linear._grads' order)
        harness.record(key, a, b)
        want = _hand_on(harness, a, b, **kw)
        out = kw.pop("out", None)
        if harness.check:
            choice = gd.auto_backend(a, b).backend
            # the product handed on is not the float64 reference's own rounding: a bound
            got = real_gemm(a, b, **kw)
            backend = "dequant" if choice == "reference" else choice
            ratio = gemm_bound_ratio(got, want, a, b, backend)
            harness.checked += 1
            if not ratio <= 1.0:
                harness.problems.append(f"{describe(key)} on {choice}: x{ratio:.3g} the bound")
        if out is not None:
            out.copy_(want)
            return out
        return want

    def operand_matmul(a: Any, b: Any) -> torch.Tensor:
        """A GEMM with an operand in high precision or MoR: the library's exact values and
        float64 sum, summed on the CPU whatever the device, so a CUDA run and a CPU run hand on
        the same product (the sum of exact values in float64 may round differently in another
        order)."""
        if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
            return real_operand_matmul(a, b)
        va, vb = operand_values(a), operand_values(b)
        return (va.cpu() @ vb.cpu().t()).to(torch.float32).to(va.device)

    def observe_pair(layer: Any, gemm_name: str, call: int, a: Any, b: Any) -> None:
        harness.record((layer.name, gemm_name, call), a, b)

    def group_rows(a: torch.Tensor, b: torch.Tensor, ends: list, offs=None) -> torch.Tensor:
        got = real_rows(a, b, ends, offs) if harness.check else None
        return _grouped_bound_check(harness, "rows", got, a, b, list(ends)).float().to(a.device)

    def group_k(a: torch.Tensor, b: torch.Tensor, ends: list, offs=None) -> torch.Tensor:
        got = real_k(a, b, ends, offs) if harness.check else None
        return _grouped_bound_check(harness, "k", got, a, b, list(ends)).float().to(a.device)

    with (
        pytest.MonkeyPatch.context() as mp,
        environment(**{LAYER_GROUPS_VAR: "0", LAYER_GRAPHS_VAR: "0"}),
    ):
        mp.setattr(linear, "gemm", gemm)
        mp.setattr(linear, "operand_matmul", operand_matmul)
        mp.setattr(_ExpertGemm, "forward_gemm", forward_gemm)
        mp.setattr(_ExpertGemm, "backward_gemms", backward_gemms)
        mp.setattr(grouped, "observe_pair", observe_pair)
        mp.setattr(grouped, "group_rows", group_rows)
        mp.setattr(grouped, "group_k", group_k)
        if harness.glue_on_cpu:
            real_scaled, real_bias_grad = grouped._scaled, ops.bias_grad
            real_activation = GroupedExperts._activation

            def scaled(c, alpha, bias, out_dtype, *, rows=None):  # type: ignore[no-untyped-def]
                b = None if bias is None else bias.cpu()
                r = None if rows is None else rows.cpu()
                return real_scaled(c.cpu(), alpha.cpu(), b, out_dtype, rows=r).to(c.device)

            def bias_grad(dy: torch.Tensor, dtype: torch.dtype | None) -> Any:
                db = real_bias_grad(dy.cpu(), dtype)
                return None if db is None else db.to(dy.device)

            def activation(self: GroupedExperts, h: torch.Tensor) -> torch.Tensor:
                return real_activation(self, h.cpu()).to(h.device)

            mp.setattr(grouped, "_scaled", scaled)
            mp.setattr(ops, "bias_grad", bias_grad)
            mp.setattr(GroupedExperts, "_activation", activation)
        yield harness


@dataclass
class Result:
    """One harnessed forward and backward: the output, the gradients of the hidden states and
    the routing weights, every parameter's gradient, and what the harness recorded."""

    out: torch.Tensor
    dx: torch.Tensor
    routing_grad: torch.Tensor
    grads: dict[str, torch.Tensor]
    harness: Harness


def harnessed_run(
    module: torch.nn.Module,
    hidden: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    *,
    check: bool,
    glue_on_cpu: bool = False,
) -> Result:
    """``module``'s forward and backward (tests/test_moe.py's ``run``: a seeded upstream
    gradient) under a fresh ``Harness``; every tensor returned on the CPU."""
    hidden = hidden.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    with harnessed(Harness(check, glue_on_cpu)) as harness:
        # sliced experts (Llama 4's contract) take every expert's rows alone: no routing
        out = module(hidden) if sliced(module) else module(hidden, index, weights)
        g = torch.Generator().manual_seed(2)
        out.backward(torch.randn(out.shape, generator=g).to(out.device, out.dtype))
    grads = {n: p.grad.detach().cpu() for n, p in module.named_parameters() if p.grad is not None}
    assert hidden.grad is not None
    # sliced experts have no routing weights: their gradient stands in as an empty tensor
    routing = weights.grad.cpu() if weights.grad is not None else torch.zeros(0)
    assert sliced(module) or weights.grad is not None
    return Result(out.detach().cpu(), hidden.grad.cpu(), routing, grads, harness)


def sliced(module: torch.nn.Module) -> bool:
    """Whether ``module`` (converted or not) holds experts of the sliced contract."""
    layout = getattr(module, "layout", None)
    if layout is None:
        from fp4gen.runtime.experts import experts_layout

        layout = experts_layout(module)
    return bool(getattr(layout, "sliced", False))


def operand_differences(got: Harness, want: Harness) -> list[str]:
    """The GEMMs only one run made, and the first GEMM (in ``want``'s order) whose operands
    differ, naming its pieces (later differences follow from it)."""
    problems = [
        f"{describe(k)}: only in the run checked"
        for k in got.operands.keys() - want.operands.keys()
    ]
    problems += [
        f"{describe(k)}: missing from the run checked"
        for k in want.operands.keys() - got.operands.keys()
    ]
    for key, pieces in want.operands.items():
        if key not in got.operands:
            continue
        names = [f"{n} {p}" for n in OPERAND_NAMES[key[1]] for p in PIECES]
        bad = [
            n
            for n, x, y in zip(names, got.operands[key], pieces, strict=True)
            if not torch.equal(x, y)
        ]
        if bad:
            problems.append(f"{describe(key)}: operand {', '.join(bad)} differ")
            break
    return problems


def result_differences(got: Result, want: Result, *, routing_exact: bool = True) -> list[str]:
    """The results that are not bit for bit the same (the routing weights' gradient within
    ``routing_grad_close`` where not ``routing_exact``)."""
    pairs = [("the output", got.out, want.out), ("dx", got.dx, want.dx)]
    if routing_exact or not routing_grad_close(got.routing_grad, want.routing_grad):
        pairs.append(("the routing weights' gradient", got.routing_grad, want.routing_grad))
    problems = [f"{n}: only one run has a gradient" for n in got.grads.keys() ^ want.grads.keys()]
    pairs += [
        (f"the gradient of {n}", got.grads[n], want.grads[n]) for n in want.grads if n in got.grads
    ]
    for name, a, b in pairs:
        if a.shape != b.shape or not torch.equal(bits(a), bits(b)):
            problems.append(f"{name} differs")
    return problems


def routing_grad_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The routing weights' gradient [T, k] of two devices: each entry is torch's sum over the
    hidden size H of the same bf16 products, accumulated in fp32 in each device's order and
    rounded once to bf16. Two fp32 orders differ by at most 2 (H - 1) 2^-24 sum |terms|
    (2^-17 sum |terms| for H = 64), each rounding by 2^-8 of its result: the limit is
    2^-8 (|a| + |b|) + 2^-12 max |entry|, whose second term covers the first whenever
    sum |terms| <= 32 max |entry| (measured on these tests' data: at most 4.5)."""
    if got.shape != want.shape:
        return False
    if not want.numel():  # sliced experts (Llama 4) have no routing weights: an empty stand-in
        return True
    a, b = got.double(), want.double()
    limit = 2.0**-8 * (a.abs() + b.abs()) + 2.0**-12 * b.abs().max()
    return bool(((a - b).abs() <= limit).all())
