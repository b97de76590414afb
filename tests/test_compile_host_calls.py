"""Per-call host work of a converted layer that a compiled step repeats for every layer pass:
what depends only on the operand table is looked at once per table object.

A compiled step runs each layer's forward and backward op on its own (no layer groups), and
each pass asked the table whether its RHT signs are redrawn (``OperandTable.redrawn``, a walk
over the six operands) three times: for the layer's table (``operands``, twice: the forward,
and the backward's wgrad copy and GEMMs) and for the layer graphs' check."""

from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.dsl.model import OperandTable


@pytest.mark.parametrize("recipe", ["nvfp4_no_bf16", "fp8_blockwise"])
def test_a_layer_asks_whether_signs_are_redrawn_once_per_table(recipe: str, monkeypatch) -> None:
    layer = fp4gen.nn.Linear(64, 48, recipe=recipe)
    calls: list[bool] = []
    original = OperandTable.redrawn

    def counted(self, *, per_step: bool = False) -> bool:
        calls.append(per_step)
        return original(self, per_step=per_step)

    monkeypatch.setattr(OperandTable, "redrawn", counted)
    x = torch.randn(32, 64, requires_grad=True)
    layer(x).sum().backward()
    first = len(calls)
    assert first <= 2  # the table's two answers, once
    for _ in range(3):
        layer(x).sum().backward()
        compiled = torch.ops.fp4gen.linear_forward.default(
            x, layer.weight, None, layer._op_id, x.dtype
        )
        compiled.sum().backward()
    assert len(calls) == first  # none per call
    # the layer graphs' check (CUDA only) asks about the pass's table in a slot of its own
    assert layer._redraws(layer.operands, 1) == layer._redraws(layer.operands, 1)
    assert len(calls) == first + 2
