"""The grouped experts' epilogue without a bias: out = round(fp32(c[rows]) * alpha[:, None]).

``scale_rows`` finishes a grouped product (``fp4gen.runtime.grouped``): ``c`` is what the
grouped GEMM wrote (bf16 from ``torch._grouped_mm`` on CUDA, fp32 elsewhere), ``alpha`` each
output row's S_dec(A) S_dec(B) and ``rows`` (optional) the rows of ``c`` to take, in order
(the dgrad's real rows among its padded ones). On sm_90a and sm_100a a bf16 product runs the
one-pass kernel of ``fp4gen.kernels.grouped_scale`` (compiled once per process, JIT); every
other case, and a kernel that does not compile here (logged once), runs torch ops with the
same arithmetic: bf16 is exact in fp32, one fp32 multiply, one rounding to the output dtype.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from fp4gen.errors import TensorError
from fp4gen.kernels.host import describe
from fp4gen.runtime.loader import LogOnce, compiled_once

log = logging.getLogger(__name__)
_log_once = LogOnce(log)

_OUT_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_ARCHS = ("sm_90a", "sm_100a")
_compiled: dict[Any, Any] = {}
_lock = threading.Lock()
_enabled = [True]


def set_scale_kernel(enabled: bool) -> bool:
    """Whether bf16 products on CUDA run the one-pass kernel (True, the default) or torch's
    ops (the path the tests compare it with); returns the previous setting."""
    previous = _enabled[0]
    _enabled[0] = bool(enabled)
    return previous


def scale_rows(
    c: torch.Tensor,
    alpha: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """[R, N] in ``out_dtype`` = round(fp32(c[rows]) * alpha[:, None]) (``rows`` None: every
    row of ``c``). ``c`` [Rc, N] bf16 or fp32, ``alpha`` fp32 [R], ``rows`` int32 or int64 [R]
    on ``c``'s device. An fp32 ``c`` may be overwritten (the caller's own product)."""
    if c.dim() != 2 or alpha.dim() != 1 or alpha.dtype != torch.float32:
        raise TensorError(
            f"scale_rows takes a 2-D product and fp32 [rows] alphas; got c {describe(c)}, "
            f"alpha {describe(alpha)}"
        )
    n_rows = c.shape[0] if rows is None else rows.shape[0]
    if alpha.shape[0] != n_rows:
        raise TensorError(f"{n_rows} output rows need as many alphas; got {describe(alpha)}")
    fns = _kernel(c, alpha, out_dtype, rows)
    if fns is None:
        return _torch_scale_rows(c, alpha, out_dtype, rows)
    out = torch.empty((n_rows, c.shape[1]), dtype=out_dtype, device=c.device)
    if n_rows and c.shape[1]:
        if rows is None:  # never read without a gather: a stand-in
            src = torch.empty(1, dtype=torch.int32, device=c.device)
        else:
            src = rows if rows.dtype == torch.int32 else rows.to(torch.int32)
        fns(c, src, alpha.contiguous(), out)
    return out


def _torch_scale_rows(
    c: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype, rows: torch.Tensor | None
) -> torch.Tensor:
    """The same arithmetic by torch ops (the multiply promotes a 16-bit ``c`` to fp32)."""
    taken = c if rows is None else c[rows]
    if taken.dtype == out_dtype == torch.float32:  # in place: the caller's product, or a copy
        return torch.mul(taken, alpha[:, None], out=taken)
    out = torch.empty(taken.shape, dtype=out_dtype, device=c.device)
    return torch.mul(taken, alpha[:, None], out=out)


def _kernel(
    c: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype, rows: torch.Tensor | None
) -> Any | None:
    """The compiled kernel for this call, or None where torch's ops run it (not a bf16 product
    on a CUDA GPU the kernel is compiled for, a layout it does not take, or turned off)."""
    if not _enabled[0] or c.device.type != "cuda" or c.dtype != torch.bfloat16:
        return None
    out = _OUT_KEYS.get(out_dtype)
    n_rows = c.shape[0] if rows is None else rows.shape[0]
    if (
        out is None
        or c.shape[1] % 8
        or not c.is_contiguous()
        or c.data_ptr() % 16
        or alpha.device != c.device
        or (rows is not None and rows.device != c.device)
        or max(c.shape[0], n_rows) * c.shape[1] >= 2**31
    ):
        return None
    from fp4gen.compiler.jit import detect_arch

    arch = detect_arch(c.device)
    if arch not in _ARCHS:
        return None
    from fp4gen.kernels.grouped_scale import ScaleRowsParams

    params = ScaleRowsParams(out=out, gather=rows is not None)
    found = compiled_once(
        _compiled,
        _lock,
        (params, arch),
        lambda: None,
        lambda: compile_scale_rows(params, arch),
        "the grouped epilogue kernel",
    )
    if isinstance(found, str):
        _log_once(f"{found}; the grouped products are scaled by torch ops")
        return None
    return found


def compile_scale_rows(params: Any, arch: str, *, dump_dir: str | None = None) -> Any:
    """The TVM-FFI callable of the epilogue kernel of ``params`` (``ScaleRowsParams``) for
    ``arch`` ("sm_90a" or "sm_100a"); needs no GPU. With ``dump_dir`` the PTX is kept there."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from fp4gen.kernels.grouped_scale import OUT_TYPES, UNIT, ScaleRowsKernel
    from fp4gen.kernels.host import compile_options

    options = compile_options(
        "grouped_scale", ("scale_rows",), _ARCHS, "scale_rows", arch, dump_dir
    )
    fake = cute.runtime.make_fake_compact_tensor
    n = cute.sym_int(divisibility=UNIT)
    c = fake(BFloat16, (cute.sym_int(), n), stride_order=(1, 0), assumed_align=16)
    rows = cute.sym_int()
    src = fake(Int32, (cute.sym_int(),), assumed_align=4)
    alpha = fake(Float32, (rows,), assumed_align=4)
    out = fake(OUT_TYPES[params.out], (rows, n), stride_order=(1, 0), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(ScaleRowsKernel(params), c, src, alpha, out, stream, options=options)


__all__ = ["compile_scale_rows", "scale_rows", "set_scale_kernel"]
