"""Storage layouts: packed element codes and the tensor-core scale-factor swizzle.

Packing: each row is a little-endian bit stream. Element j occupies bits [j*bits, (j+1)*bits) of
the row, bit k of the stream is bit (k % 8) of byte k // 8. For 4-bit codes element 0 is the low
nibble of byte 0 (Blackwell's cvt and torch's float4_e2m1fn_x2 order). Rows are padded with zero
bits to a whole byte.

Scale swizzle (numerics contract section 9): 128 x 4 atoms of 512 bytes; rows padded to a
multiple of 128 and scale columns to a multiple of 4 with zeros. With C4 = ceil(C / 4), scale
(r, c) lives at byte ((r // 128) * C4 + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4
+ c % 4.
"""

from __future__ import annotations

import torch

from fp4gen.errors import TensorError


def _need_uint8(t: torch.Tensor, what: str) -> None:
    if t.dtype != torch.uint8:
        raise TensorError(f"{what} must be uint8, got {t.dtype}")


def packed_cols(cols: int, bits: int) -> int:
    """Bytes per packed row of ``cols`` codes of ``bits`` bits."""
    return (cols * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int, *, check: bool = True) -> torch.Tensor:
    """Pack uint8 codes [..., C] of width ``bits`` (1..8) into uint8 [..., ceil(C*bits/8)].

    With ``check`` a code that does not fit ``bits`` raises TensorError (one device sync);
    without it the high bits are dropped.
    """
    _need_uint8(codes, "codes")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1..8, got {bits}")
    if codes.dim() < 1:
        raise TensorError("pack needs at least one dimension")
    if check and bits < 8 and bool((codes >> bits).any()):
        raise TensorError(f"codes do not fit in {bits} bits")
    *lead, cols = codes.shape
    nbytes = packed_cols(cols, bits)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.uint8)
    stream = ((codes.unsqueeze(-1) >> shifts) & 1).reshape(*lead, cols * bits)
    stream = torch.nn.functional.pad(stream, (0, nbytes * 8 - cols * bits))
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32)).to(torch.int32)
    packed = (stream.reshape(*lead, nbytes, 8).to(torch.int32) * weights).sum(-1)
    return packed.to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 [..., B] -> uint8 codes [..., cols]."""
    _need_uint8(packed, "packed data")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1..8, got {bits}")
    *lead, nbytes = packed.shape
    if nbytes != packed_cols(cols, bits):
        raise TensorError(
            f"{cols} codes of {bits} bits need {packed_cols(cols, bits)} bytes per row, "
            f"got shape {tuple(packed.shape)}"
        )
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    stream = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(*lead, nbytes * 8)
    stream = stream[..., : cols * bits].reshape(*lead, cols, bits).to(torch.int32)
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int32)).to(torch.int32)
    return (stream * weights).sum(-1).to(torch.uint8)


def swizzled_size(rows: int, cols: int) -> int:
    """Bytes of the swizzled buffer for a [rows, cols] scale matrix (with padding)."""
    return -(-rows // 128) * 128 * (-(-cols // 4) * 4)


def swizzle_scales(scale_codes: torch.Tensor) -> torch.Tensor:
    """uint8 scale codes [R, C] -> 1D uint8 buffer in the 128x4 tensor-core layout."""
    _need_uint8(scale_codes, "scale codes")
    if scale_codes.dim() != 2:
        raise TensorError(f"scale codes must be 2-D, got shape {tuple(scale_codes.shape)}")
    rows, cols = scale_codes.shape
    r128, c4 = -(-rows // 128), -(-cols // 4)
    padded = torch.nn.functional.pad(scale_codes, (0, c4 * 4 - cols, 0, r128 * 128 - rows))
    # r = rb*128 + q*32 + i and c = cb*4 + j  ->  offset (rb, cb, i, q, j) row-major.
    atoms = padded.reshape(r128, 4, 32, c4, 4).permute(0, 3, 2, 1, 4)
    return atoms.contiguous().reshape(-1)


def unswizzle_scales(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: 1D buffer -> uint8 [rows, cols] (padding dropped)."""
    _need_uint8(buffer, "swizzled scales")
    r128, c4 = -(-rows // 128), -(-cols // 4)
    if buffer.dim() != 1 or buffer.numel() != r128 * 128 * c4 * 4:
        raise TensorError(
            f"a swizzled [{rows}, {cols}] scale matrix has {swizzled_size(rows, cols)} bytes, "
            f"got shape {tuple(buffer.shape)}"
        )
    atoms = buffer.reshape(r128, c4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return atoms.reshape(r128 * 128, c4 * 4)[:rows, :cols].contiguous()
