"""The one kernel loader of the backends (fp4gen.runtime.loader), on the CPU: what it remembers,
how it words a failure, what it lets through, logging once, and concurrent calls."""

from __future__ import annotations

import logging
import threading
from dataclasses import FrozenInstanceError

import pytest
import torch

from fp4gen.codegen.gemm import pick_tile
from fp4gen.codegen.gemm_configs import MmaPlan, gemm_config, mma_plan
from fp4gen.runtime import blackwell_gemm, cute_backend, cute_gemm, dequant, mor_kernels
from fp4gen.runtime.loader import (
    ARCHS,
    BUILD_FAILED,
    DSL_MISSING,
    NO_KERNELS_FOR_ARCH,
    KernelLoader,
    LogOnce,
    Reasons,
    Unsupported,
)


class Spec:
    """A stand-in spec: hashable, with a name."""

    def __init__(self, name: str) -> None:
        self.name = name


FULL = Reasons(
    arch=NO_KERNELS_FOR_ARCH,
    template="the template cannot generate {spec.name} ({err})",
    dsl=DSL_MISSING,
    build=BUILD_FAILED,
)


class Counting:
    """A load function that counts its calls and returns or raises what it is given."""

    def __init__(self, outcome: object) -> None:
        self.outcome = outcome
        self.calls = 0

    def __call__(self, spec: object, arch: str) -> object:
        self.calls += 1
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome if self.outcome is not None else object()


def test_unsupported_is_a_frozen_value_with_a_reason() -> None:
    u = Unsupported("no kernel")
    assert u.reason == "no kernel" and str(u) == "no kernel"
    assert u == Unsupported("no kernel") and hash(u) == hash(Unsupported("no kernel"))
    with pytest.raises(FrozenInstanceError):
        u.reason = "other"  # type: ignore[misc]


def test_a_success_is_returned_and_kept_only_when_asked() -> None:
    spec = Spec("s")
    load = Counting(None)
    loader: KernelLoader[Spec, object] = KernelLoader(FULL)
    first, second = loader.get(spec, "sm_90a", load), loader.get(spec, "sm_90a", load)
    assert load.calls == 2 and first is not second  # the load function memoizes, not the loader
    assert not loader.loaded and not loader.failed
    keeping: KernelLoader[Spec, object] = KernelLoader(FULL, keep_loaded=True)
    load = Counting(None)
    first = keeping.get(spec, "sm_90a", load)
    assert keeping.get(spec, "sm_90a", load) is first and load.calls == 1
    assert keeping.loaded == {(spec, "sm_90a"): first}
    keeping.get(spec, "sm_100a", load)  # per (spec, arch)
    assert load.calls == 2


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (NotImplementedError("2D blocks"), "the template cannot generate s (2D blocks)"),
        (ImportError("no cutlass"), "the CuTe DSL cannot be imported (no cutlass)"),
        (RuntimeError("ld failed"), "building s for sm_90a failed (RuntimeError: ld failed)"),
    ],
)
def test_a_failure_is_worded_remembered_and_not_retried(error: Exception, reason: str) -> None:
    spec = Spec("s")
    load = Counting(error)
    loader: KernelLoader[Spec, object] = KernelLoader(FULL, keep_loaded=True)
    got = loader.get(spec, "sm_90a", load)
    assert got == Unsupported(reason)
    assert loader.get(spec, "sm_90a", load) is got and load.calls == 1
    assert loader.failed == {(spec, "sm_90a"): got} and not loader.loaded
    loader.get(spec, "sm_100a", load)  # another arch is tried on its own
    assert load.calls == 2


def test_exceptions_without_a_template_propagate() -> None:
    spec = Spec("s")
    template_only = Reasons(template="{spec.name}: {err}")
    loader: KernelLoader[Spec, object] = KernelLoader(template_only)
    assert loader.get(spec, "sm_90a", Counting(NotImplementedError("x"))) == Unsupported("s: x")
    for error in (ImportError("y"), RuntimeError("z")):
        load, other = Counting(error), Spec("other")
        with pytest.raises(type(error)):
            loader.get(other, "sm_90a", load)
        with pytest.raises(type(error)):  # not remembered: raised again
            loader.get(other, "sm_90a", load)
        assert load.calls == 2
    assert set(loader.failed) == {(spec, "sm_90a")}
    # no template for NotImplementedError: a build failure like any other (the sm_100a GEMM)
    build_only = KernelLoader(Reasons(build=BUILD_FAILED))
    got = build_only.get(spec, "sm_100a", Counting(NotImplementedError("n")))
    assert got == Unsupported("building s for sm_100a failed (NotImplementedError: n)")
    with pytest.raises(KeyboardInterrupt):  # not an Exception: never caught
        build_only.get(Spec("t"), "sm_100a", Counting(KeyboardInterrupt()))


