"""cuBLASLt through ctypes: D = alpha * (A @ B^T) [+ beta * C] [+ bias] with alpha and beta read
from device memory, for the dequantize + cuBLAS GEMM path (``fp4gen.runtime.dequant``).

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

The library is the libcublasLt the running torch loaded (``libcublasLt.so.<CUDA major>``). When
it cannot be loaded, or no algorithm serves a problem, ``matmul`` returns None and the caller
takes the torch path; ``unavailable()`` says why.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from fp4gen.runtime.device_memory import kept

log = logging.getLogger(__name__)

# cuBLASLt / CUDA enum values (cublasLt.h, library_types.h)
CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUBLASLT_POINTER_MODE_DEVICE = 1
DESC_SCALE_TYPE = 1
DESC_POINTER_MODE = 2
DESC_TRANSA = 3
DESC_TRANSB = 4
DESC_EPILOGUE = 7
DESC_BIAS_POINTER = 8
DESC_BIAS_DATA_TYPE = 26
EPILOGUE_DEFAULT = 1
EPILOGUE_BIAS = 4
PREF_MAX_WORKSPACE_BYTES = 1
HEURISTIC_RESULT_BYTES = 96  # cublasLtMatmulHeuristicResult_t: algo, size_t, int, float, int[4]
ALGO_BYTES = 64

WORKSPACE_BYTES = 32 * 2**20  # what cuBLAS itself uses on Hopper
ROW_ALIGN_BYTES = 16  # leading dimensions in bytes: what the tensor-core kernels need
PTR_ALIGN_BYTES = 256  # what the heuristic assumes of every pointer unless told otherwise

_DTYPES = {torch.bfloat16: CUDA_R_16BF, torch.float16: CUDA_R_16F, torch.float32: CUDA_R_32F}


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

    def layouts(self) -> dict[str, tuple[int, int, int, int]]:
        """The column-major (type, rows, cols, ld) of cuBLASLt's A (B's buffer), B (A's) and
        C / D, as the module docstring derives them."""
        out = _DTYPES[self.out_dtype]
        return {
            "A": (CUDA_R_16BF, self.k, self.n, self.k),
            "B": (CUDA_R_16BF, self.k, self.m, self.k),
            "D": (out, self.n, self.m, self.n),
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


class _Lib:
    """The loaded libcublasLt with the argument types of the functions used."""

    def __init__(self) -> None:
        major = (torch.version.cuda or "0").split(".")[0]
        names = [f"libcublasLt.so.{major}", "libcublasLt.so"]
        last: OSError | None = None
        for name in names:
            try:
                self.dll = ctypes.CDLL(name)
                break
            except OSError as err:
                last = err
        else:
            raise OSError(f"cannot load {' or '.join(names)}: {last}")
        vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        sigs: dict[str, list[Any]] = {
            "cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i32, i32],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i32, ctypes.c_uint64,
                                           ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, vp,
                                               ctypes.POINTER(i32)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        }  # fmt: skip
        for fn_name, argtypes in sigs.items():
            fn = getattr(self.dll, fn_name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} returned cuBLAS status {status}")


@dataclass
class _Plan:
    """Descriptors and the chosen algorithm of one Problem on one device."""

    desc: ctypes.c_void_p
    layouts: dict[str, ctypes.c_void_p]
    algo: ctypes.Array  # the algo bytes of the heuristic result


_lib: list[_Lib] = []
_unavailable: list[str] = []
_handles: dict[int, ctypes.c_void_p] = {}  # device index -> cublasLt handle
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


def _library() -> _Lib | None:
    if not _lib and not _unavailable:
        try:
            _lib.append(_Lib())
        except (OSError, AttributeError) as err:
            _unavailable.append(f"cuBLASLt is unavailable ({err})")
    return _lib[0] if _lib else None


def _handle(lib: _Lib, device: int) -> ctypes.c_void_p:
    handle = _handles.get(device)
    if handle is None:
        handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            lib.check(lib.dll.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        _handles[device] = handle
    return handle


def _set(lib: _Lib, fn: Any, obj: ctypes.c_void_p, attr: int, value: Any, what: str) -> None:
    lib.check(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), what)


def _plan(lib: _Lib, problem: Problem, device: int) -> _Plan | None:
    """Descriptors for ``problem`` and the heuristic's first algorithm (None: none serves it)."""
    desc = ctypes.c_void_p()
    lib.check(
        lib.dll.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
        "cublasLtMatmulDescCreate",
    )
    set_desc = lib.dll.cublasLtMatmulDescSetAttribute
    _set(lib, set_desc, desc, DESC_SCALE_TYPE, ctypes.c_int32(CUDA_R_32F), "scale type")
    _set(lib, set_desc, desc, DESC_POINTER_MODE,
         ctypes.c_int32(CUBLASLT_POINTER_MODE_DEVICE), "pointer mode")  # fmt: skip
    _set(lib, set_desc, desc, DESC_TRANSA, ctypes.c_int32(CUBLAS_OP_T), "transa")
    _set(lib, set_desc, desc, DESC_TRANSB, ctypes.c_int32(CUBLAS_OP_N), "transb")
    epilogue = EPILOGUE_DEFAULT if problem.bias_dtype is None else EPILOGUE_BIAS
    _set(lib, set_desc, desc, DESC_EPILOGUE, ctypes.c_int32(epilogue), "epilogue")
    if problem.bias_dtype is not None:
        bias_type = ctypes.c_int32(_DTYPES[problem.bias_dtype])
        _set(lib, set_desc, desc, DESC_BIAS_DATA_TYPE, bias_type, "bias data type")
    layouts: dict[str, ctypes.c_void_p] = {}
    for name, (dtype, rows, cols, ld) in problem.layouts().items():
        layout = ctypes.c_void_p()
        lib.check(
            lib.dll.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld),
            "cublasLtMatrixLayoutCreate",
        )
        layouts[name] = layout
    pref = ctypes.c_void_p()
    lib.check(lib.dll.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
    _set(lib, lib.dll.cublasLtMatmulPreferenceSetAttribute, pref, PREF_MAX_WORKSPACE_BYTES,
         ctypes.c_uint64(WORKSPACE_BYTES), "max workspace")  # fmt: skip
    result = (ctypes.c_uint8 * HEURISTIC_RESULT_BYTES)()
    count = ctypes.c_int(0)
    status = lib.dll.cublasLtMatmulAlgoGetHeuristic(
        _handle(lib, device), desc, layouts["A"], layouts["B"], layouts["D"], layouts["D"],
        pref, 1, result, ctypes.byref(count),
    )  # fmt: skip
    if status != 0 or count.value < 1:
        return None
    algo = (ctypes.c_uint8 * ALGO_BYTES).from_buffer_copy(bytes(result[:ALGO_BYTES]))
    return _Plan(desc, layouts, algo)


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
    lib = _lib[0]
    if out is None or out.data_ptr() % PTR_ALIGN_BYTES:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    stream = _current_stream(device)
    ws = _workspace(device, stream)
    beta = accumulate if accumulate is not None else out  # C: read only with beta = 1
    beta_value = constant(device, 1.0 if accumulate is not None else 0.0)
    with _lock:
        if bias is not None:
            ptr = ctypes.c_void_p(bias.data_ptr())
            _set(lib, lib.dll.cublasLtMatmulDescSetAttribute, plan.desc, DESC_BIAS_POINTER,
                 ptr, "bias pointer")  # fmt: skip
        status = lib.dll.cublasLtMatmul(
            _handle(lib, device), plan.desc, alpha.data_ptr(),
            b.data_ptr(), plan.layouts["A"], a.data_ptr(), plan.layouts["B"],
            beta_value.data_ptr(), beta.data_ptr(), plan.layouts["D"],
            out.data_ptr(), plan.layouts["D"], plan.algo,
            ws.data_ptr(), WORKSPACE_BYTES, stream,
        )  # fmt: skip
    lib.check(status, "cublasLtMatmul")
    return out


def _plan_for(problem: Problem, device: int) -> _Plan | str:
    """The plan of ``problem`` on ``device``, or why cuBLASLt does not serve it."""
    reason = problem.reason()
    if reason is not None:
        return reason
    lib = _library()
    if lib is None:
        return unavailable() or "cuBLASLt is unavailable"
    with _lock:
        plan = _plan(lib, problem, device)
    return plan if plan is not None else f"no cuBLASLt algorithm for {problem}"


def _current_stream(device: int) -> int:
    """The current CUDA stream's handle: torch's raw accessor where it has one (a few hundred
    nanoseconds, against microseconds for the Stream object)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device)
    return torch.cuda.current_stream(device).cuda_stream


__all__ = ["Problem", "constant", "matmul", "unavailable"]
