"""Whether a layer's pass may run from its layer graph (``fp4gen.runtime.layer_graphs``), and the
keys its graphs are found by: the operand table and the wgrad copy's layout by identity
(``_Identity``, interned so that a key hashes without walking their fields), the parameters by
address and layout (``_param_key``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from fp4gen.dsl.model import OperandTable
from fp4gen.numerics.quantize import QuantizedLayout
from fp4gen.runtime import finite, ops
from fp4gen.runtime.layer_graphs import LayerGraphs, worth_graphing
from fp4gen.settings import layer_graphs_enabled

# distinct wgrad-copy layouts a layer interns for its backward graph keys before starting over
MAX_LAYOUT_PARTS = 64


class _Identity:
    """A key part that compares by identity and keeps its object alive (so its id is never
    reused while a key holds it): hashing an operand table per call would cost host time."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj


def _param_key(p: torch.Tensor | None) -> tuple[Any, ...] | None:
    """A parameter as a layer graph reads it: in place, at this address and layout."""
    if p is None:
        return None
    return (p.data_ptr(), p.shape, p.stride(), p.dtype, p.device)


class LayerGraphKeys:
    """A layer's layer graphs and their keys (a ``Linear`` mixin)."""

    def _graphs_for(
        self, t: torch.Tensor, table: OperandTable, *, forward: bool
    ) -> LayerGraphs | None:
        """The layer's graphs when this pass may run from one (fp4gen.runtime.layer_graphs):
        CUDA, the kernels' backend, block formats or high precision only (MoR decides on the
        host), no telemetry (it records on the host), non-finite inputs propagated, and no
        amax group."""
        if not self._graphable(t, table, forward=forward):
            return None
        if self._graphs is None:
            self._graphs = LayerGraphs(self.name)
        return self._graphs

    def _graphable(self, t: torch.Tensor, table: OperandTable, *, forward: bool) -> bool:
        """Whether a pass on ``t`` may run from a layer graph (``_graphs_for``)."""
        if not t.is_cuda or self.telemetry.every or not layer_graphs_enabled():
            return False
        if self.amax_group is not None:
            return False  # a collective inside a captured graph: not proven safe, so eager
        if self.backend not in ("auto", "cute") or not finite.propagates():
            # outside a propagating scope (a direct forward_gemm call, FP4GEN_CHECK_FINITE=raise)
            # the quantize calls read their finite flags on the host, which a capture refuses
            return False
        if not worth_graphing(t.shape[0], self.in_features, self.out_features):
            return False  # the GPU work outlasts the launches: a graph's copies would cost more
        facts = self._table_facts(table, 1)
        if facts.redrawn_per_step:
            return False  # RHT signs drawn every step: a graph would keep one step's signs
        if facts.stochastic_scales:
            return False  # the reference draws stochastic scales from the host's offset
        return not self._pass_mors(table, forward)[0]

    def _pass_key(
        self, table: OperandTable, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[Any, ...]:
        """What a layer graph of a group (``fp4gen.runtime.layer_groups``) depends on in this
        member besides the group's tensors: its parameters where they are, its operand table,
        backend and seed."""
        return (
            _param_key(weight),
            _param_key(bias),
            self._table_key(table),
            self.backend,
            self.seed,
        )

    def release_graphs(self) -> None:
        """Release this layer's own layer graphs (their static buffers and pool claims): its
        passes run from its layer group's graphs now (``fp4gen.runtime.layer_groups``)."""
        if self._graphs is not None:
            self._graphs.clear()

    def _described(self, layout: QuantizedLayout, packing: ops.Packing | None) -> _Identity:
        """``layout`` without its offset, and the copy's packing, as a backward graph's key
        holds them: one object per distinct value (interned), named by identity, so a key hashes
        and compares it without walking its fields. A replayed forward graph hands over the
        same layout and packing objects every step: looked up once for them."""
        last = self._last_described  # [layout, packing, its key part], mutated (no setattr)
        if last[0] is not layout or last[1] is not packing:
            described = (replace(layout, offset=None), packing)
            parts = self._layout_parts
            if len(parts) >= MAX_LAYOUT_PARTS:  # shapes that keep changing: start over (keys
                parts.clear()  # hold their parts, so an equal layout only gets a new key)
            last[:] = layout, packing, parts.setdefault(described, _Identity(described))
        return last[2]

    def _table_key(self, table: OperandTable) -> _Identity:
        """The operand table as a graph key holds it (by identity: the schedule hands over the
        same table object until it switches), made once per table."""
        last = self._table_part  # [table, its key part], mutated: no Module.__setattr__
        if last[0] is not table:
            last[:] = table, _Identity(table)
        return last[1]
