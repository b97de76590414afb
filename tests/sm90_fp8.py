"""What the sm_90a FP8 GEMM GPU tests share: their markers (a GPU, and sm_90: FP8 wgmma or
cuBLAS's block scaling) and the e4m3 element."""

from __future__ import annotations

import pytest
import torch

from fp4gen.formats import BUILTIN_FORMATS


def sm90_marks(reason: str) -> list:
    """The markers of a test that needs an sm_90 GPU: ``gpu``, a CUDA device, compute
    capability 9.0 (``reason`` says which part needs it)."""
    return [
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        pytest.mark.skipif(
            torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
            reason=reason,
        ),
    ]


MARKS = sm90_marks("FP8 wgmma: sm_90a only")

E4M3 = BUILTIN_FORMATS["mxfp8_e4m3"].element
