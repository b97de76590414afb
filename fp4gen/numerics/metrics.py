"""Quantization error statistics (the MoR paper's metric and a few companions)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp4gen.errors import TensorError
from fp4gen.numerics.hadamard import rht
from fp4gen.numerics.minifloat import decode, max_finite
from fp4gen.numerics.quantize import QuantizedTensor


@dataclass(frozen=True)
class ErrorStats:
    """Error of a quantized tensor against its source, all computed in float64.

    rel_error:       ||x - x_hat|| / ||x|| (Frobenius; 0 when both are 0, inf when only x is).
    mean_rel_error:  mean over non-zero x of |x - x_hat| / |x| (MoR paper; 0 if x is all zero).
    snr_db:          10 log10(sum x^2 / sum (x - x_hat)^2); inf for an exact result.
    flushed:         fraction of non-zero inputs of the quantizer (after the RHT, if any) whose
                     code decodes to 0.
    saturated:       fraction of elements with |x * e_b| > elem_max before the clamp (after the
                     RHT, if any). Blocks whose scale rounded to 0 count here: e_b = FLT_MAX.
    """

    rel_error: float
    mean_rel_error: float
    snr_db: float
    flushed: float
    saturated: float


def error_stats(x: torch.Tensor, qt: QuantizedTensor) -> ErrorStats:
    """Statistics of ``qt`` (quantized from ``x``) against ``x`` itself."""
    if tuple(x.shape) != tuple(qt.shape):
        raise TensorError(f"x has shape {tuple(x.shape)}, the quantized tensor {tuple(qt.shape)}")
    x64 = x.to(device=qt.device, dtype=torch.float64)
    err = x64 - qt.dequantize().to(torch.float64)
    sig, noise = float((x64 * x64).sum()), float((err * err).sum())
    rel = math.sqrt(noise / sig) if sig else (0.0 if noise == 0 else math.inf)
    nz = x64 != 0
    mean_rel = float((err.abs()[nz] / x64.abs()[nz]).mean()) if bool(nz.any()) else 0.0
    if noise == 0:
        snr = math.inf
    elif sig == 0:
        snr = -math.inf
    else:
        snr = 10.0 * math.log10(sig / noise)

    # The quantizer's own input: the 2-D view, rotated like the codes.
    src = x.to(device=qt.device, dtype=torch.float32).reshape(qt.rows, qt.cols)
    if qt.rht is not None:
        src = rht(src, qt.rht)
    q_nz = src != 0
    zero_code = decode(qt.codes, qt.element) == 0
    n_nz = int(q_nz.sum())
    flushed = float((q_nz & zero_code).sum()) / n_nz if n_nz else 0.0
    scaled = src * qt.block_values(qt.encode_scales)
    saturated = float((scaled.abs() > max_finite(qt.element)).sum()) / src.numel()
    return ErrorStats(rel, mean_rel, snr, flushed, saturated)
