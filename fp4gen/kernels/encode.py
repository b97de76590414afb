"""Element encode of the quantize and MoR kernels: scaled fp32 values -> element codes, for every
signed minifloat and rounding (docs/numerics.md 1 and 5; the reference is
``fp4gen.numerics.minifloat``), and the bit stream of packed codes.

``ElementParams`` holds a format's constants, ``ElementEncoder`` one rounding of it: which
software encode (``fp4gen.codegen.quantize.SwEncode``: "rne", "srhalf", "srshift", "sr64",
"floor"), whether codes are packed and signed word by word (SWAR: 4- and 8-bit codes) and
whether a last word may hold fewer codes. The hardware convert, where one equals the contract's
RNE encode, is taken where the caller says (``hw``: the arch has it).

The software encodes, with a = min(|y|, ELEM_MAX) and k = max(floor(log2 a), emin): q =
a * 2^(m - k) is exact and the grid step is 1 in q, so the magnitude code is n + (k - emin) *
2^m for the integer n that q rounds to (n = 2^(m+1) rolls into the next binade). Every encode
returns that code plus ``code_bias`` (mod 2^32), which the packing takes off.

Plain Python methods: they run while a kernel is traced (loops unroll, every index is a
compile-time constant), reading their parameters as Python values.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32

from fp4gen.kernels.quant_ptx import (
    add_rz,
    cvt_f16x2_both,
    cvt_hw,
    cvt_rz_f16x2,
    f16_half_to_f32,
    fma_rn,
    hw_per_word,
    min_abs_f16x2,
    mul_f16x2,
    mul_rn,
    mul_rz,
    prmt,
    sr_step,
    sub_rn,
)

RNE_MAGIC = 8388608.0  # 2^23: adding it rounds a value in [0, 2^22) to an integer
TWO32 = 4294967296.0
HALF_MAGS = 0x00070007  # the magnitude bits of nibble 0 and nibble 4 (the "srhalf" encode)
HALF_SIGNS = 0x00080008  # the sign bits of nibble 0 and nibble 4


@dataclass(frozen=True)
class ElementParams:
    """An element format's constants, every one derived from (exp, man, special)."""

    name: str
    bits: int
    man_bits: int
    emin: int  # 1 - bias: exponent of the smallest normal (and of the subnormals)
    emin_biased: int  # emin + 127, as an fp32 exponent field
    max: float  # largest finite value
    inv_max: float  # fp32(1 / max)
    emax: int  # floor(log2(max)), OCP MX's emax_elem
    code_bias: int  # magnitude code = bits(2^23 + n) + (k + 127) * 2^m - code_bias
    word_bias: int  # code_bias in every lane of a 32-bit word, mod 2^32
    lane_signs: int  # the sign bit of every lane of a 32-bit word
    sign_mask: int  # the sign bit of a code
    hw_cvt: str | None = None  # PTX type of a hardware convert equal to the RNE encode
    # the fp16 image of a 4-bit format with at most 2 mantissa bits ("srhalf"): z = y *
    # half_scale puts the format's grid on fp16's, the code in the fp16 bits from half_code
    half_scale: float = 0.0  # 2^(-14 - emin)
    half_max2: int = 0  # the image of max in both fp16 halves
    half_code: int = 0  # 10 - m: the lowest code bit of an image
    half_rand: int = 0  # the lowest bit of the 8 random bits below it: half_code - 8

    @property
    def lanes(self) -> int:
        """Codes per 32-bit word (SWAR)."""
        return 32 // self.bits

    def lanes_of(self, value: int, n: int) -> int:
        """value repeated in the low n lanes of a word, mod 2^32."""
        return sum(value << (self.bits * j) for j in range(n)) & 0xFFFFFFFF


def pack_bits(fields: list) -> list:
    """Little-endian bit stream of (value, width) fields as 32-bit words (a field may straddle
    two words); values must fit their width."""
    words = []
    pos = 0
    for val, width in fields:
        w, s = divmod(pos, 32)
        while len(words) <= w:
            words.append(None)
        part = val << Uint32(s) if s else val
        words[w] = part if words[w] is None else words[w] | part
        if s + width > 32:
            words.append(val >> Uint32(32 - s))
        pos += width
    return [Uint32(0) if w is None else w for w in words]


