"""The package's layers only point down (docs/architecture.md), checked from the source.

Every module of fp4gen/ belongs to one layer; a module may import (at module level or inside a
function) from its own layer or a lower one, never a higher one, and the import graph has no
cycles. Imports under ``if TYPE_CHECKING:`` are annotations only and do not count. An upward
import that has to stay while its file is being changed is listed in ``PENDING`` with the
reason (none is, now); any other upward import fails.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fp4gen"

# lowest first
LAYERS: tuple[str, ...] = (
    "core",  # errors, formats, settings, vocab, kernel specs, the recipe model
    "dsl",  # recipe text <-> model: parse, resolve, validate, print, canonical spellings
    "numerics",  # the pure-torch oracle
    "kernels",  # code generation (templates are rendered by fp4gen.codegen)
    "compiler",  # plan, build, cache, jit, ahead-of-time manifests
    "backends",  # loaded kernels and the choice between them and the oracle
    "nn",  # Linear, ops, whole-model conversion, schedules
    "app",  # command line, reports, demo, experiments, export, presentation
)

# module (or package prefix) -> layer; the longest matching prefix decides
LAYER_OF: dict[str, str] = {
    "fp4gen": "core",  # the package facade (this name only): it loads the rest lazily, by name
    "fp4gen.errors": "core",
    "fp4gen.formats": "core",
    "fp4gen.settings": "core",
    "fp4gen.outputs": "core",  # writing user-visible files: whole, never through a link
    "fp4gen.device_offset": "core",  # a value type generated modules and the runtime share
    "fp4gen.vocab": "core",
    "fp4gen.spec": "core",
    "fp4gen.dsl.model": "core",  # the recipe model: what the dsl produces and the numerics read
    "fp4gen.dsl": "dsl",
    "fp4gen.numerics": "numerics",
    # torch-only: device buffers kept outside CUDA-graph pools (the oracle's tables too)
    "fp4gen.runtime.device_memory": "numerics",
    "fp4gen.codegen": "kernels",
    "fp4gen.kernels": "kernels",  # the CuTe DSL kernel classes generated modules bind
    # the host code generated modules bind: compiling against fake tensors, the input checks,
    # the outputs and launches (one module per family; what they share is kernels.host)
    "fp4gen.kernels.host": "kernels",
    "fp4gen.kernels.quantize_host": "kernels",
    "fp4gen.kernels.mor_host": "kernels",
    "fp4gen.kernels.gemm_sm90_host": "kernels",
    "fp4gen.compiler": "compiler",
    "fp4gen.compiler.commands": "app",  # the ``fp4gen compile`` / ``cache`` commands
    "fp4gen.runtime": "backends",
    "fp4gen.gemm_dispatch": "backends",
    "fp4gen.runtime.linear": "nn",
    # Linear's jobs, one module each (mixins of Linear): its operand tables, slots and Philox
    # offsets, amax group, operand quantization, shared copies of x, graph keys, telemetry
    "fp4gen.runtime.layer_tables": "nn",
    "fp4gen.runtime.operand_slots": "nn",
    "fp4gen.runtime.layer_amax": "nn",
    "fp4gen.runtime.layer_quantize": "nn",
    "fp4gen.runtime.shared_copy": "nn",
    "fp4gen.runtime.layer_graph_keys": "nn",
    "fp4gen.runtime.telemetry": "nn",
    "fp4gen.runtime.ops": "nn",
    "fp4gen.runtime.compile_sharing": "nn",  # the inductor pass that merges the ops on one x
    "fp4gen.runtime.layer_groups": "nn",  # sibling Linears run as one (uses Linear by duck type)
    "fp4gen.runtime.convert": "nn",
    "fp4gen.runtime.experts": "nn",  # GroupedExperts: MoE experts run through Linear's op
    "fp4gen.runtime.grouped": "nn",  # grouped expert GEMMs (quantize through each Linear)
    "fp4gen.runtime.grouped_scope": "nn",  # experts' per-tensor global scale (Linear's quantize)
    "fp4gen.runtime.grouped_quantize": "nn",  # the experts' grouped quantize (scope: grouped_scope)
    "fp4gen.runtime.grouped_tile": "nn",  # the grouped tile quantize (scope: grouped_scope)
    "fp4gen.runtime.static_experts": "nn",  # the experts' projection from device sizes (grouped)
    "fp4gen.runtime.schedule": "nn",
    "fp4gen.runtime.fsdp": "nn",  # FSDP2's quantized weight all-gather (wraps Linear)
    "fp4gen.nn": "nn",
    "fp4gen.__main__": "app",
    "fp4gen.cli": "app",
    "fp4gen.table": "app",
    "fp4gen.describe": "app",
    "fp4gen.report": "app",
    "fp4gen.demo": "app",
    "fp4gen.experiments": "app",
    "fp4gen.export": "app",
    "fp4gen.export_cli": "app",
    "fp4gen.integrations": "app",  # callbacks for other training frameworks (HF Trainer)
}

# Upward imports (importer, imported) waiting on files other work is changing, each with the
# reason. Keep it short: an entry goes as soon as its import does (test_pending_entries_still_exist
# says when). Empty: every import points down.
PENDING: dict[tuple[str, str], str] = {}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    out: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer_of(module: str) -> str:
    """The layer of a module: its longest prefix in LAYER_OF (``fp4gen`` matches only the
    package itself, so a new top-level module has to be given a layer)."""
    name = module
    while name not in LAYER_OF or (name == "fp4gen" and module != "fp4gen"):
        name, _, _ = name.rpartition(".")
        if not name:
            raise KeyError(module)
    return LAYER_OF[name]


def _is_type_checking(test: ast.expr) -> bool:
    return any(
        (isinstance(n, ast.Name) and n.id == "TYPE_CHECKING")
        or (isinstance(n, ast.Attribute) and n.attr == "TYPE_CHECKING")
        for n in ast.walk(test)
    )


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Every dotted name an import statement may load (the module and, for ``from X import
    y``, ``X.y`` in case y is a submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [source, *(f"{source}.{alias.name}" for alias in node.names)]


def import_edges() -> dict[tuple[str, str], list[tuple[int, bool]]]:
    """(importer, imported fp4gen module) -> [(line, inside a function)], TYPE_CHECKING blocks
    left out. A name resolves to the longest module prefix that exists."""
    files = module_files()

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[tuple[str, str], list[tuple[int, bool]]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, in_function: bool, module: str = module, pkg: bool = is_package):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child.test):
                    for sub in child.orelse:
                        visit(sub, in_function)
                    continue
                if isinstance(child, ast.Import | ast.ImportFrom):
                    found = {
                        r
                        for t in _targets(child, module, pkg)
                        if t.split(".")[0] == "fp4gen" and (r := resolve(t)) and r != module
                    }
                    for r in found:
                        if any(o != r and o.startswith(r + ".") for o in found):
                            continue  # ``from fp4gen.x import y`` with y a module: count y only
                        edges.setdefault((module, r), []).append((child.lineno, in_function))
                inner = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                visit(child, in_function or inner)

        visit(ast.parse(path.read_text(), filename=str(path)), False)
    return edges


def upward_imports() -> list[tuple[str, str, int, bool]]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    out = []
    for (src, dst), sites in import_edges().items():
        if rank[layer_of(dst)] > rank[layer_of(src)]:
            out.extend((src, dst, line, inner) for line, inner in sites)
    return sorted(out)


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_has_a_layer() -> None:
    unknown = []
    for module in module_files():
        try:
            layer_of(module)
        except KeyError:
            unknown.append(module)
    assert not unknown, f"give these modules a layer in LAYER_OF: {unknown}"


def test_imports_point_down() -> None:
    new = [
        f"{src} (line {line}{', in a function' if inner else ''}, {layer_of(src)}) imports "
        f"{dst} ({layer_of(dst)})"
        for src, dst, line, inner in upward_imports()
        if (src, dst) not in PENDING
    ]
    assert not new, "imports from a higher layer:\n" + "\n".join(new)


def test_pending_entries_still_exist() -> None:
    present = {(src, dst) for src, dst, _, _ in upward_imports()}
    gone = sorted(set(PENDING) - present)
    assert not gone, f"these imports are gone: remove them from PENDING: {gone}"


def test_no_import_cycles() -> None:
    edges = set(import_edges()) - set(PENDING)
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_cycle_finder_finds_cycles() -> None:
    edges = {("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"), ("e", "d")}
    assert sorted(cycles(edges)) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({("a", "b"), ("b", "c")}) == []


# The quantize and MoR kernel classes and their device helpers (fp4gen.kernels) are what a
# generated quantize or MoR module imports when it is compiled: they read the words of
# fp4gen.vocab and each other, never the code generators, the templates, the compiler or the
# runtime.
QUANTIZE_KERNEL_MODULES = tuple(
    f"fp4gen.kernels.{name}"
    for name in (
        "quantize",
        "quantize_tile",
        "tile",
        "mor",
        "encode",
        "scale",
        "philox",
        "quant_ptx",
        "sm90_ptx",
        "hadamard",
    )
)
KERNEL_CLASS_IMPORTS = ("fp4gen.vocab", "fp4gen.kernels")


def test_kernel_classes_import_only_the_words_and_each_other() -> None:
    edges = import_edges()
    kernel_modules = set(QUANTIZE_KERNEL_MODULES)
    assert kernel_modules <= set(module_files())
    wrong = sorted(
        f"{src} imports {dst}"
        for src, dst in edges
        if src in kernel_modules
        and not any(dst == a or dst.startswith(a + ".") for a in KERNEL_CLASS_IMPORTS)
    )
    assert not wrong, "\n".join(wrong)
    # and the helpers are used: every quantize and MoR helper module is imported by a kernel
    # module or a template
    templates = "\n".join(p.read_text() for p in (PACKAGE / "templates").glob("*.j2"))
    helpers = ("encode", "scale", "philox", "quant_ptx", "hadamard", "tile", "mor", "quantize")
    for helper in (*helpers, "quantize_tile"):
        name = f"fp4gen.kernels.{helper}"
        used = any(dst == name for _, dst in edges) or f" {helper}" in templates
        assert used, f"{name} is imported by nothing"


# The host side of the generated modules (kernels.*_host, over kernels.host): bound by the
# templates, so each is in use while a template names it.
HOST_MODULES = ("host", "quantize_host", "quantize_tile_host", "mor_host", "gemm_sm90_host")


def test_host_modules_are_bound_by_the_templates() -> None:
    templates = "\n".join(p.read_text() for p in (PACKAGE / "templates").glob("*.j2"))
    edges = import_edges()
    for name in HOST_MODULES:
        module = f"fp4gen.kernels.{name}"
        assert module in module_files(), f"{module} is missing"
        assert layer_of(module) == "kernels"
        imported = any(dst == module for _, dst in edges)
        named = re.search(rf"[ .]{name}\b", templates) is not None
        assert imported or named, f"{module} is bound by no template"


@pytest.mark.parametrize(
    ("module", "banned"),
    [
        ("fp4gen.numerics", ("lark", "cutlass", "jinja2", "fp4gen.dsl.parser", "fp4gen.runtime")),
        ("fp4gen.dsl.model", ("lark", "torch", "fp4gen.dsl.parser")),
        ("fp4gen.spec", ("lark", "torch", "cutlass")),
        # read by the compiler and the GEMM dispatch at import
        ("fp4gen.codegen.gemm_configs", ("torch", "jinja2", "cutlass", "fp4gen.runtime")),
        # the quantize and MoR kernel classes: no templating, compiler or runtime when compiled
        (
            "fp4gen.kernels.quantize",
            ("jinja2", "fp4gen.codegen", "fp4gen.compiler", "fp4gen.runtime"),
        ),
        ("fp4gen.kernels.tile", ("jinja2", "fp4gen.codegen", "fp4gen.compiler", "fp4gen.runtime")),
        (
            "fp4gen.kernels.quantize_tile",
            ("jinja2", "fp4gen.codegen", "fp4gen.compiler", "fp4gen.runtime"),
        ),
        ("fp4gen.kernels.mor", ("jinja2", "fp4gen.codegen", "fp4gen.compiler", "fp4gen.runtime")),
        # the host code of the generated modules: no templating, compiler or runtime either
        *(
            (
                f"fp4gen.kernels.{name}",
                ("jinja2", "fp4gen.codegen", "fp4gen.compiler", "fp4gen.runtime"),
            )
            for name in HOST_MODULES
        ),
    ],
)
def test_lower_layers_load_nothing_above(module: str, banned: tuple[str, ...]) -> None:
    code = (
        f"import sys, {module}\n"
        f"bad = sorted(m for m in sys.modules if any(m == b or m.startswith(b + '.') "
        f"for b in {banned!r}))\n"
        "print(' '.join(bad))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip() == "", f"import {module} loads: {proc.stdout.strip()}"
