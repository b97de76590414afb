"""The checks and input shaping the kernel backends make before a launch, written once.

GEMM backends (``cute_gemm``, ``dequant``, ``blackwell_gemm``, ``gemm_dispatch``): the operand
pair's K and RHT, one CUDA device, the shapes of ``bias``, ``accumulate`` and ``out``; their
messages are the backends' own (the oracle's, in ``numerics.gemm``, say more); ``PreparedA``,
what a prepared call's activation must be. Quantize backends
(``cute_backend``, ``mor_kernels``): why a tensor is not a CUDA input, the 2D view a kernel
launch reads, and the error or log line when the kernels do not serve a call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fp4gen.errors import FP4GenError, TensorError
from fp4gen.numerics.quantize import QuantizedTensor


def check_pair(a: Any, b: Any) -> None:
    """TensorError unless QuantizedTensors ``a`` [M, K] and ``b`` [N, K] share K and the RHT."""
    if a.cols != b.cols:
        raise TensorError(f"K mismatch: a is [{a.rows}, {a.cols}] and b is [{b.rows}, {b.cols}]")
    if a.rht != b.rht:
        raise TensorError("the operands carry different Hadamard transforms")


class PreparedA:
    """What A must be for a prepared GEMM call (``cute_gemm.PreparedGemm``,
    ``dequant.PreparedDequantGemm``) to be the call it was prepared for: a QuantizedTensor of
    the same format object, shape, RHT and device, with the same output dtype asked. Together
    with B (the prepared call's key) that is everything the full path checked."""

    __slots__ = ("format", "rows", "cols", "rht", "device", "out_dtype")

    def __init__(self, a: Any, out_dtype: torch.dtype) -> None:
        self.format, self.rows, self.cols = a.format, a.rows, a.cols
        self.rht, self.device, self.out_dtype = a.rht, a.device, out_dtype

    def matches(self, a: Any, out_dtype: torch.dtype) -> bool:
        return (
            isinstance(a, QuantizedTensor)
            and a.format is self.format
            and out_dtype == self.out_dtype
            and a.rows == self.rows
            and a.cols == self.cols
            and a.device == self.device
            and (a.rht is self.rht or a.rht == self.rht)
        )


def one_cuda_device(a: Any, b: Any, gemm: str) -> torch.device:
    """The CUDA device both operands are on; TensorError naming ``gemm`` otherwise."""
    dev = a.device
    if dev.type != "cuda" or b.device != dev:
        raise TensorError(f"the {gemm} needs both operands on one CUDA device: {dev}, {b.device}")
    return dev


def check_bias(bias: torch.Tensor | None, n: int) -> None:
    """TensorError unless ``bias`` is None or has shape [N]."""
    if bias is not None and tuple(bias.shape) != (n,):
        raise TensorError(f"bias must have shape [{n}], got {tuple(bias.shape)}")


def check_out(out: torch.Tensor, m: int, n: int, dtype: torch.dtype, device: torch.device) -> None:
    """TensorError unless ``out`` can take an [m, n] product of ``dtype`` on ``device``."""
    if (
        tuple(out.shape) != (m, n)
        or out.dtype != dtype
        or out.device != device
        or not out.is_contiguous()
    ):
        raise TensorError(
            f"out must be a contiguous [{m}, {n}] {dtype} tensor on {device}; got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
            + ("" if out.is_contiguous() else ", not contiguous")
        )


def check_accumulate(accumulate: torch.Tensor | None, m: int, n: int) -> None:
    """TensorError unless ``accumulate`` is None or has the product's shape [M, N]."""
    if accumulate is not None and tuple(accumulate.shape) != (m, n):
        raise TensorError(f"accumulate has shape {tuple(accumulate.shape)}, the product {(m, n)}")


def not_cuda(x: object) -> str | None:
    """Why ``x`` is no input of the CUDA kernels (not a CUDA tensor), or None."""
    if isinstance(x, torch.Tensor) and x.device.type == "cuda":
        return None
    where = x.device if isinstance(x, torch.Tensor) else type(x).__name__
    return f"it runs on CUDA tensors, got a tensor on {where}"


def launch_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the 2D row-major tensor a quantize launch reads: [1, numel] for 0D/1D inputs,
    else [rows, last dim]; copied when it is not contiguous or not 16-byte aligned (the kernels'
    vector loads)."""
    x2 = x.reshape(1, -1) if x.dim() <= 1 else x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.contiguous() if not x2.is_contiguous() else x2.clone()
    return x2


def served_by_reference(
    reason: str, *, required: bool, kernels: str, log_once: Callable[[str], None]
) -> None:
    """The generated ``kernels`` do not serve a call: FP4GenError when the caller ``required``
    them (backend="cute"), else ``reason`` is logged once and the caller runs the reference."""
    if required:
        raise FP4GenError(f"the 'cute' backend ({kernels}) is not available: {reason}")
    log_once(reason)


__all__ = [
    "PreparedA",
    "check_accumulate",
    "check_bias",
    "check_out",
    "check_pair",
    "launch_rows",
    "not_cuda",
    "one_cuda_device",
    "served_by_reference",
]
