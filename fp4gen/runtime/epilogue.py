"""The epilogue every GEMM backend of ``fp4gen.gemm`` shares: what is left after the product.

A backend computes a ``GemmProduct``: the tensor it wrote and which epilogue steps it applied
itself (a kernel or cuBLASLt may fuse them). ``finish`` applies every step the product does not
claim, in the order of the contract (docs/numerics.md 6):

    y = fp32(acc * S_dec(A) S_dec(B))  (+ bias, in fp32)  (+ accumulate, in fp32)

then one rounding to the output dtype. A step is applied unless the backend says it applied it,
so a backend that ignores the bias leaves it to ``finish`` instead of dropping it; claiming a
step is the only way to skip it here. A product already rounded to a 16-bit dtype while a step
is still to apply is refused (adding in fp32 after a rounding would round twice).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fp4gen.errors import FP4GenError

# what fp4gen.gemm writes: the fp32 sum rounded once to one of these
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GemmProduct(NamedTuple):
    """What a GEMM backend computed for C [M, N], and which epilogue steps are in it.

    ``c``: the backend's own tensor (``finish`` may overwrite it), fp32 unless every step the
    call asks for is in it, then fp32 or the output dtype. ``scaled``: multiplied by the two
    global decode scales; ``bias`` / ``accumulated``: the call's bias / accumulate added (what
    a call without them claims does not matter)."""

    c: torch.Tensor
    scaled: bool
    bias: bool = False
    accumulated: bool = False


def finish(
    product: GemmProduct,
    a: Any,
    b: Any,
    *,
    bias: torch.Tensor | None,
    accumulate: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """The result of ``fp4gen.gemm``: ``product`` with the steps it does not claim applied (the
    global scales of QuantizedTensors ``a`` and ``b``, ``bias`` [N], ``accumulate`` [M, N]) and
    rounded once to ``out_dtype``. One elementwise pass without ``accumulate``. The shapes of
    ``bias`` and ``accumulate`` are the caller's to check; ``backend`` names the backend in the
    error a product that breaks its contract raises."""
    if not isinstance(product, GemmProduct):
        raise FP4GenError(_broken(backend, "a GemmProduct", _shown(product)))
    c = product.c
    if tuple(c.shape) != (a.rows, b.rows):
        raise FP4GenError(_broken(backend, f"an [{a.rows}, {b.rows}] product", _shown(c)))
    alpha = None if product.scaled else _alpha(a, b, c.device)
    bias = None if product.bias else bias
    accumulate = None if product.accumulated else accumulate
    if alpha is None and bias is None and accumulate is None:
        if c.dtype not in (torch.float32, out_dtype):
            raise FP4GenError(_broken(backend, f"an fp32 or {out_dtype} product", _shown(c)))
        if c.dtype != out_dtype:
            return c.to(out_dtype, memory_format=torch.contiguous_format)
        return c if c.is_contiguous() else c.contiguous()
    if c.dtype != torch.float32:
        steps = (("global scales", alpha), ("bias", bias), ("accumulate", accumulate))
        left = ", ".join(name for name, t in steps if t is not None)
        raise FP4GenError(_broken(backend, f"an fp32 product ({left} still to apply)", _shown(c)))
    if not c.is_contiguous():  # a cropped view (padded operands): the result is contiguous
        c = c.contiguous()
    return apply_steps(c, alpha, bias, accumulate, out_dtype)


def apply_steps(
    c: torch.Tensor,
    alpha: torch.Tensor | None,
    bias: torch.Tensor | None,
    accumulate: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """y = fp32(c * alpha) (+ bias) (+ accumulate), converted to ``out_dtype``: the epilogue's
    arithmetic (None: a step not to apply). ``c`` (fp32, contiguous, owned by the caller) may
    be overwritten. One elementwise pass without ``accumulate``. The shapes of ``bias`` [N] and
    ``accumulate`` [M, N] are the caller's to check."""
    m, n = c.shape
    if bias is not None:  # no autograd in a GEMM: the caller defines the gradients
        bias = bias.detach().to(device=c.device, dtype=torch.float32)
    if accumulate is not None:
        if alpha is not None:
            c.mul_(alpha)
        if bias is not None:
            c.add_(bias)
        c.add_(accumulate.detach().to(device=c.device, dtype=torch.float32))
        return c if out_dtype == torch.float32 else c.to(out_dtype)
    out = c if out_dtype == torch.float32 else torch.empty((m, n), dtype=out_dtype, device=c.device)
    if alpha is None:
        if bias is None:
            return out.copy_(c) if out is not c else c
        return torch.add(c, bias, out=out)
    if bias is None:
        return torch.mul(c, alpha, out=out)
    return torch.addcmul(bias, c, alpha, out=out)


def _alpha(a: Any, b: Any, device: torch.device) -> torch.Tensor:
    """S_dec(A) * S_dec(B) as one fp32 element on ``device``; with per-row global scales
    (docs/numerics.md 11.4) [M, 1] (A's) times [1, N] (B's), one fp32 product per element."""
    ga = a.global_scale.to(device=device, dtype=torch.float32)
    gb = b.global_scale.to(device=device, dtype=torch.float32)
    if gb.dim() == 2:  # per row of B: per column of C
        gb = gb.reshape(1, -1)
    return ga * gb


def _broken(backend: str, wanted: str, got: str) -> str:
    """The message of a product that breaks the contract (a bug in that backend)."""
    return f"internal error: the {backend} GEMM backend must return {wanted}, got {got}"


def _shown(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    return type(x).__name__


__all__ = ["OUT_DTYPES", "GemmProduct", "apply_steps", "finish"]
