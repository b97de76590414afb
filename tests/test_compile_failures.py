"""``fp4gen compile`` when kernels fail or the kernel cache loses files under it (``fp4gen cache
clear`` in another shell): every failure is one line naming the kernel, the summary counts them,
the exit status is 1, and a source that vanished is stored again and compiled once more.

The compile workers are stand-ins here (no CuTe DSL compile) except in the last test, which
clears the cache under real workers compiling the stub template's kernels."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from fp4gen.cli import main
from fp4gen.compiler import build, jit
from fp4gen.compiler import cache as cache_mod
from fp4gen.compiler.cache import KernelCache
from fp4gen.compiler.worker import failure_text

TESTS = Path(__file__).resolve().parent

sys.path.insert(0, str(TESTS))
from kernel_stub import render_stub  # noqa: E402

sys.path.remove(str(TESTS))

# three formats: several modules, some with two kernels (amax, quantize)
RECIPE = """recipe r "t"
operands {
    * : mxfp8_e4m3 round nearest
    weight : nvfp4
    gradient : mxfp4
}
"""
SUMMARY = re.compile(
    r"^compiled (\d+) kernel\(s\), (\d+) from the cache(?:, (\d+) failed \(see below\))?, "
    r"for sm_90a in [\d.]+s$"
)
LOST_TWICE = (
    "lost twice; was the kernel cache cleared during the compile? Compile again once it is not"
)


def no_gemm_template(spec: object) -> str:
    raise NotImplementedError("no GEMM or dequantize template here (stub)")


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The stub template in a scratch folder: nothing reads or writes the real cache."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FP4GEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(jit, "render_source", render_stub)
    monkeypatch.setattr(jit, "render_gemm_source", no_gemm_template)
    monkeypatch.setattr(cache_mod, "template_version", lambda: "stub")
    (tmp_path / "r.fp4r").write_text(RECIPE)


def compile_r(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> tuple[int, str, str]:
    argv = ["compile", "r.fp4r", "--out", "out", "--cache-dir", str(tmp_path / "c")]
    code = main([*argv, "--arch", "sm_90a", "-j", "1"])
    out, err = capsys.readouterr()
    return code, out, err


def summary(stdout: str) -> tuple[int, int, int]:
    """(compiled, cached, failed) of the summary, which is the last line."""
    match = SUMMARY.match(stdout.splitlines()[-1])
    assert match is not None, stdout
    return int(match[1]), int(match[2]), int(match[3] or 0)


def progress_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.match(r"\[\s*\d+/\d+\]", line)]


class FakeWorker:
    """Stands in for a compile worker process: ``answer(cache, task)`` gives each result."""

    answer: Any = None
    asked: list[dict[str, Any]] = []

    def __init__(self, arch: str, cache: KernelCache, log_dir: Path) -> None:
        self.arch = arch
        self.cache = cache
        self.alive = True

    def ask(self, task: dict[str, Any]) -> dict[str, Any]:
        FakeWorker.asked.append(task)
        return FakeWorker.answer(self.cache, task)

    def close(self) -> None:
        pass


@pytest.fixture
def fake_worker(monkeypatch: pytest.MonkeyPatch) -> type[FakeWorker]:
    FakeWorker.asked = []
    monkeypatch.setattr(build, "_Worker", FakeWorker)
    return FakeWorker


def vanished(source: str) -> dict[str, Any]:
    """What a worker answers when the source it was to compile is gone."""
    err = cache_mod.SourceVanished(
        f"the generated source {source} vanished from the kernel cache before it was compiled",
        Path(source),
    )
    return {"status": f"error: {failure_text(err)}", "seconds": 0.0, "vanished": True}


OK = {"status": "ok", "seconds": 0.25, "cached": False}


def test_a_cleared_cache_under_the_compile_is_recovered(
    fake_worker: type[FakeWorker], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cleared: list[int] = []

    def answer(cache: KernelCache, task: dict[str, Any]) -> dict[str, Any]:
        if not cleared:  # fp4gen cache clear, just as the first kernel starts
            cleared.append(KernelCache(cache.root).clear())
        return OK if Path(task["source"]).is_file() else vanished(task["source"])

    fake_worker.answer = answer
    code, out, err = compile_r(capsys, tmp_path)
    assert code == 0, err
    compiled, cached, failed = summary(out)
    assert compiled > 0 and (cached, failed) == (0, 0)
    assert cleared[0] > 0 and "error" not in err
    # each source lost was stored again and its kernel asked once more
    sources = {task["source"] for task in fake_worker.asked}
    assert len(fake_worker.asked) == compiled + len(sources)
    assert all(Path(source).is_file() for source in sources)


def test_failures_are_counted_and_each_is_one_line(
    fake_worker: type[FakeWorker], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tasks: list[tuple[str, str]] = []  # (source, kernel), in the order first asked

    def answer(cache: KernelCache, task: dict[str, Any]) -> dict[str, Any]:
        asked = (task["source"], task["kernel"])
        if asked not in tasks:
            tasks.append(asked)
        if asked == tasks[0]:  # cleared again and again: lost twice
            Path(task["source"]).unlink(missing_ok=True)
            return vanished(task["source"])
        if asked == next((t for t in tasks if t[0] != tasks[0][0]), None):
            # the first kernel of another module: the compiler fails, with a long story
            err = RuntimeError("ptxas fatal: out of registers\n  at line 7\n  at line 9")
            return {"status": f"error: {failure_text(err)}", "seconds": 0.0}
        return OK if Path(task["source"]).is_file() else vanished(task["source"])

    fake_worker.answer = answer
    code, out, err = compile_r(capsys, tmp_path)
    assert code == 1
    compiled, cached, failed = summary(out)
    assert (cached, failed) == (0, 2) and compiled == len(tasks) - 2 > 0
    names = _modules(tmp_path)
    (lost, lost_kernel) = tasks[0]
    (broken, broken_kernel) = next(t for t in tasks if t[0] != lost)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert sorted(errors) == sorted(
        [
            f"error: {names[lost]} {lost_kernel} sm_90a: the generated source {lost} vanished "
            f"from the kernel cache before it was compiled ({LOST_TWICE})",
            f"error: {names[broken]} {broken_kernel} sm_90a: RuntimeError: ptxas fatal: out of "
            "registers (...)",
        ]
    )
    assert "Traceback" not in err and "FileNotFoundError" not in err
    assert len(progress_lines(err)) == len(tasks)  # one progress line per kernel


def test_a_worker_that_cannot_start_fails_its_kernels_in_one_line_each(
    fake_worker: type[FakeWorker],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    logs = tmp_path / "c" / "v1" / "tmp"

    def cannot_start(self: FakeWorker, arch: str, cache: KernelCache, log_dir: Path) -> None:
        raise FileNotFoundError(2, "No such file or directory", str(logs / "worker.log"))

    monkeypatch.setattr(FakeWorker, "__init__", cannot_start)
    code, out, err = compile_r(capsys, tmp_path)
    assert code == 1
    compiled, cached, failed = summary(out)
    assert (compiled, cached) == (0, 0) and failed > 0
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == failed
    for line in errors:
        assert line.endswith(f" sm_90a: {logs / 'worker.log'}: no such file or directory")
    assert "Traceback" not in err


def _modules(tmp_path: Path) -> dict[str, str]:
    """The cache path of each generated module's source -> the module's name."""
    import json

    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    cache = KernelCache(tmp_path / "c")
    out = {}
    for kernel in manifest["kernels"]:
        if kernel["source_sha256"] is not None:
            out[str(cache.sources_dir / f"{kernel['source_sha256']}.py")] = kernel["name"]
    return out


def test_a_real_compile_survives_a_cache_clear(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("cutlass")
    real_ask = build._Worker.ask
    cleared: list[int] = []

    def clear_first(self: Any, task: dict[str, Any]) -> dict[str, Any]:
        if not cleared:  # fp4gen cache clear in another shell, as the first kernel starts
            cleared.append(KernelCache(tmp_path / "c").clear())
        return real_ask(self, task)

    monkeypatch.setattr(build._Worker, "ask", clear_first)
    code, out, err = compile_r(capsys, tmp_path)
    assert code == 0, err
    compiled, cached, failed = summary(out)
    assert compiled > 0 and (cached, failed) == (0, 0) and cleared[0] > 0
    assert KernelCache(tmp_path / "c").info()["kernels"] == compiled


def test_a_worker_that_dies_is_one_line(tmp_path: Path) -> None:
    import subprocess
    import tempfile

    worker = build._Worker.__new__(build._Worker)
    worker.arch = "sm_90a"
    worker.log = tempfile.NamedTemporaryFile(mode="w+", dir=tmp_path, delete=False)  # noqa: SIM115
    script = "import sys; print('starting', file=sys.stderr); raise RuntimeError('no DSL here')"
    worker.proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=worker.log,
        text=True,
    )
    worker.proc.wait()
    result = worker.ask({"source": "s.py", "kernel": "quantize", "arch": "sm_90a"})
    worker.close()
    assert result == {
        "status": "error: the compile worker died (exit 1): RuntimeError: no DSL here",
        "seconds": 0.0,
    }
