"""The ``cute`` backend of ``fp4gen.gemm``: the generated fused dequantizing GEMM (Hopper, sm_90a).

``fused_gemm(a, b, ...)`` picks the GemmKernelSpec of the operand pair (formats, block shapes,
output dtype, bias, accumulate, the tile for M), loads its kernel through ``kernels_for`` (the
kernel cache: the first use compiles, later processes load the shared library) and launches it
on the codes and scale codes of the two QuantizedTensors. Numerics: docs/numerics.md section 6
(the products are exact, only the fp32 summation order differs from the reference).

The per-call path is kept short (docs/gemm-sm90.md, "Host overhead"): everything that depends
only on the formats, the tile and the flags is decided once (``_Plan``: the spec, the loaded
function, the module's constants); the split-K count per shape and the split-K workspace per
device and stream are cached; a weight's packed codes and padded scale codes are prepared once
per quantization; the activation goes in as it is (the small-M kernels read one code per byte,
so there is no pack pass; the wgmma kernels pack it in one elementwise op). The operands'
shapes are checked against each other (cheap integer compares); the generated ``launch_args``,
which validates every tensor, is for callers outside this module.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from fp4gen.codegen.gemm import SmallMTile, choose_splits, fused_support, gemm_spec, pick_tile
from fp4gen.codegen.gemm_configs import FUSED_ARCHS
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat
from fp4gen.numerics.quantize import tensor_version
from fp4gen.runtime.checks import (
    PreparedA,
    check_accumulate,
    check_bias,
    check_pair,
    one_cuda_device,
)
from fp4gen.runtime.device_memory import capturing, kept
from fp4gen.runtime.epilogue import GemmProduct, finish
from fp4gen.runtime.loader import KernelLoader, Reasons, Unsupported
from fp4gen.spec import GemmKernelSpec, GemmTile

# (spec, arch) -> the loaded kernel or why it cannot be built (remembered, not retried)
_loader: KernelLoader[GemmKernelSpec, Any] = KernelLoader(Reasons.building())
# QuantizedTensor -> (version of its codes, packed codes): a weight is packed once, not per GEMM
_packed: weakref.WeakKeyDictionary[Any, tuple[int, torch.Tensor]] = weakref.WeakKeyDictionary()
# QuantizedTensor -> (versions, (codes, scale codes, global scale)) as a kernel reads B
_b_operands: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], tuple]] = (
    weakref.WeakKeyDictionary()
)
_plans: dict[tuple, _Plan] = {}
_splits: dict[tuple, int] = {}  # (tile, m, n, k, device index) -> split-K ways
_sms: dict[int, int] = {}  # device index -> SM count
# (device index, stream, splits, tiles, tile elements) -> (workspace, counters)
_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_MAX_WORKSPACES = 64


def packed_codes(q: Any) -> torch.Tensor:
    """uint8 [R, ceil(C/2)], two 4-bit codes per byte (element 0 in the low nibble), as
    ``q.data`` but in one elementwise op (lo + 16 hi: the codes are below 16); remembered per
    QuantizedTensor (until its codes change), so a weight reused across GEMMs is packed once.
    A kernel's own packed codes (``q.packed_codes()``) are returned as they are."""
    own = q.packed_codes()
    if own is not None and own.bits == 4:
        return own.data
    codes = q.codes
    hit = _packed.get(q)
    if hit is not None and hit[0] == tensor_version(codes):
        return hit[1]
    version = tensor_version(codes)
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    packed = torch.add(codes[:, 0::2], codes[:, 1::2], alpha=16)
    _packed[q] = (version, packed)
    return packed


def _kernels(spec: GemmKernelSpec, arch: str) -> Any:
    """kernels_for(spec, arch), or why it cannot be had (an Unsupported, remembered)."""
    from fp4gen.runtime.kernels import kernels_for

    return _loader.get(spec, arch, kernels_for)  # type: ignore[arg-type]


def _sf_cols_16(kp: int) -> int:
    """Scale-code columns of a row with K padded to ``kp``, one code per 16 values (what the
    kernels read, 1x32 codes repeated; a small-M kernel's A may read fewer: ``a_scale_cols``)."""
    return kp // 16


@dataclass(frozen=True)
class _Plan:
    """Everything a call needs that depends only on (formats, tile, flags, arch)."""

    spec: GemmKernelSpec
    module: ModuleType
    fn: Callable[..., Any]
    small: bool  # small-M kernel: A one code per byte, split-K workspace
    expand: int  # times each of B's scale codes is repeated along K (MXFP4: 2)
    out_dtype: torch.dtype  # what the kernel writes
    b_sf_rows: Callable[[int], int]  # rows of B's scale codes for N rows
    k_multiple: int  # the kernel's K granularity (its stage)
    a_expand: int = 1  # ... and A's (1 where the kernel reads A's 1x32 codes as they are)
    a_sf_cols: Callable[[int], int] = _sf_cols_16  # A's scale columns for padded K


