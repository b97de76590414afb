"""``fp4gen compile``: plan recipes, render every kernel, compile each for each arch.

Per recipe folder: one ``<kernel>.py`` per planned kernel (the generated CuTe DSL module) and
``manifest.json`` (recipe name and hash, template and toolchain versions, archs, every kernel
with its spec parameters, the operands that use it, its kernel names and compile results).
Compiled kernels go to the kernel cache (``fp4gen.compiler.cache``), so a later
``fp4gen.runtime.kernels_for`` on this machine, or on a GPU machine given the same cache folder,
loads them without compiling.

Compilation runs in worker processes (``cute.compile`` is not thread-safe; see
``fp4gen.compiler.worker``), each for one arch with ``CUTE_DSL_ARCH`` set before the DSL is
imported, so a worker never depends on the GPU it runs on (a GPU-blind worker would otherwise
default to sm_100a). A spec the template does not support yet is listed as
``unsupported: <reason>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from fp4gen.compiler import jit
from fp4gen.compiler.cache import (
    PLAIN_NAME_RULE,
    KernelCache,
    cutlass_dsl_version,
    inside,
    is_plain_name,
    path_problem,
    sha256_text,
)
from fp4gen.compiler.plan import KernelPlan, PlannedKernel, plan_recipe, spec_json, use_json
from fp4gen.compiler.spec import QuantKernelSpec
from fp4gen.dsl.model import Recipe
from fp4gen.errors import FP4GenError, RecipeError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------


@dataclass
class RenderedKernel:
    planned: PlannedKernel
    source: str | None = None  # None when unsupported
    kernels: tuple[str, ...] = ()
    unsupported: str | None = None
    error: str | None = None  # the template failed (a bug, not a NotImplementedError)
    fallback_for: str | None = None  # set on a split kernel standing in for a fused one
    fallback: list[str] = field(default_factory=list)  # on a fused kernel: its stand-ins
    cache_path: Path | None = None  # the source in the cache (what workers compile)
    compile: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.planned.spec.name

    @property
    def file(self) -> str:
        return f"{self.name}.py"


@dataclass
class RecipeBuild:
    recipe: Recipe
    plan: KernelPlan
    out: Path
    kernels: list[RenderedKernel]


def recipe_sha256(recipe: Recipe) -> str:
    """Hash of the recipe's canonical text: what it means, not how it is written."""
    from fp4gen.dsl import print_recipe

    return sha256_text(print_recipe(recipe))


def split_specs(planned: PlannedKernel) -> list[PlannedKernel]:
    """Stand-ins for a fused 1D spec: one single-output rowwise spec per output, run on the
    tensor (rowwise) or on its transpose (columnwise), as ``quantize`` does. 2D blocks have
    none: their columnwise copy is the transpose of the same tile codes."""
    spec = planned.spec
    if not isinstance(spec, QuantKernelSpec):
        return []  # MoR kernels: one module, no stand-ins
    if spec.block[0] != 1 or (len(spec.outputs) == 1 and spec.outputs[0].direction == "rowwise"):
        return []
    out = []
    for o in spec.outputs:
        single = replace(spec, outputs=(replace(o, direction="rowwise"),))
        uses = tuple(u for u in planned.uses if u.operand.use == o.direction)
        out.append(PlannedKernel(single, uses))
    return out


def _render_one(item: RenderedKernel, render: Callable[[Any], str]) -> None:
    try:
        item.source = render(item.planned.spec)
        item.kernels = jit.kernel_names(item.source)
    except NotImplementedError as err:
        item.source = None
        item.unsupported = str(err) or "not implemented by the template"
    except Exception as err:  # a template bug: reported with the kernel, the others go on
        item.source = None
        item.error = f"{type(err).__name__}: {err}"


