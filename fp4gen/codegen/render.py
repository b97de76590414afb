"""What every code generator shares to turn a context into module text: the template folder, the
Jinja environment with its filters, the PEP 8 tidy pass over the rendered text, and the spellings
of literals and docstring blocks.

One environment serves every template so that the generated modules differ only where their
contexts do (the same whitespace rules, the same ``pytuple`` filter).
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import jinja2

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"


def lit(x: float) -> str:
    """A Python literal for an fp32 value (repr round-trips exactly; inf via math.inf)."""
    if math.isinf(x):
        return "math.inf" if x > 0 else "-math.inf"
    return repr(float(x)).replace("e+", "e")


def pytuple(items: Iterable[object]) -> str:
    """A Python tuple literal: ("a", "b"), (1,) or ()."""
    items = list(items)
    body = ", ".join(f'"{i}"' if isinstance(i, str) else repr(i) for i in items)
    return f"({body},)" if len(items) == 1 else f"({body})"


def spec_entries(spec: Any) -> dict[str, Any]:
    """The context entries every template reads the same way: the spec, its repr (the module
    records it), its name and digest."""
    return {"spec": spec, "spec_repr": repr(spec), "name": spec.name, "digest": spec.digest}


def doc_block(text: str) -> str:
    """``text`` filled into a docstring paragraph indented for a function body."""
    return textwrap.fill(text, width=96, initial_indent="    ", subsequent_indent="    ")


_DEFINITION = re.compile(r"^(def |class |@)")


def tidy(source: str) -> str:
    """PEP 8 spacing of the rendered text: two blank lines around top-level definitions (a
    top-level def/class/decorator, or a comment after an indented body), at most two blank lines
    in a row, one newline at the end."""
    out: list[str] = []
    for line in source.splitlines():
        line = line.rstrip()
        if not line:
            if len(out) < 2 or out[-1] or out[-2]:
                out.append(line)
            continue
        if not line[0].isspace():
            prev = next((p for p in reversed(out) if p), "")
            leaving_body = prev[:1].isspace()
            if (_DEFINITION.match(line) and not prev.startswith(("@", "#"))) or (
                leaving_body and line.startswith("#")
            ):
                while out and not out[-1]:
                    out.pop()
                if out:
                    out += ["", ""]
        out.append(line)
    return "\n".join(out).rstrip("\n") + "\n"


@cache
def environment() -> jinja2.Environment:
    """The Jinja environment of every template (built once: it caches compiled templates)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["pytuple"] = pytuple
    return env


def render_template(name: str, context: dict[str, Any]) -> str:
    """Template ``name`` rendered with ``context``, tidied."""
    return tidy(environment().get_template(name).render(**context))


__all__ = [
    "TEMPLATE_DIR",
    "doc_block",
    "environment",
    "lit",
    "pytuple",
    "render_template",
    "spec_entries",
    "tidy",
]
