"""``fp4gen.quantize(..., backend="cute")``: the generated kernels behind fp4gen's quantize API.

GPU tests (marker ``gpu``, skipped without CUDA): the kernels are bit-exact with the reference
through ``quantize``; ``kernels_for`` compiles once and a fresh process loads the kernels from the
cache without compiling (also from a cache filled on another machine, FP4GEN_PREBUILT_CACHE).
The CPU tests cover the dispatch: what runs where and what is reported.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fp4gen.compiler.spec import QuantKernelSpec, QuantOutput
from fp4gen.dsl.model import RHTSpec
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BUILTIN_FORMATS
from fp4gen.runtime import cute_backend
from fp4gen.runtime.quantize_dispatch import quantize

ROOT = Path(__file__).resolve().parent.parent


def pythonpath() -> str:
    """The checkout first, then whatever the environment had (installed dependencies)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


CUDA = torch.cuda.is_available()

NVFP4 = BUILTIN_FORMATS["nvfp4"]
MXFP8 = BUILTIN_FORMATS["mxfp8_e4m3"]
MXFP4 = BUILTIN_FORMATS["mxfp4"]

# (format, rounding, hadamard) of the operands of the shipped recipes, rowwise
CASES = {
    "nvfp4_rne": (NVFP4, "nearest", None),
    "nvfp4_sr": (NVFP4, "stochastic", None),
    "nvfp4_rht16_rne": (NVFP4, "nearest", 16),
    "nvfp4_rht16_sr": (NVFP4, "stochastic", 16),
    "mxfp8_e4m3": (MXFP8, "nearest", None),
    "mxfp4_rht32_sr": (MXFP4, "stochastic", RHTSpec(32, "seeded", None, 0)),
}


# ----------------------------------------------------------------------------------------------
# CPU: dispatch
# ----------------------------------------------------------------------------------------------


def test_spec_for_matches_quantize_arguments() -> None:
    spec = cute_backend.spec_for(NVFP4, "stochastic", RHTSpec(16), torch.bfloat16)
    assert spec == QuantKernelSpec(
        NVFP4.element,
        (1, 16),
        NVFP4.scale,
        True,
        "bf16",
        (QuantOutput("rowwise", "stochastic", RHTSpec(16)),),
    )
    assert cute_backend.spec_for(MXFP8, "nearest", None, torch.float32).input_dtype == "fp32"
    with pytest.raises(TensorError, match="int32"):
        cute_backend.spec_for(NVFP4, "nearest", None, torch.int32)


def test_cute_needs_cuda_tensors() -> None:
    with pytest.raises(FP4GenError, match="'cute' backend .* runs on CUDA tensors, got .* cpu"):
        quantize(torch.ones(4, 32), "nvfp4", backend="cute")


def test_auto_on_cpu_stays_on_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a, **k):
        raise AssertionError("the cute backend must not be consulted for CPU tensors")

    monkeypatch.setattr(cute_backend, "quantize_cute", boom)
    q = quantize(torch.ones(4, 32), "nvfp4", backend="auto")
    assert q.codes.device.type == "cpu"


# ----------------------------------------------------------------------------------------------
# GPU: bit-exact through quantize()
# ----------------------------------------------------------------------------------------------


