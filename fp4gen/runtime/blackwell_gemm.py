"""The ``blackwell`` backend of ``fp4gen.gemm``: block-scaled tcgen05 MMA on sm_100a.

The tensor cores of Blackwell multiply block-scaled operands natively: ``tcgen05.mma`` with
``.kind::mxf4nvf4`` (e2m1 x e2m1, 16 or 32 values per scale) or ``.kind::mxf8f6f4`` (e2m1, e2m3,
e3m2, e4m3, e5m2, 32 values per ue8m0 scale) reads the codes from shared memory, the scale
factors from tensor memory, and accumulates in fp32. The kernel is NVIDIA's persistent
block-scaled GEMM from nvidia-cutlass-operators (``fp4gen.runtime.blackwell_kernel`` wraps it
with the epilogue alpha); fp4gen supplies the glue:

* ``mma_plan(a, b)`` (``fp4gen.codegen.gemm_configs``): which MMA kind serves a pair of
  operand formats, or why none does (``fp4gen.gemm`` then dequantizes). 2D weight tiles
  (16x16, 32x32) are served: a tile's scale applies to each of its rows, so it is a 1x16 /
  1x32 scale repeated along M or N.
* Operands in the layouts the kernel reads: codes packed along K (``packed_codes``), scale codes
  in the 128x4 tensor-core layout (``QuantizedTensor.swizzled_scales``, the layout the kernel's
  ``tile_atom_to_shape_SF`` describes; docs/gemm-sm100.md), alpha = S_a * S_b on the device.
* ``GemmConfig`` (``fp4gen.codegen.gemm_configs``): the compile unit (element / scale types,
  output dtype, tile, cluster and the persistent grid size), rendered into a small generated
  module so that it compiles and caches like every fp4gen kernel
  (``fp4gen.compiler.jit.build_kernel``: a later process loads the shared library).
* ``native_product``: S_a S_b (A @ B^T) as the kernel writes it, which ``fp4gen.gemm`` finishes
  with the shared epilogue (bias, accumulate, the output dtype); ``native_gemm``: the two
  together, C = S_a S_b (A @ B^T) (+ bias) (+ accumulate), the same result as the other paths
  up to the fp32 summation order (docs/numerics.md section 6).

Nothing here has run on a Blackwell GPU yet: the kernels are cross-compiled and their PTX is
checked (tests/test_gemm_sm100.py), the layouts are checked bit for bit on the CPU.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

# The MMA choice, the compile unit and its generated module depend only on formats and sizes:
# they live in the kernels layer, where the compiler reads them too. GemmConfig is also
# imported from here by fp4gen.runtime.blackwell_kernel and by every generated module.
from fp4gen.codegen.gemm_configs import (
    NATIVE_ARCHS,
    OPERATORS_PACKAGE,
    GemmConfig,
    MmaPlan,
    OutDType,
    gemm_config,
    mma_plan,
    render_module,
    shape_reason,
)
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.numerics.quantize import tensor_version
from fp4gen.runtime.checks import check_accumulate, check_bias, check_pair, one_cuda_device
from fp4gen.runtime.epilogue import GemmProduct, finish
from fp4gen.runtime.loader import BUILD_FAILED, KernelLoader, Reasons, Unsupported

_TORCH_OUT: dict[str, torch.dtype] = {"Float32": torch.float32, "BFloat16": torch.bfloat16}


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
_loaded: dict[tuple[GemmConfig, str, str], Any] = {}
_lock = threading.Lock()
# (config, arch) -> the loaded function or why it cannot be built (remembered, not retried)
_loader: KernelLoader[GemmConfig, Any] = KernelLoader(
    Reasons(
        dsl=f"{OPERATORS_PACKAGE} or the CuTe DSL cannot be imported ({{err}})",
        build=BUILD_FAILED,
    )
)


def gemm_kernel(config: GemmConfig, arch: str, *, cache: Any = None) -> Any:
    """The loaded TVM-FFI function of ``config`` for ``arch``: compiled on first use (about
    1 s, no GPU needed) and kept in the kernel cache; later processes load it."""
    return load_rendered(_loaded, _lock, config, arch, cache, render_module, "gemm")


def load_rendered(
    loaded: dict[tuple[GemmConfig, str, str], Any],
    lock: threading.Lock,
    config: GemmConfig,
    arch: str,
    cache: Any,
    render: Callable[[GemmConfig], str],
    entry: str,
) -> Any:
    """The loaded function ``entry`` of the module ``render(config)`` for ``arch``, kept in
    ``loaded`` per (config, arch, cache root): built into the kernel cache on first use (or
    loaded from it), once per process under ``lock``."""
    from fp4gen.compiler import jit
    from fp4gen.compiler.cache import KernelCache, default_root

    root = str(cache.root) if cache is not None else str(default_root())
    memo = (config, arch, root)
    fn = loaded.get(memo)
    if fn is not None:
        return fn
    with lock:
        fn = loaded.get(memo)
        if fn is None:
            cache = cache or KernelCache(root)
            jit.use_cache_for_dsl(cache)
            path = cache.store_source(render(config))
            fn = jit.load_entry(jit.build_kernel(cache, path, entry, arch).entry)
            loaded[memo] = fn
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
    """C = S_a S_b (A_q @ B_q^T) (+ bias) (+ accumulate) on the tensor cores of sm_100a:
    ``native_product`` finished by the shared epilogue (``fp4gen.gemm`` runs the same two)."""
    product = native_product(
        a, b, out_dtype=out_dtype, bias=bias, accumulate=accumulate, arch=arch, tile=tile
    )
    return finish(
        product, a, b, bias=bias, accumulate=accumulate, out_dtype=out_dtype, backend="blackwell"
    )


def native_product(
    a: Any,
    b: Any,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    accumulate: torch.Tensor | None,
    arch: str,
    tile: str | None = None,
) -> GemmProduct:
    """S_a S_b (A_q @ B_q^T) on the tensor cores of sm_100a, as a GemmProduct: the kernel
    applies alpha = S_a S_b and writes fp32; bias and accumulate are the shared epilogue's (in
    fp32 after it, the order of gemm_reference), then one rounding to ``out_dtype``.

    ``a``, ``b``: QuantizedTensors [M, K] and [N, K] on one CUDA device, quantized along K with
    the same RHT (or none). bf16 comes straight from the kernel only when nothing is added and
    neither format has a global scale (alpha is 1): the package's epilogue converts to the
    output type before our multiply, so a bf16 kernel would round twice. Raises FP4GenError
    when no MMA serves the pair, the shape or the arch, TensorError for operands that do not fit
    together.
    """
    check_pair(a, b)
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
    dev = one_cuda_device(a, b, "blackwell GEMM")
    check_bias(bias, n)
    check_accumulate(accumulate, m, n)
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
    return GemmProduct(out, scaled=True)


__all__ = [
    "GemmConfig",
    "gemm_kernel",
    "load_rendered",
    "kernel_args",
    "native_gemm",
    "native_product",
    "pack_codes",
    "packed_codes",
    "scale_buffer",
]
