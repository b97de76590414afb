"""``fp4gen.gemm``: C = A @ B^T for two quantized operands, on the best path the machine has.

Paths (``backend=``):
  reference  exact products summed in float64, one rounding to fp32 (fp4gen.numerics).
  dequant    block values decoded to bf16 when element x scale is exact in bf16 (fp32 otherwise),
             a cuBLAS/CPU GEMM with fp32 accumulation, the two global scales as the epilogue
             alpha. Matches the reference up to fp32 summation order. On CUDA (sm_90a, sm_100a)
             the decode is the generated dequantize kernel (``fp4gen.runtime.dequant``: one
             memory-bound pass per operand, B's values remembered per tensor) and the epilogue
             one elementwise pass; elsewhere, or for formats it does not serve, torch ops.
  cute       the generated fused dequantizing GEMM (``fp4gen.runtime.cute_gemm``, Hopper
             sm_90a): the kernel decodes the 4-bit codes to bf16 in its mainloop (mma.sync
             split-K for M <= 64, wgmma above); fp32 accumulation, the same numerics as
             dequant. NVFP4 (A 1x16, B 1x16 or 16x16 blocks) and MXFP4 (1x32 blocks) pairs;
             FP8 pairs (e4m3 / e5m2 either side, fp32 or ue8m0 scales, A 1xN, B 1xN or NxN
             for N = 32, 64 or a multiple of 128) take the generated block-scaled FP8 kernel
             (``fp8_gemm.cute_block_scaled_product``): block_scaled's semantics on the FP8
             tensor cores. FP4GenError with the reason for anything else.
  block_scaled
             block-scaled accumulation (numerics.md 6.1): the element products exact, each
             K-block's partial sum in fp32, scaled by s_a s_b and accumulated in fp32. On CUDA
             ``torch.nn.functional.scaled_mm`` (cuBLASLt, sm_90a; ``fp4gen.runtime.fp8_gemm``):
             e4m3/e5m2 elements, fp32 scales, A 1x128 and B 1x128 or 128x128 blocks, the pairs of
             the fp8_blockwise recipe; FP4GenError with the reason for anything else. On CPU the
             float64 oracle ``gemm_block_scaled_reference``.
  blackwell  the block-scaled tcgen05 MMA of sm_100a (``fp4gen.runtime.blackwell_gemm``,
             docs/gemm-sm100.md): the tensor cores read the codes and the 128x4 scale factors,
             accumulate in fp32, the epilogue applies the global scales; e2m1, e2m3, e3m2,
             e4m3 and e5m2 elements with e4m3 (16-value blocks, e2m1 only) or ue8m0 scales.
  auto       CPU tensors: reference. CUDA tensors: on sm_100a blackwell when the pair and the
             shape have a native MMA, else dequant. On sm_90a: cute for M <= FUSED_MAX_M when
             the pair has a fused kernel (the small-M kernel streams the 4-bit B once), dequant
             above (the fused kernel re-decodes each B tile once per M-tile; dequant decodes
             once and runs cuBLAS at BF16 speed): measured crossover in docs/gemm-sm90.md.
             Pairs the block_scaled backend serves take it on sm_90a (the FP8 tensor cores);
             ``set_fp8_semantics("exact")`` / ``with fp8_semantics("exact")`` keeps them on the
             exact dequantized product instead (what every other arch runs for them).
             Each reason for not taking the native or fused kernel is logged once (INFO,
             logger fp4gen.gemm_dispatch).
Every path takes the same arguments. reference, dequant, cute and blackwell compute the exact
product of the dequantized operands up to fp32 summation order (numerics.md 6); block_scaled
computes block-scaled accumulation, within the bound of numerics.md 6.1 of that product.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from fp4gen.codegen.gemm_configs import (
    FUSED_ARCHS,
    FUSED_MAX_M,
    NATIVE_ARCHS,
    mma_plan,
    shape_reason,
)
from fp4gen.compiler.plan import ROW_SCALED_REASON
from fp4gen.errors import ArgumentError, FP4GenError, TensorError
from fp4gen.formats import BlockFormat, decoded_max, overflow_k
from fp4gen.numerics import QuantizedTensor, gemm_block_scaled_reference, gemm_reference
from fp4gen.runtime.checks import check_accumulate, check_bias, check_out, check_pair
from fp4gen.runtime.device_memory import pooled
from fp4gen.runtime.epilogue import OUT_DTYPES, GemmProduct, finish
from fp4gen.runtime.fp32_matmul import ieee_fp32_matmul

BACKENDS = ("auto", "reference", "dequant", "cute", "blackwell", "block_scaled")
# what backend="auto" computes for the pairs the block_scaled backend serves (numerics.md 6.1)
FP8_SEMANTICS = ("block_scaled", "exact")
_fp8_semantics = "block_scaled"
# auto_backend's CUDA choices: (formats, M, N, K, device index, semantics) -> GemmChoice
_choices: dict[tuple, GemmChoice] = {}
_MAX_CHOICES = 4096  # shapes that keep changing: cleared, not grown without end
log = logging.getLogger(__name__)
_logged: set[str] = set()
_fused_ids: dict[tuple[int, int], tuple[object, object, str | None]] = {}
# B -> the call auto made with it last, prepared (cute_gemm.PreparedGemm at small M,
# dequant.PreparedDequantGemm above the fused range): the next auto call like it (same A format
# and shape, B unchanged) launches with no dispatch, checks or plan lookups
_prepared: weakref.WeakKeyDictionary[QuantizedTensor, Any] = weakref.WeakKeyDictionary()
# FP8 pairs: (A's and B's format ids, M, N, K, output dtype, device, bias dtype or None) -> the
# call auto made last for such operands, prepared (fp8_gemm.PreparedBlockScaled for scaled_mm,
# PreparedCuteFp8 for the generated kernel): the next auto call like it, with any B of that
# format and shape (a weight quantized anew per call included), launches with no dispatch; the
# entry checks the format objects themselves, so a reused id is no match
_prepared_fp8: dict[tuple, Any] = {}
# Whether auto keeps prepared FP8 calls (set_fp8_prepared). On by default: their GPU test
# (tests/test_fp8_gemm_prepared_gpu.py: the full path's bits on scaled_mm and the generated
# kernel) passed on an H200; the CPU tests prove them the full path's arguments, bit for bit
_fp8_prepared_on = [True]


def set_fp8_prepared(enabled: bool) -> bool:
    """Whether ``backend="auto"`` keeps prepared FP8 calls (True) so that the next call like it
    skips the dispatch (docs/gemm-sm90.md, "Host time of the FP8 GEMM"), or runs the full path
    on every call (False). On by default (their GPU test passed on an H200). Process-wide; the kept
    calls are dropped; returns the previous setting."""
    previous, _fp8_prepared_on[0] = _fp8_prepared_on[0], bool(enabled)
    _prepared_fp8.clear()
    return previous


class GemmChoice(NamedTuple):
    """What ``backend="auto"`` runs, why, and whether that is a fallback from the fused kernel
    (a fallback is logged once per reason)."""

    backend: str
    why: str
    fallback: bool = False


class _GemmCall(NamedTuple):
    """The arguments of one ``gemm`` call, as each kernel path below takes them."""

    a: QuantizedTensor
    b: QuantizedTensor
    out_dtype: torch.dtype
    bias: torch.Tensor | None
    accumulate: torch.Tensor | None
    out: torch.Tensor | None = None  # where the result is written (checked by ``gemm``)
    auto: bool = False  # backend="auto" chose the path (a fused or dequantize call then
    # prepares the next)


def gemm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    accumulate: torch.Tensor | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """C = S_a S_b (A_q @ B_q^T) (+ bias) for a: [M, K] and b: [N, K], both quantized along K.

    ``out_dtype``: float32, bfloat16 or float16 (the fp32 result rounded once). ``bias``: a
    floating-point [N] tensor. ``accumulate`` (a floating-point [M, N] tensor, read in fp32) is
    added to the result, as a wgrad GEMM accumulates across micro-batches; the sum is returned
    (the tensor given is not modified). ``out``: a contiguous [M, N] tensor of ``out_dtype`` on
    a's device that receives the result and is returned (the fused and dequant kernels write it
    directly; other paths copy into it). Every backend's product goes through one epilogue
    (``fp4gen.runtime.epilogue.finish``), which applies the scales, bias and accumulate the
    backend did not apply itself. A bad argument raises ArgumentError, a bad tensor TensorError.
    """
    if backend == "auto" and out is None and accumulate is None and isinstance(b, QuantizedTensor):
        if bias is None:
            prepared = _prepared.get(b)  # a call like the last one with this B (a weight)
            if prepared is not None:
                c = prepared(a, b, out_dtype)  # checks A and out_dtype
                if c is not None:
                    return c
        if _prepared_fp8 and isinstance(a, QuantizedTensor):
            bias_dtype = getattr(bias, "dtype", None)
            prepared = _prepared_fp8.get(_fp8_key(a, b, out_dtype, bias_dtype))  # FP8: any B
            if prepared is not None:
                c = prepared(a, b, out_dtype, bias)  # checks A, B and the bias
                if c is not None:
                    return c
    _check_arguments(a, b, out_dtype, bias, accumulate, out)
    if backend not in BACKENDS:
        raise FP4GenError(f"unknown GEMM backend {backend!r}; choose one of {BACKENDS}")
    if out is not None:
        check_out(out, a.rows, b.rows, out_dtype, a.device)
    call = _GemmCall(a, b, out_dtype, bias, accumulate, out, backend == "auto")
    return _into(_gemm(call, backend), out)


def _fp8_key(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, bias_dtype: Any = None
) -> tuple:
    return (id(a.format), id(b.format), a.rows, b.rows, a.cols, out_dtype, a.device, bias_dtype)


def _keep_fp8(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    prepared: Any,
) -> None:
    """Keep ``prepared`` for the auto calls like this FP8 one (``_prepared_fp8``): CUDA
    operands only (a CPU call reaches a kernel path only where a test stands CUDA in), only
    while set_fp8_prepared is on, and not inside a CUDA graph's pool (a capture, or
    torch.compile's CUDA graph warm-up: a prepared call holds tensors made there, which must
    not outlive the graph)."""
    if a.device.type != "cuda" or not _fp8_prepared_on[0] or pooled(a.device):
        return
    if len(_prepared_fp8) >= 256:  # shapes that keep changing: cleared, not grown without end
        _prepared_fp8.clear()
    _prepared_fp8[_fp8_key(a, b, out_dtype, None if bias is None else bias.dtype)] = prepared


def _check_arguments(
    a: object, b: object, out_dtype: object, bias: object, accumulate: object, out: object
) -> None:
    """ArgumentError for an argument of the wrong kind, TensorError for a bias or accumulate
    of the wrong shape: before any work, whatever the backend (``out``'s shape, dtype and
    device are ``check_out``'s)."""
    for name, operand in (("a", a), ("b", b)):
        if not isinstance(operand, QuantizedTensor):
            raise ArgumentError(
                f"gemm: {name} must be a QuantizedTensor (quantize the tensor first: "
                f"fp4gen.quantize), got {_kind(operand)}"
            )
    assert isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor)
    if out_dtype not in OUT_DTYPES:
        raise ArgumentError(
            f"gemm: out_dtype must be torch.float32, torch.bfloat16 or torch.float16 (the fp32 "
            f"result rounded once), got {out_dtype!r}"
        )
    for name, t, shape in (("bias", bias, (b.rows,)), ("accumulate", accumulate, (a.rows, b.rows))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ArgumentError(
                f"gemm: {name} must be None or a floating-point tensor of shape "
                f"{list(shape)}, got {_kind(t)}"
            )
    if out is not None and not isinstance(out, torch.Tensor):
        raise ArgumentError(f"gemm: out must be None or a tensor, got {_kind(out)}")
    check_bias(bias, b.rows)  # type: ignore[arg-type]
    check_accumulate(accumulate, a.rows, b.rows)  # type: ignore[arg-type]


def _kind(x: object) -> str:
    """What was passed, in a few words (a tensor by dtype and shape, not its values)."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    if isinstance(x, bool | int | float | str):
        return f"{type(x).__name__} {x!r}"
    return type(x).__name__


KERNEL_BACKENDS = ("cute", "blackwell", "block_scaled")


def _kernel_path(backend: str) -> Callable[[_GemmCall], GemmProduct]:
    """The product function of a kernel backend, looked up at each call (tests replace them)."""
    return {"cute": _fused, "blackwell": _native, "block_scaled": _block_scaled}[backend]


def _gemm(call: _GemmCall, backend: str) -> torch.Tensor:
    """``gemm`` on ``backend`` (``call.out``: where a kernel may write the result): the
    backend's product, then the shared epilogue, which applies every step (global scales,
    bias, accumulate, the rounding to out_dtype) the backend does not say it applied."""
    backend, product = _product(call, backend)
    a, b, out_dtype, bias, accumulate, _, _ = call
    return finish(
        product, a, b, bias=bias, accumulate=accumulate, out_dtype=out_dtype, backend=backend
    )


def _product(call: _GemmCall, backend: str) -> tuple[str, GemmProduct]:
    """(the backend that ran, its product) for ``backend`` ("auto" resolved here)."""
    a, b = call.a, call.b
    if backend == "auto":
        if not call.auto:  # the fused, FP8 and dequant paths then prepare the next
            call = call._replace(auto=True)
        choice = auto_backend(a, b)
        backend = choice.backend
        if choice.fallback and backend == "reference":
            _log_once(choice.why, "gemm(backend='auto') uses the float64 reference: %s")
        elif choice.fallback:
            _log_once(choice.why)
        if backend in KERNEL_BACKENDS:
            try:
                return backend, _kernel_path(backend)(call)
            except TensorError:
                raise
            except FP4GenError as err:  # the kernel cannot be built or loaded here
                _log_once(str(err))
                backend = "dequant"
    elif backend == "block_scaled" and a.device.type != "cuda":
        return backend, GemmProduct(gemm_block_scaled_reference(a, b), scaled=True)
    elif backend in KERNEL_BACKENDS:
        if _row_scaled(a.format) or _row_scaled(b.format):
            raise FP4GenError(f"gemm(backend={backend!r}) cannot run: {ROW_SCALED_REASON}")
        return backend, _kernel_path(backend)(call)
    if backend == "dequant":
        fast = _fast_dequant(call)
        if fast is not None:
            return backend, fast
        return backend, _dequant_gemm(a, b)
    return backend, GemmProduct(gemm_reference(a, b), scaled=True)


def _into(c: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``c`` written into ``out`` (returned), unless a kernel wrote it there already."""
    if out is None or c is out:
        return c
    out.copy_(c)
    return out


