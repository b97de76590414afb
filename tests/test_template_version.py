"""The template version (part of every kernel-cache key) changes with every file generated
modules are made of or import."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import fp4gen
from fp4gen.compiler import cache as cache_mod

# the kernel classes and device helpers generated modules import: dequantize, the quantize,
# tile and MoR kernels, and the helpers they share
KERNEL_FILES = (
    "dequant.py",
    "quantize.py",
    "quantize_tile.py",
    "quantize_tile_host.py",
    "tile.py",
    "mor.py",
    "encode.py",
    "scale.py",
    "philox.py",
    "quant_ptx.py",
)


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_the_template_version_covers_the_kernel_classes(
    name: str, tmp_path: Path, monkeypatch
) -> None:
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
        kernel = copy / "kernels" / name
        kernel.write_text(kernel.read_text() + "\n# a change\n")
        cache_mod.template_version.cache_clear()
        assert cache_mod.template_version() != before
    finally:
        cache_mod.template_version.cache_clear()
