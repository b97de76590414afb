"""Grouped quantize: the rowwise copies of several groups of rows of one tensor in one launch
(``fp4gen.kernels.grouped_quantize``), each group quantized as quantizing it alone would.

``quantize_groups(x, counts, fmt, rounding=, rht=, seeds=, offsets=)`` returns one QuantizedTensor
per group of ``counts[g]`` consecutive rows of ``x`` [M, K]: the same bits as
``fp4gen.quantize(x[s:e], fmt, rounding=, hadamard=rht, seed=seeds[g], offset=offsets[g])``, that is
each group's own global amax and S_dec ("per group" global-scale scope, what a dense layer of the
group's size gets; ``scope="tensor"``: every group's with the amax of all rows,
``fp4gen.runtime.grouped_scope.quantize_scoped`` of its rows), its own Philox seed and offset, and
its stochastic rounding indexed from its own first element. An empty group (no rows: an expert no
token was routed to) has no operand: None in its place. On CUDA, for a 1xN rowwise spec the grouped
kernels serve (``grouped_reason``), two launches quantize every group (the grouped amax where the
format has a global scale, then the grouped quantize); anywhere else (the CPU, the reference
backend, a spec or input the kernels do not take) the groups are quantized one by one with
``fp4gen.quantize``, the same bits. ``cta_table`` is the host's share of the launch: one row per
CTA, one tile of one group (``cta_table_tensor`` builds it on the launch's device).

The list returned is a ``GroupedOperands``: from the kernels its ``whole`` is also the one
QuantizedTensor of every row (codes and block scales; its global scale is the first non-empty
group's, so only its block values mean anything): the grouped GEMMs decode every group's block
values from it in one pass. None where the groups were quantized one by one.
"""

from __future__ import annotations

import logging
import os
import shlex
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat
from fp4gen.runtime.host_tables import built_on_device, host_table, spread_groups, unread_table
from fp4gen.runtime.loader import compiled_once

log = logging.getLogger(__name__)
_logged: set[str] = set()
_lock = threading.Lock()
# (RowwiseParams, arch) -> {"amax": fn, "quantize": fn} or the reason they cannot be compiled
_compiled: dict[tuple[Any, str], dict[str, Any] | str] = {}


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


_PENDING = object()  # an entry of a lazy group sequence not built yet


class LazyGroups(Sequence):
    """A sequence of per-group entries, each built on first access by ``make(g)`` and kept
    (``count`` entries), or the ``items`` given. A grouped launch's consumers mostly read its
    outputs whole (one decode, one GEMM of every group): a QuantizedTensor and two views per
    group and copy, built eagerly, were most of the grouped path's host time per expert
    (docs/moe.md, "The host path on a CPU"), and are now made only where one is read."""

    def __init__(
        self,
        items: Iterable[Any] = (),
        *,
        make: Callable[[int], Any] | None = None,
        count: int = 0,
    ) -> None:
        self._make = make
        self._items: list[Any] = list(items) if make is None else [_PENDING] * count

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self._items)))]
        item = self._items[index]
        if item is _PENDING:
            index = index + len(self._items) if index < 0 else index
            item = self._items[index] = self._build(index)
        return item

    def _build(self, index: int) -> Any:
        """Entry ``index``, made (a subclass's own maker is a method, not a bound method kept
        in ``_make``: that would be a reference cycle, and the launch's device buffers would
        wait for the garbage collector)."""
        return self._make(index)  # type: ignore[misc]

    def append(self, item: Any) -> None:
        self._items.append(item)

    @property
    def built(self) -> int:
        """How many entries exist (built or given): what a consumer has read so far."""
        return sum(item is not _PENDING for item in self._items)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} groups, {self.built} built)"


