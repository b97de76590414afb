"""The state one recipe file resolves to before its names are bound: the operand cascade's
slots and the file's unit. resolve.py fills them; validate.py finishes a unit into a Recipe.
Both read these types from here, so neither module imports the other's."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fp4gen.dsl.model import MoRSpec, Operand, RHTSpec
from fp4gen.dsl.source import At, Pos, Source
from fp4gen.dsl.statements import EvalStmt, FormatRef, LayersSection, ScheduleSection, Shape
from fp4gen.formats import Format


@dataclass
class Slot:
    """The cascade state of one operand: each property and the statement that set it last."""

    format: At[FormatRef] | None = None
    block: At[Shape] | None = None
    rounding: At[str] | None = None
    rht: At[RHTSpec | None] | None = None
    source: At[Operand | None] | None = None  # ``from GEMM.ROLE`` / ``from none``
    global_scope: At[str] | None = None  # ``global per expert|tensor``
    order: dict[str, int] = field(default_factory=dict)  # property -> when it was set

    def copy(self) -> Slot:
        return replace(self, order=dict(self.order))


@dataclass
class Unit:
    """One file after includes and the cascade, before names are bound."""

    source: Source
    name: str | None = None
    description: str | None = None
    formats: dict[str, At[Format]] = field(default_factory=dict)  # non-builtin or redefined
    mors: dict[str, At[MoRSpec]] = field(default_factory=dict)
    slots: dict[Operand, Slot] = field(default_factory=lambda: {op: Slot() for op in Operand})
    layers: LayersSection | None = None
    schedule: ScheduleSection | None = None
    evaluation: EvalStmt | None = None  # the eval statement in force (this file's or inherited)
    anchor: Pos | None = None  # where an operand left without a format is reported


__all__ = ["Slot", "Unit"]
