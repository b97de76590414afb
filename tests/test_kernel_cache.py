"""The kernel cache (fp4gen.compiler.cache) and loading compiled kernels from it (CPU only:
compiling, exporting, linking and loading need no GPU)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fp4gen.compiler import cache as cache_mod
from fp4gen.compiler.cache import KernelCache, default_root, sha256_text
from fp4gen.compiler.jit import find_linker
from fp4gen.formats import E2M1, E4M3, ScaleSpec
from fp4gen.spec import QuantKernelSpec, QuantOutput

ROOT = Path(__file__).resolve().parent.parent


def pythonpath() -> str:
    """The checkout first, then whatever the environment had (installed dependencies)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


TESTS = Path(__file__).resolve().parent

SPEC = QuantKernelSpec(
    E2M1,
    (1, 16),
    ScaleSpec(E4M3, "nearest"),
    True,
    "bf16",
    (QuantOutput("rowwise", "nearest", None),),
)


def fake_build(payload: bytes = b"\x7fELF fake kernel", counter: list[int] | None = None):
    def build(folder: Path) -> dict:
        if counter is not None:
            counter.append(1)
        (folder / "kernel.so").write_bytes(payload)
        return {"symbol": "fp4gen_test", "compile_seconds": 0.5}

    return build


@pytest.fixture(autouse=True)
def fresh_warnings() -> None:
    cache_mod._warned.clear()


# ----------------------------------------------------------------------------------------------
# Location
# ----------------------------------------------------------------------------------------------


def test_root_env_xdg_and_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FP4GEN_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_root() == tmp_path / "home" / ".cache" / "fp4gen"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / "xdg" / "fp4gen"
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path / "mine"))
    assert default_root() == tmp_path / "mine"
    assert KernelCache().root == tmp_path / "mine"


def test_cache_dir_env_is_honoured_end_to_end(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path / "c"))
    cache = KernelCache()
    cache.store_source("X = 1\n")
    key, parts = cache.key(source_sha256="s", kernel="k", arch="sm_90a")
    cache.get_or_build(key, fake_build(), parts=parts)
    assert (tmp_path / "c" / "v1" / "kernels" / key / "entry.json").is_file()
    assert len(list((tmp_path / "c" / "v1" / "sources").glob("*.py"))) == 1


# ----------------------------------------------------------------------------------------------
# Keys, sources, entries
# ----------------------------------------------------------------------------------------------


def test_key_covers_everything_that_changes_the_binary(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path)
    base = dict(source_sha256="a" * 64, kernel="quantize", arch="sm_90a", options={"o": 1})
    key, parts = cache.key(**base)
    assert key == cache.key(**base)[0]  # deterministic
    for change in (
        {"source_sha256": "b" * 64},
        {"kernel": "amax"},
        {"arch": "sm_100a"},
        {"options": {"o": 2}},
    ):
        assert cache.key(**{**base, **change})[0] != key
    assert KernelCache(tmp_path, template="other").key(**base)[0] != key
    for name in ("nvidia-cutlass-dsl", "apache-tvm-ffi", "template", "fp4gen", "platform"):
        assert name in parts
    assert parts["nvidia-cutlass-dsl"].startswith("4.8")


def test_store_source_is_content_addressed(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path)
    path = cache.store_source("A = 1\n")
    assert path.name == f"{sha256_text('A = 1' + chr(10))}.py"
    assert cache.store_source("A = 1\n") == path
    path.write_text("garbage")  # corrupt: rewritten on the next store
    assert cache.store_source("A = 1\n").read_text() == "A = 1\n"
    assert not list(path.parent.glob(".*.tmp"))  # no temp files left behind


def test_build_once_then_hit(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path)
    key, parts = cache.key(source_sha256="s", kernel="k", arch="sm_90a")
    calls: list[int] = []
    entry, built = cache.get_or_build(key, fake_build(counter=calls), parts=parts)
    assert built and len(calls) == 1
    assert entry.meta["symbol"] == "fp4gen_test" and entry.meta["parts"]["arch"] == "sm_90a"
    assert entry.files == ("kernel.so",)
    again, built = cache.get_or_build(key, fake_build(counter=calls), parts=parts)
    assert not built and len(calls) == 1 and again.path == entry.path
    assert not any((tmp_path / "v1" / "tmp").iterdir())  # staging cleaned up


