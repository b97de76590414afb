"""The ``cute`` backend of ``fp4gen.gemm``: the generated fused dequantizing GEMM (Hopper, sm_90a).

``fused_gemm(a, b, ...)`` picks the GemmKernelSpec of the operand pair (formats, block shapes,
output dtype, bias, accumulate, the tile for M), loads its kernel through ``kernels_for`` (the
kernel cache: the first use compiles, later processes load the shared library) and launches it
on the packed codes and scale codes of the two QuantizedTensors. Numerics: docs/numerics.md
section 6 (the products are exact, only the fp32 summation order differs from the reference).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from fp4gen.codegen.gemm import pick_tile, unsupported_reason
from fp4gen.compiler.spec import GemmKernelSpec, GemmOutDType, GemmTile
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat

FUSED_ARCHS: tuple[str, ...] = ("sm_90a",)  # wgmma

_unavailable: dict[GemmKernelSpec, str] = {}  # spec -> why its kernel cannot be built
_lock = threading.Lock()
# QuantizedTensor -> (version of its codes, packed codes): a weight is packed once, not per GEMM
_packed: weakref.WeakKeyDictionary[Any, tuple[int, torch.Tensor]] = weakref.WeakKeyDictionary()


def gemm_spec(
    a: BlockFormat,
    b: BlockFormat,
    m: int,
    *,
    out_dtype: GemmOutDType = "fp32",
    bias: bool = False,
    accumulate: bool = False,
    tile: GemmTile | None = None,
) -> GemmKernelSpec:
    """The fused-kernel spec for A [m, K] in format ``a`` times B^T in format ``b``."""
    return GemmKernelSpec(
        a_element=a.element,
        a_block=a.block,
        a_scale=a.scale.element,
        b_element=b.element,
        b_block=b.block,
        b_scale=b.scale.element,
        out_dtype=out_dtype,
        bias=bias,
        accumulate=accumulate,
        tile=tile or pick_tile(m),
    )


def fused_support(a: BlockFormat, b: BlockFormat) -> str | None:
    """None when a fused kernel is generated for this operand pair, else the reason."""
    return unsupported_reason(gemm_spec(a, b, 1))


def packed_codes(q: Any) -> torch.Tensor:
    """uint8 [R, ceil(C/2)], two 4-bit codes per byte (element 0 in the low nibble), as
    ``q.data`` but in one elementwise pass; remembered per QuantizedTensor (until its codes
    change), so a weight reused across GEMMs is packed once."""
    codes = q.codes
    hit = _packed.get(q)
    if hit is not None and hit[0] == codes._version:
        return hit[1]
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    packed = (codes[:, 0::2] & 0xF) | (codes[:, 1::2] << 4)
    _packed[q] = (q.codes._version, packed)
    return packed


def _kernels(spec: GemmKernelSpec, arch: str) -> Any:
    """kernels_for(spec, arch), or the reason it cannot be had (a str, remembered)."""
    reason = _unavailable.get(spec)
    if reason is not None:
        return reason
    from fp4gen.runtime.kernels import kernels_for

    try:
        return kernels_for(spec, arch)  # type: ignore[arg-type]
    except NotImplementedError as err:
        reason = f"the template cannot generate {spec.name} ({err})"
    except ImportError as err:
        reason = f"the CuTe DSL cannot be imported ({err})"
    except Exception as err:  # a compile, link or load failure: reported, not retried
        reason = f"building {spec.name} for {arch} failed ({type(err).__name__}: {err})"
    with _lock:
        _unavailable[spec] = reason
    return reason


def fused_gemm(
    a: Any,
    b: Any,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    accumulate: torch.Tensor | None,
    arch: str,
    tile: GemmTile | None = None,
) -> torch.Tensor:
    """C = S_a S_b (A_q @ B_q^T) (+ bias) (+ accumulate) with the generated fused kernel.

    ``a``, ``b``: QuantizedTensors on one CUDA device, quantized along K with the same RHT (or
    none). Raises FP4GenError when no fused kernel serves the pair or the arch, TensorError for
    operands that do not fit together. ``accumulate`` (fp32 [M, N]) is not modified.
    """
    if a.cols != b.cols:
        raise TensorError(f"K mismatch: a is [{a.rows}, {a.cols}] and b is [{b.rows}, {b.cols}]")
    if a.rht != b.rht:
        raise TensorError("the operands carry different Hadamard transforms")
    if a.device != b.device or a.device.type != "cuda":
        raise TensorError(
            f"the fused GEMM needs both operands on one CUDA device: {a.device}, {b.device}"
        )
    if arch not in FUSED_ARCHS:
        raise FP4GenError(
            f"no fused GEMM kernel for {arch} (it uses wgmma: {', '.join(FUSED_ARCHS)})"
        )
    m, n, k = a.rows, b.rows, a.cols
    # bf16 straight from the kernel when nothing fp32 is added; else fp32 (one rounding at the end)
    kernel_dtype: GemmOutDType = (
        "bf16" if out_dtype == torch.bfloat16 and accumulate is None else "fp32"
    )
    spec = gemm_spec(
        a.format,
        b.format,
        m,
        out_dtype=kernel_dtype,
        bias=bias is not None,
        accumulate=accumulate is not None,
        tile=tile,
    )
    reason = unsupported_reason(spec)
    if reason is not None:
        raise FP4GenError(f"no fused GEMM kernel for {a.format.name} x {b.format.name}: {reason}")
    kernels = _kernels(spec, arch)
    if isinstance(kernels, str):
        raise FP4GenError(f"the fused GEMM kernel is not available: {kernels}")
    dev = a.device
    if accumulate is not None:
        if tuple(accumulate.shape) != (m, n):
            raise TensorError(
                f"accumulate has shape {tuple(accumulate.shape)}, the product {(m, n)}"
            )
        out = accumulate.to(
            device=dev, dtype=torch.float32, copy=True, memory_format=torch.contiguous_format
        )
    else:
        out = torch.empty(
            (m, n), dtype=torch.bfloat16 if kernel_dtype == "bf16" else torch.float32, device=dev
        )
    if bias is not None:
        if tuple(bias.shape) != (n,):
            raise TensorError(f"bias must have shape [{n}], got {tuple(bias.shape)}")
        bias = bias.to(device=dev, dtype=torch.float32).contiguous()
    kernels.module.run(
        kernels.fns,
        packed_codes(a),
        a.scale_codes,
        a.global_scale.to(device=dev, dtype=torch.float32),
        packed_codes(b),
        b.scale_codes,
        b.global_scale.to(device=dev, dtype=torch.float32),
        k=k,
        out=out,
        bias=bias,
    )
    return out if out.dtype == out_dtype else out.to(out_dtype)


__all__ = ["FUSED_ARCHS", "fused_gemm", "fused_support", "gemm_spec", "packed_codes"]