def fused_support(a: BlockFormat | object, b: BlockFormat | object) -> str | None:
    """None when the fused GEMM template generates a kernel for this operand pair, else why not."""
    hit = _fused_ids.get((id(a), id(b)))  # by identity: hashing two formats costs microseconds
    if hit is not None and hit[0] is a and hit[1] is b:
        return hit[2]
    if not (isinstance(a, BlockFormat) and isinstance(b, BlockFormat)):
        reason: str | None = "an operand is kept in high precision"
    else:
        from fp4gen.codegen.gemm import fused_support as support  # Jinja: loaded on first ask

        reason = support(a, b)
    if len(_fused_ids) >= 256:
        _fused_ids.clear()
    _fused_ids[(id(a), id(b))] = (a, b, reason)  # the references keep the ids valid
    return reason


def set_fp8_semantics(semantics: str) -> str:
    """What ``backend="auto"`` computes for the operand pairs the block_scaled backend serves
    (FP8 elements, fp32 1x128 / 128x128 block scales): "block_scaled" (the default: scaled_mm
    on sm_90a, numerics.md 6.1) or "exact" (the dequantized product, fp32 GEMM). Process-wide,
    read at every call (fp4gen.nn.Linear included); returns the previous setting."""
    global _fp8_semantics
    if semantics not in FP8_SEMANTICS:
        raise FP4GenError(
            f"unknown FP8 GEMM semantics {semantics!r}; choose one of {FP8_SEMANTICS}"
        )
    previous, _fp8_semantics = _fp8_semantics, semantics
    if semantics != previous:  # a prepared FP8 call computes the previous semantics
        _prepared_fp8.clear()
    return previous


