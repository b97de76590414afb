"""The tile quantize kernel stores each thread's codes at byte addresses: a strip's row segment
(``vec`` values along K) and column segment (``rows`` values along M) must be whole bytes
(``codegen.quantize.tile_bytes_reason``). With fp32 inputs a strip is 4 values wide, so
3-, 5- and 7-bit elements (e2m0, e2m2, e3m3, ...) are refused there, with the reason, and
quantized by the reference instead: the GPU recipe fuzzer's finding (seed 2662692715, training
cases 425-428: an e2m0 8x8 weight's dgrad copy quantized from its fp32 dequantized fprop copy
had half its codes misplaced). bf16 inputs (8-value strips) keep the kernel for every width.
Without a GPU: the refusals and what still renders; the bits on a GPU are
tests/test_tile_code_bytes_gpu.py's."""

from __future__ import annotations

import pytest

from fp4gen.codegen.quantize import render, spec_tile_mapping, tile_bytes_reason
from fp4gen.compiler.plan import kernel_spec
from fp4gen.formats import UE8M0, BlockFormat, ElementFormat, ScaleSpec
from fp4gen.spec import QuantOutput

PAIR = (QuantOutput("rowwise", "nearest", None), QuantOutput("columnwise", "nearest", None))
ROW = (QuantOutput("rowwise", "nearest", None),)
COL = (QuantOutput("columnwise", "nearest", None),)
# (exponent bits, mantissa bits) of elements 3 to 8 bits wide
ELEMENTS = [(2, 0), (1, 2), (2, 2), (3, 1), (2, 3), (3, 2), (3, 3), (4, 2), (4, 3), (5, 2)]


def fmt(exp: int, man: int, block: tuple[int, int]) -> BlockFormat:
    element = ElementFormat(exp, man, True, "fn" if man == 0 else "finite")
    return BlockFormat("t", element, block, ScaleSpec(UE8M0, "up"))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("outputs", [PAIR, ROW, COL], ids=["row_col", "row", "col"])
@pytest.mark.parametrize("block", [(1, 32), (8, 8), (16, 16)], ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("element", ELEMENTS, ids=lambda e: f"e{e[0]}m{e[1]}")
def test_refused_exactly_where_a_segment_is_not_whole_bytes(element, block, outputs, dtype):
    if block[0] == 1 and outputs == ROW:
        pytest.skip("one rowwise copy of 1D blocks is the rowwise kernel's")
    f = fmt(*element, block)
    spec = kernel_spec(f, dtype, outputs)  # type: ignore[arg-type]
    mapping = spec_tile_mapping(spec)
    bits = f.element.bits
    along_k = outputs != COL or block[0] != 1
    along_m = outputs != ROW
    odd = (along_k and mapping.vec * bits % 8) or (along_m and mapping.rows * bits % 8)
    reason = tile_bytes_reason(spec)
    assert (reason is not None) == bool(odd), (spec.name, mapping.vec, mapping.rows)
    # the only refusals: fp32's 4-value strips with 3-, 5- or 7-bit elements along K
    assert bool(odd) == (dtype == "fp32" and along_k and bits % 2 == 1)
    if reason is not None:
        assert "not whole bytes" in reason and f"{bits} bits" in reason
        with pytest.raises(NotImplementedError, match="not whole bytes"):
            render(spec)
    else:
        assert render(spec)  # the kernel module renders


def test_the_fuzzers_format_is_refused_for_fp32_only() -> None:
    """The failing recipe's weight format (e2m0 fn 8x8, e7m0 scales rounded stochastically)."""
    e7m0 = ElementFormat(7, 0, True, "finite")
    fa = BlockFormat("fa", ElementFormat(2, 0, True, "fn"), (8, 8), ScaleSpec(e7m0, "stochastic"))
    for outputs in (ROW, PAIR):
        fp32 = kernel_spec(fa, "fp32", outputs)
        assert "4 codes of 3 bits along K are not whole bytes (fp32 inputs" in (
            tile_bytes_reason(fp32) or ""
        )
        assert tile_bytes_reason(kernel_spec(fa, "bf16", outputs)) is None
