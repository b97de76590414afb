"""Block-scaled FP8 GEMM on Hopper through ``torch.nn.functional.scaled_mm`` (cuBLASLt).

The ``block_scaled`` backend of ``fp4gen.gemm`` (docs/numerics.md 6.1, docs/gemm-sm90.md): A
with 1x128 blocks and B with 1x128 or 128x128 blocks, e4m3 elements (torch refuses e5m2 here),
fp32 block scales. cuBLASLt multiplies the FP8 codes on the tensor cores, sums each 128-wide
K-block, multiplies the partial sums by the two fp32 block scales and accumulates in fp32
(``CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F`` / ``BLK128x128_32F``, cuBLAS >= 12.9, sm_90 only).

The contract of ``scaled_mm`` (torch's ``_scaled_mm_v2`` checks in
aten/src/ATen/native/cuda/ScaledBlas.cpp and its test test/test_scaled_matmul_cuda.py
``test_scaled_mm_block_wise_numerics``), for C [M, N] = mat_a [M, K] @ mat_b [K, N]:

* mat_a row-major (the codes of A as they are), mat_b column-major: B's codes [N, K] viewed
  through ``.t()`` (Hopper runs only this "TN" layout); K and N multiples of 16.
* Scales are decode factors (value = code * scale), fp32:
  - 1x128 on A: shape [M, ceil(K/128)], strides (1, M) (M-major: ``s.t().contiguous().t()``);
  - 1x128 on B: shape [N, ceil(K/128)], strides (1, N), the same construction;
  - 128x128 on B: shape [L4, ceil(N/128)], strides (1, L4), L4 = ceil(K/128) rounded up to a
    multiple of 4: the [ceil(N/128), L4] row-major tensor (fp4gen's [N/128, K/128] layout
    with its columns zero-padded to L4) viewed through ``.t()``. The scale of B's tile
    (n-block j, K-block b) is element [b, j] of the view.
* ``use_fast_accum`` must be False for block scaling; ``bias`` is refused with an fp32 output.
  A bias of the output's dtype (bf16 or fp16) goes into cuBLASLt's epilogue, which adds it to
  the fp32 sum and rounds once, as the reference does (fp32 C + fp32 bias, then one rounding;
  tests/test_fp8_gemm_gpu.py); any other bias, ``accumulate`` and the global scales are left
  to the shared epilogue of ``fp4gen.gemm`` (``fp4gen.runtime.epilogue.finish``: in fp32 after
  an fp32 GEMM), which applies what ``block_scaled_product`` does not say it applied.

fp4gen pads (with zero codes, which add exactly 0) where the contract or cuBLAS alignment needs
it, and crops the result: M to a multiple of ``ROW_ALIGN`` (so A's M-major scale columns are
16-byte aligned), N to a multiple of ``ROW_ALIGN`` (torch requires 16) and K to a multiple of 128
(every K-block full; the scales keep ceil(K/128) columns). The sizes fp4gen.nn.Linear produces
(tokens and features multiples of 128) need no copy.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from fp4gen.codegen.gemm_fp8 import (
    AUTO_MIN_M,
    CLUSTER_M,
    E4M3,
    E5M2,
    MN_MAJOR_ALIGN,
    MN_MAJOR_SCALES,
    OVERLAP,
    TILE_BY_SHAPE,
    TILE_N,
    WIDE_STORES,
    kernel_fields,
    kernel_out,
    pair_name,
    pair_reason,
    scaled_mm_name,
    scaled_mm_reason,
    tile_n_for,
)
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat
from fp4gen.numerics import QuantizedTensor
from fp4gen.numerics.gemm import require_quantized
from fp4gen.numerics.quantize import tensor_version
from fp4gen.runtime.checks import (
    PreparedA,
    check_accumulate,
    check_bias,
    check_pair,
    one_cuda_device,
)
from fp4gen.runtime.epilogue import GemmProduct, finish

ARCHS = ("sm_90a",)  # cuBLASLt's 1x128 / 128x128 fp32 block scaling: Hopper only
BLOCK = 128
ROW_ALIGN = 16  # M and N are padded to a multiple of this (see the module docstring)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TORCH_DTYPES = {E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}


def support(a: BlockFormat | object, b: BlockFormat | object) -> str | None:
    """None when ``scaled_mm``'s blockwise FP8 GEMM serves the operand pair (A [M, K], B [N, K],
    both quantized along K), else why not. Pure logic on the formats, remembered per pair of
    format objects (asked on every call: comparing formats costs microseconds)."""
    return _by_identity(_support_ids, a, b, _support)


def _by_identity(memo: dict, a: object, b: object, decide) -> str | None:
    """``decide(a, b)``, remembered in ``memo`` by the objects' identity (the entry holds them,
    so the ids stay valid)."""
    hit = memo.get((id(a), id(b)))
    if hit is not None and hit[0] is a and hit[1] is b:
        return hit[2]
    reason = decide(a, b)
    if len(memo) >= 256:
        memo.clear()
    memo[(id(a), id(b))] = (a, b, reason)
    return reason


_support_ids: dict[tuple[int, int], tuple[object, object, str | None]] = {}
_cute_support_ids: dict[tuple[int, int], tuple[object, object, str | None]] = {}


def _support(a: BlockFormat | object, b: BlockFormat | object) -> str | None:
    return scaled_mm_reason(a, b)  # pure logic, shared with fp4gen compile's plan


def arch_reason(arch: str | None) -> str | None:
    """None when ``arch`` runs the blockwise FP8 scaled_mm, else why not."""
    if arch in ARCHS:
        return None
    return (
        f"no block-scaled FP8 GEMM for {arch}: cuBLAS's 1x128 / 128x128 fp32 block scaling "
        "runs on sm_90a only"
    )


def torch_reason() -> str | None:
    """None when this torch build has the blockwise ``scaled_mm`` (torch >= 2.10 with CUDA
    >= 12.9), else why not. Found once per process (the build does not change)."""
    if not _torch_reason:
        _torch_reason.append(_find_torch_reason())
    return _torch_reason[0]


_torch_reason: list[str | None] = []


def _find_torch_reason() -> str | None:
    scaling = getattr(F, "ScalingType", None)
    if not hasattr(F, "scaled_mm") or not hasattr(scaling, "BlockWise128x128"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm with block scaling"
    cuda = torch.version.cuda
    if cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    major, minor = (int(v) for v in cuda.split(".")[:2])
    if (major, minor) < (12, 9):
        return f"torch is built with CUDA {cuda}; cuBLAS block scaling needs 12.9 or later"
    return None


def takes_result(out: torch.Tensor | None, dtype: torch.dtype, m: int, n: int) -> bool:
    """Whether a GEMM may write its [m, n] result of ``dtype`` straight into ``out``
    (``fp4gen.gemm``'s ``out``): contiguous, of that dtype and shape, 16-byte aligned (as the
    GEMMs' own results are: the generated kernel is compiled for 16-byte aligned tensors, and
    cuBLASLt's algorithms want it)."""
    return (
        out is not None
        and out.dtype == dtype
        and out.shape == (m, n)
        and out.is_contiguous()
        and out.data_ptr() % 16 == 0
    )


def scaled_mm_out_op() -> Any | None:
    """``aten::_scaled_mm_v2.out`` (the op behind ``F.scaled_mm``, writing into a given tensor)
    where this torch has it, else None. Found once per process."""
    if not _scaled_mm_out:
        op = getattr(torch.ops.aten, "_scaled_mm_v2", None)
        _scaled_mm_out.append(op.out if op is not None and "out" in op.overloads() else None)
    return _scaled_mm_out[0]


_scaled_mm_out: list[Any] = []


def scaled_mm_into(ops: Operands, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``F.scaled_mm`` of ``ops`` (+ the epilogue ``bias``) written into ``out`` (contiguous
    [M, N] of the output dtype, M and N unpadded): the arguments ``F.scaled_mm`` passes its op,
    with ``out=``. A caller that hands ``fp4gen.gemm`` an ``out`` (a layer graph's result
    tensors) then gets the product there, not a copy of it: one fewer pass over C per GEMM."""
    op = scaled_mm_out_op()
    assert op is not None
    return op(
        ops.mat_a,
        ops.mat_b,
        [ops.scale_a],
        [ops.recipe_a.value],
        [],
        [ops.scale_b],
        [ops.recipe_b.value],
        [],
        bias,
        out.dtype,
        [],
        False,
        out=out,
    )


def describe(a: BlockFormat, b: BlockFormat) -> str:
    """The scaled_mm recipe pair of a supported operand pair, e.g. "BlockWise1x128 x
    BlockWise128x128"."""
    return scaled_mm_name(a, b)


# ----------------------------------------------------------------------------------------------
# Layout conversion (pure tensor logic: runs on any device)
# ----------------------------------------------------------------------------------------------


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def outer_major_scales(
    scales: torch.Tensor, rows: int, times: torch.Tensor | None = None
) -> torch.Tensor:
    """1x128 scales [R, KB] (fp32, one row per tensor row) as scaled_mm reads them: shape
    [rows, KB] with strides (1, rows), rows >= R; padded rows get scale 0 (their codes are 0).
    ``times`` (an fp32 0-dim tensor) multiplies them in the same pass (``_folded``)."""
    r, kb = scales.shape
    if rows == r:  # written through the buffer's strides: no transposed views (aten ops)
        out = torch.empty_strided((r, kb), (1, r), dtype=torch.float32, device=scales.device)
        _write(out, scales, times)
        return out
    out = _buffer((kb, rows), padded=True, device=scales.device)
    _write(out[:, :r], scales.t(), times)
    return out.t()


def tile_scales(scales: torch.Tensor, times: torch.Tensor | None = None) -> torch.Tensor:
    """128x128 scales [NB, KB] (fp32, fp4gen's layout) as scaled_mm reads B's: shape [L4, NB]
    with strides (1, L4), L4 = KB rounded up to 4; the padded K-blocks get scale 0."""
    nb, kb = scales.shape
    l4 = round_up(kb, 4)
    padded = l4 != kb
    out = _buffer((nb, l4), padded=padded, device=scales.device)
    _write(out[:, :kb] if padded else out, scales, times)
    return out.t()


def _buffer(shape: tuple[int, int], *, padded: bool, device: torch.device) -> torch.Tensor:
    """An fp32 scale buffer; zeroed only where padding leaves part of it unwritten (one launch
    less per operand on the per-call path otherwise)."""
    if padded:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    return torch.empty(shape, dtype=torch.float32, device=device)


def _write(dst: torch.Tensor, src: torch.Tensor, times: torch.Tensor | None) -> None:
    if times is None:
        dst.copy_(src)
    else:
        torch.mul(src, times, out=dst)


def _folded(q: QuantizedTensor) -> torch.Tensor | None:
    """The decode scale S_dec of a format without a global scale, to fold into its block scales:
    it is 1.0 (s_b * 1.0 = s_b exactly) unless the input held a NaN or an Inf, when the
    quantize kernels make it NaN, and the product must then be NaN too (runtime/finite.py).
    None for a format with a global scale: the epilogue applies those."""
    if q.format.global_scale:
        return None
    g = q.global_scale
    return g if g.dtype == torch.float32 else g.to(torch.float32)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as fp32: itself when it is (``.to`` costs a call into torch per operand)."""
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def fp8_codes(q: QuantizedTensor, rows: int, cols: int) -> torch.Tensor:
    """The codes of ``q`` as a row-major FP8 tensor [rows, cols] (zero codes appended)."""
    element = q.element
    hit = _fp8_dtypes.get(id(element))  # by identity: hashing an element format costs a call
    if hit is None or hit[0] is not element:
        if len(_fp8_dtypes) >= 256:
            _fp8_dtypes.clear()
        hit = _fp8_dtypes[id(element)] = (element, _TORCH_DTYPES[element])
    return code_bytes(q, rows, cols).view(hit[1])


# id(element format) -> (the format, its torch FP8 dtype); the entry keeps the id valid
_fp8_dtypes: dict[int, tuple[Any, torch.dtype]] = {}


def code_bytes(q: QuantizedTensor, rows: int, cols: int) -> torch.Tensor:
    """The codes of ``q`` as a row-major uint8 tensor [rows, cols] (zero codes appended)."""
    p = q.packed_codes()
    codes = q.codes if p is None else p.data  # 8-bit codes: the packed form is one per byte
    if codes.dtype != torch.uint8:
        raise TensorError(f"expected uint8 codes, got {codes.dtype}")
    if (rows, cols) != tuple(codes.shape):
        codes = F.pad(codes, (0, cols - codes.shape[1], 0, rows - codes.shape[0]))
    elif not codes.is_contiguous():
        codes = codes.contiguous()
    return codes


class Operands:
    """The arguments of one scaled_mm call for A [M, K] and B [N, K], and the padded sizes."""

    def __init__(self, a: QuantizedTensor, b: QuantizedTensor) -> None:
        self.m, self.n, self.k = a.rows, b.rows, a.cols
        self.mp, self.np = round_up(self.m, ROW_ALIGN), round_up(self.n, ROW_ALIGN)
        self.kp = round_up(self.k, BLOCK)
        self.mat_a = fp8_codes(a, self.mp, self.kp)
        self.scale_a = outer_major_scales(_fp32(a.scales), self.mp, _folded(a))
        self.mat_b, self.scale_b = b_operand(b, self.np, self.kp)
        self.recipe_a = _recipe(a.format)
        self.recipe_b = _recipe(b.format)


def b_operand(b: QuantizedTensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B's codes as scaled_mm's column-major [cols, rows] and its scales in scaled_mm's layout
    (global scale folded in), remembered per B until its codes, scales or global scale change
    (their version counters): a weight used by several calls is converted once, the same
    tensors and values every time."""
    key = _b_versions(b, b.scales, rows, cols)
    kept = _b_operands.get(b)
    if kept is not None and kept[0] == key:
        return kept[1], kept[2]
    mat_b = fp8_codes(b, rows, cols).t()  # [K, N], column-major
    if b.format.block == (BLOCK, BLOCK):
        scale_b = tile_scales(_fp32(b.scales), _folded(b))
    else:
        scale_b = outer_major_scales(_fp32(b.scales), rows, _folded(b))
    _b_operands[b] = (key, mat_b, scale_b)
    return mat_b, scale_b


def _b_versions(b: QuantizedTensor, scales: torch.Tensor, *layout: Any) -> tuple:
    """What B's kept operands are derived from: its codes, ``scales`` (the scale tensor the
    path reads) and global scale (each tensor and its version), and the ``layout`` values
    (padded sizes, scale layout) they were made for."""
    return (
        *b.code_version(),
        id(scales),
        tensor_version(scales),
        id(b.global_scale),
        tensor_version(b.global_scale),
        *layout,
    )


# B (a QuantizedTensor, weakly held) -> (its versions, mat_b, scale_b)
_b_operands: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ----------------------------------------------------------------------------------------------
# The GEMM
# ----------------------------------------------------------------------------------------------


def block_scaled_gemm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    accumulate: torch.Tensor | None = None,
) -> torch.Tensor:
    """C = S_dec(a) S_dec(b) sum_b s_a s_b P_b (+ bias) (+ accumulate) on the FP8 tensor cores:
    ``block_scaled_product`` finished by the shared epilogue (``fp4gen.gemm`` runs the same
    two)."""
    product = block_scaled_product(a, b, out_dtype=out_dtype, bias=bias, accumulate=accumulate)
    return finish(
        product,
        a,
        b,
        bias=bias,
        accumulate=accumulate,
        out_dtype=out_dtype,
        backend="block_scaled",
    )


def block_scaled_product(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    accumulate: torch.Tensor | None = None,
    keep: Callable[..., None] | None = None,
    out: torch.Tensor | None = None,
) -> GemmProduct:
    """S_dec(a) S_dec(b) sum_b s_a s_b P_b on the FP8 tensor cores, as a GemmProduct: the
    global scales applied where they are folded into the block scales (formats without one),
    a bias of the 16-bit output dtype in cuBLASLt's epilogue; everything else (the global
    scales of formats with one, any other bias, accumulate, the rounding of an fp32 product)
    is the shared epilogue's (``fp4gen.runtime.epilogue.finish``).

    ``keep``: called as ``keep(a, b, out_dtype, bias, prepared)`` with a
    ``PreparedBlockScaled`` for the calls like this one by a call without ``accumulate`` on
    formats without a global scale (``fp4gen.gemm``'s per-call path,
    ``gemm_dispatch._prepared_fp8``).

    ``out``: where the caller wants C (``fp4gen.gemm``'s ``out``): cuBLASLt writes it there
    where C needs nothing after it (no fp32 step left, M and N unpadded, ``out`` 16-byte
    aligned, this torch has the op's out variant: ``scaled_mm_into``), else the caller
    copies.

    Raises TensorError for operands that cannot be multiplied (shapes, devices, transforms) and
    FP4GenError where this path does not serve them (formats, arch, torch build): the caller's
    cue to take another path."""
    require_quantized(a, b)
    check_pair(a, b)
    one_cuda_device(a, b, "block_scaled GEMM")
    if out_dtype not in OUT_DTYPES:
        raise TensorError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    reason = support(a.format, b.format) or torch_reason()
    if reason is None:
        from fp4gen.compiler.jit import detect_arch

        reason = arch_reason(detect_arch(a.device))
    if reason is not None:
        raise FP4GenError(f"the block-scaled FP8 GEMM does not serve this pair: {reason}")
    check_bias(bias, b.rows)
    check_accumulate(accumulate, a.rows, b.rows)
    ops = Operands(a, b)
    global_scales = a.format.global_scale or b.format.global_scale
    # cuBLASLt's epilogue adds a bias of the output's (16-bit) dtype in fp32 and rounds once:
    # the reference's order, and no fp32 copy of C (module docstring)
    fused_bias = (
        bias is not None
        and accumulate is None
        and not global_scales
        and out_dtype != torch.float32
        and bias.dtype == out_dtype
    )
    epilogue_bias = None
    if fused_bias:
        assert bias is not None
        epilogue_bias = bias if ops.np == ops.n else F.pad(bias, (0, ops.np - ops.n))
    # the output dtype straight from cuBLASLt only where nothing is left to add in fp32
    left = (bias is not None and not fused_bias) or accumulate is not None or global_scales
    direct = (
        not left
        and (ops.mp, ops.np) == (ops.m, ops.n)
        and takes_result(out, out_dtype, ops.m, ops.n)
        and scaled_mm_out_op() is not None
    )
    try:
        if direct:
            assert out is not None
            c = scaled_mm_into(ops, epilogue_bias, out)
        else:
            c = F.scaled_mm(
                ops.mat_a,
                ops.mat_b,
                ops.scale_a,
                ops.recipe_a,
                ops.scale_b,
                ops.recipe_b,
                bias=epilogue_bias,
                output_dtype=torch.float32 if left else out_dtype,
                use_fast_accum=False,
            )
    except NotImplementedError as err:  # this GPU / cuBLAS has no such kernel
        raise FP4GenError(
            f"torch.nn.functional.scaled_mm refused the block-scaled GEMM: {err}"
        ) from err
    if (ops.mp, ops.np) != (ops.m, ops.n):
        c = c[: ops.m, : ops.n]  # the shared epilogue makes the result contiguous
    if keep is not None and accumulate is None and not global_scales:
        keep(a, b, out_dtype, bias, PreparedBlockScaled(a, b, out_dtype, ops, bias, fused_bias))
    return GemmProduct(c, scaled=not global_scales, bias=fused_bias)


class PreparedB:
    """What B must be for a prepared FP8 call to be the call it was prepared for: a
    QuantizedTensor of the same format object, shape and device as then, with A's RHT, uint8
    codes and ``scales`` (the scale tensor its path reads) of the dtype and shape they had.
    With ``PreparedA`` that is everything the full path checked of the pair; B's values may be
    any (a weight quantized anew per call)."""

    __slots__ = ("format", "rows", "cols", "device", "scales")

    def __init__(self, b: QuantizedTensor, scales: torch.Tensor) -> None:
        self.format, self.rows, self.cols, self.device = b.format, b.rows, b.cols, b.device
        self.scales = (scales.dtype, scales.shape)

    def matches(self, a: QuantizedTensor, b: QuantizedTensor, scales: Any) -> bool:
        if b.format is not self.format or b.rows != self.rows or b.cols != self.cols:
            return False
        if b.device != self.device or not (b.rht is a.rht or b.rht == a.rht):
            return False
        if scales is None or (scales.dtype, scales.shape) != self.scales:
            return False
        return _code_dtype(b) == torch.uint8


def _code_dtype(q: QuantizedTensor) -> torch.dtype:
    p = q.packed_codes()
    return (q.codes if p is None else p.data).dtype


class PreparedBlockScaled:
    """A block-scaled scaled_mm call, kept by ``block_scaled_product`` for the ``fp4gen.gemm``
    calls like it (A and B of the same format objects and shapes, the same output dtype,
    device and bias dtype, or no bias): the recipes, the padded sizes and where the bias goes.
    A call checks that A, B and the bias are what it was prepared for (``PreparedA``,
    ``PreparedB``: format objects, shapes, RHT, device, output dtype, the scales' dtype and
    shape, uint8 codes; the bias's dtype, shape and device), then converts the operands as the
    full path does (B's from ``b_operand``, kept per weight version), calls scaled_mm and
    finishes as the full path does (a bias of the 16-bit output dtype in cuBLASLt's epilogue,
    any other in the shared epilogue); it returns None where anything differs, and the caller
    takes the full path (which checks, raises and prepares again). Formats without a global
    scale only (S_dec folded into the block scales)."""

    __slots__ = ("a", "b", "a_scales", "recipe_a", "recipe_b", "m", "n", "mp", "np", "kp",
                 "bias", "fused_bias", "output_dtype")  # fmt: skip

    def __init__(
        self,
        a: QuantizedTensor,
        b: QuantizedTensor,
        out_dtype: torch.dtype,
        ops: Operands,
        bias: torch.Tensor | None = None,
        fused_bias: bool = False,
    ) -> None:
        self.a, self.b = PreparedA(a, out_dtype), PreparedB(b, b.scales)
        self.a_scales = (torch.float32, a.rows, -(-a.cols // BLOCK))
        self.m, self.n, self.mp, self.np, self.kp = ops.m, ops.n, ops.mp, ops.np, ops.kp
        self.recipe_a, self.recipe_b = ops.recipe_a, ops.recipe_b
        self.bias = None if bias is None else (bias.dtype, bias.device)
        self.fused_bias = fused_bias
        # scaled_mm's output: fp32 where the shared epilogue still adds the bias
        left = bias is not None and not fused_bias
        self.output_dtype = torch.float32 if left else out_dtype

    def __call__(
        self,
        a: QuantizedTensor,
        b: QuantizedTensor,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """C = A_q @ B_q^T block-scaled (+ bias) in ``out_dtype``, or None where this call is
        not one like the call prepared."""
        if not self.a.matches(a, out_dtype) or not self.b.matches(a, b, b.scales):
            return None
        if not _bias_matches(bias, self.bias, self.n):
            return None
        scales = a.scales
        if (scales.dtype, *scales.shape) != self.a_scales or _code_dtype(a) != torch.uint8:
            return None  # the full path says why
        mat_b, scale_b = b_operand(b, self.np, self.kp)
        mat_a = fp8_codes(a, self.mp, self.kp)
        scale_a = outer_major_scales(scales, self.mp, _folded(a))
        epilogue_bias = None
        if self.fused_bias:
            assert bias is not None
            epilogue_bias = bias if self.np == self.n else F.pad(bias, (0, self.np - self.n))
        try:
            c = F.scaled_mm(
                mat_a,
                mat_b,
                scale_a,
                self.recipe_a,
                scale_b,
                self.recipe_b,
                bias=epilogue_bias,
                output_dtype=self.output_dtype,
                use_fast_accum=False,
            )
        except NotImplementedError:
            return None  # the full path raises the reason
        if (self.mp, self.np) != (self.m, self.n):
            c = c[: self.m, : self.n]
        if bias is not None and not self.fused_bias:  # the full path's epilogue adds it
            product = GemmProduct(c, scaled=True)
            return finish(
                product,
                a,
                b,
                bias=bias,
                accumulate=None,
                out_dtype=out_dtype,
                backend="block_scaled",
            )
        return c if c.is_contiguous() else c.contiguous()


def _bias_matches(bias: Any, prepared: tuple | None, n: int) -> bool:
    """Whether ``bias`` is what a prepared call was made for: none, or a tensor of its dtype
    and device (``prepared``) and of shape [N]."""
    if prepared is None or bias is None:
        return prepared is None and bias is None
    if not isinstance(bias, torch.Tensor) or (bias.dtype, bias.device) != prepared:
        return False
    return tuple(bias.shape) == (n,)


# ----------------------------------------------------------------------------------------------
# The generated kernel (backend="cute" for FP8 pairs): fp4gen.kernels.gemm_sm90_fp8
# ----------------------------------------------------------------------------------------------
CUTE_ARCHS = ("sm_90a",)
# Where backend="auto" takes the generated kernel instead of scaled_mm: pair name
# (``cute_pair_name``) -> the smallest M it won at in benchmarks/gemm.py. The same dict as
# ``fp4gen.codegen.gemm_fp8.AUTO_MIN_M`` (fill it there: fp4gen compile's plan reads it too).
CUTE_AUTO_MIN_M: dict[str, int] = AUTO_MIN_M
# The kernel variant calls take (GemmSm90Fp8Params.overlap, .cluster_m): the values
# ``fp4gen compile`` compiles, ``fp4gen.codegen.gemm_fp8.OVERLAP`` / ``CLUSTER_M`` (change them
# there); set here, a process takes another variant, compiled on first use.
CUTE_OVERLAP = OVERLAP
CUTE_CLUSTER_M = CLUSTER_M
# The coalesced variant (GemmSm90Fp8Params.mn_major_scales, .wide_stores): the values of
# ``fp4gen.codegen.gemm_fp8.MN_MAJOR_SCALES`` / ``WIDE_STORES``, set here the same way.
CUTE_MN_MAJOR_SCALES = MN_MAJOR_SCALES
CUTE_WIDE_STORES = WIDE_STORES
# The output tile's width (GemmSm90Fp8Params.tile_n, where the pair allows it):
# ``fp4gen.codegen.gemm_fp8.TILE_N``; with ``CUTE_TILE_BY_SHAPE`` (``TILE_BY_SHAPE``) that one
# where the call's shape fills its waves, else 128 (``cute_tile_n``).
CUTE_TILE_N = TILE_N
CUTE_TILE_BY_SHAPE = TILE_BY_SHAPE


def cute_support(a: BlockFormat | object, b: BlockFormat | object) -> str | None:
    """None when the generated block-scaled FP8 kernel serves the operand pair (A [M, K], B
    [N, K], both quantized along K), else why not. Pure logic on the formats: e4m3 / e5m2
    elements on either side, fp32 or ue8m0 block scales (the same kind on both), A in 1xN and
    B in 1xN or NxN blocks for one N that the FP8 wgmma K (32) divides and that divides 128 or
    is a multiple of it (32, 64, 128, 256, ...). Remembered per pair of format objects."""
    return _by_identity(_cute_support_ids, a, b, _cute_support)


def _cute_support(a: BlockFormat | object, b: BlockFormat | object) -> str | None:
    return pair_reason(a, b)  # pure logic, shared with fp4gen compile's plan


def cute_pair_name(a: BlockFormat, b: BlockFormat) -> str:
    """The pair as ``CUTE_AUTO_MIN_M`` names it, e.g. "e4m3 1x128 x e4m3 128x128 fp32"."""
    return pair_name(a, b)


def cute_auto_reason(a: BlockFormat | object, b: BlockFormat | object, m: int) -> str | None:
    """Why ``backend="auto"`` takes the generated FP8 kernel for this pair at M = ``m`` (the
    measured table ``CUTE_AUTO_MIN_M`` says it is the faster), or None (it does not)."""
    if not CUTE_AUTO_MIN_M or cute_support(a, b) is not None:  # nothing measured: no import
        return None
    assert isinstance(a, BlockFormat) and isinstance(b, BlockFormat)
    name = cute_pair_name(a, b)
    least = CUTE_AUTO_MIN_M.get(name)
    if least is None or m < least:
        return None
    return f"generated block-scaled FP8 kernel: {name} (measured faster from M = {least})"


_cute_compiled: dict[Any, Any] = {}  # GemmSm90Fp8Params -> the compiled function
_cute_lock = threading.Lock()
_sm_counts: dict[tuple[int, int], int] = {}  # (device, cluster size) -> grid limit


def cute_kernel(params: Any, cache: Any = None) -> Any:
    """The compiled kernel of ``params`` (a ``GemmSm90Fp8Params``): from the kernel cache on
    disk (``fp4gen.runtime.kernels_for``, keyed by its generated module's text and the kernel
    code's version), compiled into it on first use (about 2-3 s), then kept in this process.
    ``cache``: a ``KernelCache`` other than the default one."""
    fn = _cute_compiled.get(params)
    if fn is not None and cache is None:
        return fn
    with _cute_lock:  # cute.compile is not thread-safe
        fn = _cute_compiled.get(params)
        if fn is None or cache is not None:
            from fp4gen.codegen.gemm_fp8 import module_source
            from fp4gen.runtime.kernels import kernels_for

            source = module_source(params)
            try:
                loaded = kernels_for(params, "sm_90a", cache=cache, render=lambda _: source)
            except Exception as err:  # the DSL's and the cache's errors have no common base
                raise FP4GenError(
                    f"the FP8 GEMM kernel {params.name} did not compile or load: {err}"
                ) from err
            fn = _cute_compiled[params] = loaded["gemm"]
            _cute_loaded[params] = loaded.stats
    return fn


_cute_loaded: dict[Any, Any] = {}  # params -> LoadStats of the last compile or load


class CutePlan(NamedTuple):
    """What a call of the generated kernel needs besides its tensors, per (formats, output
    dtype, bias, accumulate): kept, so a call builds no params and hashes no formats."""

    params: Any  # GemmSm90Fp8Params
    block_k: int
    ue8m0: bool
    kernel_out: torch.dtype  # what the kernel writes: bf16 or fp32


_cute_plans: dict[tuple, tuple[BlockFormat, BlockFormat, CutePlan]] = {}


def cute_plan(
    a: BlockFormat,
    b: BlockFormat,
    out_dtype: torch.dtype,
    bias: bool,
    accumulate: bool,
    tile_n: int | None = None,
) -> CutePlan:
    """The plan of a supported pair (``cute_support``), looked up by the formats' identity;
    ``tile_n``: the output tile's width for the call's shape (``cute_tile_n``), by default
    ``CUTE_TILE_N`` (where the pair takes it; else 128)."""
    tile_n = CUTE_TILE_N if tile_n is None else tile_n
    key = (id(a), id(b), out_dtype, bias, accumulate, tile_n, *cute_settings())
    hit = _cute_plans.get(key)
    if hit is not None and hit[0] is a and hit[1] is b:
        return hit[2]
    from fp4gen.kernels.gemm_sm90_fp8 import GemmSm90Fp8Params

    out = kernel_out("bf16" if out_dtype == torch.bfloat16 else "fp32", accumulate)
    fields = kernel_fields(
        a,
        b,
        out,
        bias,
        accumulate,
        overlap=CUTE_OVERLAP,
        cluster_m=CUTE_CLUSTER_M,
        mn_major_scales=CUTE_MN_MAJOR_SCALES,
        wide_stores=CUTE_WIDE_STORES,
        tile_n=tile_n,
    )
    params = GemmSm90Fp8Params(**fields)
    kernel_dtype = torch.bfloat16 if params.out == "bf16" else torch.float32
    plan = CutePlan(params, a.block[1], params.scale_kind == "ue8m0", kernel_dtype)
    if len(_cute_plans) >= 256:
        _cute_plans.clear()
    _cute_plans[key] = (a, b, plan)  # the references keep the ids valid
    return plan


def cute_settings() -> tuple:
    """The kernel variant calls take now (``CUTE_OVERLAP``, ``CUTE_CLUSTER_M``,
    ``CUTE_MN_MAJOR_SCALES``, ``CUTE_WIDE_STORES``, ``CUTE_TILE_N``, ``CUTE_TILE_BY_SHAPE``):
    part of a plan's key."""
    return (
        CUTE_OVERLAP,
        CUTE_CLUSTER_M,
        CUTE_MN_MAJOR_SCALES,
        CUTE_WIDE_STORES,
        CUTE_TILE_N,
        CUTE_TILE_BY_SHAPE,
    )


def cute_tile_n(a: BlockFormat, b: BlockFormat, m: int, n: int, device: torch.device) -> int:
    """The output tile width of an M x N call of the pair on ``device``: ``CUTE_TILE_N``; with
    ``CUTE_TILE_BY_SHAPE``, 128 where the pair takes tiles wider than 128 and they leave a
    partial last wave of the persistent grid (``codegen.gemm_fp8.tile_n_for``: the faster there,
    measured, ``TILE_BY_SHAPE``)."""
    if not CUTE_TILE_BY_SHAPE or CUTE_TILE_N <= 128:
        return CUTE_TILE_N
    widest = cute_plan(a, b, torch.bfloat16, False, False).params.tile_n
    if widest <= 128:
        return CUTE_TILE_N
    return tile_n_for(m, n, sm_count(device, 1), widest)


def cute_scales(q: QuantizedTensor, ue8m0: bool) -> torch.Tensor:
    """The block scales as the kernel reads them: fp32 [R, KB] as the quantize kernels write
    them, or the ue8m0 codes uint8 [R, KB] with KB zero-padded to a multiple of 4 (the kernel
    copies aligned 4-byte words)."""
    if not ue8m0:
        s = q.scales
        if s.dtype != torch.float32:
            s = s.to(torch.float32)
        return s if s.is_contiguous() else s.contiguous()
    codes = q.scale_codes
    if codes is None:
        raise TensorError("a ue8m0-scaled QuantizedTensor without scale codes")
    kb = codes.shape[1]
    if kb % 4:
        return F.pad(codes, (0, 4 - kb % 4))
    return codes if codes.is_contiguous() else codes.contiguous()


def cute_scales_mn_major(q: QuantizedTensor, ue8m0: bool) -> torch.Tensor:
    """The 1xN block scales MN-major, as the kernel's ``mn_major_scales`` variant reads them:
    [KB, Rp] (fp32 factors, or the ue8m0 codes as uint8), one K-block's scales of all R rows
    contiguous, Rp = R rounded up to ``MN_MAJOR_ALIGN`` (the padded rows zero). Scales that
    already are a [R, KB] view of such a buffer (strides (1, Rp), what the quantize kernels
    would write for this layout) are passed as that buffer, without a copy; others are
    transposed here, one elementwise pass (as scaled_mm's A scales are)."""
    s = q.scale_codes if ue8m0 else q.scales
    if s is None:
        raise TensorError("a ue8m0-scaled QuantizedTensor without scale codes")
    if not ue8m0 and s.dtype != torch.float32:
        s = s.to(torch.float32)
    return scales_mn_major(s)


def scales_mn_major(s: torch.Tensor) -> torch.Tensor:
    """Row-major scales ``s`` [R, KB] (fp32 factors or ue8m0 codes) as the [KB, Rp] MN-major
    buffer ``cute_scales_mn_major`` describes: ``s``'s own buffer where it is a view of one,
    else one transposing copy."""
    rows, kb = s.shape
    buffer = _mn_major_buffer(s)
    if buffer is not None:
        return buffer
    pitch = round_up(rows, MN_MAJOR_ALIGN)
    if pitch != rows:
        out = torch.zeros((kb, pitch), dtype=s.dtype, device=s.device)
        out[:, :rows].copy_(s.t())
        return out
    out = torch.empty((kb, pitch), dtype=s.dtype, device=s.device)
    out.t().copy_(s)  # no slice of the whole buffer (one aten op less)
    return out


def _mn_major_buffer(s: torch.Tensor) -> torch.Tensor | None:
    """The [KB, Rp] buffer that ``s`` [R, KB] is a transposed view of (strides (1, Rp), Rp a
    multiple of ``MN_MAJOR_ALIGN``, 16-byte aligned, the whole buffer inside the storage), or
    None."""
    rows, kb = s.shape
    pitch = s.stride(1)
    if kb > 1 and (s.stride(0) != 1 or pitch < rows or pitch % MN_MAJOR_ALIGN):
        return None
    if kb == 1:  # one K-block: any [R, 1] column with unit row stride is the buffer's row
        if s.stride(0) != 1:
            return None
        pitch = round_up(rows, MN_MAJOR_ALIGN)
    if s.data_ptr() % 16:
        return None
    end = (s.storage_offset() + kb * pitch) * s.element_size()
    if end > s.untyped_storage().nbytes():
        return None
    return s.as_strided((kb, pitch), (pitch, 1))


def sm_count(device: torch.device, cluster: int = 1) -> int:
    """The persistent grid's limit on ``device``: its SM count, or for clusters of ``cluster``
    CTAs that many times the clusters that can be resident at once (the GPCs' SM counts
    leave some SMs out of pairs; more clusters would run in a second wave)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _sm_counts.get((index, cluster))
    if count is None:
        if cluster == 1:
            count = torch.cuda.get_device_properties(index).multi_processor_count
        else:
            from cutlass.utils import HardwareInfo

            with _cute_lock:  # it compiles a probe kernel: cute.compile is not thread-safe
                count = cluster * max(1, HardwareInfo(index).get_max_active_clusters(cluster))
        _sm_counts[(index, cluster)] = count
    return count


def cute_block_scaled_product(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    accumulate: torch.Tensor | None = None,
    keep: Callable[..., None] | None = None,
    out: torch.Tensor | None = None,
) -> GemmProduct:
    """S_dec(a) S_dec(b) sum_b s_a s_b P_b (+ bias) (+ accumulate) with the generated FP8
    kernel (``fp4gen.kernels.gemm_sm90_fp8``), as a GemmProduct: the global scales, the bias
    (in fp32) and ``accumulate`` (an fp32 copy read and overwritten by the kernel) applied in
    the kernel, in the reference's order; a bf16 result straight from the kernel, any other
    output dtype rounded by the shared epilogue from its fp32 result.

    ``keep``: called as ``keep(a, b, out_dtype, bias, prepared)`` with a ``PreparedCuteFp8``
    for the calls like this one by a call without ``accumulate`` (``fp4gen.gemm``'s per-call
    path).

    ``out``: where the caller wants C (``fp4gen.gemm``'s ``out``): the kernel writes it there
    where it writes the result itself (``cute_launch``), else the caller copies.

    Raises TensorError for operands that cannot be multiplied and FP4GenError where the kernel
    does not serve them (formats, arch): the caller's cue to take another path."""
    fn, args, product = cute_launch(
        a, b, out_dtype=out_dtype, bias=bias, accumulate=accumulate, out=out
    )
    fn(*args)
    if keep is not None and accumulate is None:
        keep(a, b, out_dtype, bias, PreparedCuteFp8(a, b, out_dtype, fn, args, bias))
    return product


def cute_launch(
    a: QuantizedTensor,
    b: QuantizedTensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    accumulate: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[Any, list, GemmProduct]:
    """``cute_block_scaled_product`` up to the launch: (the compiled kernel, its arguments,
    the product it will have written). The arguments, in the kernel's order: A's codes
    [M, Kp] and scales, B's codes [N, Kp] and scales (Kp = K rounded up to whole K-blocks,
    zero codes appended; uint8, read as FP8), S_a and S_b as fp32 [1], C [M, N] (an fp32
    copy of ``accumulate`` when given; else ``out`` where it is a contiguous, 16-byte aligned
    [M, N] tensor of the dtype the kernel writes, the result itself), the bias as fp32 [N]
    when given, the GPU's SM count (the persistent grid)."""
    require_quantized(a, b)
    check_pair(a, b)
    dev = one_cuda_device(a, b, "generated FP8 GEMM")
    if out_dtype not in OUT_DTYPES:
        raise TensorError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    reason = cute_support(a.format, b.format)
    if reason is None:
        from fp4gen.compiler.jit import detect_arch

        arch = detect_arch(a.device)
        if arch not in CUTE_ARCHS:
            reason = f"no generated FP8 GEMM for {arch} (FP8 wgmma: sm_90a only)"
    if reason is not None:
        raise FP4GenError(f"the generated FP8 GEMM does not serve this pair: {reason}")
    check_bias(bias, b.rows)
    check_accumulate(accumulate, a.rows, b.rows)
    m, n, k = a.rows, b.rows, a.cols
    if m * n >= 2**31:
        raise FP4GenError(f"the generated FP8 GEMM indexes C with 32 bits: M * N = {m * n}")
    tile_n = cute_tile_n(a.format, b.format, m, n, dev)
    plan = cute_plan(
        a.format, b.format, out_dtype, bias is not None, accumulate is not None, tile_n
    )
    kp = round_up(k, plan.block_k)  # whole K-blocks: zero codes add exactly 0
    mn_major = plan.params.mn_major_scales
    b_codes, b_scales, b_global = cute_b_operand(b, kp, plan.ue8m0, plan.params.b_mn_major, dev)
    args = [
        code_bytes(a, m, kp),  # read as FP8 by the kernel
        cute_scales_mn_major(a, plan.ue8m0) if mn_major else cute_scales(a, plan.ue8m0),
        b_codes,
        b_scales,
        _global(a, dev),
        b_global,
    ]
    if accumulate is not None:  # read and overwritten by the kernel: a copy of its own
        c = accumulate.detach().to(
            device=dev, dtype=torch.float32, memory_format=torch.contiguous_format, copy=True
        )
    elif plan.kernel_out == out_dtype and takes_result(out, out_dtype, m, n):
        c = out  # the kernel's result is the call's: written where the caller wants it
    else:
        c = torch.empty((m, n), dtype=plan.kernel_out, device=dev)
    args.append(c)
    if bias is not None:
        args.append(bias.detach().to(device=dev, dtype=torch.float32).contiguous())
    args.append(sm_count(dev, plan.params.cluster_m))
    product = GemmProduct(c, scaled=True, bias=bias is not None, accumulated=accumulate is not None)
    return cute_kernel(plan.params), args, product


def cute_b_operand(
    b: QuantizedTensor, kp: int, ue8m0: bool, mn_major: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B's arguments of the generated kernel (codes [N, kp], scales in the layout the variant
    reads, S_dec as fp32 [1]), remembered per B from its second call until its codes, scales
    or global scale change (their version counters): a weight used by several calls is padded
    and laid out once. A B met for the first time is only noted (a weight quantized anew per
    call is a new B every time: its versions would be computed for nothing)."""
    kept = _cute_b_operands.get(b, _UNMET)
    if kept is _UNMET:
        _cute_b_operands[b] = None
        return _cute_b_arguments(b, kp, ue8m0, mn_major, device)
    scales = b.scale_codes if ue8m0 else b.scales
    key = None if scales is None else _b_versions(b, scales, kp, ue8m0, mn_major, device)
    if key is not None and kept is not None and kept[0] == key:
        return kept[1]
    made = _cute_b_arguments(b, kp, ue8m0, mn_major, device)
    _cute_b_operands[b] = None if key is None else (key, made)
    return made


def _cute_b_arguments(
    b: QuantizedTensor, kp: int, ue8m0: bool, mn_major: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        code_bytes(b, b.rows, kp),
        cute_scales_mn_major(b, ue8m0) if mn_major else cute_scales(b, ue8m0),
        _global(b, device),
    )


_UNMET = object()


# B (a QuantizedTensor, weakly held) -> (its versions, its kernel arguments), or None for a B
# met once
_cute_b_operands: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class PreparedCuteFp8:
    """A generated FP8 GEMM call, kept by ``cute_block_scaled_product`` for the
    ``fp4gen.gemm`` calls like it (A and B of the same format objects and shapes, the same
    output dtype, device and bias dtype, or no bias): the compiled kernel, the padded K, the SM
    count and a template of the output. A call checks that A, B and the bias are what it was
    prepared for (``PreparedA``, ``PreparedB``: format objects, shapes, RHT, device, output
    dtype, the scales' dtype and shape, uint8 codes; the bias's dtype, shape and device) and
    that the kernel variant (``cute_settings``) is the same, then
    launches with the arguments made as the full path makes them (B's from
    ``cute_b_operand``, kept per weight version); it returns None where anything differs (the
    caller takes the full path)."""

    __slots__ = ("a", "b", "a_scales", "settings", "fn", "m", "n", "kp", "ue8m0", "mn_major",
                 "b_mn_major", "dev", "sms", "out_like", "bias")  # fmt: skip

    def __init__(
        self,
        a: QuantizedTensor,
        b: QuantizedTensor,
        out_dtype: torch.dtype,
        fn: Any,
        args: list,
        bias: torch.Tensor | None = None,
    ) -> None:
        dev = args[6].device  # the full path's output device (that of the operands)
        tile_n = cute_tile_n(a.format, b.format, a.rows, b.rows, dev)  # as the full path did
        plan = cute_plan(a.format, b.format, out_dtype, bias is not None, False, tile_n)
        self.bias = None if bias is None else (bias.dtype, bias.device)
        self.n = b.rows
        self.ue8m0, self.mn_major = plan.ue8m0, plan.params.mn_major_scales
        self.b_mn_major = plan.params.b_mn_major
        self.a = PreparedA(a, out_dtype)
        self.b = PreparedB(b, _kernel_scales(b, self.ue8m0))
        self.m, self.kp = a.rows, round_up(a.cols, plan.block_k)
        scale_dtype = torch.uint8 if self.ue8m0 else torch.float32
        self.a_scales = (scale_dtype, a.rows, -(-a.cols // plan.block_k))
        self.settings = cute_settings()
        self.fn = fn
        self.dev = dev
        self.sms = args[-1]
        # the output's shape, dtype and device on one element: empty_like of it allocates a
        # contiguous [M, N] with less argument parsing than torch.empty
        self.out_like = torch.empty((1, 1), dtype=plan.kernel_out, device=self.dev).expand(
            a.rows, b.rows
        )

    def __call__(
        self,
        a: QuantizedTensor,
        b: QuantizedTensor,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """C = S_a S_b (A_q @ B_q^T) block-scaled (+ bias) in ``out_dtype``, or None where this
        call is not one like the call prepared."""
        ue8m0 = self.ue8m0
        if not self.a.matches(a, out_dtype) or cute_settings() != self.settings:
            return None
        if not self.b.matches(a, b, _kernel_scales(b, ue8m0)):
            return None
        if not _bias_matches(bias, self.bias, self.n):
            return None
        s = _kernel_scales(a, ue8m0)
        if s is None or (s.dtype, *s.shape) != self.a_scales or _code_dtype(a) != torch.uint8:
            return None  # the full path says why
        dev = self.dev
        b_codes, b_scales, b_global = cute_b_operand(b, self.kp, ue8m0, self.b_mn_major, dev)
        out = torch.empty_like(self.out_like, memory_format=torch.contiguous_format)
        args = [
            code_bytes(a, self.m, self.kp),
            cute_scales_mn_major(a, ue8m0) if self.mn_major else cute_scales(a, ue8m0),
            b_codes,
            b_scales,
            _global(a, dev),
            b_global,
            out,
        ]
        if bias is not None:  # as the full path passes it: fp32 [N] on the device
            args.append(bias.detach().to(device=dev, dtype=torch.float32).contiguous())
        self.fn(*args, self.sms)
        if out.dtype != out_dtype:
            return out.to(out_dtype, memory_format=torch.contiguous_format)
        return out


def _kernel_scales(q: QuantizedTensor, ue8m0: bool) -> torch.Tensor | None:
    """The scale tensor the generated kernel reads of ``q``: its ue8m0 codes or fp32 scales."""
    return q.scale_codes if ue8m0 else q.scales


def _global(q: QuantizedTensor, device: torch.device) -> torch.Tensor:
    """S_dec as the kernel reads it: fp32 [1] on ``device`` (a view when it already is)."""
    g = q.global_scale
    if g.dtype != torch.float32 or g.device != device:
        g = g.to(device=device, dtype=torch.float32)
    return g.reshape(1)


def _recipe(fmt: BlockFormat):
    scaling = F.ScalingType  # type: ignore[attr-defined]
    return scaling.BlockWise128x128 if fmt.block == (BLOCK, BLOCK) else scaling.BlockWise1x128


__all__ = [
    "ARCHS",
    "BLOCK",
    "CUTE_ARCHS",
    "CUTE_AUTO_MIN_M",
    "ROW_ALIGN",
    "Operands",
    "PreparedB",
    "PreparedBlockScaled",
    "PreparedCuteFp8",
    "arch_reason",
    "b_operand",
    "block_scaled_gemm",
    "block_scaled_product",
    "cute_auto_reason",
    "cute_block_scaled_product",
    "cute_launch",
    "cute_scales",
    "cute_scales_mn_major",
    "scales_mn_major",
    "cute_support",
    "cute_b_operand",
    "cute_settings",
    "cute_tile_n",
    "code_bytes",
    "describe",
    "fp8_codes",
    "outer_major_scales",
    "support",
    "tile_scales",
    "torch_reason",
]
