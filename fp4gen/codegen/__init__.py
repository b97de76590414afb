"""Code generation: QuantKernelSpec -> a self-contained CuTe DSL Python module (Jinja2 templates).

``fp4gen.codegen.quantize.render(spec)`` returns the source text; ``import_source`` writes it to a
file and imports it (CuTe DSL reads kernel source back from files, so generated modules must live
in one).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_source(source: str, directory: str | Path, name: str | None = None) -> ModuleType:
    """Write ``source`` to ``directory/<name>.py`` and import it as a fresh module.

    ``name`` defaults to a content hash, so equal sources share one file. The module is registered
    in ``sys.modules`` under that name (the DSL looks kernels up through their module).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if name is None:
        name = "fp4gen_gen_" + hashlib.sha256(source.encode()).hexdigest()[:16]
    path = directory / f"{name}.py"
    if not path.is_file() or path.read_text() != source:
        path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


__all__ = ["import_source"]
