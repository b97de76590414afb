"""The MoR reference (fp4gen.numerics.mor) on hand-built tensors and against independent code."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from fp4gen.dsl import load_recipe
from fp4gen.dsl.model import Candidate, Metric, MoRSpec, Partition
from fp4gen.errors import TensorError
from fp4gen.formats import BUILTIN_FORMATS, E4M3, E5M2, HighPrecision
from fp4gen.numerics import quantize
from fp4gen.numerics.minifloat import decode
from fp4gen.numerics.mor import HIST_BINS, mor_quantize, mor_scales, tree_sum

BF16 = HighPrecision("bf16")
TENSOR = load_recipe("mor_tensor.fp4r").mors[0]  # decide tensor, scale block 128x128 gam, 4.5%
TWO_WAY = load_recipe("mor_subtensor_2way.fp4r").mors[0]
THREE_WAY = load_recipe("mor_subtensor_3way.fp4r").mors[0]


def spec(decide: Partition, scale: Partition, scaling="gam", candidates=None) -> MoRSpec:
    return MoRSpec("m", decide, scale, scaling, candidates or TENSOR.candidates)


# ------------------------------------------------------------------------------------------------
# GAM scaling against Algorithm 1, computed independently in float64
# ------------------------------------------------------------------------------------------------


def alg1(x: np.ndarray, block, q_max: float, group=None):
    """Algorithm 1 of the MoR paper in float64 over Python floats. The ideal scales are rounded
    to fp32 (the paper keeps the fp32 mantissa); mantissa in [1, 2), exponent = floor(log2)."""
    rows, cols = x.shape
    br, bc = block
    nbr, nbc = -(-rows // br), -(-cols // bc)
    gr, gc = group or (nbr * br, nbc * bc)

    def amax(r0, r1, c0, c1):
        part = np.abs(x[r0:r1, c0:c1].astype(np.float64))
        return float(part.max()) if part.size else 0.0

    def ideal(a):
        return float(np.float32(q_max / a))  # float64 quotient, rounded once to fp32

    def split(s):
        f, e = math.frexp(s)
        return 2.0 * f, e - 1

    scale = np.zeros((nbr, nbc))
    exponent = np.zeros((nbr, nbc), dtype=np.int64)
    lowered = np.zeros((nbr, nbc), dtype=bool)
    for i in range(nbr):
        for j in range(nbc):
            g0, h0 = (i * br) // gr * gr, (j * bc) // gc * gc
            g_amax = amax(g0, g0 + gr, h0, h0 + gc)
            s_g = ideal(g_amax) if g_amax > 0 else 1.0
            b_amax = amax(i * br, (i + 1) * br, j * bc, (j + 1) * bc)
            s_b = ideal(b_amax) if b_amax > 0 else s_g  # a zero block is scaled like its group
            m_g, _ = split(s_g)
            m_b, e_b = split(s_b)
            e = e_b if m_g <= m_b else e_b - 1
            scale[i, j], exponent[i, j], lowered[i, j] = m_g * 2.0**e, e, m_g > m_b
    return scale, exponent, lowered


def varied(rows: int, cols: int, block, seed: int = 0) -> torch.Tensor:
    """Gaussian blocks with per-block magnitudes 2^[-20, 20] x [1, 2), one all-zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    br, bc = block
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            k = int(torch.randint(-20, 21, (1,), generator=g))
            x[i : i + br, j : j + bc] *= 2.0**k * (1 + float(torch.rand(1, generator=g)))
    x[:br, bc : 2 * bc] = 0
    return x


