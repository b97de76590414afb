"""What every code generator shares to turn a context into module text: the template folder, the
Jinja environment with its filters, the PEP 8 tidy pass over the rendered text, the spellings
of literals and docstring blocks, and the base of the typed contexts (``TemplateContext``) with
the parts they share (``SpecEntries``, ``InputContext``).

One environment serves every template so that the generated modules differ only where their
contexts do (the same whitespace rules, the same ``pytuple`` filter).
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import jinja2

from fp4gen.vocab import DTYPES

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


# Field metadata of a TemplateContext field whose own fields are template variables
_INLINE = "inline"


def inline() -> Any:
    """A TemplateContext field whose value (a TemplateContext) is spread into the template's
    variables: the part several contexts share, typed once."""
    return field(metadata={_INLINE: True})


@dataclass(frozen=True)
class TemplateContext:
    """A typed template context: a frozen dataclass whose fields are the template's variables.

    Each subclass is built in one place, so a missing or misspelt entry fails where the context
    is built, not halfway through a render. Nested values stay objects: Jinja reads
    ``elem.name`` from a dataclass as it read it from a dict.
    """

    def as_template_vars(self) -> dict[str, Any]:
        """The fields by name, shallowly; an ``inline()`` field's own variables in its place."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            inner = value.as_template_vars() if f.metadata.get(_INLINE) else {f.name: value}
            clash = out.keys() & inner.keys()
            if clash:
                raise TypeError(f"{type(self).__name__}: template variables {sorted(clash)} twice")
            out.update(inner)
        return out


class KernelSpec(Protocol):
    """What SpecEntries reads of a kernel spec (every spec of fp4gen.spec has it)."""

    @property
    def name(self) -> str: ...

    @property
    def digest(self) -> str: ...


SpecT = TypeVar("SpecT", bound=KernelSpec)


@dataclass(frozen=True)
class SpecEntries(TemplateContext, Generic[SpecT]):
    """The variables every template reads the same way: the spec, its repr (the module records
    it), its name and digest. A context holds it as an ``inline()`` field."""

    spec: SpecT
    spec_repr: str
    name: str  # the spec's kernel name
    digest: str  # the spec's content hash

    @classmethod
    def of(cls, spec: SpecT) -> SpecEntries[SpecT]:
        return cls(spec, repr(spec), spec.name, spec.digest)


@dataclass(frozen=True)
class InputContext:
    """A high-precision dtype (a kernel's input, the GEMM's output) under the names a generated
    module uses."""

    name: str  # the spec's word: "bf16"
    cutlass: str  # the CuTe DSL type: "BFloat16"
    torch: str  # the torch attribute: "bfloat16"


def input_context(dtype: str) -> InputContext:
    """The names of dtype ``dtype`` (a word of ``vocab.DTYPES``)."""
    d = DTYPES[dtype]
    return InputContext(d.name, d.cute, d.torch_name)


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


def render_template(name: str, context: TemplateContext | Mapping[str, Any]) -> str:
    """Template ``name`` rendered with ``context`` (a typed context or a plain mapping), tidied."""
    variables = context.as_template_vars() if isinstance(context, TemplateContext) else context
    return tidy(environment().get_template(name).render(**variables))


__all__ = [
    "TEMPLATE_DIR",
    "InputContext",
    "SpecEntries",
    "TemplateContext",
    "doc_block",
    "environment",
    "inline",
    "input_context",
    "lit",
    "pytuple",
    "render_template",
    "tidy",
]
