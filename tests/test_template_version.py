"""The template version (part of every kernel-cache key) changes with every file generated
modules are made of or import."""

from __future__ import annotations

import shutil
from pathlib import Path

import fp4gen
from fp4gen.compiler import cache as cache_mod


def test_the_template_version_covers_the_kernel_classes(tmp_path: Path, monkeypatch) -> None:
    """Generated modules import the kernel classes of fp4gen/kernels: a change there is a new
    template version (a cached kernel built from the old class is never loaded)."""
    pkg = Path(fp4gen.__file__).resolve().parent
    copy = tmp_path / "fp4gen"
    for folder in cache_mod._TEMPLATE_DIRS:
        shutil.copytree(pkg / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "__init__.py").write_text("")
    monkeypatch.setattr(fp4gen, "__file__", str(copy / "__init__.py"))
    cache_mod.template_version.cache_clear()
    try:
        before = cache_mod.template_version()
        kernel = copy / "kernels" / "dequant.py"
        kernel.write_text(kernel.read_text() + "\n# a change\n")
        cache_mod.template_version.cache_clear()
        assert cache_mod.template_version() != before
    finally:
        cache_mod.template_version.cache_clear()
