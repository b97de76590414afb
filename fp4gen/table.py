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
    """A table of every linear layer of a converted model and what it runs in; then the
    parameters of ``report_min_elements`` or more that the conversion left in high precision,
    with the reason, and the shares of the parameters (and of the linear layers' parameters)
    quantized."""
    # loaded here, not with the module: the runtime imports torch, which the CLI defers
    from fp4gen.runtime.convert import layer_decisions, report

    rows = [
        [
            str(d.layer_index),
            "-" if d.block_index is None else str(d.block_index),
            _module_label(d),
            d.precision,
            d.reason,
        ]
        for d in layer_decisions(model)
    ]
    text = render_table(["layer", "block", "module", "runs in", "why"], rows)
    done = report(model)
    if done.kept:
        kept = [[k.name, "x".join(map(str, k.shape)), k.reason] for k in done.kept]
        text += (
            f"\n\nleft in high precision (parameters of {done.min_elements} elements or more):\n"
            + render_table(["parameter", "shape", "why"], kept)
        )
    text += (
        f"\n\nquantized: {done.quantized} of {done.parameters} parameter elements "
        f"({done.share:.1%}); {done.quantized} of {done.layer_parameters} in linear layers "
        f"({done.layer_share:.1%})"
    )
    evaluation = _evaluation(model)
    if evaluation is not None:
        text += f"\nnot training (model.eval()): the forward runs {evaluation}"
    return text


def _evaluation(model: Any) -> str | None:
    """What the converted layers' forward runs in under model.eval(), where the recipe's eval
    statement changes it (one statement per conversion: the first layer's says it)."""
    from fp4gen.describe import eval_text
    from fp4gen.runtime.experts import GroupedExperts
    from fp4gen.runtime.linear import Linear

    for module in model.modules():
        layer = module.gemms[0][0] if isinstance(module, GroupedExperts) else module
        if isinstance(layer, Linear) and layer.schedule.evaluation is not None:
            return eval_text(layer.schedule.evaluation)
    return None


def _module_label(decision: Any) -> str:
    """A layer's name, with its kind where it is not an nn.Linear."""
    if decision.conv1d:
        return f"{decision.name} (Conv1D)"
    if decision.experts:
        return f"{decision.name} ({decision.experts} experts)"
    return decision.name


__all__ = ["render_table", "show_plan"]
