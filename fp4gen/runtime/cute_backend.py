"""The ``cute`` backend of ``fp4gen.quantize``: generated kernels -> a QuantizedTensor.

``quantize(x, fmt, ..., backend="cute")`` quantizes with the generated kernel of the matching
single-output rowwise spec (``kernels_for``) and builds the same QuantizedTensor as the reference:
the kernel's packed codes (unpacked on first read of ``codes``; the GEMM paths read them packed),
the scale codes (decoded on first read of ``scales``), S_dec as a 0-dim fp32 tensor. Non-finite
inputs raise TensorError (``fp4gen.runtime.finite``). ``backend="auto"`` takes this path for
CUDA tensors whose spec and shape the kernels support, and otherwise stays on the reference
(logged once per reason at INFO).

``quantize_tile_cute(x, fmt, outputs, ...)`` quantizes a tensor rowwise and/or columnwise (the
columnwise copy being the rowwise quantization of ``x.t()``, each copy with its own rounding, RHT
and Philox offset) in one launch of the tile kernel, reading ``x`` once and never transposing
it: what a linear layer's backward pass needs for the gradient (dgrad rowwise, wgrad
columnwise) and the activation (wgrad columnwise).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from fp4gen.compiler.spec import InputDType, QuantKernelSpec, QuantOutput
from fp4gen.dsl.model import RHTSpec
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat
from fp4gen.runtime import finite

log = logging.getLogger("fp4gen.runtime")

_DTYPES: dict[torch.dtype, InputDType] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
}
_unsupported: dict[QuantKernelSpec, str] = {}  # spec -> why the template cannot make it
_logged: set[str] = set()
_lock = threading.Lock()


def spec_for(
    fmt: BlockFormat, rounding: str, rht: RHTSpec | None, dtype: torch.dtype
) -> QuantKernelSpec:
    """The single-output rowwise kernel spec that quantizes like ``quantize`` does."""
    return _spec(fmt, dtype, (QuantOutput("rowwise", rounding, rht),))  # type: ignore[arg-type]


def _spec(
    fmt: BlockFormat, dtype: torch.dtype, outputs: tuple[QuantOutput, ...]
) -> QuantKernelSpec:
    """The kernel spec writing ``outputs`` of a ``dtype`` tensor in format ``fmt``."""
    if dtype not in _DTYPES:
        raise TensorError(
            f"cannot quantize a {dtype} tensor: expected float32, bfloat16 or float16"
        )
    return QuantKernelSpec(
        element=fmt.element,
        block=fmt.block,
        scale=fmt.scale,
        global_scale=fmt.global_scale,
        input_dtype=_DTYPES[dtype],
        outputs=outputs,
    )


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        log.info("quantize(backend='auto') uses the reference: %s", reason)


def _kernels(spec: QuantKernelSpec) -> Any:
    """kernels_for(spec), or the reason the generated kernels cannot serve it (a str)."""
    reason = _unsupported.get(spec)
    if reason is not None:
        return reason
    from fp4gen.compiler.jit import ARCHS, detect_arch
    from fp4gen.runtime.kernels import kernels_for

    arch = detect_arch()
    if arch not in ARCHS:
        return f"no generated kernels for {arch} (only {', '.join(ARCHS)})"
    try:
        return kernels_for(spec, arch)
    except NotImplementedError as err:
        reason = f"{spec.name} is not supported by the kernel template yet ({err})"
    except ImportError as err:
        reason = f"the CuTe DSL cannot be imported ({err})"
    with _lock:
        _unsupported[spec] = reason
    return reason


def quantize_cute(
    x: torch.Tensor,
    fmt: BlockFormat,
    *,
    rounding: str,
    rht: RHTSpec | None,
    seed: int,
    offset: int,
    required: bool,
) -> Any:
    """A QuantizedTensor from the generated kernels; None when ``required`` is False and the
    kernels cannot serve this call (the caller then runs the reference)."""

    def unavailable(reason: str) -> None:
        if required:
            raise FP4GenError(
                f"the 'cute' backend (generated CuTe DSL kernels) is not available: {reason}"
            )
        _log_once(reason)

    if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
        where = x.device if isinstance(x, torch.Tensor) else type(x).__name__
        return unavailable(f"it runs on CUDA tensors, got a tensor on {where}")
    if x.dtype not in _DTYPES or x.numel() == 0:
        return None if not required else _reference_error(x)
    spec = spec_for(fmt, rounding, rht, x.dtype)
    kernels = _kernels(spec)
    if isinstance(kernels, str):
        return unavailable(kernels)

    x2 = x.reshape(1, -1) if x.dim() <= 1 else x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.contiguous() if not x2.is_contiguous() else x2.clone()
    check = getattr(kernels.module, "check_input", None)
    if check is not None:
        try:
            check(x2)
        except TensorError as err:
            if required:
                raise
            _log_once(f"{spec.name} does not take this input ({err})")
            return None
    flag = finite.check(x2, f"the input of shape {tuple(x.shape)}")

    out = kernels.run(x2, seed=seed, offset=offset)
    cols = x2.shape[1]
    return _quantized(out, "", fmt, cols, rounding, rht, seed, offset, x.shape, x.dtype, flag)


def _quantized(
    out: dict[str, torch.Tensor],
    prefix: str,
    fmt: BlockFormat,
    cols: int,
    rounding: str,
    rht: RHTSpec | None,
    seed: int,
    offset: int,
    shape: torch.Size,
    dtype: torch.dtype,
    finite_flag: torch.Tensor | None = None,
) -> Any:
    """The QuantizedTensor of one copy a generated module's ``run`` wrote (its outputs named
    ``prefix`` + "data", "scales", "global_scale"; ``cols`` values per row)."""
    from fp4gen.numerics.quantize import PackedCodes, QuantizedTensor

    scales = out[prefix + "scales"]
    data = out[prefix + "data"]
    bits = fmt.element.bits
    coded_scales = fmt.scale.element is not None
    # codes and scale values are derived on first read: the GEMM paths read the packed codes
    # and the scale codes, so a training step never materializes them
    return QuantizedTensor(
        codes=data if bits == 8 else None,
        packed=None if bits == 8 else PackedCodes(data, cols, bits),
        scales=None if coded_scales else scales.to(torch.float32),
        scale_codes=scales if coded_scales else None,
        # NaN when the input was not all finite and the caller propagates that (finite.py)
        global_scale=finite.poison(out[prefix + "global_scale"].reshape(()), finite_flag).to(
            torch.float32
        ),
        format=fmt,
        rounding=rounding,
        rht=rht,
        seed=seed,
        offset=offset,
        shape=shape,
        dtype=dtype,
    )


TileOutput = tuple[str, str, RHTSpec | None, int]  # (direction, rounding, rht, Philox offset)


def quantize_tile_cute(
    x: torch.Tensor, fmt: BlockFormat, outputs: tuple[TileOutput, ...], *, seed: int
) -> tuple[Any, ...] | None:
    """QuantizedTensors of the copies ``outputs`` of the 2-D CUDA tensor ``x`` (1D blocks), from
    one tile kernel: a rowwise copy equals ``quantize(x, ...)``, a columnwise one
    ``quantize(x.t().contiguous(), ...)``, bit for bit. None when the kernels cannot serve the
    call (no GPU kernels, a shape the tile kernel does not take: the caller quantizes the copies
    one by one); TensorError for non-finite values."""
    if x.device.type != "cuda" or x.dim() != 2 or x.dtype not in _DTYPES or fmt.is_2d:
        return None
    if x.numel() == 0 or not x.is_contiguous() or x.data_ptr() % 16:
        return None
    copies = tuple(QuantOutput(d, r, h) for d, r, h, _ in outputs)  # type: ignore[arg-type]
    spec = _spec(fmt, x.dtype, copies)
    kernels = _kernels(spec)
    if isinstance(kernels, str):
        _log_once(kernels)
        return None
    try:
        kernels.module.check_input(x)
    except TensorError as err:
        _log_once(f"{spec.name} does not take this input ({err}); the copies run one by one")
        return None
    flag = finite.check(x, f"the input of shape {tuple(x.shape)}")  # once for every copy

    out = kernels.module.run(kernels.fns, x, seed=seed, offset=tuple(o for *_, o in outputs))
    rows, cols = x.shape
    # a columnwise copy is the rowwise quantization of x.t(): [cols, rows]
    copies = {"rowwise": ("", cols, (rows, cols)), "columnwise": ("col_", rows, (cols, rows))}
    result = []
    for direction, rounding, rht, offset in outputs:
        prefix, n, shape = copies[direction]
        result.append(
            _quantized(
                out, prefix, fmt, n, rounding, rht, seed, offset, torch.Size(shape), x.dtype, flag
            )
        )
    return tuple(result)


def _reference_error(x: torch.Tensor) -> None:
    """Raise the reference quantizer's error for an input it rejects."""
    from fp4gen.numerics.quantize import _as_2d_float32

    _as_2d_float32(x)
    raise TensorError(f"cannot quantize a tensor of shape {tuple(x.shape)} and dtype {x.dtype}")


__all__ = ["quantize_cute", "quantize_tile_cute", "spec_for"]