def render_plan(
    plan: KernelPlan, render: Callable[[Any], str] | None = None, *, fallback: bool = True
) -> list[RenderedKernel]:
    """Render every kernel of ``plan``. With ``fallback``, a fused spec the template does not
    support yet is followed by its single-output stand-ins (see ``split_specs``) that render."""
    render = render or jit.render_source
    out: list[RenderedKernel] = []
    planned_specs = {k.spec for k in plan.kernels}
    stand_ins: dict[Any, RenderedKernel] = {}
    for planned in plan.kernels:
        item = RenderedKernel(planned)
        _render_one(item, render)
        out.append(item)
        if item.unsupported is None or not fallback:
            continue
        for single in split_specs(planned):
            if single.spec in planned_specs:
                continue  # the plan has this kernel already
            known = stand_ins.get(single.spec)
            if known is None:
                stand_in = RenderedKernel(single, fallback_for=item.name)
                _render_one(stand_in, render)
                if stand_in.source is None:
                    continue
                stand_ins[single.spec] = stand_in
                out.append(stand_in)
            else:  # one stand-in serves several copies (e.g. rowwise and columnwise alike)
                uses = known.planned.uses + single.uses
                known.planned = PlannedKernel(known.planned.spec, uses)
            if single.spec.name not in item.fallback:
                item.fallback.append(single.spec.name)
    return out


def manifest(
    build: RecipeBuild, archs: Sequence[str], *, timings: bool, template: str
) -> dict[str, Any]:
    recipe = build.recipe
    kernels = []
    for item in build.kernels:
        status = "ok"
        if item.unsupported is not None:
            status = f"unsupported: {item.unsupported}"
        elif item.error is not None:
            status = f"error: {item.error}"
        entry: dict[str, Any] = {
            "name": item.name,
            "status": status,
            "file": item.file if item.source is not None else None,
            "source_sha256": sha256_text(item.source) if item.source is not None else None,
            "spec": spec_json(item.planned.spec),
            "tensors": [
                {"activation": "x", "weight": "W", "gradient": "dy"}[r] for r in item.planned.roles
            ],
            "uses": [use_json(u) for u in item.planned.uses],
            "kernels": list(item.kernels),
        }
        if item.fallback:
            entry["fallback"] = list(item.fallback)
        if item.fallback_for is not None:
            entry["fallback_for"] = item.fallback_for
        if item.compile:
            entry["compile"] = {
                arch: {
                    name: (result if timings else {"status": result["status"]})
                    for name, result in per_arch.items()
                }
                for arch, per_arch in item.compile.items()
            }
        kernels.append(entry)
    return {
        "format": MANIFEST_FORMAT,
        "recipe": {
            "name": recipe.name,
            "description": recipe.description,
            "file": recipe.source.name if recipe.source is not None else None,
            "sha256": recipe_sha256(recipe),
        },
        "template_version": template,
        "nvidia_cutlass_dsl": cutlass_dsl_version(),
        "arch": list(archs),
        "input_dtypes": dict(build.plan.input_dtypes),
        "kernels": kernels,
        "skipped": build.plan.to_json()["skipped"],
    }


def recipe_folder(recipe: Recipe, parent: Path) -> Path:
    """``parent/<recipe name>``, for a name that cannot lead out of ``parent``."""
    if not is_plain_name(recipe.name):
        raise RecipeError(
            f"recipe name {recipe.name!r} is used as a folder name, so it must be "
            f"{PLAIN_NAME_RULE}; rename the recipe, or compile it alone with --out DIR",
            file=recipe.source,
        )
    return inside(parent, recipe.name)


@contextlib.contextmanager
def writing_out(folder: Path) -> Iterator[None]:
    """Turn an OSError of writing into the output folder into a one-line FP4GenError."""
    try:
        yield
    except OSError as err:
        raise FP4GenError(
            f"cannot write the output folder {folder}: {path_problem(folder, err)} "
            "(choose another --out)"
        ) from err


def _stale_files(build: RecipeBuild, keep: set[str]) -> list[Path]:
    """Kernel files the folder's previous manifest lists and this build does not make; only
    plain ``.py`` names inside the folder (the manifest is a file anyone could have edited)."""
    try:
        previous = json.loads((build.out / MANIFEST).read_text())
        files = [k.get("file") for k in previous.get("kernels", [])]
    except (OSError, ValueError, AttributeError, TypeError):
        return []
    out = []
    for f in files:
        if isinstance(f, str) and f.endswith(".py") and f not in keep and is_plain_name(f):
            path = build.out / f
            if path.is_file() and not path.is_symlink():
                out.append(path)
    return out


def write_sources(build: RecipeBuild) -> None:
    """Write the sources of a recipe folder, removing the ones an earlier run left there."""
    with writing_out(build.out):
        build.out.mkdir(parents=True, exist_ok=True)
        keep = {item.file for item in build.kernels if item.source is not None}
        for stale in _stale_files(build, keep):
            stale.unlink()
        for item in build.kernels:
            if item.source is not None:
                path = inside(build.out, item.file)
                if not path.is_file() or path.read_text() != item.source:
                    path.write_text(item.source)


