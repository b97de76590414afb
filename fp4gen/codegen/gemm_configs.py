"""The GEMM choices that depend only on formats and sizes, shared by the compiler and the backends.

``fp4gen.compiler.aot`` enumerates from the recipe alone what ``fp4gen.gemm``'s dispatch will
pick at run time, and ``fp4gen.compiler.jit`` renders the sm_100a GEMM's module; both read the
choices here, so that neither imports a backend (docs/architecture.md). Nothing here imports
torch, Jinja or the CuTe DSL.

* sm_90a (``fp4gen.runtime.cute_gemm``): the arch of the fused GEMM and the largest M the
  dispatch sends to it (the spec and tile of the fused kernel are ``fp4gen.codegen.gemm``'s).
* sm_100a (``fp4gen.runtime.blackwell_gemm``, docs/gemm-sm100.md): which block-scaled tcgen05
  MMA serves a pair of formats (``mma_plan``) and which shapes it takes (``shape_reason``); the
  compile unit (``GemmConfig``, ``gemm_config``, the tile for M) and its generated module
  (``render_module``; ``render_grouped_module``: the same compile unit over a batch of groups,
  the Mixture-of-Experts GEMMs of ``fp4gen.runtime.blackwell_grouped``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from math import gcd
from pathlib import Path
from typing import Literal

from fp4gen.formats import BlockFormat, ElementFormat
from fp4gen.vocab import Arch

FUSED_ARCHS: tuple[str, ...] = (Arch.SM90A.value,)  # wgmma / mma.sync + TMA
# sm_90a: the fused kernel up to this M, dequantize kernels + cuBLAS above (docs/gemm-sm90.md)
FUSED_MAX_M = 64

NATIVE_ARCHS: tuple[str, ...] = (Arch.SM100A.value,)  # tcgen05 block-scaled MMA (B200, GB200)
DEFAULT_SM_COUNT = 148  # B200: sizes the persistent grid when compiling without a GPU
OPERATORS_PACKAGE = "nvidia-cutlass-operators"
# The wrapper the generated module calls (fp4gen.runtime.blackwell_kernel): read, not imported,
# for the digest that puts its source into the kernel's cache key
_WRAPPER = Path(__file__).parent.parent / "runtime" / "blackwell_kernel.py"

# fp4gen element format (exponent bits, mantissa bits, special) -> the MMA's element type
_ELEMENTS: dict[tuple[int, int, str], tuple[str, int]] = {
    (2, 1, "finite"): ("Float4E2M1FN", 4),
    (2, 3, "finite"): ("Float6E2M3FN", 6),
    (3, 2, "finite"): ("Float6E3M2FN", 6),
    (4, 3, "fn"): ("Float8E4M3FN", 8),
    (5, 2, "ieee"): ("Float8E5M2", 8),
}
_SCALES: dict[tuple[int, int, bool, str], tuple[str, str]] = {
    (4, 3, True, "fn"): ("Float8E4M3FN", "ue4m3"),  # the scales are never negative
    (8, 0, False, "finite"): ("Float8E8M0FNU", "ue8m0"),
}
_HW_ELEMENTS = "e2m1, e2m3, e3m2, e4m3 and e5m2"

OutDType = Literal["Float32", "BFloat16"]


# ----------------------------------------------------------------------------------------------
# Which MMA serves a pair of formats
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MmaPlan:
    """The block-scaled MMA of an operand pair (A [M, K] times B [N, K]^T)."""

    kind: Literal["mxf4nvf4", "mxf8f6f4"]
    a_dtype: str  # the MMA's element types (CuTe DSL names)
    b_dtype: str
    a_bits: int
    b_bits: int
    sf_dtype: str  # Float8E4M3FN (read as ue4m3) or Float8E8M0FNU
    scale: Literal["ue4m3", "ue8m0"]
    sf_vec: Literal[16, 32]  # values per scale along K

    @property
    def unpacked(self) -> bool:
        """Sub-byte codes that TMA unpacks to one byte each (mixed widths, any 6-bit operand)."""
        return self.a_bits != self.b_bits or 6 in (self.a_bits, self.b_bits)

    @property
    def k_multiple(self) -> int:
        """K must be a multiple of this: 16-byte rows for TMA (128 bits per row step), and 128
        values for the unpacking TMA."""
        step = max(128 // gcd(bits, 128) for bits in (self.a_bits, self.b_bits))
        return max(step, 128) if self.unpacked else step

    def describe(self) -> str:
        block = f"block{self.sf_vec}"
        return f"tcgen05.mma kind::{self.kind}.block_scale.{block}, {self.scale} scales"


def _element(fmt: ElementFormat) -> tuple[str, int] | None:
    if not fmt.signed:
        return None
    return _ELEMENTS.get((fmt.exp_bits, fmt.man_bits, fmt.special))


def mma_plan(a: BlockFormat | object, b: BlockFormat | object) -> MmaPlan | str:
    """The MMA for A in format ``a`` times B^T in format ``b`` (both quantized along K), or why
    the tensor cores cannot multiply them (the rules of the tcgen05 block-scaled MMA as the
    package's kernel implements them, nvidia-cutlass-operators 0.3)."""
    if not (isinstance(a, BlockFormat) and isinstance(b, BlockFormat)):
        return "an operand is not block-scaled (high precision or a MoR mix)"
    types = []
    for side, fmt in (("A", a), ("B", b)):
        element = _element(fmt.element)
        if element is None:
            return (
                f"{side} has {fmt.element.name} elements; the block-scaled MMA reads {_HW_ELEMENTS}"
            )
        scale = fmt.scale.element
        if scale is None:
            return f"{side} has fp32 block scales; the MMA reads e4m3 (as ue4m3) or ue8m0 scales"
        key = (scale.exp_bits, scale.man_bits, scale.signed, scale.special)
        if key not in _SCALES:
            return f"{side} has {scale.name} block scales; the MMA reads e4m3 or ue8m0 scales"
        if fmt.block_len not in (16, 32):
            return (
                f"{side} has {fmt.block[0]}x{fmt.block[1]} blocks; the MMA scales 16 or 32 "
                "values along K"
            )
        types.append((element, _SCALES[key], fmt.block_len))
    (a_el, a_sf, a_vec), (b_el, b_sf, b_vec) = types
    if a_sf != b_sf:
        return f"different scale formats ({a.scale.name} and {b.scale.name}): the MMA takes one"
    if a_vec != b_vec:
        return f"different block lengths along K ({a_vec} and {b_vec})"
    fp4 = a_el[1] == 4 and b_el[1] == 4
    if a_vec == 16 and not fp4:
        return "16-value blocks are an e2m1 x e2m1 MMA (kind::mxf4nvf4); use 1x32 blocks"
    if a_vec == 32 and a_sf[1] != "ue8m0":
        return f"32-value blocks need ue8m0 scales, not {a.scale.name}"
    if 6 in (a_el[1], b_el[1]) and {a_el[0], b_el[0]} - {"Float6E2M3FN", "Float6E3M2FN"} != {
        "Float8E4M3FN"
    }:
        return (
            "6-bit operands pair with e4m3 only in nvidia-cutlass-operators' kernel "
            f"(got {a.element.name} x {b.element.name})"
        )
    return MmaPlan(
        kind="mxf4nvf4" if fp4 else "mxf8f6f4",
        a_dtype=a_el[0],
        b_dtype=b_el[0],
        a_bits=a_el[1],
        b_bits=b_el[1],
        sf_dtype=a_sf[0],
        scale=a_sf[1],  # type: ignore[arg-type]
        sf_vec=a_vec,  # type: ignore[arg-type]
    )


def shape_reason(plan: MmaPlan, m: int, n: int, k: int) -> str | None:
    """None when the kernel takes A [m, k] x B [n, k]^T, else why not."""
    if min(m, n, k) < 1:
        return f"empty GEMM ({m} x {n} x {k})"
    if k % plan.k_multiple:
        why = "the unpacking TMA" if plan.unpacked else "16-byte TMA rows"
        return f"K = {k} is not a multiple of {plan.k_multiple} ({why})"
    if n % 4:
        return f"N = {n} is not a multiple of 4 (16-byte rows of the fp32 output)"
    if max(m * n, m * k, n * k) >= 2**31:
        return "the kernel's shapes and strides are 32-bit (M * N, M * K, N * K < 2^31)"
    return None


# ----------------------------------------------------------------------------------------------
# The compile unit
# ----------------------------------------------------------------------------------------------
# name -> (MMA tile M x N, cluster M x N); tile M 256 is the 2-CTA MMA.
TILES: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "m128n64c1x1": ((128, 64), (1, 1)),
    "m256n128c2x1": ((256, 128), (2, 1)),
}


