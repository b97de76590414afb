"""The experts' grouped projection with every size on the device (the static MoE layer, step 2).

``grouped.GroupedProjection`` reads the routing's counts on the host: every table, buffer and
GEMM shape of a pass is sized from them, so the host waits for the router and no CUDA graph can
replay the layer for the next routing (docs/moe.md, "What the layer goals need").
``StaticProjection`` runs the same three GEMMs from device tensors alone:

- the routing is a ``StaticRoute``: the experts' row counts as a device tensor, and what the
  GEMMs need of them (each group's row ends, padded ends, each row's expert and its padded row),
  made by torch ops, no host read;
- the tokens' copies come from the static grouped launches (``grouped_quantize
  .quantize_groups_static``, ``grouped_tile.quantize_groups_tile_static``): the fprop rows as
  they are, the gradient's dgrad rows padded per group at the bound's length, the wgrad
  columns of the gradient and the activations side by side;
- the weights' copies do not depend on the routing: the grouped launches of every expert
  (``grouped.grouped_fprop_weights``, ``grouped_dgrad_weights``), whose tables are the same at
  every call;
- the products read the groups' ends from device memory: ``torch._grouped_mm`` on the decoded
  block values (NVFP4, MXFP4, MXFP8: exact in bf16), the grouped and K-grouped FP8 kernels on
  the codes (block-scaled FP8 pairs);
- the Philox offsets are device tensors (``StaticCalls``): STREAMS_PER_CALL x each expert's
  call count + the operand's slot, the value its layer's counter holds.

Each expert's operands, products and gradients are the grouped path's bit for bit for the same
seeds and call counts (tests/test_static_experts.py, on the GPU). What is not served raises
FP4GenError naming why (``static_reason``): there is no per-expert fallback, since a graph
cannot branch on the routing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fp4gen.dsl.model import Operand
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat, is_stochastic
from fp4gen.runtime import finite, ops
from fp4gen.runtime.grouped import (
    _batched,
    _fp8_pair,
    _scaled,
    grouped_dgrad_weights,
    grouped_fprop_weights,
    grouped_mm_available,
    grouped_tile_operands,
    pass_reason,
    product_dtype,
)
from fp4gen.runtime.grouped_quantize import quantize_groups_static
from fp4gen.runtime.grouped_static import DeviceGroups, device_groups
from fp4gen.runtime.grouped_tile import quantize_groups_tile_static
from fp4gen.runtime.layer_quantize import _transposable
from fp4gen.runtime.operand_slots import SLOT, STREAMS_PER_CALL, advance_devices
from fp4gen.runtime.operands import k_multiple


@dataclass(frozen=True)
class StaticRoute:
    """R routed rows (sorted by expert) over E experts, as device tensors of fixed shapes:
    ``groups`` (the counts, padded to the wgrad GEMM's K multiple), each expert's row ends and
    first rows (int32 [E] and [E + 1]) among the real rows and among the padded rows, each row's
    expert (int64 [R]) and padded row (int32 [R]), and which experts have rows (bool [E])."""

    groups: DeviceGroups
    ends: torch.Tensor
    offsets: torch.Tensor
    pad_ends: torch.Tensor
    pad_offsets: torch.Tensor
    row_expert: torch.Tensor
    padded_row: torch.Tensor
    present: torch.Tensor

    @property
    def experts(self) -> int:
        return self.groups.groups

    @property
    def rows(self) -> int:
        return self.groups.rows


def static_route(counts: torch.Tensor, rows: int, multiple: int) -> StaticRoute:
    """The ``StaticRoute`` of ``counts`` (int [E] on the device, summing to ``rows``: the
    caller's promise, as a routing's T k is) padded to ``multiple`` (the wgrad K multiple of the
    recipe: ``backward_multiple``)."""
    groups = device_groups(counts, rows, multiple)
    zero = torch.zeros(1, dtype=torch.int32, device=counts.device)
    ends = groups.in_rows + groups.counts
    pad_ends = groups.out_rows + groups.pads
    experts = torch.arange(groups.groups, device=counts.device)
    row_expert = torch.repeat_interleave(experts, groups.counts, output_size=rows)
    shift = (groups.out_rows - groups.in_rows).index_select(0, row_expert)
    padded_row = torch.arange(rows, dtype=torch.int32, device=counts.device) + shift
    return StaticRoute(
        groups,
        ends,
        torch.cat((zero, ends)),
        pad_ends,
        torch.cat((zero, pad_ends)),
        row_expert,
        padded_row.to(torch.int32),
        groups.counts > 0,
    )


def route_of(routing: Any, experts: int, rows: int) -> StaticRoute:
    """The ``StaticRoute`` of a ``grouped_static.DeviceRouting`` whose every slot is routed to
    one of these ``experts`` (its last group, the slots of no local expert, must be empty:
    asserted on the device, since no host may read it; an expert-parallel routing is not
    served yet)."""
    counts = routing.groups.counts
    torch._assert_async(
        counts[experts] == 0, "the static experts serve routings to local experts only"
    )
    return static_route(counts[:experts], rows, routing.groups.multiple)


@dataclass(frozen=True)
class StaticCalls:
    """What each expert's layer gives its stochastically rounded copies, as device tensors:
    its data seed (int64 [E]) and the forward and backward call counts of the pass (int64 [E]:
    what its layer's device counters hold)."""

    data_seeds: torch.Tensor
    forward: torch.Tensor
    backward: torch.Tensor

    def offsets(self, op: Operand, *, forward: bool) -> torch.Tensor:
        """Each expert's Philox offset of operand ``op``: STREAMS_PER_CALL x call + its slot
        (``operand_slots``), int64 [E]."""
        calls = self.forward if forward else self.backward
        return calls * STREAMS_PER_CALL + SLOT[op]


def static_calls(layers: list[Any], device: torch.device) -> StaticCalls:
    """``StaticCalls`` from the experts' layers' host counts (one copy; a graph's caller keeps
    the counts on the device instead)."""
    values = [
        [layer.data_seed for layer in layers],
        [layer._forward_calls for layer in layers],
        [layer._backward_calls for layer in layers],
    ]
    seeds, forward, backward = torch.tensor(values, dtype=torch.int64).to(device)
    return StaticCalls(seeds, forward, backward)


def backward_multiple(table: Any) -> int:
    """The wgrad GEMM's K multiple of ``table``: every expert's tokens are padded to it."""
    return k_multiple(table.wgrad_gradient, table.wgrad_activation, blocks=True)


def static_reason(table: Any, x: torch.Tensor, n_out: int, bias: bool) -> str | None:
    """None where ``StaticProjection`` serves a projection of ``table``'s operands for input
    ``x`` [R, K] and ``n_out`` outputs here; else why not (``table_reason``, then the device)."""
    from fp4gen.compiler.jit import detect_arch

    reason = table_reason(table, x.shape[1], n_out, bias)
    if reason is not None:
        return reason
    if not x.is_cuda:
        return f"{x.device.type.upper()} tensors (the static launches run on CUDA)"
    if detect_arch(x.device) != "sm_90a":
        return "the static products are built for sm_90a (Hopper) only"
    fp8 = any(_fp8_pair(*pair) for pair in _pairs(table))
    if not fp8 and (not grouped_mm_available() or product_dtype(x.device) != torch.bfloat16):
        return "the grouped product is not torch._grouped_mm in bf16 (set_grouped_product)"
    return None


def table_reason(table: Any, k: int, n_out: int, bias: bool) -> str | None:
    """None where the static projection serves ``table``'s operands for K = ``k`` inputs and
    ``n_out`` outputs on some device; else why not."""

    reason = pass_reason(table)
    if reason is not None:
        return reason
    if bias:
        return "a bias (its gradient is summed per expert on the host's groups)"
    for op in (Operand.FPROP_WEIGHT, Operand.DGRAD_WEIGHT):
        spec = table[op]
        if is_stochastic(spec.rounding) or spec.format.scale.rounding == "stochastic":
            return f"{op.selector} rounds stochastically (the weights' launches take host offsets)"
    dgrad, wgrad = table.dgrad_gradient, table.wgrad_gradient
    if dgrad.format != wgrad.format or dgrad.global_scope != wgrad.global_scope:
        return "dgrad.gradient and wgrad.gradient differ in format or scope (one tile launch)"
    # whole blocks and RHT chunks along both GEMMs' K: the launches pad no columns
    fprop_k = k_multiple(table.fprop_activation, table.fprop_weight, blocks=True)
    dgrad_k = k_multiple(table.dgrad_gradient, table.dgrad_weight, blocks=True)
    if k % fprop_k or n_out % dgrad_k:
        return (
            f"K = {k} and N = {n_out} are not multiples of {fprop_k} and {dgrad_k} (the static "
            "launches take no padded columns)"
        )
    return None


def _pairs(table: Any) -> tuple[tuple[Any, Any], ...]:
    return (
        (table.fprop_activation, table.fprop_weight),
        (table.dgrad_gradient, table.dgrad_weight),
        (table.wgrad_gradient, table.wgrad_activation),
    )


def _whole(fmt: BlockFormat, spec: Any, data, scales, global_scale, shape, dtype) -> Any:
    """One QuantizedTensor over a static launch's codes and scales (a decode reads no global
    scale; the FP8 kernels take the groups' S_dec on their own)."""
    from fp4gen.runtime import cute_backend

    pieces = {"data": data, "scales": scales, "global_scale": global_scale}
    return cute_backend._quantized(
        pieces, "", fmt, shape[1], spec.rounding, spec.rht, 0, 0, torch.Size(shape), dtype
    )


def _decoded(q: Any) -> torch.Tensor:
    """The block values of a whole copy in bf16 (one decode launch)."""
    from fp4gen.runtime.dequant import dequantize_bf16

    return dequantize_bf16(q)[:, : q.cols]


def _present(scales: torch.Tensor, route: StaticRoute) -> torch.Tensor:
    """The groups' S_dec, fp32 [E], 1.0 for an expert without rows (its launch wrote none;
    its product is all zeros and stays so)."""
    return torch.where(route.present, scales.float(), 1.0).contiguous()


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    with torch.autocast(a.device.type, enabled=False):
        return torch._grouped_mm(a, b, offs=offs)


def _fp8_rows(
    a: Any, b: Any, s_a: torch.Tensor, s_b: torch.Tensor, offsets: torch.Tensor, rows: int,
    experts: int, out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """C [rows, N] = every expert's A_g B_g^T rows by one launch of the grouped FP8 kernel
    (``fp8_grouped``): A's codes and scales every row's, B's every expert's [N, K], the groups'
    first rows ``offsets`` on the device. Rows past the groups' last are not written."""
    from fp4gen.runtime import fp8_gemm
    from fp4gen.runtime.fp8_gemm import code_bytes, cute_scales, round_up
    from fp4gen.runtime.fp8_grouped import grid_limit, grouped_plan

    plan = grouped_plan(a.format, b.format, out_dtype, False)
    n, k = b.rows // experts, b.cols
    kp = round_up(k, plan.block_k)
    c = torch.empty((rows, n), dtype=plan.kernel_out, device=s_a.device)
    args = [
        code_bytes(a, rows, kp),
        cute_scales(a, plan.ue8m0),
        code_bytes(b, b.rows, kp),
        cute_scales(b, plan.ue8m0),
        s_a,
        s_b,
        offsets,
        c,
        grid_limit(None, s_a.device),
    ]
    fp8_gemm.cute_kernel(plan.params)(*args)
    return c if c.dtype == out_dtype else c.to(out_dtype)


def _weights_of(groups: Any, what: str, got: Any) -> Any:
    if got is None or getattr(got, "whole", None) is None or got.global_scales is None:
        raise FP4GenError(
            f"{groups.name}: the static projection needs the experts' {what} from one grouped "
            "launch, which does not serve them here (see the log for why)"
        )
    return got


def weight_copies(weight: torch.Tensor, groups: Any, *, dgrad: bool) -> tuple[Any, Any]:
    """Every expert's fprop weight operand and, with ``dgrad``, its dgrad weight operand
    where that is the transpose of 2D fprop codes (``layer_quantize._transposable``): both
    copies from one grouped tile launch, which reads the weights once (else None: the
    backward quantizes its own, ``grouped.grouped_dgrad_weights``)."""

    table = groups.layers[0].operands
    if dgrad and _transposable(table.fprop_weight, table.dgrad_weight):
        w = _batched(weight, groups, transposed=groups.transposed)
        counts = [w.shape[0] // len(groups.experts)] * len(groups.experts)
        ops_ = ((Operand.FPROP_WEIGHT, "rowwise"), (Operand.DGRAD_WEIGHT, "columnwise"))
        got = grouped_tile_operands(w, groups, ops_, counts, counts, forward=True)
        if got is not None and got.wholes and got.global_scales is not None:
            return got.copy(0), got.copy(1)
    k = weight.shape[1] if groups.transposed else weight.shape[2]
    fprop = grouped_fprop_weights(weight, groups, k)
    return _weights_of(groups, "fprop weights", fprop), None


def static_fprop(
    x: torch.Tensor,
    weight: torch.Tensor,
    route: StaticRoute,
    calls: StaticCalls,
    groups: Any,
    weights: Any = None,
) -> torch.Tensor:
    """y [R, out] in ``groups.out_dtype``: every row's expert GEMM, as ``grouped._fprop``
    computes it for the same seeds and calls; ``groups``: a ``grouped.Groups`` of every expert
    (its layers say the operands, seeds and the weights' calls); ``weights``: the fprop weight
    operands where the caller has them (``weight_copies``)."""

    table = groups.layers[0].operands
    spec = table.fprop_activation
    experts, rows = route.experts, route.rows
    xq = quantize_groups_static(
        x,
        route.groups,
        spec.format,
        rounding=spec.rounding,
        rht=spec.rht,
        seeds=calls.data_seeds,
        offsets=calls.offsets(Operand.FPROP_ACTIVATION, forward=True),
        scope=spec.global_scope,
    )
    w_ops = weight_copies(weight, groups, dgrad=False)[0] if weights is None else weights
    w = w_ops.whole
    s_x = _present(xq.global_scales, route)
    s_w = w_ops.global_scales.float().reshape(-1)
    shape = (rows, x.shape[1])
    xw = _whole(spec.format, spec, xq.data, xq.scales, xq.global_scales[0], shape, x.dtype)
    if _fp8_pair(spec, table.fprop_weight):
        return _fp8_rows(xw, w, s_x, s_w.contiguous(), route.offsets, rows, experts,
                         groups.out_dtype)  # fmt: skip
    n = w.rows // experts
    c = _grouped_mm(_decoded(xw), _decoded(w).view(experts, n, -1).transpose(1, 2), route.ends)
    alpha = (s_x * s_w).index_select(0, route.row_expert)
    return _scaled(c, alpha, None, groups.out_dtype)


def static_grads(
    x: torch.Tensor,
    weight: torch.Tensor,
    dy: torch.Tensor,
    route: StaticRoute,
    calls: StaticCalls,
    groups: Any,
    weights: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx [R, in] (x's dtype) and dW (the weight's shape and dtype) as ``grouped._grads``
    computes them for the same seeds and calls (an expert without rows: dW zero);
    ``weights``: the dgrad weight operands where the forward made them (``weight_copies``)."""
    from fp4gen.runtime.fp8_kgrouped import k_grouped_sides

    table = groups.layers[0].operands
    experts = route.experts
    n_out, n_in = dy.shape[1], x.shape[1]
    g_row, g_col = table.dgrad_gradient, table.wgrad_gradient
    offsets = torch.stack(
        (
            calls.offsets(Operand.DGRAD_GRADIENT, forward=False),
            calls.offsets(Operand.WGRAD_GRADIENT, forward=False),
        ),
        1,
    )
    dyq = quantize_groups_tile_static(
        dy,
        route.groups,
        g_row.format,
        (("rowwise", g_row.rounding, g_row.rht), ("columnwise", g_col.rounding, g_col.rht)),
        seeds=calls.data_seeds,
        offsets=offsets,
        scope=g_row.global_scope,
    )
    xs = table.wgrad_activation
    xq = quantize_groups_tile_static(
        x,
        route.groups,
        xs.format,
        (("columnwise", xs.rounding, xs.rht),),
        seeds=calls.data_seeds,
        offsets=calls.offsets(Operand.WGRAD_ACTIVATION, forward=False)[:, None],
        scope=xs.global_scope,
    )
    if weights is None:
        weights = grouped_dgrad_weights(weight, groups, n_out)
    w_ops = _weights_of(groups, "dgrad weights", weights)
    w_cols = w_ops.whole
    bound = route.groups.bound
    dy_rows = _whole(g_row.format, g_row, dyq.codes[0], dyq.scales[0], dyq.global_scales[0, 0],
                     (bound, n_out), dy.dtype)  # fmt: skip
    dy_side = _whole(g_col.format, g_col, dyq.codes[1], dyq.scales[1], dyq.global_scales[0, 1],
                     (n_out, bound), dy.dtype)  # fmt: skip
    x_side = _whole(xs.format, xs, xq.codes[0], xq.scales[0], xq.global_scales[0, 0],
                    (n_in, bound), x.dtype)  # fmt: skip
    s_dgrad = _present(dyq.global_scales[:, 0], route)
    s_wgrad = _present(dyq.global_scales[:, 1], route)
    s_x = _present(xq.global_scales[:, 0], route)
    s_w = w_ops.global_scales.float().reshape(-1).contiguous()
    # dgrad: every expert's padded gradient rows, then each real row taken from its padded one
    if _fp8_pair(g_row, table.dgrad_weight):
        c = _fp8_rows(dy_rows, w_cols, s_dgrad, s_w, route.pad_offsets, bound, experts, x.dtype)
        dx = c.index_select(0, route.padded_row)
    else:
        w_vals = _decoded(w_cols).view(experts, n_in, -1).transpose(1, 2)
        c = _grouped_mm(_decoded(dy_rows), w_vals, route.pad_ends)
        alpha = (s_dgrad * s_w).index_select(0, route.row_expert)
        dx = _scaled(c, alpha, None, x.dtype, rows=route.padded_row)
    # wgrad: the experts' token columns side by side, grouped along K
    if _fp8_pair(g_col, xs):
        dw = k_grouped_sides(dy_side, x_side, (s_wgrad, s_x), route.pad_offsets, experts,
                             weight.dtype)  # fmt: skip
    else:
        c = _grouped_mm(_decoded(dy_side), _decoded(x_side).t(), route.pad_ends)
        per_row = (s_wgrad * s_x).repeat_interleave(n_out, output_size=experts * n_out)
        dw = _scaled(c.reshape(experts * n_out, n_in), per_row, None, weight.dtype)
        dw = dw.view(experts, n_out, n_in)
    if groups.transposed:
        dw = dw.transpose(1, 2)
    return dx, dw.contiguous()


class StaticProjection(torch.autograd.Function):
    """y = x_e W_e^T for every expert's rows of ``x`` (sorted by expert, ``route``), every
    size on the device (module docstring). ``groups``: a ``grouped.Groups`` of every expert;
    ``counted``: the pass advances every expert layer's call counts (``count_pass``), as a
    layer's own pass does; else the counts are the caller's (``calls``)."""

    @staticmethod
    def forward(ctx: Any, x, weight, route: StaticRoute, calls: StaticCalls, groups: Any,
                counted: bool):  # type: ignore[override]  # fmt: skip
        if x.dim() != 2 or x.shape[0] != route.rows or weight.shape[0] != route.experts:
            raise TensorError(
                f"{groups.name}: x of shape {tuple(x.shape)} and weight of shape "
                f"{tuple(weight.shape)} for a route of {route.rows} rows over {route.experts} "
                "experts; expected [rows, in] and [experts, ...]"
            )
        n_out = weight.shape[2] if groups.transposed else weight.shape[1]
        reason = static_reason(groups.layers[0].operands, x, n_out, bias=False)
        if reason is not None:
            raise FP4GenError(f"{groups.name}: the static projection does not serve {reason}")
        x = x.contiguous()
        with finite.layer_scope():
            # the dgrad weights too where one launch writes both copies (dx is asked for)
            w_fprop, w_dgrad = weight_copies(weight, groups, dgrad=ctx.needs_input_grad[0])
            y = static_fprop(x, weight, route, calls, groups, w_fprop)
        if counted:
            count_pass(groups.layers, forward=True)
        ctx.save_for_backward(x, weight)
        ctx.route, ctx.calls, ctx.groups, ctx.counted = route, calls, groups, counted
        ctx.w_dgrad = w_dgrad
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        groups = ctx.groups
        if torch.is_grad_enabled():
            raise ops.double_backward_error(groups.name)
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        with finite.layer_scope():
            ops.check_output_grad(groups.name, dy)
            dx, dw = static_grads(x, weight, dy, ctx.route, ctx.calls, groups, ctx.w_dgrad)
        ctx.w_dgrad = None
        if ctx.counted:
            count_pass(groups.layers, forward=False)
        return dx, dw, None, None, None, None


def count_pass(layers: list[Any], *, forward: bool) -> None:
    """One forward (or backward) call of every expert layer, routed or not: the host counts
    and, in one launch, the device counters (what a CUDA graph's replay advances)."""

    key = "_forward_calls" if forward else "_backward_calls"
    for layer in layers:
        layer.__dict__[key] += 1
    advance_devices(layers, forward=forward)


def counter_calls(layers: list[Any], device: torch.device, seeds: torch.Tensor) -> StaticCalls:
    """``StaticCalls`` read from the expert layers' device counters (made from their host
    counts on the first eager call: ``OperandSlots._philox_counter``), so that a graph's
    replay reads the counts of its own pass."""
    forward = torch.cat([layer._philox_counter(True, device) for layer in layers])
    backward = torch.cat([layer._philox_counter(False, device) for layer in layers])
    return StaticCalls(seeds, forward, backward)


def static_projection(
    x: torch.Tensor,
    weight: torch.Tensor,
    route: StaticRoute,
    calls: StaticCalls,
    groups: Any,
    *,
    counted: bool = False,
) -> torch.Tensor:
    """``StaticProjection.apply``: the experts' projection of ``x`` with every size on the
    device."""
    return StaticProjection.apply(x, weight, route, calls, groups, counted)


__all__ = [
    "StaticCalls",
    "StaticProjection",
    "StaticRoute",
    "backward_multiple",
    "count_pass",
    "counter_calls",
    "route_of",
    "static_calls",
    "static_fprop",
    "static_grads",
    "static_projection",
    "static_reason",
    "table_reason",
    "weight_copies",
]
