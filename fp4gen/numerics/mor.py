"""Mixture of Representations (MoR): the reference (Su et al., "MoR", Sections 2 and 3).

A MoR rule (:class:`~fp4gen.dsl.model.MoRSpec`) quantizes a tensor to each element candidate
with one scale partition and scaling, measures every decision unit (the whole tensor, a row or
an RxC block) and keeps, per unit, the first candidate whose metric accepts it, else the final
fallback. Everything is computed with torch ops on the tensor's device; the decision path has no
host synchronization (only the input check shared with ``quantize`` reads a value back), so the
decisions and errors can be logged later without stalling the device. ``mor_quantize`` always
runs these torch ops; the generated MoR kernels are chosen in the backends
(``fp4gen.runtime.quantize_dispatch.mor_quantize``, ``backend=``).

Geometry **(fp4gen)**. The operand is the 2-D [R, K] view the GEMM reads (1-D inputs are one row,
higher ranks flatten their leading dimensions; a columnwise operand is given transposed, as for
``quantize``), so K, the dot-product dimension, is always the last one. Partitions:

- ``tensor``: one partition of shape [R, K];
- ``channel``: one partition per row, [1, K]: a vector along the dot product (per token for
  activations, per output feature for the fprop weight, per input feature for the dgrad weight
  W^T). Per-channel scales factor out of the dot product as s_a[m] * s_b[n] (the paper's "each
  row of the first GEMM operand and each column of the second");
- ``block RxC``: R rows by C columns (C along K); edge blocks are padded with zeros, which
  changes no amax, no error sum and no count.

Scaling (all fp32, each operation correctly rounded). q_max is the candidate's largest finite
value. The *ideal scale* of a set of values with amax A > 0 is s = min(fp32(q_max / A), FLT_MAX),
what x is multiplied by before rounding (Algorithm 1's s = q_amax / amax). For s > 0,
**mantissa(s)** is its significand m in [1, 2) and **exponent(s)** the integer e with
s = m * 2^e, i.e. floor(log2 s). For a normal fp32 s (every s met here unless q_max < 4 and
A is near FLT_MAX) these are 1 + f / 2^23 and E - 127 for the stored fields f and E, so comparing
mantissas compares the 23-bit fields.

- ``gam`` (Algorithm 1, one group per tensor unless ``group`` is given): per group g,
  m_g = mantissa(s_g); per block b, e_b = exponent(s_b), lowered by one when m_g > m_b
  (mantissa(s_b) < mantissa(s_g)); the block's encode scale is m_g * 2^e_b <= s_b, so nothing
  saturates (up to the rounding of the quotient). Stored: m_g (fp32) per group and e_b (int,
  an E8M0 exponent) per block.
- ``e8m0``: e_b = exponent(s_b), encode scale 2^e_b (GAM with m_g = 1: never lowered).
- ``amax``: the fp32 ideal scale s_b itself (per-block FP32 amax scaling).

Zero blocks **(fp4gen)**: a block whose amax is 0 is scaled as if its amax were its group's
(for e8m0 and amax, the group is the tensor): s_b = s_g, so GAM keeps e_b = exponent(s_g). A
group (tensor) that is all zeros gets s_g = 1. Such blocks encode to code 0 and decode to 0
whatever the scale; the rule only pins down the stored exponents.

Decoding **(fp4gen)**: the decode factor of a block is fp32(1 / m_g) * 2^-e_b (gam),
2^-e_b (e8m0) or fp32(1 / s_b) (amax): one fp32 reciprocal per group, the exponent applied
exactly. code value x decode factor is exact in float64 (at most 4 + 24 significand bits), which
is what ``values()`` returns and what a mixed GEMM sums; ``dequantize()`` rounds it once to fp32.
A kernel applies fp32(1/m_g_a) * fp32(1/m_g_b) in its epilogue and the exponents per block pair.

Element quantization: y = clamp(fp32(x * encode scale), -q_max, q_max), code = round(y) with the
sign bit set iff x < 0 (a negative x that rounds to zero is negative zero, -0.0 is code 0) and the
operand's rounding (``nearest``, ``zero``, or ``stochastic`` with the same Philox words as
``quantize``: element (r, c) uses word r * K + c of (seed, offset); every candidate sees the same
words). High-precision candidates (bf16, fp16, fp32) round x to the dtype (RNE).

Metrics, per decision unit, in float64 over the unit's non-zero x (n of them):

- ``relerr < t``: (1/n) sum |x - Q(x)| / |x| < t; a unit without non-zeros has error 0.
- ``relerr < relerr(F)``: sum |x - Q(x)| / |x| < the same sum for F (quantized with the same
  partition and scaling). **(fp4gen)** A candidate whose sum is exactly 0 (the unit is
  represented exactly, e.g. an all-zero unit) is also accepted, so exact ties do not fall back.
- ``range``: max|x| / min|x| over non-zeros < q_max / min_normal of the candidate (for E5M2,
  57344 / 2^-14), evaluated exactly as max < (q_max / min_normal) * min; true without non-zeros.

Summation order **(fp4gen)**, so that kernels reproduce the sums bit for bit: the per-element
terms (|x - Q(x)| / |x|, one correctly rounded float64 division; 0 for x = 0) are added as a
pairwise tree. The unit is cut by the 128x128 grid of the tensor (``SUM_TILE``) into pieces; in
each piece the tree first adds columns (adjacent pairs, then pairs of pairs, ..., counted from
the piece's first column), then rows the same way; the piece sums are then added by the same
tree over piece columns, then piece rows (counted from the unit's first piece). A level with an
odd count pairs the last entry with 0, which changes nothing (all terms are >= +0), so this is
the tree over the counts padded to powers of two. See ``tree_sum``.

Candidates are tried in order (Algorithm 2); the last one is taken when no earlier metric
accepts. With an RHT, everything above happens on the rotated (bf16-rounded) tensor and
``dequantize()`` rotates back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp4gen.dsl.model import Candidate, MoRScaling, MoRSpec, Partition, RHTSpec
from fp4gen.formats import (
    ElementFormat,
    HighPrecision,
    is_stochastic,
    sr_bits,
)
from fp4gen.numerics.hadamard import inverse_rht, rht
from fp4gen.numerics.minifloat import decode, encode, max_finite
from fp4gen.numerics.philox import random_bits
from fp4gen.numerics.quantize import (
    FLT_MAX,
    _as_2d_float32,
    _check_call,
    _check_finite,
    _expand,
    resolve_rht,
)

SCALINGS: tuple[str, ...] = ("gam", "e8m0", "amax")
HP_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}

# Telemetry histogram of relative errors: bins of 0.5% from 0 to 20%, then one bin for >= 20%.
HIST_BIN_WIDTH = 0.005
HIST_BINS = 41

Representation = ElementFormat | HighPrecision


# ----------------------------------------------------------------------------------------------
# Partitions
# ----------------------------------------------------------------------------------------------


def partition_block(partition: Partition, rows: int, cols: int) -> tuple[int, int]:
    """The block shape a partition stands for on an [rows, cols] operand (cols = K)."""
    if partition.kind == "tensor":
        return rows, cols
    if partition.kind == "channel":
        return 1, cols
    assert partition.block is not None
    return partition.block


def partition_text(partition: Partition) -> str:
    if partition.kind == "block":
        assert partition.block is not None
        return f"block {partition.block[0]}x{partition.block[1]}"
    return partition.kind


def _grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // block[0]), -(-cols // block[1])


def _tiles(t: torch.Tensor, block: tuple[int, int], fill: float = 0.0) -> torch.Tensor:
    """[R, C] -> [nbr, br, nbc, bc], padded with ``fill``."""
    rows, cols = t.shape
    br, bc = block
    nbr, nbc = _grid(rows, cols, block)
    padded = F.pad(t, (0, nbc * bc - cols, 0, nbr * br - rows), value=fill)
    return padded.reshape(nbr, br, nbc, bc)


def _block_sum(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    return _tiles(t, block).sum(dim=(1, 3))


def _expand_to(per_block: torch.Tensor, block: tuple[int, int], rows: int, cols: int):
    return _expand(per_block, block[0], block[1], rows, cols)


# ----------------------------------------------------------------------------------------------
# The summation order of the error sums (fp4gen): pairwise trees over 128x128 pieces
# ----------------------------------------------------------------------------------------------

SUM_TILE = 128  # pieces of a unit are its intersections with the tensor's 128x128 tiles


def _pairwise(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Pairwise tree sum along ``dim`` (>= 0), which is removed: adjacent pairs, then pairs of
    pairs, ...; a level with an odd count pairs its last entry with 0. Only elementwise adds, so
    the order of operations is fixed on every device."""
    while t.shape[dim] > 1:
        if t.shape[dim] % 2:
            pad = list(t.shape)
            pad[dim] = 1
            t = torch.cat([t, t.new_zeros(pad)], dim)
        t = t.unflatten(dim, (t.shape[dim] // 2, 2))
        t = t.select(dim + 1, 0) + t.select(dim + 1, 1)
    return t.squeeze(dim)


def _pow2_ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _segments(n: int, unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, lengths) of the pieces along an axis of length n: cuts at the multiples of
    SUM_TILE and of ``unit``."""
    if SUM_TILE % unit == 0:
        starts = torch.arange(0, n, unit)
    elif unit % SUM_TILE == 0:
        starts = torch.arange(0, n, SUM_TILE)
    else:
        starts = torch.unique(torch.cat([torch.arange(0, n, SUM_TILE), torch.arange(0, n, unit)]))
    ends = torch.cat([starts[1:], torch.tensor([n])])
    return starts, ends - starts


def _gather_tree(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """Pairwise sums along ``dim`` of the groups ``index`` [groups, width] names (entries equal
    to t.shape[dim] stand for 0): the result has ``groups`` entries along ``dim``."""
    pad = list(t.shape)
    pad[dim] = 1
    t = torch.cat([t, t.new_zeros(pad)], dim)
    groups, width = index.shape
    picked = t.index_select(dim, index.reshape(-1).to(t.device))
    return _pairwise(picked.unflatten(dim, (groups, width)), dim + 1)


def _within_pieces(t: torch.Tensor, dim: int, starts: torch.Tensor, lengths: torch.Tensor):
    """One tree sum per piece along ``dim`` (pieces given by their starts and lengths)."""
    j = torch.arange(_pow2_ceil(int(lengths.max())))
    index = torch.where(j < lengths[:, None], starts[:, None] + j, t.shape[dim])
    return _gather_tree(t, dim, index)


def _across_pieces(t: torch.Tensor, dim: int, starts: torch.Tensor, unit: int, n: int):
    """One tree sum per unit along ``dim`` over its pieces (entries of ``t``), counted from the
    unit's first piece."""
    owner = starts // unit  # non-decreasing: the unit of each piece
    units = -(-n // unit)
    per_unit = torch.bincount(owner, minlength=units)
    first = torch.searchsorted(owner, torch.arange(units))
    k = torch.arange(_pow2_ceil(int(per_unit.max())))
    index = torch.where(k < per_unit[:, None], first[:, None] + k, owner.numel())
    return _gather_tree(t, dim, index)


def tree_sum(t: torch.Tensor, unit: tuple[int, int]) -> torch.Tensor:
    """[..., R, C] -> [..., ceil(R/ur), ceil(C/uc)]: the sums per unit in fp4gen's order (module
    docstring): in each 128x128 piece columns, then rows; then piece columns, then piece rows."""
    rows_dim, cols_dim = t.dim() - 2, t.dim() - 1
    n_rows, n_cols = t.shape[-2:]
    r_starts, r_len = _segments(n_rows, unit[0])
    c_starts, c_len = _segments(n_cols, unit[1])
    t = _within_pieces(t, cols_dim, c_starts, c_len)
    t = _within_pieces(t, rows_dim, r_starts, r_len)  # one sum per piece
    t = _across_pieces(t, cols_dim, c_starts, unit[1], n_cols)
    return _across_pieces(t, rows_dim, r_starts, unit[0], n_rows)


# ----------------------------------------------------------------------------------------------
# Scaling (GAM, E8M0, FP32 amax)
# ----------------------------------------------------------------------------------------------


def split_fp32(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mantissa, exponent) of positive fp32 values: s = m * 2^e with m in [1, 2) (fp32, exact)
    and e = floor(log2 s) (int32)."""
    m, e = torch.frexp(s)  # m in [0.5, 1)
    return m * 2, e - 1


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64 for integer e in [-1022, 1023], built from the bits (exact, no sync)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def ideal_scale(amax: torch.Tensor, q_max: float) -> torch.Tensor:
    """min(fp32(q_max / amax), FLT_MAX) for amax > 0; inf where amax == 0 (replaced by callers)."""
    q = torch.tensor(q_max, dtype=torch.float32, device=amax.device)
    return torch.clamp(q / amax, max=FLT_MAX)


@dataclass(frozen=True, eq=False)
class MoRScales:
    """The scales of one element candidate over the scale partition.

    encode:   fp32 [nbr, nbc], what x is multiplied by before rounding (gam: m_g * 2^e_b).
    decode:   float64 [nbr, nbc], the exact decode factor (gam: fp32(1/m_g) * 2^-e_b).
    exponent: int32 [nbr, nbc], the E8M0 block exponents e_b (gam, e8m0), else None.
    mantissa: fp32 [ngr, ngc], the group mantissas m_g in [1, 2) (gam), else None.
    """

    element: ElementFormat
    scaling: MoRScaling
    block: tuple[int, int]
    group: tuple[int, int]
    encode: torch.Tensor
    decode: torch.Tensor
    exponent: torch.Tensor | None
    mantissa: torch.Tensor | None


def mor_scales(
    x2: torch.Tensor,
    element: ElementFormat,
    block: tuple[int, int],
    scaling: MoRScaling = "gam",
    group: tuple[int, int] | None = None,
) -> MoRScales:
    """Block scales of the fp32 [R, C] tensor ``x2`` for ``element`` (module docstring).

    ``group`` (gam; also the zero-block rule) is a block shape whose sides are multiples of
    ``block``'s; None is one group for the whole tensor (the paper's setting).
    """
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    rows, cols = x2.shape
    nbr, nbc = _grid(rows, cols, block)
    if group is None:
        gbr, gbc = nbr, nbc  # groups, in blocks
        group = (nbr * block[0], nbc * block[1])
    else:
        if group[0] % block[0] or group[1] % block[1]:
            raise ValueError(f"a GAM group {group} must be a whole number of blocks {block}")
        gbr, gbc = group[0] // block[0], group[1] // block[1]
    q_max = max_finite(element)

    amax_b = _tiles(x2.abs(), block).amax(dim=(1, 3))  # [nbr, nbc]
    amax_g = _tiles(amax_b, (gbr, gbc)).amax(dim=(1, 3))  # [ngr, ngc]
    s_g = ideal_scale(amax_g, q_max)
    s_g = torch.where(amax_g == 0, torch.ones_like(s_g), s_g)
    s_g_blocks = _expand_to(s_g, (gbr, gbc), nbr, nbc)
    s_b = torch.where(amax_b == 0, s_g_blocks, ideal_scale(amax_b, q_max))

    if scaling == "amax":
        decode_f = (1.0 / s_b).to(torch.float64)
        return MoRScales(element, scaling, block, group, s_b, decode_f, None, None)

    m_b, e_b = split_fp32(s_b)
    if scaling == "gam":
        m_g, _ = split_fp32(s_g)
        m_g_blocks = _expand_to(m_g, (gbr, gbc), nbr, nbc)
        e_b = torch.where(m_g_blocks <= m_b, e_b, e_b - 1)
        recip = (1.0 / m_g_blocks).to(torch.float64)  # fp32(1 / m_g), then exact
        encode_s = (m_g_blocks.to(torch.float64) * _pow2(e_b)).to(torch.float32)
        decode_f = recip * _pow2(-e_b)
        return MoRScales(element, scaling, block, group, encode_s, decode_f, e_b, m_g)
    encode_s = _pow2(e_b).to(torch.float32)
    return MoRScales(element, scaling, block, group, encode_s, _pow2(-e_b), e_b, None)


def quantize_element(
    x2: torch.Tensor, scales: MoRScales, rounding: str, bits: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [R, C], exact values float64 [R, C]) of ``x2`` in ``scales.element``."""
    rows, cols = x2.shape
    q_max = max_finite(scales.element)
    enc = _expand_to(scales.encode, scales.block, rows, cols)
    y = torch.clamp(x2 * enc, -q_max, q_max)
    # the sign of x: a negative x that rounds (or whose product underflows) to zero keeps it
    codes = encode(y, scales.element, rounding, bits, negative=x2 < 0)  # type: ignore[arg-type]
    dec = _expand_to(scales.decode, scales.block, rows, cols)
    return codes, decode(codes, scales.element).to(torch.float64) * dec


# ----------------------------------------------------------------------------------------------
# The quantized tensor
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MoRTensor:
    """A tensor quantized by a MoR rule: one representation per decision unit.

    ``choice`` [nur, nuc] holds each unit's candidate index into ``spec.candidates``. ``codes``
    (uint8 [R, C]) holds the codes of the chosen element format in quantized units (0
    elsewhere), ``scales[i]`` the scales of element candidate i (None for high-precision ones),
    ``high`` [R, C] the values of high-precision units, rounded to their dtype (0 elsewhere):
    fp32 from the reference; the kernels write the rule's high-precision dtype (bf16, fp16, or
    fp32 where the rule mixes them), whose values are those fp32 ones exactly. ``evaluated``
    lists every representation measured (the candidates, then any ``relerr(F)`` yardstick that
    is not one); ``error_sum`` [len(evaluated), nur, nuc] is
    the float64 sum of |x - Q(x)| / |x| over each unit's non-zero x, ``nonzero`` their count.
    Everything stays on the device (no host sync) until read.
    """

    spec: MoRSpec
    choice: torch.Tensor
    codes: torch.Tensor
    high: torch.Tensor
    scales: tuple[MoRScales | None, ...]
    evaluated: tuple[Representation, ...]
    error_sum: torch.Tensor
    nonzero: torch.Tensor
    unit: tuple[int, int]
    rounding: str
    rht: RHTSpec | None
    seed: int
    offset: int
    shape: torch.Size
    dtype: torch.dtype

    # --- geometry -----------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def cols(self) -> int:
        return self.codes.shape[1]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        return self.spec.candidates

    @property
    def units(self) -> int:
        return self.choice.numel()

    def unit_values(self, per_unit: torch.Tensor) -> torch.Tensor:
        """Broadcast a per-unit tensor to the [R, C] elements."""
        return _expand_to(per_unit, self.unit, self.rows, self.cols)

    # --- values -------------------------------------------------------------------------------
    def values(self) -> torch.Tensor:
        """The exact represented values, float64 [R, C] (in the rotated space if the tensor
        has an RHT): what a mixed GEMM sums."""
        chosen = self.unit_values(self.choice)
        out = self.high.to(torch.float64)
        for i, sc in enumerate(self.scales):
            if sc is None:
                continue
            dec = _expand_to(sc.decode, sc.block, self.rows, self.cols)
            v = decode(self.codes, sc.element).to(torch.float64) * dec
            out = torch.where(chosen == i, v, out)
        return out

    def dequantize(self, rotated: bool = False) -> torch.Tensor:
        """The represented values rounded once to fp32, in the input's shape (the inverse RHT
        applied unless ``rotated``)."""
        values = self.values().to(torch.float32)
        if self.rht is not None and not rotated:
            values = inverse_rht(values, self.rht)
        return values.reshape(self.shape)

    # --- decisions and errors -----------------------------------------------------------------
    @property
    def fallback_mask(self) -> torch.Tensor:
        """bool [nur, nuc]: units kept in a high-precision candidate."""
        high = [i for i, c in enumerate(self.candidates) if isinstance(c.format, HighPrecision)]
        return torch.isin(self.choice, torch.tensor(high, device=self.device, dtype=torch.int64))

    def fallback_fraction(self) -> torch.Tensor:
        """fp32 0-dim: the fraction of decision units kept in high precision."""
        return self.fallback_mask.to(torch.float32).mean()

    def format_fractions(self) -> torch.Tensor:
        """fp32 [len(candidates)]: the fraction of units that chose each candidate."""
        counts = torch.zeros(len(self.candidates), device=self.device, dtype=torch.float32)
        flat = self.choice.reshape(-1)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        return counts / flat.numel()

    def mean_rel_error(self) -> torch.Tensor:
        """float64 [len(evaluated), nur, nuc]: mean relative error over each unit's non-zeros
        (0 for units without non-zeros)."""
        n = self.nonzero.to(torch.float64)
        return torch.where(n > 0, self.error_sum / n.clamp(min=1), torch.zeros_like(n))

    def chosen_rel_error(self) -> torch.Tensor:
        """float64 0-dim: mean relative error over all non-zeros of what was kept."""
        chosen = self.error_sum.gather(0, self.choice.unsqueeze(0)).squeeze(0)
        n = self.nonzero.sum()
        return torch.where(n > 0, chosen.sum() / n.clamp(min=1), chosen.sum() * 0)

    def histogram(self, candidate: int = 0) -> torch.Tensor:
        """int64 [HIST_BINS]: units by the mean relative error of ``candidate`` (default the
        first, most aggressive one), in bins of 0.5% (bin i: i/200 <= e < (i+1)/200) and a last
        bin for e >= 20%. Units without non-zeros are not counted."""
        err = self.mean_rel_error()[candidate].reshape(-1)
        edges = torch.arange(1, HIST_BINS, dtype=torch.float64, device=self.device) / 200
        index = torch.bucketize(err, edges, right=True)
        index = torch.where(self.nonzero.reshape(-1) > 0, index, HIST_BINS)  # dropped below
        counts = torch.zeros(HIST_BINS + 1, dtype=torch.int64, device=self.device)
        counts.scatter_add_(0, index, torch.ones_like(index))
        return counts[:HIST_BINS]

    def stats(self) -> dict:
        """Telemetry as plain Python values (reads the device once)."""
        first = self.candidates[0].metric
        threshold = first.threshold if first is not None and first.kind == "relerr" else None
        fractions = self.format_fractions().tolist()
        formats: dict[str, float] = {}
        for cand, frac in zip(self.candidates, fractions, strict=True):
            name = cand.format.name
            formats[name] = formats.get(name, 0.0) + frac
        return {
            "mor": self.spec.name,
            "decide": partition_text(self.spec.decide),
            "units": self.units,
            "formats": formats,
            "fallback": float(self.fallback_fraction()),
            "mean_rel_error": float(self.chosen_rel_error()),
            "candidate": self.candidates[0].format.name,
            "threshold": threshold,
            "rel_error_hist": self.histogram().tolist(),
        }


# ----------------------------------------------------------------------------------------------
# The MoR quantizer
# ----------------------------------------------------------------------------------------------


def representations(spec: MoRSpec) -> tuple[Representation, ...]:
    """Every representation a rule measures, in ``error_sum`` order: its candidates, then each
    ``relerr(F)`` yardstick that is not one."""
    formats: list[Representation] = [c.format for c in spec.candidates]
    for c in spec.candidates:
        if c.metric is not None and c.metric.versus is not None and c.metric.versus not in formats:
            formats.append(c.metric.versus)
    return tuple(formats)


def mor_quantize(
    x: torch.Tensor,
    spec: MoRSpec,
    *,
    rounding: str = "nearest",
    hadamard: int | RHTSpec | None = None,
    seed: int = 0,
    offset: int = 0,
    group: tuple[int, int] | None = None,
) -> MoRTensor:
    """Quantize ``x`` with the MoR rule ``spec`` (module docstring for every definition).

    x: float32, bfloat16 or float16, any device; viewed as [R, K] like ``quantize`` (empty
    tensors, other dtypes and NaN/Inf raise TensorError). rounding, hadamard, seed and offset
    mean what they mean for ``quantize``; ``group`` is the GAM group shape (None: the tensor).
    Not differentiable, like ``quantize``: ``x`` is detached.
    """
    seed, offset = _check_call(rounding, seed, offset)
    spec_rht = resolve_rht(hadamard)
    if isinstance(x, torch.Tensor):
        x = x.detach()  # not differentiable, like quantize: no graph in the result
    x2 = _as_2d_float32(x)
    if spec_rht is not None:
        x2 = rht(x2, spec_rht)
        _check_finite(x2, "the Hadamard-transformed input")
    x2 = x2.contiguous()
    rows, cols = x2.shape
    dev = x2.device
    scale_block = partition_block(spec.scale, rows, cols)
    unit = partition_block(spec.decide, rows, cols)
    bits = None
    if is_stochastic(rounding):
        n_bits = sr_bits(rounding)
        bits = random_bits(rows * cols, seed, offset, device=dev, bits=n_bits).reshape(rows, cols)

    x64 = x2.to(torch.float64)
    nz = x2 != 0
    abs64 = x64.abs()
    safe = torch.where(nz, abs64, torch.ones_like(abs64))
    nonzero = _block_sum(nz.to(torch.float64), unit).to(torch.int64)

    evaluated = representations(spec)
    scales: dict[Representation, MoRScales] = {}
    codes: dict[Representation, torch.Tensor] = {}
    values: dict[Representation, torch.Tensor] = {}
    sums = []
    for fmt in evaluated:
        if isinstance(fmt, ElementFormat):
            scales[fmt] = mor_scales(x2, fmt, scale_block, spec.scaling, group)
            codes[fmt], values[fmt] = quantize_element(x2, scales[fmt], rounding, bits)
        else:
            values[fmt] = x2.to(HP_DTYPES[fmt.name]).to(torch.float64)
        rel = torch.where(nz, (x64 - values[fmt]).abs() / safe, torch.zeros_like(x64))
        sums.append(tree_sum(rel, unit))
    error_sum = torch.stack(sums)

    # Algorithm 2: the first candidate whose metric accepts the unit, else the last one.
    k = len(spec.candidates)
    choice = torch.full_like(nonzero, k - 1)
    decided = torch.zeros_like(nonzero, dtype=torch.bool)
    n64 = nonzero.to(torch.float64)
    for i, cand in enumerate(spec.candidates[:-1]):
        metric = cand.metric
        assert metric is not None
        err = error_sum[i]
        if metric.kind == "relerr":
            assert metric.threshold is not None
            ok = torch.where(n64 > 0, err / n64.clamp(min=1), torch.zeros_like(err))
            ok = ok < metric.threshold
        elif metric.kind == "relerr_vs":
            assert metric.versus is not None
            ok = (err < error_sum[evaluated.index(metric.versus)]) | (err == 0)
        else:  # range
            assert isinstance(cand.format, ElementFormat)
            amax_u = _tiles(abs64, unit).amax(dim=(1, 3))
            amin_u = _tiles(torch.where(nz, abs64, torch.inf), unit, torch.inf).amin(dim=(1, 3))
            bound = max_finite(cand.format) / cand.format.min_normal
            ok = amax_u < bound * amin_u
        choice = torch.where(ok & ~decided, i, choice)
        decided = decided | ok

    chosen = _expand_to(choice, unit, rows, cols)
    out_codes = torch.zeros((rows, cols), dtype=torch.uint8, device=dev)
    high = torch.zeros((rows, cols), dtype=torch.float32, device=dev)
    cand_scales: list[MoRScales | None] = []
    for i, cand in enumerate(spec.candidates):
        mask = chosen == i
        if isinstance(cand.format, ElementFormat):
            out_codes = torch.where(mask, codes[cand.format], out_codes)
            cand_scales.append(scales[cand.format])
        else:
            high = torch.where(mask, values[cand.format].to(torch.float32), high)
            cand_scales.append(None)

    return MoRTensor(
        spec=spec,
        choice=choice,
        codes=out_codes,
        high=high,
        scales=tuple(cand_scales),
        evaluated=evaluated,
        error_sum=error_sum,
        nonzero=nonzero,
        unit=unit,
        rounding=rounding,
        rht=spec_rht,
        seed=seed,
        offset=offset,
        shape=x.shape,
        dtype=x.dtype,
    )


__all__ = [
    "HIST_BINS",
    "HIST_BIN_WIDTH",
    "SCALINGS",
    "MoRScales",
    "MoRTensor",
    "ideal_scale",
    "mor_quantize",
    "mor_scales",
    "partition_block",
    "partition_text",
    "representations",
    "quantize_element",
    "split_fp32",
    "tree_sum",
]
