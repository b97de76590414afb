"""The rowwise quantize kernels: one rowwise copy of a compact row-major [M, K] tensor with 1xN
blocks, for every element and scale format, rounding, input dtype, global scale, RHT and scale
layout (docs/numerics.md sections 1-5 and 7, bit for bit; the reference is
``fp4gen.numerics.quantize``).

Thread mapping: [M, K] is a flat sequence of M * K / unit units of ``unit`` contiguous elements
(whole blocks: a thread owns them; or ``threads_per_block`` consecutive lanes share a block and
combine its amax with butterfly shuffles). The v-th unit of a thread is cta * (T * V) + v * T +
tid, so each load and store instruction of a warp covers one contiguous span. Loads are clamped
to the last unit (no predicates), stores are predicated. The flat element index u * unit + j is
also row * K + col.

Kernels, in launch order:

* ``RowwiseAmaxKernel`` (with a global scale): A = max |x| (of the RHT'd values with an RHT) over
  the tensor into a zeroed fp32 [1] buffer: registers -> warp shuffles -> shared memory -> one
  atomic max per CTA. Every max propagates NaN and the atomic max of the fp32 bits keeps a NaN
  or an Inf.
* ``RowwiseQuantizeKernel``: per block amax_b, scale code s_b, encode factor e_b, element codes;
  writes the packed codes, the scale codes (and the swizzled 128x4 copy) and S_dec. Without a
  global scale S_dec is 1.0 from the host and a thread whose blocks hold a NaN or an Inf stores
  NaN over it.

The block-scale options of docs/numerics.md 11 (block targets, stochastic block scales, MS-EDEN:
``quantize_unit_choice``; per-row global scales: ``row_amaxes`` and a global scale per unit),
RHT signs drawn per layer or step (12: ``RowwiseAmaxSignsKernel`` and the quantize kernel take
them as arguments, ``bind_signs``) and an RHT wider than a thread's values (``rht_across_lanes``)
are fields of ``RowwiseParams`` too; a spec without them traces exactly the code it always did.

Every variant is a field of ``RowwiseParams``, read as a Python value while the kernel is traced
(``cutlass.const_expr`` in the kernel bodies). What differs in the compiled function's arguments
(a swizzled copy, the global amax, the Philox scalars) is the generated module's entry: its
subclasses spell ``__call__`` and ``kernel`` with exactly the spec's arguments and hand them to
``launch`` and ``body`` here, None for what the spec does not have.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, Uint16, Uint32, const_expr, range_constexpr

from fp4gen.kernels.encode import (
    ElementEncoder,
    ElementParams,
    error_terms,
    field_magnitudes,
    image_error_terms,
    keep_lower,
    pack_bits,
)
from fp4gen.kernels.hadamard import butterflies, signed_butterflies, xor_signed_butterflies
from fp4gen.kernels.philox import (
    philox4x32_10,
    philox_keys,
    philox_offset,
    random_fields,
    random_words,
)
from fp4gen.kernels.quant_ptx import (
    add_rn,
    bf16x2_absmax,
    cvt_bf16x2,
    f16_half_to_f32,
    mul_rn,
    scale_value,
)
from fp4gen.kernels.scale import (
    NAN_BITS,
    NONFINITE_BITS,
    BlockScaler,
    ScaleParams,
    global_scales,
    scale_word,
    target_factors,
)
from fp4gen.vocab import DTYPES

_STORE_TYPES = {4: Uint32, 2: Uint16, 1: Uint8}


@dataclass(frozen=True)
class RowwiseParams:
    """Everything the rowwise kernels depend on besides their tensors: compile-time constants."""

    input_dtype: str  # "bf16", "fp16" or "fp32"
    block: int  # 1 x block blocks along K
    elem: ElementParams
    scale: ScaleParams
    rounding: str  # a Rounding word
    sw_encode: str  # the software encode (a SwEncode word)
    swar: bool  # whole codes per 32-bit word: pack and sign them word by word
    sr_bits: int  # random bits per value; 0: a deterministic rounding
    rand_words: bool  # the encode takes whole Philox words ("srhalf"), else one field per value
    hw_archs: tuple[str, ...]  # arches whose hardware convert gives this rounding's codes
    global_scale: bool  # an fp32 per-tensor scale from the tensor's amax
    global_num: float  # fp32(scale max * element max), S_enc's numerator
    swizzled: bool  # scales also in the swizzled 128x4 layout
    rht_size: int  # size of the row RHT before every amax; 0: none
    rht_signs: tuple[int, ...]  # +1 / -1 per RHT position
    rht_scale: float  # fp32(1 / sqrt(rht_size))
    unit: int  # contiguous elements per unit of work
    blocks_per_unit: int
    threads_per_block: int  # > 1: lanes cooperating on one block
    store_bytes: int  # bytes of one store word of codes
    store_n: int  # store words per unit
    quant_threads: int
    quant_units: int  # units per thread
    amax_threads: int
    amax_units: int
    # the options of docs/numerics.md 11 (a format without them leaves these at their defaults)
    target_invs: tuple[float, ...] = ()  # fp32(1 / T) per block target T, in order; ()
    # maps the amax to the element's max alone
    target_mae: bool = False  # the targets' error: |d| (mae) instead of d * d (mse)
    scale_sr: bool = False  # stochastic block scales: a 32-bit Philox word per block
    # the RHT's signs are the kernels' arguments (drawn per layer or step, docs/numerics.md 12):
    # SIGN_WORDS Int32 words, bit i % 32 of word i // 32 set for a -1 at position i
    rht_runtime_signs: bool = False
    # one global scale per row (docs/numerics.md 11.4): the amax, S_enc and S_dec are [M]
    global_rows: bool = False
    # an RHT larger than a unit: each chunk spans this many consecutive lanes (their units),
    # the butterflies of h >= unit across them by xor shuffles; 1: a unit holds whole chunks
    rht_lanes: int = 1
    # the MS-EDEN correction (11.3) over groups of this many values of a row; 0: none
    eden_group: int = 0
    # with stochastic block scales and MS-EDEN the codes are made with the nearest scale: the
    # ScaleKind of that rounding (e4m3's is the hardware convert); "" otherwise
    eden_first_kind: str = ""

    @property
    def choice(self) -> bool:
        """Block targets, stochastic block scales or MS-EDEN: ``quantize_unit_choice``
        quantizes."""
        return bool(self.target_invs) or self.scale_sr or self.eden_group > 0

    @property
    def sign_masks(self) -> bool:
        """Runtime RHT signs taken as xor masks of the input's packed 16-bit pairs (bits 15 and
        31 of mask k: positions 2k and 2k + 1 of a chunk, ``quantize_host.rht_sign_masks``):
        one xor per two values before they are widened, where the signs' words cost a shift,
        a move and a xor per value. Where a thread holds whole chunks, the input is bf16 or
        fp16 and a chunk's masks fit the SIGN_WORDS arguments (an RHT of at most 16 points);
        else the arguments are the sign words."""
        return (
            self.rht_runtime_signs
            and self.rht_lanes == 1
            and self.input_dtype in ("bf16", "fp16")
            and self.rht_size // 2 <= SIGN_WORDS
        )

    @property
    def half_products(self) -> bool:
        """The block targets' errors take the "srhalf" encode's fp16 images
        (``encode.image_error_terms``): every |value(code)| * s_b * half_scale is an fp16 value
        (its grid at least 2^-24, at most 65504, significand of at most 11 bits) and so is s_b
        (e4m3 scales, or minifloat ones as narrow)."""
        if not self.target_invs or self.sw_encode != "srhalf" or self.eden_group:
            return False
        e, s = self.elem, self.scale
        if s.kind == "e4m3_hw":
            step, top, sig = 2.0**-9, 448.0, 4
        elif s.kind == "minifloat":
            step, top, sig = 2.0 ** (s.emin_biased - 127 - s.man_bits), s.cap, s.man_bits + 1
        else:
            return False
        image = 2.0 ** (-14 - e.emin)
        return (
            step >= 2.0**-24
            and top <= 65504.0
            and sig <= 11
            and 2.0 ** (e.emin - e.man_bits) * step * image >= 2.0**-24
            and e.max * top * image <= 65504.0
            and e.man_bits + 1 + sig <= 11
        )

    @property
    def philox(self) -> bool:
        """The kernel draws Philox words (its arguments include the seed and offset)."""
        return bool(self.sr_bits) or self.scale_sr

    @property
    def input_type(self) -> type:
        return getattr(cutlass, DTYPES[self.input_dtype].cute)

    @property
    def bf16_words(self) -> bool:
        """bf16 input without an RHT: block amaxes on the packed words."""
        return self.input_dtype == "bf16" and not self.rht_size


def _units(mX: cute.Tensor, unit: int):
    """(M, K) compact row-major -> (M*K/unit, unit) view of whole units."""
    num_units = mX.shape[0] * (mX.shape[1] // unit)
    gX = cute.make_tensor(mX.iterator, cute.make_layout((num_units, unit), stride=(unit, 1)))
    return gX, num_units


class RowwiseBase:
    """The device helpers both rowwise kernels use: values of a unit, amaxes, the RHT."""

    def __init__(self, params: RowwiseParams, arch: str) -> None:
        self.p = params
        self.arch = arch

    def to_f32(self, frag: cute.Tensor) -> list:
        """The unit's input values of a register fragment as fp32 scalars (exact)."""
        xf = cute.make_rmem_tensor((self.p.unit,), Float32)
        xf.store(frag.load().to(Float32))
        return [xf[j] for j in range(self.p.unit)]

    def unit_words(self, frag: cute.Tensor) -> list:
        raw = cute.recast_tensor(frag, Uint32)
        return [raw[i] for i in range(self.p.unit // 2)]

    def bind_signs(self, words) -> None:
        """The RHT's sign arguments of a kernel with runtime signs (``rht_runtime_signs``): the
        pair masks (``sign_masks``) that ``rht_values`` xors into the packed input, or sign
        words: per position i its sign bit, (word[i // 32] << (31 - i % 32)) & 0x80000000,
        which ``rht_chunks`` xors into the values."""
        if self.p.sign_masks:
            self.pair_masks = [Uint32(w) for w in words[: self.p.rht_size // 2]]
            return
        self.sign_words = [Uint32(w) for w in words]
        if self.p.rht_lanes > 1:
            return  # rht_across_lanes picks this lane's word
        self.sign_bits = [
            (Uint32(words[i // 32]) << Uint32(31 - i % 32)) & Uint32(0x80000000)
            for i in range(self.p.rht_size)
        ]

    def clamped(self, u, last):
        """Unit ``u``, or past ``last`` a unit of the last RHT chunk at ``u``'s place in it: loads
        need no predicate, and a unit past the end repeats a real one. With a chunk over
        rht_lanes lanes the whole chunk must repeat (a duplicate chunk leaves a max as it is; one
        unit repeated over a chunk's lanes would transform into other, larger values). Lanes of
        one chunk hold consecutive units from a multiple of rht_lanes (K is a multiple of the
        RHT size), so u % rht_lanes is u's place in its chunk."""
        if const_expr(self.p.rht_lanes > 1):
            lanes = self.p.rht_lanes
            return cutlass.select_(u > last, last + Int32(1 - lanes) + (u & Int32(lanes - 1)), u)
        return cutlass.min(u, last)

    def rht_across_lanes(self, xs: list) -> list:
        """The forward RHT of a chunk spread over rht_lanes consecutive lanes, this thread
        holding positions sub * unit .. sub * unit + unit - 1 (sub = lane % rht_lanes; unit =
        32: one sign word per lane): the signs (xored in), the butterflies h < unit within the
        thread, then h = unit, 2 unit, ... with the lane sub ^ (h / unit), the lower lane
        taking a + b and the upper a - b (the same fp32 operations as in one thread), times
        fp32(1/sqrt(d)), rounded to bf16 (docs/numerics.md 4)."""
        p = self.p
        sub = cute.arch.lane_idx() & Int32(p.rht_lanes - 1)
        if p.rht_runtime_signs:
            words = self.sign_words
        else:  # the compiled-in signs as words: bit i of word k for position 32 k + i
            words = [
                Uint32(sum(1 << i for i in range(32) if p.rht_signs[32 * k + i] < 0))
                for k in range(p.rht_size // 32)
            ]
        w = words[0]
        for k in range(1, p.rht_lanes):
            w = Uint32(cutlass.select_(sub == Int32(k), words[k], w))
        v = [
            (x.bitcast(Uint32) ^ ((w << Uint32(31 - i)) & Uint32(0x80000000))).bitcast(Float32)
            for i, x in enumerate(xs)
        ]
        v = butterflies(v, p.unit)
        h = p.unit
        while h < p.rht_size:
            off = h // p.unit
            upper = (sub & Int32(off)) != Int32(0)
            other = [cute.arch.shuffle_sync_bfly(t, offset=off) for t in v]
            v = [
                Float32(cutlass.select_(upper, o - t, t + o)) for t, o in zip(v, other, strict=True)
            ]
            h *= 2
        return self.to_bf16([t * Float32(p.rht_scale) for t in v])

    def to_bf16(self, v: list) -> list:
        """fp32 values rounded to bf16 (RNE), as fp32."""
        out = []
        for i in range(0, len(v), 2):
            word = cvt_bf16x2(v[i], v[i + 1])
            out.append((word & Uint32(0xFFFF0000)).bitcast(Float32))
            out.append((word << Uint32(16)).bitcast(Float32))
        return out

    def rht_values(self, frag: cute.Tensor) -> list:
        """The unit's values after the forward RHT (``rht_chunks``); with ``sign_masks`` the
        signs are xored into the packed 16-bit input before it is widened (exact: a sign flip
        of a bf16 or fp16 value is the flip of its fp32 value)."""
        p = self.p
        if not p.sign_masks:
            return self.rht_chunks(self.to_f32(frag))
        masks = self.pair_masks
        words = [w ^ masks[k % len(masks)] for k, w in enumerate(self.unit_words(frag))]
        xs = []
        for w in words:  # element 2k in the low half, 2k + 1 in the high half
            if p.input_dtype == "bf16":
                hi = (w & Uint32(0xFFFF0000)).bitcast(Float32)
                xs += [(w << Uint32(16)).bitcast(Float32), hi]
            else:
                xs += [f16_half_to_f32(w, False), f16_half_to_f32(w, True)]
        return self.rht_chunks(xs, signed=True)

    def rht_chunks(self, xs: list, signed: bool = False) -> list:
        """Forward RHT of every chunk of xs (docs/numerics.md section 4, in this order): signs
        (unless ``signed``: already applied), butterflies h = 1, 2, ..., size/2 in fp32, times
        fp32(1/sqrt(d)), round to bf16."""
        size = self.p.rht_size
        if self.p.rht_lanes > 1:  # a chunk over several lanes
            return self.rht_across_lanes(xs)
        out = []
        for c in range(0, len(xs), size):  # chunk by chunk, as the transform is traced
            if signed:
                v = butterflies(xs[c : c + size], size)
            elif self.p.rht_runtime_signs:
                v = xor_signed_butterflies(xs[c : c + size], size, self.sign_bits)
            else:
                v = signed_butterflies(xs[c : c + size], size, self.p.rht_signs)
            v = [t * Float32(self.p.rht_scale) for t in v]
            for i in range(0, size, 2):
                w = cvt_bf16x2(v[i], v[i + 1])
                out.append((w & Uint32(0xFFFF0000)).bitcast(Float32))
                out.append((w << Uint32(16)).bitcast(Float32))
        return out


def tree_sum(values: list):
    """fp32 sum as a pairwise tree in index order, zero-padded to a power of two
    (docs/numerics.md 11: ((v0 + v1) + (v2 + v3)) + ...): a lone last value is carried, since
    v + 0 = v for the non-negative sums it is used for. Each add is an explicit add.rn: a
    product term is never fused into it (quant_ptx.add_rn)."""
    while len(values) > 1:
        pairs = [add_rn(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)]
        values = pairs + values[len(pairs) * 2 :]
    return values[0]


def fmax_nan(a: Float32, b: Float32) -> Float32:
    """max(a, b), NaN if either is NaN (max.NaN.f32: one instruction, as the plain max)."""
    return cute.arch.fmax(a, b, nan=True)


def absmax(xs: list) -> Float32:
    """max |x| over fp32 scalars (a chain); NaN if any is NaN."""
    acc = abs(xs[0])
    for x in xs[1:]:
        acc = fmax_nan(acc, abs(x))
    return acc


def absmax_bf16(words: list) -> Float32:
    """max |x| over bf16x2 words: packed HMNMX2 (a chain), then one fp32 max of the halves
    (exact); NaN if any is NaN."""
    h = words[0]
    for w in words[1:]:
        h = bf16x2_absmax(h, w)
    return fmax_nan(
        abs((h << Uint32(16)).bitcast(Float32)), abs((h & Uint32(0xFFFF0000)).bitcast(Float32))
    )


class RowwiseAmaxKernel(RowwiseBase):
    """Global amax A = max |x| (of the RHT'd values with an RHT) into a zero-initialised fp32 [1]
    buffer: each CTA reduces amax_threads * amax_units units and issues one atomic max."""

    @cute.jit
    def __call__(self, mX: cute.Tensor, mAmax: cute.Tensor, stream: cuda.CUstream):
        p = self.p
        gX, num_units = _units(mX, p.unit)
        tile = p.amax_threads * p.amax_units
        grid = (num_units + (tile - 1)) // tile
        self.kernel(gX, mAmax, num_units).launch(
            grid=[grid, 1, 1], block=[p.amax_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, gX: cute.Tensor, mAmax: cute.Tensor, num_units: Int32):
        self.body(gX, mAmax, num_units)

    def unit_amax(self, frag) -> Float32:
        """max |x| (of the RHT'd values with an RHT) over one unit; NaN if any is NaN."""
        p = self.p
        if p.rht_size > 0:
            return absmax(self.rht_values(frag))
        if p.input_dtype == "bf16":
            return absmax_bf16(self.unit_words(frag))
        return absmax(self.to_f32(frag))

    @cute.jit
    def body(self, gX: cute.Tensor, mAmax: cute.Tensor, num_units: Int32):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        last = num_units - 1
        base = bidx * (p.amax_threads * p.amax_units) + tidx

        frags = []
        for v in range_constexpr(p.amax_units):  # issue every load first
            frag = cute.make_rmem_tensor((p.unit,), p.input_type)
            # clamped: a duplicate unit does not change a max
            cute.autovec_copy(gX[self.clamped(base + v * p.amax_threads, last), None], frag)
            frags.append(frag)
        if const_expr(p.global_rows):
            self.row_amaxes(frags, mAmax, base, last, num_units)
        else:
            acc = Float32(0.0)
            for v in range_constexpr(p.amax_units):
                if const_expr(p.rht_size > 0):
                    acc = fmax_nan(acc, absmax(self.rht_values(frags[v])))
                elif const_expr(p.input_dtype == "bf16"):
                    acc = fmax_nan(acc, absmax_bf16(self.unit_words(frags[v])))
                else:
                    acc = fmax_nan(acc, absmax(self.to_f32(frags[v])))

            # CTA reduction: warp shuffles, one shared-memory slot per warp, warp 0 finishes;
            # every max propagates NaN, so a NaN anywhere reaches the atomic as the canonical
            # (positive) NaN
            acc = cute.arch.warp_reduction(acc, fmax_nan)
            smem = cutlass.memory.SmemAllocator()
            red = smem.allocate_tensor(
                Float32, cute.make_layout(p.amax_threads // 32), byte_alignment=16
            )
            warp = cute.arch.warp_idx()
            lane = cute.arch.lane_idx()
            if lane == 0:
                red[warp] = acc
            cute.arch.barrier()
            if warp == 0:
                w = Float32(0.0)
                if lane < p.amax_threads // 32:
                    w = red[lane]
                w = cute.arch.warp_reduction(w, fmax_nan)
                if lane == 0:
                    # |x| >= 0: the fp32 max is the integer max of the bits (Inf and the
                    # positive NaN above every finite value)
                    cute.arch.atomic_fmax(mAmax.iterator, w, sign_bit=False)

    @cute.jit
    def row_amaxes(self, frags, mAmax: cute.Tensor, base, last, num_units: Int32):
        """One amax per row (docs/numerics.md 11.4) into the zeroed [M] buffer: a unit lies in
        one row (K is a multiple of the unit) and a warp's lanes hold consecutive units, so a
        max over each run of lanes of one row (shuffles down, rows nondecreasing along the
        lanes) leaves the run's max in its first lane, which issues one atomic max."""
        p = self.p
        units_per_row = num_units // mAmax.shape[0]
        lane = cute.arch.lane_idx()
        for v in range_constexpr(p.amax_units):
            acc = self.unit_amax(frags[v])
            row = self.clamped(base + v * p.amax_threads, last) // units_per_row
            for off in (1, 2, 4, 8, 16):
                other = cute.arch.shuffle_sync_down(acc, offset=off)
                other_row = cute.arch.shuffle_sync_down(row, offset=off)
                # past lane 31 a lane reads its own value: the same row, a max with itself
                acc = Float32(cutlass.select_(other_row == row, fmax_nan(acc, other), acc))
            prev_row = cute.arch.shuffle_sync_up(row, offset=1)
            if (lane == 0) | (prev_row != row):
                cute.arch.atomic_fmax(mAmax.iterator + row, acc, sign_bit=False)


SIGN_WORDS = 8  # Int32 sign words a kernel with runtime RHT signs takes: 256 positions


class RowwiseAmaxSignsKernel(RowwiseAmaxKernel):
    """``RowwiseAmaxKernel`` with the RHT's signs as arguments (``rht_runtime_signs``): eight
    Int32 words after the amax buffer (docs/numerics.md 12)."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mAmax: cute.Tensor,
        s0: Int32,
        s1: Int32,
        s2: Int32,
        s3: Int32,
        s4: Int32,
        s5: Int32,
        s6: Int32,
        s7: Int32,
        stream: cuda.CUstream,
    ):
        p = self.p
        gX, num_units = _units(mX, p.unit)
        tile = p.amax_threads * p.amax_units
        grid = (num_units + (tile - 1)) // tile
        self.kernel(gX, mAmax, num_units, s0, s1, s2, s3, s4, s5, s6, s7).launch(
            grid=[grid, 1, 1], block=[p.amax_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        gX: cute.Tensor,
        mAmax: cute.Tensor,
        num_units: Int32,
        s0: Int32,
        s1: Int32,
        s2: Int32,
        s3: Int32,
        s4: Int32,
        s5: Int32,
        s6: Int32,
        s7: Int32,
    ):
        self.bind_signs((s0, s1, s2, s3, s4, s5, s6, s7))
        self.body(gX, mAmax, num_units)


class RowwiseQuantizeKernel(RowwiseBase):
    """Rowwise quantization of a compact row-major [M, K] tensor (module docstring). A generated
    module's subclass spells the entry: ``__call__`` -> ``launch``, ``kernel`` -> ``body``."""

    def __init__(self, params: RowwiseParams, arch: str) -> None:
        super().__init__(params, arch)
        self.hw = arch in params.hw_archs  # hardware element convert on this arch
        self.encoder = ElementEncoder(params.elem, params.rounding, params.sw_encode, params.swar)
        self.scaler = BlockScaler(params.scale, params.global_scale)
        # the scale of the codes: the format's, or with MS-EDEN and stochastic scales the
        # nearest one (the corrected scale alone is rounded stochastically, numerics.md 11.3)
        self.first_scaler = self.scaler
        if params.eden_first_kind:
            first = replace(params.scale, kind=params.eden_first_kind, rounding="nearest")
            self.first_scaler = BlockScaler(first, params.global_scale)

    @property
    def store_type(self) -> type:
        return _STORE_TYPES[self.p.store_bytes]

    def store_words(self, words: list) -> list:
        """The packed words as store_n values of the store type (the unit's code bytes)."""
        p = self.p
        if p.store_bytes == 4:
            return words
        if p.store_bytes == 2:
            halves = []
            for w in words:
                halves += [Uint16(w), Uint16(w >> Uint32(16))]
            return halves[: p.store_n]
        out = []
        for w in words:
            out += [Uint8(w >> Uint32(8 * i)) for i in range(4)]
        return out[: p.store_n]

    def swizzled_offset(self, b: Int32, nbk: Int32, c4: Int32) -> Int32:
        """Byte offset of block b's scale in the 128x4 tensor-core layout (docs/numerics.md 3):
        ((r // 128) * ceil(C/4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4."""
        row = b // nbk
        col = b - row * nbk
        atom = (row >> 7) * c4 + (col >> 2)  # 512-byte atom of 128 rows x 4 scales
        return atom * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4 + (col & 3)

    def quantize_unit(self, frag: cute.Tensor, k_enc, s_enc, s_dec, rand):
        """Quantize one unit: returns (store values, [(scale code or value) per block], max of
        this thread's block amaxes: NaN or Inf iff its values hold a NaN or an Inf; None with a
        global scale, whose amax says it)."""
        p = self.p
        xs = self.rht_values(frag) if p.rht_size else self.to_f32(frag)
        if p.bf16_words:
            raw = self.unit_words(frag)
        bl = p.unit // p.blocks_per_unit  # elements of one block held by this thread
        ys = []
        scales = []
        seen = None
        for g in range(p.blocks_per_unit):
            if p.bf16_words:
                amax_b = absmax_bf16(raw[g * bl // 2 : (g + 1) * bl // 2])
            else:
                amax_b = absmax(xs[g * bl : (g + 1) * bl])
            if not p.global_scale:
                seen = amax_b if seen is None else fmax_nan(seen, amax_b)  # before any shuffle
            if p.threads_per_block > 1:
                # the block spans threads_per_block consecutive lanes: butterfly max over them
                for off in (1 << i for i in range(p.threads_per_block.bit_length() - 1)):
                    amax_b = cute.arch.fmax(amax_b, cute.arch.shuffle_sync_bfly(amax_b, offset=off))
            scale, e_b = self.scaler.block_scale(amax_b, k_enc, s_enc, s_dec)
            scales.append(scale)
            ys += [scale_value(x, e_b) for x in xs[g * bl : (g + 1) * bl]]  # sign bit: x < 0
        codes = self.encoder.encode_elements(ys, rand, self.hw)
        return self.store_words(pack_bits(codes)), scales, seen

    def quantize_unit_choice(self, frag, u, k_encs: list, s_enc, s_dec, rand, philox_state):
        """``quantize_unit`` with the block options of docs/numerics.md 11.1-11.2: per block,
        each target's scale (k_encs: fp32(S_enc * fp32(1 / T)) per target T, in order), codes
        and error against z = fp32(x * S_enc); a later target replaces the kept one only where
        its error is strictly lower. With stochastic block scales (philox_state: the keys and
        offset words) the scale rounding takes the word of element index 2^62 + b of the
        call's stream, b the block's index, the same word for every target."""
        p = self.p
        xs = self.rht_values(frag) if p.rht_size else self.to_f32(frag)
        if p.bf16_words:
            raw = self.unit_words(frag)
        bl = p.unit // p.blocks_per_unit  # elements of one block held by this thread
        words = self.scale_words(u, philox_state) if p.scale_sr else None
        # the codes' scale rounding takes the words unless MS-EDEN rounds only the corrected one
        first_words = None if p.eden_first_kind else words
        fields = []
        scales = []
        seen = None
        eden = []  # per block: (code fields, s_b, |z|) for the MS-EDEN correction
        for g in range(p.blocks_per_unit):
            xb = xs[g * bl : (g + 1) * bl]
            half = (g * bl // 2, (g + 1) * bl // 2)  # the block's bf16x2 words
            amax_b = absmax_bf16(raw[half[0] : half[1]]) if p.bf16_words else absmax(xb)
            if not p.global_scale:
                seen = amax_b if seen is None else fmax_nan(seen, amax_b)  # before any shuffle
            if p.threads_per_block > 1:
                for off in (1 << i for i in range(p.threads_per_block.bit_length() - 1)):
                    amax_b = cute.arch.fmax(amax_b, cute.arch.shuffle_sync_bfly(amax_b, offset=off))
            rb = None
            if p.sr_bits:
                # the block's random fields (whole Philox words for the "srhalf" encode)
                per = 32 // p.sr_bits if p.rand_words else 1
                rb = rand[g * bl // per : (g + 1) * bl // per]
            word = first_words[g] if first_words is not None else None
            # |z| = |fp32(x * S_enc)| once per value: |fp32(q) - z| = |fp32(|q|) - |z|| since
            # the code's sign is x's (fp32 rounding is symmetric)
            az = None
            if len(k_encs) > 1 or p.eden_group:
                az = [abs(x) * s_enc if p.global_scale else abs(x) for x in xb]
            kept = kept_err = None
            for k_enc in k_encs:
                code, s_b, e_b = self.first_scaler.block_scale_value(
                    amax_b, k_enc, s_enc, s_dec, word
                )
                ys = [scale_value(x, e_b) for x in xb]  # sign bit: x < 0
                images = [] if p.half_products else None
                cand = self.encoder.encode_elements(ys, rb, self.hw, images=images)
                if kept is None:
                    kept = (code, cand, s_b)
                    if len(k_encs) > 1:
                        kept_err = self.block_error(cand, s_b, az, images)
                else:
                    err = self.block_error(cand, s_b, az, images)
                    better = err < kept_err  # strictly lower: ties keep the earlier target
                    kept_err = cutlass.select_(better, err, kept_err)
                    kept = (
                        cutlass.select_(better, code, kept[0]),
                        keep_lower(better, cand, kept[1]),
                        Float32(cutlass.select_(better, s_b, kept[2])),
                    )
            scales.append(kept[0])
            fields += kept[1]
            eden.append((kept[1], kept[2], az))
        if p.eden_group:
            scales = self.eden_scales(eden, words)
        return self.store_words(pack_bits(fields)), scales, seen

    def eden_scales(self, blocks: list, words) -> list:
        """The MS-EDEN correction (docs/numerics.md 11.3) of this thread's blocks: per group of
        eden_group values of a row, F = fp32(tree(z * z) / tree(z * q)) (F = 1 where the
        denominator is not > 0 or F is not finite), q = fp32(value(code) * s_b); each block's
        scale becomes the format's rounding of min(fp32(s_b * F), cap). The trees: each
        block's in index order, then pairwise over the group's blocks in this thread, then
        over the lanes holding the rest of the group (xor butterflies: the same tree, the group
        being aligned whole units of consecutive lanes)."""
        p = self.p
        sums = []
        for fields, s_b, az in blocks:
            zz = [mul_rn(a, a) for a in az]  # products of the trees: never fused (mul_rn)
            zq = [
                mul_rn(a, mul_rn(v, s_b))
                for v, a in zip(field_magnitudes(fields, p.elem), az, strict=True)
            ]
            sums.append((tree_sum(zz), tree_sum(zq)))
        bl = p.unit // p.blocks_per_unit
        per_group = max(p.eden_group // bl, 1)  # blocks of a group ...
        per_group = min(per_group, len(blocks))  # ... held by this thread
        out = []
        for g0 in range(0, len(blocks), per_group):
            zz = tree_sum([sums[g][0] for g in range(g0, g0 + per_group)])
            zq = tree_sum([sums[g][1] for g in range(g0, g0 + per_group)])
            lanes = p.eden_group // (bl * per_group)  # lanes holding the group
            for off in (1 << i for i in range(lanes.bit_length() - 1)):
                zz = add_rn(zz, cute.arch.shuffle_sync_bfly(zz, offset=off))
                zq = add_rn(zq, cute.arch.shuffle_sync_bfly(zq, offset=off))
            f = zz / zq
            finite = (f.bitcast(Uint32) & Uint32(NONFINITE_BITS)) != Uint32(NONFINITE_BITS)
            f = Float32(cutlass.select_((zq > Float32(0.0)) & finite, f, Float32(1.0)))
            for g in range(g0, g0 + per_group):
                d = cute.arch.fmin(mul_rn(blocks[g][1], f), Float32(p.scale.cap))
                word = words[g] if words is not None else None
                out.append(self.scaler.round_scale(d, word))
        return out

    def target_factors(self, s_enc) -> list:
        """fp32(S_enc * fp32(1 / T)) per block target T, in order (S_enc = 1 without a global
        scale: fp32(1 / T) itself); the element's max alone without targets."""
        p = self.p
        return target_factors(p.target_invs, p.elem.inv_max, s_enc, p.global_scale)

    def block_error(self, fields: list, s_b, az: list, images: list | None = None):
        """A block's error (docs/numerics.md 11.1): the pairwise tree sum in index order of
        e(fp32(fp32(|value(code)| * s_b) - |z|)), e = d * d (mse) or |d| (mae); a block spread
        over lanes adds the lanes' sums by xor butterflies (the same tree: fp32 addition
        commutes). ``images``: the encode's fp16 images, where ``half_products`` holds (the
        same terms from fewer instructions)."""
        p = self.p
        # each product rounded on its own, as the reference: never fused into an fma
        if images is not None:
            terms = image_error_terms(images, s_b, az, p.elem, p.target_mae)
        else:
            terms = error_terms(fields, s_b, az, p.elem, p.target_mae)
        err = tree_sum(terms)
        if p.threads_per_block > 1:
            for off in (1 << i for i in range(p.threads_per_block.bit_length() - 1)):
                err = add_rn(err, cute.arch.shuffle_sync_bfly(err, offset=off))
        return err

    def scale_words(self, u, philox_state) -> list:
        """The Philox word of each block of unit u for its stochastic scale rounding: word
        (2^62 + b) % 4 of the call with counter ((2^62 + b) // 4, offset), i.e. (b // 4, 2^28,
        offset_lo, offset_hi) for b < 2^34 (docs/numerics.md 11.2)."""
        p = self.p
        keys, off_lo, off_hi = philox_state
        if p.threads_per_block > 1:
            bs = [Uint32(u) // Uint32(p.threads_per_block)]
        else:
            first = Uint32(u) * Uint32(p.blocks_per_unit)
            bs = [first + Uint32(g) for g in range(p.blocks_per_unit)]
        if p.blocks_per_unit % 4 == 0:  # whole calls: four blocks per call, in order
            out = []
            for c in range(0, len(bs), 4):
                out += philox4x32_10(bs[c] >> Uint32(2), Uint32(1 << 28), off_lo, off_hi, keys)
            return out
        return [scale_word(b, keys, off_lo, off_hi) for b in bs]

    # ---- host side: the launch (the subclass's __call__ gives the spec's arguments)
    @cute.jit
    def launch(self, mX, mQ, mS, mSwz, mAmax, mSdec, philox, stream, signs=None):
        """mX (M, K) input; mQ (M, K * bits / 8) uint8 packed codes; mS (M, K / block) scale
        codes (fp32 values for fp32 scales); mSwz (bytes,) uint8 swizzled scale codes,
        zero-initialised, or None; mAmax (1,) fp32 global amax or None; mSdec (1,) fp32 S_dec
        (out with a global scale; else 1.0 from the host, NaN for a non-finite input); philox:
        (seed, offset, counter address, stride) as (lo, hi) Int32 words, or None."""
        p = self.p
        gX, num_units = _units(mX, p.unit)
        gQ = cute.make_tensor(
            cute.recast_ptr(mQ.iterator, dtype=self.store_type),
            cute.make_layout((num_units, p.store_n), stride=(p.store_n, 1)),
        )
        nbk = mX.shape[1] // p.block  # blocks per row
        gS = cute.make_tensor(mS.iterator, cute.make_layout(mX.shape[0] * nbk))
        tile = p.quant_threads * p.quant_units
        grid = (num_units + (tile - 1)) // tile
        args = [gX, gQ, gS]
        if const_expr(p.swizzled):
            args += [mSwz, nbk, (nbk + 3) // 4]
        if const_expr(p.global_scale):
            args.append(mAmax)
        args.append(mSdec)
        if const_expr(p.philox):
            args += list(philox)
        if const_expr(p.rht_runtime_signs):
            args += list(signs)
        self.kernel(*args, num_units).launch(
            grid=[grid, 1, 1], block=[p.quant_threads, 1, 1], stream=stream
        )

    # ---- device side (the subclass's kernel gives the spec's arguments)
    @cute.jit
    def body(self, gX, gQ, gS, gSwz, nbk, c4, mAmax, mSdec, philox, num_units, signs=None):
        p = self.p
        if const_expr(p.rht_runtime_signs):
            self.bind_signs(signs)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        last = num_units - 1
        base = bidx * (p.quant_threads * p.quant_units) + tidx

        # ---- issue every load of this thread first; clamped, so loads need no predicate
        frags = []
        for v in range_constexpr(p.quant_units):
            frag = cute.make_rmem_tensor((p.unit,), p.input_type)
            cute.autovec_copy(gX[self.clamped(base + v * p.quant_threads, last), None], frag)
            frags.append(frag)

        units_per_row = None
        if const_expr(p.global_rows):
            # ---- one global scale per row: computed per unit below (numerics.md 11.4)
            units_per_row = num_units // mAmax.shape[0]
            s_enc = s_dec = k_enc = None
        elif const_expr(p.global_scale):
            # ---- global scales, recomputed by every thread (a broadcast load, div.rn + rcp.rn)
            s_enc, s_dec = global_scales(mAmax[0], p.global_num)
            if bidx == 0:  # noqa: SIM102
                if tidx == 0:
                    mSdec[0] = s_dec
            k_enc = s_enc * Float32(p.elem.inv_max)  # fp32(S_enc * fp32(1 / ELEM_MAX))
        else:
            s_enc = s_dec = None  # no global scale: S_enc = S_dec = 1
            k_enc = Float32(p.elem.inv_max)  # fp32(1 * fp32(1 / ELEM_MAX))
        keys = off_lo = off_hi = None
        if const_expr(p.philox):
            seed_lo, seed_hi, offset_lo, offset_hi, ctr_lo, ctr_hi, stride_lo, stride_hi = philox
            keys = philox_keys(Uint32(seed_lo), Uint32(seed_hi))
            # the Philox offset: the int one, or counter * stride + slot read from device memory
            off_lo, off_hi = philox_offset(
                ctr_lo, ctr_hi, stride_lo, stride_hi, offset_lo, offset_hi
            )
        seen = None
        if const_expr(not p.global_scale):
            seen = Float32(0.0)  # max of this thread's block amaxes (NaN-propagating)
        k_encs = None
        if const_expr(p.choice and not p.global_rows):
            k_encs = self.target_factors(s_enc)

        for v in range_constexpr(p.quant_units):
            u = base + v * p.quant_threads
            if const_expr(p.global_rows):
                # this unit's row: its S_enc and S_dec; the row's first unit stores S_dec
                row = cutlass.min(u, last) // units_per_row
                s_enc, s_dec = global_scales(mAmax[row], p.global_num)
                k_enc = s_enc * Float32(p.elem.inv_max)
                if const_expr(p.choice):
                    k_encs = self.target_factors(s_enc)
                if u < num_units:  # noqa: SIM102 (runtime conditions)
                    if u - row * units_per_row == 0:
                        mSdec[row] = s_dec
            rand = None
            if const_expr(p.sr_bits):
                i0 = Uint32(u) * Uint32(p.unit)
                if const_expr(p.rand_words):  # whole Philox words: the "srhalf" encode
                    rand = random_words(i0, p.unit, p.sr_bits, keys, off_lo, off_hi)
                else:
                    rand = random_fields(i0, p.unit, p.sr_bits, keys, off_lo, off_hi)
            if const_expr(p.choice):
                vals, scales, seen_v = self.quantize_unit_choice(
                    frags[v], u, k_encs, s_enc, s_dec, rand, (keys, off_lo, off_hi)
                )
            else:
                vals, scales, seen_v = self.quantize_unit(frags[v], k_enc, s_enc, s_dec, rand)
            if const_expr(not p.global_scale):
                seen = fmax_nan(seen, seen_v)  # a clamped (duplicate) unit holds real values too
            q = cute.make_rmem_tensor((p.store_n,), self.store_type)
            for i in range_constexpr(p.store_n):
                q[i] = vals[i]
            if u < num_units:
                cute.autovec_copy(q, gQ[u, None])
                if const_expr(p.threads_per_block > 1):
                    if tidx % p.threads_per_block == 0:  # one lane of the group writes the scale
                        b = u // p.threads_per_block
                        gS[b] = self.scale_out(scales[0])
                        if const_expr(p.swizzled):
                            gSwz[self.swizzled_offset(b, nbk, c4)] = Uint8(scales[0])
                else:
                    for g in range_constexpr(p.blocks_per_unit):
                        b = u * p.blocks_per_unit + g
                        gS[b] = self.scale_out(scales[g])
                        if const_expr(p.swizzled):
                            gSwz[self.swizzled_offset(b, nbk, c4)] = Uint8(scales[g])

        if const_expr(not p.global_scale):  # noqa: SIM102 (a compile-time if around a runtime one)
            # ---- a NaN or an Inf among this thread's values (rare): S_dec = NaN over the host's
            # 1.0 (every writer stores the same NaN, so no race)
            if seen.bitcast(Uint32) >= Uint32(NONFINITE_BITS):
                mSdec[0] = Uint32(NAN_BITS).bitcast(Float32)

    def scale_out(self, scale):
        """What the scale tensor stores: the fp32 value of fp32 scales, else the code's byte."""
        return scale if self.p.scale.kind == "fp32" else Uint8(scale)


__all__ = [
    "SIGN_WORDS",
    "RowwiseAmaxKernel",
    "RowwiseAmaxSignsKernel",
    "RowwiseBase",
    "RowwiseParams",
    "RowwiseQuantizeKernel",
    "absmax",
    "absmax_bf16",
    "fmax_nan",
]
