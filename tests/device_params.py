"""The device parameter of tests that run on the CPU and, with a GPU, on CUDA (its CUDA case
carries the ``gpu`` marker and skips without CUDA)."""

from __future__ import annotations

import pytest
import torch

CPU_AND_CUDA = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]
