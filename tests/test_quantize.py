"""The quantizer against the numerics contract, implemented here with numpy float32 scalars."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp4gen.dsl.model import RHTSpec
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import E2M1, E4M3, E5M2, UE8M0, BlockFormat, ScaleSpec
from fp4gen.numerics.hadamard import inverse_rht, rht
from fp4gen.numerics.layout import swizzle_scales, unpack
from fp4gen.numerics.philox import random_bits
from fp4gen.numerics.quantize import QuantizedTensor, quantize
from fp4gen.runtime import quantize_dispatch

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)

# ----------------------------------------------------------------------------------------------
# Independent reference (scalar numpy float32; every operation rounds to float32)
# ----------------------------------------------------------------------------------------------

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # magnitude code = index


def e2m1_rne(v: float) -> int:
    """Magnitude code of |y| <= 6 by the contract's thresholds (section 1)."""
    for code, limit, inclusive in [
        (0, 0.25, True),
        (1, 0.75, False),
        (2, 1.25, True),
        (3, 1.75, False),
        (4, 2.5, True),
        (5, 3.5, False),
        (6, 5.0, True),
    ]:
        if v < limit or (inclusive and v == limit):
            return code
    return 7


def minifloat_grid(e: int, m: int, top_mantissas: int) -> list[float]:
    """Non-negative values of a signed ExMy by magnitude code; the top exponent has only
    ``top_mantissas`` finite mantissas (e4m3fn: 7, e5m2: 0 since its top exponent is Inf/NaN)."""
    bias = 2 ** (e - 1) - 1
    out = [k / 2**m * 2.0 ** (1 - bias) for k in range(2**m)]
    for ef in range(1, 2**e):
        n = 2**m if ef < 2**e - 1 else top_mantissas
        out += [(1 + k / 2**m) * 2.0 ** (ef - bias) for k in range(n)]
    return out


E4M3_VALUES = minifloat_grid(4, 3, 7)  # 0 .. 448, codes 0..126
E5M2_VALUES = minifloat_grid(5, 2, 0)  # 0 .. 57344, codes 0..123
assert E4M3_VALUES[-1] == 448.0 and E5M2_VALUES[-1] == 57344.0


def nearest_even(v: float, values: list[float]) -> int:
    """Nearest grid index by float64 distance (exact here), ties to the even index."""
    v = min(v, values[-1])
    best = min(range(len(values)), key=lambda i: (abs(values[i] - v), i % 2))
    return best


def pow2_up(d: F32) -> int:
    """Biased ue8m0 code of the smallest power of two >= d, clamped to [2^-127, 2^127]."""
    if d == 0:
        return 0
    mant, exp = math.frexp(float(d))  # d = mant * 2^exp, mant in [0.5, 1)
    k = exp - 1 if mant == 0.5 else exp
    return min(max(k + 127, 0), 254)