def field_magnitudes(fields: list, elem: ElementParams) -> list:
    """|value| of every code held by bit-stream fields of whole codes, in element order (field
    (value, width) holds width // bits codes, element 0 lowest), exact: each code's magnitude
    bits, shifted straight from the field to the top of an fp32 mantissa (one shift and one
    mask), make the fp32 (normal or subnormal) whose value is the code's times 2^(-126 - emin),
    which one exact multiply by a power of two undoes (fp32 subnormals are kept: no flush to
    zero)."""
    bits, man = elem.bits, elem.man_bits
    mask = Uint32((elem.sign_mask - 1) << (23 - man))  # the magnitude bits, placed
    undo = Float32(2.0 ** (126 + elem.emin))
    out = []
    for val, width in fields:
        for j in range(width // bits):
            shift = 23 - man - bits * j  # from the code's place in the field to the mantissa's
            placed = val << Uint32(shift) if shift >= 0 else val >> Uint32(-shift)
            out.append((placed & mask).bitcast(Float32) * undo)
    return out


def error_terms(fields: list, s_b: Float32, az: list, elem: ElementParams, mae: bool) -> list:
    """The block targets' error terms (docs/numerics.md 11.1) of the codes held by ``fields``:
    e(fp32(fp32(|value(code)| * s_b) - |z|)) per code, e = d * d, or |d| for ``mae``; az: |z| =
    |fp32(x * S_enc)| per value (the code's sign is x's, so |q - z| needs no signs). Each
    product and difference is rounded on its own (mul.rn / sub.rn), as the reference: never
    fused into an fma."""
    terms = []
    for v, a in zip(field_magnitudes(fields, elem), az, strict=True):
        d = sub_rn(mul_rn(v, s_b), a)
        terms.append(abs(d) if mae else mul_rn(d, d))
    return terms


def image_error_terms(images: list, s_b: Float32, az: list, elem: ElementParams, mae: bool) -> list:
    """``error_terms`` from the "srhalf" encode's fp16 images (``encode_half``'s ``images``:
    (word, j), values j and j + 2 in its halves) where ``RowwiseParams.half_products`` holds:
    the image's code bits alone are |value(code)| * half_scale in fp16, and one fp16x2
    multiply by s_b (an fp16 value) makes |value| * s_b * half_scale exactly (the products'
    grid, range and significand fit fp16); its fp32 times 1 / half_scale is the exact
    fp32(|value| * s_b), so one fma.rn gives fp32(fp32(|value| * s_b) - |z|): the same d as
    ``error_terms`` in three instructions per value instead of five."""
    mask = Uint32((((1 << (elem.bits - 1)) - 1) << elem.half_code) * 0x10001)
    s2 = cvt_f16x2_both(s_b)
    unscale = Float32(2.0 ** (14 + elem.emin))
    terms: list = [None] * len(az)
    for word, j in images:
        product = mul_f16x2(word & mask, s2)
        for high, i in ((False, j), (True, j + 2)):
            d = fma_rn(f16_half_to_f32(product, high), unscale, -az[i])
            terms[i] = abs(d) if mae else mul_rn(d, d)
    return terms


def keep_lower(better, fields: list, kept: list) -> list:
    """The code fields of a later block target where ``better`` (its error strictly lower),
    else the kept ones (docs/numerics.md 11.1: ties keep the earlier target)."""
    return [
        (cutlass.select_(better, v, kv), w) for (v, w), (kv, _) in zip(fields, kept, strict=True)
    ]


def shift_down(v: Uint32, n: int) -> Uint32:
    """v >> n, or v << -n for a negative n."""
    if n > 0:
        return v >> Uint32(n)
    return v << Uint32(-n) if n < 0 else v


class ElementEncoder:
    """One rounding of an element format: ``encode_elements(ys, rand, hw)`` gives the codes of
    scaled values as (value, width) fields of a bit stream, in element order."""

    def __init__(
        self, elem: ElementParams, rounding: str, sw_encode: str, swar: bool, partial: bool = False
    ) -> None:
        self.e = elem
        self.rounding = rounding
        self.sw_encode = sw_encode
        self.swar = swar
        self.partial = partial  # a last word may hold fewer codes
        self.sr = rounding.startswith("stochastic")
        self.sr_bits = {"stochastic16": 16, "stochastic8": 8}.get(rounding, 32)

    # ---- one value
    def elem_raw(self, y: Float32, r: Uint32 | None = None) -> Uint32:
        """The magnitude code of y plus ``code_bias`` (mod 2^32), saturating, in this rounding
        (r: the value's random field). "rne": one FFMA q + 2^23 rounds to nearest even (with
        m >= 1 rint's even integer is the even code). "sr64": q * 2^32 truncated to 64 bits has
        floor(q) in its high word and floor(frac * 2^32) in its low word; round up iff r < the
        low word, by one borrow. "srshift": z = a * 2^(-126 - emin) rounded toward zero maps the
        format's grid onto fp32's (its subnormals onto fp32 subnormals), so bits(z) >> (23 - m)
        is the code of floor and the bits below are floor(frac * 2^(23 - m)); r added at the top
        of those carries into the code iff floor(frac * 2^bits) + r >= 2^bits. "floor": 2^23
        +rz q gives floor(q), frac = q - floor(q) is exact; round up iff r < floor(frac * 2^32)
        (stochastic), frac > 1/2 or a tie on an odd code (nearest), never (zero)."""
        e = self.e
        a = cute.arch.fmin(abs(y), Float32(e.max))
        if self.sw_encode == "srshift":
            z = mul_rz(a, Float32(2.0 ** (-126 - e.emin)))
            up = r << Uint32(23 - e.man_bits - self.sr_bits)  # r at the top of the bits below
            return ((z.bitcast(Uint32) + up) >> Uint32(23 - e.man_bits)) + Uint32(e.code_bias)
        two_k = cutlass.max(a.bitcast(Uint32) & Uint32(0x7F800000), Uint32(e.emin_biased << 23))
        if self.sw_encode == "sr64":
            p = (Uint32((e.man_bits + 286) << 23) - two_k).bitcast(Float32)  # 2^(m - k + 32)
            e_off = (two_k >> Uint32(23 - e.man_bits)) + Uint32(0x4B000000)
            # ~r: free where r comes out of a LOP3 (Philox words 0 and 2)
            return sr_step(a * p, r ^ Uint32(0xFFFFFFFF), e_off)  # a * p = q * 2^32, exact
        p = (Uint32((e.man_bits + 254) << 23) - two_k).bitcast(Float32)  # 2^(m - k)
        e_off = two_k >> Uint32(23 - e.man_bits)  # (k + 127) * 2^m
        if self.sw_encode == "rne":
            return (a * p + Float32(RNE_MAGIC)).bitcast(Uint32) + e_off  # bits(2^23 + rint(q))
        q = a * p  # exact
        t = add_rz(q, Float32(RNE_MAGIC))  # 2^23 + floor(q)
        raw = t.bitcast(Uint32) + e_off
        if self.rounding == "zero":
            return raw
        if self.sr:
            # frac * 2^32 = q * 2^32 - floor(q) * 2^32, every step exact; the cvt truncates
            floor32 = t * Float32(TWO32) - Float32(2.0**55)
            up = r < Uint32(q * Float32(TWO32) - floor32)
            return raw + cutlass.select_(up, Uint32(1), Uint32(0))
        frac = q - (t - Float32(RNE_MAGIC))
        half = Float32(0.5)
        odd = ((raw ^ Uint32(e.code_bias)) & Uint32(1)) != Uint32(0)  # the code below is odd
        return raw + cutlass.select_((frac > half) | ((frac == half) & odd), Uint32(1), Uint32(0))

    # ---- signs
    def sign_word(self, ys: list) -> Uint32:
        """The sign of each of ys (one word's lanes) at its lane's sign bit (other bits garbage).
        Byte 3 of an fp32 holds its sign: 4-bit codes take two byte gathers per 4 values, the
        second replicating each sign over its byte; 8-bit codes one gather."""
        yb = [y.bitcast(Uint32) for y in ys]
        if self.e.bits == 4:
            even = prmt(prmt(yb[0], yb[2], 0x0073), prmt(yb[4], yb[6], 0x0073), 0xDC98)
            odd = prmt(prmt(yb[1], yb[3], 0x0073), prmt(yb[5], yb[7], 0x0073), 0xDC98)
            return (odd & Uint32(0x80808080)) | (even & Uint32(0x08080808))
        return prmt(prmt(yb[0], yb[1], 0x0073), prmt(yb[2], yb[3], 0x0073), 0x5410)

    def with_sign(self, mag: Uint32, y: Float32) -> Uint32:
        """Add y's sign bit to a magnitude code, a zero magnitude included (y comes from
        scale_value: its sign bit is x < 0)."""
        return mag | ((y.bitcast(Uint32) >> Uint32(32 - self.e.bits)) & Uint32(self.e.sign_mask))

    # ---- many values
    def encode_elements(
        self,
        ys: list,
        rand,
        hw: bool,
        folded: bool = False,
        images: list | None = None,
    ) -> list:
        """Codes of the scaled values ys as (value, width) bit-stream fields, in element order;
        rand: the values' random fields (the Philox words for "srhalf"), None for a
        deterministic rounding; hw: take the hardware convert (where it gives this rounding);
        images: a list that the "srhalf" encode fills with its fp16 images."""
        if self.sw_encode == "srhalf":
            return self.encode_half(ys, rand, folded, images)
        e = self.e
        if e.hw_cvt and self.rounding == "nearest" and hw:
            return self.encode_hw(ys)
        if self.swar:
            # LANES codes per 32-bit word: sum raw_j * 2^(bits * j) by shift-adds, then take all
            # the code_bias terms off at once (mod 2^32); the sign bits of ys on every code, zero
            # magnitudes included (ys come from scale_value: the sign bit is x < 0)
            lanes = e.lanes
            fields = []
            for i in range(0, len(ys), lanes):
                if self.partial:
                    n = min(lanes, len(ys) - i)  # a short last word: the padding lanes masked off
                    raws = [
                        self.elem_raw(ys[i + j], rand[i + j] if self.sr else None) for j in range(n)
                    ]
                    w = raws[-1]
                    for raw in reversed(raws[:-1]):
                        w = (w << Uint32(e.bits)) + raw
                    w = w - Uint32(e.lanes_of(e.code_bias, n))
                    group = ys[i : i + n] + [ys[i]] * (lanes - n)
                    signs = self.sign_word(group) & Uint32(e.lanes_of(e.sign_mask, n))
                    fields.append((w | signs, n * e.bits))
                else:
                    raws = [
                        self.elem_raw(ys[i + j], rand[i + j] if self.sr else None)
                        for j in range(lanes)
                    ]
                    w = raws[-1]
                    for raw in reversed(raws[:-1]):
                        w = (w << Uint32(e.bits)) + raw
                    w = w - Uint32(e.word_bias)
                    fields.append(
                        (w | (self.sign_word(ys[i : i + lanes]) & Uint32(e.lane_signs)), 32)
                    )
            return fields
        return [
            (
                self.with_sign(
                    self.elem_raw(ys[i], rand[i] if self.sr else None) - Uint32(e.code_bias), ys[i]
                ),
                e.bits,
            )
            for i in range(len(ys))
        ]

    def encode_hw(self, ys: list) -> list:
        """The hardware convert's codes (RNE, satfinite) as bit-stream fields."""
        e = self.e
        per_word = hw_per_word(e.hw_cvt)
        fields = []
        for i in range(0, len(ys), per_word):
            if self.partial:
                n = min(per_word, len(ys) - i)  # a short last word: zeros fill the cvt
                group = ys[i : i + n] + [Float32(0.0)] * (per_word - n)
                w = cvt_hw(group, e.hw_cvt)
            else:
                n = per_word
                w = cvt_hw(ys[i : i + per_word], e.hw_cvt)
            if e.bits == 6:
                # four 6-bit codes from the low 6 bits of each byte -> 24 bits
                w = (
                    (w & Uint32(0x3F))
                    | ((w >> Uint32(2)) & Uint32(0xFC0))
                    | ((w >> Uint32(4)) & Uint32(0x3F000))
                    | ((w >> Uint32(6)) & Uint32(0xFC0000))
                )
                if self.partial:
                    fields.append((w if n == 4 else w & Uint32((1 << (6 * n)) - 1), 6 * n))
                else:
                    fields.append((w, 24))
            elif self.partial:
                width = n * e.bits
                fields.append((w if width == 32 else w & Uint32((1 << width) - 1), width))
            else:
                fields.append((w, 32))
        return fields

    def encode_half(
        self,
        ys: list,
        rand,
        folded: bool = False,
        images: list | None = None,
    ) -> list:
        """The "srhalf" encode of 4-bit codes with 8 random bits per value; rand: the Philox
        words of ys (byte j of word w for value 4 w + j).

        Eight values per code word, two per fp16x2 image: values j and j + 2 (j = 0, 1, 4, 5)
        share a word, so their random bytes (j % 4 and j % 4 + 2 of a Philox word) are 16 bits
        apart as well and one mask and shift puts both below their codes. Adding them carries
        into a code iff floor(frac * 2^8) + r >= 2^8 (docs/numerics.md 5). Image n of the word
        lands in nibbles n and n + 4, which leaves the bytes in the order 0 2 1 3: one byte
        permute fixes it. ``folded``: ys are already the images' values (half_scale folded into
        the encode factor). ``images``: where given, each image after its random bits were added
        is appended as (word, j): values j (low half) and j + 2 (high half) of ys, their code
        bits in place (``image_error_terms``)."""
        e = self.e
        fields = []
        for i in range(0, len(ys), 8):
            # y * half_scale is exact (a tiny z encodes as a zero magnitude, its sign kept)
            z = ys[i : i + 8] if folded else [y * Float32(e.half_scale) for y in ys[i : i + 8]]
            mags = None
            signs = None
            for n, j in enumerate((0, 1, 4, 5)):
                word = rand[(i + j) // 4]
                if j % 2:  # random bytes 1 and 3
                    r = (word & Uint32(0xFF00FF00)) >> Uint32(8 - e.half_rand)
                else:  # random bytes 0 and 2
                    r = shift_down(word & Uint32(0x00FF00FF), -e.half_rand)
                # |image| saturated at max's (the sign of z kept), plus the random bits
                h = min_abs_f16x2(cvt_rz_f16x2(z[j + 2], z[j]), Uint32(e.half_max2)) + r
                if images is not None:
                    images.append((h, i + j))
                # to nibbles n and n + 4: the codes from bit half_code, the signs from bit 15
                mag = shift_down(h, e.half_code - 4 * n) & Uint32(HALF_MAGS << 4 * n)
                sign = shift_down(h, 12 - 4 * n) & Uint32(HALF_SIGNS << 4 * n)
                mags = mag if mags is None else mags | mag
                signs = sign if signs is None else signs | sign
            # the sign bits on every code, zero magnitudes included: cvt.rz keeps the sign of a
            # value that becomes (or is) -0.0, and the values come from scale_value (sign bit:
            # x < 0), with half_scale applied by an exact or sign-keeping multiply
            w = mags | signs
            fields.append((prmt(w, w, 0x3120), 32))
        return fields


__all__ = [
    "ElementEncoder",
    "ElementParams",
    "RNE_MAGIC",
    "TWO32",
    "error_terms",
    "field_magnitudes",
    "image_error_terms",
    "keep_lower",
    "pack_bits",
    "shift_down",
]
