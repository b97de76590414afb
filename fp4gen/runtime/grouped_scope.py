"""The global scale's scope of an experts module's operands (``global per expert|tensor``,
docs/numerics.md 13).

Per expert (the default) each expert's GEMM operand is quantized as a dense layer's: its global
amax is its own. Per tensor, the operand of every expert is quantized with ONE amax, that of
all experts' operands of that slot together: A = max over the experts e of amax(T_e), T_e being
the tensor expert e's GEMM layer quantizes for the slot (padded and transposed as the layer
pads it, Hadamard-transformed where the spec has an RHT, with that expert's signs); then each
T_e is quantized with S_enc = fp32(scale_max * elem_max) / A and S_dec = 1 / S_enc, everything
else (block scales, codes, its seed, Philox offset and stochastic stream) as quantizing T_e
alone. The activations and gradients are taken over the experts that have tokens (the routed
tokens of this call), the weights over every expert of the module (the 3-D parameter), whether
routed or not.

``scope_amax`` computes A; ``quantize_scoped`` quantizes one expert's operand with it (the rows
of ``fp4gen.quantize`` of T_e with A in place of T_e's own amax: one block-row holding A is
appended, as ``fp4gen.runtime.global_amax`` does for an amax group, after the rows are zero-padded
to the block height, and cut off again; an RHT is applied first, by the reference transform, so
the appended row carries the amax of the transformed values); ``ScopedOperands`` is the mixin of
an expert's GEMM layer that quantizes its per-tensor slots so, with the amaxes its experts module
gave it (``scope_amaxes``). The per-expert loop (``fp4gen.runtime.experts``) and the grouped path
(``fp4gen.runtime.grouped``) both quantize through it, so they give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch

from fp4gen.dsl.model import Operand, OperandSpec, OperandTable
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat
from fp4gen.numerics import QuantizedTensor
from fp4gen.numerics.hadamard import rht
from fp4gen.numerics.quantize import PackedCodes
from fp4gen.runtime import finite
from fp4gen.runtime.operands import k_multiple, pad_to, quantize_operand, round_up

FORWARD_SLOTS: tuple[Operand, ...] = (Operand.FPROP_ACTIVATION, Operand.FPROP_WEIGHT)
BACKWARD_SLOTS: tuple[Operand, ...] = (
    Operand.DGRAD_GRADIENT,
    Operand.WGRAD_GRADIENT,
    Operand.WGRAD_ACTIVATION,
    Operand.DGRAD_WEIGHT,
)


def per_tensor(spec: OperandSpec) -> bool:
    """Whether ``spec`` takes one global amax over every expert (validated by the recipe: a
    block format with one global amax)."""
    return spec.global_scope == "tensor" and isinstance(spec.format, BlockFormat)


def scoped_slots(table: OperandTable, slots: Iterable[Operand]) -> list[Operand]:
    """The slots among ``slots`` whose spec in ``table`` is per tensor."""
    return [op for op in slots if per_tensor(table[op])]


def operand_tensor(op: Operand, layer: Any, table: OperandTable, t: torch.Tensor) -> torch.Tensor:
    """The tensor expert GEMM ``layer`` quantizes for slot ``op`` (before any RHT), from ``t``:
    its tokens x [n, in] for the activations, its output gradient dy [n, out] for the
    gradients, its weight slice w [out, in] for the weights; zero-padded and transposed as
    ``fp4gen.nn.Linear`` pads them (``_fprop``, ``_grads``, ``wgrad_activation``,
    ``columnwise_weight``)."""
    if op in (Operand.FPROP_ACTIVATION, Operand.FPROP_WEIGHT):
        return pad_to(t, t.shape[0], layer.fprop_k(table, t.shape[1]))
    wgrad_k = k_multiple(table.wgrad_gradient, table.wgrad_activation, blocks=True)
    dgrad_k = k_multiple(table.dgrad_gradient, table.dgrad_weight, blocks=False)
    if op is Operand.WGRAD_ACTIVATION:
        return pad_to(t, round_up(t.shape[0], wgrad_k), t.shape[1]).t()
    if op is Operand.DGRAD_WEIGHT:
        return pad_to(t.t(), t.shape[1], round_up(t.shape[0], dgrad_k))
    dy = pad_to(t, round_up(t.shape[0], wgrad_k), round_up(t.shape[1], dgrad_k))
    return dy if op is Operand.DGRAD_GRADIENT else dy.t()


def values_amax(t: torch.Tensor, spec: OperandSpec) -> torch.Tensor:
    """amax |T| in fp32 of the values the quantizer scales (the transformed ones with an RHT);
    a NaN stays NaN."""
    values = t if spec.rht is None else rht(t.contiguous(), spec.rht)
    return values.abs().amax().float()


def scope_amax(
    tensors: Sequence[torch.Tensor],
    specs: Sequence[OperandSpec],
    layers: Sequence[Any],
    op: Operand,
) -> torch.Tensor:
    """A: the amax over every expert's operand of slot ``op`` (module docstring), fp32 0-dim,
    from each expert's tensor (``operand_tensor``'s input), spec (its RHT signs may be its
    own) and GEMM layer. Without an RHT the padding is zeros and the transpose keeps the values,
    so the tensors are read as they are. No value is read back to the host."""
    found: list[torch.Tensor] = []
    for t, spec, layer in zip(tensors, specs, layers, strict=True):
        if t.numel() == 0:
            continue
        if spec.rht is None:
            found.append(t.detach().abs().amax().float())
        else:
            found.append(values_amax(operand_tensor(op, layer, layer.operands, t.detach()), spec))
    if not found:
        device = tensors[0].device if tensors else None
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(found).amax()


def quantize_scoped(
    t: torch.Tensor,
    spec: OperandSpec,
    amax: torch.Tensor,
    *,
    seed: int,
    offset: Any,
    backend: str = "auto",
) -> QuantizedTensor:
    """Q(t; spec) with the global amax ``amax`` (fp32 0-dim, at least the amax of t's scaled
    values, one of the values of some expert's operand) in place of t's own: ``t`` transformed
    by its RHT where it has one (the reference transform, whose values are bf16), zero-padded
    to a multiple of the block height, one block-row holding ``amax`` appended, quantized, and
    the padding's and that row's codes and scales cut off (module docstring). The result is
    t's operand: its shape, dtype and RHT."""
    fmt = spec.format
    assert isinstance(fmt, BlockFormat) and not fmt.global_rows
    rows, cols = t.shape
    x = t if spec.rht is None else rht(t.contiguous(), spec.rht).to(torch.bfloat16)
    height = fmt.block[0]
    padded = round_up(rows, height)
    extra = x.new_zeros((padded - rows + height, cols))
    extra[padded - rows, 0] = amax.to(x.dtype)  # exact: a value of some expert's operand
    plain = replace(spec, rht=None, global_scope="expert")
    q = quantize_operand(torch.cat((x, extra)), plain, seed=seed, offset=offset, backend=backend)
    assert isinstance(q, QuantizedTensor)
    block_rows = -(-rows // height)
    if q.scale_codes is not None:
        scales, scale_codes = None, q.scale_codes[:block_rows]
    else:
        scales, scale_codes = q.scales[:block_rows], None
    return QuantizedTensor(
        codes=None,
        scales=scales,
        scale_codes=scale_codes,
        global_scale=q.global_scale,
        format=q.format,
        rounding=q.rounding,
        rht=spec.rht,
        seed=q.seed,
        offset=q.offset,
        shape=t.shape,
        dtype=t.dtype,
        packed=PackedCodes(q.data[:rows], cols, q.element.bits),
    )


class ScopedOperands:
    """An expert GEMM layer's per-tensor slots (a mixin placed before ``Linear``): every
    quantization of such a slot goes through ``quantize`` (``_reduced`` says so to
    ``Linear``'s passes, which then neither share nor keep that copy, as for an amax group)
    with the amax its experts module put into ``scope_amaxes`` before the call."""

    def _reduced(self, op: Operand, spec: OperandSpec) -> bool:
        return per_tensor(spec)

    def _group_amax(self, t: torch.Tensor) -> torch.Tensor | None:
        # Linear asks once for both gradient copies; each slot's amax is in scope_amaxes
        return None

    @property
    def scope_amaxes(self) -> dict[Operand, torch.Tensor]:
        """Slot -> the amax over every expert, set by the experts module for this call."""
        found = self.__dict__.get("_scope_amaxes")
        if found is None:
            found = self.__dict__["_scope_amaxes"] = {}
        return found

    def quantize(
        self,
        t: torch.Tensor,
        op: Operand,
        spec: OperandSpec,
        call: int,
        amax: torch.Tensor | None = None,
        *,
        source_in_backward: bool = False,
        host_offset: bool = False,
    ) -> Any:
        if not per_tensor(spec):
            return super().quantize(  # type: ignore[misc]
                t,
                op,
                spec,
                call,
                source_in_backward=source_in_backward,
                host_offset=host_offset,
            )
        found = self.scope_amaxes.get(op)
        if found is None:
            raise FP4GenError(
                f"{self.name or 'an expert GEMM'}: {op.selector} takes the amax over every "  # type: ignore[attr-defined]
                "expert (global per tensor), which its experts module did not give"
            )
        _, offset = self.slot(  # type: ignore[attr-defined]
            op, spec, call, t, source_in_backward=source_in_backward, host_offset=host_offset
        )
        backend = self.backend  # type: ignore[attr-defined]
        # non-finite values as the layer's own quantize treats them (docs/numerics.md 7):
        # propagating, a NaN global scale for every expert (A is not finite then) with the
        # reference given finite values; raising, an error that names the cause
        t, flag = finite.reference_input(t, backend)
        if finite.propagates():
            good = torch.isfinite(found)
            flag = good if flag is None else flag & good
            found = torch.where(good, found, torch.zeros_like(found))
        elif not found.is_cuda and not bool(torch.isfinite(found)):
            raise TensorError(
                f"{self.name or 'an expert GEMM'}: {op.selector} of shape {tuple(t.shape)} "  # type: ignore[attr-defined]
                "takes the amax over every expert (global per tensor), and an expert's "
                "operand holds a NaN or an Inf"
            )
        q = quantize_scoped(
            t,
            spec,
            found,
            seed=self._seed_of(op),  # type: ignore[attr-defined]
            offset=offset,
            backend=backend,
        )
        return finite.poisoned(q, flag)

    def columnwise_weight(
        self,
        w: torch.Tensor,
        table: OperandTable,
        call: int,
        k: int | None = None,
        *,
        source_call: int | None = None,
    ) -> Any:
        from fp4gen.runtime.layer_quantize import _transposable

        spec = table.dgrad_weight
        if per_tensor(spec) and _transposable(table.fprop_weight, spec):
            # the transpose of the rowwise codes, as Linear makes it, but with the scope's
            # amax (Linear's tile kernel takes the weight's own)
            w = w if w.is_contiguous() else w.contiguous()
            return self.quantize(w, Operand.DGRAD_WEIGHT, spec, call).transpose()
        return super().columnwise_weight(w, table, call, k, source_call=source_call)  # type: ignore[misc]


def give_amaxes(
    layers: Sequence[Any],
    slots: Iterable[Operand],
    tensor_of: Callable[[Operand, int], torch.Tensor],
    experts: Sequence[int],
    every_layer: Sequence[Any],
) -> None:
    """Put into every layer of ``every_layer`` (one experts module's GEMM layers of one
    projection, by expert index) the scope amax of each per-tensor slot among ``slots``:
    over the experts with tokens (``experts``, whose layers are ``layers``) for activations and
    gradients, over every expert for the weights. ``tensor_of(op, expert)`` gives expert's
    input tensor of ``operand_tensor`` for that slot."""
    if not every_layer:
        return
    table = every_layer[0].operands
    for op in scoped_slots(table, slots):
        chosen = range(len(every_layer)) if op.role == "weight" else experts
        chosen_layers = [every_layer[e] for e in chosen]
        amax = scope_amax(
            [tensor_of(op, e) for e in chosen],
            [layer.operands[op] for layer in chosen_layers],
            chosen_layers,
            op,
        )
        for layer in every_layer:
            layer.scope_amaxes[op] = amax


class ScopeBarrier(torch.autograd.Function):
    """The identity on one projection's per-expert outputs whose backward first calls ``give``
    with every expert's output gradient: so the backward amaxes of per-tensor slots are known
    before any expert's GEMM backward runs (each one's gradient comes only through here)."""

    @staticmethod
    def forward(ctx: Any, give: Callable[[list[torch.Tensor]], None], *ys: torch.Tensor):  # type: ignore[override]
        ctx.give = give
        return tuple(y.view_as(y) for y in ys)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):  # type: ignore[override]
        ctx.give(list(grads))
        return (None, *grads)


__all__ = [
    "BACKWARD_SLOTS",
    "FORWARD_SLOTS",
    "ScopeBarrier",
    "ScopedOperands",
    "give_amaxes",
    "operand_tensor",
    "per_tensor",
    "quantize_scoped",
    "scope_amax",
    "scoped_slots",
    "values_amax",
]