def fp8_semantics_setting() -> str:
    """The current ``set_fp8_semantics`` setting."""
    return _fp8_semantics


@contextmanager
def fp8_semantics(semantics: str) -> Iterator[None]:
    """``with fp8_semantics("exact"):`` runs the block with that setting (restored after)."""
    previous = set_fp8_semantics(semantics)
    try:
        yield
    finally:
        set_fp8_semantics(previous)


def fp8_support(a: BlockFormat | object, b: BlockFormat | object) -> str | None:
    """None when the block_scaled backend (scaled_mm) serves this operand pair, else why not."""
    from fp4gen.runtime.fp8_gemm import support

    return support(a, b)


def _fp32_scaled(fmt: BlockFormat | object) -> bool:
    return isinstance(fmt, BlockFormat) and fmt.scale.element is None


def _generated_fp8(
    a: BlockFormat | object, b: BlockFormat | object, m: int, n: int, arch: str | None
) -> bool:
    """Whether the generated block-scaled FP8 kernel serves this pair and shape on ``arch``."""
    return m * n < 2**31 and _generated_fp8_pair(a, b, arch)


def _generated_fp8_pair(a: BlockFormat | object, b: BlockFormat | object, arch: str | None) -> bool:
    """Whether the generated block-scaled FP8 kernel serves this pair on ``arch``."""
    from fp4gen.runtime.fp8_gemm import CUTE_ARCHS, cute_support

    return arch in CUTE_ARCHS and cute_support(a, b) is None


