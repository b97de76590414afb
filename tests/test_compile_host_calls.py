"""Per-call host work of a converted layer that a compiled step repeats for every layer pass:
what depends only on the operand table is looked at once per table object.

A compiled step runs each layer's forward and backward op on its own (no layer groups), and
each pass asked the table whether its RHT signs are redrawn (``OperandTable.redrawn``, a walk
over the six operands) three times: for the layer's table (``operands``, twice: the forward,
and the backward's wgrad copy and GEMMs) and for the layer graphs' check, which also walked
the operands for stochastically rounded scales (``OperandTable.items``)."""

from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.dsl.model import OperandTable


@pytest.mark.parametrize("recipe", ["nvfp4_no_bf16", "fp8_blockwise"])
def test_a_layer_walks_its_operand_table_once_per_table(recipe: str, monkeypatch) -> None:
    layer = fp4gen.nn.Linear(64, 48, recipe=recipe)
    calls: list[str] = []
    redrawn, items = OperandTable.redrawn, OperandTable.items

    def counted_redrawn(self, *, per_step: bool = False) -> bool:
        calls.append("redrawn")
        return redrawn(self, per_step=per_step)

    def counted_items(self):
        calls.append("items")
        return items(self)

    monkeypatch.setattr(OperandTable, "redrawn", counted_redrawn)
    monkeypatch.setattr(OperandTable, "items", counted_items)
    x = torch.randn(32, 64, requires_grad=True)
    layer(x).sum().backward()
    first = len(calls)
    assert 0 < first <= 6  # the table's answers, once (each redrawn() walks items() too)
    for _ in range(3):
        layer(x).sum().backward()
        compiled = torch.ops.fp4gen.linear_forward.default(
            x, layer.weight, None, layer._op_id, x.dtype
        )
        compiled.sum().backward()
    assert len(calls) == first  # none per call
    # the layer graphs' check (CUDA only) asks about the pass's table in a slot of its own:
    # answered once (its facts as the layer's), then remembered
    facts = layer._table_facts(layer.operands, 1)
    answered = len(calls)
    assert answered > first
    assert layer._table_facts(layer.operands, 1) == facts
    assert len(calls) == answered
    assert facts == (False, False, False)  # these recipes: fixed signs, scales to nearest


def test_the_remembered_facts_are_the_tables(monkeypatch) -> None:
    """nvfp4_quartet2 draws its backward signs every step and rounds its scales
    stochastically: the facts say so, for the schedule's table and the resolved one alike."""
    layer = fp4gen.nn.Linear(256, 128, recipe="nvfp4_quartet2")
    base = layer.schedule.active(evaluating=False)
    assert layer._table_facts(base, 0) == (True, True, True)
    resolved = layer.operands  # the signs of this layer and step
    assert resolved is not base
    assert layer._table_facts(resolved, 1) == (
        resolved.redrawn(),
        resolved.redrawn(per_step=True),
        True,
    )


# fp4gen's own calls per converted Linear forward + backward in a compiled step, on the layer
# graphs' path (emulated: benchmarks/compiled_host_calls.py), down to the entry of the
# numerics: 176 before the per-call cuts (the 2-D stride check of the op results, one look at
# the table and at the non-finite mode per pass, the shared copies reset only when held),
# 158 after, where the eager route (no layer groups) makes 156. A count, not a time: exact on
# any host for one torch version; the bound leaves 2 calls of room for torch's own changes.
COMPILED_BODY_CALLS_PER_LINEAR = 160


def test_a_compiled_step_makes_at_most_the_counted_calls_per_linear() -> None:
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import compiled_host_calls

    got = compiled_host_calls.count_step("nvfp4_small", compiled=True, blocks=2, graphs=True)
    assert got.linears == 7  # the first block's; the last block is BF16 (nvfp4_small)
    # every pass of the counted step replayed its layer graph in place, as from the third step
    # on a GPU: 7 forwards, 7 backwards (each quantizes its own wgrad copy: the compiled ops
    # share none)
    assert got.in_place_replays == 7 + 7
    per_linear = got.per_linear(got.body_calls)
    assert 100 < per_linear <= COMPILED_BODY_CALLS_PER_LINEAR
    # torch operations in the bodies on that path: the result tensors, nothing else
    assert got.per_linear(got.body_ops) <= 4


@pytest.mark.parametrize(
    ("shape", "strides"),
    [((1, 8), (16, 1)), ((5, 1), (1, 1)), ((5, 1), (4, 1)), ((0, 4), (4, 1)), ((3, 0), (1, 1)),
     ((4, 6), (6, 1)), ((4, 6), (1, 4)), ((2, 3, 4), (12, 4, 1)), ((2, 1, 4), (4, 8, 1))],
)  # fmt: skip
def test_row_major_checks_2d_results_as_the_general_rule_does(shape, strides) -> None:
    """``ops.row_major`` checks a 2-D result against (columns, 1) without building the strides
    in a loop: the strides it gives are the general rule's (each dimension's stride the product
    of the sizes after it, a size 0 counted as 1), for size-1, empty and transposed layouts."""
    from fp4gen.runtime.ops import row_major

    storage = torch.arange(64, dtype=torch.float32)
    t = storage.as_strided(shape, strides)
    want, step = [], 1
    for size in reversed(shape):
        want.append(step)
        step *= max(size, 1)
    got = row_major(t)
    assert got.stride() == tuple(reversed(want))
    assert got.shape == t.shape and torch.equal(got, t)
