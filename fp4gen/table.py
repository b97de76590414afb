"""Plain-text tables for the command line and for the summaries the app prints.

``render_table`` lays out a header, a rule and the rows in left-aligned columns. ``show_plan``
renders what ``fp4gen.convert`` decided for each linear layer of a model (the decisions
themselves are data: ``fp4gen.runtime.convert.layer_decisions``). Importing this module loads
nothing but the standard library, so the command line starts fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=False)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()
    rule = "  ".join("-" * w for w in widths)
    body = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in rows
    ]
    return "\n".join([line, rule, *body])


def show_plan(model: Any) -> str:
    """A table of every linear layer of a converted model and what it runs in."""
    # loaded here, not with the module: the runtime imports torch, which the CLI defers
    from fp4gen.runtime.convert import layer_decisions

    rows = [
        [
            str(d.layer_index),
            "-" if d.block_index is None else str(d.block_index),
            f"{d.name} (Conv1D)" if d.conv1d else d.name,
            d.precision,
            d.reason,
        ]
        for d in layer_decisions(model)
    ]
    return render_table(["layer", "block", "module", "runs in", "why"], rows)


__all__ = ["render_table", "show_plan"]
