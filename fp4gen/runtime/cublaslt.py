"""cuBLASLt through nvmath-python: D = alpha * (A @ B^T) [+ beta * C] [+ bias] with alpha and
beta read from device memory, for the dequantize + cuBLAS GEMM path (``fp4gen.runtime.dequant``).

Why not ``torch.mm``: the global scales S_a * S_b live on the GPU, and torch's bf16 GEMMs take
alpha only as a host number (a device-to-host sync per GEMM) and no fused bias with an fp32
alpha; so the torch path writes an fp32 product and applies alpha, the bias and the output dtype
in a second elementwise pass (about 10 % of an 8192^3 GEMM). cuBLASLt's matmul takes alpha and
beta by device pointer (``CUBLASLT_POINTER_MODE_DEVICE``) and adds the bias in its epilogue
(``CUBLASLT_EPILOGUE_BIAS``), so the whole GEMM is one kernel writing the output dtype.

Numerics: bf16 x bf16 products are exact in fp32 and accumulate in fp32
(``CUBLAS_COMPUTE_32F``; split-K partials in fp32 too); the epilogue computes
alpha * acc + beta * C + bias in fp32 (the scale type) and rounds once to D's dtype: the same
terms as the torch epilogue, possibly with fused multiply-adds (one rounding fewer), which the
GEMM tolerance covers (docs/gemm-sm90.md).

Layout: torch tensors are row-major and cuBLASLt's column-major, so the row-major product
D[M, N] = A[M, K] @ B[N, K]^T is computed as the column-major D^T[N, M] = op(B) op(A) with
``TRANSA = T`` on B's buffer (K x N, ld K) and ``TRANSB = N`` on A's (K x M, ld K). The bias
(length N) then runs along D^T's rows, which is what the bias epilogue adds.

The binding is NVIDIA's (``nvmath.bindings.cublasLt`` of nvmath-python: typed, maintained, a
Cython call per function), which finds the libcublasLt of the CUDA that torch runs on. A plan
(descriptors and the heuristic's algorithm) is made once per problem and device, so a call is
one ``cublasLtMatmul`` (and, with a bias, one attribute write for its pointer). When nvmath or
the library cannot be loaded, or no algorithm serves a problem, ``matmul`` returns None and the
caller takes the torch path; ``unavailable()`` says why.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fp4gen.runtime.device_memory import kept

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 32 * 2**20  # what cuBLAS itself uses on Hopper
ROW_ALIGN_BYTES = 16  # leading dimensions in bytes: what the tensor-core kernels need
PTR_ALIGN_BYTES = 256  # what the heuristic assumes of every pointer unless told otherwise

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the outputs and biases it takes


@dataclass(frozen=True)
class Problem:
    """One cuBLASLt matmul configuration: D[M, N] = alpha A[M, K] B[N, K]^T (+ beta C) (+ bias),
    row-major A, B (bf16) and C, D (``out_dtype``), all contiguous."""

    m: int
    n: int
    k: int
    out_dtype: torch.dtype
    bias_dtype: torch.dtype | None  # None: no bias
    accumulate: bool

    def layouts(self) -> dict[str, tuple[torch.dtype, int, int, int]]:
        """The column-major (dtype, rows, cols, ld) of cuBLASLt's A (B's buffer), B (A's) and
        C / D, as the module docstring derives them."""
        return {
            "A": (torch.bfloat16, self.k, self.n, self.k),
            "B": (torch.bfloat16, self.k, self.m, self.k),
            "D": (self.out_dtype, self.n, self.m, self.n),
        }

    def reason(self) -> str | None:
        """Why cuBLASLt is not asked for this problem, None when it is."""
        if self.out_dtype not in _DTYPES:
            return f"output dtype {self.out_dtype} (cuBLASLt path: bf16, fp16, fp32)"
        if self.bias_dtype not in (None, self.out_dtype, torch.float32):
            return f"a {self.bias_dtype} bias with a {self.out_dtype} output"
        item = self.out_dtype.itemsize
        if (self.k * 2) % ROW_ALIGN_BYTES or (self.n * item) % ROW_ALIGN_BYTES:
            return f"K = {self.k} or N = {self.n}: rows not multiples of {ROW_ALIGN_BYTES} bytes"
        if min(self.m, self.n, self.k) == 0:
            return "an empty product"
        return None


@dataclass
class _Plan:
    """Descriptors and the chosen algorithm of one Problem on one device."""

    desc: int
    layouts: dict[str, int]
    heuristic: Any  # the heuristic's result (kept alive: its first field is the algorithm)
    bias_pointer: np.ndarray  # the bias pointer attribute's value, written per call

    @property
    def algo(self) -> int:
        return self.heuristic.ptr  # cublasLtMatmulAlgo_t is the result's first field


_lib: list[Any] = []  # nvmath.bindings.cublasLt, once imported
_unavailable: list[str] = []
_handles: dict[int, int] = {}  # device index -> cublasLt handle
# (M, N, K, out dtype, bias dtype, accumulate, device) -> plan, or why cuBLASLt declines it
_plans: dict[tuple[Any, ...], _Plan | str] = {}
_workspaces: dict[tuple[int, int], torch.Tensor] = {}  # (device, stream) -> workspace
_constants: dict[tuple[int, float], torch.Tensor] = {}  # (device, value) -> fp32 scalar
_lock = threading.Lock()  # descriptors are shared: the bias pointer is set per call
_logged: set[str] = set()


def _declined(reason: str) -> None:
    """Log once why a call takes the torch path instead (the fallback is never silent)."""
    if reason not in _logged:
        _logged.add(reason)
        log.info("cuBLASLt GEMM not used, torch GEMM + epilogue pass instead: %s", reason)


def unavailable() -> str | None:
    """Why cuBLASLt cannot be used in this process (None when it can or was not tried)."""
    return _unavailable[0] if _unavailable else None


def available() -> bool:
    """Whether cuBLASLt can serve calls in this process (loads nvmath's binding once)."""
    return _library() is not None


def _library() -> Any | None:
    """nvmath's cuBLASLt binding with the library loaded (its version asked once: that loads
    it), or None with the reason in ``unavailable()``."""
    if not _lib and not _unavailable:
        try:
            from nvmath.bindings import cublasLt

            cublasLt.get_version()
            _lib.append(cublasLt)
        except ImportError as err:
            _unavailable.append(f"nvmath-python is not installed ({err})")
        except Exception as err:  # the library itself: nvmath raises its own errors for it
            _unavailable.append(f"cuBLASLt is unavailable ({type(err).__name__}: {err})")
    return _lib[0] if _lib else None


def _data_type(dtype: torch.dtype) -> int:
    from nvmath import CudaDataType

    return {
        torch.bfloat16: CudaDataType.CUDA_R_16BF,
        torch.float16: CudaDataType.CUDA_R_16F,
        torch.float32: CudaDataType.CUDA_R_32F,
    }[dtype]


def _handle(lt: Any, device: int) -> int:
    handle = _handles.get(device)
    if handle is None:
        with torch.cuda.device(device):
            handle = lt.create()
        _handles[device] = handle
    return handle


def _set_desc(lt: Any, desc: int, attr: Any, value: Any) -> np.ndarray:
    """Set a matmul descriptor attribute from a value of the type cuBLASLt gives it; returns the
    buffer (a caller that rewrites it per call keeps it)."""
    buf = np.array([value], dtype=lt.get_matmul_desc_attribute_dtype(attr))
    lt.matmul_desc_set_attribute(desc, attr, buf.ctypes.data, buf.itemsize)
    return buf


def _plan(lt: Any, problem: Problem, device: int) -> _Plan | None:
    """Descriptors for ``problem`` and the heuristic's first algorithm (None: none serves it)."""
    from nvmath.bindings.cublas import ComputeType, Operation

    attr = lt.MatmulDescAttribute
    f32 = _data_type(torch.float32)
    desc = lt.matmul_desc_create(ComputeType.COMPUTE_32F, f32)
    _set_desc(lt, desc, attr.SCALE_TYPE, f32)
    _set_desc(lt, desc, attr.POINTER_MODE, lt.PointerMode.DEVICE)
    _set_desc(lt, desc, attr.TRANSA, Operation.T)
    _set_desc(lt, desc, attr.TRANSB, Operation.N)
    epilogue = lt.Epilogue.DEFAULT if problem.bias_dtype is None else lt.Epilogue.BIAS
    _set_desc(lt, desc, attr.EPILOGUE, epilogue)
    if problem.bias_dtype is not None:
        _set_desc(lt, desc, attr.BIAS_DATA_TYPE, _data_type(problem.bias_dtype))
    bias_pointer = _set_desc(lt, desc, attr.BIAS_POINTER, 0)
    layouts = {
        name: lt.matrix_layout_create(_data_type(dtype), rows, cols, ld)
        for name, (dtype, rows, cols, ld) in problem.layouts().items()
    }
    pref = lt.matmul_preference_create()
    size = np.array([WORKSPACE_BYTES], dtype=np.uint64)
    lt.matmul_preference_set_attribute(
        pref, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, size.ctypes.data, size.itemsize
    )
    result = lt.MatmulHeuristicResult()
    count = np.zeros(1, dtype=np.int32)
    handle = _handle(lt, device)
    try:
        lt.matmul_algo_get_heuristic(
            handle, desc, layouts["A"], layouts["B"], layouts["D"], layouts["D"],
            pref, 1, result.ptr, count.ctypes.data,
        )  # fmt: skip
    except lt.cuBLASLtError:  # e.g. NOT_SUPPORTED: no algorithm for this problem
        count[0] = 0
    finally:
        lt.matmul_preference_destroy(pref)
    if count[0] < 1:  # the declined problem keeps no descriptors
        for layout in layouts.values():
            lt.matrix_layout_destroy(layout)
        lt.matmul_desc_destroy(desc)
        return None
    return _Plan(desc, layouts, result, bias_pointer)


def _workspace(device: int, stream: int) -> torch.Tensor:
    """One per stream: work on one stream runs in order and can share it."""

    def make() -> torch.Tensor:
        return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")

    return kept(_workspaces, (device, stream), make, device)


def constant(device: int, value: float) -> torch.Tensor:
    """A cached fp32 device scalar (beta); during a capture, one the graph owns."""

    def make() -> torch.Tensor:
        return torch.full((1,), value, dtype=torch.float32, device=f"cuda:{device}")

    return kept(_constants, (device, value), make, device)


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    alpha: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    accumulate: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """D = alpha * (a @ b^T) (+ accumulate) (+ bias) in one cuBLASLt call, or None when cuBLASLt
    does not serve this call (the caller then takes the torch path). D is ``out`` (contiguous
    [M, N] of ``out_dtype``, as ``fp4gen.gemm`` checks) where given and aligned, else new.

    ``a`` [M, K] and ``b`` [N, K]: contiguous bf16 on one CUDA device; ``alpha``: an fp32 device
    scalar; ``bias`` [N] in ``out_dtype`` or fp32; ``accumulate`` [M, N] in ``out_dtype`` (not
    modified). Tensors 256-byte aligned (fresh allocations are) and contiguous. The reason for a
    None is logged once."""
    if a.device.type != "cuda":
        _declined(f"operands on {a.device}")
        return None
    m, k = a.shape
    n = b.shape[0]
    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    bias_dtype = None if bias is None else bias.dtype
    key = (m, n, k, out_dtype, bias_dtype, accumulate is not None, device)
    plan = _plans.get(key)  # per call: plain-tuple lookups only, no descriptor work
    if plan is None:
        plan = _plan_for(Problem(m, n, k, out_dtype, bias_dtype, accumulate is not None), device)
        _plans[key] = plan
    reason = plan if isinstance(plan, str) else None
    if reason is None:
        if accumulate is not None and accumulate.dtype != out_dtype:
            reason = f"accumulating into {accumulate.dtype} with a {out_dtype} output"
        elif any(
            t.data_ptr() % PTR_ALIGN_BYTES or not t.is_contiguous()
            for t in (a, b, alpha, bias, accumulate)
            if t is not None
        ):
            reason = f"an operand not contiguous or not aligned to {PTR_ALIGN_BYTES} bytes"
    if reason is not None:
        _declined(reason)
        return None
    assert isinstance(plan, _Plan)
    lt = _lib[0]
    if out is None or out.data_ptr() % PTR_ALIGN_BYTES:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    stream = _current_stream(device)
    ws = _workspace(device, stream)
    beta = accumulate if accumulate is not None else out  # C: read only with beta = 1
    beta_value = constant(device, 1.0 if accumulate is not None else 0.0)
    with _lock:
        if bias is not None:
            plan.bias_pointer[0] = bias.data_ptr()
            lt.matmul_desc_set_attribute(
                plan.desc, lt.MatmulDescAttribute.BIAS_POINTER,
                plan.bias_pointer.ctypes.data, plan.bias_pointer.itemsize,
            )  # fmt: skip
        lt.matmul(
            _handle(lt, device), plan.desc, alpha.data_ptr(),
            b.data_ptr(), plan.layouts["A"], a.data_ptr(), plan.layouts["B"],
            beta_value.data_ptr(), beta.data_ptr(), plan.layouts["D"],
            out.data_ptr(), plan.layouts["D"], plan.algo,
            ws.data_ptr(), WORKSPACE_BYTES, stream,
        )  # fmt: skip
    return out


def _plan_for(problem: Problem, device: int) -> _Plan | str:
    """The plan of ``problem`` on ``device``, or why cuBLASLt does not serve it."""
    reason = problem.reason()
    if reason is not None:
        return reason
    lt = _library()
    if lt is None:
        return unavailable() or "cuBLASLt is unavailable"
    with _lock:
        plan = _plan(lt, problem, device)
    return plan if plan is not None else f"no cuBLASLt algorithm for {problem}"


def _current_stream(device: int) -> int:
    """The current CUDA stream's handle: torch's raw accessor where it has one (a few hundred
    nanoseconds, against microseconds for the Stream object)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device)
    return torch.cuda.current_stream(device).cuda_stream


__all__ = ["Problem", "constant", "matmul", "unavailable"]
