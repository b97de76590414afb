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

import torch
import torch.nn.functional as F

from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat, ElementFormat
from fp4gen.numerics import QuantizedTensor
from fp4gen.numerics.gemm import require_quantized
from fp4gen.runtime.checks import check_accumulate, check_bias, check_pair, one_cuda_device
from fp4gen.runtime.epilogue import GemmProduct, finish

ARCHS = ("sm_90a",)  # cuBLASLt's 1x128 / 128x128 fp32 block scaling: Hopper only
BLOCK = 128
ROW_ALIGN = 16  # M and N are padded to a multiple of this (see the module docstring)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_E4M3 = ElementFormat(4, 3, True, "fn")
_E5M2 = ElementFormat(5, 2, True, "ieee")
_TORCH_DTYPES = {_E4M3: torch.float8_e4m3fn, _E5M2: torch.float8_e5m2}


def support(a: BlockFormat | object, b: BlockFormat | object) -> str | None:
    """None when ``scaled_mm``'s blockwise FP8 GEMM serves the operand pair (A [M, K], B [N, K],
    both quantized along K), else why not. Pure logic on the formats."""
    if not (isinstance(a, BlockFormat) and isinstance(b, BlockFormat)):
        return "an operand is kept in high precision"
    for name, fmt in (("A", a), ("B", b)):
        if fmt.element not in _TORCH_DTYPES:
            return (
                f"{name} has {fmt.element.name} elements (the FP8 tensor cores read e4m3 and "
                "e5m2 with their fn and ieee conventions)"
            )
        if fmt.scale.element is not None:
            return (
                f"{name} has {fmt.scale.element.name} block scales (cuBLAS's 1x128 / 128x128 "
                "block scaling takes fp32 scales)"
            )
    if _E5M2 in (a.element, b.element):
        # measured on the H100 (torch 2.11, CUDA 13): "Invalid scaling configuration" for an
        # e5m2 operand with 1x128 / 128x128 scales, e4m3 x e4m3 only
        return "an operand has e5m2 elements (torch's block-wise scaled_mm takes e4m3 only)"
    if a.block != (1, BLOCK):
        return f"A has {_block_text(a)} blocks (scaled_mm takes 1x128 for A here)"
    if b.block not in ((1, BLOCK), (BLOCK, BLOCK)):
        return f"B has {_block_text(b)} blocks (scaled_mm takes 1x128 or 128x128)"
    return None


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
    >= 12.9), else why not."""
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


def describe(a: BlockFormat, b: BlockFormat) -> str:
    """The scaled_mm recipe pair of a supported operand pair, e.g. "BlockWise1x128 x
    BlockWise128x128"."""
    return f"{_recipe_name(a)} x {_recipe_name(b)}"


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
    out = _buffer((kb, rows), padded=rows != r, device=scales.device)
    _write(out[:, :r], scales.t(), times)
    return out.t()


def tile_scales(scales: torch.Tensor, times: torch.Tensor | None = None) -> torch.Tensor:
    """128x128 scales [NB, KB] (fp32, fp4gen's layout) as scaled_mm reads B's: shape [L4, NB]
    with strides (1, L4), L4 = KB rounded up to 4; the padded K-blocks get scale 0."""
    nb, kb = scales.shape
    l4 = round_up(kb, 4)
    out = _buffer((nb, l4), padded=l4 != kb, device=scales.device)
    _write(out[:, :kb], scales, times)
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
    return None if q.format.global_scale else q.global_scale.to(torch.float32)


def fp8_codes(q: QuantizedTensor, rows: int, cols: int) -> torch.Tensor:
    """The codes of ``q`` as a row-major FP8 tensor [rows, cols] (zero codes appended)."""
    p = q.packed_codes()
    codes = q.codes if p is None else p.data  # 8-bit codes: the packed form is one per byte
    if codes.dtype != torch.uint8:
        raise TensorError(f"expected uint8 codes, got {codes.dtype}")
    if (rows, cols) != tuple(codes.shape):
        codes = F.pad(codes, (0, cols - codes.shape[1], 0, rows - codes.shape[0]))
    elif not codes.is_contiguous():
        codes = codes.contiguous()
    return codes.view(_TORCH_DTYPES[q.element])


class Operands:
    """The arguments of one scaled_mm call for A [M, K] and B [N, K], and the padded sizes."""

    def __init__(self, a: QuantizedTensor, b: QuantizedTensor) -> None:
        self.m, self.n, self.k = a.rows, b.rows, a.cols
        self.mp, self.np = round_up(self.m, ROW_ALIGN), round_up(self.n, ROW_ALIGN)
        self.kp = round_up(self.k, BLOCK)
        self.mat_a = fp8_codes(a, self.mp, self.kp)
        self.mat_b = fp8_codes(b, self.np, self.kp).t()  # [K, N], column-major
        self.scale_a = outer_major_scales(a.scales.to(torch.float32), self.mp, _folded(a))
        if b.format.block == (BLOCK, BLOCK):
            self.scale_b = tile_scales(b.scales.to(torch.float32), _folded(b))
        else:
            self.scale_b = outer_major_scales(b.scales.to(torch.float32), self.np, _folded(b))
        self.recipe_a = _recipe(a.format)
        self.recipe_b = _recipe(b.format)


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
) -> GemmProduct:
    """S_dec(a) S_dec(b) sum_b s_a s_b P_b on the FP8 tensor cores, as a GemmProduct: the
    global scales applied where they are folded into the block scales (formats without one),
    a bias of the 16-bit output dtype in cuBLASLt's epilogue; everything else (the global
    scales of formats with one, any other bias, accumulate, the rounding of an fp32 product)
    is the shared epilogue's (``fp4gen.runtime.epilogue.finish``).

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
    try:
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
    return GemmProduct(c, scaled=not global_scales, bias=fused_bias)


def _recipe(fmt: BlockFormat):
    scaling = F.ScalingType  # type: ignore[attr-defined]
    return scaling.BlockWise128x128 if fmt.block == (BLOCK, BLOCK) else scaling.BlockWise1x128


def _recipe_name(fmt: BlockFormat) -> str:
    return "BlockWise128x128" if fmt.block == (BLOCK, BLOCK) else "BlockWise1x128"


def _block_text(fmt: BlockFormat) -> str:
    return f"{fmt.block[0]}x{fmt.block[1]}"


__all__ = [
    "ARCHS",
    "BLOCK",
    "ROW_ALIGN",
    "Operands",
    "arch_reason",
    "block_scaled_gemm",
    "block_scaled_product",
    "describe",
    "fp8_codes",
    "outer_major_scales",
    "support",
    "tile_scales",
    "torch_reason",
]