@pytest.mark.parametrize("element", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(
    "block,group",
    [((16, 32), None), ((16, 32), (16, 96)), ((1, 96), None), ((48, 96), None), ((1, 16), None)],
    ids=["block", "block-rowgroups", "channel", "tensor", "1x16"],
)
def test_gam_matches_algorithm_1(element, block, group) -> None:
    x = varied(48, 96, block)
    sc = mor_scales(x, element, block, "gam", group)
    scale, exponent, lowered = alg1(x.numpy(), block, element.max_finite, group)
    assert torch.equal(sc.encode.double(), torch.from_numpy(scale))
    assert torch.equal(sc.exponent.long(), torch.from_numpy(exponent))
    # one group mantissa per group, in [1, 2)
    assert sc.mantissa is not None and ((sc.mantissa >= 1) & (sc.mantissa < 2)).all()
    if group is None:
        assert sc.mantissa.numel() == 1
    if block != (48, 96):
        assert lowered.any() and (~lowered).any()  # both branches of Algorithm 1 are exercised
    # decode factor: fp32(1 / m_g) * 2^-e, exact in float64
    m_g = sc.mantissa.reshape(-1)[0] if group is None else None
    if m_g is not None:
        recip = float(np.float32(1.0) / np.float32(float(m_g)))
        assert torch.equal(sc.decode, torch.from_numpy(recip * 2.0 ** (-exponent.astype(float))))
    # nothing saturates (up to the fp32 rounding of q_max / amax)
    br, bc = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            b = x[i * br : (i + 1) * br, j * bc : (j + 1) * bc].double().abs().max()
            assert float(b) * scale[i, j] <= element.max_finite * (1 + 2**-22)


def test_zero_blocks_and_zero_tensor() -> None:
    x = torch.zeros(4, 8)
    x[0, 0] = 3.0  # s_g = 448 / 3
    sc = mor_scales(x, E4M3, (2, 4), "gam")
    e_g = math.frexp(float(np.float32(448 / 3)))[1] - 1
    assert sc.exponent.tolist() == [[e_g, e_g], [e_g, e_g]]  # zero blocks keep the group's
    z = mor_scales(torch.zeros(4, 8), E4M3, (2, 4), "gam")
    assert z.encode.eq(1).all() and z.exponent.eq(0).all() and float(z.mantissa) == 1.0
    mt = mor_quantize(torch.zeros(4, 8), THREE_WAY)
    assert mt.choice.tolist() == [[0]] and mt.dequantize().eq(0).all()  # exact -> e4m3


def test_e8m0_and_amax_scaling() -> None:
    x = varied(32, 64, (16, 16), seed=3)
    e8 = mor_scales(x, E4M3, (16, 16), "e8m0")
    gam = mor_scales(x, E4M3, (16, 16), "gam")
    amax = mor_scales(x, E4M3, (16, 16), "amax")
    assert torch.equal(e8.encode, torch.exp2(e8.exponent.float()))  # powers of two
    assert e8.mantissa is None and amax.exponent is None
    # GAM's exponent is e8m0's, lowered by one where the group mantissa exceeds the block's
    assert ((e8.exponent - gam.exponent) >= 0).all() and ((e8.exponent - gam.exponent) <= 1).all()
    b_amax = x.abs().reshape(2, 16, 4, 16).amax(dim=(1, 3))
    ideal = torch.where(b_amax > 0, torch.tensor(448.0) / b_amax, amax.encode)
    assert torch.equal(amax.encode, ideal)
    assert torch.equal(amax.decode, (1.0 / amax.encode).double())


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_e8m0_elements_match_the_block_quantizer(rounding: str) -> None:
    """E8M0 scaling with 1x32 blocks is MXFP8's e4m3 with round-up scales: same codes (same
    Philox words for SR), same values."""
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(7)) * 3
    accept_all = MoRSpec(
        "all",
        Partition("tensor"),
        Partition("block", (1, 32)),
        "e8m0",
        (Candidate(E4M3, Metric("relerr", threshold=0.99)), Candidate(BF16)),
    )
    mt = mor_quantize(x, accept_all, rounding=rounding, seed=5, offset=3)
    qt = quantize(x, BUILTIN_FORMATS["mxfp8_e4m3"], rounding=rounding, seed=5, offset=3)
    assert mt.choice.tolist() == [[0]]
    assert torch.equal(mt.codes, qt.codes)
    assert torch.equal(mt.dequantize(), qt.dequantize())


# ------------------------------------------------------------------------------------------------
# Tensor-level MoR: the 4.5% threshold
# ------------------------------------------------------------------------------------------------

UNDER, OVER = 1.0479, 1.0480  # e4m3 rounds both to 1.0 at scale 1


def threshold_block(v: float, n: int = 64) -> torch.Tensor:
    """448 (amax, so the GAM scale is exactly 1 and 448 is exact) and n - 1 copies of v."""
    t = torch.full((n,), v, dtype=torch.float32)
    t[0] = 448.0
    return t


def expected_mean(v: float, n: int = 64) -> float:
    v = float(np.float32(v))
    return (n - 1) * abs(v - 1.0) / v / n  # Q(v) = 1.0; 448 is exact


def test_threshold_under_and_over() -> None:
    assert 0.045 - 1e-4 < expected_mean(UNDER) < 0.045 < expected_mean(OVER) < 0.045 + 1e-4
    under = mor_quantize(threshold_block(UNDER).reshape(4, 16), TENSOR)
    over = mor_quantize(threshold_block(OVER).reshape(4, 16), TENSOR)
    assert under.choice.tolist() == [[0]] and over.choice.tolist() == [[1]]
    assert float(under.mean_rel_error()[0]) == pytest.approx(expected_mean(UNDER), rel=1e-12)
    assert float(over.mean_rel_error()[0]) == pytest.approx(expected_mean(OVER), rel=1e-12)
    # e4m3 keeps its codes; the bf16 tensor is the input rounded to bf16
    assert set(under.dequantize().unique().tolist()) == {1.0, 448.0}
    x = threshold_block(OVER).reshape(4, 16)
    assert torch.equal(over.dequantize(), x.bfloat16().float())
    assert over.fallback_fraction() == 1 and under.fallback_fraction() == 0
    assert under.histogram()[int(expected_mean(UNDER) * 200)] == 1 and under.histogram().sum() == 1


