"""benchmarks/gemm_ablation.py: every variant patches the generated large-M GEMM module where it
means to and cross-compiles for sm_90a (no GPU needed), so the ablation figures in
docs/gemm-sm90.md stay reproducible as the template changes."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ablation():
    spec = importlib.util.spec_from_file_location(
        "gemm_ablation", ROOT / "benchmarks" / "gemm_ablation.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["gemm_ablation"] = module
    spec.loader.exec_module(module)
    return module


ablation = _ablation()


@pytest.mark.parametrize("tile", ["large", "r16", "r64"])
def test_every_variant_changes_the_module_except_full(tile):
    full = ablation.variant_source("full", tile)
    for name in ablation.variants_of(tile):
        src = ablation.variant_source(name, tile)
        assert (src == full) == (name == "full"), name


def test_a_patch_that_no_longer_matches_stops_the_benchmark():
    with pytest.raises(RuntimeError, match="expected one occurrence"):
        ablation.drop_fence("no fence here\n" + ablation.FENCE + "\n" + ablation.FENCE + "\n")
    with pytest.raises(RuntimeError, match="is not in the generated module"):
        ablation.drop_decode("a module without the decode\n")


def test_unknown_variant_or_tile_names_the_known_ones():
    with pytest.raises(SystemExit, match="variants: full, no-fence"):
        ablation.variant_source("no-such-variant")
    with pytest.raises(SystemExit, match="variants: full, no-decode, fewer-decode-ops"):
        ablation.variant_source("half-b", "r16")
    with pytest.raises(SystemExit, match="tiles: r16, r32, r64"):
        ablation.variant_source("full", "r8")


@pytest.mark.parametrize("name", list(ablation.VARIANTS))
def test_variant_cross_compiles_for_sm90a(name, tmp_path):
    module = ablation.load_variant(name, tmp_path)
    module.compile_kernel("gemm", "sm_90a", dump_dir=str(tmp_path / "ptx"))
    ptx = "\n".join(p.read_text() for p in (tmp_path / "ptx").glob("*.ptx"))
    # the MMA is untouched in every variant: 4 m64n256k16 wgmma per k-tile (one per k16 step)
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16", ptx)) == 4
    fences = len(re.findall(r"fence\.proxy\.async\.shared::cta", ptx))
    assert (fences == 0) == name.endswith("no-fence"), (name, fences)
    stores = len(re.findall(r"st\.shared\.v4\.b32", ptx))
    if name.startswith("no-decode"):
        assert stores == 0
    elif name == "decode-no-store":
        assert stores == 2  # the fold's store (never taken) at both transform_ktile call sites
    else:
        # per thread 3 decode units (unit 0: A rows, 1: B rows 0-127, 2: B rows 128-255), 4
        # stores each, at both transform_ktile call sites (prologue and loop); units whose rows
        # a variant never decodes are compiled out
        units = {"a-only": 1, "half-b": 2, "quarter-b": 2}.get(name, 3)
        assert stores == 2 * 4 * units, (name, stores)


@pytest.mark.parametrize("name", list(ablation.SMALL_VARIANTS))
def test_small_m_variant_cross_compiles_for_sm90a(name, tmp_path):
    module = ablation.load_variant(name, tmp_path, "r16")
    module.compile_kernel("gemm", "sm_90a", dump_dir=str(tmp_path / "ptx"))
    ptx = "\n".join(p.read_text() for p in (tmp_path / "ptx").glob("*.ptx"))
    # r16: one m16 atom x 8 n8 atoms x 4 k16 steps per k-tile, untouched by every variant
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", ptx)) == 32
    hmul = len(re.findall(r"mul\.rn\.bf16x2", ptx))
    assert (hmul == 0) == (name == "no-decode"), (name, hmul)
