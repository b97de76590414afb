"""PTX identity of the quantize, MoR and sm_90a GEMM kernels: dump, then compare two dumps byte
for byte.

A change that moves kernel code (a template into a kernel class, a helper into a module of its
own) should leave the compiled kernels exactly as they were. This tool renders a fixed set of
specs, cross-compiles every kernel of each for sm_90a and sm_100a (no GPU needed) and writes
its PTX into a folder, one file per (spec, kernel, arch); a second dump after the change,
compared with the first, proves the PTX unchanged or lists what differs.

The specs: every quantize and MoR kernel the shipped recipes load (``fp4gen compile``'s plan:
the quantize plan with its stand-ins and the kernels the runtime asks for), the configurations
the codegen tests render (``tests/test_codegen_quantize.py``, ``tests/test_codegen_mor.py``, the
cross-compiled ``tests/test_codegen_gemm.py`` GEMMs: families ``gemm_small`` and ``gemm``, sm_90a
only), MoR rules for the entry variants none of those has (``mor_variant_specs``) and the kernels
of a seeded batch of fuzzed recipes (``tests/test_recipe_fuzz_gpu.batch``).

The PTX is kept as the compiler wrote it except for the generated module's name, which the DSL
puts into every kernel symbol: it is a hash of the module's text, so it changes with any edit of
the text around the kernel; it is replaced by ``MODULE``. Comment lines are kept.

The spec set is stored with the dump (``specs.pickle``); ``--specs-from BEFORE`` dumps exactly
the specs of an earlier dump, so that recipes or tests added in between do not change the set.

    python -m tests.ptx_identity dump DIR [--fuzz-seed S] [--fuzz-count N] [--only FAMILY]
    python -m tests.ptx_identity dump AFTER --specs-from BEFORE
    python -m tests.ptx_identity compare BEFORE AFTER
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

# every compile runs: the DSL's own cache must not answer for a changed module
os.environ.setdefault("CUTE_DSL_NO_CACHE", "1")

ARCHS: tuple[str, ...] = ("sm_90a", "sm_100a")
FUZZ_SEED = 20251  # tests/test_recipe_fuzz_gpu.DEFAULT_SEED
FUZZ_COUNT = 30
SPECS_FILE = "specs.pickle"
FAMILIES: tuple[str, ...] = ("rowwise", "tile", "mor", "gemm_small", "gemm")


def shipped_specs() -> dict[str, object]:
    """Every quantize and MoR spec ``fp4gen compile`` renders for the shipped recipes."""
    import fp4gen
    from fp4gen.dsl.parser import load_recipe

    recipes = [
        load_recipe(p) for p in sorted((Path(fp4gen.__file__).parent / "recipes").glob("*.fp4r"))
    ]
    return planned_specs(recipes)


def planned_specs(recipes: Iterable[object]) -> dict[str, object]:
    """The quantize and MoR specs that ``fp4gen compile`` renders for ``recipes``."""
    from fp4gen.compiler.build import prepare_builds

    specs: dict[str, object] = {}
    for recipe in recipes:
        with tempfile.TemporaryDirectory() as folder:
            (build,) = prepare_builds([recipe], out=Path(folder))
        for item in build.kernels:
            if item.kind in ("quantize", "mor") and item.source is not None:
                specs.setdefault(item.name, item.planned.spec)
    return specs


def codegen_test_specs() -> dict[str, object]:
    """The configurations the quantize and MoR codegen tests render."""
    tests = str(Path(__file__).parent)
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import test_codegen_gemm
    import test_codegen_mor
    import test_codegen_quantize

    specs: dict[str, object] = {}
    for table in (
        test_codegen_quantize.ALL_SPECS,
        test_codegen_quantize.TILE_SPECS,
        test_codegen_mor.SPECS,
        mor_variant_specs(),
        test_codegen_gemm.COMPILED,
    ):
        for spec in table.values():
            specs.setdefault(spec.name, spec)  # type: ignore[attr-defined]
    return specs


def mor_variant_specs() -> dict[str, object]:
    """MoR rules whose kernels take arguments no shipped or codegen-test rule has: codes only
    (no high-precision candidate; decided in the quantizing pass, and per channel) and the range
    metric with decisions over several tiles (the measure and decide kernels' max / min)."""
    from fp4gen.dsl.model import Candidate, HighPrecision, Metric, MoRSpec, Partition
    from fp4gen.formats import ElementFormat
    from fp4gen.spec import MoRKernelSpec

    e2m1, e4m3 = ElementFormat(2, 1, special="finite"), ElementFormat(4, 3, special="fn")
    relerr = Metric("relerr", threshold=0.05)
    block, channel = Partition("block", (128, 128)), Partition("channel")
    rules = (
        MoRSpec("cf", block, block, "gam", (Candidate(e2m1, relerr), Candidate(e4m3))),
        MoRSpec(
            "cs", channel, channel, "e8m0", (Candidate(e2m1, Metric("range")), Candidate(e4m3))
        ),
        MoRSpec(
            "sr",
            Partition("block", (256, 256)),
            Partition("tensor"),
            "amax",
            (
                Candidate(e2m1, Metric("range")),
                Candidate(e4m3, relerr),
                Candidate(HighPrecision("bf16")),
            ),
        ),
    )
    return {(spec := MoRKernelSpec(r)).name: spec for r in rules}


def fuzz_specs(seed: int, count: int) -> dict[str, object]:
    """The quantize and MoR specs of ``count`` recipes drawn from ``seed``."""
    import dataclasses

    tests = str(Path(__file__).parent)
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from test_recipe_fuzz_gpu import batch, load_case

    recipes = []
    with tempfile.TemporaryDirectory() as root:
        for i, case in enumerate(batch(seed, count)):
            recipe = load_case(case, Path(root) / f"case{i}")
            if recipe is not None:
                recipes.append(dataclasses.replace(recipe, name=f"r{i}"))
        return planned_specs(recipes)


def all_specs(seed: int, count: int) -> dict[str, object]:
    specs = shipped_specs()
    for name, spec in codegen_test_specs().items():
        specs.setdefault(name, spec)
    for name, spec in fuzz_specs(seed, count).items():
        specs.setdefault(name, spec)
    return specs


def family(spec: object) -> str:
    """The template family that renders ``spec``: "rowwise", "tile", "mor", "gemm_small" or
    "gemm"."""
    from fp4gen.codegen.gemm import SmallMTile
    from fp4gen.codegen.quantize import is_rowwise
    from fp4gen.spec import GemmKernelSpec, MoRKernelSpec

    if isinstance(spec, MoRKernelSpec):
        return "mor"
    if isinstance(spec, GemmKernelSpec):
        return "gemm_small" if isinstance(spec.tile, SmallMTile) else "gemm"
    return "rowwise" if is_rowwise(spec) else "tile"  # type: ignore[arg-type]


def dump(out: Path, specs: dict[str, object], families: set[str]) -> int:
    """Write the PTX of every kernel of ``specs`` (of ``families``) for each arch into ``out``;
    returns the number of PTX files written."""
    from fp4gen.codegen import import_source
    from fp4gen.compiler.jit import render_source

    out.mkdir(parents=True, exist_ok=True)
    written = 0
    with tempfile.TemporaryDirectory() as work:
        for name in sorted(specs):
            spec = specs[name]
            fam = family(spec)
            if fam not in families:
                continue
            module = import_source(render_source(spec), Path(work) / "src")
            for kernel in module.KERNELS:
                for arch in (a for a in ARCHS if a in module.ARCHS):
                    keep = Path(work) / "ptx" / f"{name}.{kernel}.{arch}"
                    module.compile_kernel(kernel, arch, dump_dir=str(keep))
                    (ptx,) = keep.glob(f"*.{arch}.ptx")
                    text = ptx.read_text().replace(module.__name__, "MODULE")
                    (out / f"{fam}.{name}.{kernel}.{arch}.ptx").write_text(text)
                    written += 1
            print(f"{fam:8} {name}: {len(module.KERNELS)} kernel(s)", flush=True)
    return written


def compare(before: Path, after: Path, families: set[str] | None = None) -> tuple[int, list[str]]:
    """(files compared, what differs) between two dumps, over ``families`` (default: all)."""

    def names(folder: Path) -> set[str]:
        found = {p.name for p in folder.glob("*.ptx")}
        return {n for n in found if families is None or n.split(".")[0] in families}

    names_before, names_after = names(before), names(after)
    problems = [f"only in {before}: {n}" for n in sorted(names_before - names_after)]
    problems += [f"only in {after}: {n}" for n in sorted(names_after - names_before)]
    common = sorted(names_before & names_after)
    for n in common:
        if (before / n).read_bytes() != (after / n).read_bytes():
            problems.append(f"differs: {n}")
    return len(common), problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.ptx_identity")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="write the PTX of every kernel into DIR")
    d.add_argument("dir", type=Path)
    d.add_argument("--fuzz-seed", type=int, default=FUZZ_SEED)
    d.add_argument("--fuzz-count", type=int, default=FUZZ_COUNT)
    d.add_argument("--only", action="append", choices=FAMILIES)
    d.add_argument("--specs-from", type=Path, help="the spec set of an earlier dump")
    c = sub.add_parser("compare", help="compare two dumps byte for byte")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--only", action="append", choices=FAMILIES)
    args = parser.parse_args(argv)
    if args.command == "dump":
        if args.specs_from is not None:
            specs = pickle.loads((args.specs_from / SPECS_FILE).read_bytes())
        else:
            specs = all_specs(args.fuzz_seed, args.fuzz_count)
        args.dir.mkdir(parents=True, exist_ok=True)
        (args.dir / SPECS_FILE).write_bytes(pickle.dumps(specs))
        families = set(args.only or FAMILIES)
        written = dump(args.dir, specs, families)
        print(f"{written} PTX files in {args.dir}")
        return 0
    count, problems = compare(args.before, args.after, set(args.only) if args.only else None)
    for line in problems:
        print(line)
    print(f"{count} PTX files compared, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
