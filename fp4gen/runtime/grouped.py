"""Grouped GEMMs of a Mixture-of-Experts layer: every expert's fprop, dgrad or wgrad in one call.

``GroupedProjection`` runs one projection (up or down) of every expert that has tokens: its operands
are quantized exactly as the per-expert loop quantizes them (each expert's operands with its own
seed, Philox offset and global scale, or with the amax over every expert where the recipe says
``global per tensor``, ``fp4gen.runtime.grouped_scope``, by the same methods: on CUDA the 1xN
rowwise ones of every expert in one grouped quantize, ``grouped_operands``, and, with the grouped
tile quantize turned on, the wgrad copies and 2D weights in one grouped tile launch each,
``grouped_tile_operands``; the others by each expert's ``Linear``), then decoded to their block
values (element x block scale, exact in bf16 for NVFP4, MXFP4, MXFP6 and MXFP8: on CUDA by the
generated dequantize kernel, elsewhere by ``QuantizedTensor.dequantize_blockwise``) and
multiplied by ONE ``torch._grouped_mm`` call per GEMM (fprop: tokens x weights per expert; dgrad:
gradients x weights; wgrad: gradients^T x activations, grouped along the token dimension). The
per-expert global scales, the bias and the rounding to the output dtype are the dense epilogue's
(``fp4gen.runtime.epilogue``: y = fp32(C S_a S_b) + bias, rounded once), applied per group.

What the product is (``product_dtype``):

- CUDA: ``torch._grouped_mm`` in BF16, whose fast kernel (sm_90a, sm_100a) writes BF16 only:
  the fp32 accumulator of each group's exact products is rounded once to BF16 before the
  epilogue multiplies by the global scales. Against the per-expert loop that is one more
  rounding of relative size at most 2^-8 per element of the product (docs/moe.md, "Grouped
  GEMMs"); the operands are the same bits. ``set_grouped_product("fp32")`` takes a GEMM per
  group with an fp32 result instead: the loop's numbers up to fp32 summation order.
- CPU (and anything else): ``torch._grouped_mm`` in fp32 (the block values are exact in fp32),
  so the result equals the per-expert loop's dequantize path up to fp32 summation order.

Where this torch has no ``torch._grouped_mm``, or the call refuses the operands' layout, a loop
of ``torch.mm`` over the groups computes the same product (logged once).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from fp4gen.dsl.model import Operand
from fp4gen.errors import FP4GenError
from fp4gen.runtime import finite, ops
from fp4gen.runtime.grouped_quantize import GroupedOperands
from fp4gen.runtime.grouped_scale import scale_rows
from fp4gen.runtime.grouped_scope import BACKWARD_SLOTS, FORWARD_SLOTS, scoped_slots
from fp4gen.runtime.grouped_tile import padded_counts
from fp4gen.runtime.host_tables import host_table
from fp4gen.runtime.linear import Linear, recomputing
from fp4gen.runtime.operand_slots import advance_devices
from fp4gen.runtime.operands import k_multiple, pad_to, round_up

log = logging.getLogger(__name__)
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def grouped_mm_available() -> bool:
    """Whether this torch has ``torch._grouped_mm`` (tests turn it off to run the loop)."""
    return callable(getattr(torch, "_grouped_mm", None))


PRODUCTS = ("bf16", "fp32")
_product = ["bf16"]  # set_grouped_product


def set_grouped_product(precision: str) -> str:
    """What the grouped products are on CUDA: "bf16" (the default: torch._grouped_mm's fast
    kernel, each product rounded once to bf16 before the global scales) or "fp32" (a GEMM per
    group with an fp32 result, ``torch.mm(out_dtype=torch.float32)``: the per-expert loop's
    numbers up to fp32 summation order, one launch per expert). Process-wide, read at every
    call; returns the previous setting. The CPU's products are fp32 either way."""
    if precision not in PRODUCTS:
        raise FP4GenError(f"unknown grouped product {precision!r}; choose one of {PRODUCTS}")
    previous, _product[0] = _product[0], precision
    return previous


def product_dtype(device: torch.device) -> torch.dtype:
    """The dtype the grouped product is computed in on ``device`` (module docstring)."""
    return torch.bfloat16 if device.type == "cuda" and _product[0] == "bf16" else torch.float32


def _exact_on_cuda(a: torch.Tensor) -> bool:
    """Whether this product is the fp32 one on CUDA (``set_grouped_product("fp32")``): bf16
    block values (exact), one GEMM per group with fp32 accumulation and result."""
    return a.device.type == "cuda" and _product[0] == "fp32"


def group_rows(
    a: torch.Tensor, b: torch.Tensor, ends: Sequence[int], offs: torch.Tensor | None = None
) -> torch.Tensor:
    """C [M, N] with C[s:e] = a[s:e] @ b[g]^T for the groups of rows that end at ``ends`` (a
    [M, K], b [G, N, K]): fprop and dgrad. In the product's dtype (``product_dtype``: bf16 from
    ``torch._grouped_mm`` on CUDA, else fp32), C being the caller's; ``scale_rows`` finishes it.
    ``offs``: ``ends`` as an int32 tensor on a's device where the caller has it
    (``Groups.count_tables``)."""
    # autocast would round fp32 block values to 16 bits: the product keeps the types given
    with torch.autocast(a.device.type, enabled=False):
        return _group_rows(a, b, ends, offs)


def _group_rows(
    a: torch.Tensor, b: torch.Tensor, ends: Sequence[int], offs: torch.Tensor | None
) -> torch.Tensor:
    if _exact_on_cuda(a):
        a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
        out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
        start = 0
        for g, end in enumerate(ends):
            out[start:end] = torch.mm(a[start:end], b[g].t(), out_dtype=torch.float32)
            start = end
        return out
    dtype = product_dtype(a.device)
    a, b = a.to(dtype), b.to(dtype)
    if grouped_mm_available():
        if offs is None:
            offs = host_table(list(ends), torch.int32, a.device)
        try:
            return torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
        except (RuntimeError, ValueError) as err:  # a layout it refuses (stride alignment)
            _log_once(f"torch._grouped_mm refused the expert GEMM ({err}); a loop of torch.mm")
    else:
        _log_once("this torch has no torch._grouped_mm: the expert GEMMs run a loop of torch.mm")
    out = torch.empty((a.shape[0], b.shape[1]), dtype=dtype, device=a.device)
    start = 0
    for g, end in enumerate(ends):
        torch.mm(a[start:end], b[g].t(), out=out[start:end])
        start = end
    return out


def group_k(
    a: torch.Tensor, b: torch.Tensor, ends: Sequence[int], offs: torch.Tensor | None = None
) -> torch.Tensor:
    """C [G, N, M] with C[g] = a[:, s:e] @ b[:, s:e]^T for the groups of columns (the GEMM's
    K) that end at ``ends`` (a [N, K], b [M, K]): wgrad, K being the tokens. In the product's
    dtype, as ``group_rows``' (``offs`` too)."""
    with torch.autocast(a.device.type, enabled=False):
        return _group_k(a, b, ends, offs)


def _group_k(
    a: torch.Tensor, b: torch.Tensor, ends: Sequence[int], offs: torch.Tensor | None
) -> torch.Tensor:
    if _exact_on_cuda(a):
        a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
        out = torch.empty((len(ends), a.shape[0], b.shape[0]), dtype=torch.float32, device=a.device)
        start = 0
        for g, end in enumerate(ends):
            sa, sb = a[:, start:end], b[:, start:end]
            out[g] = torch.mm(sa, sb.t(), out_dtype=torch.float32)
            start = end
        return out
    dtype = product_dtype(a.device)
    a, b = a.to(dtype), b.to(dtype)
    if grouped_mm_available():
        if offs is None:
            offs = host_table(list(ends), torch.int32, a.device)
        try:
            return torch._grouped_mm(a, b.t(), offs=offs)
        except (RuntimeError, ValueError) as err:
            _log_once(f"torch._grouped_mm refused the expert GEMM ({err}); a loop of torch.mm")
    else:
        _log_once("this torch has no torch._grouped_mm: the expert GEMMs run a loop of torch.mm")
    out = torch.empty((len(ends), a.shape[0], b.shape[0]), dtype=dtype, device=a.device)
    start = 0
    for g, end in enumerate(ends):
        torch.mm(a[:, start:end], b[:, start:end].t(), out=out[g])
        start = end
    return out


