"""The ``blackwell`` backend of ``fp4gen.gemm``: block-scaled tcgen05 MMA on sm_100a.

The tensor cores of Blackwell multiply block-scaled operands natively: ``tcgen05.mma`` with
``.kind::mxf4nvf4`` (e2m1 x e2m1, 16 or 32 values per scale) or ``.kind::mxf8f6f4`` (e2m1, e2m3,
e3m2, e4m3, e5m2, 32 values per ue8m0 scale) reads the codes from shared memory, the scale
factors from tensor memory, and accumulates in fp32. The kernel is NVIDIA's persistent
block-scaled GEMM from nvidia-cutlass-operators (``fp4gen.runtime.blackwell_kernel`` wraps it
with the epilogue alpha); fp4gen supplies the glue:

* ``mma_plan(a, b)``: which MMA kind serves a pair of operand formats, or why none does
  (``fp4gen.gemm`` then dequantizes). 2D weight tiles (16x16, 32x32) are served: a tile's scale
  applies to each of its rows, so it is a 1x16 / 1x32 scale repeated along M or N.
* Operands in the layouts the kernel reads: codes packed along K (``packed_codes``), scale codes
  in the 128x4 tensor-core layout (``QuantizedTensor.swizzled_scales``, the layout the kernel's
  ``tile_atom_to_shape_SF`` describes; docs/gemm-sm100.md), alpha = S_a * S_b on the device.
* ``GemmConfig``: the compile unit (element / scale types, output dtype, tile, cluster and the
  persistent grid size), rendered into a small generated module so that it compiles and caches
  like every fp4gen kernel (``fp4gen.compiler.jit.build_kernel``: a later process loads the
  shared library).
* ``native_gemm``: C = S_a S_b (A @ B^T) (+ bias) (+ accumulate), the same result as the other
  paths up to the fp32 summation order (docs/numerics.md section 6).

Nothing here has run on a Blackwell GPU yet: the kernels are cross-compiled and their PTX is
checked (tests/test_gemm_sm100.py), the layouts are checked bit for bit on the CPU.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from dataclasses import dataclass
from math import gcd
from pathlib import Path
from typing import Any, Literal

import torch

from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat, ElementFormat
from fp4gen.numerics.quantize import tensor_version
from fp4gen.runtime.loader import BUILD_FAILED, KernelLoader, Reasons, Unsupported
from fp4gen.vocab import Arch

NATIVE_ARCHS: tuple[str, ...] = (Arch.SM100A.value,)  # tcgen05 block-scaled MMA (B200, GB200)
DEFAULT_SM_COUNT = 148  # B200: sizes the persistent grid when compiling without a GPU
OPERATORS_PACKAGE = "nvidia-cutlass-operators"

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
_TORCH_OUT: dict[str, torch.dtype] = {"Float32": torch.float32, "BFloat16": torch.bfloat16}

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
# Operand layouts
# ----------------------------------------------------------------------------------------------
# QuantizedTensor -> (version of its codes, bytes): a weight is converted once, not per GEMM
_packed: weakref.WeakKeyDictionary[Any, tuple[int, torch.Tensor]] = weakref.WeakKeyDictionary()
_scales: weakref.WeakKeyDictionary[Any, tuple[Any, torch.Tensor]] = weakref.WeakKeyDictionary()


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [R, K] (one per byte) -> the K-major bytes the MMA's TMA reads: a
    little-endian bit stream per row (element j in bits [j * bits, (j + 1) * bits)), as
    ``fp4gen.numerics.layout.pack`` defines it; two e2m1 codes per byte (element 0 in the low
    nibble, torch's float4_e2m1fn_x2), four 6-bit codes per three bytes, 8-bit codes as they
    are. K must fill whole bytes (the kernel needs far more: ``MmaPlan.k_multiple``)."""
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise TensorError(f"codes must be uint8 [R, K], got {codes.dtype} {tuple(codes.shape)}")
    rows, k = codes.shape
    if bits == 8:
        return codes.contiguous()
    if bits == 4 and k % 2 == 0:
        return (codes[:, 0::2] & 0xF) | (codes[:, 1::2] << 4)
    if bits == 6 and k % 4 == 0:
        c = codes.reshape(rows, k // 4, 4) & 0x3F
        b0 = c[..., 0] | (c[..., 1] << 6)
        b1 = (c[..., 1] >> 2) | (c[..., 2] << 4)
        b2 = (c[..., 2] >> 4) | (c[..., 3] << 2)
        return torch.stack((b0, b1, b2), dim=-1).reshape(rows, k // 4 * 3)
    raise TensorError(f"cannot pack {k} codes of {bits} bits per row into whole bytes")


def _aligned(t: torch.Tensor, align: int) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % align == 0 else t.clone()


def packed_codes(q: Any, bits: int) -> torch.Tensor:
    """``pack_codes(q.codes, bits)``, 16-byte aligned, remembered per QuantizedTensor until its
    codes change (a weight reused across GEMMs is packed once). A quantize kernel's own packed
    codes (``layout.pack``'s order, the same bytes) are used as they are."""
    own = q.packed_codes()
    if own is not None and own.bits == bits and (own.cols * bits) % 8 == 0:
        return _aligned(own.data, 16)
    hit = _packed.get(q)
    version = tensor_version(q.codes)
    if hit is not None and hit[0] == version:
        return hit[1]
    packed = _aligned(pack_codes(q.codes, bits), 16)
    _packed[q] = (version, packed)
    return packed


def scale_buffer(q: Any) -> torch.Tensor:
    """The scale codes in the 128x4 tensor-core layout (one scale per row and K block, 2D tile
    scales repeated over the tile's rows), 32-byte aligned, remembered like ``packed_codes``."""
    hit = _scales.get(q)
    version = q.code_version()
    if hit is not None and hit[0] == version:
        return hit[1]
    buf = _aligned(q.swizzled_scales(), 32)
    _scales[q] = (version, buf)
    return buf


# ----------------------------------------------------------------------------------------------
# Compile, cache, load
# ----------------------------------------------------------------------------------------------
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

_loaded: dict[tuple[GemmConfig, str, str], Any] = {}
_lock = threading.Lock()
# (config, arch) -> the loaded function or why it cannot be built (remembered, not retried)
_loader: KernelLoader[GemmConfig, Any] = KernelLoader(
    Reasons(
        dsl=f"{OPERATORS_PACKAGE} or the CuTe DSL cannot be imported ({{err}})",
        build=BUILD_FAILED,
    )
)


def operators_version() -> str:
    from importlib import metadata

    try:
        return metadata.version(OPERATORS_PACKAGE)
    except metadata.PackageNotFoundError:
        return "absent"


def render_module(config: GemmConfig) -> str:
    """The generated module of ``config``. Its text names the package version and a digest of
    the wrapper's source, so the kernel cache key changes with either."""
    wrapper = Path(__file__).with_name("blackwell_kernel.py").read_bytes()
    return _MODULE.format(
        name=config.name,
        package=OPERATORS_PACKAGE,
        version=operators_version(),
        digest=hashlib.sha256(wrapper).hexdigest()[:16],
        config=config,
    )


def gemm_kernel(config: GemmConfig, arch: str, *, cache: Any = None) -> Any:
    """The loaded TVM-FFI function of ``config`` for ``arch``: compiled on first use (about
    1 s, no GPU needed) and kept in the kernel cache; later processes load it."""
    from fp4gen.compiler import jit
    from fp4gen.compiler.cache import KernelCache, default_root

    root = str(cache.root) if cache is not None else str(default_root())
    memo = (config, arch, root)
    fn = _loaded.get(memo)
    if fn is not None:
        return fn
    with _lock:
        fn = _loaded.get(memo)
        if fn is None:
            cache = cache or KernelCache(root)
            jit.use_cache_for_dsl(cache)
            path = cache.store_source(render_module(config))
            fn = jit.load_entry(jit.build_kernel(cache, path, "gemm", arch).entry)
            _loaded[memo] = fn
    return fn


def _kernel_or_reason(config: GemmConfig, arch: str) -> Any:
    """gemm_kernel(config, arch), or why it cannot be had (an Unsupported, remembered)."""
    return _loader.get(config, arch, gemm_kernel)


_sm_counts: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _sm_counts.get(index)
    if count is None:
        count = _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


# ----------------------------------------------------------------------------------------------
# The GEMM
# ----------------------------------------------------------------------------------------------
def kernel_args(a: Any, b: Any, plan: MmaPlan, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The compiled function's arguments: A and B codes (uint8 [rows, K * bits / 8]), their scale
    buffers (uint8, 128x4 layout), C (``out``, [M, N] row-major) and alpha = S_a * S_b (fp32
    [1]) on ``out``'s device."""
    dev = out.device
    alpha = a.global_scale.to(dev, torch.float32) * b.global_scale.to(dev, torch.float32)
    return (
        packed_codes(a, plan.a_bits),
        packed_codes(b, plan.b_bits),
        scale_buffer(a),
        scale_buffer(b),
        out,
        alpha.reshape(1),
    )


def native_gemm(
    a: Any,
    b: Any,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    accumulate: torch.Tensor | None,
    arch: str,
    tile: str | None = None,
) -> torch.Tensor:
    """C = S_a S_b (A_q @ B_q^T) (+ bias) (+ accumulate) on the tensor cores of sm_100a.

    ``a``, ``b``: QuantizedTensors [M, K] and [N, K] on one CUDA device, quantized along K with
    the same RHT (or none). The kernel writes fp32 acc * alpha; bias and accumulate are added in
    fp32 after it (the order of gemm_reference), then one rounding to ``out_dtype``. bf16 comes
    straight from the kernel only when nothing is added and neither format has a global scale
    (alpha is 1): the package's epilogue converts to the output type before our multiply, so a
    bf16 kernel would round twice. Raises FP4GenError when no MMA serves the pair, the shape or
    the arch, TensorError for operands that do not fit together.
    """
    if a.cols != b.cols:
        raise TensorError(f"K mismatch: a is [{a.rows}, {a.cols}] and b is [{b.rows}, {b.cols}]")
    if a.rht != b.rht:
        raise TensorError("the operands carry different Hadamard transforms")
    if arch not in NATIVE_ARCHS:
        raise FP4GenError(
            f"no block-scaled tcgen05 MMA on {arch} (the native GEMM targets {NATIVE_ARCHS})"
        )
    plan = mma_plan(a.format, b.format)
    if isinstance(plan, str):
        raise FP4GenError(f"no native MMA for {a.format.name} x {b.format.name}: {plan}")
    m, n, k = a.rows, b.rows, a.cols
    reason = shape_reason(plan, m, n, k)
    if reason is not None:
        raise FP4GenError(f"the native GEMM cannot take {m} x {n} x {k}: {reason}")
    if a.device != b.device or a.device.type != "cuda":
        raise TensorError(
            f"the blackwell GEMM needs both operands on one CUDA device: {a.device}, {b.device}"
        )
    dev = a.device
    if bias is not None and tuple(bias.shape) != (n,):
        raise TensorError(f"bias must have shape [{n}], got {tuple(bias.shape)}")
    if accumulate is not None and tuple(accumulate.shape) != (m, n):
        raise TensorError(f"accumulate has shape {tuple(accumulate.shape)}, the product {(m, n)}")
    direct_bf16 = (
        out_dtype == torch.bfloat16
        and bias is None
        and accumulate is None
        and not (a.format.global_scale or b.format.global_scale)
        and n % 8 == 0
    )
    kernel_dtype: OutDType = "BFloat16" if direct_bf16 else "Float32"
    config = gemm_config(plan, m, out_dtype=kernel_dtype, tile=tile, sm_count=_sm_count(dev))
    fn = _kernel_or_reason(config, arch)
    if isinstance(fn, Unsupported):
        raise FP4GenError(f"the native GEMM kernel is not available: {fn.reason}")
    out = torch.empty((m, n), dtype=_TORCH_OUT[kernel_dtype], device=dev)
    fn(*kernel_args(a, b, plan, out))
    if bias is not None:
        out += bias.to(device=dev, dtype=torch.float32)
    if accumulate is not None:
        out = accumulate.to(device=dev, dtype=torch.float32) + out
    return out if out.dtype == out_dtype else out.to(out_dtype)


__all__ = [
    "DEFAULT_SM_COUNT",
    "NATIVE_ARCHS",
    "TILES",
    "GemmConfig",
    "MmaPlan",
    "gemm_config",
    "gemm_kernel",
    "kernel_args",
    "mma_plan",
    "native_gemm",
    "pack_codes",
    "packed_codes",
    "pick_tile",
    "render_module",
    "scale_buffer",
    "shape_reason",
]
