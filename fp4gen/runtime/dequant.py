"""Dequantize + cuBLAS: the large-M GEMM path on CUDA (``fp4gen.gemm(backend="dequant")``).

``dequantize_bf16(q)`` runs the generated dequantize kernel (``fp4gen.codegen.dequant``, compiled
and cached through ``kernels_for`` like the GEMM kernels) on a QuantizedTensor's codes and
scale codes: bf16 [R, Kp] holding element x block scale exactly (the global scale is not
applied; K zero-padded to a multiple of 8). ``dequant_gemm(a, b, ...)`` decodes both operands
(B's values are remembered per QuantizedTensor until its codes change: a weight is decoded once
per quantization), multiplies them with
cuBLASLt in one call (``fp4gen.runtime.cublaslt``: bf16 products are exact in fp32, fp32
accumulation; alpha = S_a * S_b read from device memory, no host sync; the bias and the
accumulation in its epilogue; the output dtype written directly). Where cuBLASLt does not serve a
call (logged once with the reason) ``torch.mm(..., out_dtype=torch.float32)`` multiplies and the
shared GEMM epilogue (``fp4gen.runtime.epilogue``: one elementwise pass, ``mul`` / ``addcmul``)
applies alpha, the bias, the accumulation and the output dtype. ``dequant_product`` says which
of them cuBLASLt applied; ``fp4gen.gemm`` finishes it like every backend's product.

Numerics: the fused kernels' contract (docs/numerics.md section 6): K exact products summed in
fp32 in cuBLAS's order, then y = fp32(acc * alpha) (+ bias) (+ C) rounded once to the output
dtype. cuBLASLt's epilogue and ``addcmul`` may fuse the multiply and the adds (one rounding
fewer); the GEMM tolerance covers both.

Formats: every pair whose element x block scale is exact in bf16 (``gemm_exact_in_bf16``) and
whose scales are codes of at most 8 bits: NVFP4 (1x16 and 16x16), MXFP4, MXFP6, MXFP8, exotic
eXmY elements with e4m3 or ueXm0 scales. ``support(fmt)`` says why not for the others.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import MutableMapping
from functools import lru_cache
from typing import Any

import torch

from fp4gen.codegen.dequant import UNIT, spec_for
from fp4gen.compiler.spec import DequantKernelSpec
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat
from fp4gen.numerics.quantize import tensor_version
from fp4gen.runtime import cublaslt
from fp4gen.runtime.checks import (
    PreparedA,
    check_accumulate,
    check_bias,
    check_pair,
    one_cuda_device,
)
from fp4gen.runtime.epilogue import GemmProduct, finish
from fp4gen.runtime.epilogue import apply_steps as epilogue  # the fallback's arithmetic
from fp4gen.runtime.fp32_matmul import ieee_fp32_matmul
from fp4gen.runtime.loader import KernelLoader, LogOnce, Reasons, Unsupported

log = logging.getLogger(__name__)

# (spec, arch) -> the loaded kernels (kept) or why they cannot be had (a build failure too)
_loader: KernelLoader[DequantKernelSpec, Any] = KernelLoader(
    Reasons.building(arch="no dequantize kernel for {arch} (only {archs})"), keep_loaded=True
)
# per-call lookups by format identity: id(format) -> (format, ...), at most _MAX_IDS entries
_by_format: dict[tuple[int, str, str], tuple[BlockFormat, Any]] = {}
_support_ids: dict[int, tuple[object, str | None]] = {}
_MAX_IDS = 256
_log_once = LogOnce(log)
# QuantizedTensor -> (versions of its codes and scale codes, bf16 values [R, Kp])
_values: weakref.WeakKeyDictionary[Any, tuple[tuple[int, int, int], torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
_MM_DTYPE: list[bool] = []  # [whether torch.mm(..., out_dtype=) exists], filled on first use


def support(fmt: BlockFormat | object) -> str | None:
    """None when the dequantize kernel serves this operand format, else why not."""
    hit = _support_ids.get(id(fmt))  # by identity: hashing a format costs microseconds
    if hit is not None and hit[0] is fmt:
        return hit[1]
    if not isinstance(fmt, BlockFormat):
        reason: str | None = "the operand is kept in high precision"
    else:
        spec = _spec(fmt)
        reason = spec if isinstance(spec, str) else None
    if len(_support_ids) >= _MAX_IDS:
        _support_ids.clear()
    _support_ids[id(fmt)] = (fmt, reason)  # the reference keeps the id valid
    return reason


@lru_cache(maxsize=256)
def _spec(fmt: BlockFormat, codes: str = "bytes") -> DequantKernelSpec | str:
    return spec_for(fmt, codes)


def kernels(fmt: BlockFormat, arch: str, codes: str = "bytes") -> Any:
    """The loaded dequantize kernels of ``fmt`` for ``arch`` reading ``codes`` ("bytes": one
    code per byte, "packed": two 4-bit codes per byte); FP4GenError with the reason when there
    are none."""
    hit = _by_format.get((id(fmt), arch, codes))
    if hit is not None and hit[0] is fmt:
        return hit[1]
    spec = _spec(fmt, codes)
    if isinstance(spec, str):
        raise FP4GenError(f"no dequantize kernel: {spec}")
    from fp4gen.runtime.kernels import kernels_for

    found = _loader.get(spec, arch, kernels_for)  # type: ignore[arg-type]
    if isinstance(found, Unsupported):
        raise FP4GenError(found.reason)
    if len(_by_format) >= _MAX_IDS:
        _by_format.clear()
    _by_format[(id(fmt), arch, codes)] = (fmt, found)
    return found


def dequantize_bf16(q: Any, *, arch: str | None = None) -> torch.Tensor:
    """bf16 [R, Kp] = element x block scale of the QuantizedTensor ``q`` (CUDA), Kp = K rounded
    up to a multiple of 8 (zeros past K). Bit for bit ``q.dequantize_blockwise()`` rounded to
    bf16 (exact for these formats). FP4GenError when no kernel serves ``q``'s format here."""
    if q.device.type != "cuda":
        raise TensorError(f"the dequantize kernel runs on CUDA tensors, got {q.device}")
    if arch is None:
        from fp4gen.compiler.jit import detect_arch

        arch = detect_arch()
    fmt = q.format
    sc = q.scale_codes
    if sc is None:
        raise TensorError(f"{fmt.name}: the dequantize kernel needs scale codes")
    packed = q.packed_codes() if fmt.element.bits == 4 else None
    if packed is not None:  # a kernel's packed codes, read as they are (no unpacking pass)
        k = kernels(fmt, arch, "packed")
        codes, rows, cols = packed.data, packed.data.shape[0], packed.cols
        code_cols = cols // 2
    else:
        k = kernels(fmt, arch)
        codes = q.codes
        rows, cols = codes.shape
        code_cols = cols
    br, bc = fmt.block
    if (  # the common case, checked with integer compares: launch without launch_args
        cols % UNIT == 0
        and codes.shape[1] == code_cols
        and codes.dtype == torch.uint8
        and sc.dtype == torch.uint8
        and codes.is_contiguous()
        and sc.is_contiguous()
        and codes.data_ptr() % 16 == 0
        and sc.device == codes.device
        and sc.shape == (-(-rows // br), -(-cols // bc))
        and rows * cols < 2**31
    ):
        out = torch.empty((rows, cols), dtype=torch.bfloat16, device=codes.device)
        if rows:
            k.fns["dequant"](codes, sc, out)
        return out
    return k.module.run(k.fns, codes, sc, cols=cols)  # validates, pads K, copies


def cached_bf16(q: Any, *, arch: str | None = None) -> torch.Tensor:
    """``dequantize_bf16(q)``, remembered per QuantizedTensor until its codes or scale codes
    change (a weight's values are decoded once per quantization)."""
    versions = (*q.code_version(), -1 if q.scale_codes is None else tensor_version(q.scale_codes))
    hit = _values.get(q)
    if hit is not None and hit[0] == versions:
        return hit[1]
    values = dequantize_bf16(q, arch=arch)
    _values[q] = (versions, values)
    return values


def is_cached(q: Any) -> bool:
    """Whether ``q``'s bf16 values are remembered (and current)."""
    hit = _values.get(q)
    if hit is None:
        return False
    sc = q.scale_codes
    return hit[0] == (*q.code_version(), -1 if sc is None else tensor_version(sc))


def _mm_fp32(va: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
    """va @ vb^T (bf16 [M, K], [N, K]) with fp32 accumulation and an fp32 result."""
    if not _MM_DTYPE:
        try:
            torch.mm(va[:1, :16], vb[:1, :16].t(), out_dtype=torch.float32)
            _MM_DTYPE.append(True)
        except (TypeError, RuntimeError, NotImplementedError) as err:
            _log_once(f"torch.mm(out_dtype=float32) is unavailable ({err}); fp32 GEMM instead")
            _MM_DTYPE.append(False)
    if _MM_DTYPE[0]:
        return torch.mm(va, vb.t(), out_dtype=torch.float32)
    with ieee_fp32_matmul():  # full fp32 products of the bf16 values
        return torch.mm(va.float(), vb.float().t())


def dequant_gemm(
    a: Any,
    b: Any,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    accumulate: torch.Tensor | None,
    arch: str,
    out: torch.Tensor | None = None,
    keep: MutableMapping[Any, PreparedDequantGemm] | None = None,
) -> torch.Tensor:
    """C = S_a S_b (A_q @ B_q^T) (+ bias) (+ accumulate) by dequantize kernels + cuBLAS:
    ``dequant_product`` finished by the shared epilogue (``fp4gen.gemm`` runs the same two)."""
    product = dequant_product(
        a, b, out_dtype=out_dtype, bias=bias, accumulate=accumulate, arch=arch, out=out, keep=keep
    )
    return finish(
        product, a, b, bias=bias, accumulate=accumulate, out_dtype=out_dtype, backend="dequant"
    )


def dequant_product(
    a: Any,
    b: Any,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    accumulate: torch.Tensor | None,
    arch: str,
    out: torch.Tensor | None = None,
    keep: MutableMapping[Any, PreparedDequantGemm] | None = None,
) -> GemmProduct:
    """C = S_a S_b (A_q @ B_q^T) (+ bias) (+ accumulate) by dequantize kernels + cuBLAS, as a
    GemmProduct: cuBLASLt applies alpha, the bias and accumulate in its epilogue and writes
    ``out_dtype``; where it declines, the fp32 product with nothing applied (the shared
    epilogue, ``fp4gen.runtime.epilogue.finish``, then applies them).

    ``a``, ``b``: QuantizedTensors on one CUDA device, quantized along K with the same RHT (or
    none), formats served by the dequantize kernel (FP4GenError otherwise). B's values are
    remembered per tensor (see ``cached_bf16``). ``accumulate`` is not modified. ``out``
    (contiguous [M, N] of ``out_dtype``, checked by ``fp4gen.gemm``): cuBLASLt writes the
    result there; the fallback's result is a new tensor. ``keep``: where a call without
    bias, accumulate or ``out`` leaves a ``PreparedDequantGemm`` for ``b`` once ``b`` is met a
    second time (``fp4gen.gemm``'s per-call path).
    """
    check_pair(a, b)
    one_cuda_device(a, b, "dequantize GEMM")
    kp = -(-a.cols // UNIT) * UNIT
    if max(a.rows, b.rows) * kp >= 2**31:
        raise FP4GenError("the dequantize kernel indexes with 32 bits (rows * K >= 2^31)")
    # a weight met before, multiplied as it is: the calls after this one are prepared
    preparing = (
        keep is not None and bias is None and accumulate is None and out is None and is_cached(b)
    )
    va = dequantize_bf16(a, arch=arch)
    vb = cached_bf16(b, arch=arch)
    dev = va.device
    ga, gb = a.global_scale, b.global_scale
    if ga.dtype != torch.float32 or ga.device != dev:
        ga = ga.to(device=dev, dtype=torch.float32)
    if gb.dtype != torch.float32 or gb.device != dev:
        gb = gb.to(device=dev, dtype=torch.float32)
    alpha = ga * gb  # one fp32 element: cuBLASLt reads it by pointer, the epilogue broadcasts it
    m, n = va.shape[0], vb.shape[0]
    # checked once here for both the cuBLASLt call and the fallback epilogue
    if bias is not None:
        check_bias(bias, n)
        bias = bias.detach()  # no autograd here
    if accumulate is not None:
        check_accumulate(accumulate, m, n)
        accumulate = accumulate.detach()
    on_device = all(t is None or t.device == dev for t in (bias, accumulate))
    if on_device:  # one cuBLASLt kernel: alpha, bias and C in its epilogue
        c = cublaslt.matmul(
            va, vb, alpha, out_dtype=out_dtype, bias=bias, accumulate=accumulate, out=out
        )
        if c is not None:
            if preparing:
                assert keep is not None
                keep[b] = PreparedDequantGemm(a, out_dtype, arch)
            return GemmProduct(c, scaled=True, bias=True, accumulated=True)
    return GemmProduct(_mm_fp32(va, vb), scaled=False)


class PreparedDequantGemm:
    """A dequantize + cuBLASLt call with one B, kept by ``dequant_gemm`` for the calls after it
    (a weight multiplied by new activations of one shape): what A must be for the call to be
    the prepared one. A call checks A's format (the same object), shape, RHT, device and the
    output dtype, and runs what ``dequant_gemm`` runs for them without its checks and lookups:
    A's dequantize kernel, B's remembered values (``cached_bf16`` follows B's versions) and
    one cuBLASLt call. It returns None where A differs (the caller then takes the full path,
    which checks, raises and prepares again)."""

    __slots__ = ("a", "arch")

    def __init__(self, a: Any, out_dtype: torch.dtype, arch: str) -> None:
        self.a, self.arch = PreparedA(a, out_dtype), arch

    def __call__(self, a: Any, b: Any, out_dtype: torch.dtype) -> torch.Tensor | None:
        """C = S_a S_b (A_q @ B_q^T) in ``out_dtype``, or None where this call is not the one
        prepared (``b``: the B it was prepared with, as the caller looked it up)."""
        if not self.a.matches(a, out_dtype):
            return None
        dev = self.a.device
        ga, gb = a.global_scale, b.global_scale
        if (
            ga.dtype != torch.float32
            or gb.dtype != torch.float32
            or ga.device != dev
            or gb.device != dev
        ):
            return None
        va = dequantize_bf16(a, arch=self.arch)
        vb = cached_bf16(b, arch=self.arch)
        alpha = ga * gb
        c = cublaslt.matmul(va, vb, alpha, out_dtype=out_dtype)
        return c if c is not None else epilogue(_mm_fp32(va, vb), alpha, None, None, out_dtype)


__all__ = [
    "PreparedDequantGemm",
    "cached_bf16",
    "dequant_gemm",
    "dequant_product",
    "dequantize_bf16",
    "epilogue",
    "is_cached",
    "kernels",
    "support",
]