def write_manifest(
    build: RecipeBuild, archs: Sequence[str], *, timings: bool, template: str
) -> Path:
    path = build.out / MANIFEST
    data = manifest(build, archs, timings=timings, template=template)
    with writing_out(build.out):
        path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    return path


# ----------------------------------------------------------------------------------------------
# Compiling in worker processes
# ----------------------------------------------------------------------------------------------


class Progress:
    """A progress bar on a terminal, one line per finished kernel otherwise."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()

    def update(self, label: str, result: dict[str, Any]) -> None:
        self.done += 1
        status = result["status"]
        if status == "ok":
            status = "cached" if result.get("cached") else f"{result['seconds']:.2f}s"
        width = len(str(self.total))
        if self.tty:
            filled = int(30 * self.done / max(self.total, 1))
            bar = "#" * filled + "-" * (30 - filled)
            elapsed = time.perf_counter() - self.start
            line = f"\r[{bar}] {self.done:>{width}}/{self.total} {elapsed:5.1f}s  {label} {status}"
            self.stream.write(line[:160].ljust(160))
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(f"[{self.done:>{width}}/{self.total}] {label}: {status}\n")
        self.stream.flush()


class _Worker:
    """One ``python -m fp4gen.compiler.worker`` process for one arch."""

    def __init__(self, arch: str, cache: KernelCache, log_dir: Path) -> None:
        import fp4gen

        env = dict(os.environ)
        env["CUTE_DSL_ARCH"] = arch
        env["FP4GEN_CACHE_DIR"] = str(cache.root)
        env.setdefault("CUTE_DSL_CACHE_DIR", str(cache.dsl_cache_dir))
        pkg_parent = str(Path(fp4gen.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([pkg_parent, *filter(None, [env.get("PYTHONPATH")])])
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in close())
            mode="w+", prefix=f"worker-{arch}-", suffix=".log", dir=log_dir, delete=False
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fp4gen.compiler.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
            bufsize=1,
        )

    def ask(self, task: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(task) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except OSError:
            line = ""
        if not line:
            self.proc.wait()
            self.log.seek(0)
            tail = self.log.read()[-2000:].strip()
            return {
                "status": f"error: the compile worker died (exit {self.proc.returncode})"
                + (f": {tail}" if tail else ""),
                "seconds": 0.0,
            }
        return json.loads(line)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


@dataclass(frozen=True)
class CompileTask:
    source: str  # the generated module's path (in the cache)
    kernel: str
    arch: str
    dump_dir: str | None = None
    label: str = ""  # shown in the progress output (the spec's name)
    key: tuple[str, dict[str, Any]] | None = None  # (cache key, parts), computed by the parent


def compile_all(
    tasks: Sequence[CompileTask],
    *,
    cache: KernelCache,
    jobs: int,
    progress: Progress | None = None,
) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Compile tasks in worker processes, one arch per worker (``jobs`` workers in all, at
    least one per arch); results by (source, kernel, arch)."""
    results: dict[tuple[str, str, str], dict[str, Any]] = {}
    if not tasks:
        return results
    archs = list(dict.fromkeys(t.arch for t in tasks))
    queues: dict[str, queue.SimpleQueue[CompileTask]] = {a: queue.SimpleQueue() for a in archs}
    for task in tasks:
        queues[task.arch].put(task)
    lock = threading.Lock()
    log_dir = cache.work_dir()

    def drive(arch: str) -> None:
        worker: _Worker | None = None
        try:
            while True:
                try:
                    task = queues[arch].get_nowait()
                except queue.Empty:
                    return
                if worker is None or not worker.alive:
                    if worker is not None:
                        worker.close()
                    worker = _Worker(arch, cache, log_dir)
                result = worker.ask(
                    {
                        "source": task.source,
                        "kernel": task.kernel,
                        "arch": arch,
                        "dump_dir": task.dump_dir,
                        "key": task.key[0] if task.key else None,
                        "parts": task.key[1] if task.key else None,
                    }
                )
                with lock:
                    results[(task.source, task.kernel, arch)] = result
                    if progress is not None:
                        label = task.label or Path(task.source).stem
                        progress.update(f"{arch} {label} {task.kernel}", result)
        finally:
            if worker is not None:
                worker.close()

    counts = {a: sum(1 for t in tasks if t.arch == a) for a in archs}
    per_arch = max(1, jobs // len(archs))
    threads = [
        threading.Thread(target=drive, args=(arch,), daemon=True)
        for arch in archs
        for _ in range(min(per_arch, counts[arch]))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------


@dataclass
class CompileReport:
    builds: list[RecipeBuild]
    unsupported: dict[str, list[str]]  # reason -> kernel names
    errors: list[str]
    seconds: float
    compiled: int
    cached: int


def compile_recipes(
    recipes: Sequence[Recipe],
    *,
    archs: Sequence[str] = jit.ARCHS,
    out: Path | None = None,
    keep_ptx: bool = False,
    jobs: int | None = None,
    compile: bool = True,
    timings: bool = True,
    cache: KernelCache | None = None,
    render: Callable[[Any], str] | None = None,
    progress_stream: TextIO | None = None,
    input_dtype: str = "bf16",
    fallback: bool = True,
) -> CompileReport:
    """Plan, render and (unless ``compile`` is False) compile ``recipes`` for ``archs``.

    out: the recipe folder for one recipe, the parent of one folder per recipe for several
    (default: generated/<recipe>/ under the current directory)."""
    if jobs is not None and jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    start = time.perf_counter()
    cache = cache or KernelCache()
    builds = []
    for recipe in recipes:
        if out is None:
            folder = recipe_folder(recipe, Path("generated"))
        else:
            folder = Path(out) if len(recipes) == 1 else recipe_folder(recipe, Path(out))
        plan = plan_recipe(recipe, input_dtype=input_dtype)  # type: ignore[arg-type]
        rendered = render_plan(plan, render, fallback=fallback)
        builds.append(RecipeBuild(recipe, plan, folder, rendered))

    unsupported: dict[str, list[str]] = {}
    errors: list[str] = []
    tasks: dict[tuple[str, str, str], CompileTask] = {}
    cache.prepare()  # an unusable cache fails here, before any output folder is written
    for build in builds:
        write_sources(build)
        for item in build.kernels:
            if item.error is not None:
                errors.append(f"{item.name}: the template failed: {item.error}")
            if item.unsupported is not None:
                names = unsupported.setdefault(item.unsupported, [])
                if item.name not in names:
                    names.append(item.name)
            if item.source is None:
                continue
            item.cache_path = cache.store_source(item.source)
            if compile:
                for arch in archs:
                    for name in item.kernels:
                        dump = None
                        if keep_ptx:
                            dump = str(inside(build.out, "ptx", arch, item.name, name))
                        where = (str(item.cache_path), name, arch)
                        if where not in tasks:
                            key = jit.kernel_key(cache, item.source, name, arch)
                            tasks[where] = CompileTask(*where, dump, item.name, key)

    # kernels already in the cache need no worker (unless PTX is wanted: that is a compile)
    results: dict[tuple[str, str, str], dict[str, Any]] = {}
    ordered = []
    for where, task in tasks.items():
        entry = None if keep_ptx or task.key is None else cache.lookup(task.key[0])
        if entry is None:
            ordered.append(task)
        else:
            seconds = round(float(entry.meta.get("compile_seconds", 0.0)), 3)
            results[where] = {"status": "ok", "seconds": seconds, "cached": True}
    jobs = jobs or min(8, os.cpu_count() or 1)
    progress = Progress(len(ordered), progress_stream) if ordered else None
    results.update(compile_all(ordered, cache=cache, jobs=jobs, progress=progress))

    compiled = cached = 0
    for (source, name, arch), result in results.items():
        if result["status"] != "ok":
            errors.append(f"{Path(source).name} {name} {arch}: {result['status']}")
        elif result.get("cached"):
            cached += 1
        else:
            compiled += 1
    for build in builds:
        for item in build.kernels:
            if item.cache_path is None or not compile:
                continue
            for arch in archs:
                for name in item.kernels:
                    r = results[(str(item.cache_path), name, arch)]
                    kept = {k: r[k] for k in ("status", "seconds", "cached") if k in r}
                    item.compile.setdefault(arch, {})[name] = kept
        write_manifest(build, archs, timings=timings, template=cache.template_version)
    return CompileReport(builds, unsupported, errors, time.perf_counter() - start, compiled, cached)


__all__ = [
    "MANIFEST",
    "CompileReport",
    "RecipeBuild",
    "compile_recipes",
    "manifest",
    "recipe_sha256",
    "render_plan",
]
