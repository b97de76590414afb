"""``cute_backend._quantized``: the QuantizedTensor of a kernel's outputs, its global scale."""

from __future__ import annotations

import dataclasses

import torch

from fp4gen.formats import BUILTIN_FORMATS
from fp4gen.runtime import cute_backend


def pieces(rows: int, global_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "data": torch.zeros((rows, 8), dtype=torch.uint8),
        "scales": torch.full((rows, 1), 0x38, dtype=torch.uint8),
        "global_scale": global_scale,
    }


def made(fmt, rows: int, global_scale: torch.Tensor, flag=None):
    return cute_backend._quantized(pieces(rows, global_scale), "", fmt, 16, "rne", None, 0, 0,
                                   torch.Size((rows, 16)), torch.bfloat16, flag)  # fmt: skip


def test_the_global_scale_per_tensor_and_per_row() -> None:
    """Per tensor: a 0-dim fp32 scale, the kernel's element itself where it already is one (a
    view of a group's slot); any other shape or dtype reshaped and cast. Per row: [R, 1]."""
    nvfp4 = BUILTIN_FORMATS["nvfp4"]
    slots = torch.tensor([0.5, 2.0])
    one = slots.unbind(0)[1]
    q = made(nvfp4, 3, one)
    assert q.global_scale.shape == () and q.global_scale.dtype == torch.float32
    assert q.global_scale.data_ptr() == slots[1:].data_ptr() and float(q.global_scale) == 2.0
    for given in (torch.tensor([3.0]), torch.tensor(3.0, dtype=torch.float64)):
        q = made(nvfp4, 3, given)
        assert q.global_scale.shape == () and q.global_scale.dtype == torch.float32
        assert float(q.global_scale) == 3.0
    per_row = dataclasses.replace(nvfp4, global_rows=True)
    q = made(per_row, 3, torch.tensor([1.0, 2.0, 4.0]))
    assert q.global_scale.shape == (3, 1) and q.global_scale.flatten().tolist() == [1, 2, 4]


def test_a_non_finite_input_poisons_the_global_scale() -> None:
    nvfp4 = BUILTIN_FORMATS["nvfp4"]
    q = made(nvfp4, 2, torch.tensor(2.0), flag=torch.tensor(False))
    assert torch.isnan(q.global_scale) and q.global_scale.dtype == torch.float32
    assert float(made(nvfp4, 2, torch.tensor(2.0), flag=torch.tensor(True)).global_scale) == 2.0
