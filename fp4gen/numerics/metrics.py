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
    snr_db:          10 log10(sum x^2 / sum (x - x_hat)^2); inf for an exact result, -inf when
                     x is all zero and x_hat is not (or the ratio underflows float64).
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


def _ratio(sig: float, noise: float) -> tuple[float, float]:
    """(sig / noise, noise / sig) with the limits spelled out, so that no math call sees a NaN
    or a negative number: 0 / 0 is exact (inf, 0), x / 0 is inf, inf / inf (an overflowed
    float64 sum; no float32 input gets there) counts as inf noise."""
    if noise == 0:
        return math.inf, 0.0
    if sig == 0 or math.isinf(noise):
        return 0.0, math.inf
    return sig / noise, noise / sig


def _decibels(ratio: float) -> float:
    """10 log10(ratio) for ratio in [0, inf]: -inf for 0, inf for inf."""
    if ratio == 0:
        return -math.inf
    if math.isinf(ratio):
        return math.inf
    return 10.0 * math.log10(ratio)


def error_stats(x: torch.Tensor, qt: QuantizedTensor) -> ErrorStats:
    """Statistics of ``qt`` (quantized from ``x``) against ``x`` itself."""
    if tuple(x.shape) != tuple(qt.shape):
        raise TensorError(f"x has shape {tuple(x.shape)}, the quantized tensor {tuple(qt.shape)}")
    x64 = x.to(device=qt.device, dtype=torch.float64)
    err = x64 - qt.dequantize().to(torch.float64)
    sig, noise = float((x64 * x64).sum()), float((err * err).sum())
    nz = x64 != 0
    mean_rel = float((err.abs()[nz] / x64.abs()[nz]).mean()) if bool(nz.any()) else 0.0
    signal_to_noise, noise_to_signal = _ratio(sig, noise)
    rel = math.sqrt(noise_to_signal)
    snr = _decibels(signal_to_noise)

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
