"""Which operand table a layer's call runs with: the schedule's table at the current step (the
eval table while the layer is not training, RHT signs drawn for this layer and step where the
recipe redraws them), the check that the runtime can run every table, and what a pass's table
holds of Mixture-of-Representations operands."""

from __future__ import annotations

from typing import NamedTuple

from fp4gen.dsl.model import MoRRef, OperandTable
from fp4gen.formats import BlockFormat, is_stochastic
from fp4gen.runtime.operands import check_supported
from fp4gen.runtime.schedule import BACKWARD_SLOTS, FORWARD_SLOTS


class TableFacts(NamedTuple):
    """What a layer's per-call paths ask of an operand table (``LayerTables._table_facts``)."""

    redrawn: bool  # RHT signs drawn per layer or step (``OperandTable.redrawn``)
    redrawn_per_step: bool  # drawn per step
    stochastic_scales: bool  # a block format whose scales round stochastically


class LayerTables:
    """The operand table of a layer's call (a ``Linear`` mixin: it reads ``schedule``,
    ``training``, ``seed``, ``mors``, ``_redrawn``, ``_table_facts_seen`` and ``_mors_seen``)."""

    def check_supported(self) -> None:
        """Raise FP4GenError for an operand (of the base table or any table the schedule switches
        to) that the runtime cannot run, e.g. a MoR rule the layer was not given."""
        tables = self.schedule.tables()
        for table in tables:
            for op, spec in table.items():
                check_supported(spec, f"{self.name or 'this layer'}: {op.selector}", self.mors)

    @property
    def operands(self) -> OperandTable:
        """The operand table in force at the current step; while the layer is not training
        (``module.eval()``), with the recipe's eval statement's fprop operands."""
        table = self.schedule.active(evaluating=not self.training)
        if self._table_facts(table, 0).redrawn:  # RHT signs drawn per layer (and step)
            last, step = self._redrawn, self.schedule.clock.step
            if last[0] is not table or last[1] != step:
                last[:] = table, step, table.at(self.seed, step)
            return last[2]
        return table

    def _table_facts(self, table: OperandTable, slot: int) -> TableFacts:
        """What the per-call paths ask of ``table`` (``TableFacts``), looked at once per table
        object and ``slot`` (0: the schedule's table, ``operands``; 1: a pass's table, the
        layer graphs' check): each answer walks the six operands, and a compiled step asked
        them on every layer pass (the schedule hands over the same table object until it
        switches)."""
        seen = self._table_facts_seen[slot]
        if seen[0] is not table:
            facts = TableFacts(
                redrawn=table.redrawn(),
                redrawn_per_step=table.redrawn(per_step=True),
                stochastic_scales=any(
                    isinstance(spec.format, BlockFormat)
                    and spec.format.scale.rounding == "stochastic"
                    for _, spec in table.items()
                ),
            )
            seen = (table, facts)
            self._table_facts_seen[slot] = seen
        return seen[1]

    def _pass_mors(self, table: OperandTable, forward: bool) -> tuple[bool, bool]:
        """(whether a pass has a MoR operand, whether one of them rounds stochastically) under
        ``table``, looked at once per table (the schedule hands over the same table object
        until it switches): a per-call question of the forward and backward paths."""
        seen, answer = self._mors_seen[forward]
        if seen is not table:
            specs = [
                getattr(table, name) for name in (FORWARD_SLOTS if forward else BACKWARD_SLOTS)
            ]
            mors = [spec for spec in specs if isinstance(spec.format, MoRRef)]
            answer = (bool(mors), any(is_stochastic(spec.rounding) for spec in mors))
            self._mors_seen[forward] = (table, answer)
        return answer