def choose_backend(
    a: BlockFormat | object,
    b: BlockFormat | object,
    m: int,
    n: int,
    k: int,
    *,
    device: str,
    arch: str | None,
    semantics: str = "block_scaled",
) -> GemmChoice:
    """What ``backend="auto"`` runs for A [m, k] and B [n, k] in these formats on ``device``
    ("cpu" or "cuda") with a GPU of ``arch`` (e.g. "sm_90a"), the FP8 pairs computing
    ``semantics`` (``set_fp8_semantics``). Pure logic: needs no GPU."""
    if device != "cuda":
        return GemmChoice("reference", "CPU tensors: the float64 reference")
    overflow = accumulator_overflow_reason(a, b, k)
    if overflow is not None:
        return GemmChoice("reference", overflow, fallback=True)
    if _row_scaled(a) or _row_scaled(b):
        return GemmChoice("dequant", ROW_SCALED_REASON, fallback=True)
    if arch == "sm_90a" and semantics != "exact":
        from fp4gen.runtime.fp8_gemm import cute_auto_reason

        why = cute_auto_reason(a, b, m)  # the measured table (fp8_gemm.CUTE_AUTO_MIN_M)
        if why is not None:
            return GemmChoice("cute", why)
    if arch not in NATIVE_ARCHS and _fp32_scaled(a) and _fp32_scaled(b):
        # FP8-style pairs with fp32 block scales: no fused kernel or bf16-exact decode serves
        # them, only scaled_mm's block-scaled accumulation or the exact fp32 GEMM
        from fp4gen.runtime.fp8_gemm import arch_reason, describe

        reason = fp8_support(a, b)
        if semantics == "exact":
            return GemmChoice("dequant", "exact products requested (set_fp8_semantics('exact'))")
        reason = reason or arch_reason(arch)
        if reason is not None and _generated_fp8(a, b, m, n, arch):
            # the same block-scaled semantics on the generated kernel (e5m2, 1x64 blocks, ...):
            # the exact fp32 GEMM would run these pairs about 20x slower
            from fp4gen.runtime.fp8_gemm import cute_pair_name

            name = cute_pair_name(a, b)  # type: ignore[arg-type]
            return GemmChoice(
                "cute", f"block-scaled FP8 GEMM: the generated kernel {name} (scaled_mm: {reason})"
            )
        if reason is not None:
            return GemmChoice("dequant", f"no block-scaled FP8 GEMM: {reason}", fallback=True)
        return GemmChoice(
            "block_scaled",
            f"block-scaled FP8 GEMM: scaled_mm {describe(a, b)} (cuBLAS, fp32 block scales)",  # type: ignore[arg-type]
        )
    if arch in NATIVE_ARCHS:
        plan = mma_plan(a, b)
        reason = plan if isinstance(plan, str) else shape_reason(plan, m, n, k)
        if reason is not None:
            return GemmChoice("dequant", f"no native MMA on {arch}: {reason}", fallback=True)
        return GemmChoice("blackwell", f"native block-scaled MMA: {plan.describe()}")
    reason = fused_support(a, b)
    if reason is not None:
        return GemmChoice("dequant", f"no fused GEMM kernel: {reason}", fallback=True)
    if arch not in FUSED_ARCHS:
        return GemmChoice(
            "dequant", f"no fused GEMM kernel for {arch} (wgmma: sm_90a only)", fallback=True
        )
    if m * n >= 2**31 or max(m, n) * ((k + 1) // 2) >= 2**31:
        return GemmChoice(
            "dequant",
            "the fused kernel indexes with 32 bits (M * N or max(M, N) * K/2 >= 2^31)",
            fallback=True,
        )
    if m > FUSED_MAX_M and dequant_support(a) is None and dequant_support(b) is None:
        return GemmChoice(
            "dequant",
            f"M = {m} > {FUSED_MAX_M}: dequantize kernels + cuBLAS (decodes each operand once; "
            "the fused kernel re-decodes B once per M-tile)",
        )
    return GemmChoice("cute", "fused kernel: reads the 4-bit operands, decodes in the mainloop")


def accumulator_overflow_reason(
    a: BlockFormat | object, b: BlockFormat | object, k: int
) -> str | None:
    """Why no fp32-accumulating GEMM may compute A [., k] x B [., k] in these formats, or None.
    Every kernel (fused, dequantize + cuBLAS, FP8, native MMA) sums the K products of element x
    block scale in fp32 and applies the global scales S_dec(A) S_dec(B) after (docs/numerics.md
    6). With a global amax on both sides each decoded value reaches elem_max x scale cap
    whatever the data, so where K times their product can pass fp32's largest value the
    accumulator overflows to inf while the scaled result (the float64 reference's) is finite:
    such pairs (exotic wide elements, e.g. e7m0) run on the float64 reference instead."""
    first = overflow_k(a, b)
    if first is None or k < first:
        return None
    pa, pb = decoded_max(a), decoded_max(b)
    assert isinstance(a, BlockFormat) and isinstance(b, BlockFormat)
    return (
        f"{a.name} x {b.name} at K = {k}: an fp32 accumulator of K products of decoded values "
        f"up to {pa:g} x {pb:g} (element x block scale, before the global scales) could "
        "overflow where the result does not; the float64 reference computes it"
    )


def _row_scaled(fmt: BlockFormat | object) -> bool:
    return isinstance(fmt, BlockFormat) and fmt.global_rows


def dequant_support(fmt: BlockFormat | object) -> str | None:
    """None when the generated dequantize kernel serves this operand format, else why not."""
    from fp4gen.runtime.dequant import support

    if _row_scaled(fmt):  # docs/numerics.md 11.4: the epilogue applies S_dec per row
        return ROW_SCALED_REASON

    return support(fmt)


def auto_backend(a: QuantizedTensor, b: QuantizedTensor) -> GemmChoice:
    """What ``gemm(a, b, backend="auto")`` runs. On CUDA the choice is kept per formats, shape,
    GPU and semantics (``choose_backend`` is pure): the per-call path is one lookup."""
    dev = a.device
    cuda = dev.type == "cuda"
    key = (a.format, b.format, a.rows, b.rows, a.cols, dev.index, _fp8_semantics)
    choice = _choices.get(key) if cuda else None
    if choice is None:
        from fp4gen.compiler.jit import detect_arch

        arch = detect_arch(dev) if cuda else None
        choice = choose_backend(
            a.format, b.format, a.rows, b.rows, a.cols,
            device=dev.type, arch=arch, semantics=_fp8_semantics,
        )  # fmt: skip
        if cuda:
            if len(_choices) >= _MAX_CHOICES:
                _choices.clear()
            _choices[key] = choice
    return choice


def _log_once(
    reason: str, message: str = "gemm(backend='auto') uses dequantize + cuBLAS: %s"
) -> None:
    """Log ``message % reason`` at INFO the first time that line comes (``_logged``)."""
    line = message % reason
    if line not in _logged:
        _logged.add(line)
        log.info(message, reason)


def _fast_dequant(call: _GemmCall) -> GemmProduct | None:
    """The dequant backend with the generated dequantize kernels on CUDA, or None where they do
    not serve (CPU tensors, formats not exact in bf16, an arch without the kernel, no CuTe DSL:
    logged once); the torch decode then runs. Where auto chose it (``call.auto``), a call with
    a B met before leaves a prepared call for it (``_prepared``)."""
    a, b, out_dtype, bias, accumulate, out, auto = call
    if a.device.type != "cuda" or b.device.type != "cuda":
        return None
    reason = dequant_support(a.format) or dequant_support(b.format)
    if reason is None:
        from fp4gen.compiler.jit import detect_arch
        from fp4gen.runtime.dequant import dequant_product

        try:
            return dequant_product(
                a,
                b,
                out_dtype=out_dtype,
                bias=bias,
                accumulate=accumulate,
                arch=detect_arch(a.device),
                out=out,
                keep=_prepared if auto else None,
            )
        except TensorError:
            raise
        except FP4GenError as err:
            reason = str(err)
    _log_once(str(reason), "the dequant backend decodes with torch ops: %s")
    return None


def _kernel_gemm(
    backend: str, run: Callable[..., GemmProduct], call: _GemmCall, **extra: Any
) -> GemmProduct:
    """``run`` (``fused_product`` or ``native_product``) on the arch of ``a``'s GPU, after the
    check both kernel backends make first (CUDA tensors)."""
    from fp4gen.compiler.jit import detect_arch

    a, b, out_dtype, bias, accumulate, out, _ = call
    if a.device.type != "cuda":
        raise FP4GenError(f"the {backend} GEMM backend runs on CUDA tensors, got {a.device}")
    arch = detect_arch(a.device)
    # the fused kernel writes into ``out``; the native one makes its own (``gemm`` copies it)
    if out is not None and backend == "cute":
        extra["out"] = out
    return run(a, b, out_dtype=out_dtype, bias=bias, accumulate=accumulate, arch=arch, **extra)


# _fused, _native and _block_scaled stay three names: tests replace each on its own. Each
# returns the backend's GemmProduct; ``_gemm`` finishes it (the shared epilogue).
def _fused(call: _GemmCall) -> GemmProduct:
    """The fused kernel; where ``backend="auto"`` chose it, a small-M call also leaves a
    prepared call for its B (``_prepared``), which serves the next auto calls like it. FP8
    pairs take the generated block-scaled FP8 kernel (``fp8_gemm.cute_block_scaled_product``)."""
    from fp4gen.runtime.cute_gemm import fused_product
    from fp4gen.runtime.fp8_gemm import cute_block_scaled_product, cute_support

    a, b = call.a, call.b
    if fused_support(a.format, b.format) is not None and cute_support(a.format, b.format) is None:
        return cute_block_scaled_product(
            a,
            b,
            out_dtype=call.out_dtype,
            bias=call.bias,
            accumulate=call.accumulate,
            keep=_keep_fp8 if call.auto else None,
            out=call.out,
        )

    return _kernel_gemm("cute", fused_product, call, keep=_prepared if call.auto else None)


def _native(call: _GemmCall) -> GemmProduct:
    from fp4gen.runtime.blackwell_gemm import native_product

    return _kernel_gemm("blackwell", native_product, call)


def _block_scaled(call: _GemmCall) -> GemmProduct:
    from fp4gen.runtime.fp8_gemm import block_scaled_product

    a, b, out_dtype, bias, accumulate, out, auto = call
    return block_scaled_product(
        a,
        b,
        out_dtype=out_dtype,
        bias=bias,
        accumulate=accumulate,
        keep=_keep_fp8 if auto else None,
        out=out,
    )


def significand_bits(fmt: BlockFormat) -> int:
    """Bits of precision of one block value decode(q) * s_b (numerics.md section 6)."""
    scale = fmt.scale.element
    scale_bits = 24 if scale is None else 1 if scale.exponent_only else scale.significand_bits
    return fmt.element.significand_bits + scale_bits


def gemm_path(a: BlockFormat | object, b: BlockFormat | object) -> tuple[str, str]:
    """(path, why) that ``gemm(..., backend="auto")`` takes on a GPU for these operand formats."""
    if not (isinstance(a, BlockFormat) and isinstance(b, BlockFormat)):
        return "high-precision GEMM", "an operand is kept in high precision (upcast, fp32 sum)"
    if _row_scaled(a) or _row_scaled(b):
        return "operands decoded by torch ops + cuBLAS (fp32 accumulation)", ROW_SCALED_REASON
    plan = mma_plan(a, b)
    if isinstance(plan, str):
        native, native_why = "", f"; no native MMA on sm_100a: {plan}"
    else:
        native = f"; the native {plan.describe()} on sm_100a"
        native_why = "; on sm_100a the tensor cores read the codes and scales directly"
    bits = max(significand_bits(a), significand_bits(b))
    if a.gemm_exact_in_bf16() and b.gemm_exact_in_bf16():
        path = "dequantize to bf16 + cuBLAS (fp32 accumulation)"
        why = f"element x block scale needs {bits} significant bits, exact in bf16 (8)"
        kernel = dequant_support(a) or dequant_support(b)
        if kernel is None:
            why += "; the generated dequantize kernel decodes each operand once (CUDA)"
        else:
            why += f"; decoded by torch ops: {kernel}"
        reason = fused_support(a, b)
        if reason is None:
            path += f"; the fused CuTe kernel on sm_90a for M <= {FUSED_MAX_M}"
            why += "; the fused kernel reads the 4-bit operands and decodes in the mainloop"
        else:
            why += f"; no fused kernel: {reason}"
        return path + native, why + _mx_note(a, b) + native_why
    exact = "dequantize to fp32 + fp32 GEMM (no TF32)"
    exact_why = f"element x block scale needs {bits} significant bits, more than bf16's 8"
    if fp8_support(a, b) is None:
        from fp4gen.runtime.fp8_gemm import describe

        return (
            f"block-scaled FP8 GEMM on sm_90a: torch scaled_mm {describe(a, b)} (cuBLAS); "
            f"elsewhere, or with set_fp8_semantics('exact'): {exact}" + native,
            "the FP8 products are exact and each 128-wide K-block is summed in fp32, then "
            "scaled by s_a s_b and accumulated in fp32 (block-scaled accumulation, "
            f"numerics.md 6.1); the exact dequantized product: {exact_why}" + native_why,
        )
    if _fp32_scaled(a) and _fp32_scaled(b) and _generated_fp8_pair(a, b, "sm_90a"):
        from fp4gen.runtime.fp8_gemm import cute_pair_name

        return (
            f"block-scaled FP8 GEMM on sm_90a: the generated kernel {cute_pair_name(a, b)} "
            f"(wgmma); elsewhere, or with set_fp8_semantics('exact'): {exact}" + native,
            "block-scaled accumulation as for scaled_mm's pairs (numerics.md 6.1), which "
            f"scaled_mm does not serve ({fp8_support(a, b)}); the exact dequantized product: "
            f"{exact_why}" + native_why,
        )
    return exact + native, exact_why + native_why


def _mx_note(a: BlockFormat, b: BlockFormat) -> str:
    """Why an MXFP8 pair stays on the exact bf16 path on Hopper."""
    from fp4gen.runtime.fp8_gemm import support

    fp8 = all(
        (f.element.exp_bits, f.element.man_bits) in ((4, 3), (5, 2)) and f.block == (1, 32)
        for f in (a, b)
    )
    if not fp8 or support(a, b) is None:
        return ""
    return (
        "; no block-scaled FP8 GEMM on sm_90a: torch's scaled_mm runs 1x32 ue8m0 (MX) scaling "
        "on sm_100+ only (cuBLAS VEC32_UE8M0), so the exact bf16 path it is (backend='cute': "
        "the generated FP8 kernel's block-scaled accumulation, numerics.md 6.1)"
    )


def _dequant_gemm(a: QuantizedTensor, b: QuantizedTensor) -> GemmProduct:
    """The dequant backend with torch ops: the block values' fp32 product, the global scales,
    bias and accumulate left to the epilogue."""
    check_pair(a, b)
    exact_bf16 = a.format.gemm_exact_in_bf16() and b.format.gemm_exact_in_bf16()
    va, vb = a.dequantize_blockwise(), b.dequantize_blockwise()
    # autocast would round fp32 block values to 16 bits: this GEMM keeps the types it is given
    with torch.autocast(a.device.type, enabled=False):
        if exact_bf16 and a.device.type == "cuda":
            # bf16 inputs hold the block values exactly; cuBLAS accumulates in fp32.
            c = torch.mm(va.to(torch.bfloat16), vb.to(torch.bfloat16).t(), out_dtype=torch.float32)
        else:
            with ieee_fp32_matmul():  # TF32 would round the inputs to 10 mantissa bits
                c = va @ vb.t()
    return GemmProduct(c, scaled=False)