def pick_tile(m: int) -> str:
    """Small M: 128 x 64 tiles (more CTAs along N); larger M: the 2-CTA 256 x 128 tile with a 2x1
    cluster (the package example's default). Not tuned: no Blackwell GPU measured it."""
    return "m128n64c1x1" if m <= 128 else "m256n128c2x1"


@dataclass(frozen=True)
class GemmConfig:
    """Everything that changes the compiled kernel; M, N and K stay dynamic."""

    a_dtype: str
    b_dtype: str
    a_bits: int
    sf_dtype: str
    sf_vec: int
    out_dtype: OutDType
    tile_mn: tuple[int, int]
    cluster_mn: tuple[int, int]
    max_active_clusters: int  # the persistent grid (compile-time in the package's kernel)

    @property
    def name(self) -> str:
        (tm, tn), (cm, cn) = self.tile_mn, self.cluster_mn
        return (
            f"sm100_{self.a_dtype}_x_{self.b_dtype}_{self.sf_dtype}v{self.sf_vec}_"
            f"{self.out_dtype}_m{tm}n{tn}c{cm}x{cn}_g{self.max_active_clusters}"
        )


def gemm_config(
    plan: MmaPlan,
    m: int,
    *,
    out_dtype: OutDType = "Float32",
    tile: str | None = None,
    sm_count: int = DEFAULT_SM_COUNT,
) -> GemmConfig:
    """The config for A [m, K] with this plan; the grid is one cluster per ``cluster size`` SMs
    (one CTA per SM: the package's kernel uses all of shared memory)."""
    tile_mn, cluster_mn = TILES[tile or pick_tile(m)]
    return GemmConfig(
        a_dtype=plan.a_dtype,
        b_dtype=plan.b_dtype,
        a_bits=plan.a_bits,
        sf_dtype=plan.sf_dtype,
        sf_vec=plan.sf_vec,
        out_dtype=out_dtype,
        tile_mn=tile_mn,
        cluster_mn=cluster_mn,
        max_active_clusters=max(1, sm_count // (cluster_mn[0] * cluster_mn[1])),
    )


# ----------------------------------------------------------------------------------------------
# The generated module
# ----------------------------------------------------------------------------------------------
# The backend loads it (fp4gen.runtime.blackwell_gemm.gemm_kernel), so it imports GemmConfig by
# the backend's name for it (the same class); the text is part of the kernel's cache key.
_MODULE = '''"""Native Blackwell block-scaled GEMM, generated by fp4gen (do not edit).

{name}: tcgen05 block-scaled MMA through {package} {version}
(PersistentDenseBlockScaledGemmKernel) with fp4gen's epilogue alpha
(fp4gen.runtime.blackwell_kernel, source digest {digest}).
"""

from fp4gen.runtime.blackwell_gemm import GemmConfig

CONFIG = {config!r}
KERNELS = ("gemm",)


def compile_kernel(name, arch, *, dump_dir=None):
    """The TVM-FFI compiled GEMM of CONFIG for ``arch`` (no GPU needed)."""
    if name not in KERNELS:
        raise ValueError(f"{{CONFIG.name}} has no kernel {{name!r}}; kernels: {{KERNELS}}")
    from fp4gen.runtime.blackwell_kernel import compile_gemm

    return compile_gemm(CONFIG, arch, dump_dir=dump_dir)
'''


# The grouped (Mixture-of-Experts) GEMM's module: the same compile unit over a batch of groups
# (fp4gen.runtime.blackwell_grouped_kernel, whose source digest it names)
_GROUPED_WRAPPER = _WRAPPER.parent / "blackwell_grouped_kernel.py"
GROUPED_KERNEL = "grouped_gemm"
_GROUPED_MODULE = '''"""Grouped native Blackwell GEMM, generated by fp4gen (do not edit).

{name}: tcgen05 block-scaled MMA through {package} {version}
(PersistentDenseBlockScaledGemmKernel over L = groups) with fp4gen's epilogue alpha
(fp4gen.runtime.blackwell_kernel, source digest {digest};
fp4gen.runtime.blackwell_grouped_kernel, source digest {grouped_digest}).
"""

from fp4gen.runtime.blackwell_gemm import GemmConfig

CONFIG = {config!r}
KERNELS = ("{kernel}",)


def compile_kernel(name, arch, *, dump_dir=None):
    """The TVM-FFI compiled grouped GEMM of CONFIG for ``arch`` (no GPU needed)."""
    if name not in KERNELS:
        raise ValueError(f"{{CONFIG.name}} has no kernel {{name!r}}; kernels: {{KERNELS}}")
    from fp4gen.runtime.blackwell_grouped_kernel import compile_grouped_gemm

    return compile_grouped_gemm(CONFIG, arch, dump_dir=dump_dir)
'''


def operators_version() -> str:
    """The installed nvidia-cutlass-operators version (the generated module names it), or
    "absent"."""
    from importlib import metadata

    try:
        return metadata.version(OPERATORS_PACKAGE)
    except metadata.PackageNotFoundError:
        return "absent"


def render_module(config: GemmConfig) -> str:
    """The generated module of ``config``. Its text names the package version and a digest of
    the wrapper's source, so the kernel cache key changes with either."""
    wrapper = _WRAPPER.read_bytes()
    return _MODULE.format(
        name=config.name,
        package=OPERATORS_PACKAGE,
        version=operators_version(),
        digest=hashlib.sha256(wrapper).hexdigest()[:16],
        config=config,
    )


def render_grouped_module(config: GemmConfig) -> str:
    """The generated module of the grouped GEMM of ``config`` (every group's GEMM in one launch,
    docs/gemm-sm100.md "Grouped"); like ``render_module`` its text names the package version
    and the digests of both wrappers, so the cache key changes with any of them."""
    return _GROUPED_MODULE.format(
        name=config.name,
        package=OPERATORS_PACKAGE,
        version=operators_version(),
        digest=hashlib.sha256(_WRAPPER.read_bytes()).hexdigest()[:16],
        grouped_digest=hashlib.sha256(_GROUPED_WRAPPER.read_bytes()).hexdigest()[:16],
        config=config,
        kernel=GROUPED_KERNEL,
    )


__all__ = [
    "DEFAULT_SM_COUNT",
    "FUSED_ARCHS",
    "FUSED_MAX_M",
    "GROUPED_KERNEL",
    "NATIVE_ARCHS",
    "OPERATORS_PACKAGE",
    "TILES",
    "GemmConfig",
    "MmaPlan",
    "OutDType",
    "gemm_config",
    "mma_plan",
    "operators_version",
    "pick_tile",
    "render_grouped_module",
    "render_module",
    "shape_reason",
]