@pytest.mark.parametrize(
    "damage",
    ["truncate", "flip", "delete_file", "delete_manifest", "garbage_manifest", "empty_manifest"],
)
def test_corrupt_entry_is_detected_and_rebuilt(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = KernelCache(tmp_path)
    key, parts = cache.key(source_sha256="s", kernel="k", arch="sm_90a")
    entry, _ = cache.get_or_build(key, fake_build(), parts=parts)
    lib, manifest = entry.file("kernel.so"), entry.file("entry.json")
    if damage == "truncate":
        lib.write_bytes(lib.read_bytes()[:5])
    elif damage == "flip":
        data = bytearray(lib.read_bytes())
        data[0] ^= 0xFF
        lib.write_bytes(bytes(data))
    elif damage == "delete_file":
        lib.unlink()
    elif damage == "delete_manifest":
        manifest.unlink()
    elif damage == "garbage_manifest":
        manifest.write_text("{not json")
    else:
        manifest.write_text(json.dumps({"files": {}}))
    with caplog.at_level(logging.WARNING, logger="fp4gen.cache"):
        assert cache.lookup(key) is None
        assert cache.lookup(key) is None  # gone now: no second warning
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "rebuilding" in warnings[0].getMessage()
    calls: list[int] = []
    rebuilt, built = cache.get_or_build(key, fake_build(counter=calls), parts=parts)
    assert built and calls == [1]
    assert rebuilt.file("kernel.so").read_bytes() == b"\x7fELF fake kernel"


def test_warning_once_per_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = KernelCache(tmp_path)
    key, parts = cache.key(source_sha256="s", kernel="k", arch="sm_90a")
    with caplog.at_level(logging.WARNING, logger="fp4gen.cache"):
        for _ in range(3):
            entry, _ = cache.get_or_build(key, fake_build(), parts=parts)
            entry.file("kernel.so").write_bytes(b"bad")
            assert cache.lookup(key) is None
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_losing_a_publish_race_keeps_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compile-then-rename without the lock: both build, one rename wins, the loser discards its
    copy and returns the winner's entry."""
    import contextlib

    cache = KernelCache(tmp_path)
    monkeypatch.setattr(KernelCache, "lock", lambda self, key: contextlib.nullcontext())
    key, parts = cache.key(source_sha256="s", kernel="k", arch="sm_90a")
    barrier = threading.Barrier(2)
    results = []

    def build(folder: Path) -> dict:
        barrier.wait()  # both are building at the same time
        (folder / "kernel.so").write_bytes(f"from {threading.get_ident()}".encode())
        return {"symbol": "s"}

    def worker() -> None:
        results.append(cache.get_or_build(key, build, parts=parts))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(built for _, built in results) == [False, True]
    assert results[0][0].path == results[1][0].path
    assert cache.lookup(key) is not None
    assert [p.name for p in (tmp_path / "v1" / "kernels").iterdir()] == [key]
    assert not any((tmp_path / "v1" / "tmp").iterdir())


RACE_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from fp4gen.compiler.cache import KernelCache

    root, start, log = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
    cache = KernelCache(root)
    key, parts = cache.key(source_sha256="s", kernel="k", arch="sm_90a")

    def build(folder):
        with open(log, "a") as f:
            f.write("build\\n")
        time.sleep(1.0)
        (folder / "kernel.so").write_bytes(b"x" * 100000)
        return {"symbol": "s"}

    time.sleep(max(0.0, start - time.time()))
    entry, built = cache.get_or_build(key, build, parts=parts)
    print(json.dumps({"built": built, "path": str(entry.path)}))
    """
)


def test_two_processes_build_one_valid_entry(tmp_path: Path) -> None:
    script = tmp_path / "race.py"
    script.write_text(RACE_SCRIPT)
    log = tmp_path / "builds.log"
    start = time.time() + 1.5
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "c"), str(start), str(log)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.append(json.loads(out))
    assert sorted(o["built"] for o in outs) == [False, True]
    assert outs[0]["path"] == outs[1]["path"]
    assert log.read_text().count("build") == 1  # the lock: the second process waited, no build
    cache = KernelCache(tmp_path / "c")
    assert len(cache.entries()) == 1
    assert cache.lookup(cache.entries()[0].key) is not None


def test_info_and_clear(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "c")
    assert cache.info()["kernels"] == 0 and cache.clear() == 0
    cache.store_source("A = 2\n")
    for arch in ("sm_90a", "sm_100a", "sm_100a"):
        key, parts = cache.key(
            source_sha256=arch + str(len(cache.entries())), kernel="k", arch=arch
        )
        cache.get_or_build(key, fake_build(), parts=parts)
    info = cache.info()
    assert info["location"] == str(tmp_path / "c")
    assert info["kernels"] == 3 and info["sources"] == 1
    assert info["by_arch"] == {"sm_100a": 2, "sm_90a": 1}
    assert info["bytes"] > 3 * len(b"\x7fELF fake kernel")
    assert cache.clear() == info["bytes"]
    assert cache.info()["kernels"] == 0 and cache.info()["bytes"] == 0


# ----------------------------------------------------------------------------------------------
# A cache cleared under a build (fp4gen cache clear in another shell during a compile)
# ----------------------------------------------------------------------------------------------


def clearing_build(cache: KernelCache, clears: int, counter: list[int]):
    """A build that clears the cache (staging folder included) during its first ``clears``
    calls, as ``fp4gen cache clear`` in another shell would, then fails as the export would."""

    def build(folder: Path) -> dict:
        counter.append(1)
        (folder / "kernel.so").write_bytes(b"\x7fELF fake kernel")
        if len(counter) <= clears:
            cache.clear()
            (folder / "kernel.o").write_bytes(b"x")  # the export writes into a folder now gone
        return {"symbol": "fp4gen_test"}

    return build


def test_a_build_whose_staging_folder_is_cleared_is_built_again(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "c")
    key, parts = cache.key(source_sha256="s", kernel="k", arch="sm_90a")
    calls: list[int] = []
    entry, built = cache.get_or_build(key, clearing_build(cache, 1, calls), parts=parts)
    assert built and len(calls) == 2  # recompiled once
    assert entry.file("kernel.so").read_bytes() == b"\x7fELF fake kernel"
    assert cache.lookup(key) is not None and cache.info()["kernels"] == 1


def test_a_build_cleared_twice_says_so(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path / "c")
    key, parts = cache.key(source_sha256="s", kernel="k", arch="sm_90a")
    calls: list[int] = []
    with pytest.raises(cache_mod.CacheVanished) as info:
        cache.get_or_build(key, clearing_build(cache, 2, calls), parts=parts)
    assert len(calls) == 2
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"cache entry {key}: its staging folder ")
    assert message.endswith(
        "vanished while the kernel was built (lost twice; was the kernel cache cleared during "
        "the compile? Compile again once it is not)"
    )
    assert cache.lookup(key) is None


def test_a_kernels_folder_cleared_before_publishing_is_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = KernelCache(tmp_path / "c")
    key, parts = cache.key(source_sha256="s", kernel="k", arch="sm_90a")
    real_rename = os.rename
    renames: list[str] = []

    def rename_after_a_clear(src: object, dst: object) -> None:
        renames.append(str(dst))
        if len(renames) == 1:  # the first publish finds kernels/ gone
            shutil.rmtree(cache.kernels_dir)
        real_rename(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rename", rename_after_a_clear)
    calls: list[int] = []
    entry, built = cache.get_or_build(key, fake_build(counter=calls), parts=parts)
    assert built and len(calls) == 2 and renames == [str(entry.path)] * 2
    assert cache.lookup(key) is not None


def test_a_source_cleared_before_its_compile_is_named(tmp_path: Path) -> None:
    from fp4gen.compiler import jit

    cache = KernelCache(tmp_path / "c")
    source = cache.store_source("KERNELS = ('quantize',)\n")
    key = jit.kernel_key(cache, source.read_text(), "quantize", "sm_90a")
    cache.clear()
    message = f"the generated source {source} vanished from the kernel cache before it was compiled"
    for given in (None, key):  # the key read from the source, or the parent's
        with pytest.raises(cache_mod.SourceVanished) as info:
            jit.build_kernel(cache, source, "quantize", "sm_90a", key=given)
        assert str(info.value) == message
    # a missing file outside the cache is what it is
    with pytest.raises(FileNotFoundError):
        jit.build_kernel(cache, tmp_path / "elsewhere.py", "quantize", "sm_90a")


def test_a_worker_reports_a_vanished_source_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fp4gen.compiler import jit, worker

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path / "c"))
    cache = KernelCache(tmp_path / "c")
    source = cache.store_source("KERNELS = ('quantize',)\n")
    key, parts = jit.kernel_key(cache, source.read_text(), "quantize", "sm_90a")
    cache.clear()
    task = {"source": str(source), "kernel": "quantize", "arch": "sm_90a", "key": key}
    result = worker.compile_task({**task, "parts": parts})
    assert result == {
        "status": f"error: the generated source {source} vanished from the kernel cache "
        "before it was compiled",
        "seconds": 0.0,
        "cached": False,
        "vanished": True,
    }


def test_failure_text_is_one_line() -> None:
    from fp4gen.compiler.worker import REASON_CHARS, failure_text

    lost = FileNotFoundError(2, "No such file or directory", "/c/v1/sources/a.py")
    assert failure_text(lost) == "/c/v1/sources/a.py: no such file or directory"
    assert (
        failure_text(RuntimeError("ptxas failed\n  line 2\n")) == "RuntimeError: ptxas failed (...)"
    )
    assert failure_text(cache_mod.CacheError("the cache is full")) == "the cache is full"
    assert failure_text(ValueError()) == "ValueError"
    long = failure_text(RuntimeError("x" * 1000))
    assert len(long) == REASON_CHARS and long.endswith("...")


# ----------------------------------------------------------------------------------------------
# Real compiled kernels (the stub template: compiles in a second, no GPU)
# ----------------------------------------------------------------------------------------------

LOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, sys.argv[2])
    from kernel_stub import render_stub
    from fp4gen.compiler import jit
    from fp4gen.compiler.cache import KernelCache
    from fp4gen.spec import QuantKernelSpec, QuantOutput
    from fp4gen.formats import E2M1, E4M3, ScaleSpec
    from fp4gen.runtime import kernels_for

    spec = QuantKernelSpec(E2M1, (1, 16), ScaleSpec(E4M3, "nearest"), True, "bf16",
                           (QuantOutput("rowwise", "nearest", None),))
    cache = KernelCache(sys.argv[1], template="stub")
    start = time.perf_counter()
    k = kernels_for(spec, "sm_90a", cache=cache, render=render_stub)
    s = k.stats
    print(json.dumps({"compiled": s.compiled, "loaded": s.loaded, "names": list(k),
                      "seconds": time.perf_counter() - start,
                      "callable": all(callable(f) for f in k.values()),
                      "compile_count": jit.compile_count(), "load_count": jit.load_count(),
                      "compiled_kernels": [k for _, k, _ in jit.compiled_kernels()]}))
    """
)


