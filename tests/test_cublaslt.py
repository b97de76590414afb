"""The cuBLASLt call of the dequantize + cuBLAS GEMM path, without a GPU: the column-major
problem it describes and the calls it declines (the GPU tests in tests/test_dequant_gpu.py run
it against the torch path)."""

from __future__ import annotations

import torch

from fp4gen.runtime import cublaslt
from fp4gen.runtime.cublaslt import Problem


def test_row_major_product_as_column_major_layouts() -> None:
    # D[M, N] = A[M, K] B[N, K]^T is D^T[N, M] = op(B) op(A): B's buffer K x N (ld K, TRANSA =
    # T), A's K x M (ld K), D^T N x M (ld N)
    p = Problem(m=300, n=64, k=512, out_dtype=torch.float32, bias_dtype=None, accumulate=False)
    assert p.layouts() == {
        "A": (torch.bfloat16, 512, 64, 512),
        "B": (torch.bfloat16, 512, 300, 512),
        "D": (torch.float32, 64, 300, 64),
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
    """nvmath's binding present but the library (or the driver it needs) not loadable: the
    plan is the reason, the same reason ``unavailable()`` gives, and nothing raises."""
    from nvmath.bindings import cublasLt

    def no_library() -> int:
        raise RuntimeError("libcublasLt.so.13: cannot open shared object file")

    monkeypatch.setattr(cublaslt, "_lib", [])
    monkeypatch.setattr(cublaslt, "_unavailable", [])
    monkeypatch.setattr(cublasLt, "get_version", no_library)
    problem = Problem(128, 64, 64, torch.bfloat16, bias_dtype=None, accumulate=False)
    reason = cublaslt._plan_for(problem, 0)
    assert reason == cublaslt.unavailable()
    assert reason == (
        "cuBLASLt is unavailable (RuntimeError: libcublasLt.so.13: cannot open shared object file)"
    )


def test_without_nvmath_the_reason_names_the_package(monkeypatch) -> None:
    import sys

    monkeypatch.setattr(cublaslt, "_lib", [])
    monkeypatch.setattr(cublaslt, "_unavailable", [])
    monkeypatch.setitem(sys.modules, "nvmath.bindings", None)  # import fails: not installed
    problem = Problem(128, 64, 64, torch.bfloat16, bias_dtype=None, accumulate=False)
    reason = cublaslt._plan_for(problem, 0)
    assert reason == cublaslt.unavailable() and reason.startswith("nvmath-python is not installed")


def test_the_plan_describes_the_problem_to_cublaslt(monkeypatch) -> None:
    """What ``_plan`` asks of the binding, with the binding's calls recorded (no GPU): fp32
    compute and scale, device pointer mode, B's buffer transposed, the bias epilogue with the
    bias dtype, the column-major layouts of ``Problem.layouts``, a 32 MiB workspace, and the
    heuristic's first algorithm kept for the calls."""
    from nvmath import CudaDataType
    from nvmath.bindings import cublasLt as real
    from nvmath.bindings.cublas import ComputeType, Operation

    calls: list[tuple] = []
    attrs: dict[int, int] = {}

    class Binding:
        MatmulDescAttribute = real.MatmulDescAttribute
        MatmulPreferenceAttribute = real.MatmulPreferenceAttribute
        PointerMode, Epilogue, cuBLASLtError = real.PointerMode, real.Epilogue, real.cuBLASLtError
        get_matmul_desc_attribute_dtype = staticmethod(real.get_matmul_desc_attribute_dtype)
        MatmulHeuristicResult = staticmethod(real.MatmulHeuristicResult)

        @staticmethod
        def create() -> int:
            return 7

        @staticmethod
        def matmul_desc_create(compute: int, scale: int) -> int:
            calls.append(("desc", compute, scale))
            return 11

        @staticmethod
        def matmul_desc_set_attribute(desc: int, attr: int, buf: int, size: int) -> None:
            import ctypes

            attrs[int(attr)] = {4: ctypes.c_int32, 8: ctypes.c_int64}[size].from_address(buf).value

        @staticmethod
        def matrix_layout_create(dtype: int, rows: int, cols: int, ld: int) -> int:
            calls.append(("layout", dtype, rows, cols, ld))
            return 100 + len(calls)

        @staticmethod
        def matmul_preference_create() -> int:
            return 13

        @staticmethod
        def matmul_preference_set_attribute(pref: int, attr: int, buf: int, size: int) -> None:
            import ctypes

            calls.append(("workspace", ctypes.c_uint64.from_address(buf).value))

        @staticmethod
        def matmul_preference_destroy(pref: int) -> None:
            calls.append(("destroy preference", pref))

        found = 1  # algorithms the heuristic returns

        @staticmethod
        def matmul_algo_get_heuristic(handle, desc, a, b, c, d, pref, n, results, count) -> None:
            import ctypes

            calls.append(("heuristic", handle, desc, a, b, c, d, pref, n))
            ctypes.c_int32.from_address(count).value = Binding.found

        @staticmethod
        def matrix_layout_destroy(layout: int) -> None:
            calls.append(("destroy layout", layout))

        @staticmethod
        def matmul_desc_destroy(desc: int) -> None:
            calls.append(("destroy desc", desc))

    monkeypatch.setattr(cublaslt, "_handles", {0: 7})
    p = Problem(300, 64, 512, torch.bfloat16, bias_dtype=torch.float32, accumulate=False)
    plan = cublaslt._plan(Binding, p, 0)
    a = real.MatmulDescAttribute
    f32, bf16 = int(CudaDataType.CUDA_R_32F), int(CudaDataType.CUDA_R_16BF)
    assert calls[0] == ("desc", ComputeType.COMPUTE_32F, f32)
    assert attrs[a.SCALE_TYPE] == f32 and attrs[a.POINTER_MODE] == real.PointerMode.DEVICE
    assert attrs[a.TRANSA] == Operation.T and attrs[a.TRANSB] == Operation.N
    assert attrs[a.EPILOGUE] == real.Epilogue.BIAS and attrs[a.BIAS_DATA_TYPE] == f32
    assert calls[1:4] == [
        ("layout", bf16, 512, 64, 512),
        ("layout", bf16, 512, 300, 512),
        ("layout", bf16, 64, 300, 64),
    ]
    assert calls[4] == ("workspace", 32 * 2**20)
    assert calls[5] == ("heuristic", 7, 11, 102, 103, 104, 104, 13, 1)  # A, B, C = D, D
    assert calls[6] == ("destroy preference", 13)
    assert plan is not None and plan.desc == 11 and plan.algo == plan.heuristic.ptr
    assert len(calls) == 7  # a plan that serves keeps its descriptors
    # no algorithm: no plan, and the descriptors made for it are destroyed
    calls.clear()
    Binding.found = 0
    assert cublaslt._plan(Binding, p, 0) is None
    assert calls[-4:] == [
        ("destroy layout", 102), ("destroy layout", 103), ("destroy layout", 104),
        ("destroy desc", 11),
    ]  # fmt: skip
