"""The precision schedule: which operand table a layer uses at the current training step.

A recipe's ``schedule`` rules switch the forward pass (fprop operands), the backward pass (dgrad
and wgrad operands) or both to another format or recipe from a step, or from a fraction of the
run, on (the NVFP4 paper's Appendix D). The training loop tells the model where it is with
``fp4gen.set_step``; every converted layer shares one ``TrainingClock``.
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


def action_mors(action: LayerAction) -> tuple[MoRSpec, ...]:
    """The MoR rules the operand table of ``action`` may name (those of a referenced recipe)."""
    if isinstance(action, RecipeRef) and action.recipe is not None:
        return action.recipe.mors
    return ()


@dataclass
class ScheduledOperands:
    """A layer's base operand table plus the schedule rules that may replace parts of it."""

    base: OperandTable
    rules: tuple[ScheduleRule, ...] = ()
    clock: TrainingClock = field(default_factory=TrainingClock)
    # which rules are in force -> the table they make: one object per phase of training, so
    # that what a layer derives from a table can be kept by the table's identity
    _tables: dict[tuple[bool, ...], OperandTable] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name in ("base", "rules") and "_tables" in self.__dict__:
            self._tables.clear()  # composed from what just changed

    def tables(self) -> list[OperandTable]:
        """The base table and each rule's table: every table a slot in force is taken from."""
        return [self.base, *(action_table(rule.action) for rule in self.rules)]

    def active(self) -> OperandTable:
        if not self.rules:
            return self.base
        reached = tuple(self.clock.reached(rule) for rule in self.rules)
        table = self._tables.get(reached)
        if table is None:
            table = self._tables[reached] = self._compose(reached)
        return table

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