def test_threshold_per_channel() -> None:
    x = torch.stack([threshold_block(UNDER), threshold_block(OVER), threshold_block(UNDER)])
    mt = mor_quantize(x, spec(Partition("channel"), Partition("channel")))
    assert mt.choice.tolist() == [[0], [1], [0]]
    out = mt.dequantize()
    assert torch.equal(out[1], x[1].bfloat16().float())
    assert set(out[0].tolist()) == {1.0, 448.0}
    assert float(mt.fallback_fraction()) == pytest.approx(1 / 3)


def test_threshold_per_block() -> None:
    """decide block 2x32 on [4, 64]: each block holds its own 448 and 63 copies of v."""
    blocks = [[UNDER, OVER], [OVER, UNDER]]
    x = torch.zeros(4, 64)
    for i in range(2):
        for j in range(2):
            block = threshold_block(blocks[i][j]).reshape(2, 32)
            x[2 * i : 2 * i + 2, 32 * j : 32 * j + 32] = block
    mt = mor_quantize(x, spec(Partition("block", (2, 32)), Partition("block", (2, 32))))
    assert mt.choice.tolist() == [[0, 1], [1, 0]]
    assert mt.histogram().sum() == 4
    # one decision for the whole tensor: the mean of the four blocks' means is over 4.5%
    assert (expected_mean(UNDER) + expected_mean(OVER)) / 2 > 0.045
    assert mor_quantize(x, TENSOR).choice.tolist() == [[1]]


# ------------------------------------------------------------------------------------------------
# Sub-tensor MoR: two-way and three-way selection
# ------------------------------------------------------------------------------------------------


def three_blocks() -> torch.Tensor:
    """[8, 96] in three 8x32 blocks: Gaussian (e4m3 wins M1); log-uniform magnitudes over 2^20
    (e4m3 flushes the small ones, M1 fails, the range 2^20 < 57344 / 2^-14 fits e5m2); over 2^34
    (wider than e5m2's normal range: bf16)."""
    g = torch.Generator().manual_seed(11)
    sign = torch.where(torch.rand(8, 96, generator=g) < 0.5, -1.0, 1.0)
    x = torch.randn(8, 96, generator=g)
    u = torch.rand(8, 64, generator=g)
    x[:, 32:64] = sign[:, 32:64] * torch.exp2(-20 * u[:, :32])
    x[:, 64:] = sign[:, 64:] * torch.exp2(-34 * u[:, 32:])
    x[0, 32], x[1, 32], x[0, 64], x[1, 64] = 1.0, 2.0**-20, 1.0, 2.0**-34  # pin the ranges
    return x


def test_three_way_picks_each_representation() -> None:
    x = three_blocks()
    blocks = Partition("block", (8, 32))
    mt = mor_quantize(x, spec(blocks, blocks, candidates=THREE_WAY.candidates))
    assert mt.choice.tolist() == [[0, 1, 2]]
    err = mt.error_sum  # [e4m3, e5m2, bf16] x units
    assert err[0, 0, 0] < err[1, 0, 0]  # M1 holds for the Gaussian block
    assert err[0, 0, 1] > err[1, 0, 1] and err[0, 0, 2] > err[1, 0, 2]  # and fails for the others
    out = mt.dequantize()
    assert torch.equal(out[:, 64:], x[:, 64:].bfloat16().float())
    e5 = mt.scales[1]
    values = decode(mt.codes[:, 32:64], E5M2).double() * e5.decode[0, 1]
    assert torch.equal(mt.values()[:, 32:64], values)
    assert mt.stats()["formats"] == pytest.approx({"e4m3": 1 / 3, "e5m2": 1 / 3, "bf16": 1 / 3})

    two = mor_quantize(x, spec(blocks, blocks, candidates=TWO_WAY.candidates))
    assert two.choice.tolist() == [[0, 1, 1]]  # e5m2 is only the yardstick
    assert two.evaluated == (E4M3, BF16, E5M2)
    assert torch.equal(two.dequantize()[:, 32:], x[:, 32:].bfloat16().float())


def test_shipped_subtensor_rules_on_128x128_blocks() -> None:
    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(2))
    x[128:, 128:256] = three_blocks()[:, 64:].repeat(16, 4)  # one block beyond e5m2's range
    x[:128, 256:] = three_blocks()[:, 32:64].repeat(16, 4)  # one block for e5m2
    three = mor_quantize(x.bfloat16(), THREE_WAY)
    assert three.choice.tolist() == [[0, 0, 1], [0, 2, 0]]
    two = mor_quantize(x.bfloat16(), TWO_WAY)
    assert two.choice.tolist() == [[0, 0, 1], [0, 1, 0]]
    assert float(two.fallback_fraction()) == pytest.approx(2 / 6)
    assert three.histogram().sum() == 6 and three.histogram().shape == (HIST_BINS,)


