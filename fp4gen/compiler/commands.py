"""The ``fp4gen compile`` and ``fp4gen cache`` commands (registered by ``fp4gen.cli``)."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp4gen.compiler.cache import MARKER, CacheError, KernelCache
from fp4gen.errors import FP4GenError

if TYPE_CHECKING:
    from fp4gen.compiler.build import CompileReport, RecipeBuild, RenderedKernel

COMPILE_EPILOG = """\
examples:
  fp4gen compile recipes/nvfp4.fp4r
  fp4gen compile recipes/nvfp4.fp4r --arch sm_100a --out /tmp/nvfp4 --keep-ptx
  fp4gen compile recipes/*.fp4r --out generated
"""


def parse_archs(text: str) -> tuple[str, ...]:
    from fp4gen.compiler.jit import ARCHS

    archs = tuple(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    bad = [a for a in archs if a not in ARCHS]
    if not archs or bad:
        raise argparse.ArgumentTypeError(
            f"--arch takes a comma-separated list of {', '.join(ARCHS)}; got {text!r}"
        )
    return archs


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (argparse reports the error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def cache_for(cache_dir: str | None) -> KernelCache:
    """The kernel cache ``--cache-dir`` names (none: the default location); CacheError, one line,
    for a name no folder can have (a NUL byte, ``~user`` of an unknown user)."""
    if not cache_dir:  # unset or empty: the default, as before
        return KernelCache()
    if "\0" in cache_dir:
        raise CacheError(f"--cache-dir {cache_dir!r}: a folder name holds no NUL byte")
    try:
        return KernelCache(cache_dir)
    except RuntimeError:  # Path.expanduser: no home folder for this ~ or ~user
        raise CacheError(
            f"--cache-dir {cache_dir}: cannot expand its '~': no home folder for that user"
        ) from None


def _print_json(data: dict[str, Any]) -> None:
    # strict JSON: a NaN or an infinity is a bug to see, not a token other parsers reject
    print(json.dumps(data, indent=2, allow_nan=False))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _archs_text(archs: Sequence[str]) -> str:
    return ", ".join(archs)


def _where(item: RenderedKernel) -> str:
    """Who uses a kernel, in short: the operand slots or the GEMMs (the manifest has when)."""
    seen: dict[str, None] = {}
    for use in item.planned.uses:
        operand = getattr(use, "operand", None)
        seen[operand.selector if operand is not None else str(use.gemm)] = None
    return ", ".join(seen)


def print_plan(builds: list[RecipeBuild], archs: Sequence[str]) -> None:
    """What each recipe needs and what will be built (before anything is compiled)."""
    from fp4gen.compiler.aot import KIND_TEXT, KINDS, RuntimeKernel
    from fp4gen.compiler.plan import TENSOR_NAMES

    for build in builds:
        recipe = build.recipe
        source = f" ({recipe.source.name})" if recipe.source is not None else ""
        print(f"{recipe.name}{source} -> {build.out}")
        inputs = ", ".join(f"{TENSOR_NAMES[r]} {d}" for r, d in build.plan.input_dtypes)
        print(f"  inputs {inputs}; archs {_archs_text(archs)}")
        planned = [k for k in build.kernels if not isinstance(k.planned, RuntimeKernel)]
        ok = [k for k in planned if k.source is not None and k.fallback_for is None]
        stand_ins = [k for k in planned if k.fallback_for is not None]
        unsupported = [k for k in planned if k.unsupported is not None]
        parts = [f"{len(build.plan.kernels)} planned kernel(s)", f"{len(ok)} generated"]
        if unsupported:
            parts.append(f"{len(unsupported)} unsupported")
        if stand_ins:
            parts.append(f"{len(stand_ins)} single-output stand-in(s)")
        print(f"  quantize plan: {', '.join(parts)}")
        if build.runtime is not None and build.runtime.gemms:
            for line in build.runtime.gemm_text().splitlines():
                print(f"  {line}")
        made = [k for k in build.kernels if k.source is not None]
        counts = [
            f"{n} {KIND_TEXT[kind]}"
            for kind in KINDS
            if (n := sum(1 for k in made if k.kind == kind))
        ]
        compiles = sum(len(k.kernels) * len([a for a in archs if a in k.archs]) for k in made)
        lacking = sum(
            1 for k in build.kernels if k.source is None and isinstance(k.planned, RuntimeKernel)
        )
        print(
            f"  kernels: {', '.join(counts) or 'none'} ({len(made)} module(s), {compiles} "
            f"kernel compile(s) for {_archs_text(archs)})"
            + (f"; {lacking} more the template cannot make yet" if lacking else "")
        )
        width = max((len(k.name) for k in made), default=0)
        kinds = max((len(k.kind) for k in made), default=0)
        for k in made:
            where = [a for a in archs if a in k.archs]
            print(f"    {k.kind:<{kinds}} {k.name:<{width}}  {' '.join(where):<15} {_where(k)}")
        if build.runtime is not None and build.runtime.notes:
            print("  left to run time (not compiled here):")
            for note in build.runtime.notes:
                print(f"    - {note}")
    sys.stdout.flush()  # before the workers' progress on stderr


def print_results(report: CompileReport) -> None:
    """Every kernel compiled or found in the cache, with its arch and compile seconds."""
    if not report.results:
        return
    width = max(len(f"{r.module} {r.kernel}") for r in report.results)
    print("built (kernel, arch, result, compile seconds):")
    for r in report.results:
        label = f"{r.module} {r.kernel}"
        if r.status != "ok":
            result = r.status
        elif r.cached:
            result = "cached"
        else:
            result = f"compiled  {r.seconds:6.2f}s"
        print(f"  {label:<{width}}  {r.arch:<8} {result}")


def cmd_compile(args: argparse.Namespace) -> int:
    from fp4gen.compiler.build import compile_recipes
    from fp4gen.dsl import find_recipe, load_recipe

    if args.out is not None and "\0" in args.out:
        raise FP4GenError(f"--out {args.out!r}: a folder name holds no NUL byte")
    cache = cache_for(args.cache_dir) if args.cache_dir else None
    recipes = [load_recipe(find_recipe(p)) for p in args.recipes]
    names = [r.name for r in recipes]
    if len(set(names)) != len(names):
        raise FP4GenError(f"two recipes have the same name ({', '.join(names)}): one folder each")
    report = compile_recipes(
        recipes,
        archs=args.arch,
        out=Path(args.out) if args.out else None,
        keep_ptx=args.keep_ptx,
        jobs=args.jobs,
        compile=not args.no_compile,
        cache=cache,
        input_dtype=args.input_dtype,
        fallback=not args.no_fallback,
        gemm_sources=args.gemm_sources,
        announce=lambda builds: print_plan(builds, args.arch),
    )
    if report.unsupported:
        count = sum(len(v) for v in report.unsupported.values())
        print(f"not supported by the template yet ({count} kernel(s)):", file=sys.stderr)
        for reason, kernels in report.unsupported.items():
            for name in kernels:
                shown = reason if reason.startswith(name) else f"{name}: {reason}"
                print(f"  {shown}", file=sys.stderr)
    if not args.no_compile:
        print_results(report)
    for build in report.builds:
        print(f"{build.recipe.name}: wrote {build.out / 'manifest.json'}")
        replaced = build.files.replaced_text()
        if replaced is not None:  # files that were there before and now differ
            print(f"{build.recipe.name}: {replaced}")
    if not args.no_compile:  # the summary last: scripts read the final line
        failed = f", {report.failed} failed (see below)" if report.failed else ""
        print(
            f"compiled {report.compiled} kernel(s), {report.cached} from the cache{failed}, for "
            f"{_archs_text(args.arch)} in {report.seconds:.1f}s"
        )
    for err in report.errors:
        print(f"error: {err}", file=sys.stderr)
    return 1 if report.errors else 0


def _cache_info(cache: KernelCache) -> dict[str, Any]:
    """``cache.info()`` for a usable root; CacheError when a file stands where it should be."""
    problem = cache.root_problem()
    if problem is not None:
        raise CacheError(
            f"cannot read the kernel cache {cache.root}: {problem} "
            "(point FP4GEN_CACHE_DIR or --cache-dir at a folder)"
        )
    return cache.info()


def _cache_status(info: dict[str, Any]) -> str:
    if not info["exists"]:
        return "not created yet (fp4gen creates and marks it on its first write)"
    if not info["marked"]:
        return f"no {MARKER} marker: not known to be an fp4gen cache, so clear refuses it"
    return f"an fp4gen cache ({MARKER} marker present)"


def _print_cache_info(info: dict[str, Any]) -> None:
    by_arch = ", ".join(f"{a}: {n}" for a, n in info["by_arch"].items()) or "none"
    print(f"location   {info['location']}")
    print(f"status     {_cache_status(info)}")
    print(f"kernels    {info['kernels']} ({by_arch})")
    print(f"sources    {info['sources']}")
    print(f"size       {_human(info['bytes'])}")


def cmd_cache(args: argparse.Namespace) -> int:
    from fp4gen.compiler.cache import toolchain

    try:
        cache = cache_for(args.cache_dir)
    except CacheError as err:
        if args.json:  # a script still gets JSON, as for the errors below
            _print_json({"location": args.cache_dir, "error": str(err)})
        raise
    try:
        if args.action == "clear":
            existed = cache.root.is_dir()
            report = {"location": str(cache.root), "existed": existed, "freed_bytes": cache.clear()}
        else:
            report = _cache_info(cache)
    except CacheError as err:
        if args.json:  # a script still gets JSON; main() prints the one-line error and exits 1
            _print_json({"location": str(cache.root), "error": str(err)})
        raise
    if args.json:
        if args.action == "info":
            report["toolchain"] = toolchain()
        _print_json(report)
    elif args.action == "info":
        _print_cache_info(report)
    elif not report["existed"]:
        print(f"nothing to clear: {cache.root} does not exist")
    else:
        freed = report["freed_bytes"]
        print(f"cleared {cache.root} ({_human(freed)}, {freed} bytes)")
    return 0


def add_commands(sub: Any) -> None:
    """Register ``compile`` and ``cache`` on the CLI's subparsers."""
    from fp4gen.compiler.jit import ARCHS

    p = sub.add_parser(
        "compile",
        help="generate and compile every kernel a recipe's training run loads",
        description=textwrap.fill(
            "Plan every kernel a training run with each recipe can load: the quantize plan, "
            "the quantize kernels fp4gen.nn.Linear asks for, MoR, dequantize, the sm_90a fused "
            "GEMMs (small-M mma.sync and wgmma tiles) and the sm_100a block-scaled tcgen05 GEMMs "
            "of the recipe's operand pairs. Print the plan, write the generated CuTe DSL quantize "
            "and MoR modules (with --gemm-sources the dequantize and GEMM modules too) and a "
            "manifest.json listing every kernel into the output folder (no timings or "
            "machine-dependent fields: the same recipe gives the same bytes), and compile each "
            "kernel for each arch in worker processes (no GPU needed) into the kernel cache, "
            "from which fp4gen.runtime loads them: a later process on a GPU compiles nothing. "
            "Then print every kernel compiled or found in the cache, with its arch and compile "
            "seconds. Specs the template does not support yet are listed in the manifest as "
            "unsupported.",
            width=80,
        ),
        epilog=COMPILE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipes", nargs="+", metavar="RECIPE", help=".fp4r recipe files")
    p.add_argument(
        "--arch",
        type=parse_archs,
        default=ARCHS,
        metavar="ARCHS",
        help=f"comma-separated targets (default: {','.join(ARCHS)})",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="output folder (default: generated/<recipe>/); with several recipes, one "
        "subfolder per recipe",
    )
    p.add_argument("--keep-ptx", action="store_true", help="keep PTX under DIR/ptx/<arch>/")
    p.add_argument(
        "--jobs",
        "-j",
        type=positive_int,
        metavar="N",
        help="compile worker processes, at least 1 (default: CPUs, at most 8)",
    )
    p.add_argument(
        "--no-compile", action="store_true", help="only write the sources and the manifest"
    )
    p.add_argument(
        "--gemm-sources",
        action="store_true",
        help="also write the dequantize and GEMM modules into DIR (default: the manifest lists "
        "them with their source hash; the kernel cache holds them)",
    )
    p.add_argument(
        "--no-timings",
        action="store_true",
        help=argparse.SUPPRESS,  # accepted for old scripts: manifests never hold timings now
    )
    p.add_argument(
        "--no-fallback",
        action="store_true",
        help="do not add single-output stand-ins for fused kernels the template lacks",
    )
    p.add_argument(
        "--input-dtype",
        choices=("bf16", "fp16", "fp32"),
        default="bf16",
        help="dtype of the tensors the kernels read (x, W, dy) and of the GEMM outputs "
        "(default: bf16, a bf16 model)",
    )
    p.add_argument("--cache-dir", metavar="DIR", help="kernel cache (default: FP4GEN_CACHE_DIR)")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser(
        "cache",
        help="show or clear the kernel cache",
        description="The on-disk cache of generated sources and compiled kernels: "
        "$FP4GEN_CACHE_DIR, else $XDG_CACHE_HOME/fp4gen, else ~/.cache/fp4gen. fp4gen marks "
        f"a cache folder with a {MARKER} file on its first write; clear refuses a folder "
        "without it and removes only the entries fp4gen wrote (other files stay).",
    )
    p.add_argument("action", choices=("info", "clear"), help="info: location, entries, size")
    p.add_argument("--json", action="store_true", help="print JSON (also on an error)")
    p.add_argument("--cache-dir", metavar="DIR", help="the cache folder to use")
    p.set_defaults(func=cmd_cache)


__all__ = ["add_commands", "cmd_cache", "cmd_compile"]
