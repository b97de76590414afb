"""What the Hopper block-scaled FP8 GEMMs take, as pure logic on the operand formats (no torch
or CuTe DSL import: the dispatch asks on every uncached choice, and ``fp4gen compile`` plans
with it): the generated kernel (``fp4gen.kernels.gemm_sm90_fp8``: ``pair_reason``,
``pair_name``, the measured table and variant settings, ``kernel_fields``) and torch's
block-wise ``scaled_mm`` (``scaled_mm_reason``, ``scaled_mm_name``); and the generated module
of one of the kernel's specializations (``module_source``: what the kernel cache stores and
keys). ``fp4gen.runtime.fp8_gemm`` runs both."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from fp4gen.formats import UE8M0, BlockFormat, ElementFormat

WGMMA_K = 32  # FP8 wgmma consumes 32 values of K per instruction
MAX_TILE_K = 128  # one 128-byte swizzle row of FP8 codes per k-tile
ELEMENT_NAMES = ("e4m3", "e5m2")
SCALE_KINDS = ("fp32", "ue8m0")
OUT_NAMES = ("bf16", "fp32")
E4M3 = ElementFormat(4, 3, True, "fn")
E5M2 = ElementFormat(5, 2, True, "ieee")
ELEMENT_OF: dict[ElementFormat, str] = {E4M3: "e4m3", E5M2: "e5m2"}
SCALED_MM_BLOCK = 128  # torch's block-wise scaled_mm: 1x128 and 128x128 blocks

# Where backend="auto" takes the generated kernel instead of scaled_mm: pair name
# (``pair_name``) -> the smallest M it won at in benchmarks/gemm.py (H200, N = K = 8192, the
# same run). Empty until measured: auto keeps scaled_mm (and the exact path for the pairs
# scaled_mm does not serve) for every pair. ``fp8_gemm.CUTE_AUTO_MIN_M`` is this dict.
AUTO_MIN_M: dict[str, int] = {}
# The kernel variant calls take (the runtime's ``fp8_gemm.CUTE_OVERLAP`` / ``CUTE_CLUSTER_M``
# start from these, and ``fp4gen compile`` compiles these): K-block b's wgmma overlapped with
# block b - 1's promotion (GemmSm90Fp8Params.overlap), where the K-block's stages allow it, off
# until measured faster (benchmarks/gemm.py times both variants alone); CTAs per cluster along M
# (GemmSm90Fp8Params.cluster_m: 2 multicasts each B tile to two CTAs): 2, measured faster at the
# GPU's sustained clock (H200, the kernel alone, 0.4 s of warm-up per timing, turns rotated:
# 192-wide tiles 1011-1021 -> 1066 TFLOP/s at 8192^3, +4-5 % on five full-wave shapes; 128-wide
# 918 -> 956 at 4096^3; docs/gemm-sm90.md, "The power limit").
OVERLAP = False
CLUSTER_M = 2
# The coalesced variant (docs/gemm-sm90.md, "Where the FP8 kernel's time goes"): A's (and a
# 1xN B's) block scales read MN-major with 16-byte copies (GemmSm90Fp8Params.mn_major_scales;
# the host transposes the quantize kernels' row-major scales per call until they write that
# layout) and the epilogue's stores of whole sectors (.wide_stores). On: measured faster on the
# H200 (8192^3, the kernel alone 699 -> 1135 TFLOP/s, fp4gen.gemm with the scale transpose
# 969), bit-exact on its GPU tests (-k coalesced).
MN_MAJOR_SCALES = True
WIDE_STORES = True
# Output tile width (GemmSm90Fp8Params.tile_n): 192 moves less through shared memory per
# multiply-add than 128 (docs/gemm-sm90.md), where it fits the registers (``wide_tile_reason``:
# B in tiles, no overlap; other pairs keep 128). On: 1135 -> 1178 TFLOP/s at 8192^3 (H200),
# bit-exact on its GPU tests (-k wide_tile).
TILE_N = 192
# Whether a call's tile width follows its shape (``tile_n_for``): the widest tile the pair
# takes where its waves are full, else 128. Measured on the H200 (the kernel alone, best of
# 7 turns, TFLOP/s, fp8_blockwise's pair / e5m2 x e4m3; docs/gemm-sm90.md, "The tile width by
# shape"): 4096^3 192-wide 893 / 917, 128-wide 975 / 1002; 8192x2048x8192 920 / 965 against
# 1004 / 1017; 2048x8192x2048 860 / 873 against 929 / 937; 1024x8192x8192 1009 / 1002 against
# 1097 / 1089; at 8192^3 and the other full-wave shapes the 192-wide tile is ahead.
TILE_BY_SHAPE = True
# The 192-wide tile's throughput over the 128-wide one's where both fill whole waves (8192^3,
# the kernel alone, H200): what a wave of the wider tiles is worth in ``tile_n_for``.
WIDE_TILE_GAIN = 1178 / 1135
# The K-grouped kernel (the experts' wgrad) in the coalesced variant: MN-major scales and
# whole-sector stores, as the dense kernel's (k_grouped_kernel_fields). On: measured on the H200
# (both wgrad GEMMs of a 64-expert top-8 layer, 8192 tokens, hidden 2048, inner 768;
# benchmarks/moe_static.py --wgrad) 1.758 -> 1.039 ms (352 -> 595 TFLOP/s; BF16 grouped_mm
# 0.996 ms), bit-exact on its GPU tests (tests/test_fp8_kgrouped_gpu.py, both variants)
K_GROUPED_COALESCED = True
# MN-major scale tensors [KB, Rp]: Rp = the rows rounded up to this (16-byte chunks of fp32
# factors need 4, of ue8m0 codes 16; scaled_mm's M-major A scales need 16 too)
MN_MAJOR_ALIGN = 16


def block_k_reason(block_k: int) -> str | None:
    """None when the kernel takes K-blocks of ``block_k`` values, else why not: a multiple of
    the FP8 wgmma K (32) that divides 128 or is a multiple of 128 (32, 64, 128, 256, ...)."""
    if block_k < WGMMA_K or block_k % WGMMA_K:
        return f"block length {block_k} along K is not a multiple of the FP8 wgmma K ({WGMMA_K})"
    if (block_k < MAX_TILE_K and MAX_TILE_K % block_k) or (
        block_k > MAX_TILE_K and block_k % MAX_TILE_K
    ):
        return f"block length {block_k} along K neither divides {MAX_TILE_K} nor is a multiple"
    return None


def wide_tile_reason(tile_n: int, block_k: int, b_2d: bool, overlap: bool) -> str | None:
    """None when the kernel takes output tiles ``tile_n`` wide, else why not: up to 128 any
    pair; wider (the registers hold total and partial accumulators of tile_n / 2 each) only
    with B in block_k x block_k tiles of which a tile spans at most two (tile_n <= block_k +
    gcd(tile_n, block_k): two B scales per tile, not one per column) and without overlap (a
    third accumulator)."""
    if tile_n <= 128:
        return None
    if not b_2d:
        return f"tile_n {tile_n} > 128 needs B in tiles (1xN B: a scale per column)"
    if tile_n > block_k + math.gcd(tile_n, block_k):
        return f"tile_n {tile_n} spans more than two of B's {block_k}x{block_k} tiles"
    if overlap:
        return f"overlap keeps three accumulators: tile_n {tile_n} > 128 too wide"
    return None


def tile_n_for(m: int, n: int, sms: int, widest: int = TILE_N, tile_m: int = 128) -> int:
    """The output tile width for an M x N product on ``sms`` persistent CTAs: ``widest`` or
    128, whichever takes less time by waves (a wave: one tile per CTA, as long as the tile is
    wide, the wider tile's waves ``WIDE_TILE_GAIN`` faster per column). The wider tile wins
    where both fill their waves (8192^3: 21 waves of 192 against 32 of 128); a shape whose
    wider tiles leave a partial last wave takes 128 (4096^3: 6 waves of 192 columns, 1152,
    against 8 of 128, 1024). Ties go to the wider tile."""
    if widest <= 128:
        return widest

    def cost(width: int) -> float:
        tiles = -(-m // tile_m) * -(-n // width)
        waves = -(-tiles // max(1, sms))
        return waves * width / (WIDE_TILE_GAIN if width == widest else 1.0)

    return widest if cost(widest) <= cost(128) else 128


def scale_kind(fmt: BlockFormat) -> str | None:
    """ "fp32" (no scale format: fp32 decode factors), "ue8m0", or None for other scales."""
    scale = fmt.scale.element
    if scale is None:
        return "fp32"
    return "ue8m0" if scale == UE8M0 else None


def block_text(fmt: BlockFormat) -> str:
    return f"{fmt.block[0]}x{fmt.block[1]}"


def pair_reason(a: BlockFormat | object, b: BlockFormat | object) -> str | None:
    """None when the generated block-scaled FP8 kernel serves the operand pair (A [M, K], B
    [N, K], both quantized along K), else why not: e4m3 / e5m2 elements on either side, fp32 or
    ue8m0 block scales (the same kind on both), A in 1xN and B in 1xN or NxN blocks for one N
    that the FP8 wgmma K (32) divides and that divides 128 or is a multiple of it."""
    if not (isinstance(a, BlockFormat) and isinstance(b, BlockFormat)):
        return "an operand is kept in high precision"
    for name, fmt in (("A", a), ("B", b)):
        if fmt.element not in ELEMENT_OF:
            return f"{name} has {fmt.element.name} elements (the FP8 kernel reads e4m3 and e5m2)"
        if scale_kind(fmt) is None:
            return (
                f"{name} has {fmt.scale.element.name} block scales (the FP8 kernel reads fp32 "
                "and ue8m0 scales)"
            )
    if scale_kind(a) != scale_kind(b):
        return "the operands' block scales differ in kind (fp32 and ue8m0)"
    n = a.block[1]
    if a.block[0] != 1:
        return f"A has {block_text(a)} blocks (the FP8 kernel takes 1xN for A)"
    if b.block not in ((1, n), (n, n)):
        return f"B has {block_text(b)} blocks (A's 1x{n} needs 1x{n} or {n}x{n})"
    return block_k_reason(n)


def pair_name(a: BlockFormat, b: BlockFormat) -> str:
    """A served pair as ``AUTO_MIN_M`` names it, e.g. "e4m3 1x128 x e4m3 128x128 fp32"."""
    return (
        f"{ELEMENT_OF[a.element]} {block_text(a)} x {ELEMENT_OF[b.element]} "
        f"{block_text(b)} {scale_kind(a)}"
    )


def kernel_out(out_dtype: str, accumulate: bool) -> str:
    """What the kernel writes for an output dtype ("bf16", "fp16", "fp32"): bf16 straight from
    the kernel for a bf16 output without accumulate, else fp32 (the shared epilogue rounds)."""
    return "bf16" if out_dtype == "bf16" and not accumulate else "fp32"


def kernel_fields(
    a: BlockFormat,
    b: BlockFormat,
    out: str,
    bias: bool,
    accumulate: bool,
    *,
    overlap: bool = OVERLAP,
    cluster_m: int = CLUSTER_M,
    mn_major_scales: bool = MN_MAJOR_SCALES,
    wide_stores: bool = WIDE_STORES,
    tile_n: int = TILE_N,
) -> dict[str, Any]:
    """The ``GemmSm90Fp8Params`` fields of a served pair (``pair_reason``) with the kernel
    writing ``out`` ("bf16" or "fp32": ``kernel_out``); ``overlap`` only where two K-blocks'
    stages fit. The runtime (``fp8_gemm.cute_plan``) and ``fp4gen compile`` both build their
    params from this, so they key the same kernels."""
    block_k = a.block[1]
    b_2d = b.block[0] != 1
    overlap = overlap and block_k <= 3 * MAX_TILE_K  # two blocks' stages fit
    if wide_tile_reason(tile_n, block_k, b_2d, overlap) is not None:
        tile_n = 128  # where the wider tile does not fit, the 128 one
    return {
        "a_element": ELEMENT_OF[a.element],
        "b_element": ELEMENT_OF[b.element],
        "scale_kind": scale_kind(a) or "fp32",
        "block_k": block_k,
        "b_2d": b_2d,
        "out": out,
        "bias": bias,
        "accumulate": accumulate,
        "tile_n": tile_n,
        "overlap": overlap,
        "cluster_m": cluster_m,
        "mn_major_scales": mn_major_scales,
        "wide_stores": wide_stores,
    }


def scaled_mm_reason(a: BlockFormat | object, b: BlockFormat | object) -> str | None:
    """None when torch's block-wise ``scaled_mm`` (cuBLASLt, sm_90a) serves the operand pair,
    else why not: e4m3 elements, fp32 block scales, A in 1x128 and B in 1x128 or 128x128."""
    if not (isinstance(a, BlockFormat) and isinstance(b, BlockFormat)):
        return "an operand is kept in high precision"
    for name, fmt in (("A", a), ("B", b)):
        if fmt.element not in ELEMENT_OF:
            return (
                f"{name} has {fmt.element.name} elements (the FP8 tensor cores read e4m3 and "
                "e5m2 with their fn and ieee conventions)"
            )
        if fmt.scale.element is not None:
            return (
                f"{name} has {fmt.scale.element.name} block scales (cuBLAS's 1x128 / 128x128 "
                "block scaling takes fp32 scales)"
            )
    if E5M2 in (a.element, b.element):
        # measured on the H100 (torch 2.11, CUDA 13): "Invalid scaling configuration" for an
        # e5m2 operand with 1x128 / 128x128 scales, e4m3 x e4m3 only
        return "an operand has e5m2 elements (torch's block-wise scaled_mm takes e4m3 only)"
    if a.block != (1, SCALED_MM_BLOCK):
        return f"A has {block_text(a)} blocks (scaled_mm takes 1x128 for A here)"
    if b.block not in ((1, SCALED_MM_BLOCK), (SCALED_MM_BLOCK, SCALED_MM_BLOCK)):
        return f"B has {block_text(b)} blocks (scaled_mm takes 1x128 or 128x128)"
    return None


def scaled_mm_name(a: BlockFormat, b: BlockFormat) -> str:
    """The scaled_mm recipe pair of a served pair, e.g. "BlockWise1x128 x BlockWise128x128"."""

    def one(fmt: BlockFormat) -> str:
        square = fmt.block == (SCALED_MM_BLOCK, SCALED_MM_BLOCK)
        return "BlockWise128x128" if square else "BlockWise1x128"

    return f"{one(a)} x {one(b)}"


def grouped_kernel_fields(
    a: BlockFormat,
    b: BlockFormat,
    out: str,
    bias: bool,
    *,
    overlap: bool = OVERLAP,
    wide_stores: bool = WIDE_STORES,
    tile_n: int = TILE_N,
) -> dict[str, Any]:
    """The ``GemmSm90Fp8Params`` fields of the M-grouped kernel (the experts' fprop and dgrad)
    for a served pair: the dense kernel's variant with one CTA per cluster and row-major scales
    (a group's first row may be any row), ``grouped=True``."""
    fields = kernel_fields(
        a,
        b,
        out,
        bias,
        False,
        overlap=overlap,
        cluster_m=1,
        mn_major_scales=False,
        wide_stores=wide_stores,
        tile_n=tile_n,
    )
    fields["grouped"] = True
    return fields


def k_grouped_kernel_fields(
    a: BlockFormat, b: BlockFormat, out: str, *, coalesced: bool = K_GROUPED_COALESCED
) -> dict[str, Any]:
    """The ``GemmSm90Fp8Params`` fields of the K-grouped kernel (the experts' wgrad) for a
    served pair writing ``out`` ("bf16" or "fp32"): the dense kernel's 128-wide tile with one
    partial accumulator and one CTA per cluster; ``coalesced``: MN-major scales and
    whole-sector stores (else row-major scales and the plain epilogue)."""
    fields = kernel_fields(
        a,
        b,
        out,
        False,
        False,
        overlap=False,
        cluster_m=1,
        mn_major_scales=coalesced,
        wide_stores=coalesced,
        tile_n=128,
    )
    fields["k_grouped"] = True
    return fields


def k_grouped_reason(a: BlockFormat, b: BlockFormat) -> str | None:
    """None where the K-grouped kernel takes the pair: what the dense kernel takes
    (``pair_reason``) with 1xN blocks on both sides (a group's K range is whole blocks of
    both), else why not."""
    reason = pair_reason(a, b)
    if reason is None and (a.block[0] != 1 or b.block[0] != 1):
        reason = f"blocks {a.block} x {b.block}: the K-grouped GEMM takes 1xN blocks on both sides"
    return reason


def module_source(params: Any) -> str:
    """The generated module of ``params`` (a ``GemmSm90Fp8Params``): its params and the
    ``KERNELS`` / ``compile_kernel`` protocol of fp4gen's generated modules; the kernel itself
    is ``fp4gen.kernels.gemm_sm90_fp8``'s class."""
    # k_grouped is bound only where set: the modules of the other kernels keep their text (and
    # so their cache keys and the manifests' hashes)
    bound = ", ".join(
        f"{f.name}={getattr(params, f.name)!r}"
        for f in fields(params)
        if f.name != "k_grouped" or getattr(params, f.name)
    )
    # the grouped variants: their own modules (the launch takes the groups' offsets)
    module, compile_fn = "gemm_sm90_fp8", "compile_fp8_gemm"
    if getattr(params, "grouped", False):
        module, compile_fn = "gemm_sm90_fp8_grouped", "compile_grouped_fp8_gemm"
    if getattr(params, "k_grouped", False):
        module, compile_fn = "gemm_sm90_fp8_kgrouped", "compile_k_grouped_fp8_gemm"
    return (
        f'"""The block-scaled FP8 GEMM {params.name} for sm_90a (generated by fp4gen:\n'
        'fp4gen.codegen.gemm_fp8.module_source)."""\n\n'
        f"from fp4gen.kernels.{module} import GemmSm90Fp8Params, {compile_fn}\n\n"
        f"PARAMS = GemmSm90Fp8Params({bound})\n"
        'KERNELS = ("gemm",)\n\n\n'
        "def compile_kernel(name: str, arch: str, *, dump_dir: str | None = None):\n"
        f'    """The TVM-FFI compiled kernel (``{compile_fn}``)."""\n'
        "    if name not in KERNELS:\n"
        '        raise ValueError(f"no kernel {name!r}; kernels: {KERNELS}")\n'
        f"    return {compile_fn}(PARAMS, arch, dump_dir=dump_dir)\n"
    )


__all__ = [
    "AUTO_MIN_M",
    "grouped_kernel_fields",
    "K_GROUPED_COALESCED",
    "k_grouped_kernel_fields",
    "k_grouped_reason",
    "CLUSTER_M",
    "E4M3",
    "E5M2",
    "ELEMENT_NAMES",
    "ELEMENT_OF",
    "MAX_TILE_K",
    "MN_MAJOR_ALIGN",
    "MN_MAJOR_SCALES",
    "OUT_NAMES",
    "OVERLAP",
    "SCALED_MM_BLOCK",
    "SCALE_KINDS",
    "TILE_BY_SHAPE",
    "TILE_N",
    "WIDE_TILE_GAIN",
    "WGMMA_K",
    "WIDE_STORES",
    "block_k_reason",
    "block_text",
    "kernel_out",
    "kernel_fields",
    "module_source",
    "pair_name",
    "pair_reason",
    "scale_kind",
    "scaled_mm_name",
    "scaled_mm_reason",
    "tile_n_for",
    "wide_tile_reason",
]