def _scaled(
    c: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense epilogue (``epilogue.apply_steps``) with an alpha per row: fp32(c[rows] *
    alpha) (+ bias in fp32), rounded once to ``out_dtype``; ``c`` [R, N] in the product's
    dtype, ``alpha`` fp32 [R] (R: ``rows``' length where given), ``bias`` fp32 rows [R, N].
    Without a bias one pass (``grouped_scale.scale_rows``)."""
    if bias is None:
        return scale_rows(c, alpha, out_dtype, rows=rows)
    taken = c if rows is None else c[rows]
    out = torch.empty(taken.shape, dtype=out_dtype, device=c.device)
    return torch.addcmul(bias.detach().float(), taken, alpha[:, None], out=out)


def _shifts(rows: Sequence[int], real: Sequence[int]) -> list[int]:
    """Each group's first row among groups of ``rows`` rows minus its first among groups of
    ``real`` rows: where a group's padded rows start against its real tokens."""
    ends = zip(itertools.accumulate(rows), rows, itertools.accumulate(real), real, strict=True)
    return [(end - n) - (real_end - m) for end, n, real_end, m in ends]


class RoutingTables(NamedTuple):
    """One routing's per-group rows as device tables, int32 (``Groups.count_tables``): the
    groups of ``rows[g]`` rows (the real tokens, or their padded rows) hold ``real[g]`` real
    tokens each."""

    counts: torch.Tensor  # rows[g]
    ends: torch.Tensor  # rows[0] + ... + rows[g]
    offsets: torch.Tensor  # 0, then ``ends``: each group's first row, and the end
    shifts: torch.Tensor  # group g's first row minus its real tokens' first row
    host_offsets: list[int]  # ``offsets`` on the host

    @classmethod
    def of(cls, rows: Sequence[int], real: Sequence[int], device: torch.device) -> RoutingTables:
        g = len(rows)
        offsets = [0, *itertools.accumulate(rows)]
        table = host_table([*rows, *offsets, *_shifts(rows, real)], torch.int32, device)
        counts, offs, shift = table.split((g, g + 1, g))
        return cls(counts, offs[1:], offs, shift, offsets)

    def for_launch(self) -> tuple[list[int], torch.Tensor]:
        """``(host_offsets, offsets)``: what a grouped FP8 launch takes as its groups' first
        rows; it uses them where they are its own groups' (``fp8_grouped.offsets_tensor``
        compares the host values)."""
        return self.host_offsets, self.offsets


@dataclass
class Groups:
    """The experts one projection runs for, in order: each expert's index, token count and
    GEMM layer (an ``experts._ExpertGemm``), the weight layout and the output dtype."""

    experts: list[int]
    counts: list[int]
    layers: list[Any]
    transposed: bool  # the 3-D weight is [E, in, out] (y = x W)
    out_dtype: torch.dtype
    name: str  # the projection's, in messages
    # every expert's GEMM layer of the projection, by expert index (a per-tensor weight slot's
    # amax is over all of them: fp4gen.runtime.grouped_scope); None: ``layers`` are all
    every_layer: list[Any] | None = None
    # what the launches of one projection call ask of every expert's layer, looked at once
    _seeds: dict[tuple[str, bool], list[int]] = field(default_factory=dict, repr=False)
    _reduced: frozenset[Operand] | None = field(default=None, repr=False)
    # the routing's device tables (``count_tables``, ``padded_tables``), made once per routing:
    # the caller may hand one dict to the groups of every projection of a routing
    tables: dict[Any, Any] = field(default_factory=dict, repr=False)

    def count_tables(self, device: torch.device) -> RoutingTables:
        """The groups' row counts, their running ends and first rows, int32 on ``device`` (the
        repeats of the per-row scales, ``torch._grouped_mm``'s offsets, the grouped FP8
        GEMM's), from one copy."""
        key = ("counts", device)
        found = self.tables.get(key)
        if found is None:
            found = self.tables[key] = RoutingTables.of(self.counts, self.counts, device)
        return found

    def padded_tables(self, padded: Sequence[int], device: torch.device) -> RoutingTables:
        """``count_tables`` of the groups' rows padded to ``padded`` (the backward's), with
        each group's shift from its real rows to its padded ones (``real_rows``)."""
        key = ("padded", tuple(padded), device)
        found = self.tables.get(key)
        if found is None:
            found = self.tables[key] = RoutingTables.of(padded, self.counts, device)
        return found

    @property
    def all_layers(self) -> list[Any]:
        return self.layers if self.every_layer is None else self.every_layer

    def seeds(self, op: Operand, every: bool = False) -> list[int]:
        """Each expert's Philox seed of ``op`` (its layer's ``_seed_of``), of ``all_layers``
        where ``every`` else of ``layers``."""
        key = (op.role, every)
        found = self._seeds.get(key)
        if found is None:
            layers = self.all_layers if every else self.layers
            found = self._seeds[key] = [layer._seed_of(op) for layer in layers]
        return found

    def reduced(self, op: Operand) -> bool:
        """Whether any expert's layer quantizes ``op`` with its amax group's amax."""
        if self._reduced is None:
            self._reduced = frozenset().union(*(layer.amax_operands for layer in self.layers))
        return op in self._reduced

    def give_amaxes(
        self,
        slots: tuple[Operand, ...],
        weight: torch.Tensor,
        rows: dict[str, torch.Tensor],
    ) -> None:
        """The per-tensor slots' amaxes over every expert (``grouped_scope.give_amaxes``):
        ``rows`` holds the groups' rows of each role ("activation", "gradient": every expert's
        tokens, in the groups' order), ``weight`` the 3-D parameter."""
        from fp4gen.runtime.grouped_scope import give_amaxes

        slices = {}
        start = 0
        for expert, count in zip(self.experts, self.counts, strict=True):
            slices[expert] = slice(start, start + count)
            start += count

        def tensor_of(op: Operand, expert: int) -> torch.Tensor:
            if op.role == "weight":
                return _weight(weight, expert, self.transposed)
            return rows[op.role][slices[expert]]

        give_amaxes(self.layers, slots, tensor_of, self.experts, self.all_layers)


def _weight(weight: torch.Tensor, expert: int, transposed: bool) -> torch.Tensor:
    """Expert ``expert``'s weight as [out, in], detached (the GEMMs define the gradients)."""
    w = weight.detach()[expert]
    return w.t() if transposed else w


def _contiguous_rows(w: torch.Tensor) -> torch.Tensor:
    return w if w.is_contiguous() else w.contiguous()


def _values(q: Any) -> torch.Tensor:
    """The block values (element x block scale, no global scale) of a QuantizedTensor [R, C]:
    on CUDA in bf16 by the generated dequantize kernel (``fp4gen.runtime.dequant``, one pass;
    exact for the formats grouped here), else ``dequantize_blockwise`` in fp32 (torch ops;
    where no kernel serves the format here, logged once)."""
    if q.device.type == "cuda":
        from fp4gen.runtime.dequant import dequantize_bf16

        try:
            return dequantize_bf16(q)[:, : q.cols]  # its K is padded to a multiple of 8
        except FP4GenError as err:
            _log_once(f"the experts' operands are decoded by torch ops: {err}")
    return q.dequantize_blockwise()


def _alpha(a: Any, b: Any) -> torch.Tensor:
    """S_dec(a) * S_dec(b) in fp32, one element (as ``epilogue._alpha``)."""
    return a.global_scale.float().reshape(1) * b.global_scale.float().reshape(1)


def _group_alphas(a_scales: Any, b_scales: Any) -> torch.Tensor | None:
    """``_alpha`` of every group's pair as one fp32 [groups] product (the same fp32 products)
    where one launch wrote each side's S_dec (``GroupedOperands.global_scales``); else None,
    and each expert's is taken on its own: a few launches per expert fewer."""
    if a_scales is None or b_scales is None:
        return None
    return a_scales.float() * b_scales.float()


def _scales_of(operands: Any, copy: int | None = None) -> torch.Tensor | None:
    """The groups' S_dec tensor of grouped operands (column ``copy`` of a pair's), or None."""
    scales = getattr(operands, "global_scales", None)
    return scales if scales is None or copy is None else scales[:, copy]


def observe_pair(layer: Any, gemm: str, call: int, a: Any, b: Any) -> None:
    """Every expert GEMM of the grouped path passes its two quantized operands here: ``layer``
    the expert's GEMM layer, ``gemm`` "fprop", "dgrad" or "wgrad", ``call`` the layer's call
    count that quantized them. Nothing happens: a test harness records the operands here, keyed
    as the loop's GEMM calls are (tests/moe_harness.py). Where the values are read whole, the
    pairs are built for this only while someone observes (``observing``)."""


_UNOBSERVED = observe_pair


def observing() -> bool:
    """Whether ``observe_pair`` has been replaced (a harness records the operands): where a
    GEMM reads every expert's values whole, the per-expert operands are built only then."""
    return observe_pair is not _UNOBSERVED


class _Pairs(Sequence):
    """Each expert's (A, B) operands of one GEMM, read from two sequences on access (a grouped
    launch's are built on first read: ``grouped_quantize.LazyGroups``)."""

    def __init__(self, a: Sequence[Any], b: Sequence[Any]) -> None:
        self.a, self.b = a, b

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.a[index], self.b[index]


def _shape(operands: Sequence[Any], i: int) -> tuple[int, ...]:
    """Operand ``i``'s shape, without building it where the sequence knows its shapes."""
    shapes = getattr(operands, "shapes", None)
    return tuple(operands[i].shape) if shapes is None else shapes[i]


def _most_rows(operands: Sequence[Any]) -> int:
    """The most rows of any group's operand, from the sequence's shapes where it knows them
    all (one ``max`` over a column, no Python step per group)."""
    shapes = getattr(operands, "shapes", None)
    if shapes is None or None in shapes:
        return max(_shape(operands, i)[0] for i in range(len(operands)))
    return max(next(zip(*shapes, strict=True)))


@dataclass(frozen=True)
class FirstGroup:
    """What the FP8 dispatch check reads of the first group's operand (``fp8_grouped_reason``),
    known without building it."""

    format: Any
    rows: int
    cols: int
    device: torch.device


def _first_group(operands: Sequence[Any]) -> Any:
    """The first group's operand for ``fp8_grouped_reason``: where one launch wrote the groups
    (its whole or side-by-side copy says the format and device) and the sequence knows the group's
    shape, a ``FirstGroup``, so the check builds no group (which makes the views of every group
    of that copy: two per group of a columnwise copy); else the group itself."""
    source = getattr(operands, "whole", None)
    if source is None:
        source = getattr(operands, "side", None)
    shapes = getattr(operands, "shapes", None)
    if source is None or shapes is None or shapes[0] is None:
        return operands[0]
    rows, cols = shapes[0]
    return FirstGroup(source.format, rows, cols, source.device)


def decode_pair(
    layer: Any,
    gemm: str,
    call: int,
    a: Any,
    b: Any,
    *,
    a_values: torch.Tensor | None = None,
    b_values: torch.Tensor | None = None,
    alpha: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block values of one expert GEMM's two operands and S_dec(a) S_dec(b): ``layer`` is
    the expert's GEMM layer, ``gemm`` "fprop", "dgrad" or "wgrad", ``call`` the layer's call
    count that quantized them; ``a_values`` / ``b_values``: the operand's block values where
    they were decoded already (every expert's at once, ``_whole_values``); ``alpha``: the
    product where the caller has it already (every group's, ``_group_alphas``), returned as
    given. The operands pass ``observe_pair`` first (where the caller has every value already,
    it calls ``observe_pair`` alone: no slices per expert)."""
    observe_pair(layer, gemm, call, a, b)
    return (
        _values(a) if a_values is None else a_values,
        _values(b) if b_values is None else b_values,
        _alpha(a, b) if alpha is None else alpha,
    )


def _side_values(operands: Any) -> torch.Tensor | None:
    """Every group's block values of a columnwise copy side by side ([K, sum of padded rows])
    in one decode, where a grouped launch wrote them so (``GroupedOperands.side``); else
    None."""
    side = getattr(operands, "side", None)
    return None if side is None else _values(side)


def _whole_values(operands: Any) -> torch.Tensor | None:
    """Every group's block values in one decode, where a grouped quantize wrote the groups as
    one tensor (``GroupedOperands.whole``: the decode reads no global scale); else None."""
    whole = getattr(operands, "whole", None)
    return None if whole is None else _values(whole)


def _wgrad_values(
    pairs: _Pairs,
    calls: list[tuple[Any, int]],
    gt_all: torch.Tensor | None,
    xt_all: torch.Tensor | None,
    alphas: torch.Tensor | None,
    pads: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts' wgrad GEMM values, their columns side by side (the gradient's [out, sum of
    ``pads``], the activation's [in, sum of ``pads``]), and the groups' S_dec products as one
    fp32 [groups]: the one decode of each side-by-side columnwise copy (``_side_values``:
    ``gt_all``, ``xt_all``) where there is one, else each expert's own, concatenated;
    ``pairs`` the experts' (gradient, activation) operands, ``calls`` their (GEMM layer, call
    count). Every pair passes ``observe_pair`` (through ``decode_pair`` where values are
    decoded per expert)."""
    if gt_all is not None and xt_all is not None and alphas is not None:
        if observing():
            for (layer, call), (a, b) in zip(calls, pairs, strict=True):
                observe_pair(layer, "wgrad", call, a, b)
        return gt_all, xt_all, alphas
    gt_views = None if gt_all is None else gt_all.split(list(pads), 1)
    xt_views = None if xt_all is None else xt_all.split(list(pads), 1)
    gt_values, xt_values, each = [], [], []
    for j, ((layer, call), (a, b)) in enumerate(zip(calls, pairs, strict=True)):
        gt_v, xt_v, alpha = decode_pair(
            layer,
            "wgrad",
            call,
            a,
            b,
            a_values=None if gt_views is None else gt_views[j],
            b_values=None if xt_views is None else xt_views[j],
            alpha=alphas,
        )
        gt_values.append(gt_v)
        xt_values.append(xt_v)
        each.append(alpha)
    gt = gt_all if gt_all is not None else torch.cat(gt_values, dim=1)
    xt = xt_all if xt_all is not None else torch.cat(xt_values, dim=1)
    return gt, xt, torch.cat(each) if alphas is None else alphas


class GroupedProjection(torch.autograd.Function):
    """y = x_e W_e^T (+ b_e) for every group of rows of ``x`` (the tokens routed to each expert,
    sorted by expert), with the three GEMMs grouped (module docstring). Returns y [T, out];
    its backward dx [T, in], dW into the experts' slices (zero for experts not in the groups)
    and the bias gradient per expert."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, groups: Groups):  # type: ignore[override]
        if finite.layer_mode() == "raise":
            # the tensors given are checked first, so that an error names them as given
            with finite.deferred():
                finite.check_given(x, "{}: the input of shape {}", groups.name, x.shape)
                shape = weight.shape
                finite.check_given(weight, "{}: the weight of shape {}", groups.name, shape)
                y = _fprop(x, weight, bias, groups)
        else:
            y = _fprop(x, weight, bias, groups)
        ctx.save_for_backward(x, weight)
        ctx.groups = groups
        ctx.bias_shape = None if bias is None else (bias.shape, bias.dtype)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        groups: Groups = ctx.groups
        if torch.is_grad_enabled():
            raise ops.double_backward_error(groups.name)
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        Linear.forget_shared_copy()  # as a dense backward: the forward's shared copy is done
        with finite.layer_scope():
            ops.check_output_grad(groups.name, dy)
            dx, dw = _grads(x, weight, dy, groups)
        db = None
        if ctx.bias_shape is not None:
            shape, dtype = ctx.bias_shape
            db = torch.zeros(shape, dtype=dtype, device=dy.device)
            start = 0
            # ops.bias_grad per expert, as the loop sums each expert's dy
            for expert, count in zip(groups.experts, groups.counts, strict=True):
                db[expert] = ops.bias_grad(dy[start : start + count], dtype)
                start += count
        return dx, dw, db, None


def _fprop(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: Groups
) -> torch.Tensor:
    """``GroupedProjection``'s forward: y [T, out] in the groups' output dtype, each expert's
    operands quantized as ``Linear._fprop`` quantizes them."""
    recompute = recomputing()  # activation checkpointing: the forward it repeats, uncounted
    with finite.layer_scope():  # non-finite inputs: propagated as NaN, or raised at the end
        values, weights, alphas = [], [], []
        start = 0
        k = groups.layers[0].fprop_k(groups.layers[0].operands, x.shape[1])
        # every expert's tokens in one launch where the grouped kernels serve (else None: each
        # expert's layer quantizes its own below)
        inputs = grouped_fprop_inputs(x, groups, k)
        batched = grouped_fprop_weights(weight, groups, k)
        # per-tensor slots that each expert's layer quantizes below: the amax over every expert
        missing = tuple(
            op
            for op in scoped_slots(groups.layers[0].operands, FORWARD_SLOTS)
            if (inputs if op is Operand.FPROP_ACTIVATION else batched) is None
        )
        if missing:
            groups.give_amaxes(missing, weight, {"activation": x})
        table0 = groups.layers[0].operands
        # a block-scaled FP8 pair multiplies the codes (fp4gen.runtime.fp8_grouped): no decode
        fp8 = _fp8_pair(table0.fprop_activation, table0.fprop_weight)
        # their block values in one decode each (slices of them per expert below)
        x_all = None if fp8 else _whole_values(inputs)
        w_all = None if fp8 else _whole_values(batched)
        alpha_all = None if fp8 else _group_alphas(_scales_of(inputs), _scales_of(batched))
        whole = x_all is not None and w_all is not None and alpha_all is not None
        n_out = weight.shape[2] if groups.transposed else weight.shape[1]
        # the operands each expert's own layer quantizes (else the grouped launch's, read from
        # ``inputs`` / ``batched`` where needed: built on first read, LazyGroups)
        own_x: list[Any] = []
        own_w: list[Any] = []
        pairs = _Pairs(own_x if inputs is None else inputs, own_w if batched is None else batched)
        observe = observing()
        for i, (expert, count, layer) in enumerate(
            zip(groups.experts, groups.counts, groups.layers, strict=True)
        ):
            start += count
            # each expert's own table only where its layer quantizes (a call per expert)
            table = layer.operands if inputs is None or batched is None else table0
            # a checkpoint's recomputation: the backward's (Linear.next_forward_call)
            call = layer._backward_calls if recompute else layer._forward_calls
            # each expert's slices only where its own layer quantizes them (a view is a call too)
            if inputs is None:
                x_e = x[start - count : start]
                own_x.append(
                    layer.quantize(
                        pad_to(x_e, count, k),
                        Operand.FPROP_ACTIVATION,
                        table.fprop_activation,
                        call,
                        source_in_backward=recompute,
                    )
                )
            if batched is None:
                w = _weight(weight, expert, groups.transposed)
                own_w.append(
                    layer.quantize(
                        pad_to(_contiguous_rows(w), w.shape[0], k),
                        Operand.FPROP_WEIGHT,
                        table.fprop_weight,
                        call,
                        source_in_backward=recompute,
                    )
                )
            if not recompute:
                layer.__dict__["_forward_calls"] = call + 1
            if fp8:
                continue
            if whole:  # every expert's values are slices of x_all and w_all: none taken
                if observe:
                    observe_pair(layer, "fprop", call, *pairs[i])
                continue
            xq, wq = pairs[i]
            x_values, w_values, alpha = decode_pair(
                layer,
                "fprop",
                call,
                xq,
                wq,
                a_values=None if x_all is None else x_all[start - count : start],
                b_values=None if w_all is None else w_all[i * n_out : (i + 1) * n_out],
                alpha=alpha_all,
            )
            values.append(x_values)
            weights.append(w_values)
            alphas.append(alpha)
        if not recompute:
            advance_devices(groups.layers, forward=True)  # after every expert's launches above
        if fp8:  # the bias and the rounding in the FP8 GEMM's epilogue, per expert
            bias_groups = None if bias is None else bias.detach()[_experts_index(groups, x.device)]
            return _fp8_products(
                pairs,
                groups.out_dtype,
                bias_groups,
                "fprop",
                groups.name,
                wholes=(getattr(inputs, "whole", None), getattr(batched, "whole", None)),
                global_scales=(_scales_of(inputs), _scales_of(batched)),
                offsets=groups.count_tables(x.device).for_launch(),
            )
        routed = groups.count_tables(x.device)
        counts, ends = routed.counts, routed.ends
        a = torch.cat(values) if x_all is None else x_all
        b = torch.stack(weights) if w_all is None else w_all.reshape(len(groups.experts), n_out, -1)
        c = _native(pairs, x.device, by_rows=True)
        c = group_rows(a, b, _ends(groups.counts), ends) if c is None else c
        # the row count given: repeat_interleave would otherwise wait for the GPU to learn it
        rows = sum(groups.counts)
        alpha = (torch.cat(alphas) if alpha_all is None else alpha_all).repeat_interleave(
            counts, output_size=rows
        )
        bias_rows = None
        if bias is not None:
            index = _experts_index(groups, x.device)
            bias_rows = bias.detach()[index].repeat_interleave(counts, 0, output_size=rows)
        return _scaled(c, alpha, bias_rows, groups.out_dtype)


# set_grouped_quantize: on by default (the grouped quantize kernels match each group's
# reference quantization bit for bit on the GPU, tests/test_moe_grouped_quantize.py);
# False quantizes per expert, the path they are compared with
_grouped_quantize = [True]


def set_grouped_quantize(enabled: bool) -> bool:
    """Whether the grouped path quantizes the experts' operands that the grouped quantize
    kernels serve (1xN rowwise copies: every expert's tokens, the batched weights) in one launch
    per operand on CUDA (True, the default) or per expert (False, docs/moe.md). Process-wide,
    read at every call; returns the previous setting. The bits are the same (verified on the
    GPU by tests/test_moe_grouped_quantize.py). False also turns the grouped tile quantize
    off (``set_grouped_tile_quantize``)."""
    previous, _grouped_quantize[0] = _grouped_quantize[0], bool(enabled)
    return previous


# set_grouped_tile_quantize: on by default since its GPU tests passed on an H200
# (tests/test_moe_grouped_tile.py -m gpu: each group bit for bit its reference, and the experts'
# operands the loop's); the CPU tests prove the grouped path's use of it with the definition
# standing in for the kernels
_grouped_tile_quantize = [True]


def set_grouped_tile_quantize(enabled: bool) -> bool:
    """Whether the grouped path quantizes, where the grouped quantize is on
    (``set_grouped_quantize``), the experts' operands the grouped tile kernels serve (the wgrad
    activation and the gradient's two copies of every expert, each expert's tokens padded inside
    the kernel; 2D weights: the batched fprop and dgrad copies) in one launch per operand on
    CUDA (True, the default) or per expert (False, docs/moe.md). Process-wide, read at every
    call; returns the previous setting. The bits are the same either way."""
    previous, _grouped_tile_quantize[0] = _grouped_tile_quantize[0], bool(enabled)
    return previous


def grouped_operands(
    rows: torch.Tensor, groups: Groups, op: Operand, *, forward: bool
) -> list[Any] | None:
    """Operand ``op`` of every expert from one grouped quantize
    (``fp4gen.runtime.grouped_quantize``) of ``rows`` [sum of the groups' rows, K] (each expert's
    rows contiguous, in ``groups``' order, padded as its layer pads them): group e quantized
    with expert e's seed and Philox offset, exactly as its layer's ``quantize`` would (the
    offset: STREAMS_PER_CALL * call + the operand's slot, the value the layer's device counter
    holds for that call; ``forward``: the forward or the backward call count), with its own
    global amax or, where the slot is per tensor, the amax of all groups (``global per
    tensor``: a weight's ``rows`` then hold every expert's slice, ``_weight_groups``, and the
    experts with tokens are picked from them). None where the grouped kernels do not serve (not
    CUDA, the reference backend, a spec other than a plain 1xN block format, an amax group,
    turned off, or a kernel refusal, logged once): the caller then quantizes per expert."""
    from fp4gen.runtime.grouped_quantize import GroupedOperands, quantize_groups
    from fp4gen.runtime.operand_slots import SLOT, STREAMS_PER_CALL

    if not (_serves(rows) and _eligible(groups, op)):
        return None
    spec = groups.layers[0].operands[op]
    every = op.role == "weight" and spec.global_scope == "tensor"
    layers = groups.all_layers if every else groups.layers
    calls = _call_counts(layers, forward)
    experts = len(layers)
    # a weight: every expert's slice, equal groups; an activation or gradient: its tokens
    counts = [rows.shape[0] // experts] * experts if op.role == "weight" else groups.counts
    try:
        got = quantize_groups(
            rows,
            counts,
            spec.format,
            rounding=spec.rounding,
            rht=spec.rht,
            seeds=groups.seeds(op, every),
            offsets=[STREAMS_PER_CALL * call + SLOT[op] for call in calls],
            backend="cute",
            scope=spec.global_scope,
        )
    except FP4GenError as err:
        _log_once(f"the experts' {op.selector} operands are quantized per expert: {err}")
        return None
    if not every or len(layers) == len(groups.layers):
        return got
    picked = GroupedOperands(got[e] for e in groups.experts)  # decoded per expert: no whole
    return picked


def _call_counts(layers: Sequence[Any], forward: bool) -> list[int]:
    """Each layer's count of the pass's call: the forward's, or in a checkpoint's
    recomputation (and in the backward) the backward's (``Linear.next_forward_call``)."""
    counts_forward = forward and not recomputing()
    return [layer._forward_calls if counts_forward else layer._backward_calls for layer in layers]


def _weight_groups(groups: Groups, op: Operand) -> Groups:
    """The groups whose weight slices a batched weight operand holds: every expert's where the
    slot is per tensor (its amax is over all of them), else the experts with tokens."""
    spec = groups.layers[0].operands[op]
    if spec.global_scope != "tensor" or groups.every_layer is None:
        return groups
    every = list(range(len(groups.every_layer)))
    return replace(
        groups, experts=every, counts=[0] * len(every), layers=groups.every_layer, tables={}
    )


def _eligible(groups: Groups, op: Operand) -> bool:
    """Whether operand ``op`` of these experts is one the grouped quantize serves, before any
    tensor is made for it: a plain 1xN block format (not from another copy), no amax group,
    a backend that runs kernels."""
    # an amax group's operand is not served (a per-tensor slot is: the kernels take its scope)
    return _tile_eligible(groups, op) and groups.layers[0].operands[op].format.block[0] == 1


def grouped_fprop_inputs(x: torch.Tensor, groups: Groups, k: int) -> list[Any] | None:
    """Every expert's fprop activation operand (``grouped_operands``): the rows of ``x``
    (sorted by expert) zero-padded to K = ``k``, as ``Linear._fprop`` pads them."""
    if not (_serves(x) and _eligible(groups, Operand.FPROP_ACTIVATION)):
        return None
    return grouped_operands(
        pad_to(x, x.shape[0], k), groups, Operand.FPROP_ACTIVATION, forward=True
    )


def grouped_fprop_weights(weight: torch.Tensor, groups: Groups, k: int) -> list[Any] | None:
    """Every expert's fprop weight operand (``grouped_operands``; with 2D blocks the grouped
    tile kernel's rowwise copy, ``grouped_tile_operands``) from the batched weights of the
    experts with tokens, [experts x out, in] (a view where every expert has tokens and the
    weights are [E, out, in]; else one gathered or transposed copy), zero-padded to K = ``k``."""
    op = Operand.FPROP_WEIGHT
    two_d = _is_2d(groups, op)
    if not (_serves_tile(weight) if two_d else _serves(weight)) or not (
        _tile_eligible(groups, op) if two_d else _eligible(groups, op)
    ):
        return None
    w = _batched(weight, _weight_groups(groups, op), transposed=groups.transposed)
    w = pad_to(w, w.shape[0], k)
    if not two_d:
        return grouped_operands(w, groups, op, forward=True)
    got = _weight_tiles(w, groups, op, "rowwise", forward=True)
    return None if got is None else got.copy(0)


def grouped_dgrad_weights(weight: torch.Tensor, groups: Groups, k: int) -> list[Any] | None:
    """Every expert's dgrad weight operand W_e^T [in, out]: where it is a rowwise quantization
    of W^T of its own (not the transpose of 2D fprop codes, not from another copy:
    ``Linear.columnwise_weight``'s last case) by ``grouped_operands``, zero-padded to K =
    ``k``; where it is the transpose of the 2D fprop codes (and K needs no padding), the
    grouped tile kernel's columnwise copy of the batched W (``grouped_tile_operands``: each
    expert's transposed codes and tile scales, what the tile kernel gives a dense layer)."""
    from fp4gen.runtime.layer_quantize import _transposable

    op = Operand.DGRAD_WEIGHT
    table = groups.layers[0].operands
    if _transposable(table.fprop_weight, table.dgrad_weight):
        n_out = weight.shape[2] if groups.transposed else weight.shape[1]
        if k != n_out or not (_serves_tile(weight) and _tile_eligible(groups, op)):
            return None
        w = _batched(weight, _weight_groups(groups, op), transposed=groups.transposed)
        got = _weight_tiles(w, groups, op, "columnwise", forward=False)
        return None if got is None else got.copy(0)
    if not (_serves(weight) and _eligible(groups, op)):
        return None
    wt = _batched(weight, _weight_groups(groups, op), transposed=not groups.transposed)
    return grouped_operands(pad_to(wt, wt.shape[0], k), groups, op, forward=False)


def grouped_wgrad_activations(x: torch.Tensor, groups: Groups) -> list[Any] | None:
    """Every expert's wgrad activation Q(x_e^T; wgrad.activation) [in, padded tokens]
    (``Linear.wgrad_activation``: its tokens zero-padded to the wgrad GEMM's K multiple, here
    inside the kernel) from one grouped tile launch of the tokens sorted by expert
    (``grouped_tile_operands``), or None (each expert's layer quantizes its own)."""
    op = Operand.WGRAD_ACTIVATION
    if not (_serves_tile(x) and _tile_eligible(groups, op)):
        return None
    table = groups.layers[0].operands
    wgrad_k = k_multiple(table.wgrad_gradient, table.wgrad_activation, blocks=True)
    pads = padded_counts(groups.counts, wgrad_k)
    got = grouped_tile_operands(
        _contiguous_rows(x),
        groups,
        ((op, "columnwise"),),
        groups.counts,
        pads,
        forward=False,
        side_by_side=True,
    )
    return None if got is None else got.copy(0)


def grouped_gradients(dy: torch.Tensor, groups: Groups, out: int) -> list[Any] | None:
    """Every expert's gradient copies (dgrad rowwise, wgrad columnwise) as ``Linear._grads``
    quantizes them (``_quantize_pair``: both from one tile launch where they share a block
    format; per tensor, each with its slot's amax over every expert), dy's columns zero-padded
    to ``out`` (the dgrad GEMM's K) and each expert's tokens to the wgrad GEMM's K multiple
    (inside the kernel): one grouped tile launch of both copies (``grouped_tile_operands``),
    a (dgrad, wgrad) pair per expert (``whole``: every expert's padded dgrad copy as one
    QuantizedTensor [sum of padded tokens, out], for one decode, where the launch wrote them
    all); None where the copies do not share a format or the grouped quantize does not serve
    them."""
    row_op, col_op = Operand.DGRAD_GRADIENT, Operand.WGRAD_GRADIENT
    if not (_serves_tile(dy) and _tile_eligible(groups, row_op) and _tile_eligible(groups, col_op)):
        return None
    table = groups.layers[0].operands
    if table.dgrad_gradient.format != table.wgrad_gradient.format:
        # two launches per expert in the loop too (quantize_operand_pair)
        _log_once(
            "the experts' dgrad.gradient and wgrad.gradient copies are quantized per expert: "
            "their formats differ (the grouped tile quantize writes both copies of one format)"
        )
        return None
    wgrad_k = k_multiple(table.wgrad_gradient, table.wgrad_activation, blocks=True)
    pads = padded_counts(groups.counts, wgrad_k)
    rows = pad_to(_contiguous_rows(dy), dy.shape[0], out)
    ops = ((row_op, "rowwise"), (col_op, "columnwise"))
    got = grouped_tile_operands(
        rows, groups, ops, groups.counts, pads, forward=False, side_by_side=True
    )
    if got is None:
        return None
    pairs = GroupedOperands(make=got.__getitem__, count=len(got))  # built on first read
    pairs.whole = got.wholes[0] if got.wholes else None
    pairs.global_scales = got.global_scales  # [groups, 2]: the dgrad and the wgrad copy's
    pairs.side = got.sides[1] if got.sides else None  # the wgrad copies side by side
    pairs.copies = (got.copy(0), got.copy(1))  # each copy of every group on its own
    return pairs


def grouped_tile_operands(
    rows: torch.Tensor,
    groups: Groups,
    ops: tuple[tuple[Operand, str], ...],
    counts: Sequence[int],
    pads: Sequence[int],
    *,
    forward: bool,
    side_by_side: bool = False,
) -> Any:
    """Operands ``ops`` ((slot, "rowwise" or "columnwise"), the rowwise one first) of every
    group of ``rows`` from one grouped tile quantize (``fp4gen.runtime.grouped_tile``): group
    e's ``counts[e]`` rows zero-padded to ``pads[e]`` inside the kernel and quantized with
    expert e's seed and each slot's Philox offset of its call, exactly as its layer's tile
    launch would (as ``grouped_operands``), with its own global amaxes or, where the slots are
    per tensor, the largest over every group (a weight's ``rows`` then hold every expert's
    slice, and the experts with tokens are picked from them). A ``GroupedCopies`` (per expert
    a tuple of its copies), or None where the kernels do not serve (the slots' specs differ in
    format or scope, or a kernel's refusal, logged once). ``side_by_side``: a columnwise copy
    laid out for a GEMM grouped along K (``GroupedOperands.side``: the tokens' wgrad copies)."""
    from fp4gen.runtime.grouped_tile import GroupedCopies, quantize_groups_tile
    from fp4gen.runtime.operand_slots import SLOT, STREAMS_PER_CALL

    specs = [groups.layers[0].operands[op] for op, _ in ops]
    names = "/".join(op.selector for op, _ in ops)
    if len({s.format for s in specs}) != 1 or len({s.global_scope for s in specs}) != 1:
        _log_once(f"the experts' {names} operands are quantized per expert: their specs differ")
        return None
    scope = specs[0].global_scope
    every = ops[0][0].role == "weight" and scope == "tensor"
    layers = groups.all_layers if every else groups.layers
    calls = _call_counts(layers, forward)
    # per group: each op's Philox offset of its call (a list per op, then zipped: no
    # per-group generator, 64 experts make thousands of those per step)
    per_op = [[STREAMS_PER_CALL * call + SLOT[op] for call in calls] for op, _ in ops]
    try:
        got = quantize_groups_tile(
            rows,
            counts,
            pads,
            specs[0].format,
            [(direction, s.rounding, s.rht) for (_, direction), s in zip(ops, specs, strict=True)],
            seeds=groups.seeds(ops[0][0], every),
            offsets=list(zip(*per_op, strict=True)),
            backend="cute",
            scope=scope,
            side_by_side=side_by_side,
        )
    except FP4GenError as err:
        _log_once(f"the experts' {names} operands are quantized per expert: {err}")
        return None
    if not every or len(layers) == len(groups.layers):
        return got
    return GroupedCopies(got[e] for e in groups.experts)  # decoded per expert: no wholes


def _weight_tiles(
    w: torch.Tensor, groups: Groups, op: Operand, direction: str, *, forward: bool
) -> Any:
    """The 2D weight copy ``direction`` of every expert's slice of the batched weights ``w``
    (equal groups, no padding rows: ``grouped_tile_operands``)."""
    every = _weight_groups(groups, op)
    n = w.shape[0] // len(every.experts)
    counts = [n] * len(every.experts)
    return grouped_tile_operands(w, groups, ((op, direction),), counts, counts, forward=forward)


def _is_2d(groups: Groups, op: Operand) -> bool:
    from fp4gen.formats import BlockFormat

    fmt = groups.layers[0].operands[op].format
    return isinstance(fmt, BlockFormat) and fmt.is_2d


def _tile_eligible(groups: Groups, op: Operand) -> bool:
    """Whether operand ``op`` of these experts is one the grouped tile quantize serves, before
    any tensor is made for it: a block format (1xN or 2D, not from another copy), no amax
    group, a backend that runs kernels (the kernels refuse what else they do not take)."""
    from fp4gen.formats import BlockFormat

    layer0 = groups.layers[0]
    spec = layer0.operands[op]
    return (
        layer0.backend in ("auto", "cute")
        and isinstance(spec.format, BlockFormat)
        and spec.source is None
        and not groups.reduced(op)
    )


def _serves(t: torch.Tensor) -> bool:
    """The cheap first look of ``grouped_operands`` (before any copy for it is made)."""
    return _grouped_quantize[0] and t.is_cuda


def _serves_tile(t: torch.Tensor) -> bool:
    """The cheap first look of ``grouped_tile_operands``: ``_serves`` and the tile switch."""
    return _grouped_tile_quantize[0] and _serves(t)


def _batched(weight: torch.Tensor, groups: Groups, *, transposed: bool) -> torch.Tensor:
    """The experts' weight slices as rows [experts x rows, cols], each expert's [rows, cols] the
    slice (``transposed``: its transpose), in ``groups``' order, contiguous."""
    w = weight.detach()
    if len(groups.experts) != w.shape[0] or groups.experts != list(range(w.shape[0])):
        w = w[_experts_index(groups, w.device)]
    if transposed:
        w = w.transpose(1, 2)
    return w.contiguous().reshape(-1, w.shape[2])


def real_rows(
    counts: Sequence[int],
    padded: Sequence[int],
    device: torch.device,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The rows of the groups' real tokens among their padded rows (group g's ``counts[g]``
    rows from the sum of the padded counts before it), int32 on ``device`` (the epilogue
    kernel's gather index): a few launches whatever the number of groups (the row count is
    known here, so ``repeat_interleave`` does not wait for the GPU). ``tables``: each group's
    shift and count as int32 tensors on ``device`` where the caller has them
    (``Groups.padded_tables``, ``Groups.count_tables``)."""
    total = sum(counts)
    if tables is None:
        per_group = host_table([_shifts(padded, counts), list(counts)], torch.int32, device)
        tables = (per_group[0], per_group[1])
    moved = torch.repeat_interleave(tables[0], tables[1], output_size=total)
    return torch.arange(total, dtype=torch.int32, device=device) + moved


def _experts_index(groups: Groups, device: torch.device) -> torch.Tensor:
    """The groups' expert indices on ``device``, for gathering their slices of a parameter (a
    Python list as the index would be copied with a wait for the GPU: host_tables)."""
    return host_table(groups.experts, torch.int64, device)


def _ends(counts: Sequence[int]) -> list[int]:
    return list(itertools.accumulate(counts))


def _grads(
    x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, groups: Groups
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx [T, in] (x's dtype) and dW (the weight's shape and dtype) by a grouped dgrad and a
    grouped wgrad; each expert's operands quantized as ``Linear._grads`` quantizes them."""
    dy_values, w_values, dy_alphas = [], [], []
    wgrad_calls, padded = [], []
    start = 0
    n_out = dy.shape[1]
    table0 = groups.layers[0].operands
    dgrad_out = round_up(
        n_out, k_multiple(table0.dgrad_gradient, table0.dgrad_weight, blocks=False)
    )
    w_cols = grouped_dgrad_weights(weight, groups, dgrad_out)
    # every expert's wgrad activation, and its gradient's two copies, from one grouped tile
    # launch each where the grouped quantize serves them (else None: each expert's layer below)
    x_cols = grouped_wgrad_activations(x, groups)
    dy_pairs = grouped_gradients(dy, groups, dgrad_out)
    # block-scaled FP8 pairs multiply the codes (fp4gen.runtime.fp8_grouped): no decode
    fp8_dgrad = _fp8_pair(table0.dgrad_gradient, table0.dgrad_weight)
    fp8_wgrad = _fp8_pair(table0.wgrad_gradient, table0.wgrad_activation)
    # [experts x in, out] block values, one decode
    w_col_all = None if fp8_dgrad else _whole_values(w_cols)
    # every expert's padded dgrad gradient rows [sum of padded tokens, out], one decode
    dy_all = None if fp8_dgrad else _whole_values(dy_pairs)
    padded_start = 0
    # every expert's wgrad gradient and activation columns side by side, one decode each
    gt_all = None if fp8_wgrad else _side_values(dy_pairs)
    xt_all = None if fp8_wgrad else _side_values(x_cols)
    dgrad_alphas = None if fp8_dgrad else _group_alphas(_scales_of(dy_pairs, 0), _scales_of(w_cols))
    wgrad_alphas = None if fp8_wgrad else _group_alphas(_scales_of(dy_pairs, 1), _scales_of(x_cols))
    dgrad_whole = dy_all is not None and w_col_all is not None and dgrad_alphas is not None
    # per-tensor slots that each expert's layer quantizes below: the amax over every expert
    missing = tuple(
        op
        for op in scoped_slots(table0, BACKWARD_SLOTS)
        if not (op is Operand.DGRAD_WEIGHT and w_cols is not None)
        and not (op is Operand.WGRAD_ACTIVATION and x_cols is not None)
        and not (op.role == "gradient" and dy_pairs is not None)
    )
    if missing:
        groups.give_amaxes(missing, weight, {"activation": x, "gradient": dy})
    n_in = weight.shape[1] if groups.transposed else weight.shape[2]
    # the operands each expert's own layer quantizes (else the grouped launches', read where
    # needed: built on first read, LazyGroups)
    own_w: list[Any] = []
    own_dy: list[Any] = []
    own_dy_t: list[Any] = []
    own_x_t: list[Any] = []
    dy_rows_ops, dy_cols_ops = (own_dy, own_dy_t) if dy_pairs is None else dy_pairs.copies
    dgrad_pairs = _Pairs(dy_rows_ops, own_w if w_cols is None else w_cols)
    wgrad_pairs = _Pairs(dy_cols_ops, own_x_t if x_cols is None else x_cols)
    # the K multiples are the module's table's (the experts' tables differ at most in redrawn
    # RHT signs, never in sizes); the per-expert loop below does only what varies by expert
    wgrad_k = k_multiple(table0.wgrad_gradient, table0.wgrad_activation, blocks=True)
    out = dgrad_out
    own = w_cols is None or dy_pairs is None or x_cols is None
    observe = observing()
    for i, (expert, count, layer) in enumerate(
        zip(groups.experts, groups.counts, groups.layers, strict=True)
    ):
        table = layer.operands if own else table0  # each expert's own table where it quantizes
        call = layer._backward_calls
        first, start = start, start + count  # the expert's rows of x and dy
        tokens = -(-count // wgrad_k) * wgrad_k  # round_up(count, wgrad_k)
        # the batched dgrad weights where the grouped quantize served them
        if w_cols is None:
            w = _weight(weight, expert, groups.transposed)
            own_w.append(layer.columnwise_weight(w, table, call, out))
        if dy_pairs is None:
            # the expert's layer quantizes its padded gradient (no padded copy made otherwise)
            dy_p = pad_to(dy[first:start], tokens, out)
            if layer._reduced(Operand.DGRAD_GRADIENT, table.dgrad_gradient) or layer._reduced(
                Operand.WGRAD_GRADIENT, table.wgrad_gradient
            ):  # a per-tensor copy: each quantized on its own, as Linear's backward does then
                dyq = layer.quantize(dy_p, Operand.DGRAD_GRADIENT, table.dgrad_gradient, call)
                dyq_t = layer.quantize(
                    dy_p.t().contiguous(), Operand.WGRAD_GRADIENT, table.wgrad_gradient, call
                )
            else:
                dyq, dyq_t = layer._quantize_pair(
                    dy_p,
                    layer.slot(Operand.DGRAD_GRADIENT, table.dgrad_gradient, call, dy_p),
                    layer.slot(Operand.WGRAD_GRADIENT, table.wgrad_gradient, call, dy_p),
                    seed=layer.data_seed,
                )
            own_dy.append(dyq)
            own_dy_t.append(dyq_t)
        if x_cols is None:
            own_x_t.append(layer.wgrad_activation(x[first:start], table, call))
        layer.__dict__["_backward_calls"] = call + 1
        padded.append(tokens)
        wgrad_calls.append((layer, call))
        if not fp8_dgrad and dgrad_whole:  # the values are slices of dy_all and w_col_all
            if observe:
                observe_pair(layer, "dgrad", call, *dgrad_pairs[i])
            padded_start += tokens
        elif not fp8_dgrad:
            dyq, w_col = dgrad_pairs[i]
            dy_v, w_v, dgrad_alpha = decode_pair(
                layer,
                "dgrad",
                call,
                dyq,
                w_col,
                a_values=None if dy_all is None else dy_all[padded_start : padded_start + tokens],
                b_values=None if w_col_all is None else w_col_all[i * n_in : (i + 1) * n_in],
                alpha=dgrad_alphas,
            )
            dy_values.append(dy_v)
            w_values.append(w_v)
            if dgrad_alphas is None:
                dy_alphas.append(dgrad_alpha.expand(tokens))
            padded_start += tokens
    advance_devices(groups.layers, forward=False)  # after every expert's launches above
    # dgrad: the padded token rows of every expert, then the real rows taken back
    padded_t = groups.padded_tables(padded, dy.device)
    count_t = groups.count_tables(dy.device).counts
    real = real_rows(groups.counts, padded, dy.device, (padded_t.shifts, count_t))
    if fp8_dgrad:  # the rounding to x's dtype in the FP8 GEMM's epilogue, per expert
        dx = _fp8_products(
            dgrad_pairs,
            x.dtype,
            None,
            "dgrad",
            groups.name,
            wholes=(getattr(dy_pairs, "whole", None), getattr(w_cols, "whole", None)),
            global_scales=(_scales_of(dy_pairs, 0), _scales_of(w_cols)),
            offsets=padded_t.for_launch(),
        )[real]
    else:
        if w_col_all is None:
            w_stack = torch.stack(w_values)
        else:
            w_stack = w_col_all.reshape(len(groups.experts), n_in, -1)
        c = _native(dgrad_pairs, dy.device, by_rows=True)
        dy_rows = torch.cat(dy_values) if dy_all is None else dy_all
        c = group_rows(dy_rows, w_stack, _ends(padded), padded_t.ends) if c is None else c
        if dgrad_alphas is None:
            per_row = torch.cat(dy_alphas)[real]
        else:  # group g's alpha on each of its real rows, as the padded rows' taken at ``real``
            per_row = dgrad_alphas.repeat_interleave(count_t, output_size=sum(groups.counts))
        dx = _scaled(c, per_row, None, x.dtype, rows=real)
    # wgrad: the experts' token columns side by side, one group each
    if fp8_wgrad:  # grouped along K: one K-grouped launch, or each expert's dense FP8 GEMM
        dw_groups = _fp8_wgrad(
            wgrad_pairs,
            weight.dtype,
            groups.name,
            sides=(getattr(dy_pairs, "side", None), getattr(x_cols, "side", None)),
            global_scales=(_scales_of(dy_pairs, 1), _scales_of(x_cols)),
            offsets=padded_t.for_launch(),
        )[:, :n_out]
    else:
        gt, xt, per_group = _wgrad_values(
            wgrad_pairs, wgrad_calls, gt_all, xt_all, wgrad_alphas, padded
        )
        c = _native(wgrad_pairs, dy.device, by_rows=False)
        if c is None:
            c = group_k(gt, xt, _ends(padded), padded_t.ends)
        g, n, m = c.shape
        per_rows = per_group.repeat_interleave(n, output_size=g * n)  # a row of C: its group's
        dw_groups = _scaled(c.reshape(g * n, m), per_rows, None, weight.dtype).view(g, n, m)
        dw_groups = dw_groups[:, :n_out]
    if groups.transposed:
        dw_groups = dw_groups.transpose(1, 2)
    if len(groups.experts) == weight.shape[0]:  # every expert routed: in order, no scatter
        return dx, dw_groups.contiguous()
    dw = torch.zeros_like(weight)
    dw.index_copy_(0, _experts_index(groups, weight.device), dw_groups)
    return dx, dw


def _native(
    pairs: Sequence[tuple[Any, Any]], device: torch.device, *, by_rows: bool
) -> torch.Tensor | None:
    """On sm_100a GPUs the product of the groups' quantized pairs on the block-scaled MMA, from
    the codes, without global scales (``fp4gen.runtime.blackwell_grouped.native_products``:
    ``group_rows``' or ``group_k``'s shape); None elsewhere (the product above is taken),
    decided by ``device`` before any pair is read (the grouped launches' pairs are built on
    first read)."""
    if not pairs or device.type != "cuda":
        return None
    from fp4gen.compiler.jit import detect_arch
    from fp4gen.runtime.blackwell_grouped import NATIVE_ARCHS, native_products

    if detect_arch(device) not in NATIVE_ARCHS:
        return None
    return native_products(pairs, by_rows=by_rows)


def _fp8_pair(a: Any, b: Any) -> bool:
    """Whether a GEMM of operand specs ``a`` and ``b`` is a block-scaled FP8 pair: block formats
    whose values are not exact in bf16 (fp32 block scales) and that the FP8 GEMM class takes
    (``codegen.gemm_fp8.pair_reason``: e4m3 / e5m2, A 1xN, B 1xN or NxN). Its product is the
    dense layer's FP8 GEMM, grouped (``_fp8_products``), never the bf16 decode."""
    from fp4gen.codegen.gemm_fp8 import pair_reason
    from fp4gen.formats import BlockFormat

    fa, fb = a.format, b.format
    if not (isinstance(fa, BlockFormat) and isinstance(fb, BlockFormat)):
        return False
    if fa.gemm_exact_in_bf16() and fb.gemm_exact_in_bf16():
        return False
    return pair_reason(fa, fb) is None


def fp8_grouped_reason(a: Any, b: Any, m: int) -> str | None:
    """None when the grouped FP8 kernel computes the experts' GEMM of QuantizedTensors ``a``
    [m, K] and ``b`` [N, K] (the first expert's) as each expert's dense GEMM would: CUDA, the
    switch on (``fp8_grouped.set_grouped_fp8``), and the dense dispatch's choice for the pair
    a block-scaled FP8 GEMM (scaled_mm or the generated kernel: the same semantics,
    numerics.md 6.1); else why not (each expert then runs its dense GEMM)."""
    from fp4gen.gemm_dispatch import choose_backend, fp8_semantics_setting
    from fp4gen.runtime.fp8_grouped import grouped_fp8_enabled

    if not grouped_fp8_enabled():
        return "the grouped FP8 GEMM is turned off (fp8_grouped.set_grouped_fp8(False))"
    if a.device.type != "cuda":
        return f"{a.device.type.upper()} tensors: the dense GEMM per expert"
    from fp4gen.compiler.jit import detect_arch

    choice = choose_backend(
        a.format, b.format, m, b.rows, a.cols,
        device="cuda", arch=detect_arch(a.device), semantics=fp8_semantics_setting(),
    )  # fmt: skip
    if choice.backend not in ("block_scaled", "cute"):
        return f"the dense GEMM is not block-scaled here ({choice.reason})"
    return None


def _dense_fp8(a: Any, b: Any, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """One expert's GEMM as its layer runs it (``Linear``'s ``gemm``, looked up there: a test
    that stands it in sees these calls too)."""
    from fp4gen.runtime import linear

    return linear.gemm(a, b, bias=bias, out_dtype=out_dtype)


def _fp8_products(
    pairs: _Pairs,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    gemm: str,
    name: str,
    *,
    wholes: tuple[Any, Any] = (None, None),
    global_scales: tuple[Any, Any] = (None, None),
    offsets: tuple[list[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The experts' block-scaled FP8 GEMMs of ``pairs`` (A_e [M_e, K], B_e [N, K]) as C
    [sum M_e, N] in ``out_dtype``, with ``bias`` [experts, N] (or None) and the global scales in
    the epilogue: one launch of the grouped FP8 kernel (``fp4gen.runtime.fp8_grouped``: each
    expert's rows bit for bit the dense generated kernel's) where ``fp8_grouped_reason`` allows,
    else each expert's dense GEMM (``_dense_fp8``: the loop's own products), the reason logged
    once (INFO, logger ``fp4gen.runtime.fp8_grouped``). ``wholes`` and ``global_scales``:
    each side's groups as one tensor where one grouped launch wrote them
    (``GroupedOperands.whole``, ``.global_scales``), passed as the kernel's arguments as they are
    (``fp8_grouped.grouped_launch``; ``offsets`` too)."""
    from fp4gen.runtime.fp8_grouped import grouped_block_scaled, log_fallback

    # each side as its sequence: a grouped launch's groups are built only where read
    a, b = pairs.a, pairs.b
    reason = fp8_grouped_reason(_first_group(a), _first_group(b), _most_rows(a))
    if reason is None:
        try:
            return grouped_block_scaled(
                a,
                b,
                out_dtype=out_dtype,
                bias=bias,
                wholes=wholes,
                global_scales=global_scales,
                offsets=offsets,
            )
        except FP4GenError as err:  # a kernel that did not compile or load, a refused pair
            reason = str(err)
    log_fallback(f"{name}: the experts' {gemm} GEMMs run per expert: {reason}")
    return torch.cat(
        [
            _dense_fp8(a_e, b_e, out_dtype, None if bias is None else bias[i])
            for i, (a_e, b_e) in enumerate(pairs)
        ]
    )


def _fp8_wgrad(
    pairs: _Pairs,
    out_dtype: torch.dtype,
    name: str,
    *,
    sides: tuple[Any, Any] = (None, None),
    global_scales: tuple[Any, Any] = (None, None),
    offsets: tuple[list[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The experts' block-scaled FP8 wgrad GEMMs (A_e [out, K_e], B_e [in, K_e]: the groups
    run along K) as [experts, out, in] in ``out_dtype``: one launch of the K-grouped kernel
    (``fp4gen.runtime.fp8_kgrouped``: each expert's the dense generated kernel's bits) where
    it is on and ``fp8_grouped_reason`` allows, else each expert's dense GEMM (the loop's own
    products), the reason logged once. ``sides``, ``global_scales``: each side's groups as one
    launch wrote them (``GroupedOperands.side``, ``.global_scales``), the kernel's arguments
    then made from these without reading a group; ``offsets``: as ``_fp8_products``'."""
    from fp4gen.runtime.fp8_grouped import log_fallback
    from fp4gen.runtime.fp8_kgrouped import k_grouped_block_scaled, k_grouped_fp8_enabled

    if k_grouped_fp8_enabled():
        a, b = pairs.a, pairs.b  # a grouped launch's: built only where read
        first_a = _first_group(a)
        reason = fp8_grouped_reason(first_a, _first_group(b), first_a.rows)
        if reason is None:
            try:
                return k_grouped_block_scaled(
                    a,
                    b,
                    out_dtype=out_dtype,
                    sides=sides,
                    global_scales=global_scales,
                    offsets=offsets,
                )
            except FP4GenError as err:  # a kernel that did not compile or load, a refused pair
                reason = str(err)
        log_fallback(f"{name}: the experts' wgrad GEMMs run per expert: {reason}")
    return torch.stack([_dense_fp8(a, b, out_dtype, None) for a, b in pairs])


def pass_reason(table: Any) -> str | None:
    """None when every GEMM of ``table`` can run grouped (both operands of each block formats
    whose element x block scale is exact in bf16, or a block-scaled FP8 pair (``_fp8_pair``),
    no operand quantized from another copy, none with per-row global scales), else why not."""
    from fp4gen.formats import BlockFormat, overflow_k

    pairs = (
        ("fprop", table.fprop_activation, table.fprop_weight),
        ("dgrad", table.dgrad_gradient, table.dgrad_weight),
        ("wgrad", table.wgrad_gradient, table.wgrad_activation),
    )
    for gemm, a, b in pairs:
        fp8 = _fp8_pair(a, b)
        for spec in (a, b):
            fmt = spec.format
            if not isinstance(fmt, BlockFormat):
                return f"the {gemm} GEMM has an operand in {fmt} (not a block format)"
            if not fmt.gemm_exact_in_bf16() and not fp8:
                return (
                    f"the {gemm} GEMM's {fmt.name} values (element x block scale) are not exact "
                    "in bf16 and not a block-scaled FP8 pair (their GEMM is the fp32 one, per "
                    "expert)"
                )
            if spec.source is not None:
                return f"a {gemm} operand is quantized from another GEMM's copy"
            if fmt.global_rows:
                # a grouped product scales each expert's rows by one S_dec pair
                return (
                    f"the {gemm} GEMM's {fmt.name} has per-row global scales (the grouped "
                    "products scale each expert by one global scale per operand)"
                )
        # the grouped products accumulate in fp32 too: a pair whose accumulator can overflow
        # at some K runs per expert, where each GEMM's dispatch sees its K
        if overflow_k(a.format, b.format) is not None:
            return (
                f"the {gemm} GEMM's decoded values can overflow an fp32 accumulator "
                "(gemm_dispatch.accumulator_overflow_reason: each expert's GEMM decides by its K)"
            )
    return None


__all__ = [
    "PRODUCTS",
    "GroupedProjection",
    "Groups",
    "decode_pair",
    "observe_pair",
    "fp8_grouped_reason",
    "group_k",
    "group_rows",
    "grouped_fprop_inputs",
    "grouped_mm_available",
    "pass_reason",
    "product_dtype",
    "real_rows",
    "set_grouped_product",
    "set_grouped_quantize",
    "set_grouped_tile_quantize",
]
