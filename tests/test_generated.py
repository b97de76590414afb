"""generated/ holds what ``fp4gen compile`` emits for the shipped recipes; it must be current.

Regenerate with:  fp4gen compile fp4gen/recipes/*.fp4r --out generated --no-timings
(the sources and manifests are compared; compile results and toolchain versions are not, so the
check needs no compiler and does not depend on timings).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fp4gen.compiler.build import compile_recipes
from fp4gen.compiler.cache import KernelCache
from fp4gen.dsl import load_recipe

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "fp4gen" / "recipes"
GENERATED = ROOT / "generated"
SHIPPED = sorted(RECIPES.glob("*.fp4r"))
REGENERATE = "fp4gen compile fp4gen/recipes/*.fp4r --out generated --no-timings"

# depend on the machine and toolchain, not on what was generated
VOLATILE_TOP = ("nvidia_cutlass_dsl", "template_version")
VOLATILE_KERNEL = ("compile",)


def normalized(manifest: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in manifest.items() if k not in VOLATILE_TOP}
    out["kernels"] = [
        {k: v for k, v in kernel.items() if k not in VOLATILE_KERNEL}
        for kernel in manifest["kernels"]
    ]
    return out


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("generated")
    recipes = [load_recipe(p) for p in SHIPPED]
    compile_recipes(recipes, out=out, compile=False, cache=KernelCache(out / ".cache"))
    return out


def test_one_folder_per_shipped_recipe() -> None:
    names = {load_recipe(p).name for p in SHIPPED}
    folders = {p.name for p in GENERATED.iterdir() if p.is_dir()}
    assert folders == names, f"generated/ is stale: run {REGENERATE}"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_generated_sources_and_manifest_are_current(path: Path, rendered: Path) -> None:
    name = load_recipe(path).name
    fresh, checked_in = rendered / name, GENERATED / name
    hint = f"generated/{name} is stale: run {REGENERATE}"
    fresh_files = sorted(p.name for p in fresh.iterdir())
    assert sorted(p.name for p in checked_in.iterdir()) == fresh_files, hint
    for file in fresh_files:
        if file == "manifest.json":
            continue
        assert (checked_in / file).read_text() == (fresh / file).read_text(), f"{file}: {hint}"
    want = normalized(json.loads((fresh / "manifest.json").read_text()))
    have = normalized(json.loads((checked_in / "manifest.json").read_text()))
    assert have == want, hint


def test_checked_in_output_has_no_timings_or_binaries() -> None:
    for manifest in GENERATED.glob("*/manifest.json"):
        assert '"seconds"' not in manifest.read_text(), f"{manifest}: use --no-timings"
    binaries = [p for p in GENERATED.rglob("*") if p.suffix in (".ptx", ".cubin", ".so", ".o")]
    assert binaries == []


def test_manifests_name_the_current_template_version() -> None:
    """The template version hashes the template, codegen and kernel files in the repository, so
    a change to them without a regenerate leaves the manifests naming the old one (and the
    README's ``fp4gen compile`` rewrites a checked-in file)."""
    from fp4gen.compiler.cache import template_version

    current = template_version()
    stale = [
        manifest.parent.name
        for manifest in sorted(GENERATED.glob("*/manifest.json"))
        if json.loads(manifest.read_text())["template_version"] != current
    ]
    assert stale == [], f"generated/ {stale} name another template version: run {REGENERATE}"
