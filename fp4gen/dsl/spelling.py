"""Canonical one-line spellings of recipe-model values: a block shape, a layer selector, a
schedule point, a layer action, an RHT as JSON.

The compiler names the contexts of a plan with them ("layers: first 2 blocks : bf16") and writes
them into manifests; ``fp4gen.describe`` uses the same spellings in what the app prints. They
are part of the model's vocabulary, so they live below both (no parser, no torch).
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

from fp4gen.dsl.model import LayerSelector, MoRRef, Partition, RecipeRef, RHTSpec, ScheduleRule
from fp4gen.formats import BlockFormat, ElementFormat, HighPrecision


def block_text(block: tuple[int, int]) -> str:
    return f"{block[0]}x{block[1]}"


def percent(fraction: float) -> str:
    """The shortest decimal percentage that reads back as exactly this fraction: two rules at
    different points of training never share a spelling (``:g`` would round to 6 digits)."""
    center = fraction * 100
    candidates = [center, math.nextafter(center, math.inf), math.nextafter(center, -math.inf)]
    for digits in range(1, 18):
        for value in candidates:
            text = format(Decimal(f"{value:.{digits}g}"), "f")
            if float(text) / 100 == fraction:
                return text + "%"
    return f"{center!r}%"  # not finite: no decimal reads back as it


def quoted(text: str) -> str:
    """``text`` as a recipe string: quotes, backslashes, line feeds and tabs escaped, so that
    a pattern or a path stays on one line and reads back as written."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"' + escaped.replace("\t", "\\t") + '"'


def format_text(fmt: BlockFormat | HighPrecision | MoRRef | ElementFormat) -> str:
    if isinstance(fmt, MoRRef):
        return f"mor {fmt.name}"
    return fmt.name


def partition_text(part: Partition) -> str:
    return f"block {block_text(part.block)}" if part.block else part.kind


def selector_text(sel: LayerSelector) -> str:
    if sel.kind == "match":
        return f"match {quoted(sel.pattern or '')}"
    amount = percent(sel.fraction) if sel.fraction is not None else str(sel.count)
    return f"{sel.kind} {amount} {sel.unit}"


def action_text(action: HighPrecision | BlockFormat | RecipeRef) -> str:
    if isinstance(action, RecipeRef):
        return f"recipe {quoted(action.path)}"
    return action.name


def when_text(rule: ScheduleRule) -> str:
    return f"step {rule.step}" if rule.step is not None else f"{percent(rule.fraction or 0.0)}"


def rht_json(rht: RHTSpec | None) -> dict[str, Any] | None:
    if rht is None:
        return None
    return {
        "size": rht.size,
        "sign_source": rht.sign_source,
        "signs": list(rht.signs) if rht.signs else None,
        "seed": rht.seed,
        **({"stream": rht.stream} if rht.stream is not None else {}),
    }


__all__ = [
    "action_text",
    "block_text",
    "format_text",
    "partition_text",
    "percent",
    "quoted",
    "rht_json",
    "selector_text",
    "when_text",
]