class Elem:
    """Element format of the reference: name, max, magnitude rounding, sign-bit position."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "e2m1":
            self.max, self.values, self.sign = F32(6), E2M1_VALUES, 8
            self.round = e2m1_rne
        elif name == "e4m3":
            self.max, self.values, self.sign = F32(448), E4M3_VALUES, 0x80
            self.round = lambda v: nearest_even(v, E4M3_VALUES)
        else:
            self.max, self.values, self.sign = F32(57344), E5M2_VALUES, 0x80
            self.round = lambda v: nearest_even(v, E5M2_VALUES)


def ref_quantize(
    x: np.ndarray,
    elem: Elem,
    scale: str,  # "e4m3" (RNE), "ue8m0_up", "ue8m0_ocp"
    global_scale: bool,
    block: tuple[int, int],
    sr_bits: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, F32]:
    """(codes, block scale values, block scale codes, S_dec) per the contract's order."""
    x = x.astype(np.float32)
    rows, cols = x.shape
    br, bc = block
    nbr, nbc = -(-rows // br), -(-cols // bc)
    scale_max = F32(448) if scale == "e4m3" else F32(2.0**127)
    with np.errstate(over="ignore", divide="ignore"):
        if global_scale:
            amax = F32(np.abs(x).max())
            s_enc = F32(1) if amax == 0 else F32(scale_max * elem.max) / amax
            s_enc = min(s_enc, FLT_MAX)
            if s_enc == 0:
                s_enc = F32(1)
        else:
            s_enc = F32(1)
        s_dec = F32(1) / s_enc
        inv = F32(1) / elem.max
        codes = np.zeros((rows, cols), dtype=np.uint8)
        s_vals = np.zeros((nbr, nbc), dtype=np.float32)
        s_codes = np.zeros((nbr, nbc), dtype=np.uint8)
        for bi in range(nbr):
            for bj in range(nbc):
                blk = x[bi * br : (bi + 1) * br, bj * bc : (bj + 1) * bc]
                amax_b = F32(np.abs(blk).max())
                d = min(amax_b * F32(s_enc * inv), scale_max)
                if scale == "e4m3":
                    sc = nearest_even(float(d), E4M3_VALUES)
                    s = F32(E4M3_VALUES[sc])
                elif scale == "ue8m0_up":
                    sc = pow2_up(d)
                    s = F32(2.0 ** (sc - 127))
                else:  # OCP: 2^(floor(log2(amax * S_enc)) - emax_elem)
                    v = amax_b * s_enc
                    emax = math.frexp(float(elem.max))[1] - 1
                    sc = 0 if v == 0 else min(max(math.frexp(float(v))[1] - 1 - emax + 127, 0), 254)
                    s = F32(2.0 ** (sc - 127))
                s_vals[bi, bj], s_codes[bi, bj] = s, sc
                e_b = min(F32(1) / F32(s * s_dec), FLT_MAX)
                for i in range(blk.shape[0]):
                    for j in range(blk.shape[1]):
                        r, c = bi * br + i, bj * bc + j
                        y = F32(blk[i, j] * e_b)
                        y = min(max(y, -elem.max), elem.max)
                        if sr_bits is None:
                            mag = elem.round(abs(float(y)))
                        else:  # stochastic: hi iff r < floor(frac * 2^32)
                            vals = elem.values
                            a = abs(float(y))
                            lo = max(k for k in range(len(vals)) if vals[k] <= a)
                            if vals[lo] == a:
                                mag = lo
                            else:
                                frac = (a - vals[lo]) / (vals[lo + 1] - vals[lo])  # exact
                                t = math.floor(frac * 2**32)
                                mag = lo + 1 if int(sr_bits[r, c]) < t else lo
                        # the sign of x: also on a zero magnitude, and where x * e_b
                        # underflows to -0.0; -0.0 is code 0
                        codes[r, c] = mag | (elem.sign if blk[i, j] < 0 else 0)
    return codes, s_vals, s_codes, s_dec


def assert_matches(qt: QuantizedTensor, ref: tuple) -> None:
    codes, s_vals, s_codes, s_dec = ref
    assert torch.equal(qt.codes, torch.from_numpy(codes))
    assert qt.scales.dtype == torch.float32
    assert torch.equal(qt.scales, torch.from_numpy(s_vals))
    assert qt.scale_codes is not None
    assert torch.equal(qt.scale_codes, torch.from_numpy(s_codes))
    assert qt.global_scale.dtype == torch.float32 and qt.global_scale.dim() == 0
    assert qt.global_scale.item() == float(s_dec)


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def gaussian(rows: int, cols: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * scale


def heavy_tailed(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) / torch.rand(rows, cols, generator=g).clamp_min(1e-3)
    return t * torch.exp2(torch.randint(-8, 8, (rows, 1), generator=g).float())


def outlier_beside_tiny() -> torch.Tensor:
    # One huge value: most blocks get e4m3-subnormal or zero scales relative to it.
    x = gaussian(48, 64, 3, 1e-4)
    x[5, 7] = 3.0e4
    x[20:22, :] *= 1e-3
    x[30, :16] = 0.0
    return x


def subnormal_scales() -> torch.Tensor:
    # A = 2688 makes S_enc = 1 and d_b = amax_b / 6 (up to fp32 rounding): pick block maxima
    # whose scales land on the e4m3 subnormal grid (multiples of 2^-9), its ties and below it.
    ds = [1.0, 2.0, 1.5, 2.5, 0.5, 0.49, 0.51, 0.7, 3.0, 5.5, 7.0, 7.5, 8.5, 13.0, 0.25, 0.0]
    x = torch.zeros(len(ds) + 1, 16)
    x[0, 0] = 2688.0
    for i, d in enumerate(ds):
        row = torch.linspace(-1, 1, 16) * (6 * d * 2.0**-9)
        x[i + 1] = row
    return x


def order_sensitive() -> torch.Tensor:
    # With S_enc = 1, amax = nextbelow(7.125): amax / 6 lies just below the e4m3 midpoint
    # 1.1875 (-> 1.125), but amax * fp32(1/6) rounds onto it and the tie goes to the even code
    # (-> 1.25). Only the contract's order gives 1.25.
    x = torch.zeros(2, 16)
    x[0, 0] = 2688.0
    x[1, 3] = float(np.nextafter(F32(7.125), F32(0)))
    return x


NVFP4_CASES = {
    "order_sensitive": order_sensitive,
    "zeros": lambda: torch.zeros(32, 48),
    "gaussian_272x304": lambda: gaussian(272, 304, 0, 3.0),
    "heavy_272x304": lambda: heavy_tailed(272, 304, 1),
    "outlier": outlier_beside_tiny,
    "subnormal_scales": subnormal_scales,
    "ragged_37x50": lambda: heavy_tailed(37, 50, 2),
}


@pytest.mark.parametrize("case", list(NVFP4_CASES))
@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_bit_exact(case: str, block: tuple[int, int], dtype: torch.dtype) -> None:
    x = NVFP4_CASES[case]().to(dtype)
    qt = quantize(x, "nvfp4", block=block)
    ref = ref_quantize(x.float().numpy(), Elem("e2m1"), "e4m3", True, block)
    assert_matches(qt, ref)
    assert qt.shape == x.shape and qt.dtype == dtype
    assert qt.format.block == block


def test_nvfp4_edge_cases_have_the_intended_scales() -> None:
    qt = quantize(subnormal_scales(), "nvfp4")
    assert qt.global_scale.item() == 1.0
    got = (qt.scales[1:, 0] * 2.0**9).tolist()  # in units of the smallest e4m3 subnormal
    # d = 1.5 and 2.5 are ties (to the even codes 2 and 2), 0.5 ties to 0, 0.49 -> 0, 0.51 -> 1.
    assert got[:8] == [1.0, 2.0, 2.0, 2.0, 0.0, 0.0, 1.0, 1.0]
    assert got[-1] == 0.0
    assert quantize(order_sensitive(), "nvfp4").scales[1, 0].item() == 1.25
    zeros = quantize(torch.zeros(4, 32), "nvfp4")
    assert zeros.global_scale.item() == 1.0
    assert not zeros.codes.any() and not zeros.scales.any()
    assert not zeros.dequantize().any()
    # A zero scale (block far below the amax): e_b = FLT_MAX, codes saturate, values are 0.
    out = quantize(outlier_beside_tiny(), "nvfp4")
    zero_blocks = out.scales == 0
    assert zero_blocks.any()
    assert not out.dequantize().reshape(48, 4, 16)[zero_blocks].any()


@pytest.mark.parametrize(
    "name,elem,scale",
    [
        ("mxfp4", "e2m1", "ue8m0_up"),
        ("mxfp8_e4m3", "e4m3", "ue8m0_up"),
        ("mxfp8_e5m2", "e5m2", "ue8m0_up"),
    ],
)
@pytest.mark.parametrize("case", ["gaussian", "heavy", "outlier", "zeros"])
def test_mx_bit_exact(name: str, elem: str, scale: str, case: str) -> None:
    x = {
        "gaussian": lambda: gaussian(40, 96, 5, 0.01),
        "heavy": lambda: heavy_tailed(33, 70, 6),
        "outlier": outlier_beside_tiny,
        "zeros": lambda: torch.zeros(3, 64),
    }[case]()
    qt = quantize(x, name)
    assert_matches(qt, ref_quantize(x.numpy(), Elem(elem), scale, False, (1, 32)))
    assert qt.global_scale.item() == 1.0


def test_mx_ocp_scale_rounding() -> None:
    x = heavy_tailed(20, 64, 7)
    for elem, element in (("e4m3", E4M3), ("e2m1", E2M1)):
        fmt = BlockFormat("mx_ocp", element, (1, 32), ScaleSpec(UE8M0, "ocp"))
        qt = quantize(x, fmt)
        assert_matches(qt, ref_quantize(x.numpy(), Elem(elem), "ue8m0_ocp", False, (1, 32)))


def test_stochastic_rounding_bit_exact() -> None:
    x = heavy_tailed(24, 40, 8)
    seed, offset = 2024, 17
    bits = random_bits(24 * 40, seed, offset).reshape(24, 40).numpy()
    qt = quantize(x, "nvfp4", rounding="stochastic", seed=seed, offset=offset)
    ref = ref_quantize(x.numpy(), Elem("e2m1"), "e4m3", True, (1, 16), sr_bits=bits)
    assert_matches(qt, ref)
    qt8 = quantize(x, "mxfp8_e4m3", rounding="stochastic", seed=seed, offset=offset)
    ref8 = ref_quantize(x.numpy(), Elem("e4m3"), "ue8m0_up", False, (1, 32), sr_bits=bits)
    assert_matches(qt8, ref8)


def test_round_toward_zero_never_grows() -> None:
    x = heavy_tailed(16, 64, 9)
    qt = quantize(x, "nvfp4", rounding="zero")
    near = quantize(x, "nvfp4")
    assert torch.equal(qt.scales, near.scales)  # element rounding does not touch the scales
    y = (x * qt.block_values(qt.encode_scales)).clamp(-6, 6)
    q = torch.tensor(E2M1_VALUES + [-v for v in E2M1_VALUES])[qt.codes.long()]
    assert torch.all(q.abs() <= y.abs()) and torch.all(q * y >= 0)
    assert torch.all((qt.codes & 7) <= (near.codes & 7))
    assert torch.any((qt.codes & 7) < (near.codes & 7))


def test_dequantize_formula_and_shapes() -> None:
    x = heavy_tailed(6, 48, 10).reshape(2, 3, 48)
    qt = quantize(x, "nvfp4")
    assert qt.codes.shape == (6, 48) and qt.scales.shape == (6, 3)
    q = torch.tensor(E2M1_VALUES + [-v for v in E2M1_VALUES])[qt.codes.long()]
    s = qt.scales.repeat_interleave(16, 1)
    want = (q * s) * qt.global_scale  # fp32(fp32(q * s_b) * S_dec)
    assert torch.equal(qt.dequantize(), want.reshape(2, 3, 48))
    assert qt.dequantize().shape == (2, 3, 48)
    one_d = quantize(torch.linspace(-3, 3, 40), "mxfp4")
    assert one_d.codes.shape == (1, 40) and one_d.dequantize().shape == (40,)
    assert torch.equal(unpack(qt.data, 4, 48), qt.codes)
    half = quantize(x.half(), "nvfp4")
    assert torch.equal(half.codes, quantize(x.half().float(), "nvfp4").codes)


def test_2d_transpose_is_the_transposed_quantization() -> None:
    x = heavy_tailed(40, 72, 11)
    qt = quantize(x, "nvfp4", block=(16, 16))
    t = qt.transpose()
    assert torch.equal(t.codes, qt.codes.T) and torch.equal(t.scales, qt.scales.T)
    assert torch.equal(t.scale_codes, qt.scale_codes.T)
    assert t.global_scale.item() == qt.global_scale.item()
    assert torch.equal(t.dequantize(), qt.dequantize().T)
    assert t.shape == (72, 40) and t.transposed and not t.transpose().transposed
    # 16x16 tiles are symmetric under transposition, so quantizing x.T gives the same tensor.
    direct = quantize(x.T.contiguous(), "nvfp4", block=(16, 16))
    assert torch.equal(direct.codes, t.codes) and torch.equal(direct.scales, t.scales)
    with pytest.raises(TensorError, match="needs 2D blocks"):
        quantize(x, "nvfp4").transpose()


def test_swizzled_scales_replicate_2d_tiles() -> None:
    x = heavy_tailed(40, 64, 12)
    one = quantize(x, "nvfp4")
    assert torch.equal(one.swizzled_scales(), swizzle_scales(one.scale_codes))
    two = quantize(x, "nvfp4", block=(16, 16))
    per_row = two.scale_codes.repeat_interleave(16, 0)[:40]
    assert torch.equal(two.swizzled_scales(), swizzle_scales(per_row))
    fp32_scales = BlockFormat("f32s", E5M2, (1, 32), ScaleSpec(None))
    with pytest.raises(TensorError, match="no tensor-core swizzled layout"):
        quantize(x, fp32_scales).swizzled_scales()


def test_fp32_block_scales() -> None:
    x = heavy_tailed(8, 64, 13)
    fmt = BlockFormat("f32s", E4M3, (1, 32), ScaleSpec(None))
    qt = quantize(x, fmt)
    assert qt.scale_codes is None
    amax = x.abs().reshape(8, 2, 32).amax(-1)
    inv = torch.tensor(1.0) / torch.tensor(448.0)
    assert torch.equal(qt.scales, amax * inv)  # s_b = d_b, no rounding


def test_rht_quantize_is_quantize_of_rotated() -> None:
    x = heavy_tailed(20, 64, 14)
    for had, spec in [(16, RHTSpec(16)), (32, RHTSpec(32, "none", None, None))]:
        qt = quantize(x, "nvfp4", hadamard=had)
        assert qt.rht == spec
        plain = quantize(rht(x, spec), "nvfp4")
        assert torch.equal(qt.codes, plain.codes) and torch.equal(qt.scales, plain.scales)
        assert torch.equal(qt.dequantize(rotated=True), plain.dequantize())
        assert torch.equal(qt.dequantize(), inverse_rht(plain.dequantize(), spec))
    seeded = RHTSpec(16, "seeded", None, 5)
    assert quantize(x, "nvfp4", hadamard=seeded).rht == seeded
    with pytest.raises(TensorError, match="undefined with an RHT"):
        quantize(x, "nvfp4", block=(16, 16), hadamard=16).transpose()


# ----------------------------------------------------------------------------------------------
# Error paths
# ----------------------------------------------------------------------------------------------


def test_error_empty() -> None:
    with pytest.raises(TensorError, match=r"empty tensor of shape \(0, 16\)"):
        quantize(torch.zeros(0, 16), "nvfp4")


def test_error_device() -> None:
    with pytest.raises(TensorError, match="on device meta: the reference runs on cpu or cuda"):
        quantize(torch.zeros(2, 16, device="meta"), "nvfp4")


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn])
def test_error_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(TensorError, match=f"cannot quantize a {dtype} tensor"):
        quantize(torch.zeros(2, 16).to(dtype), "nvfp4")


