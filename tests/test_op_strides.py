"""The custom ops return their outputs with the row-major strides their fake kernels declare
(``torch.compile`` compares strides): ``fp4gen.runtime.ops.row_major``."""

from __future__ import annotations

import torch

from fp4gen.runtime.ops import row_major


def test_a_size_one_dimension_gets_its_row_major_stride_without_a_copy() -> None:
    padded = torch.arange(256.0).reshape(16, 16)
    y = padded[:1, :8]  # a 1-token product sliced from one padded to 16 columns
    assert y.stride() == (16, 1) and y.is_contiguous()
    got = row_major(y)
    assert got.stride() == (8, 1) and got.data_ptr() == y.data_ptr()
    assert torch.equal(got, y)


def test_row_major_tensors_are_returned_as_they_are_and_others_copied() -> None:
    t = torch.randn(3, 4)
    assert row_major(t) is t
    cols = torch.randn(8, 16).t()  # column-major [16, 8]
    got = row_major(cols)
    assert got.stride() == (8, 1) and torch.equal(got, cols)
    empty = torch.empty(0, 5)
    assert row_major(empty).stride() == (5, 1)
