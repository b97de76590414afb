"""Reference block-scaled quantizer: the bit-exact oracle for every generated kernel.

Generalizes the NVFP4 two-level scaling of the numerics contract (section 2) to every
:class:`~fp4gen.formats.BlockFormat`. All arithmetic is float32 and each rounding is explicit
(torch's float32 ops are correctly rounded); the order of operations is part of the contract.

``quantize`` always runs these torch ops, on the input's device (cpu or cuda): it is what the
kernels are checked against. Choosing the generated kernels instead (``backend=``) belongs to the
backends: ``fp4gen.quantize`` is ``fp4gen.runtime.quantize_dispatch.quantize``.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from fp4gen.dsl.model import RHTSpec
from fp4gen.errors import ArgumentError, TensorError
from fp4gen.formats import (
    BUILTIN_FORMATS,
    ELEMENT_ROUNDINGS,
    BlockFormat,
    ElementFormat,
    HighPrecision,
    is_stochastic,
    sr_bits,
)
from fp4gen.numerics.hadamard import inverse_rht, rht
from fp4gen.numerics.layout import pack, swizzle_scales, unpack
from fp4gen.numerics.minifloat import decode, encode, encode_scale, max_exponent, max_finite
from fp4gen.numerics.philox import random_bits, random_words

FLT_MAX = float(torch.finfo(torch.float32).max)
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_UNVERSIONED = itertools.count(1)  # code_version of inference tensors


class _DerivedOnRead:
    """A dataclass field that holds what it was given, or, given None, is derived from the
    instance on its first read and kept: a kernel's packed codes are unpacked, scale codes
    decoded, only when something reads them (the GEMM paths read the packed form)."""

    def __init__(self, derive: Callable[[Any], torch.Tensor]) -> None:
        self.derive = derive

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.key = name, "_" + name

    def __get__(self, obj: Any, objtype: type | None = None) -> torch.Tensor:
        if obj is None:
            raise AttributeError(self.name)  # a required field: no default
        value = obj.__dict__[self.key]
        if value is None:
            value = self.derive(obj)
            obj.__dict__[self.key] = value
        return value

    def __set__(self, obj: Any, value: torch.Tensor | None) -> None:
        obj.__dict__[self.key] = value


@dataclass(frozen=True)
class PackedCodes:
    """Codes as a kernel wrote them: ``data`` uint8 [R, ceil(cols * bits / 8)], packed as
    ``fp4gen.numerics.layout.pack`` packs them (element 0 in the lowest bits)."""

    data: torch.Tensor
    cols: int
    bits: int

    def unpack(self) -> torch.Tensor:
        """uint8 codes [R, cols], one per byte."""
        data = self.data
        if self.bits == 4 and self.cols % 2 == 0:  # a mask and a shift, no bit stream
            # built from the data alone: a shift tensor made on the host would be a copy from
            # pageable memory, which waits for the GPU (and cannot be captured in a CUDA graph)
            pairs = torch.stack((data & 0xF, data >> 4), dim=-1)
            return pairs.reshape(data.shape[0], self.cols)
        return unpack(data, self.bits, self.cols)


def _unpacked_codes(q: QuantizedTensor) -> torch.Tensor:
    if q.packed is None:
        raise TensorError("a QuantizedTensor needs codes or packed codes")
    return q.packed.unpack()


def _decoded_scales(q: QuantizedTensor) -> torch.Tensor:
    if q.scale_codes is None or q.format.scale.element is None:
        raise TensorError("a QuantizedTensor needs scales or scale codes to decode them from")
    return decode(q.scale_codes, q.format.scale.element)


# the fields of a QuantizedTensor that QuantizedLayout holds as they are
_LAYOUT_FIELDS = ("format", "rounding", "rht", "seed", "offset", "shape", "dtype", "transposed")


@dataclass(frozen=True)
class QuantizedLayout:
    """Everything of a QuantizedTensor but its tensors (``QuantizedTensor.split``): hashable,
    so it can be part of a cache or CUDA-graph key. ``packed``: (cols, bits) of packed codes."""

    format: BlockFormat
    rounding: str
    rht: RHTSpec | None
    seed: int
    offset: Any  # an int, or a DeviceOffset for stochastic rounding on CUDA
    shape: torch.Size
    dtype: torch.dtype
    transposed: bool
    packed: tuple[int, int] | None


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A block-scaled tensor as the reference quantizer produced it.

    ``codes`` is the 2-D [R, C] view of the input (1-D inputs are [1, n], higher ranks flatten
    their leading dimensions); ``scales`` holds the block decode scales s_b (float32,
    [ceil(R/br), ceil(C/bc)]), ``scale_codes`` their codes in the scale format (None for fp32
    scales) and ``global_scale`` the per-tensor decode scale S_dec (float32 0-dim, 1.0 when the
    format has none; [R, 1], one per row, with per-row global scales, docs/numerics.md 11.4).
    ``shape``/``dtype`` describe the original input. ``seed``/``offset`` are the Philox stream
    used for stochastic rounding (in the orientation originally quantized).

    A kernel's output may give ``codes=None`` with ``packed`` (its packed codes) and
    ``scales=None`` with ``scale_codes``: both are then derived on first read. While ``codes``
    has not been read, ``packed_codes()`` returns the packed form, which GEMM paths read instead.
    """

    codes: torch.Tensor = _DerivedOnRead(_unpacked_codes)  # type: ignore[assignment]
    scales: torch.Tensor = _DerivedOnRead(_decoded_scales)  # type: ignore[assignment]
    scale_codes: torch.Tensor | None
    global_scale: torch.Tensor
    format: BlockFormat
    rounding: str
    rht: RHTSpec | None
    seed: int
    offset: int
    shape: torch.Size
    dtype: torch.dtype
    transposed: bool = False
    packed: PackedCodes | None = None

    def packed_codes(self) -> PackedCodes | None:
        """The packed codes while ``codes`` has not been materialized (afterwards ``codes`` is
        the one authority: it may have been modified in place)."""
        return self.packed if self.__dict__["_codes"] is None else None

    def code_version(self) -> tuple[int, int]:
        """(identity, version) of the tensor holding the codes now: a cache key that changes
        when the codes do."""
        p = self.packed_codes()
        t = self.codes if p is None else p.data
        return id(t), tensor_version(t)

    # --- derived views ------------------------------------------------------------------------
    @property
    def element(self) -> ElementFormat:
        return self.format.element

    # rows, cols and device are read several times per GEMM call and never change (the code
    # tensors are fixed at construction; in-place writes keep their shape and device): kept,
    # but not pickled (a tensor loaded with map_location has another device)
    _KEPT = ("rows", "cols", "device")

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._KEPT}

    @cached_property
    def rows(self) -> int:
        p = self.packed_codes()
        return self.codes.shape[0] if p is None else p.data.shape[0]

    @cached_property
    def cols(self) -> int:
        p = self.packed_codes()
        return self.codes.shape[1] if p is None else p.cols

    @cached_property
    def device(self) -> torch.device:
        p = self.packed_codes()
        return self.codes.device if p is None else p.data.device

    @property
    def data(self) -> torch.Tensor:
        """Packed codes, uint8 [R, ceil(C*bits/8)] (see ``fp4gen.numerics.layout.pack``)."""
        p = self.packed_codes()
        return pack(self.codes, self.element.bits, check=False) if p is None else p.data

    @property
    def encode_scales(self) -> torch.Tensor:
        """e_b = min(fp32(1 / fp32(s_b * S_dec)), FLT_MAX) per block: what x was multiplied by."""
        return _encode_factors(self.scales, self.global_scale)

    def block_values(self, per_block: torch.Tensor) -> torch.Tensor:
        """Broadcast a per-block tensor to the [R, C] elements (padding cropped)."""
        br, bc = self.format.block
        return _expand(per_block, br, bc, self.rows, self.cols)

    # --- as tensors and a layout (autograd's saved tensors, CUDA-graph outputs) ----------------
    def split(self) -> tuple[tuple[torch.Tensor | None, ...], QuantizedLayout]:
        """The tensors this holds, as they are (codes, scales, scale codes, global scale, packed
        codes; None where absent or not derived yet: nothing is materialized), and the rest.
        ``QuantizedTensor.join(tensors, layout)`` puts them back together."""
        d, packed = self.__dict__, self.packed
        tensors = (d["_codes"], d["_scales"], self.scale_codes, self.global_scale)
        described = {name: getattr(self, name) for name in _LAYOUT_FIELDS}
        layout = QuantizedLayout(
            **described, packed=None if packed is None else (packed.cols, packed.bits)
        )
        return (*tensors, None if packed is None else packed.data), layout

    @classmethod
    def join(
        cls, tensors: tuple[torch.Tensor | None, ...], layout: QuantizedLayout
    ) -> QuantizedTensor:
        """The QuantizedTensor ``split`` took apart (the same tensors, not copies)."""
        codes, scales, scale_codes, global_scale, packed_data = tensors
        if global_scale is None:
            raise TensorError("a QuantizedTensor needs its global scale")
        packed = None
        if layout.packed is not None:
            if packed_data is None:
                raise TensorError("the layout has packed codes but no packed tensor was given")
            packed = PackedCodes(packed_data, *layout.packed)
        described = {name: getattr(layout, name) for name in _LAYOUT_FIELDS}
        return cls(codes, scales, scale_codes, global_scale, **described, packed=packed)

    # --- operations ---------------------------------------------------------------------------
    def dequantize(self, rotated: bool = False) -> torch.Tensor:
        """fp32(fp32(decode(code) * s_b) * S_dec), reshaped to the input's shape.

        With an RHT the inverse transform is applied (fp32) unless ``rotated`` is True, which
        returns the values in the rotated space the codes live in.
        """
        values = self.dequantize_blockwise() * self.global_scale
        if self.rht is not None and not rotated:
            values = inverse_rht(values, self.rht)
        return values.reshape(self.shape)

    def dequantize_blockwise(self) -> torch.Tensor:
        """fp32(decode(code) * s_b) as [R, C]: rotated space, global scale not applied."""
        return decode(self.codes, self.element) * self.block_values(self.scales)

    def transpose(self) -> QuantizedTensor:
        """The columnwise tensor of a 2D-block quantization: codes and scales transposed, never
        re-quantized (numerics contract section 4). Raises TensorError for 1D blocks and for
        tensors with an RHT (the transform runs along rows, so its transpose is not the
        columnwise quantization)."""
        if not self.format.is_2d:
            raise TensorError(
                f"transpose() needs 2D blocks; {self.format.name} has {self.format.block} "
                "blocks, so the columnwise tensor must be quantized from x.T"
            )
        if self.rht is not None:
            raise TensorError("transpose() is undefined with an RHT: quantize x.T instead")
        return replace(
            self,
            codes=self.codes.t().contiguous(),
            scales=self.scales.t().contiguous(),
            scale_codes=None if self.scale_codes is None else self.scale_codes.t().contiguous(),
            shape=torch.Size((self.cols, self.rows)),
            transposed=not self.transposed,
            packed=None,  # the codes above are the transpose's
        )

    def swizzled_scales(self) -> torch.Tensor:
        """Scale codes in the 128x4 tensor-core layout, one scale per row and K-block (2D tile
        scales are replicated to the tile's rows, as the GEMM reads them)."""
        if self.scale_codes is None:
            raise TensorError("fp32 block scales have no tensor-core swizzled layout")
        br = min(self.format.block[0], self.rows)  # a taller block is one block of all rows
        per_row = self.scale_codes.repeat_interleave(br, 0)[: self.rows]
        return swizzle_scales(per_row)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def tensor_version(t: torch.Tensor) -> int:
    """``t._version`` (in-place writes bump it), for keys of values derived from ``t``.
    Inference tensors keep no version counter: they get a number that never repeats, so
    nothing derived from them is reused (a stale derived value would be a silent error)."""
    if t.is_inference():
        return -next(_UNVERSIONED)
    return t._version


