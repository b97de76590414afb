"""backend="reference" is the oracle: an operand whose Philox offset lives in a device counter
(``DeviceOffset``, what ``fp4gen.nn.Linear`` gives stochastic operands on CUDA) is quantized by
the torch reference at the counter's current offset, never by the generated kernels."""

from __future__ import annotations

import pytest
import torch

import fp4gen.runtime.operands as operands
from fp4gen.device_offset import DeviceOffset
from fp4gen.dsl.model import OperandSpec
from fp4gen.formats import BUILTIN_FORMATS
from fp4gen.runtime.quantize_dispatch import quantize


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_a_device_offset_operand_runs_the_kernels_only_off_the_reference(
    monkeypatch, backend: str
) -> None:
    asked: list[str] = []

    def kernels(*args, **kwargs):  # stands in for the generated kernels: they decline
        asked.append(backend)
        return None

    monkeypatch.setattr(operands, "quantize_cute", kernels)
    fmt = BUILTIN_FORMATS["nvfp4"]
    spec = OperandSpec(format=fmt, rounding="stochastic", rht=None)
    counter = torch.tensor([5], dtype=torch.int64)
    offset = DeviceOffset(counter, 8, (3,))
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    got = operands.quantize_operand(x, spec, seed=11, offset=offset, backend=backend)
    want = quantize(x, fmt, rounding="stochastic", seed=11, offset=5 * 8 + 3, backend="reference")
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
    assert asked == ([] if backend == "reference" else ["auto"])
