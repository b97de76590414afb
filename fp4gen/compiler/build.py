"""``fp4gen compile``: plan recipes, render every kernel, compile each for each arch.

Per recipe folder: one ``<kernel>.py`` per quantize and MoR kernel (the generated CuTe DSL
module; the dequantize and GEMM modules too with ``gemm_sources``) and ``manifest.json``, which
lists every kernel. The kernels are the recipe's quantize plan (``fp4gen.compiler.plan``) and
every kernel the runtime can load besides (``fp4gen.compiler.aot``: the quantize kernels
``fp4gen.nn.Linear`` asks for, MoR, dequantize, the sm_90a fused and block-scaled FP8 GEMMs
and the sm_100a block-scaled GEMMs). The manifest holds the recipe name and hash, template and
toolchain versions, archs, the GEMM routes, what is left to run time, and every kernel with its
spec parameters, the operands or GEMMs that use it, its kernel names and the archs it is built
for: nothing that depends on the machine, the cache or the clock, so rendering a recipe twice gives
the same bytes (compile results and timings are printed, see ``CompileReport.results``).
Compiled kernels go to the kernel cache (``fp4gen.compiler.cache``), so a later
``fp4gen.runtime.kernels_for`` on this machine, or on a GPU machine given the same cache folder,
loads them without compiling.

Compilation runs in worker processes (``cute.compile`` is not thread-safe; see
``fp4gen.compiler.worker``), each for one arch with ``CUTE_DSL_ARCH`` set before the DSL is
imported, so a worker never depends on the GPU it runs on (a GPU-blind worker would otherwise
default to sm_100a). A spec the template does not support yet is listed as
``unsupported: <reason>``. A kernel that fails is reported in one line and counted
(``CompileReport.failed``); one whose cache files vanished under the compile (``fp4gen cache
clear`` meanwhile) has its source stored again and is compiled once more.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from fp4gen.compiler import jit
from fp4gen.compiler.aot import RuntimeKernel, RuntimePlan, kernel_spec_json, runtime_plan
from fp4gen.compiler.cache import (
    CLEARED_MEANWHILE,
    PLAIN_NAME_RULE,
    KernelCache,
    cutlass_dsl_version,
    inside,
    is_plain_name,
    path_problem,
    sha256_text,
)
from fp4gen.compiler.plan import KernelPlan, PlannedKernel, plan_recipe, use_json
from fp4gen.compiler.worker import REASON_CHARS, failure_text
from fp4gen.dsl.model import Recipe
from fp4gen.errors import FP4GenError, RecipeError
from fp4gen.outputs import OutputFiles
from fp4gen.spec import MoRKernelSpec, QuantKernelSpec

MANIFEST = "manifest.json"
# 2: every kernel the runtime loads (kind, archs), GEMM routes, no compile results or timings
MANIFEST_FORMAT = 2


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------


@dataclass
class RenderedKernel:
    planned: PlannedKernel | RuntimeKernel  # from the quantize plan, or what the runtime loads
    source: str | None = None  # None when unsupported
    kernels: tuple[str, ...] = ()
    unsupported: str | None = None
    error: str | None = None  # the template failed (a bug, not a NotImplementedError)
    fallback_for: str | None = None  # set on a split kernel standing in for a fused one
    fallback: list[str] = field(default_factory=list)  # on a fused kernel: its stand-ins
    cache_path: Path | None = None  # the source in the cache (what workers compile)

    @property
    def name(self) -> str:
        return self.planned.spec.name

    @property
    def file(self) -> str:
        return f"{self.name}.py"

    @property
    def kind(self) -> str:
        if isinstance(self.planned, RuntimeKernel):
            return self.planned.kind
        return "mor" if isinstance(self.planned.spec, MoRKernelSpec) else "quantize"

    @property
    def archs(self) -> tuple[str, ...]:
        """The archs the kernel is built for (quantize and MoR templates target every one)."""
        if isinstance(self.planned, RuntimeKernel):
            return self.planned.archs
        return jit.ARCHS


@dataclass
class RecipeBuild:
    recipe: Recipe
    plan: KernelPlan
    out: Path
    kernels: list[RenderedKernel]
    runtime: RuntimePlan | None = None  # what the runtime loads (None: the plan's kernels only)
    gemm_sources: bool = False  # also write the dequantize and GEMM modules into ``out``
    files: OutputFiles = field(init=False)  # what was written into ``out`` and replaced there

    def __post_init__(self) -> None:
        self.files = OutputFiles(self.out)

    def writes(self, item: RenderedKernel) -> bool:
        """Whether ``item``'s module goes into the folder. The quantize and MoR modules always
        do; the dequantize and GEMM modules (about 40 KiB each, 20-30 for an NVFP4 recipe, the
        same for every recipe with the same operand pairs) only when asked: the manifest lists
        them with their source hash, and the kernel cache holds their text."""
        return item.source is not None and (item.kind in ("quantize", "mor") or self.gemm_sources)


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


def render_runtime(
    items: list[RenderedKernel], runtime: RuntimePlan, render: Callable[[Any], str] | None = None
) -> list[RenderedKernel]:
    """``items`` (a rendered plan) followed by the runtime's kernels it does not hold yet, each
    rendered: quantize kernels with ``render`` (default ``jit.render_source``, as the plan),
    dequantize and GEMM kernels with ``jit.render_gemm_source``. A runtime kernel the template
    cannot make gets no stand-in: the runtime itself falls back (to the single-output kernels,
    which the runtime plan lists, or to the reference)."""
    out = list(items)
    known = {item.planned.spec for item in items}
    for kernel in runtime.kernels:
        if kernel.spec in known:
            continue  # planned already (its uses are the plan's operand slots)
        known.add(kernel.spec)
        item = RenderedKernel(kernel)
        if kernel.kind in ("quantize", "mor"):
            _render_one(item, render or jit.render_source)
        else:
            _render_one(item, jit.render_gemm_source)
        out.append(item)
    return out


def _uses_json(item: RenderedKernel) -> list[dict[str, Any]]:
    if isinstance(item.planned, RuntimeKernel):
        return [u.to_json() for u in item.planned.uses]
    return [use_json(u) for u in item.planned.uses]


def manifest(build: RecipeBuild, archs: Sequence[str], *, template: str) -> dict[str, Any]:
    """The manifest of a recipe folder: only what the recipe, the templates, the toolchain
    versions and the arguments decide (no compile results, timings or paths)."""
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
            "kind": item.kind,
            "status": status,
            "file": item.file if build.writes(item) else None,
            "source_sha256": sha256_text(item.source) if item.source is not None else None,
            "spec": kernel_spec_json(item.planned.spec),
        }
        if item.kind in ("quantize", "mor"):
            entry["tensors"] = [
                {"activation": "x", "weight": "W", "gradient": "dy"}[r] for r in item.planned.roles
            ]
        entry["uses"] = _uses_json(item)
        entry["kernels"] = list(item.kernels)
        entry["archs"] = [a for a in archs if a in item.archs]
        if item.fallback:
            entry["fallback"] = list(item.fallback)
        if item.fallback_for is not None:
            entry["fallback_for"] = item.fallback_for
        kernels.append(entry)
    data: dict[str, Any] = {
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
    if build.runtime is not None:
        data.update(build.runtime.to_json())
    return data


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
        if "template_version" not in previous or "recipe" not in previous:
            return []  # someone else's manifest.json: it names no file of ours
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
    """Write the sources of a recipe folder, removing the ones an earlier run left there; each
    file whole (``fp4gen.outputs``: a full disk leaves the old file, never part of a new one)."""
    files: dict[str, str] = {}
    for item in build.kernels:
        if not build.writes(item):
            continue
        if files.setdefault(item.file, item.source) != item.source:
            # two specs with one name (kernel names do not spell out every parameter, e.g.
            # RHT signs): one would silently overwrite the other
            raise FP4GenError(
                f"{build.recipe.name}: two different kernels are both named {item.name}; "
                "compile the contexts that need them separately"
            )
    with writing_out(build.out):
        build.out.mkdir(parents=True, exist_ok=True)
        build.files.refuse_existing([*files, MANIFEST])  # a link fails before any file is written
        for stale in _stale_files(build, set(files)):
            build.files.remove(stale.name)
        for file, source in files.items():  # unchanged files keep their mtime
            build.files.write_text(file, source, keep_same=True)


def write_manifest(build: RecipeBuild, archs: Sequence[str], *, template: str) -> Path:
    text = json.dumps(manifest(build, archs, template=template), indent=2, allow_nan=False) + "\n"
    with writing_out(build.out):  # unchanged files keep their mtime
        return build.files.write_text(MANIFEST, text, keep_same=True)


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

        self.arch = arch
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
            # the last line it wrote (a traceback's ends with the exception), kept to one line
            lines = [line.strip() for line in self.log.read()[-2000:].splitlines()]
            tail = next((line for line in reversed(lines) if line), "")[:REASON_CHARS]
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
    # the module's text, to store again where the cache lost it under the compile
    text: str | None = field(default=None, repr=False, compare=False)


def _ask(worker: _Worker, task: CompileTask) -> dict[str, Any]:
    return worker.ask(
        {
            "source": task.source,
            "kernel": task.kernel,
            "arch": task.arch,
            "dump_dir": task.dump_dir,
            "key": task.key[0] if task.key else None,
            "parts": task.key[1] if task.key else None,
        }
    )


def _compile_one(worker: _Worker, task: CompileTask, cache: KernelCache) -> dict[str, Any]:
    """One task's result; where the cache lost a file under it, the source is stored again and
    the task asked once more, and a second loss says so."""
    result = _ask(worker, task)
    if not result.get("vanished"):
        return result
    if task.text is not None:
        cache.store_source(task.text)  # the same path: its name is the text's hash
    again = _ask(worker, task)
    if again.get("vanished") and CLEARED_MEANWHILE not in again["status"]:
        again["status"] += f" ({CLEARED_MEANWHILE})"
    return again


def compile_all(
    tasks: Sequence[CompileTask],
    *,
    cache: KernelCache,
    jobs: int,
    progress: Progress | None = None,
) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Compile tasks in ``jobs`` worker processes at most; results by (source, kernel, arch).

    A worker compiles for one arch (CUTE_DSL_ARCH is read when the DSL is imported), so each
    thread drives one worker at a time: it starts on an arch of its own (the archs with the most
    tasks first) and, when that arch's queue is empty, moves to the arch with the most tasks
    left, with a new worker. The archs' queues rarely have equal lengths (the sm_90a GEMMs have
    no sm_100a counterpart), so a fixed worker per arch would leave one idle."""
    results: dict[tuple[str, str, str], dict[str, Any]] = {}
    if not tasks:
        return results
    pending: dict[str, collections.deque[CompileTask]] = {}
    for task in tasks:
        pending.setdefault(task.arch, collections.deque()).append(task)
    by_size = sorted(pending, key=lambda a: -len(pending[a]))
    lock = threading.Lock()

    def next_task(arch: str) -> CompileTask | None:
        with lock:
            if not pending[arch]:  # this arch is done: help the one with the most left
                arch = max(pending, key=lambda a: len(pending[a]))
            return pending[arch].popleft() if pending[arch] else None

    def drive(first: str) -> None:
        worker: _Worker | None = None
        arch = first
        try:
            while (task := next_task(arch)) is not None:
                arch = task.arch
                if worker is not None and (worker.arch != arch or not worker.alive):
                    worker.close()
                    worker = None
                try:
                    if worker is None:  # its log goes to the staging folder, made again if cleared
                        worker = _Worker(arch, cache, cache.work_dir())
                    result = _compile_one(worker, task, cache)
                except Exception as err:  # every task gets a result, in one line
                    result = {"status": f"error: {failure_text(err)}", "seconds": 0.0}
                with lock:
                    results[(task.source, task.kernel, arch)] = result
                    if progress is not None:
                        label = task.label or Path(task.source).stem
                        progress.update(f"{arch} {label} {task.kernel}", result)
        finally:
            if worker is not None:
                worker.close()

    count = min(jobs, len(tasks))
    threads = [
        threading.Thread(target=drive, args=(by_size[i % len(by_size)],), daemon=True)
        for i in range(count)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompileResult:
    """One kernel of one generated module for one arch, as this run found or built it."""

    module: str  # the generated module's name (the spec's)
    kind: str
    kernel: str  # the kernel's name in the module ("quantize", "gemm", ...)
    arch: str
    status: str  # "ok" or "error: ..."
    cached: bool  # found in the kernel cache (no compile)
    seconds: float  # compile seconds of this run (0 for a cached kernel)


@dataclass
class CompileReport:
    builds: list[RecipeBuild]
    unsupported: dict[str, list[str]]  # reason -> kernel names
    errors: list[str]
    seconds: float
    compiled: int
    cached: int
    results: list[CompileResult] = field(default_factory=list)  # in plan order, each once
    failed: int = 0  # kernel compiles that failed (each also in ``errors``, one line)


def prepare_builds(
    recipes: Sequence[Recipe],
    *,
    archs: Sequence[str] = jit.ARCHS,
    out: Path | None = None,
    render: Callable[[Any], str] | None = None,
    input_dtype: str | Mapping[str, str] = "bf16",
    fallback: bool = True,
    runtime: bool = True,
    gemm_sources: bool = False,
) -> list[RecipeBuild]:
    """Plan and render ``recipes`` (no file is written): the quantize plan with its stand-ins,
    then (with ``runtime``) every other kernel the runtime loads on ``archs``."""
    builds = []
    for recipe in recipes:
        if out is None:
            folder = recipe_folder(recipe, Path("generated"))
        else:
            folder = Path(out) if len(recipes) == 1 else recipe_folder(recipe, Path(out))
        plan = plan_recipe(recipe, input_dtype=input_dtype)  # type: ignore[arg-type]
        rendered = render_plan(plan, render, fallback=fallback)
        loads = None
        if runtime:
            loads = runtime_plan(recipe, archs=tuple(archs), input_dtype=input_dtype)  # type: ignore[arg-type]
            rendered = render_runtime(rendered, loads, render)
        builds.append(RecipeBuild(recipe, plan, folder, rendered, loads, gemm_sources))
    return builds


def compile_recipes(
    recipes: Sequence[Recipe],
    *,
    archs: Sequence[str] = jit.ARCHS,
    out: Path | None = None,
    keep_ptx: bool = False,
    jobs: int | None = None,
    compile: bool = True,
    cache: KernelCache | None = None,
    render: Callable[[Any], str] | None = None,
    progress_stream: TextIO | None = None,
    input_dtype: str | Mapping[str, str] = "bf16",
    fallback: bool = True,
    runtime: bool = True,
    gemm_sources: bool = False,
    announce: Callable[[list[RecipeBuild]], None] | None = None,
) -> CompileReport:
    """Plan, render and (unless ``compile`` is False) compile ``recipes`` for ``archs``.

    out: the recipe folder for one recipe, the parent of one folder per recipe for several
    (default: generated/<recipe>/ under the current directory). runtime: also every kernel the
    runtime loads besides the quantize plan (``fp4gen.compiler.aot``). gemm_sources: write the
    dequantize and GEMM modules into the folder too (``RecipeBuild.writes``). announce: called with
    the rendered builds once the sources are written, before anything is compiled (the
    command prints the plan; an unusable cache or output folder fails before it)."""
    if jobs is not None and jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    start = time.perf_counter()
    cache = cache or KernelCache()
    builds = prepare_builds(
        recipes,
        archs=archs,
        out=out,
        render=render,
        input_dtype=input_dtype,
        fallback=fallback,
        runtime=runtime,
        gemm_sources=gemm_sources,
    )

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
            if not compile:
                continue
            for arch in archs:
                if arch not in item.archs:
                    continue  # e.g. the wgmma GEMMs on sm_100a
                for name in item.kernels:
                    dump = None
                    if keep_ptx:
                        dump = str(inside(build.out, "ptx", arch, item.name, name))
                    where = (str(item.cache_path), name, arch)
                    if where not in tasks:
                        key = jit.kernel_key(cache, item.source, name, arch)
                        tasks[where] = CompileTask(*where, dump, item.name, key, item.source)

    if announce is not None:  # the folders are usable: say what is about to be built
        announce(builds)

    # kernels already in the cache need no worker (unless PTX is wanted: that is a compile)
    found: dict[tuple[str, str, str], dict[str, Any]] = {}
    ordered = []
    for where, task in tasks.items():
        entry = None if keep_ptx or task.key is None else cache.lookup(task.key[0])
        if entry is None:
            ordered.append(task)
        else:
            found[where] = {"status": "ok", "seconds": 0.0, "cached": True}
    jobs = jobs or min(8, os.cpu_count() or 1)
    progress = Progress(len(ordered), progress_stream) if ordered else None
    found.update(compile_all(ordered, cache=cache, jobs=jobs, progress=progress))

    results: list[CompileResult] = []
    done: set[tuple[str, str, str]] = set()
    for build in builds:
        for item in build.kernels:
            if item.cache_path is None or not compile:
                continue
            for arch in (a for a in archs if a in item.archs):
                for name in item.kernels:
                    where = (str(item.cache_path), name, arch)
                    if where in done:
                        continue  # one module shared by several recipes: reported once
                    done.add(where)
                    r = found.get(where) or {"status": "error: no compile result came back"}
                    cached = bool(r.get("cached"))
                    seconds = 0.0 if cached else float(r.get("seconds", 0.0))
                    results.append(
                        CompileResult(
                            item.name, item.kind, name, arch, r["status"], cached, seconds
                        )
                    )
    for build in builds:
        write_manifest(build, archs, template=cache.template_version)
    failed = [r for r in results if r.status != "ok"]
    for r in failed:
        errors.append(f"{r.module} {r.kernel} {r.arch}: {r.status.removeprefix('error: ')}")
    compiled = sum(1 for r in results if r.status == "ok" and not r.cached)
    cached = sum(1 for r in results if r.status == "ok" and r.cached)
    seconds = time.perf_counter() - start
    return CompileReport(
        builds, unsupported, errors, seconds, compiled, cached, results, len(failed)
    )


__all__ = [
    "MANIFEST",
    "CompileReport",
    "CompileResult",
    "RecipeBuild",
    "compile_recipes",
    "manifest",
    "prepare_builds",
    "recipe_sha256",
    "render_plan",
    "render_runtime",
]