def test_an_arch_without_kernels_is_refused_before_loading() -> None:
    spec = Spec("s")
    load = Counting(None)
    loader: KernelLoader[Spec, object] = KernelLoader(FULL)
    got = loader.get(spec, "sm_80", load)
    assert got == Unsupported(f"no generated kernels for sm_80 (only {', '.join(ARCHS)})")
    assert ARCHS == ("sm_90a", "sm_100a") and load.calls == 0 and not loader.failed
    unchecked: KernelLoader[Spec, object] = KernelLoader(Reasons())
    assert not isinstance(unchecked.get(spec, "sm_80", load), Unsupported) and load.calls == 1


def test_log_once_logs_each_reason_once(caplog: pytest.LogCaptureFixture) -> None:
    log_once = LogOnce(logging.getLogger("fp4gen.test_loader"), "falls back: %s")
    with caplog.at_level(logging.INFO, logger="fp4gen.test_loader"):
        for reason in ("a", "b", "a", "b", "a"):
            log_once(reason)
    assert [r.getMessage() for r in caplog.records] == ["falls back: a", "falls back: b"]
    assert all(r.levelno == logging.INFO for r in caplog.records)
    assert log_once.seen == {"a", "b"}


def test_concurrent_calls_agree(caplog: pytest.LogCaptureFixture) -> None:
    """Threads asking at once get one object per (spec, arch), one remembered failure, and
    one log line per reason."""
    threads = 16
    barrier = threading.Barrier(threads)
    keeping: KernelLoader[Spec, object] = KernelLoader(FULL, keep_loaded=True)
    failing: KernelLoader[Spec, object] = KernelLoader(FULL)
    ok, bad = Spec("ok"), Spec("bad")
    log_once = LogOnce(logging.getLogger("fp4gen.test_loader"))
    results: list[tuple[object, object]] = []

    def load(spec: Spec, arch: str) -> object:
        if spec is bad:
            raise NotImplementedError("never")
        return object()

    def work() -> None:
        barrier.wait()
        got = keeping.get(ok, "sm_90a", load), failing.get(bad, "sm_90a", load)
        log_once(str(got[1]))
        results.append(got)

    with caplog.at_level(logging.INFO, logger="fp4gen.test_loader"):
        pool = [threading.Thread(target=work) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    assert len(results) == threads
    assert len({id(kept) for kept, _ in results}) == 1
    assert results[0][0] is keeping.loaded[(ok, "sm_90a")]
    assert len({id(failure) for _, failure in results}) == 1
    assert results[0][1] == Unsupported("the template cannot generate bad (never)")
    assert len(caplog.records) == 1


def test_every_backend_loads_through_a_kernel_loader() -> None:
    """The five backends word their failures as before, each through its own KernelLoader."""
    loaders = {
        m.__name__: m._loader
        for m in (cute_backend, mor_kernels, dequant, cute_gemm, blackwell_gemm)
    }
    assert all(isinstance(loader, KernelLoader) for loader in loaders.values())
    assert [name for name, loader in loaders.items() if loader.keep_loaded] == [dequant.__name__]
    spec = Spec("s")
    spec.rule = Spec("r")  # type: ignore[attr-defined]
    ni, ie, rt = NotImplementedError("n"), ImportError("i"), RuntimeError("r")

    def why(module: object, err: Exception) -> str | None:
        return module._loader.reasons.why(err, spec, "sm_90a")  # type: ignore[attr-defined]

    dsl = "the CuTe DSL cannot be imported (i)"
    built = "building s for sm_90a failed (RuntimeError: r)"
    assert why(cute_backend, ni) == "s is not supported by the kernel template yet (n)"
    assert why(mor_kernels, ni) == "MoR rule 'r' is not supported by the kernel template (n)"
    assert why(cute_backend, ie) == why(mor_kernels, ie) == dsl
    assert why(cute_backend, rt) is None and why(mor_kernels, rt) is None
    for module in (dequant, cute_gemm):
        assert why(module, ni) == "the template cannot generate s (n)"
        assert why(module, ie) == dsl and why(module, rt) == built
    assert why(blackwell_gemm, ie) == (
        "nvidia-cutlass-operators or the CuTe DSL cannot be imported (i)"
    )
    assert why(blackwell_gemm, ni) == "building s for sm_90a failed (NotImplementedError: n)"
    assert why(blackwell_gemm, rt) == built
    assert dequant._loader.get(spec, "sm_80", Counting(None)) == Unsupported(
        "no dequantize kernel for sm_80 (only sm_90a, sm_100a)"
    )
    assert cute_gemm._loader.reasons.arch is None and blackwell_gemm._loader.reasons.arch is None


def test_get_current_asks_for_the_current_gpus_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    from fp4gen.compiler import jit

    monkeypatch.setattr(jit, "detect_arch", lambda device=None: "sm_100a")
    seen: list[str] = []
    loader: KernelLoader[Spec, object] = KernelLoader(FULL)
    loader.get_current(Spec("s"), lambda spec, arch: seen.append(arch))
    assert seen == ["sm_100a"]


@pytest.fixture
def fresh_loaders(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backends' loaders with nothing remembered (restored after the test)."""
    for module in (cute_backend, mor_kernels, dequant, cute_gemm, blackwell_gemm):
        monkeypatch.setattr(module._loader, "loaded", {})
        monkeypatch.setattr(module._loader, "failed", {})
    monkeypatch.setattr(dequant, "_by_format", {})


def test_the_backends_report_a_failed_load_as_before(
    monkeypatch: pytest.MonkeyPatch, fresh_loaders: None
) -> None:
    """What each backend's caller sees when loading fails (no GPU needed: the load functions
    are replaced): the quantize and MoR lookups return the reason, the GEMM paths raise
    FP4GenError with it; a failure is not retried."""
    from fp4gen.compiler import jit
    from fp4gen.dsl import load_recipe
    from fp4gen.errors import FP4GenError
    from fp4gen.formats import BUILTIN_FORMATS
    from fp4gen.runtime import kernels
    from fp4gen.spec import MoRKernelSpec

    calls: list[object] = []

    def lacking(spec: object, arch: str) -> object:
        calls.append(spec)
        raise NotImplementedError("not yet")

    def failing(spec: object, arch: str) -> object:
        calls.append(spec)
        raise OSError("link failed")

    monkeypatch.setattr(jit, "detect_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(kernels, "kernels_for", lacking)
    nvfp4 = BUILTIN_FORMATS["nvfp4"]

    spec = cute_backend.spec_for(nvfp4, "nearest", None, torch.bfloat16)
    got = cute_backend._kernels(spec)
    assert got == Unsupported(f"{spec.name} is not supported by the kernel template yet (not yet)")
    assert cute_backend._kernels(spec) is got and calls == [spec]  # not retried

    with pytest.raises(
        FP4GenError, match=r"^the template cannot generate dequant_\S+ \(not yet\)$"
    ):
        dequant.kernels(nvfp4, "sm_90a")
    with pytest.raises(
        FP4GenError, match=r"^no dequantize kernel for sm_80 \(only sm_90a, sm_100a\)$"
    ):
        dequant.kernels(nvfp4, "sm_80")

    monkeypatch.setattr(kernels, "kernels_for", failing)
    with pytest.raises(
        FP4GenError,
        match=r"^the fused GEMM kernel is not available: building \S+ for sm_90a failed "
        r"\(OSError: link failed\)$",
    ):
        cute_gemm._plan(nvfp4, nvfp4, pick_tile(64), False, False, False, "sm_90a")

    monkeypatch.setattr(blackwell_gemm, "gemm_kernel", failing)
    mma = mma_plan(nvfp4, nvfp4)
    assert isinstance(mma, MmaPlan)
    config = gemm_config(mma, 64)
    got = blackwell_gemm._kernel_or_reason(config, "sm_100a")
    assert got == Unsupported(f"building {config.name} for sm_100a failed (OSError: link failed)")
    assert blackwell_gemm._kernel_or_reason(config, "sm_100a") is got

    monkeypatch.setattr(mor_kernels, "mor_kernels_for", lacking)
    rule = load_recipe("mor_tensor.fp4r").mors[0]
    got = mor_kernels._kernels(MoRKernelSpec(rule))
    assert got == Unsupported(
        f"MoR rule '{rule.name}' is not supported by the kernel template (not yet)"
    )
    monkeypatch.setattr(mor_kernels, "mor_kernels_for", failing)  # a build failure raises
    with pytest.raises(OSError, match="link failed"):
        mor_kernels._kernels(MoRKernelSpec(rule, "stochastic"))
    monkeypatch.setattr(jit, "detect_arch", lambda device=None: "sm_80")
    assert mor_kernels._kernels(MoRKernelSpec(rule)) == Unsupported(
        "no generated kernels for sm_80 (only sm_90a, sm_100a)"
    )  # an arch without kernels: refused before loading