def _plan(
    a: BlockFormat, b: BlockFormat, tile: GemmTile, bf16: bool, bias: bool, acc: bool, arch: str
) -> _Plan:
    spec = gemm_spec(
        a,
        b,
        1,
        out_dtype="bf16" if bf16 else "fp32",
        bias=bias,
        accumulate=acc,
        tile=tile,
    )
    reason = fused_support(a, b)
    if reason is not None:
        raise FP4GenError(f"no fused GEMM kernel for {a.name} x {b.name}: {reason}")
    kernels = _kernels(spec, arch)
    if isinstance(kernels, Unsupported):
        raise FP4GenError(f"the fused GEMM kernel is not available: {kernels.reason}")
    br = b.block[0]
    return _Plan(
        spec=spec,
        module=kernels.module,
        fn=kernels["gemm"],
        small=isinstance(tile, SmallMTile),
        expand=getattr(kernels.module, "SCALE_EXPAND", 1),
        out_dtype=torch.bfloat16 if bf16 else torch.float32,
        b_sf_rows=lambda n: -(-n // br),
        k_multiple=kernels.module.K_MULTIPLE,
        a_expand=getattr(
            kernels.module, "A_SCALE_EXPAND", getattr(kernels.module, "SCALE_EXPAND", 1)
        ),
        a_sf_cols=getattr(kernels.module, "a_scale_cols", _sf_cols_16),
    )


def _k_padded(t: torch.Tensor, cols: int) -> torch.Tensor:
    """``t`` as the kernels read it: contiguous, ``cols`` columns (zero-padded: code 0 is 0),
    16-byte aligned; ``t`` itself when it already is."""
    if t.shape[1] != cols or not t.is_contiguous():
        t = torch.nn.functional.pad(t, (0, cols - t.shape[1])).contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t


def _scale_codes(q: Any, rows: int, k: int, cols: int, expand: int) -> torch.Tensor:
    """q's scale codes checked against its codes, repeated ``expand`` times along K and padded
    to the ``cols`` columns the kernel reads."""
    sc = q.scale_codes
    bc = q.format.block[1]
    if sc is None or sc.dtype != torch.uint8 or tuple(sc.shape) != (rows, -(-k // bc)):
        raise TensorError(
            f"the fused GEMM needs uint8 scale codes [{rows}, {-(-k // bc)}] for "
            f"{q.format.name} codes [{q.rows}, {k}]; got "
            + ("None" if sc is None else f"{sc.dtype} {list(sc.shape)}")
        )
    return _scales_for_kernel(sc, cols, expand)


def _scales_for_kernel(sc: torch.Tensor, cols: int, expand: int) -> torch.Tensor:
    """Checked scale codes as the kernel reads them: each repeated ``expand`` times along K,
    ``cols`` columns (zero past the codes: scale code 0 times code 0 is 0)."""
    if expand > 1:
        sc = sc.repeat_interleave(expand, dim=1)
    return _k_padded(sc, cols)


def _global(g: torch.Tensor, dev: torch.device) -> torch.Tensor:
    if g.dtype != torch.float32 or g.device != dev:
        g = g.to(device=dev, dtype=torch.float32)
    return g.view(1)


def _b_versions(b: Any, kp: int, expand: int) -> tuple[int, ...]:
    """What B's kernel operands are derived from: its codes, scale codes and global scale (the
    tensors and their versions), the padded K and the scale expansion."""
    return (
        *b.code_version(),
        tensor_version(b.scale_codes) if b.scale_codes is not None else -1,
        tensor_version(b.global_scale),
        kp,
        expand,
    )


def _b_operand(b: Any, plan: _Plan, kp: int) -> tuple:
    """(codes packed along K and padded, scale codes, global scale) of B, remembered per
    QuantizedTensor until its codes, scale codes or global scale change."""
    versions = _b_versions(b, kp, plan.expand)
    hit = _b_operands.get(b)
    if hit is not None and hit[0] == versions:
        return hit[1]
    packed = packed_codes(b)
    if packed.dtype != torch.uint8:
        raise TensorError(f"the fused GEMM needs uint8 codes; b has {packed.dtype}")
    ops = (
        _k_padded(packed, kp // 2),
        _scale_codes(b, plan.b_sf_rows(b.rows), b.cols, _sf_cols_16(kp), plan.expand),
        _global(b.global_scale, packed.device),
    )
    _b_operands[b] = (versions, ops)
    return ops


def _split_count(tile: GemmTile, m: int, n: int, k: int, dev: torch.device) -> int:
    key = (tile, m, n, k, dev.index)
    splits = _splits.get(key)
    if splits is None:
        sms = _sms.get(dev.index)
        if sms is None:
            sms = _sms[dev.index] = torch.cuda.get_device_properties(dev).multi_processor_count
        splits = _splits[key] = choose_splits(tile, m, n, k, sms)
    return splits


def _current_stream(dev: torch.device) -> int:
    """The device's current CUDA stream handle (torch's raw-stream query: a fraction of the
    microseconds ``torch.cuda.current_stream`` takes on this per-call path)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(dev.index)
    return torch.cuda.current_stream(dev).cuda_stream


def _workspace(plan: _Plan, m: int, n: int, splits: int, dev: torch.device) -> tuple:
    """The (workspace, counters) of a small-M launch, one pair per device, stream and shape:
    calls on one stream run in order, and each call's last CTAs reset the counters."""
    stream = _current_stream(dev)
    tiles = plan.module.tiles(m, n)
    key = (dev.index, stream, splits, tiles, plan.module.TILE_ELEMS)

    def make() -> tuple:
        # during a capture the graph's own pair: its counters zeroed by the graph on every replay
        return plan.module.workspace(m, n, splits, dev)

    return kept(_workspaces, key, make, dev, limit=_MAX_WORKSPACES)


class PreparedGemm:
    """A small-M fused GEMM call with one B, kept by ``fused_gemm`` for the calls after it (a
    weight multiplied by new activations of one shape: a decode step, a small-M layer): the
    plan, B's kernel operands, the padded K, the split count, the split-K workspace of the
    last stream (not one made during a capture) and a template of the output. A call checks
    that A is what it was prepared for (format, shape, RHT, device), that B's codes, scales and
    global scale are unchanged (their versions), and launches; it returns None where anything
    differs, and the caller takes the full path (which checks, raises and prepares again)."""

    __slots__ = ("a", "m", "n", "dev", "plan", "kp", "splits", "versions", "b_ops", "sc_shape",
                 "a_sf_cols", "out_like", "ws_stream", "ws")  # fmt: skip

    def __init__(
        self, a: Any, b: Any, out_dtype: torch.dtype, plan: _Plan, kp: int, splits: int
    ) -> None:
        self.a = PreparedA(a, out_dtype)
        self.m, self.n, self.dev = a.rows, b.rows, a.device
        self.plan, self.kp, self.splits = plan, kp, splits
        self.versions = _b_versions(b, kp, plan.expand)
        self.b_ops = _b_operand(b, plan, kp)
        self.sc_shape = (self.m, -(-a.cols // a.format.block[1]))
        self.a_sf_cols = plan.a_sf_cols(kp)
        # the output's shape, dtype and device on two bytes: empty_like of it allocates a
        # contiguous [M, N] with half of torch.empty's argument parsing
        self.out_like = torch.empty((1, 1), dtype=plan.out_dtype, device=self.dev).expand(
            self.m, self.n
        )
        self.ws_stream: int | None = None  # the stream of the workspace kept below
        self.ws: tuple = ()

    def __call__(self, a: Any, b: Any, out_dtype: torch.dtype) -> torch.Tensor | None:
        """C = S_a S_b (A_q @ B_q^T) in ``out_dtype``, or None where this call is not the one
        prepared (``b``: the B it was prepared with, as the caller looked it up)."""
        if not self.a.matches(a, out_dtype):
            return None
        if _b_versions(b, self.kp, self.plan.expand) != self.versions:
            return None
        codes, sc = a.codes, a.scale_codes
        if codes.dtype != torch.uint8 or sc is None or sc.dtype != torch.uint8:
            return None
        if tuple(sc.shape) != self.sc_shape:
            return None
        plan, kp, dev = self.plan, self.kp, self.dev
        stream = _current_stream(dev)
        if stream != self.ws_stream:
            ws = _workspace(plan, self.m, self.n, self.splits, dev)
            if not capturing():  # a capture's own workspace belongs to its graph alone
                self.ws_stream, self.ws = stream, ws
        else:
            ws = self.ws
        out = torch.empty_like(self.out_like, memory_format=torch.contiguous_format)
        b_codes, b_scales, b_global = self.b_ops
        plan.fn(
            _k_padded(codes, kp), _scales_for_kernel(sc, self.a_sf_cols, plan.a_expand),
            b_codes, b_scales,
            _global(a.global_scale, dev), b_global, out, *ws,
        )  # fmt: skip
        return out if out.dtype == out_dtype else out.to(out_dtype)


def fused_gemm(
    a: Any,
    b: Any,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    accumulate: torch.Tensor | None,
    arch: str,
    tile: GemmTile | None = None,
    out: torch.Tensor | None = None,
    keep: MutableMapping[Any, PreparedGemm] | None = None,
) -> torch.Tensor:
    """C = S_a S_b (A_q @ B_q^T) (+ bias) (+ accumulate) with the generated fused kernel:
    ``fused_product`` finished by the shared epilogue (``fp4gen.gemm`` runs the same two)."""
    product = fused_product(
        a, b, out_dtype=out_dtype, bias=bias, accumulate=accumulate, arch=arch, tile=tile,
        out=out, keep=keep,
    )  # fmt: skip
    return finish(
        product, a, b, bias=bias, accumulate=accumulate, out_dtype=out_dtype, backend="cute"
    )


def fused_product(
    a: Any,
    b: Any,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    accumulate: torch.Tensor | None,
    arch: str,
    tile: GemmTile | None = None,
    out: torch.Tensor | None = None,
    keep: MutableMapping[Any, PreparedGemm] | None = None,
) -> GemmProduct:
    """C = S_a S_b (A_q @ B_q^T) (+ bias) (+ accumulate) with the generated fused kernel, as a
    GemmProduct: the kernel applies the global scales, the bias and accumulate (its spec has
    them) and writes bf16 or fp32 (the shared epilogue rounds fp32 to ``out_dtype``).

    ``a``, ``b``: QuantizedTensors on one CUDA device, quantized along K with the same RHT (or
    none). Raises FP4GenError when no fused kernel serves the pair or the arch, TensorError for
    operands that do not fit together. ``accumulate`` (fp32 [M, N]) is not modified. ``out``
    (contiguous [M, N] of ``out_dtype``, checked by ``fp4gen.gemm``): the kernel writes the
    result there when it writes ``out_dtype`` itself; else into a new tensor. ``keep``:
    where a small-M call without bias, accumulate, ``out`` or a tile of its own leaves a
    ``PreparedGemm`` for ``b`` once ``b`` is met a second time (``fp4gen.gemm``'s per-call
    path).
    """
    check_pair(a, b)
    dev = one_cuda_device(a, b, "fused GEMM")
    if arch not in FUSED_ARCHS:
        raise FP4GenError(
            f"no fused GEMM kernel for {arch} (it uses wgmma: {', '.join(FUSED_ARCHS)})"
        )
    m, n, k = a.rows, b.rows, a.cols
    # prepared for the next calls once B is met a second time (a weight reused as it is; a
    # weight quantized anew per call is a new B every time, and preparing would only cost)
    preparing = keep is not None and tile is None and out is None and b in _b_operands
    tile = tile or pick_tile(m)
    # bf16 straight from the kernel when nothing fp32 is added; else fp32 (one rounding at the end)
    bf16 = out_dtype == torch.bfloat16 and accumulate is None
    key = (a.format, b.format, tile, bf16, bias is not None, accumulate is not None, arch)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan(a.format, b.format, *key[2:])
    kp = -(-k // plan.k_multiple) * plan.k_multiple  # zero-padded along K (exact)
    # the small-M kernels read the activation's codes one per byte, the wgmma kernels packed
    a_codes = a.codes if plan.small else packed_codes(a)
    if a_codes.dtype != torch.uint8:
        raise TensorError(f"the fused GEMM needs uint8 codes; a has {a_codes.dtype}")
    a_codes = _k_padded(a_codes, kp) if plan.small else _k_padded(a_codes, kp // 2)
    a_scales = _scale_codes(a, m, k, plan.a_sf_cols(kp), plan.a_expand)
    b_codes, b_scales, b_global = _b_operand(b, plan, kp)
    if accumulate is not None:
        check_accumulate(accumulate, m, n)
        out = accumulate.to(
            device=dev, dtype=torch.float32, copy=True, memory_format=torch.contiguous_format
        )
    elif out is None or out.dtype != plan.out_dtype:
        out = torch.empty((m, n), dtype=plan.out_dtype, device=dev)
    # the compiled function's order: A, A's scales, B, B's scales, S_a, S_b, C (, bias) (, ws)
    args = [a_codes, a_scales, b_codes, b_scales, _global(a.global_scale, dev), b_global, out]
    if bias is not None:
        check_bias(bias, n)
        if bias.dtype != torch.float32 or bias.device != dev or not bias.is_contiguous():
            bias = bias.to(device=dev, dtype=torch.float32).contiguous()
        args.append(bias)
    if plan.small:
        splits = _split_count(tile, m, n, k, dev)
        args.extend(_workspace(plan, m, n, splits, dev))
    plan.fn(*args)
    if preparing and plan.small and bias is None and accumulate is None:
        assert keep is not None
        keep[b] = PreparedGemm(a, b, out_dtype, plan, kp, splits)
    return GemmProduct(out, scaled=True, bias=True, accumulated=True)


__all__ = [
    "PreparedGemm",
    "fused_gemm",
    "fused_product",
    "packed_codes",
]