class GroupedOperands(LazyGroups):
    """The groups' QuantizedTensors (None for an empty group; from the kernels built on first
    access: ``LazyGroups``), and ``whole``: every row's codes and block scales as one
    QuantizedTensor where one launch wrote them (module docstring), else None;
    ``global_scales``: where one launch wrote them, every group's S_dec as one fp32 [groups]
    tensor (group g's entry is its QuantizedTensor's ``global_scale``; an empty group's is
    never written), else None, so a grouped GEMM scales every group by one op."""

    whole: Any = None
    global_scales: torch.Tensor | None = None
    # a columnwise copy of every group side by side as one [K, sum of padded rows]
    # QuantizedTensor (group g's columns after the groups' before it), where one launch wrote
    # them so (``grouped_tile``'s ``side_by_side``), else None: a GEMM grouped along K reads it
    # whole
    side: Any = None
    # each group's operand shape (None for an empty group) where known without building it
    shapes: list[tuple[int, ...] | None] | None = None
    # where each entry is a tuple of copies (a dual-output launch): each copy's groups alone
    copies: tuple[GroupedOperands, ...] | None = None


def cta_table(counts: Sequence[int], units_per_row: int, tile: int) -> list[tuple[int, ...]]:
    """The CTA table of the grouped kernels: for groups of ``counts[g]`` rows of
    ``units_per_row`` units each, one row (group, first unit of the tile, end unit of the group,
    first unit of the group) per tile of ``tile`` units; an empty group has none."""
    _check_cta(counts, units_per_row, tile)
    rows: list[tuple[int, ...]] = []
    start = 0
    for g, count in enumerate(counts):
        end = start + count * units_per_row
        rows += [(g, t, end, start) for t in range(start, end, tile)]
        start = end
    return rows


