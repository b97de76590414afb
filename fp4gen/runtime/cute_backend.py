"""The ``cute`` backend of ``fp4gen.quantize``: generated kernels -> a QuantizedTensor.

``fp4gen.quantize(x, fmt, ..., backend="cute")`` (``fp4gen.runtime.quantize_dispatch``)
quantizes with the generated kernel of the matching single-output rowwise spec (``kernels_for``)
and builds the same QuantizedTensor as the reference: the kernel's packed codes (unpacked on
first read of ``codes``; the GEMM paths read them packed), the scale codes (decoded on first read
of ``scales``), S_dec as a 0-dim fp32 tensor. Non-finite inputs raise TensorError
(``fp4gen.runtime.finite``). ``backend="auto"`` takes this path for CUDA tensors whose spec and
shape the kernels support, and otherwise stays on the reference (logged once per reason at INFO).

``quantize_tile_cute(x, fmt, outputs, ...)`` quantizes a tensor rowwise and/or columnwise (the
columnwise copy being the rowwise quantization of ``x.t()``, each copy with its own rounding, RHT
and Philox offset) in one launch of the tile kernel, reading ``x`` once and never transposing
it: what a linear layer's backward pass needs for the gradient (dgrad rowwise, wgrad
columnwise) and the activation (wgrad columnwise).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from fp4gen.compiler.plan import (
    columnwise_tile_reason,
    kernel_rht,
    kernel_spec,
    redrawn_tile_reason,
    rowwise_only,
    rowwise_only_reason,
    tile_reason,
    unnested_rht_reason,
)
from fp4gen.compiler.spec import InputDType, QuantKernelSpec, QuantOutput
from fp4gen.device_offset import DeviceOffset
from fp4gen.dsl.model import RHTSpec
from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat, is_stochastic
from fp4gen.runtime import finite
from fp4gen.runtime.checks import launch_rows, not_cuda, served_by_reference
from fp4gen.runtime.loader import KernelLoader, LogOnce, Reasons, Unsupported

log = logging.getLogger("fp4gen.runtime")

_DTYPES: dict[torch.dtype, InputDType] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
}
# (spec, arch) -> the loaded kernels (through kernels_for) or why the template cannot make them
_loader: KernelLoader[QuantKernelSpec, Any] = KernelLoader(
    Reasons.falling_back("{spec.name} is not supported by the kernel template yet ({err})")
)
_log_once = LogOnce(log, "quantize(backend='auto') uses the reference: %s")
# a tile launch refused: the callers then quantize the copies one by one (the reason says how)
_log_tile_once = LogOnce(log, "quantize(backend='auto'): no tile launch for these copies: %s")
# an input zero-padded to the kernels' M and K multiples (``_zero_padded``): once per kernel,
# its multiples and K
_log_padded_once = LogOnce(log, "quantize(backend='auto'): %s")
_lock = threading.Lock()

# The fused kernels of the block-scale options (docs/numerics.md 11-12: block targets, a global
# bound, stochastic block scales, MS-EDEN, per-row global scales, signs drawn per layer or
# step) run by default: their GPU bit-exact tests and the recipe fuzzer's batch pass
# (docs/quantize-kernels.md, "Status"). set_option_kernels(False) hands these operands to the
# reference instead, logged once (to compare, or to rule the kernels out).
_option_kernels = [True]


def set_option_kernels(enabled: bool) -> bool:
    """Whether the generated kernels quantize operands whose format has a block-scale option of
    docs/numerics.md 11-12 (True, the default) or the reference does (False). Process-wide,
    read when a launch is first planned for a format (and forgotten here, so a change applies
    to the next call); returns the previous setting."""
    previous, _option_kernels[0] = _option_kernels[0], bool(enabled)
    with _lock:
        _launches.clear()
    return previous


def set_tile_option_kernels(enabled: bool) -> bool:
    """Whether the tile kernel quantizes 2D tiles (e.g. 16x16 weights) whose format has block
    targets or stochastic block scales (docs/numerics.md 11.1-11.2; True, the default since
    tests/test_quantize_tile_options_gpu.py passed on an H200), or the reference does (False:
    the reference's reason is logged once). Process-wide, read when a launch is first planned
    (the planner of ``fp4gen compile`` reads it too); returns the previous setting."""
    from fp4gen.compiler import plan

    previous, plan._tile_option_kernels[0] = plan._tile_option_kernels[0], bool(enabled)
    with _lock:
        _launches.clear()
    return previous


def options_off_reason(fmt: BlockFormat, rhts: tuple[RHTSpec | None, ...]) -> str | None:
    """Why the option kernels do not run for ``fmt`` and ``rhts`` (set_option_kernels), or
    None."""
    if _option_kernels[0]:
        return None
    options = rowwise_only(fmt) or fmt.global_bound is not None
    if not options and not any(r is not None and r.redrawn for r in rhts):
        return None
    return (
        f"format {fmt.name}: the fused kernels of its block-scale options (docs/numerics.md "
        "11-12) are turned off (fp4gen.runtime.cute_backend.set_option_kernels(False)), so the "
        "reference quantizes these operands"
    )


def spec_for(
    fmt: BlockFormat, rounding: str, rht: RHTSpec | None, dtype: torch.dtype
) -> QuantKernelSpec:
    """The single-output rowwise kernel spec that quantizes like ``quantize`` does."""
    return _spec(fmt, dtype, (QuantOutput("rowwise", rounding, rht),))  # type: ignore[arg-type]


def _spec(
    fmt: BlockFormat, dtype: torch.dtype, outputs: tuple[QuantOutput, ...]
) -> QuantKernelSpec:
    """The kernel spec writing ``outputs`` of a ``dtype`` tensor in format ``fmt``."""
    if dtype not in _DTYPES:
        raise TensorError(
            f"cannot quantize a {dtype} tensor: expected float32, bfloat16 or float16"
        )
    return kernel_spec(fmt, _DTYPES[dtype], outputs)


def _kernels(spec: QuantKernelSpec) -> Any:
    """kernels_for(spec) for the current GPU's arch, or why the generated kernels cannot serve
    it (an Unsupported)."""
    from fp4gen.runtime.kernels import kernels_for

    return _loader.get_current(spec, kernels_for)


@dataclass(frozen=True)
class _Launch:
    """What one quantize call needs that depends only on the format, the copies, the input's
    dtype and shape: found once per such key (``_launch``), not per call. ``kernels`` is the
    loaded kernels or the reason there are none (an Unsupported); ``refused`` the input check's
    error message for this shape (None: accepted). The message, not the error: a kept
    exception's traceback would keep the frames of the call that met it alive, and with them
    that call's tensors (a layer's quantized operands, held in a CUDA graph's pool past the
    graph, which torch.compile's reduce-overhead refuses)."""

    spec: QuantKernelSpec
    kernels: Any
    refused: str | None
    nan_scale: bool  # a NaN or Inf input makes every copy's S_dec NaN (the kernels see to it)


# (id(fmt), dtype, copies, shape) -> (fmt, rhts, _Launch): by identity, because hashing a format
# and its RHT spec per call costs more than the launch; the references keep the ids valid
_launches: dict[tuple[Any, ...], tuple[BlockFormat, tuple[Any, ...], _Launch]] = {}
_MAX_LAUNCHES = 4096


def _launch(
    fmt: BlockFormat, copies: tuple[tuple[str, str, RHTSpec | None], ...], x: torch.Tensor
) -> _Launch:
    """The memoized _Launch of ``copies`` ((direction, rounding, rht) each) of inputs like the
    2-D CUDA tensor ``x``: its dtype and shape, contiguous and 16-byte aligned (the callers make
    it so, which is what lets the check of the first such input stand for every later one)."""
    rhts = tuple(rht for _, _, rht in copies)
    dtype = x.dtype
    key = (id(fmt), dtype, tuple((d, r, id(h)) for d, r, h in copies), x.shape)
    hit = _launches.get(key)
    if hit is not None and hit[0] is fmt and all(a is b for a, b in zip(hit[1], rhts, strict=True)):
        return hit[2]
    spec = _spec(fmt, dtype, tuple(QuantOutput(d, r, h) for d, r, h in copies))  # type: ignore[arg-type]
    # what only the rowwise kernel implements (numerics.md 11-12: block targets, stochastic
    # block scales, MS-EDEN, per-row scales, drawn signs): a tile launch is refused, so the
    # callers quantize each copy on its own (a columnwise one as the rowwise copy of x.t()); 2D
    # blocks with those options and unnested RHTs: the reference
    tiled = fmt.is_2d or any(d != "rowwise" for d, _, _ in copies) or len(copies) > 1
    only = (
        options_off_reason(fmt, rhts)
        or rowwise_only_reason(fmt)
        or (tile_reason(fmt) if tiled else None)
        or next(
            (
                why
                for rht in rhts
                if (
                    why := (redrawn_tile_reason(rht) if tiled else None)
                    or unnested_rht_reason(fmt, rht)
                )
                is not None
            ),
            None,
        )
    )
    kernels = Unsupported(only) if only is not None else _kernels(spec)
    refused = None
    check = (
        None if isinstance(kernels, Unsupported) else getattr(kernels.module, "check_input", None)
    )
    if check is not None:
        try:
            check(x)
        except TensorError as err:
            refused = str(err)
    nan_scale = not isinstance(kernels, Unsupported) and getattr(
        kernels.module, "NONFINITE_TO_NAN_SCALE", False
    )
    launch = _Launch(spec, kernels, refused, bool(nan_scale))
    with _lock:
        if len(_launches) >= _MAX_LAUNCHES:
            _launches.clear()
        _launches[key] = (fmt, rhts, launch)
    return launch


def quantize_cute(
    x: torch.Tensor,
    fmt: BlockFormat,
    *,
    rounding: str,
    rht: RHTSpec | None,
    seed: int,
    offset: int | DeviceOffset,
    required: bool,
) -> Any:
    """A QuantizedTensor from the generated kernels; None when ``required`` is False and the
    kernels cannot serve this call (the caller then runs the reference). ``offset`` may be a
    DeviceOffset (one slot): the kernels then read it from device memory when they run."""

    unavailable = partial(
        served_by_reference,
        required=required,
        kernels="generated CuTe DSL kernels",
        log_once=_log_once,
    )
    refusal = not_cuda(x)
    if refusal is not None:
        return unavailable(refusal)
    if x.dtype not in _DTYPES or x.numel() == 0:
        return None if not required else _reference_error(x)
    x2 = launch_rows(x)
    # signs drawn per layer or step: one kernel per size takes them as arguments (kernel_rht,
    # one object per size, keeps the launch memo's key), this call's transform gives them
    drawn = rht is not None and rht.redrawn
    copies = (("rowwise", rounding, kernel_rht(rht) if drawn else rht),)
    launch = _launch(fmt, copies, x2)
    kernels = launch.kernels
    if isinstance(kernels, Unsupported):
        return unavailable(kernels.reason)
    rows, cols = x2.shape
    launched = x2
    if launch.refused is not None:
        padded = _zero_padded(x2, fmt, launch, copies)
        if padded is None:
            if required:
                raise TensorError(launch.refused)
            _log_once(f"{launch.spec.name} does not take this input ({launch.refused})")
            return None
        launched, launch = padded
        kernels = launch.kernels
    flag = (
        None
        if launch.nan_scale and finite.propagates()
        else finite.check(x2, "the input of shape {}", x.shape)
    )

    if drawn:
        out = kernels.module.run(kernels.fns, launched, seed=seed, offset=offset, signs=rht)
    else:
        out = kernels.run(launched, seed=seed, offset=offset)
    if launched is not x2:
        out = _unpadded(out, fmt, {"": (rows, cols)})
    return _quantized(out, "", fmt, cols, rounding, rht, seed, offset, x.shape, x.dtype, flag)


def padding_is_exact(fmt: BlockFormat, rounding: str, k: int | None = None) -> bool:
    """Whether quantizing x zero-padded to more rows and columns and then dropping the padding's
    codes and scales gives x's own quantization bit for bit: true for 1D blocks and 2D tiles
    rounded deterministically. The reference pads a partial block or tile with zeros itself
    (numerics.md 2), so every block's amax, scale, codes and target choice are the same, and
    zeros change neither a tensor's nor a row's amax (the global scale); a columnwise copy is
    the rowwise one of x.t() (1D) or the transpose of x's (2D), padded alike. Not with
    stochastic element rounding (a value's random bits are drawn by its position in the padded
    tensor), nor stochastic block scales or MS-EDEN groups (whose draws and groups follow the
    padded layout), nor, given x's K ``k``, block targets on 2D tiles wider than K: the
    reference's tile is then K wide, and its error sum adds the same values in another order
    than the padded tile's (fp32 addition does not associate), which may flip a choice."""
    narrow_tile = fmt.is_2d and bool(fmt.targets) and k is not None and k < fmt.block[1]
    return (
        not is_stochastic(rounding)
        and fmt.scale.rounding != "stochastic"
        and fmt.eden_group is None
        and not narrow_tile
    )


def _zero_padded(
    x2: torch.Tensor,
    fmt: BlockFormat,
    launch: _Launch,
    copies: tuple[tuple[str, str, RHTSpec | None], ...],
) -> tuple[torch.Tensor, _Launch] | None:
    """``x2`` zero-padded to the kernels' M and K multiples and its launch, where the kernels
    refused ``x2``'s shape and the padding is exact for every copy (``padding_is_exact``); else
    None. Logged once per kernel, its multiples and K (not M, which changes with the batch): the
    copy costs a pass over x, far less than the torch reference's."""
    module = launch.kernels.module
    k_multiple = getattr(module, "K_MULTIPLE", None)
    m_multiple = getattr(module, "M_MULTIPLE", 1)
    rows, cols = x2.shape
    if not k_multiple or not all(padding_is_exact(fmt, r, cols) for _, r, _ in copies):
        return None
    # an RHT runs along a copy's rows: K for the rowwise copy, M for the columnwise one (x.t())
    if any(
        rht is not None and (cols if d == "rowwise" else rows) % rht.size for d, _, rht in copies
    ):
        return None  # the reference refuses an RHT that does not divide its length: so must we
    padded_rows = -(-rows // m_multiple) * m_multiple
    padded_cols = -(-cols // k_multiple) * k_multiple
    if (padded_rows, padded_cols) == (rows, cols):
        return None  # refused for another reason than the shape
    padded = torch.nn.functional.pad(x2, (0, padded_cols - cols, 0, padded_rows - rows))
    again = _launch(fmt, copies, padded)
    if again.refused is not None:
        return None
    what = [f"K {cols} to {padded_cols}"] if padded_cols != cols else []
    if padded_rows != rows:
        what.append(f"M to a multiple of {m_multiple}")
    _log_padded_once(
        f"{launch.spec.name} takes K in multiples of {k_multiple}"
        + (f" and M in multiples of {m_multiple}" if m_multiple > 1 else "")
        + f": an input is zero-padded ({', '.join(what)}) and the padding's codes and scales "
        "dropped (exact)"
    )
    return padded, again


def _unpadded(
    out: dict[str, torch.Tensor], fmt: BlockFormat, shapes: dict[str, tuple[int, int]]
) -> dict[str, torch.Tensor]:
    """The outputs of a launch on a zero-padded input (``_zero_padded``) cut to the real shape:
    ``shapes`` maps each copy's prefix ("" rowwise, "col_" columnwise) to its [rows, cols] (a
    columnwise copy's rows are x's columns). A copy's packed codes are row-major with element 0
    in the lowest bits of its row (``layout.pack``), so a row's first ceil(cols * bits / 8)
    bytes hold its real codes; its scales are one per block row (a row, or a tile's rows) and
    block column. The swizzled scale buffers are left out: laid out for the padded shape, and
    no QuantizedTensor reads them."""
    br, bc = fmt.block  # 2D tiles are square: a columnwise copy's tiles are the same
    cut: dict[str, torch.Tensor] = {}
    for prefix, (rows, cols) in shapes.items():
        block_rows = -(-rows // br)
        code_bytes = -(-cols * fmt.element.bits // 8)
        cut[prefix + "data"] = out[prefix + "data"][:rows, :code_bytes].contiguous()
        cut[prefix + "scales"] = out[prefix + "scales"][:block_rows, : -(-cols // bc)].contiguous()
        global_scale = out[prefix + "global_scale"]
        # per-row global scales: one per block row, the padding's rows dropped
        cut[prefix + "global_scale"] = (
            global_scale[:block_rows] if fmt.global_rows else global_scale
        )
    return cut


def _quantized(
    out: dict[str, torch.Tensor],
    prefix: str,
    fmt: BlockFormat,
    cols: int,
    rounding: str,
    rht: RHTSpec | None,
    seed: int,
    offset: int | DeviceOffset,
    shape: torch.Size,
    dtype: torch.dtype,
    finite_flag: torch.Tensor | None = None,
) -> Any:
    """The QuantizedTensor of one copy a generated module's ``run`` wrote (its outputs named
    ``prefix`` + "data", "scales", "global_scale"; ``cols`` values per row)."""
    from fp4gen.numerics.quantize import PackedCodes, QuantizedTensor

    scales = out[prefix + "scales"]
    data = out[prefix + "data"]
    bits = fmt.element.bits
    coded_scales = fmt.scale.element is not None
    # one S_dec per row ([R, 1], docs/numerics.md 11.4) or per tensor (0-dim); a 0-dim fp32
    # scale as it is (no reshape or cast call: grouped launches make one per group and copy)
    global_scale = out[prefix + "global_scale"]
    if fmt.global_rows or global_scale.dim() != 0:
        global_scale = global_scale.reshape((-1, 1) if fmt.global_rows else ())
    # NaN when the input was not all finite and the caller propagates that (finite.py)
    global_scale = finite.poison(global_scale, finite_flag)
    if global_scale.dtype != torch.float32:
        global_scale = global_scale.to(torch.float32)
    # codes and scale values are derived on first read: the GEMM paths read the packed codes
    # and the scale codes, so a training step never materializes them
    return QuantizedTensor(
        codes=data if bits == 8 else None,
        packed=None if bits == 8 else PackedCodes(data, cols, bits),
        scales=None if coded_scales else scales.to(torch.float32),
        scale_codes=scales if coded_scales else None,
        global_scale=global_scale,
        format=fmt,
        rounding=rounding,
        rht=rht,
        seed=seed,
        offset=offset,
        shape=shape,
        dtype=dtype,
    )


# (direction, rounding, rht, Philox offset): the offsets all ints, or all one-slot DeviceOffsets
# on one counter with one stride (the kernel then reads every copy's offset on the device)
TileOutput = tuple[str, str, RHTSpec | None, "int | DeviceOffset"]
_joined: dict[tuple[int, ...], tuple[tuple[DeviceOffset, ...], DeviceOffset]] = {}


def _joined_offset(parts: tuple[DeviceOffset, ...]) -> DeviceOffset:
    """One DeviceOffset with the slots of ``parts`` (same counter and stride), kept per tuple
    of parts: building and validating one per call would cost host time."""
    key = tuple(id(p) for p in parts)
    hit = _joined.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], parts, strict=True)):
        return hit[1]
    first = parts[0]
    if any(p.counter is not first.counter or p.stride != first.stride for p in parts):
        raise FP4GenError("the copies of one tile launch must share one Philox counter")
    joined = DeviceOffset(first.counter, first.stride, tuple(p.slots[0] for p in parts))
    if len(_joined) >= _MAX_LAUNCHES:
        _joined.clear()
    _joined[key] = (parts, joined)
    return joined


def quantize_tile_cute(
    x: torch.Tensor, fmt: BlockFormat, outputs: tuple[TileOutput, ...], *, seed: int
) -> tuple[Any, ...] | None:
    """QuantizedTensors of the copies ``outputs`` of the 2-D CUDA tensor ``x``, from one tile
    kernel: a rowwise copy equals ``quantize(x, ...)``, a columnwise one
    ``quantize(x.t().contiguous(), ...)``, bit for bit (with 2D blocks the transpose of the
    rowwise codes and tile scales, ``quantize(x, ...).transpose()``: the same codes, so 2D
    blocks are taken only where every copy rounds to nearest without an RHT). A shape the tile
    kernel does not take is zero-padded to its M and K multiples and every copy cut back to the
    real shape where that is exact for all of them (``_zero_padded``). None when the kernels
    cannot serve the call (no GPU kernels, a shape they do not take that cannot be padded: the
    caller quantizes the copies one by one); TensorError for non-finite values."""
    if not_cuda(x) is not None or x.dim() != 2 or x.dtype not in _DTYPES:
        return None
    if fmt.is_2d and any(r != "nearest" or h is not None for _, r, h, _ in outputs):
        return None  # a stochastic copy of x.t() draws other bits than the rowwise copy's
    transposed = columnwise_tile_reason(fmt)
    if transposed is not None and any(d == "columnwise" for d, *_ in outputs):
        _log_tile_once(transposed)
        return None
    if x.numel() == 0 or not x.is_contiguous() or x.data_ptr() % 16:
        return None
    copies = tuple((d, r, h) for d, r, h, _ in outputs)
    launch = _launch(fmt, copies, x)
    kernels = launch.kernels
    if isinstance(kernels, Unsupported):
        _log_tile_once(kernels.reason)
        return None
    launched = x
    if launch.refused is not None:
        padded = _zero_padded(x, fmt, launch, copies)
        if padded is None:
            _log_tile_once(
                f"{launch.spec.name} does not take this input ({launch.refused}); "
                "the copies run one by one"
            )
            return None
        launched, launch = padded
        kernels = launch.kernels
    # once for every copy; none where the kernels make the decode scales NaN themselves
    flag = (
        None
        if launch.nan_scale and finite.propagates()
        else finite.check(x, "the input of shape {}", x.shape)
    )

    offsets: Any = tuple(o for *_, o in outputs)
    device = [o for o in offsets if isinstance(o, DeviceOffset)]
    if device:  # a copy that rounds to nearest ignores its offset: it takes any slot
        if any(not isinstance(o, DeviceOffset) and is_stochastic(r) for _, r, _, o in outputs):
            raise FP4GenError("stochastic copies of one tile launch need one kind of offset")
        offsets = _joined_offset(
            tuple(o if isinstance(o, DeviceOffset) else device[0] for o in offsets)
        )
    out = kernels.module.run(kernels.fns, launched, seed=seed, offset=offsets)
    rows, cols = x.shape
    # a columnwise copy is the rowwise quantization of x.t(): [cols, rows]
    layouts = {"rowwise": ("", cols, (rows, cols)), "columnwise": ("col_", rows, (cols, rows))}
    if launched is not x:
        out = _unpadded(out, fmt, {layouts[d][0]: layouts[d][2] for d, *_ in outputs})
    result = []
    for direction, rounding, rht, offset in outputs:
        prefix, n, shape = layouts[direction]
        result.append(
            _quantized(
                out, prefix, fmt, n, rounding, rht, seed, offset, torch.Size(shape), x.dtype, flag
            )
        )
    return tuple(result)


def _reference_error(x: torch.Tensor) -> None:
    """Raise the reference quantizer's error for an input it rejects."""
    from fp4gen.numerics.quantize import _as_2d_float32

    _as_2d_float32(x)
    raise TensorError(f"cannot quantize a tensor of shape {tuple(x.shape)} and dtype {x.dtype}")


__all__ = ["quantize_cute", "quantize_tile_cute", "set_tile_option_kernels", "spec_for"]