def run_load_script(tmp_path: Path) -> dict:
    script = tmp_path / "load.py"
    script.write_text(LOAD_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "c"), str(TESTS)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": pythonpath()},
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernels_for_compiles_once_then_loads_in_a_new_process(tmp_path: Path) -> None:
    first = run_load_script(tmp_path)
    assert first == {**first, "compiled": 2, "loaded": 0, "names": ["amax", "quantize"]}
    # the process-wide counters (fp4gen.compiler.jit) agree with the loader's own
    assert first["compile_count"] == 2 and first["compiled_kernels"] == ["amax", "quantize"]
    assert first["load_count"] == 2  # what it compiled, it loads from the cache entry
    second = run_load_script(tmp_path)  # a fresh process: everything from the cache
    assert second == {**second, "compiled": 0, "loaded": 2, "callable": True}
    assert second["compile_count"] == 0 and second["load_count"] == 2
    entries = KernelCache(tmp_path / "c").entries()
    assert len(entries) == 2
    linked = find_linker() is not None
    for e in entries:
        assert set(e.files) == ({"kernel.o", "kernel.so"} if linked else {"kernel.o"})
        assert e.meta["symbol"].startswith("fp4gen_")
        assert e.meta["parts"]["arch"] == "sm_90a"
        if linked and shutil.which("readelf"):
            assert e.meta["artifact"] == "kernel.so"
            # linked against the TVM-FFI runtime by soname (no path of this machine inside)
            needed = subprocess.run(
                ["readelf", "-d", str(e.file("kernel.so"))], capture_output=True, text=True
            ).stdout
            assert "libtvm_ffi.so" in needed and str(ROOT) not in needed


def test_corrupt_shared_library_is_rebuilt(tmp_path: Path) -> None:
    run_load_script(tmp_path)
    (lib,) = [
        e.file("kernel.so")
        for e in KernelCache(tmp_path / "c").entries()
        if e.meta["parts"]["kernel"] == "quantize"
    ]
    lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2])  # truncated
    again = run_load_script(tmp_path)
    assert (again["compiled"], again["loaded"]) == (1, 1)


def test_kernels_for_in_process_memo_and_stub_contract(tmp_path: Path) -> None:
    pytest.importorskip("cutlass")
    sys.path.insert(0, str(TESTS))
    try:
        from kernel_stub import render_stub
    finally:
        sys.path.remove(str(TESTS))
    from fp4gen.runtime.kernels import kernels_for

    cache = KernelCache(tmp_path / "c", template="stub")
    k = kernels_for(SPEC, "sm_100a", cache=cache, render=render_stub)
    assert list(k) == ["amax", "quantize"] and len(k) == 2
    assert k.arch == "sm_100a" and k.spec == SPEC
    assert k.source_path.parent == cache.sources_dir
    assert k.module.KERNELS == ("amax", "quantize")
