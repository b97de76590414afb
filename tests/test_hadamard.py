"""RHT: bit-exact against a scalar float32 butterfly, orthogonality, signs, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp4gen.dsl.model import TE_SIGNS_16, RHTSpec
from fp4gen.errors import TensorError
from fp4gen.numerics.hadamard import (
    hadamard_matrix,
    inverse_rht,
    rht,
    rht_matrix,
    rht_scale,
    rht_signs,
)
from fp4gen.numerics.philox import random_bits

F32 = np.float32


def bf16_rne(v: np.float32) -> np.float32:
    """Round a finite float32 to bfloat16 (nearest, ties to even) via its bit pattern."""
    u = int(np.array(v, dtype=np.float32).view(np.uint32))
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return np.array(u, dtype=np.uint32).view(np.float32)[()]


def ref_rht_chunk(x: np.ndarray, signs: list[int]) -> list[np.float32]:
    """The contract's order, scalar by scalar in float32."""
    d = len(signs)
    v = [F32(x[i]) * F32(signs[i]) for i in range(d)]
    h = 1
    while h < d:
        for j in range(d):
            if j % (2 * h) < h:
                a, b = v[j], v[j + h]
                v[j], v[j + h] = a + b, a - b
        h *= 2
    scale = F32(1.0 / math.sqrt(d))
    return [bf16_rne(F32(t) * scale) for t in v]


def specs(d: int) -> list[RHTSpec]:
    out = [RHTSpec(d, "none", None, None), RHTSpec(d, "seeded", None, 1234)]
    if d == 16:
        out.append(RHTSpec(16))
    return out


@pytest.mark.parametrize("d", [2, 4, 8, 16, 32, 64, 128, 256])
def test_rht_bit_exact_against_scalar_butterflies(d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(3, 2 * d, generator=gen) * torch.tensor(10.0) ** torch.randint(
        -3, 4, (3, 2 * d), generator=gen
    )
    for spec in specs(d):
        signs = [int(s) for s in rht_signs(spec).tolist()]
        got = rht(x, spec)
        xn = x.numpy()
        for r in range(3):
            for c0 in range(0, 2 * d, d):
                want = ref_rht_chunk(xn[r, c0 : c0 + d], signs)
                assert got[r, c0 : c0 + d].tolist() == [float(w) for w in want], (spec, r, c0)


def test_signs() -> None:
    assert rht_signs(RHTSpec(16)).tolist() == list(TE_SIGNS_16)
    assert rht_signs(RHTSpec(8, "none", None, None)).tolist() == [1.0] * 8
    words = random_bits(64, 99).tolist()
    want = [-1.0 if w >> 31 else 1.0 for w in words]
    assert rht_signs(RHTSpec(64, "seeded", None, 99)).tolist() == want
    assert -1.0 in want and 1.0 in want


@pytest.mark.parametrize("d", [2, 4, 16, 64, 256])
def test_hadamard_matrix_and_scale(d: int) -> None:
    h = hadamard_matrix(d)
    # Sylvester order: H[i, j] = (-1)^popcount(i & j).
    want = torch.tensor(
        [[(-1.0) ** bin(i & j).count("1") for j in range(d)] for i in range(d)],
        dtype=torch.float64,
    )
    assert torch.equal(h, want)
    assert torch.equal(h @ h.T, d * torch.eye(d, dtype=torch.float64))
    # rht_scale is the float32 nearest to 1/sqrt(d): within half an fp32 ulp of the true value.
    s = rht_scale(d)
    assert s == float(np.float32(s))
    ulp = float(np.spacing(np.float32(s)))
    assert abs(s - 1 / math.sqrt(d)) <= ulp / 2
    if round(math.log2(d)) % 2 == 0:
        assert s == 2.0 ** (-math.log2(d) / 2)


@pytest.mark.parametrize("d", [2, 16, 128])
def test_rht_is_x_times_h_within_bf16(d: int) -> None:
    x = torch.randn(5, 4 * d, generator=torch.Generator().manual_seed(1))
    for spec in specs(d):
        exact = (x.double().reshape(5, 4, d) @ rht_matrix(spec)).reshape(5, -1)
        got = rht(x, spec).double()
        # bf16 RNE (8 significant bits): relative error <= 2^-8; the fp32 butterflies add far
        # less (about log2(d) * 2^-24 of the chunk norm), covered by the absolute term.
        norms = x.double().reshape(5, 4, d).norm(dim=-1).repeat_interleave(d, dim=1)
        tol = 2.0**-8 * exact.abs() + 1e-6 * norms
        assert torch.all((got - exact).abs() <= tol)


@pytest.mark.parametrize("d", [2, 16, 256])
def test_inverse_is_orthogonal_inverse(d: int) -> None:
    x = torch.randn(4, 2 * d, generator=torch.Generator().manual_seed(2))
    for spec in specs(d):
        back = inverse_rht(rht(x, spec), spec).double()
        # H is orthogonal, so the error is the bf16 rounding of x H, mapped back unchanged in
        # norm: per chunk ||x - back|| <= 2^-8 ||x|| (plus fp32 slack).
        err = (back - x.double()).reshape(4, 2, d).norm(dim=-1)
        assert torch.all(err <= 2.0**-8 * x.double().reshape(4, 2, d).norm(dim=-1) * 1.0001)
        # Without the bf16 step the inverse is exact up to fp32 rounding.
        rotated = (x.double().reshape(4, 2, d) @ rht_matrix(spec)).reshape(4, -1).float()
        assert torch.allclose(inverse_rht(rotated, spec), x, rtol=0, atol=1e-5)


def test_rht_output_is_bf16_and_accepts_bf16() -> None:
    x = torch.randn(2, 32).to(torch.bfloat16)
    y = rht(x, RHTSpec(16))
    assert y.dtype == torch.float32
    assert torch.equal(y, y.to(torch.bfloat16).float())
    assert torch.equal(y, rht(x.float(), RHTSpec(16)))


def test_width_not_a_multiple_raises() -> None:
    with pytest.raises(TensorError, match=r"multiple of 16.*shape \(3, 40\)"):
        rht(torch.zeros(3, 40), RHTSpec(16))
    with pytest.raises(TensorError, match=r"multiple of 32.*shape \(2, 48\)"):
        inverse_rht(torch.zeros(2, 48), RHTSpec(32, "none", None, None))
