"""Random Hadamard transform (RHT) along the last dimension, in d-sized chunks.

Forward, per chunk x of length d (the exact order is part of the contract: GPU kernels perform
the same butterflies, so the fp32 roundings match):

1. x_i * s_i (exact: a sign flip);
2. fast Walsh-Hadamard butterflies in natural (Sylvester) order, stages h = 1, 2, 4, ..., d/2:
   for each pair (j, j + h) with j % (2h) < h: (a, b) -> (a + b, a - b), in fp32;
3. multiply by fp32(1/sqrt(d)) (the fp32 value nearest to 1/sqrt(d));
4. round to bf16 (round to nearest even) and return as float32.

This computes x' = x H with H = (1/sqrt(d)) diag(s) H_d (H_d Sylvester, symmetric). The inverse
x = x' H^T = x' H_d diag(s) / sqrt(d) runs the butterflies first, then the scale, then the signs,
in fp32 with no bf16 rounding (it is used to bring dequantized values back, not by kernels).

Sign sources: "fixed" (spec.signs), "seeded" (s_i = -1 iff the top bit of Philox word i with
key = seed and offset 0 is set; see ``fp4gen.numerics.philox``), "layer" and "step" (the same
with offset = spec.stream, the layer's and step's stream: ``RHTSpec.at``), "none" (all +1).
"""

from __future__ import annotations

import functools
import math

import torch

from fp4gen.dsl.model import RHTSpec
from fp4gen.errors import TensorError
from fp4gen.numerics.philox import random_bits
from fp4gen.numerics.tables import device_table


def _fixed_signs(signs: tuple[float, ...], device: torch.device) -> torch.Tensor:
    # made once per device, outside any CUDA-graph pool (fp4gen.numerics.tables)
    return device_table(("signs", signs), lambda: signs, device)


def rht_signs(spec: RHTSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """The sign vector s (float32, +-1, length spec.size)."""
    if spec.sign_source == "fixed":
        assert spec.signs is not None
        return _fixed_signs(tuple(spec.signs), torch.device(device or "cpu"))
    if spec.sign_source == "seeded":
        assert spec.seed is not None
        top = random_bits(spec.size, spec.seed, 0, device=device) >> 31
        return 1.0 - 2.0 * top.to(torch.float32)
    if spec.redrawn:  # per layer (and step): Philox offset = the layer's (and step's) stream
        assert spec.seed is not None
        if spec.stream is None:
            raise TensorError(
                f"rht {spec.size} signs {spec.sign_source}: the signs are drawn per layer"
                f"{' and step' if spec.sign_source == 'step' else ''}; give the transform its "
                "layer and step first (RHTSpec.at(layer, step), as fp4gen.nn.Linear does)"
            )
        top = random_bits(spec.size, spec.seed, spec.stream, device=device) >> 31
        return 1.0 - 2.0 * top.to(torch.float32)
    return torch.ones(spec.size, dtype=torch.float32, device=device)


@functools.cache
def rht_scale(d: int) -> float:
    """fp32(1/sqrt(d)) as a Python float (d a power of two: a power of two or fp32(sqrt(1/2))
    times one, either way the correctly rounded fp32 value). Cached: a CPU tensor's read per
    call is host work, and no read at all keeps a capture's trace free of them."""
    return float(torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32))


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The d x d Sylvester Hadamard matrix H_d (entries +-1, H_d H_d^T = d I); for tests."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {d}")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rht_matrix(spec: RHTSpec, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """H = diag(s) H_d / sqrt(d) in ``dtype`` (the forward transform is x' = x H); for tests."""
    s = rht_signs(spec).to(dtype)
    return s[:, None] * hadamard_matrix(spec.size, dtype) / math.sqrt(spec.size)


def _check(x: torch.Tensor, d: int) -> None:
    if x.dim() < 1 or x.shape[-1] % d:
        raise TensorError(
            f"RHT of size {d} needs the last dimension to be a multiple of {d}; "
            f"got a tensor of shape {tuple(x.shape)}"
        )


def _butterflies(x: torch.Tensor, d: int) -> torch.Tensor:
    """H_d applied to every d-chunk of the last dimension, stage by stage in fp32."""
    lead = x.shape[:-1]
    y = x.reshape(*lead, -1, d)
    h = 1
    while h < d:
        # Chunk index j = (group, half, t): pairs are (group, 0, t) and (group, 1, t).
        pairs = y.reshape(*lead, -1, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, -1, d)
        h *= 2
    return y.reshape(x.shape)


def _tile(v: torch.Tensor, n: int) -> torch.Tensor:
    return v.repeat(n // v.numel())


def rht(x: torch.Tensor, spec: RHTSpec) -> torch.Tensor:
    """Forward RHT of ``x`` (float32, bf16 or fp16; any shape) along its last dimension.

    Returns float32 values that are exactly bf16 numbers. Raises TensorError when the last
    dimension is not a multiple of spec.size.
    """
    d = spec.size
    _check(x, d)
    x = x.to(torch.float32)
    s = _tile(rht_signs(spec, x.device), x.shape[-1])
    y = _butterflies(x * s, d) * rht_scale(d)
    return y.to(torch.bfloat16).to(torch.float32)


def inverse_rht(x: torch.Tensor, spec: RHTSpec) -> torch.Tensor:
    """Inverse RHT along the last dimension, in fp32 (butterflies, scale, signs; no bf16)."""
    d = spec.size
    _check(x, d)
    x = x.to(torch.float32)
    s = _tile(rht_signs(spec, x.device), x.shape[-1])
    return _butterflies(x, d) * rht_scale(d) * s