def assert_same(a, b) -> None:
    assert torch.equal(a.codes.cpu(), b.codes.cpu())
    assert torch.equal(a.scales.cpu().view(torch.int32), b.scales.cpu().view(torch.int32))
    if b.scale_codes is None:
        assert a.scale_codes is None
    else:
        assert torch.equal(a.scale_codes.cpu(), b.scale_codes.cpu())
    assert a.global_scale.shape == b.global_scale.shape == ()
    assert a.global_scale.cpu().view(torch.int32) == b.global_scale.cpu().view(torch.int32)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert (a.rounding, a.rht, a.seed, a.offset) == (b.rounding, b.rht, b.seed, b.offset)
    assert torch.equal(a.dequantize().cpu(), b.dequantize().cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("shape", [(1, 64), (272, 320), (3, 40, 128)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cute_equals_reference_bit_for_bit(name: str, shape, dtype) -> None:
    fmt, rounding, hadamard = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = (torch.randn(shape, device="cuda", generator=gen) * 3).to(dtype)
    x.view(-1)[7] = 0.0  # a zero and a tiny value in the first block
    x.view(-1)[9] = 1e-30
    kw = dict(rounding=rounding, hadamard=hadamard, seed=1234, offset=5)
    got = quantize(x, fmt, backend="cute", **kw)
    want = quantize(x, fmt, backend="reference", **kw)
    assert got.codes.is_cuda
    assert_same(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_auto_uses_kernels_when_supported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []
    real = cute_backend.quantize_cute

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cute_backend, "quantize_cute", spy)
    monkeypatch.setattr(cute_backend._log_once, "seen", set())
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    assert_same(quantize(x, "nvfp4"), quantize(x, "nvfp4", backend="reference"))
    assert calls == [True]
    # 2D blocks: the tile kernel (rowwise copy of 16x16 tiles), bit-exact, nothing logged
    with caplog.at_level(logging.INFO, logger="fp4gen.runtime"):
        for _ in range(2):
            q = quantize(x, "nvfp4", block=(16, 16))
            assert q.codes.is_cuda
            assert_same(q, quantize(x, "nvfp4", block=(16, 16), backend="reference"))
    assert calls == [True, True, True]
    assert not [r for r in caplog.records if r.name == "fp4gen.runtime"]
    # a shape the kernel does not take (K not a multiple of 16): zero-padded to whole blocks,
    # which is exact, so "auto" and "cute" both give the reference's bits
    odd = torch.randn(4, 24, device="cuda")
    want = quantize(odd, "nvfp4", backend="reference")
    assert_same(quantize(odd, "nvfp4"), want)
    assert_same(quantize(odd, "nvfp4", backend="cute"), want)
    # an RHT of 16 along K = 24 cannot be padded exactly: "cute" says why it refuses
    with pytest.raises(TensorError, match="K must be a multiple of"):
        quantize(odd, "nvfp4", hadamard=16, backend="cute")
    w = torch.randn(1000, 64, device="cuda")  # 2D tiles with M not a multiple of 16
    assert_same(
        quantize(w, "nvfp4", block=(16, 16), backend="cute"),
        quantize(w, "nvfp4", block=(16, 16), backend="reference"),
    )
    # the reference's input checks hold for the kernels too
    bad = x.clone()
    bad[3, 5] = float("nan")
    with pytest.raises(TensorError, match="1 non-finite value"):
        quantize(bad, "nvfp4", backend="cute")


# ----------------------------------------------------------------------------------------------
# GPU: compiled once, loaded from the cache in a new process
# ----------------------------------------------------------------------------------------------

SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    from fp4gen.compiler.cache import KernelCache
    from fp4gen.runtime import cute_backend, kernels_for
    from fp4gen.formats import BUILTIN_FORMATS
    from fp4gen.numerics import quantize

    fmt = BUILTIN_FORMATS["nvfp4"]
    spec = cute_backend.spec_for(fmt, "stochastic", None, torch.bfloat16)
    t1 = time.perf_counter()
    k = kernels_for(spec)
    t2 = time.perf_counter()
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    out = k.run(x, seed=7)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    ref = quantize(x, fmt, rounding="stochastic", seed=7)
    same = bool(torch.equal(out["data"], ref.data)) and bool(
        torch.equal(out["scales"], ref.scale_codes))
    print(json.dumps({"compiled": k.stats.compiled, "loaded": k.stats.loaded, "same": same,
                      "imports": t1 - t0, "kernels_for": t2 - t1, "first_run": t3 - t2,
                      "arch": k.arch, "cache": str(KernelCache().root)}))
    """
)


def script_env(cache: Path) -> dict[str, str]:
    """The environment of a fresh process using the kernel cache ``cache`` and the CuTe DSL's
    file cache in it. CUTE_DSL_CACHE_DIR is given too: fp4gen sets it in ``os.environ`` to the
    first kernel cache this process compiled into (``jit.use_cache_for_dsl``), which under
    pytest-xdist is another test's."""
    return {
        **os.environ,
        "FP4GEN_CACHE_DIR": str(cache),
        "CUTE_DSL_CACHE_DIR": str(cache / "cute-dsl"),
        "PYTHONPATH": pythonpath(),
    }


def run_script(cache: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        env=script_env(cache),
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_fresh_process_loads_from_the_cache(tmp_path: Path) -> None:
    first = run_script(tmp_path / "cache")
    assert first["compiled"] == 2 and first["loaded"] == 0 and first["same"]
    second = run_script(tmp_path / "cache")
    assert second["compiled"] == 0 and second["loaded"] == 2 and second["same"]
    # the counts are the property; the times are reported, not asserted (they vary by machine)
    print(f"\ncold kernels_for {first['kernels_for']:.3f}s, warm {second['kernels_for']:.3f}s")


@pytest.mark.gpu
@pytest.mark.skipif(
    not CUDA or not os.environ.get("FP4GEN_PREBUILT_CACHE"),
    reason="needs a CUDA GPU and FP4GEN_PREBUILT_CACHE (a cache filled by fp4gen compile)",
)
def test_cache_built_elsewhere_loads_without_compiling(tmp_path: Path) -> None:
    """A cache filled on a CPU build machine (``fp4gen compile``) serves this GPU machine."""
    import shutil

    from fp4gen.compiler.cache import KernelCache, toolchain

    cache = tmp_path / "prebuilt"
    shutil.copytree(os.environ["FP4GEN_PREBUILT_CACHE"], cache)
    parts = KernelCache(cache).entries()[0].meta["parts"]
    here = toolchain()
    differ = {k: (parts.get(k), v) for k, v in here.items() if parts.get(k) != v}
    if differ:
        pytest.skip(f"the cache was built with another toolchain (built, here): {differ}")
    result = run_script(cache)
    assert result["compiled"] == 0 and result["loaded"] == 2 and result["same"], result


def test_a_refused_input_keeps_no_frame_or_tensor_of_its_call_alive(monkeypatch) -> None:
    """The kept launch of an input its kernel refuses (``_Launch.refused``) holds the check's
    message, not its error: an error's traceback would keep the frames of the call that met it
    alive, and with them that call's tensors (under torch.compile's reduce-overhead, a layer's
    quantized operands held in the CUDA graph's pool past the graph: the warm-up then failed).
    ``required`` raises a fresh TensorError with the same message."""
    import gc
    import weakref

    class Module:
        @staticmethod
        def check_input(x):
            raise TensorError(f"a refused input of shape {tuple(x.shape)}")

    class Loaded:
        module = Module()

    monkeypatch.setattr(cute_backend, "_kernels", lambda spec: Loaded())
    monkeypatch.setattr(cute_backend, "_launches", {})
    fmt = BUILTIN_FORMATS["nvfp4"]

    def caller() -> weakref.ref:
        held = torch.ones(4)  # a tensor of the calling frame
        launch = cute_backend._launch(fmt, (("rowwise", "nearest", None),), torch.ones(8, 32))
        assert launch.refused == "a refused input of shape (8, 32)"
        return weakref.ref(held)

    ref = caller()
    gc.collect()
    assert ref() is None
