"""Packing and the tensor-core scale swizzle against independent scalar implementations."""

from __future__ import annotations

import pytest
import torch

from fp4gen.errors import TensorError
from fp4gen.numerics.layout import (
    pack,
    packed_cols,
    swizzle_scales,
    swizzled_size,
    unpack,
    unswizzle_scales,
)


def ref_pack_row(codes: list[int], bits: int) -> list[int]:
    """Little-endian bit stream: element j at bits [j*bits, (j+1)*bits) of one big integer."""
    stream = sum(c << (j * bits) for j, c in enumerate(codes))
    return list(stream.to_bytes((len(codes) * bits + 7) // 8, "little"))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("cols", [1, 7, 16, 33])
def test_pack_matches_bit_stream_and_round_trips(bits: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(bits * 100 + cols)
    codes = torch.randint(0, 2**bits, (5, cols), generator=gen, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (5, packed_cols(cols, bits))
    for r in range(5):
        assert packed[r].tolist() == ref_pack_row(codes[r].tolist(), bits)
    assert torch.equal(unpack(packed, bits, cols), codes)


def test_nibble_order() -> None:
    # Element 0 in the low nibble (torch.float4_e2m1fn_x2 / Blackwell cvt order).
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x7, 0x9]], dtype=torch.uint8)
    assert pack(codes, 4).tolist() == [[0x21, 0x7F, 0x09]]


def test_pack_leading_dims_and_errors() -> None:
    codes = torch.randint(0, 64, (2, 3, 10), dtype=torch.uint8)
    assert torch.equal(unpack(pack(codes, 6), 6, 10), codes)
    with pytest.raises(TensorError, match="do not fit in 4 bits"):
        pack(torch.tensor([[16]], dtype=torch.uint8), 4)
    with pytest.raises(TensorError, match="must be uint8"):
        pack(torch.zeros(2, 2, dtype=torch.int32), 4)
    with pytest.raises(TensorError, match="need 2 bytes per row"):
        unpack(torch.zeros(1, 3, dtype=torch.uint8), 4, 4)


def offset(r: int, c: int, cols: int) -> int:
    c4 = -(-cols // 4)
    return ((r // 128) * c4 + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@pytest.mark.parametrize("rows,cols", [(1, 1), (128, 4), (130, 5), (300, 9), (256, 8)])
def test_swizzle_against_formula(rows: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(rows + cols)
    scales = torch.randint(1, 256, (rows, cols), generator=gen, dtype=torch.uint8)  # no zeros
    buf = swizzle_scales(scales)
    assert buf.shape == (swizzled_size(rows, cols),)
    assert buf.numel() == -(-rows // 128) * 128 * -(-cols // 4) * 4
    want = torch.zeros_like(buf)
    for r in range(rows):
        for c in range(cols):
            want[offset(r, c, cols)] = scales[r, c]
    assert torch.equal(buf, want)  # every padding byte is zero
    assert int((buf != 0).sum()) == rows * cols
    assert torch.equal(unswizzle_scales(buf, rows, cols), scales)


def test_swizzle_spot_offsets() -> None:
    scales = torch.zeros(256, 8, dtype=torch.uint8)
    points = {(0, 0): 0, (1, 0): 16, (32, 0): 4, (0, 1): 1, (0, 4): 512, (128, 0): 1024}
    points[(255, 7)] = offset(255, 7, 8)
    for i, (r, c) in enumerate(points):
        scales[r, c] = i + 1
    buf = swizzle_scales(scales)
    for i, ((r, c), off) in enumerate(points.items()):
        assert off == offset(r, c, 8)
        assert int(buf[off]) == i + 1, (r, c)
    assert points[(255, 7)] == 3 * 512 + 31 * 16 + 3 * 4 + 3


def test_unswizzle_size_error() -> None:
    with pytest.raises(TensorError, match=r"has 512 bytes"):
        unswizzle_scales(torch.zeros(100, dtype=torch.uint8), 3, 2)
