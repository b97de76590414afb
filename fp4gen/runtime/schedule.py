"""The precision schedule: which operand table a layer uses at the current training step.

A recipe's ``schedule`` rules switch the forward pass (fprop operands), the backward pass (dgrad
and wgrad operands) or both to another format or recipe from a step, or from a fraction of the
run, on (the NVFP4 paper's Appendix D). The training loop tells the model where it is with
``fp4gen.set_step``; every converted layer shares one ``TrainingClock``.

A recipe's ``eval`` statement (``evaluation``) replaces the fprop operands of the table in force
while the layer is not training (``module.eval()``): the caller says so with ``active(evaluating=
True)``. Each combination of rules reached and evaluation is one table object, so what a layer
keys by a table's identity (layer graphs, layer groups) tells an eval forward from a training one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from fp4gen.dsl.model import (
    LayerAction,
    MoRSpec,
    OperandSpec,
    OperandTable,
    RecipeRef,
    ScheduleRule,
)
from fp4gen.errors import FP4GenError
from fp4gen.formats import BlockFormat, HighPrecision

FORWARD_SLOTS = ("fprop_activation", "fprop_weight")
BACKWARD_SLOTS = ("dgrad_gradient", "dgrad_weight", "wgrad_gradient", "wgrad_activation")


@dataclass
class TrainingClock:
    """Where training is: the optimizer step and, for fractional rules, the run's length."""

    step: int = 0
    total_steps: int | None = None

    def reached(self, rule: ScheduleRule) -> bool:
        if rule.step is not None:
            return self.step >= rule.step
        if self.total_steps is None:
            raise FP4GenError(
                f"the recipe switches precision at {rule.fraction:.4g} of training; "
                "pass total_steps to fp4gen.convert or to fp4gen.set_step (a converted model "
                "or an fp4gen.nn.Linear)"
            )
        return self.step >= math.ceil((rule.fraction or 0.0) * self.total_steps)


def action_table(action: LayerAction) -> OperandTable:
    """The operand table a layer-rule or schedule action stands for."""
    if isinstance(action, RecipeRef):
        if action.recipe is None:
            raise FP4GenError(f'recipe "{action.path}" was not loaded')
        return action.recipe.operands
    if isinstance(action, HighPrecision | BlockFormat):
        return OperandTable.uniform(OperandSpec(action))
    raise TypeError(f"unknown action {action!r}")


def action_mors(action: LayerAction | None) -> tuple[MoRSpec, ...]:
    """The MoR rules the operand table of ``action`` may name (those of a referenced recipe;
    none for no action)."""
    if isinstance(action, RecipeRef) and action.recipe is not None:
        return action.recipe.mors
    return ()


@dataclass
class ScheduledOperands:
    """A layer's base operand table plus the schedule rules that may replace parts of it."""

    base: OperandTable
    rules: tuple[ScheduleRule, ...] = ()
    clock: TrainingClock = field(default_factory=TrainingClock)
    # the recipe's eval statement: None runs the fprop operands in force (eval : fprop)
    evaluation: LayerAction | None = None
    # (which rules are in force, evaluating) -> the table they make: one object per phase of
    # training, so that what a layer derives from a table can be kept by the table's identity
    _tables: dict[tuple[tuple[bool, ...], bool], OperandTable] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name in ("base", "rules", "evaluation") and "_tables" in self.__dict__:
            self._tables.clear()  # composed from what just changed

    def tables(self) -> list[OperandTable]:
        """The base table, each rule's table and the eval table (the base's with the eval
        action's fprop slots): every table a slot in force is taken from."""
        tables = [self.base, *(action_table(rule.action) for rule in self.rules)]
        if self.evaluation is not None:
            tables.append(self._evaluated(self.base))
        return tables

    def active(self, evaluating: bool = False) -> OperandTable:
        """The table in force at the clock's step; ``evaluating`` (the layer is not training)
        gives the eval statement's fprop slots in place of the schedule's."""
        evaluating = evaluating and self.evaluation is not None
        if not self.rules and not evaluating:
            return self.base
        reached = tuple(self.clock.reached(rule) for rule in self.rules)
        table = self._tables.get((reached, evaluating))
        if table is None:
            table = self._compose(reached)
            if evaluating:
                table = self._evaluated(table)
            self._tables[(reached, evaluating)] = table
        return table

    def _evaluated(self, table: OperandTable) -> OperandTable:
        """``table`` with the eval action's fprop slots (a bf16 eval: both in bf16)."""
        assert self.evaluation is not None
        target = action_table(self.evaluation)
        return replace(table, **{name: getattr(target, name) for name in FORWARD_SLOTS})

    def _compose(self, reached: tuple[bool, ...]) -> OperandTable:
        table = self.base
        # in recipe order: a later rule overrides an earlier one
        for rule, on in zip(self.rules, reached, strict=True):
            if not on:
                continue
            target = action_table(rule.action)
            slots = {"forward": FORWARD_SLOTS, "backward": BACKWARD_SLOTS}.get(
                rule.passes, FORWARD_SLOTS + BACKWARD_SLOTS
            )
            table = replace(table, **{name: getattr(target, name) for name in slots})
        return table


def all_slots() -> tuple[str, ...]:
    return tuple(f.name for f in fields(OperandTable))