def test_range_metric_bound_is_strict() -> None:
    rule = spec(
        Partition("tensor"),
        Partition("tensor"),
        candidates=(Candidate(E5M2, Metric("range")), Candidate(BF16)),
    )
    ratio = 57344 / 2.0**-14
    for top, want in ((ratio * 0.5, 0), (ratio, 1)):  # max/min < bound: e5m2; == bound: bf16
        assert mor_quantize(torch.tensor([[1.0, top]]), rule).choice.tolist() == [[want]]


# ------------------------------------------------------------------------------------------------
# The summation order of the error sums (what the kernels reproduce)
# ------------------------------------------------------------------------------------------------


def pairwise_tree(values: list[float]) -> float:
    """Adjacent pairs, then pairs of pairs; an odd count pairs its last entry with 0."""
    while len(values) > 1:
        if len(values) % 2:
            values = values + [0.0]
        values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
    return values[0] if values else 0.0


def naive_tree_sum(t: torch.Tensor, unit: tuple[int, int]) -> torch.Tensor:
    """The documented order, unit by unit in Python floats: cut each unit by the 128x128 grid;
    per piece, a tree over each row's columns, then over the rows; then a tree over the piece
    columns of each piece row, then over the piece rows."""
    rows, cols = t.shape
    uh, uw = unit
    out = torch.zeros(-(-rows // uh), -(-cols // uw), dtype=torch.float64)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            r0, r1, c0, c1 = i * uh, min(rows, (i + 1) * uh), j * uw, min(cols, (j + 1) * uw)
            rc = sorted({r0, r1, *(k for k in range(r0, r1) if k % 128 == 0)})
            cc = sorted({c0, c1, *(k for k in range(c0, c1) if k % 128 == 0)})
            pieces = [
                [
                    pairwise_tree([pairwise_tree(t[r, a:b].tolist()) for r in range(ra, rb)])
                    for a, b in itertools.pairwise(cc)
                ]
                for ra, rb in itertools.pairwise(rc)
            ]
            out[i, j] = pairwise_tree([pairwise_tree(row) for row in pieces])
    return out


@pytest.mark.parametrize(
    "shape,unit",
    [
        ((5, 7), (2, 3)),
        ((130, 260), (130, 260)),  # a tensor-level unit over four tiles
        ((300, 200), (1, 200)),  # channels across two tiles
        ((257, 129), (48, 96)),  # units that straddle tile boundaries
        ((129, 300), (256, 256)),
        ((200, 64), (16, 16)),
    ],
)
def test_error_sums_follow_the_documented_tree(shape, unit) -> None:
    g = torch.Generator().manual_seed(shape[0])
    t = torch.rand(shape, generator=g, dtype=torch.float64)
    t *= torch.exp2(torch.randint(-30, 5, shape, generator=g).double())  # order matters
    got = tree_sum(t, unit)
    assert torch.equal(got, naive_tree_sum(t, unit))
    assert torch.equal(tree_sum(t[None].expand(3, *shape), unit)[1], got)  # batched


# ------------------------------------------------------------------------------------------------
# Options and input checks
# ------------------------------------------------------------------------------------------------


def test_rht_round_trip() -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    mt = mor_quantize(x, TENSOR, hadamard=16)
    assert mt.rht is not None and mt.choice.tolist() == [[0]]
    assert torch.allclose(mt.dequantize(), x, rtol=0, atol=0.1 * float(x.abs().max()))
    assert not torch.equal(mt.dequantize(rotated=True), mt.dequantize())


def test_sync_free_outputs_and_shape() -> None:
    x = torch.randn(2, 3, 40)
    mt = mor_quantize(x, THREE_WAY)
    assert mt.dequantize().shape == x.shape and (mt.rows, mt.cols) == (6, 40)
    assert isinstance(mt.fallback_fraction(), torch.Tensor)
    assert isinstance(mt.histogram(), torch.Tensor) and mt.histogram().dtype == torch.int64


def test_bad_inputs() -> None:
    with pytest.raises(TensorError, match="non-finite"):
        mor_quantize(torch.tensor([[1.0, float("nan")]]), TENSOR)
    with pytest.raises(ValueError, match="rounding"):
        mor_quantize(torch.ones(2, 2), TENSOR, rounding="up")
    with pytest.raises(ValueError, match="whole number of blocks"):
        mor_scales(torch.ones(4, 4), E4M3, (2, 2), "gam", group=(3, 4))
