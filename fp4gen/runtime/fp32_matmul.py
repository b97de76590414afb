"""fp32 matmuls with full fp32 products for a block of code, whatever TF32 setting the process has.

TF32 rounds fp32 GEMM inputs to 10 mantissa bits; the exact fp32 paths (the torch decode of the
dequant backend, ``set_fp8_semantics("exact")``, the fp32 fallback of the dequantize + cuBLAS
path) must not. torch has two ways to set it: the legacy flags
(``torch.backends.cuda.matmul.allow_tf32``, ``torch.set_float32_matmul_precision``) and, since
2.9, ``fp32_precision`` ("ieee", "tf32", or "none": inherit) per backend and for all of them
(``torch.backends.fp32_precision``). Once the process has set the all-backends one
(transformers' Trainer does, with ``torch_compile=True`` on a CUDA machine), reading a legacy
flag raises RuntimeError ("mix of the legacy and new APIs"); the per-backend setting reads and
writes after either. So this uses the per-backend setting where torch has it, else the legacy
flag. Where the matmul setting inherits "tf32" from the all-backends one, it is put back as an
explicit "tf32" (the same products).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def ieee_fp32_matmul() -> Iterator[None]:
    """CUDA fp32 matmuls in this block with full fp32 products (no TF32); the process's setting
    is put back after it."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
        saved = matmul.fp32_precision
        matmul.fp32_precision = "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = saved
    else:
        saved_flag = matmul.allow_tf32
        matmul.allow_tf32 = False
        try:
            yield
        finally:
            matmul.allow_tf32 = saved_flag


__all__ = ["ieee_fp32_matmul"]
