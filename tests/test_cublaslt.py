"""The cuBLASLt call of the dequantize + cuBLAS GEMM path, without a GPU: the column-major
problem it describes and the calls it declines (the GPU tests in tests/test_dequant_gpu.py run
it against the torch path)."""

from __future__ import annotations

import torch

from fp4gen.runtime import cublaslt
from fp4gen.runtime.cublaslt import CUDA_R_16BF, CUDA_R_32F, Problem


def test_row_major_product_as_column_major_layouts() -> None:
    # D[M, N] = A[M, K] B[N, K]^T is D^T[N, M] = op(B) op(A): B's buffer K x N (ld K, TRANSA =
    # T), A's K x M (ld K), D^T N x M (ld N)
    p = Problem(m=300, n=64, k=512, out_dtype=torch.float32, bias_dtype=None, accumulate=False)
    assert p.layouts() == {
        "A": (CUDA_R_16BF, 512, 64, 512),
        "B": (CUDA_R_16BF, 512, 300, 512),
        "D": (CUDA_R_32F, 64, 300, 64),
    }
    assert p.reason() is None


def test_declined_problems_say_why() -> None:
    def reason(**kw) -> str | None:
        args = dict(m=128, n=64, k=64, out_dtype=torch.bfloat16, bias_dtype=None)
        return Problem(**{**args, **kw}, accumulate=False).reason()

    assert reason() is None
    assert reason(bias_dtype=torch.bfloat16) is None
    assert reason(bias_dtype=torch.float32) is None  # an fp32 bias with a bf16 output
    assert "float16 bias" in reason(bias_dtype=torch.float16)
    assert "N = 100" in reason(n=100)  # 200-byte bf16 rows
    assert reason(n=100, out_dtype=torch.float32) is None  # 400-byte rows
    assert "K = 60" in reason(k=60)
    assert "output dtype" in reason(out_dtype=torch.float64)
    assert reason(m=0) == "an empty product"


def test_cpu_tensors_take_the_torch_path() -> None:
    a = torch.zeros(16, 16, dtype=torch.bfloat16)
    assert cublaslt.matmul(a, a, torch.ones(1), out_dtype=torch.bfloat16) is None
    assert "operands on cpu" in cublaslt._logged


def test_a_missing_library_is_a_reason_not_an_error(monkeypatch) -> None:
    monkeypatch.setattr(cublaslt, "_lib", [])
    monkeypatch.setattr(cublaslt, "_unavailable", [])
    monkeypatch.setattr(cublaslt.torch.version, "cuda", "0.0")  # no libcublasLt.so.0 anywhere
    monkeypatch.setattr(cublaslt.ctypes, "CDLL", _no_library)
    problem = Problem(128, 64, 64, torch.bfloat16, bias_dtype=None, accumulate=False)
    reason = cublaslt._plan_for(problem, 0)
    assert reason == cublaslt.unavailable()
    assert "cannot load libcublasLt.so.0 or libcublasLt.so" in reason


def _no_library(name: str):
    raise OSError(f"{name}: cannot open shared object file")