def cta_table_tensor(
    counts: Sequence[int], units_per_row: int, tile: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``cta_table`` as an int32 [CTAs, 4] tensor on ``device``: built on the host by a few
    numpy ops (microseconds, where a Python tuple per CTA takes milliseconds at an MoE layer's
    sizes) and sent by one queued copy (``host_tables``), or, from
    ``host_tables.DEVICE_BUILT_ROWS`` CTAs on a CUDA device, by torch ops there
    (``host_tables.spread_groups``): the same rows."""
    _check_cta(counts, units_per_row, tile)
    device = torch.device(device)
    if not counts:
        return torch.zeros((0, 4), dtype=torch.int32, device=device)
    units = np.asarray(counts, dtype=np.int64) * units_per_row
    tiles = -(-units // tile)
    ends = np.cumsum(units)
    starts = ends - units
    if built_on_device(int(tiles.sum()), device):
        return _spread_cta_table(tiles, starts, ends, tile, device)
    group = np.repeat(np.arange(len(counts)), tiles)
    first_cta = np.cumsum(tiles) - tiles
    first_unit = starts[group] + (np.arange(group.size) - first_cta[group]) * tile
    table = np.stack((group, first_unit, ends[group], starts[group]), 1).astype(np.int32)
    return host_table(torch.from_numpy(table), torch.int32, device)


def _spread_cta_table(
    tiles: np.ndarray, starts: np.ndarray, ends: np.ndarray, tile: int, device: torch.device
) -> torch.Tensor:
    """``cta_table_tensor``'s rows built by torch ops on ``device`` (any device: the tests
    compare it with the numpy table on the CPU)."""
    group, index, (start, end) = spread_groups(tiles, np.stack((starts, ends)), device)
    return torch.stack((group, index.mul_(tile).add_(start), end, start), 1)


def _check_cta(counts: Sequence[int], units_per_row: int, tile: int) -> None:
    if tile <= 0 or units_per_row <= 0:
        raise FP4GenError(f"cta_table: tile {tile} and units per row {units_per_row} must be > 0")
    for g, count in enumerate(counts):
        if count < 0:
            raise FP4GenError(f"cta_table: group {g} has {count} rows")


def _reference_groups(
    x: torch.Tensor,
    counts: Sequence[int],
    fmt: BlockFormat,
    rounding: str,
    rht: Any,
    seeds: Sequence[int],
    offsets: Sequence[int],
    backend: str,
    scope: str = "expert",
) -> GroupedOperands:
    from fp4gen.dsl.model import OperandSpec
    from fp4gen.runtime.grouped_scope import quantize_scoped, values_amax
    from fp4gen.runtime.quantize_dispatch import quantize

    spec = OperandSpec(fmt, rounding, rht)  # type: ignore[arg-type]
    amax = None
    if scope == "tensor" and x.numel():  # the amax of every group's rows together
        amax = values_amax(x, spec)
    out = GroupedOperands()
    start = 0
    for count, seed, offset in zip(counts, seeds, offsets, strict=True):
        if count == 0:
            out.append(None)  # nothing to quantize (the reference refuses an empty tensor)
            continue
        rows = x[start : start + count]
        if amax is not None:
            out.append(quantize_scoped(rows, spec, amax, seed=seed, offset=offset, backend=backend))
        else:
            out.append(
                quantize(
                    rows,
                    fmt,
                    rounding=rounding,
                    hadamard=rht,
                    seed=seed,
                    offset=offset,
                    backend=backend,
                )
            )
        start += count
    out.global_scales = stacked_scales(out)
    return out


def stacked_scales(operands: Sequence[Any]) -> torch.Tensor | None:
    """The groups' S_dec as one fp32 [groups] tensor (``GroupedOperands.global_scales``) for
    groups quantized one by one: an empty group's entry is 1.0 (never read); None for no
    groups or for per-row global scales."""
    present = [q for q in operands if q is not None]
    if not present or any(q.global_scale.numel() != 1 for q in present):
        return None  # no groups, or per-row global scales: no one S_dec per group
    one = torch.ones((), dtype=torch.float32, device=present[0].global_scale.device)
    return torch.stack([one if q is None else q.global_scale.float().reshape(()) for q in operands])


def quantize_groups(
    x: torch.Tensor,
    counts: Sequence[int],
    fmt: BlockFormat,
    *,
    rounding: str = "nearest",
    rht: Any = None,
    seeds: Sequence[int],
    offsets: Sequence[int],
    backend: str = "auto",
    scope: str = "expert",
) -> GroupedOperands:
    """One QuantizedTensor per group of rows, None for an empty group (module docstring).
    ``backend``: "auto" the
    grouped kernels where they serve (else the groups one by one, the reason logged once at
    INFO), "cute" requires them, "reference" quantizes each group with the reference.
    ``scope``: "expert" gives each group its own global amax, "tensor" every group the amax of
    all rows (``fp4gen.runtime.grouped_scope``; a format with one global amax)."""
    if scope not in ("expert", "tensor"):
        raise FP4GenError(f"quantize_groups: scope {scope!r}; expected 'expert' or 'tensor'")
    if scope == "tensor" and not (fmt.global_scale and not fmt.global_rows):
        raise FP4GenError(
            f"quantize_groups: scope 'tensor' needs one global amax, which {fmt.name} has not"
        )
    if x.dim() != 2 or sum(counts) != x.shape[0]:
        raise TensorError(
            f"quantize_groups: x of shape {tuple(x.shape)} for groups of {list(counts)} rows; "
            "expected a 2-D tensor whose rows the groups cover exactly"
        )
    if not len(counts) == len(seeds) == len(offsets):
        raise FP4GenError(
            f"quantize_groups: {len(counts)} groups, {len(seeds)} seeds, {len(offsets)} offsets"
        )
    if backend != "reference":
        reason = _kernel_reason(x, fmt, rounding, rht)
        if reason is None:
            try:
                return _grouped_kernels(x, counts, fmt, rounding, rht, seeds, offsets, scope)
            except _Refused as refused:
                reason = str(refused)
        if backend == "cute":
            raise FP4GenError(f"quantize_groups(backend='cute'): {reason}")
        _log_once(f"the groups are quantized one by one: {reason}")
    return _reference_groups(x, counts, fmt, rounding, rht, seeds, offsets, backend, scope)


class _Refused(Exception):
    """The grouped kernels do not serve this call; ``args[0]`` says why."""


def _kernel_reason(x: torch.Tensor, fmt: BlockFormat, rounding: str, rht: Any) -> str | None:
    if isinstance(fmt, BlockFormat) and fmt.global_rows:
        return f"{fmt.name}: per-row global scales (the grouped kernels keep one per group)"
    if not x.is_cuda:
        return "a CPU tensor"
    if not isinstance(fmt, BlockFormat) or fmt.block[0] != 1:
        return f"{fmt}: the grouped kernels take 1xN blocks"
    if x.numel() == 0:
        return "no rows"
    return None


def _grouped_kernels(
    x: torch.Tensor,
    counts: Sequence[int],
    fmt: BlockFormat,
    rounding: str,
    rht: Any,
    seeds: Sequence[int],
    offsets: Sequence[int],
    scope: str = "expert",
) -> GroupedOperands:
    from fp4gen.kernels import host
    from fp4gen.runtime import cute_backend
    from fp4gen.runtime.loader import Unsupported

    spec = cute_backend.spec_for(fmt, rounding, rht, x.dtype)
    loaded = cute_backend._kernels(spec)
    if isinstance(loaded, Unsupported):
        raise _Refused(loaded.reason)
    module = loaded.module
    try:
        module.check_input(x)
    except FP4GenError as err:
        raise _Refused(str(err)) from err
    params = module.PARAMS
    fns = _compile(params, loaded.arch, module.K_MULTIPLE)
    m, k = x.shape
    dev = x.device
    groups = len(counts)
    units_per_row = k // params.unit
    data, scales, amax, s_dec = _buffers(params, m, k, groups, dev)
    if params.philox:
        rows = list(zip(seeds, offsets, strict=True))
        words = host.u64_table(rows, ["seed", "offset"])  # per group: seed, offset (lo, hi)
        philox = host_table(torch.from_numpy(words), torch.int32, dev)
    else:  # the kernel draws no random bits: its Philox table is never read
        philox = unread_table(dev, groups, 4)
    if params.global_scale:
        tile = params.amax_threads * params.amax_units
        if scope == "tensor":
            # one amax over every row: the amax kernel sees the rows as one group (slot 0),
            # then every group's slot holds it, so each group reads the same S_enc / S_dec
            table = cta_table_tensor([m], units_per_row, tile, dev)
            if len(table):
                fns["amax"](x, table, amax, len(table))
                amax = amax[:1].repeat(groups)
        else:
            table = cta_table_tensor(counts, units_per_row, tile, dev)
            if len(table):
                fns["amax"](x, table, amax, len(table))
    table = cta_table_tensor(counts, units_per_row, params.quant_threads * params.quant_units, dev)
    if len(table):
        fns["quantize"](x, data, scales, table, amax, s_dec, philox, len(table))
    parts: list[Any] = []  # every group's rows of the outputs and its S_dec, split once

    def make(g: int) -> Any:
        if counts[g] == 0:
            return None
        if not parts:  # a split each, not three calls per group
            parts.extend((data.split(list(counts)), scales.split(list(counts)), s_dec.unbind(0)))
        pieces = {"data": parts[0][g], "scales": parts[1][g], "global_scale": parts[2][g]}
        return cute_backend._quantized(
            pieces,
            "",
            fmt,
            k,
            rounding,
            rht,
            seeds[g],
            offsets[g],
            torch.Size((counts[g], k)),
            x.dtype,
        )

    out = GroupedOperands(make=make, count=groups)
    out.shapes = [None if count == 0 else (count, k) for count in counts]
    first = next(g for g, count in enumerate(counts) if count)  # x has rows: one is non-empty
    out.global_scales = s_dec
    whole = {"data": data, "scales": scales, "global_scale": s_dec[first]}
    out.whole = cute_backend._quantized(
        whole, "", fmt, k, rounding, rht, seeds[first], offsets[first], x.shape, x.dtype
    )
    return out


def _buffers(
    params: Any, m: int, k: int, groups: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A grouped rowwise launch's outputs for [m, k] rows: codes, block scales, the zeroed amax
    slots [G] and the S_dec buffer [G]: the kernel writes each group's S_dec with a global scale;
    1.0 without (NaN over it for a non-finite group); an empty group's is never read."""
    data = torch.empty((m, k * params.elem.bits // 8), dtype=torch.uint8, device=device)
    scale_dtype = torch.float32 if params.scale.kind == "fp32" else torch.uint8
    scales = torch.empty((m, k // params.block), dtype=scale_dtype, device=device)
    amax = torch.zeros(groups, dtype=torch.float32, device=device)
    make_s_dec = torch.empty if params.global_scale else torch.ones
    return data, scales, amax, make_s_dec(groups, dtype=torch.float32, device=device)


@dataclass
class StaticRowwise:
    """One device-sized grouped rowwise launch's outputs (``quantize_groups_static``): every
    row's codes [rows, K bytes] and block scales [rows, K / B] (group g's rows where its input
    rows are), and every group's S_dec, fp32 [G] (an empty group's never written)."""

    fmt: BlockFormat
    rounding: str
    rht: Any
    k: int
    dtype: torch.dtype
    data: torch.Tensor
    scales: torch.Tensor
    global_scales: torch.Tensor

    def group(self, g: int, counts: Sequence[int]) -> Any:
        """Group ``g``'s copy as a QuantizedTensor, its rows found from the routing's
        ``counts`` on the host (a check or a debugging read; None for an empty group)."""
        from fp4gen.runtime import cute_backend

        if counts[g] == 0:
            return None
        start, count = sum(counts[:g]), counts[g]
        pieces = {
            "data": self.data[start : start + count],
            "scales": self.scales[start : start + count],
            "global_scale": self.global_scales[g],
        }
        shape = torch.Size((count, self.k))
        return cute_backend._quantized(
            pieces, "", self.fmt, self.k, self.rounding, self.rht, 0, 0, shape, self.dtype
        )


def quantize_groups_static(
    x: torch.Tensor,
    groups: Any,
    fmt: BlockFormat,
    *,
    rounding: str = "nearest",
    rht: Any = None,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    scope: str = "expert",
) -> StaticRowwise:
    """``quantize_groups``' grouped launch with the groups' sizes on the device (``groups``: a
    ``grouped_static.DeviceGroups`` of x's rows): its tables built from the counts by torch ops
    at their bound's length, nothing read on the host, so a CUDA graph can replay it for any
    routing. Each group's copy is ``quantize_groups``' bit for bit, with ``seeds`` and
    ``offsets`` int64 [G] on x's device. FP4GenError where the kernels do not serve the call
    (there is no per-group fallback)."""
    from fp4gen.runtime import cute_backend
    from fp4gen.runtime.grouped_static import device_groups, philox_table, static_cta_table
    from fp4gen.runtime.loader import Unsupported

    if scope not in ("expert", "tensor"):
        raise FP4GenError(f"quantize_groups_static: scope {scope!r}; expected 'expert' or 'tensor'")
    if scope == "tensor" and not (fmt.global_scale and not fmt.global_rows):
        raise FP4GenError(
            f"quantize_groups_static: scope 'tensor' needs one global amax, which {fmt.name} "
            "has not"
        )
    if x.dim() != 2 or x.shape[0] != groups.rows:
        raise TensorError(
            f"quantize_groups_static: x of shape {tuple(x.shape)} for groups of {groups.rows} "
            "rows in all; expected a 2-D tensor of those rows"
        )
    if seeds.shape != (groups.groups,) or offsets.shape != (groups.groups,):
        raise TensorError(
            f"quantize_groups_static: seeds {tuple(seeds.shape)} and offsets "
            f"{tuple(offsets.shape)} for {groups.groups} groups; expected [G] each"
        )
    reason = _kernel_reason(x, fmt, rounding, rht)
    if reason is None:
        spec = cute_backend.spec_for(fmt, rounding, rht, x.dtype)
        loaded = cute_backend._kernels(spec)
        reason = loaded.reason if isinstance(loaded, Unsupported) else None
    if reason is None:
        module = loaded.module
        try:
            module.check_input(x)
            fns = _compile(module.PARAMS, loaded.arch, module.K_MULTIPLE)
        except (FP4GenError, _Refused) as err:
            reason = str(err)
    if reason is not None:
        raise FP4GenError(f"quantize_groups_static: {reason}")
    params = module.PARAMS
    m, k = x.shape
    dev, g = x.device, groups.groups
    units_per_row = k // params.unit
    data, scales, amax, s_dec = _buffers(params, m, k, g, dev)
    # the Philox words from the device values; a kernel without random bits reads none
    philox = philox_table(seeds, offsets[:, None]) if params.philox else unread_table(dev, g, 4)
    if params.global_scale:
        tile = params.amax_threads * params.amax_units
        if scope == "tensor":  # every row as one group (slot 0), then its amax in every slot
            every = torch.full((1,), m, dtype=torch.int32, device=dev)
            table = static_cta_table(device_groups(every, m, 1), units_per_row, tile)
            fns["amax"](x, table, amax, len(table))
            amax = amax[:1].repeat(g)
        else:
            table = static_cta_table(groups, units_per_row, tile)
            fns["amax"](x, table, amax, len(table))
    table = static_cta_table(groups, units_per_row, params.quant_threads * params.quant_units)
    fns["quantize"](x, data, scales, table, amax, s_dec, philox, len(table))
    return StaticRowwise(fmt, rounding, rht, k, x.dtype, data, scales, s_dec)


def _compile(params: Any, arch: str, k_multiple: int) -> dict[str, Any]:
    """The grouped kernels of these rowwise params for ``arch``, compiled once per process
    (JIT: ``cute.compile`` against fake tensors with dynamic sizes)."""
    from fp4gen.kernels.grouped_quantize import grouped_reason

    found = compiled_once(
        _compiled,
        _lock,
        (params, arch),
        lambda: grouped_reason(params),
        lambda: compile_grouped(params, arch, k_multiple),
        "the grouped kernels",
    )
    if isinstance(found, str):
        raise _Refused(found)
    return found


def compile_grouped(
    params: Any, arch: str, k_multiple: int, *, dump_dir: str | None = None
) -> dict[str, Any]:
    """The TVM-FFI callables of the grouped kernels ("amax" where the format has a global
    scale, "quantize") for ``arch`` ("sm_90a" or "sm_100a"); needs no GPU. With ``dump_dir`` the
    PTX is kept there."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Uint8

    from fp4gen.kernels.grouped_quantize import (
        TABLE_COLUMNS,
        GroupedRowwiseAmaxKernel,
        GroupedRowwiseQuantizeKernel,
    )

    options = f"--enable-tvm-ffi --gpu-arch {arch}"
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        options += f" --keep-ptx --dump-dir {shlex.quote(os.fspath(dump_dir))}"
    fake = cute.runtime.make_fake_compact_tensor
    m = cute.sym_int()
    x = fake(
        params.input_type,
        (m, cute.sym_int(divisibility=k_multiple)),
        stride_order=(1, 0),
        assumed_align=16,
    )
    table = fake(Int32, (cute.sym_int(), TABLE_COLUMNS), stride_order=(1, 0), assumed_align=4)
    groups = cute.sym_int()
    amax = fake(Float32, (groups,), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    fns: dict[str, Any] = {}
    if params.global_scale:
        fns["amax"] = cute.compile(
            GroupedRowwiseAmaxKernel(params, arch), x, table, amax, Int32(0), stream,
            options=options,
        )  # fmt: skip
    scale_t = Float32 if params.scale.kind == "fp32" else Uint8
    data = fake(
        Uint8,
        (m, cute.sym_int(divisibility=k_multiple * params.elem.bits // 8)),
        stride_order=(1, 0),
        assumed_align=16,
    )
    scales = fake(scale_t, (m, cute.sym_int()), stride_order=(1, 0), assumed_align=4)
    s_dec = fake(Float32, (groups,), assumed_align=4)
    philox = fake(Int32, (groups, 4), stride_order=(1, 0), assumed_align=4)
    fns["quantize"] = cute.compile(
        GroupedRowwiseQuantizeKernel(params, arch),
        x, data, scales, table, amax, s_dec, philox, Int32(0), stream,
        options=options,
    )  # fmt: skip
    return fns


__all__ = [
    "GroupedOperands",
    "LazyGroups",
    "compile_grouped",
    "cta_table",
    "cta_table_tensor",
    "quantize_groups",
    "quantize_groups_static",
    "stacked_scales",
    "StaticRowwise",
]