def _expand(per_block: torch.Tensor, br: int, bc: int, rows: int, cols: int) -> torch.Tensor:
    # A block side beyond the tensor's is one block along that side: clip it, so that a huge
    # block shape costs no memory
    br, bc = min(br, rows), min(bc, cols)
    return per_block.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]


def _encode_factors(s_b: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    # The reciprocal of the product, not a product of reciprocals (contract 2.5); s_b == 0 or an
    # underflowing product gives 1/0 = inf, capped at FLT_MAX.
    return torch.clamp(1.0 / (s_b * s_dec), max=FLT_MAX)


def _shown(value: Any) -> str:
    """repr(value) cut to a readable length (a tensor passed by mistake can print pages)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _as_int(value: Any) -> int | None:
    """``value`` as a Python int if it is an integer (int, numpy or torch integer), else None.
    bool is not an integer here."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _check_block(block: Any) -> tuple[int, int]:
    rule = "blocks are 1xN or NxN with N a positive integer, given as a pair (1, N) or (N, N)"
    sides = None
    if isinstance(block, (tuple, list, torch.Size)) and len(block) == 2:
        sides = (_as_int(block[0]), _as_int(block[1]))
    if sides is None or sides[0] is None or sides[1] is None:
        raise ArgumentError(f"block={_shown(block)}: {rule}")
    rows, cols = sides
    if rows < 1 or cols < 1 or (rows != 1 and rows != cols):
        raise ArgumentError(f"block={_shown(block)}: {rule}")
    return rows, cols


def resolve_format(fmt: BlockFormat | HighPrecision | str, block: tuple[int, int] | None = None):
    """A BlockFormat from a format or builtin name, with ``block`` overriding its block shape.

    Raises ArgumentError for an unknown name, a wrong type or a bad block, TensorError for a
    high-precision dtype (there is nothing to quantize)."""
    if isinstance(fmt, str):
        if fmt not in BUILTIN_FORMATS:
            raise ArgumentError(
                f"fmt: unknown format {_shown(fmt)}; a format is a BlockFormat or a built-in "
                f"name: {', '.join(sorted(BUILTIN_FORMATS))}"
            )
        fmt = BUILTIN_FORMATS[fmt]
    if isinstance(fmt, HighPrecision):
        raise TensorError(f"{fmt.name} is a high-precision dtype, not a quantized format")
    if not isinstance(fmt, BlockFormat):
        raise ArgumentError(
            f"fmt must be a BlockFormat or a built-in format name, got {type(fmt).__name__} "
            f"{_shown(fmt)}"
        )
    if block is not None:
        fmt = fmt.with_block(_check_block(block))
    return fmt


RHT_SIZES = "a power of two from 2 to 256"


def resolve_rht(hadamard: int | RHTSpec | None) -> RHTSpec | None:
    """None, an RHT size (16: Transformer Engine's fixed signs; any other size: no signs), or a
    full RHTSpec. Anything else raises ArgumentError."""
    if hadamard is None or isinstance(hadamard, RHTSpec):
        return hadamard
    size = _as_int(hadamard)
    if size is None:
        raise ArgumentError(
            f"hadamard must be None, an RHT size ({RHT_SIZES}) or an RHTSpec, "
            f"got {type(hadamard).__name__} {_shown(hadamard)}"
        )
    if not 2 <= size <= 256 or size & (size - 1):
        raise ArgumentError(f"hadamard={size}: the RHT size must be {RHT_SIZES}")
    if size == 16:
        return RHTSpec(16)
    return RHTSpec(size, sign_source="none", signs=None, seed=None)


# where a caller collects the finite checks' flags instead of reading them (finite_flags)
_collected = threading.local()


@contextmanager
def finite_flags() -> Iterator[list[torch.Tensor]]:
    """Inside this block the finite checks of ``quantize`` read nothing: each appends a 0-dim
    device bool (whether its tensor was all finite) to the yielded list, and the caller decides
    what a False means. For a caller that cannot read the device: a CUDA graph being captured
    (fp4gen.runtime.quantize_dispatch folds the flags into the global scale)."""
    before = getattr(_collected, "flags", None)
    _collected.flags = flags = []
    try:
        yield flags
    finally:
        _collected.flags = before


def _check_finite(x: torch.Tensor, what: str) -> None:
    flags = getattr(_collected, "flags", None)
    if flags is not None:
        flags.append(torch.isfinite(x).all())
        return
    bad = ~torch.isfinite(x)
    count = int(bad.sum())  # one device sync per quantize: kernels cannot represent NaN/Inf
    if count:
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise TensorError(
            f"{what} has {count} non-finite value(s) (NaN or Inf), the first at index {first}; "
            "block-scaled formats cannot represent them"
        )


def _as_2d_float32(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TensorError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TensorError(f"cannot quantize a {x.layout} tensor: expected a dense (strided) one")
    if x.dtype not in _INPUT_DTYPES:
        raise TensorError(
            f"cannot quantize a {x.dtype} tensor: expected float32, bfloat16 or float16"
        )
    if x.device.type not in ("cpu", "cuda"):
        raise TensorError(
            f"cannot quantize a tensor on device {x.device}: the reference runs on cpu or cuda"
        )
    if x.numel() == 0:
        raise TensorError(f"cannot quantize an empty tensor of shape {tuple(x.shape)}")
    _check_finite(x, f"the input of shape {tuple(x.shape)}")
    x = x.to(torch.float32)
    if x.dim() <= 1:
        return x.reshape(1, -1)
    return x.reshape(-1, x.shape[-1])


def _check_call(rounding: Any, seed: Any, offset: Any) -> tuple[int, int]:
    """ArgumentError for a rounding outside the vocabulary, or a seed or offset outside
    [0, 2^64); the seed and offset as ints. Shared by quantize and mor_quantize (and the
    backends' versions of both, ``fp4gen.runtime.quantize_dispatch``)."""
    if not isinstance(rounding, str) or rounding not in ELEMENT_ROUNDINGS:
        raise ArgumentError(f"rounding must be one of {ELEMENT_ROUNDINGS}, got {_shown(rounding)}")
    return _check_u64("seed", seed), _check_u64("offset", offset)


def _check_u64(name: str, value: int) -> int:
    """``value`` as an int in [0, 2^64) (a Philox key or counter word pair), else ArgumentError."""
    n = _as_int(value)
    if n is None or not 0 <= n < 1 << 64:
        raise ArgumentError(f"{name} must be an integer in [0, 2^64), got {_shown(value)}")
    return n


def _scalar(value: float, device: torch.device) -> torch.Tensor:
    # a fill on the device, not a copy from the host: a CUDA graph capture refuses those
    return torch.full((), value, dtype=torch.float32, device=device)


def _global_scales(
    amax: torch.Tensor, fmt: BlockFormat, elem_max: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_enc, S_dec) as fp32 tensors shaped like ``amax`` (0-dim, or [R, 1] per row)."""
    dev = amax.device
    if not fmt.global_scale:
        one = _scalar(1.0, dev)
        return one, one
    product = _scalar(fmt.global_max, dev) * _scalar(elem_max, dev)  # fp32, may be inf
    s_enc = torch.clamp(product / amax, max=FLT_MAX)  # amax == 0 -> inf -> replaced below
    s_enc = torch.where((amax == 0) | (s_enc == 0), _scalar(1.0, dev), s_enc)
    return s_enc, 1.0 / s_enc


def _block_scales(
    amax_b: torch.Tensor,
    s_enc: torch.Tensor,
    fmt: BlockFormat,
    target: float,
    rounding: str,
    bits: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(s_b float32, scale codes or None) from the block amaxes, mapping each block's amax to
    ``target`` (the element's max unless the format has targets), rounded by ``rounding``
    (``bits``: the blocks' 32-bit words for stochastic rounding)."""
    dev = amax_b.device
    scale = fmt.scale
    if scale.rounding == "ocp":
        # OCP MX: 2^(floor(log2(amax_b * S_enc)) - emax_elem), clamped into the scale range;
        # frexp gives v = m * 2^e with m in [0.5, 1), so floor(log2 v) = e - 1 exactly.
        assert scale.element is not None
        v = torch.clamp(amax_b * s_enc, max=FLT_MAX)  # an overflow to inf reads as 2^127
        _, e = torch.frexp(v)
        biased = (e.to(torch.int64) - 1 - max_exponent(fmt.element)) + scale.element.bias
        biased = biased.clamp(0, (1 << scale.element.exp_bits) - 2)  # all ones is NaN
        biased = torch.where(v == 0, torch.zeros_like(biased), biased)  # amax 0 -> smallest
        codes = biased.to(torch.uint8)
        return decode(codes, scale.element), codes
    inv_target = _scalar(1.0, dev) / _scalar(target, dev)  # fp32(1/target), RNE
    # Saturate at the cap, not at the scale format's max: a larger scale could decode a code to
    # +-inf (elem_max * s_b > FLT_MAX). The cap is on the grid, so rounding keeps s_b <= cap.
    # (ocp above needs no cap: s_b <= 2^(127 - emax_elem) and elem_max < 2^(emax_elem + 1).)
    d_b = torch.clamp(amax_b * (s_enc * inv_target), max=fmt.scale_cap)
    return _rounded_scales(d_b, fmt, rounding, bits)


def _rounded_scales(
    d_b: torch.Tensor, fmt: BlockFormat, rounding: str, bits: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ideal decode scales d_b (fp32, at most the cap) -> (s_b, scale codes or None)."""
    scale = fmt.scale
    if scale.element is None:
        return d_b, None
    codes = encode_scale(d_b, scale.element, rounding, bits)  # type: ignore[arg-type]
    return decode(codes, scale.element), codes


# The element index of block 0's scale word in a quantize call's Philox stream: far above every
# element's own index, so stochastic scales and elements never share a word (numerics.md 11.2).
SCALE_STREAM_INDEX = 1 << 62


def tree_sum(values: torch.Tensor) -> torch.Tensor:
    """fp32 sum over the last dimension as a pairwise tree in index order ((v0 + v1) +
    (v2 + v3)) + ..., zero-padded to a power of two: what a warp's xor-butterfly computes
    (fp32 addition commutes), so a kernel can give the same bits."""
    n = values.shape[-1]
    width = 1 << (n - 1).bit_length()
    if width != n:
        values = F.pad(values, (0, width - n))
    while values.shape[-1] > 1:
        values = values[..., 0::2] + values[..., 1::2]
    return values[..., 0]


def _per_block(values: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """[nbr * br, nbc * bc] -> [nbr, nbc, br * bc]: each block's elements, row-major."""
    rows, cols = values.shape
    blocks = values.reshape(rows // br, br, cols // bc, bc).permute(0, 2, 1, 3)
    return blocks.reshape(rows // br, cols // bc, br * bc)


@dataclass
class _Choice:
    """One candidate quantization of every block (numerics.md 11.1)."""

    s_b: torch.Tensor
    scale_codes: torch.Tensor | None
    codes: torch.Tensor


def _block_error(
    choice: _Choice, z: torch.Tensor, fmt: BlockFormat, br: int, bc: int, nbr: int, nbc: int
) -> torch.Tensor:
    """Each block's error [nbr, nbc]: tree_sum over its elements (row-major) of
    fp32(deq - z)^2 (mse) or |fp32(deq - z)| (mae), deq = fp32(decode(code) * s_b)."""
    rows, cols = z.shape
    deq = decode(choice.codes, fmt.element) * _expand(choice.s_b, br, bc, rows, cols)
    diff = deq - z
    err = diff * diff if fmt.target_error == "mse" else diff.abs()
    err = F.pad(err, (0, nbc * bc - cols, 0, nbr * br - rows))
    return tree_sum(_per_block(err, br, bc))


def _eden_scales(
    choice: _Choice,
    z: torch.Tensor,
    fmt: BlockFormat,
    scale_bits: torch.Tensor | None,
    nbc: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MS-EDEN (numerics.md 11.3): per group of G elements of a row, F = fp32(<z, z> / <z, q>)
    (tree sums; F = 1 where <z, q> is 0 or F is not finite), q = fp32(decode(code) * s_b);
    every block scale of the group becomes the format's rounding of min(fp32(s_b * F), cap)."""
    assert fmt.eden_group is not None
    rows, cols = z.shape
    bc = min(fmt.block[1], cols)
    group = fmt.eden_group
    deq = decode(choice.codes, fmt.element) * _expand(choice.s_b, 1, bc, rows, cols)
    n_groups = -(-cols // group)

    def grouped(v: torch.Tensor) -> torch.Tensor:
        return F.pad(v, (0, n_groups * group - cols)).reshape(rows, n_groups, group)

    zz = tree_sum(grouped(z * z))
    zq = tree_sum(grouped(z * deq))
    factor = zz / zq
    factor = torch.where((zq > 0) & torch.isfinite(factor), factor, torch.ones_like(factor))
    per_block = factor.repeat_interleave(max(group // bc, 1), dim=1)[:, :nbc]
    d_b = torch.clamp(choice.s_b * per_block, max=fmt.scale_cap)
    return _rounded_scales(d_b, fmt, fmt.scale.rounding, scale_bits)


# ----------------------------------------------------------------------------------------------
# The quantizer
# ----------------------------------------------------------------------------------------------


def quantize(
    x: torch.Tensor,
    fmt: BlockFormat | HighPrecision | str,
    *,
    block: tuple[int, int] | None = None,
    rounding: str = "nearest",
    hadamard: int | RHTSpec | None = None,
    seed: int = 0,
    offset: int = 0,
) -> QuantizedTensor:
    """Quantize ``x`` to the block-scaled format ``fmt`` (a BlockFormat or a builtin name).

    x: float32, bfloat16 or float16 on cpu or cuda; 0-D and 1-D are one row [1, n], higher ranks
    flatten their leading dimensions into rows. Blocks run along the last dimension (1 x N) or
    are N x N tiles. Empty tensors, other dtypes and NaN/Inf raise TensorError (kernels cannot
    represent non-finite values, so they are rejected up front, naming the count and the first
    index).

    block: overrides the format's block shape, e.g. (16, 16).
    rounding: element rounding, "nearest" (RNE), "stochastic" (32 random bits per value),
        "stochastic16", "stochastic8" (16 / 8 random bits per value) or "zero".
    hadamard: None; an int size d (16 uses Transformer Engine's fixed sign vector, any other
        size uses no signs, sign_source "none"); or an RHTSpec. The transform runs along the
        last dimension, its output rounded to bf16, and everything below sees the rotated x.
    seed, offset: the Philox stream of stochastic rounding; element (r, c) of the [R, C] tensor
        uses random field r * C + c (see ``fp4gen.numerics.philox.random_bits``).

    Not differentiable: ``x`` is detached, so no field of the result (and nothing
    ``dequantize()`` returns) carries an autograd graph. A gradient through the rounding would be
    zero almost everywhere and one through the scales only partial; to train with a format use
    ``fp4gen.nn.Linear``, which defines the GEMMs' gradients (the recipe's dgrad and wgrad).

    Bad arguments raise ``fp4gen.errors.ArgumentError`` (a ValueError) naming the argument, its
    value and the rule; bad tensors raise TensorError; both are FP4GenErrors.

    Algorithm (fp32 throughout):
      pad rows/cols to block multiples with zeros (padding only affects the amaxes, which it
      cannot change; outputs are cropped to the input);
      with a global scale: A = amax, S_enc = fp32(fp32(scale_max * elem_max) / A) capped at
      FLT_MAX, S_enc = 1 if A == 0 or S_enc == 0, S_dec = fp32(1 / S_enc); else both are 1;
      d_b = min(fp32(amax_b * fp32(S_enc * fp32(1 / elem_max))), scale_cap), scale_cap being
      the largest scale value with elem_max * scale_cap <= FLT_MAX (``BlockFormat.scale_cap``:
      the scale format's max unless that could decode to +-inf), so every code decodes finite;
      s_b = d_b rounded into the scale format per ScaleSpec.rounding (nearest/up/down; "ocp":
      2^(floor(log2(amax_b * S_enc)) - emax_elem) clamped, amax 0 -> smallest; fp32 scales:
      s_b = d_b);
      e_b = min(fp32(1 / fp32(s_b * S_dec)), FLT_MAX);
      y = clamp(fp32(x * e_b), -elem_max, elem_max); code = encode(y, element, rounding) with
      the sign bit set iff x < 0 (a negative x that rounds to zero is negative zero, -0.0 is
      code 0).
    The format's options (block targets, a global bound, per-row global scales, stochastic
    block scales, the MS-EDEN correction) change how s_b and S_enc are found: docs/numerics.md
    section 11 defines each step; the formats without them quantize exactly as above.
    """
    seed, offset = _check_call(rounding, seed, offset)
    bf = resolve_format(fmt, block)
    spec = resolve_rht(hadamard)
    if isinstance(x, torch.Tensor):
        x = x.detach()  # quantization is not differentiable (docstring): no graph in the result

    x2 = _as_2d_float32(x)  # validates x first, so x.shape and x.dtype exist below
    if spec is not None:
        x2 = rht(x2, spec)
        _check_finite(x2, "the Hadamard-transformed input")  # the butterflies can overflow

    rows, cols = x2.shape
    br, bc = bf.block
    br, bc = min(br, rows), min(bc, cols)  # the same blocks (see _expand), padding <= the tensor
    nbr, nbc = -(-rows // br), -(-cols // bc)
    padded = F.pad(x2, (0, nbc * bc - cols, 0, nbr * br - rows))
    amax_b = padded.abs().reshape(nbr, br, nbc, bc).amax(dim=(1, 3))

    elem = bf.element
    elem_max = max_finite(elem)
    # per row (1D blocks: block row = row) or per tensor
    amax = amax_b.amax(dim=1, keepdim=True) if bf.global_rows else amax_b.max()
    s_enc, s_dec = _global_scales(amax, bf, elem_max)

    bits = None
    if is_stochastic(rounding):
        bits = random_bits(
            rows * cols, seed, offset, device=x2.device, bits=sr_bits(rounding)
        ).reshape(rows, cols)
    scale_bits = None
    if bf.scale.rounding == "stochastic":
        index = torch.arange(nbr * nbc, dtype=torch.int64, device=x2.device) + SCALE_STREAM_INDEX
        scale_bits = random_words(index, seed, offset).reshape(nbr, nbc)
    # MS-EDEN rounds the scale once, after the correction: the codes are made with the nearest
    # scale; any other rounding is the format's own
    eden_stochastic = bf.eden_group is not None and bf.scale.rounding == "stochastic"
    first_rounding = "nearest" if eden_stochastic else bf.scale.rounding

    def candidate(target: float) -> _Choice:
        s_b, scale_codes = _block_scales(
            amax_b, s_enc, bf, target, first_rounding, None if eden_stochastic else scale_bits
        )
        e_b = _encode_factors(s_b, s_dec)
        y = torch.clamp(x2 * _expand(e_b, br, bc, rows, cols), -elem_max, elem_max)
        # the sign of x, not of y: a negative x whose product underflows to -0.0 keeps it
        codes = encode(y, elem, rounding, bits, negative=x2 < 0)  # type: ignore[arg-type]
        return _Choice(s_b, scale_codes, codes)

    targets = bf.block_targets
    chosen = candidate(targets[0])
    if len(targets) > 1:
        # Four Over Six: each block keeps the candidate of lower error, ties to the first
        z = x2 * s_enc  # the input in the units of the block scales, one rounding
        best = _block_error(chosen, z, bf, br, bc, nbr, nbc)
        for target in targets[1:]:
            other = candidate(target)
            err = _block_error(other, z, bf, br, bc, nbr, nbc)
            better = err < best
            best = torch.where(better, err, best)
            chosen = _Choice(
                torch.where(better, other.s_b, chosen.s_b),
                None
                if chosen.scale_codes is None or other.scale_codes is None
                else torch.where(better, other.scale_codes, chosen.scale_codes),
                torch.where(_expand(better, br, bc, rows, cols), other.codes, chosen.codes),
            )
    s_b, scale_codes, codes = chosen.s_b, chosen.scale_codes, chosen.codes
    if bf.eden_group is not None:
        s_b, scale_codes = _eden_scales(chosen, x2 * s_enc, bf, scale_bits, nbc)

    return QuantizedTensor(
        codes=codes,
        scales=s_b,
        scale_codes=scale_codes,
        global_scale=s_dec,
        format=bf,
        rounding=rounding,
        rht=spec,
        seed=seed,
        offset=offset,
        shape=x.shape,
        dtype=x.dtype,
    )


__all__ = [
    "FLT_MAX",
    "QuantizedLayout",
    "QuantizedTensor",
    "quantize",
    "resolve_format",
    "resolve_rht",
]
