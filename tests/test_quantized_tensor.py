"""QuantizedTensor's fields derived on first read: a kernel's packed codes (unpacked only when
``codes`` is read) and scale codes (decoded only when ``scales`` is read)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fp4gen.errors import TensorError
from fp4gen.formats import BUILTIN_FORMATS
from fp4gen.numerics import QuantizedTensor, quantize
from fp4gen.numerics.layout import pack
from fp4gen.numerics.quantize import PackedCodes


def lazy_copy(q: QuantizedTensor) -> QuantizedTensor:
    """``q`` as a kernel's output would give it: packed codes, scale codes only."""
    bits = q.element.bits
    return replace(
        q, codes=None, scales=None, packed=PackedCodes(pack(q.codes, bits), q.cols, bits)
    )


@pytest.mark.parametrize(
    ("name", "cols"), [("nvfp4", 64), ("nvfp4", 48), ("mxfp6_e2m3", 64), ("mxfp4", 96)]
)
def test_packed_codes_and_scale_codes_are_derived_on_read(name: str, cols: int) -> None:
    q = quantize(torch.randn(40, cols, generator=torch.Generator().manual_seed(1)), name)
    lazy = lazy_copy(q)
    assert lazy.__dict__["_codes"] is None and lazy.__dict__["_scales"] is None
    # shape queries and the packed view do not unpack
    assert (lazy.rows, lazy.cols, lazy.device) == (q.rows, q.cols, q.device)
    assert lazy.data is lazy.packed.data and lazy.packed_codes() is lazy.packed
    assert lazy.__dict__["_codes"] is None
    assert torch.equal(lazy.scales, q.scales) and lazy.__dict__["_codes"] is None
    assert torch.equal(lazy.codes, q.codes)  # unpacked now, and the codes are the authority
    assert lazy.packed_codes() is None
    assert torch.equal(lazy.dequantize(), q.dequantize())


def test_the_cache_key_follows_the_tensor_that_holds_the_codes() -> None:
    lazy = lazy_copy(quantize(torch.randn(16, 32), "nvfp4"))
    before = lazy.code_version()
    assert before == (id(lazy.packed.data), lazy.packed.data._version)
    lazy.codes[0, 0] ^= 1  # materialized and modified: the key moves to the codes
    assert lazy.code_version() == (id(lazy.codes), lazy.codes._version) != before


def test_transpose_drops_the_packed_codes() -> None:
    q = quantize(torch.randn(32, 48), BUILTIN_FORMATS["nvfp4"].with_block((16, 16)))
    t = lazy_copy(q).transpose()
    assert t.packed is None and torch.equal(t.codes, q.codes.t())
    assert (t.rows, t.cols) == (48, 32)


def test_missing_codes_and_scales_say_so() -> None:
    q = quantize(torch.randn(16, 32), "nvfp4")
    with pytest.raises(TensorError, match="needs codes or packed codes"):
        _ = replace(q, codes=None).codes
    with pytest.raises(TensorError, match="needs scales or scale codes"):
        _ = replace(q, scales=None, scale_codes=None).scales
