"""The generated MoR kernels behind ``mor_quantize``: compile / load them, run them, build the
``MoRTensor``.

``mor_kernels_for(spec, arch)`` renders the rule's module (``fp4gen.codegen.mor``), compiles each
kernel for the arch (the current GPU's by default) into the kernel cache and loads it; later calls
in the process return the same object. ``mor_quantize_cute`` runs them on a CUDA tensor and wraps
the outputs in the same ``MoRTensor`` the reference returns (bit for bit: decisions, codes, scales,
error sums). ``mor_quantize(backend="auto")`` (``fp4gen.runtime.quantize_dispatch``) takes this
path for CUDA tensors the kernels support and otherwise stays on the reference, logged once per
reason at INFO.

Everything is launched on the current stream without a host round trip; the one read-back is the
input check shared with ``quantize`` (non-finite values raise ``TensorError``), taken from the
tensor amax the first kernel computes anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from fp4gen.codegen.mor import MoRKernelSpec, render
from fp4gen.compiler import jit
from fp4gen.compiler.cache import KernelCache, default_root
from fp4gen.dsl.model import MoRSpec, RHTSpec
from fp4gen.errors import TensorError
from fp4gen.formats import ElementFormat
from fp4gen.runtime.checks import launch_rows, not_cuda, served_by_reference
from fp4gen.runtime.loader import KernelLoader, LogOnce, Reasons, Unsupported

log = logging.getLogger("fp4gen.runtime")

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
FP32_INF_BITS = 0x7F800000


@dataclass(eq=False)
class LoadedMoRKernels:
    """The loaded kernels of one MoR spec for one arch (name -> TVM-FFI function)."""

    spec: MoRKernelSpec
    arch: str
    module: ModuleType
    fns: dict[str, Callable[..., Any]]
    source_path: Path
    compiled: int = 0  # kernels compiled by the call that loaded them (the rest came cached)
    seconds: float = 0.0

    def run(self, x: torch.Tensor) -> dict[str, Any]:
        return self.module.run(self.fns, x)


_loaded: dict[tuple[MoRKernelSpec, str, str], LoadedMoRKernels] = {}
_latest: dict[tuple[MoRKernelSpec, str], LoadedMoRKernels] = {}  # whatever cache they came from
_lock = threading.RLock()
# (spec, arch) -> the loaded kernels or why the template cannot make them
_loader: KernelLoader[MoRKernelSpec, LoadedMoRKernels] = KernelLoader(
    Reasons.falling_back(
        "MoR rule '{spec.rule.name}' is not supported by the kernel template ({err})"
    )
)
_log_once = LogOnce(log, "mor_quantize(backend='auto') uses the reference: %s")


def mor_kernels_for(
    spec: MoRKernelSpec, arch: str | None = None, *, cache: KernelCache | None = None
) -> LoadedMoRKernels:
    """The loaded MoR kernels of ``spec`` for ``arch`` (default: the current CUDA device's).

    Raises NotImplementedError when the template does not cover the rule."""
    arch = arch or jit.detect_arch()
    root = str(cache.root) if cache is not None else str(default_root())
    memo = (spec, arch, root)
    found = _loaded.get(memo)
    if found is not None:
        return found
    cache = cache or KernelCache(root)
    with _lock:
        found = _loaded.get(memo)
        if found is not None:
            return found
        start = time.perf_counter()
        jit.use_cache_for_dsl(cache)
        source = render(spec)
        source_path = cache.store_source(source)
        module = jit.import_source(source_path)
        fns = {}
        compiled = 0
        for name in jit.kernel_names(source):
            built = jit.build_kernel(cache, source_path, name, arch)
            fns[name] = jit.load_entry(built.entry)
            compiled += int(built.built)
        loaded = LoadedMoRKernels(
            spec, arch, module, fns, source_path, compiled, time.perf_counter() - start
        )
        _loaded[memo] = _latest[(spec, arch)] = loaded
        return loaded


def _load(spec: MoRKernelSpec, arch: str) -> LoadedMoRKernels:
    """The kernels mor_kernels_for loaded already for (spec, arch) from any cache, else
    mor_kernels_for(spec, arch)."""
    found = _latest.get((spec, arch))
    return found if found is not None else mor_kernels_for(spec, arch)


def _kernels(spec: MoRKernelSpec) -> LoadedMoRKernels | Unsupported:
    """mor_kernels_for(spec) for the current GPU's arch, or why the generated kernels cannot
    serve it (an Unsupported)."""
    return _loader.get_current(spec, _load)


def mor_quantize_cute(
    x: torch.Tensor,
    rule: MoRSpec,
    *,
    rounding: str,
    rht: RHTSpec | None,
    seed: int,
    offset: int,
    group: tuple[int, int] | None,
    required: bool,
) -> Any:
    """A MoRTensor from the generated kernels; None when ``required`` is False and the kernels
    cannot serve this call (the caller then runs the reference, which also raises for inputs
    nobody takes)."""

    unavailable = partial(
        served_by_reference, required=required, kernels="generated MoR kernels", log_once=_log_once
    )
    refusal = not_cuda(x)
    if refusal is not None:
        return unavailable(refusal)
    if x.dtype not in _DTYPES or x.numel() == 0:
        return None  # the reference raises the input error
    if rht is not None:
        return unavailable("an operand with an RHT (the MoR kernels do not transform)")
    if group is not None:
        return unavailable(f"a GAM group {group} (the kernels take one group per tensor)")
    spec = MoRKernelSpec(rule, rounding, _DTYPES[x.dtype])  # type: ignore[arg-type]
    kernels = _kernels(spec)
    if isinstance(kernels, Unsupported):
        return unavailable(kernels.reason)

    x2 = launch_rows(x)
    try:
        kernels.module.check_input(x2)
    except TensorError as err:
        if required:
            raise
        _log_once(f"{spec.name} does not take this input ({err})")
        return None
    return run_kernels(kernels, x2, shape=x.shape, dtype=x.dtype, seed=seed, offset=offset)


def run_kernels(
    kernels: LoadedMoRKernels,
    x2: torch.Tensor,
    *,
    shape: torch.Size | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    offset: int = 0,
) -> Any:
    """Run loaded MoR kernels on the 2-D CUDA tensor x2 (as their ``check_input`` takes it) and
    wrap the outputs in a MoRTensor (``shape`` / ``dtype``: the original input's, default
    x2's). Raises TensorError for non-finite inputs (the one read-back)."""
    from fp4gen.numerics.mor import MoRScales, MoRTensor, partition_block, representations
    from fp4gen.numerics.quantize import _check_finite

    rule, rounding = kernels.spec.rule, kernels.spec.rounding
    out = kernels.run(x2)
    if int(out["amax"][-1]) >= FP32_INF_BITS:  # the tensor's amax: the one read-back
        _check_finite(x2, f"the input of shape {tuple(shape or x2.shape)}")

    rows, cols = x2.shape
    block = partition_block(rule.scale, rows, cols)
    nbr, nbc = out["encode"].shape[1:]
    evaluated = representations(rule)
    elements = [f for f in evaluated if isinstance(f, ElementFormat)]
    scales: list[MoRScales | None] = []
    for cand in rule.candidates:
        if not isinstance(cand.format, ElementFormat):
            scales.append(None)
            continue
        i = elements.index(cand.format)
        scales.append(
            MoRScales(
                element=cand.format,
                scaling=rule.scaling,
                block=block,
                group=(nbr * block[0], nbc * block[1]),
                encode=out["encode"][i],
                decode=out["decode"][i],
                exponent=None if rule.scaling == "amax" else out["exponent"][i],
                mantissa=out["mantissa"][i].reshape(1, 1) if rule.scaling == "gam" else None,
            )
        )
    high = out["high"]
    if high is None:  # no high-precision candidate: nothing is ever kept there
        high = torch.zeros((), dtype=torch.float32, device=x2.device).expand(rows, cols)
    return MoRTensor(
        spec=rule,
        choice=out["choice"],
        codes=out["codes"],
        high=high,
        scales=tuple(scales),
        evaluated=evaluated,
        error_sum=out["error_sum"],
        nonzero=out["nonzero"],
        unit=partition_block(rule.decide, rows, cols),
        rounding=rounding,
        rht=None,
        seed=seed,
        offset=offset,
        shape=shape if shape is not None else x2.shape,
        dtype=dtype if dtype is not None else x2.dtype,
    )


__all__ = ["LoadedMoRKernels", "mor_kernels_for", "mor_quantize_cute", "run_kernels"]