def test_error_non_finite() -> None:
    x = torch.ones(2, 3, 16)
    x[1, 2, 5] = math.nan
    x[1, 2, 9] = math.inf
    x[0, 1, 0] = -math.inf
    with pytest.raises(TensorError, match=r"3 non-finite value\(s\).*first at index \(0, 1, 0\)"):
        quantize(x, "nvfp4")
    big = torch.full((1, 16), 3.0e38)  # finite, but the butterflies overflow
    with pytest.raises(TensorError, match="Hadamard-transformed input has 16 non-finite"):
        quantize(big, "nvfp4", hadamard=16)


def test_error_rht_width() -> None:
    with pytest.raises(TensorError, match=r"multiple of 16.*shape \(4, 40\)"):
        quantize(torch.ones(4, 40), "nvfp4", hadamard=16)


def test_error_backend_and_format() -> None:
    x = torch.ones(2, 16)
    by_backend = quantize_dispatch.quantize  # the oracle has no backend argument
    with pytest.raises(FP4GenError, match="'cute' backend .* not available: it runs on CUDA"):
        by_backend(x, "nvfp4", backend="cute")
    assert torch.equal(
        by_backend(x, "nvfp4", backend="reference").codes,
        by_backend(x, "nvfp4", backend="auto").codes,
    )
    with pytest.raises(ValueError, match="backend must be one of"):
        by_backend(x, "nvfp4", backend="triton")
    with pytest.raises(TensorError, match="bf16 is a high-precision dtype, not a quantized"):
        quantize(x, "bf16")
    with pytest.raises(ValueError, match="unknown format 'nvfp5'"):
        quantize(x, "nvfp5")
    with pytest.raises(ValueError, match="rounding must be one of"):
        quantize(x, "nvfp4", rounding="up")
    with pytest.raises(ValueError, match="seed must be an integer"):
        quantize(x, "nvfp4", seed=-1)
    with pytest.raises(ValueError, match="blocks are 1xN or NxN"):
        quantize(x, "nvfp4", block=(2, 16))


def test_e5m2_and_e4m3_elements_are_signed_bytes() -> None:
    x = torch.tensor([[-1.0, 1.0] * 16])
    for name, sign in (("mxfp8_e4m3", 0x80), ("mxfp8_e5m2", 0x80), ("mxfp4", 0x8)):
        qt = quantize(x, name)
        assert int(qt.codes[0, 0]) == int(qt.codes[0, 1]) | sign
    assert E4M3.bits == 8 and E5M2.bits == 8
