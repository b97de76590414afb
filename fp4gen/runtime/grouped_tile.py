"""Grouped tile quantize: the tile kernel's copies (columnwise, rowwise + columnwise, 2D tiles)
of several groups of rows of one tensor in one launch (``fp4gen.kernels.grouped_tile``), each
group padded with zero rows to its padded row count inside the kernel and quantized as the tile
kernel quantizes a tensor of its own.

``quantize_groups_tile(x, counts, pads, fmt, copies, seeds=, offsets=)`` returns, per group of
``counts[g]`` consecutive rows of ``x`` [M, K], a tuple with one QuantizedTensor per copy of
``copies`` ((direction, rounding, rht) each, the rowwise copy first), or None for an empty group.
With ``xp`` the group's rows zero-padded to ``pads[g]`` rows, a rowwise copy is
``fp4gen.quantize(xp, fmt, rounding=, hadamard=rht, seed=seeds[g], offset=offsets[g][i])``, a
columnwise copy the same of ``xp.t()`` (with 2D blocks: the transpose of the rowwise copy, the
same codes and tile scales), bit for bit: each group its own global amax per transform (per
group, "expert" scope; ``scope="tensor"``: the largest over every group, as
``fp4gen.runtime.grouped_scope`` defines it), its own seed and offsets, its stochastic rounding
indexed inside its own padded copy. On CUDA, where the tile kernels serve the copies, two
launches (the grouped amax where the format has a global scale, then the grouped quantize)
quantize every group; anywhere else (``backend="reference"``, the CPU, a copy or input the
kernels do not take, logged once) the groups are quantized one by one by that definition.

The rowwise copies of every group are also one QuantizedTensor of all padded rows
(``GroupedCopies.wholes``, codes and block scales only: the grouped GEMMs decode every group's
block values from it in one pass). A columnwise copy is laid out per group (each group's a
contiguous tensor of its own; groups of one size, the experts' weights, also one ``whole``) or,
with ``side_by_side=True`` (the experts' tokens, for their wgrad GEMM grouped along K), every
group's side by side in one [K, sum of padded rows] QuantizedTensor (``GroupedCopies.sides``):
the K-grouped GEMMs read it whole, with no concatenation. The layouts hold the same codes and
scales at other addresses (``fp4gen.kernels.grouped_tile``).
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fp4gen.errors import FP4GenError, TensorError
from fp4gen.formats import BlockFormat
from fp4gen.runtime.grouped_quantize import GroupedOperands, LazyGroups, stacked_scales
from fp4gen.runtime.host_tables import built_on_device, host_table, spread_groups, unread_table
from fp4gen.runtime.loader import compiled_once

log = logging.getLogger(__name__)
_logged: set[str] = set()
_lock = threading.Lock()
# (grouped TileQuantizeParams, arch, side by side) -> {"amax": fn, "quantize": fn} or why they
# did not compile
_compiled: dict[tuple[Any, str, bool], dict[str, Any] | str] = {}

Copy = tuple[str, str, Any]  # (direction, rounding, rht)


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


class GroupedCopies(LazyGroups):
    """Per group a tuple of its copies' QuantizedTensors (None for an empty group), and
    ``wholes``: per copy, every group's copy as one QuantizedTensor where one launch wrote them
    (a rowwise copy; a columnwise copy of groups of one size, [groups x K, rows]), else None;
    ``global_scales``: where one launch wrote them, every group's S_dec per copy as one fp32
    [groups, copies] tensor (an empty group's row is never written), else None. From the
    kernels each copy of each group is built on first access (``make_copy(g, i)``, None for an
    empty group: ``LazyGroups``), so a consumer that reads the wholes builds none."""

    wholes: tuple[Any, ...] = ()
    global_scales: torch.Tensor | None = None
    # per copy, a side-by-side columnwise copy: every group's as one [K, sum of padded rows]
    # QuantizedTensor (group g's at its first padded row's column), else None
    sides: tuple[Any, ...] = ()

    def __init__(
        self,
        items: Any = (),
        *,
        make_copy: Any = None,
        count: int = 0,
        copies: int = 0,
    ) -> None:
        self.shapes: list[list[tuple[int, ...] | None]] | None = None  # per copy, per group
        if make_copy is None:
            super().__init__(items)
            self._copies: list[GroupedOperands] | None = None
            return
        # per copy, its groups (each entry built once); a group's tuple reads them
        self._copies = [
            GroupedOperands(make=lambda g, i=i: make_copy(g, i), count=count) for i in range(copies)
        ]
        super().__init__(make=make_copy, count=count)  # entries: ``_build``

    def _build(self, g: int) -> tuple[Any, ...] | None:
        got = tuple(copy[g] for copy in self._copies)  # type: ignore[union-attr]
        return None if got[0] is None else got

    def copy(self, i: int) -> GroupedOperands:
        """Copy ``i`` of every group (None for an empty group), with its ``whole``, ``side``
        and ``global_scales`` where one launch wrote them."""
        if self._copies is not None:
            out = GroupedOperands(make=self._copies[i].__getitem__, count=len(self))
            out.shapes = None if self.shapes is None else self.shapes[i]
        else:
            out = GroupedOperands(None if g is None else g[i] for g in self)
        out.whole = self.wholes[i] if self.wholes else None
        out.side = self.sides[i] if self.sides else None
        if self.global_scales is not None:
            out.global_scales = self.global_scales[:, i]
        return out


def group_pieces(
    codes: torch.Tensor,
    scales: torch.Tensor,
    pads: Sequence[int],
    k: int,
    bits: int,
    block: int,
    two_d: bool,
    direction: str,
    side_by_side: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Each group's (codes, scales) views of one copy's flat outputs (``codes`` uint8,
    ``scales`` one element per block), where the grouped kernels write them
    (``kernels.grouped_tile``): group g's ``pads[g]`` padded rows after the pads of the groups
    before it, rowwise [pad, K bytes] and [pad (2D: pad / B), K / B], columnwise [K, pad bytes]
    and [K (2D: K / B), pad / B] (``side_by_side``: the group's columns of the one [K, sum of
    pads] copy, strided views); None for an empty group. A split per buffer rather than two
    slices and two views per group (host calls, at 64 experts thousands)."""
    row_bytes = k * bits // 8
    if side_by_side and direction == "columnwise":
        total = sum(pads)
        code_parts = codes[: total * row_bytes].view(k, -1).split([p * bits // 8 for p in pads], 1)
        scale_parts = (
            scales[: total * (k // block)].view(k, -1).split([p // block for p in pads], 1)
        )
        return [
            None if pad == 0 else (c, s)
            for pad, c, s in zip(pads, code_parts, scale_parts, strict=True)
        ]
    scale_rows = [pad // block if two_d else pad for pad in pads]
    if direction == "rowwise":
        code_parts = codes[: sum(pads) * row_bytes].view(-1, row_bytes).split(list(pads))
        scale_parts = scales[: sum(scale_rows) * (k // block)].view(-1, k // block)
        scale_parts = scale_parts.split(scale_rows)
        return [
            None if pad == 0 else (c, s)
            for pad, c, s in zip(pads, code_parts, scale_parts, strict=True)
        ]
    code_sizes = [pad * row_bytes for pad in pads]
    scale_sizes = [rows * (k // block) for rows in scale_rows]
    k_rows = k // block if two_d else k
    if pads and pads[0] and len(set(pads)) == 1:
        # groups of one size (the experts' weight slices): one view and one unbind per buffer
        # give the same views as a split and a view per group
        groups = len(pads)
        code_views = codes[: sum(code_sizes)].view(groups, k, -1).unbind(0)
        scale_views = scales[: sum(scale_sizes)].view(groups, k_rows, -1).unbind(0)
        return list(zip(code_views, scale_views, strict=True))
    code_parts = codes[: sum(code_sizes)].split(code_sizes)
    scale_parts = scales[: sum(scale_sizes)].split(scale_sizes)
    return [
        None if pad == 0 else (c.view(k, -1), s.view(k_rows, -1))
        for pad, c, s in zip(pads, code_parts, scale_parts, strict=True)
    ]


def padded_counts(counts: Sequence[int], multiple: int) -> list[int]:
    """Each group's rows rounded up to ``multiple`` (an empty group stays empty)."""
    return [-(-n // multiple) * multiple for n in counts]


def tile_table(
    counts: Sequence[int], pads: Sequence[int], tile_m: int, tiles_k: int
) -> list[tuple[int, ...]]:
    """The CTA table of the grouped tile kernels (``fp4gen.kernels.grouped_tile``): per tile of
    ``tile_m`` padded rows x one of ``tiles_k`` column tiles of each non-empty group, a row
    (group, tile index in the group, first input row, real rows, padded rows, first padded
    row); an empty group has none."""
    _check_table(counts, pads, tile_m, tiles_k)
    rows: list[tuple[int, ...]] = []
    in_row = out_row = 0
    for g, (count, pad) in enumerate(zip(counts, pads, strict=True)):
        tiles = -(-pad // tile_m) * tiles_k
        rows += [(g, t, in_row, count, pad, out_row) for t in range(tiles)]
        in_row += count
        out_row += pad
    return rows


def _check_table(counts: Sequence[int], pads: Sequence[int], tile_m: int, tiles_k: int) -> None:
    if tile_m <= 0 or tiles_k <= 0:
        raise FP4GenError(f"tile_table: tile rows {tile_m} and column tiles {tiles_k} must be > 0")
    if len(counts) != len(pads):
        raise FP4GenError(f"tile_table: {len(counts)} groups, {len(pads)} padded counts")
    for g, (count, pad) in enumerate(zip(counts, pads, strict=True)):
        if count < 0 or pad < count or (count == 0 and pad != 0):
            raise FP4GenError(
                f"tile_table: group {g} has {count} rows padded to {pad}; expected 0 <= rows <= "
                "padded rows, and 0 padded rows for an empty group"
            )


def tile_table_tensor(
    counts: Sequence[int],
    pads: Sequence[int],
    tile_m: int,
    tiles_k: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``tile_table`` as an int32 [CTAs, 6] tensor on ``device`` (default the CPU): built on
    the host by a few numpy ops (not a Python row per CTA: thousands per launch at realistic
    sizes) and sent by one queued copy (``host_tables``), or, from
    ``host_tables.DEVICE_BUILT_ROWS`` CTAs on a CUDA device, by torch ops there
    (``host_tables.spread_groups``): the same rows."""
    _check_table(counts, pads, tile_m, tiles_k)
    device = torch.device(device or "cpu")
    if not counts:
        return torch.zeros((0, 6), dtype=torch.int32, device=device)
    c = np.asarray(counts, dtype=np.int64)
    p = np.asarray(pads, dtype=np.int64)
    tiles = -(-p // tile_m) * tiles_k
    in_rows, out_rows = np.cumsum(c) - c, np.cumsum(p) - p
    if built_on_device(int(tiles.sum()), device):
        return _spread_tile_table(tiles, c, p, in_rows, out_rows, device)
    group = np.repeat(np.arange(len(counts)), tiles)
    tile = np.arange(group.size) - (np.cumsum(tiles) - tiles)[group]
    columns = (group, tile, in_rows[group], c[group], p[group], out_rows[group])
    table = np.stack(columns, 1).astype(np.int32)
    return host_table(torch.from_numpy(table), torch.int32, device)


def _spread_tile_table(
    tiles: np.ndarray,
    counts: np.ndarray,
    pads: np.ndarray,
    in_rows: np.ndarray,
    out_rows: np.ndarray,
    device: torch.device,
) -> torch.Tensor:
    """``tile_table_tensor``'s rows built by torch ops on ``device`` (any device: the tests
    compare it with the numpy table on the CPU)."""
    per_group = np.stack((in_rows, counts, pads, out_rows))
    group, tile, (in_row, count, pad, out_row) = spread_groups(tiles, per_group, device)
    return torch.stack((group, tile, in_row, count, pad, out_row), 1)


# The tables of recent launches, by (counts, pads, tile_m, tiles_k, device): a table depends on
# nothing else, the kernels only read it, and a step asks for the same one several times (the
# experts' weights every step, a layer's token groups in its backward's launches).
_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_TABLES_KEPT = 32
_TABLES_LOCK = threading.Lock()


def cached_tile_table(
    counts: Sequence[int], pads: Sequence[int], tile_m: int, tiles_k: int, device: torch.device
) -> torch.Tensor:
    """``tile_table_tensor`` on ``device``, kept for the next launch of the same groups (the last
    32 tables; read-only: the kernels never write them). While allocations land in a CUDA
    graph's pool (a capture, torch.compile's graph warm-up: ``device_memory.pooled``) the table
    is the graph's own, neither taken from nor kept here: a captured table holds its values only
    once the graph replays, and a kept one could be dropped while a graph reads it."""
    from fp4gen.runtime.device_memory import pooled

    device = torch.device(device)
    if pooled(device):
        return tile_table_tensor(counts, pads, tile_m, tiles_k, device)
    key = (tuple(counts), tuple(pads), tile_m, tiles_k, str(device))
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is not None:
            _TABLES.move_to_end(key)
            return table
    table = tile_table_tensor(counts, pads, tile_m, tiles_k, device)
    with _TABLES_LOCK:
        _TABLES[key] = table
        if len(_TABLES) > _TABLES_KEPT:
            _TABLES.popitem(last=False)
    return table


def _check_groups(x: torch.Tensor, counts, pads, copies, seeds, offsets) -> None:
    if x.dim() != 2 or sum(counts) != x.shape[0]:
        raise TensorError(
            f"quantize_groups_tile: x of shape {tuple(x.shape)} for groups of {list(counts)} "
            "rows; expected a 2-D tensor whose rows the groups cover exactly"
        )
    if not len(counts) == len(pads) == len(seeds) == len(offsets):
        raise FP4GenError(
            f"quantize_groups_tile: {len(counts)} groups, {len(pads)} padded counts, "
            f"{len(seeds)} seeds, {len(offsets)} offset tuples"
        )
    for g, (count, pad) in enumerate(zip(counts, pads, strict=True)):
        if pad < count or (count == 0 and pad != 0):
            raise FP4GenError(
                f"quantize_groups_tile: group {g} has {count} rows padded to {pad}; expected "
                "rows <= padded rows, and 0 padded rows for an empty group"
            )
    directions = tuple(d for d, _, _ in copies)
    if directions not in (("rowwise",), ("columnwise",), ("rowwise", "columnwise")):
        raise FP4GenError(
            f"quantize_groups_tile: copies {directions}; expected rowwise, columnwise or both, "
            "in that order"
        )
    if set(map(len, offsets)) - {len(copies)}:
        raise FP4GenError("quantize_groups_tile: one Philox offset per copy and group")


def quantize_groups_tile(
    x: torch.Tensor,
    counts: Sequence[int],
    pads: Sequence[int],
    fmt: BlockFormat,
    copies: Sequence[Copy],
    *,
    seeds: Sequence[int],
    offsets: Sequence[Sequence[int]],
    backend: str = "auto",
    scope: str = "expert",
    side_by_side: bool = False,
) -> GroupedCopies:
    """Per group the tuple of its copies, None for an empty group (module docstring).
    ``backend``: "auto" the grouped tile kernels where they serve (else the groups one by one,
    the reason logged once at INFO), "cute" requires them, "reference" quantizes each group by
    the definition. ``scope``: "expert" gives each group its own global amaxes, "tensor" every
    group the largest of them (a format with one global amax). ``side_by_side``: the kernels
    lay a 1D columnwise copy out side by side (``GroupedCopies.sides``; 2D blocks and the
    definition: per group); the groups' copies are the same."""
    copies = tuple(copies)
    if scope not in ("expert", "tensor"):
        raise FP4GenError(f"quantize_groups_tile: scope {scope!r}; expected 'expert' or 'tensor'")
    if scope == "tensor" and not (fmt.global_scale and not fmt.global_rows):
        raise FP4GenError(
            f"quantize_groups_tile: scope 'tensor' needs one global amax, which {fmt.name} has not"
        )
    _check_groups(x, counts, pads, copies, seeds, offsets)
    if backend != "reference":
        reason = _kernel_reason(x, fmt, copies)
        if reason is None:
            try:
                return _grouped_kernels(
                    x, counts, pads, fmt, copies, seeds, offsets, scope, side_by_side
                )
            except _Refused as refused:
                reason = str(refused)
        if backend == "cute":
            raise FP4GenError(f"quantize_groups_tile(backend='cute'): {reason}")
        _log_once(f"the groups' tile copies are quantized one by one: {reason}")
    return reference_groups_tile(x, counts, pads, fmt, copies, seeds, offsets, backend, scope)


def reference_groups_tile(
    x: torch.Tensor,
    counts: Sequence[int],
    pads: Sequence[int],
    fmt: BlockFormat,
    copies: Sequence[Copy],
    seeds: Sequence[int],
    offsets: Sequence[Sequence[int]],
    backend: str = "reference",
    scope: str = "expert",
) -> GroupedCopies:
    """The definition the kernels are held to (module docstring): each group's rows padded,
    each copy quantized on its own (``fp4gen.quantize``; the per-tensor scope by
    ``grouped_scope.quantize_scoped`` with the largest amax of every group's copy)."""
    from fp4gen.dsl.model import OperandSpec
    from fp4gen.runtime.grouped_scope import quantize_scoped, values_amax
    from fp4gen.runtime.operands import pad_to
    from fp4gen.runtime.quantize_dispatch import quantize

    def tensor_of(xp: torch.Tensor, direction: str) -> torch.Tensor:
        # 2D: the columnwise copy is the transpose of the rowwise one (quantized from xp)
        return xp.t().contiguous() if direction == "columnwise" and not fmt.is_2d else xp

    padded: list[torch.Tensor | None] = []
    start = 0
    for count, pad in zip(counts, pads, strict=True):
        rows = x[start : start + count]
        padded.append(None if count == 0 else pad_to(rows, pad, x.shape[1]))
        start += count
    amaxes: list[torch.Tensor | None] = [None] * len(copies)
    if scope == "tensor":
        for i, (direction, rounding, rht) in enumerate(copies):
            spec = OperandSpec(fmt, rounding, rht)  # type: ignore[arg-type]
            found = [values_amax(tensor_of(xp, direction), spec) for xp in padded if xp is not None]
            if found:
                amaxes[i] = torch.stack(found).amax()
    out = GroupedCopies()
    for g, xp in enumerate(padded):
        if xp is None:
            out.append(None)
            continue
        group = []
        for i, (direction, rounding, rht) in enumerate(copies):
            t = tensor_of(xp, direction)
            if amaxes[i] is not None:
                spec = OperandSpec(fmt, rounding, rht)  # type: ignore[arg-type]
                q = quantize_scoped(
                    t, spec, amaxes[i], seed=seeds[g], offset=offsets[g][i], backend=backend
                )
            else:
                q = quantize(
                    t,
                    fmt,
                    rounding=rounding,
                    hadamard=rht,
                    seed=seeds[g],
                    offset=offsets[g][i],
                    backend=backend,
                )
            group.append(q.transpose() if direction == "columnwise" and fmt.is_2d else q)
        out.append(tuple(group))
    columns = [stacked_scales(out.copy(i)) for i in range(len(copies))]
    if columns and all(c is not None for c in columns):
        out.global_scales = torch.stack(columns, 1)  # type: ignore[arg-type]
    return out


class _Refused(Exception):
    """The grouped tile kernels do not serve this call; ``args[0]`` says why."""


def k_reason(k: int, fmt: BlockFormat) -> str | None:
    """Why the grouped tile kernels cannot lay out K = ``k`` columns of ``fmt``, or None. Their
    outputs hold K / B scales per padded row (rowwise) and K x rows / B (columnwise), and a
    group's scales start at its first row times K / B (``kernels.grouped_tile.group_offsets``):
    exact only for K a multiple of the block length B. Any other K would make the kernel write
    a partial block's scales past the buffers and the groups' columnwise scales overlap."""
    block = max(fmt.block)
    if k % block:
        return f"K = {k} is not a multiple of the block length {block}"
    return None


def _kernel_reason(x: torch.Tensor, fmt: BlockFormat, copies: tuple[Copy, ...]) -> str | None:
    if isinstance(fmt, BlockFormat) and fmt.global_rows:
        return f"{fmt.name}: per-row global scales (the grouped kernels keep one per group)"
    if not x.is_cuda:
        return "a CPU tensor"
    if not isinstance(fmt, BlockFormat):
        return f"{fmt}: not a block format"
    if x.dim() == 2 and (reason := k_reason(x.shape[1], fmt)) is not None:
        return reason
    if fmt.is_2d and any(r != "nearest" or h is not None for _, r, h in copies):
        # the tile kernel's 2D copies are one set of codes, drawn as the rowwise copy draws
        return "2D blocks with stochastic rounding or an RHT"
    if x.numel() == 0:
        return "no rows"
    if not x.is_contiguous() or x.data_ptr() % 16:
        return "an input that is not contiguous and 16-byte aligned"
    return None


def _module(fmt: BlockFormat, x: torch.Tensor, copies: tuple[Copy, ...]) -> Any:
    """The generated tile module of these copies (the tile kernel's variant), or _Refused."""
    from fp4gen.compiler.plan import (
        redrawn_tile_reason,
        rowwise_only_reason,
        tile_reason,
        unnested_rht_reason,
    )
    from fp4gen.compiler.spec import QuantOutput
    from fp4gen.runtime import cute_backend
    from fp4gen.runtime.loader import Unsupported

    reason = cute_backend.options_off_reason(fmt, tuple(h for _, _, h in copies))
    reason = reason or rowwise_only_reason(fmt) or tile_reason(fmt)
    for _, _, rht in copies:
        reason = reason or redrawn_tile_reason(rht) or unnested_rht_reason(fmt, rht)
    if reason is not None:
        raise _Refused(reason)
    try:
        spec = cute_backend._spec(fmt, x.dtype, tuple(QuantOutput(d, r, h) for d, r, h in copies))  # type: ignore[arg-type]
    except (FP4GenError, NotImplementedError, ValueError) as err:
        raise _Refused(str(err)) from err
    loaded = cute_backend._kernels(spec)
    if isinstance(loaded, Unsupported):
        raise _Refused(loaded.reason)
    module = loaded.module
    if not hasattr(module, "QUANT_PARAMS"):
        raise _Refused(f"{spec.name} is not a tile kernel")
    return module, loaded.arch


def _grouped_kernels(
    x: torch.Tensor,
    counts: Sequence[int],
    pads: Sequence[int],
    fmt: BlockFormat,
    copies: tuple[Copy, ...],
    seeds: Sequence[int],
    offsets: Sequence[Sequence[int]],
    scope: str,
    side_by_side: bool = False,
) -> GroupedCopies:
    from fp4gen.kernels import host
    from fp4gen.kernels.grouped_tile import grouped_params
    from fp4gen.runtime import cute_backend, finite

    module, arch = _module(fmt, x, copies)
    params = grouped_params(module.QUANT_PARAMS)
    m, k = x.shape
    if k % module.K_MULTIPLE:
        raise _Refused(f"K = {k} is not a multiple of {module.K_MULTIPLE}")
    multiple = _row_multiple(module, params)
    if [pad for pad in pads if pad % multiple]:
        raise _Refused(f"padded group rows {list(pads)} are not multiples of {multiple}")
    total = sum(pads)
    if max(m, total) * k >= 2**31:
        raise _Refused(f"{max(m, total)} x {k} values: the kernels index with int32")
    side_by_side = side_by_side and params.copy("col") is not None and not params.two_d
    fns = _compile(params, arch, module.K_MULTIPLE, side_by_side)
    dev = x.device
    groups = len(counts)
    bits, block = params.elem.bits, params.block
    outs = _outputs(params, total, k, dev)
    n_copies = len(params.copies)
    amax, s_dec = _scalars(params, groups, dev)
    sr_copies = [i for i, c in enumerate(params.copies) if c.sr_bits]
    if params.sr:
        # per group: the seed, then each stochastically rounded copy's offset (lo, hi words)
        columns = [seeds, *([offs[i] for offs in offsets] for i in sr_copies)]
        rows = list(zip(*columns, strict=True))
        words = host.u64_table(rows, ["seed", *["offset"] * len(sr_copies)])
        philox = host_table(torch.from_numpy(words), torch.int32, dev)
    else:  # no copy draws random bits: the Philox table is never read
        philox = unread_table(dev, groups, 2)
    tiles_k = -(-k // params.strip.tile_k)
    table = cached_tile_table(counts, pads, params.strip.tile_m, tiles_k, dev)
    # non-finite inputs: the kernels make the group's S_dec NaN; outside a propagating scope
    # the input is checked as the tile kernel's is
    flag = None if finite.propagates() else finite.check(x, "the input of shape {}", x.shape)
    s_dec = _launch(fns, params, x, outs, table, amax, s_dec, philox, total, scope, groups)
    scales_per_row = k // block
    # every group's views of a copy's outputs, and its S_dec: a few calls per copy, made on the
    # first read of one of that copy's groups (a consumer of the rowwise groups makes no views
    # of the columnwise copy: at 64 unequal groups those are two views per group)
    views: dict[int, Any] = {}

    def make_copy(g: int, i: int) -> Any:
        count, pad = counts[g], pads[g]
        if count == 0:
            return None
        direction, rounding, rht = copies[i]
        if i not in views:
            views[i] = (
                group_pieces(*outs["row" if direction == "rowwise" else "col"], pads, k, bits,
                             block, params.two_d, direction, side_by_side),
                s_dec[:, i].unbind(0),
            )  # fmt: skip
        (codes, scales), s_decs = views[i][0][g], views[i][1]
        if side_by_side and direction == "columnwise":
            # a group read on its own is a [K, pad] tensor of its own, as the per-group
            # layout gives it (its consumers take contiguous codes and scales)
            codes, scales = codes.contiguous(), scales.contiguous()
        shape, cols = ((pad, k), k) if direction == "rowwise" else ((k, pad), pad)
        pieces = {"data": codes, "scales": scales, "global_scale": s_decs[g]}
        return cute_backend._quantized(
            pieces,
            "",
            fmt,
            cols,
            rounding,
            rht,
            seeds[g],
            offsets[g][i],
            torch.Size(shape),
            x.dtype,
            flag,
        )  # fmt: skip

    result = GroupedCopies(make_copy=make_copy, count=groups, copies=n_copies)
    result.shapes = [
        [
            None if count == 0 else ((pad, k) if direction == "rowwise" else (k, pad))
            for count, pad in zip(counts, pads, strict=True)
        ]
        for direction, _, _ in copies
    ]
    first = next(g for g, count in enumerate(counts) if count)  # x has rows: one is non-empty
    sides = []
    for i, (direction, rounding, rht) in enumerate(copies):
        if not (side_by_side and direction == "columnwise"):
            sides.append(None)
            continue
        codes, scales = outs["col"]
        pieces = {
            "data": codes.view(k, -1),
            "scales": scales.view(k, total // block),
            "global_scale": s_dec[first, i],
        }
        sides.append(
            cute_backend._quantized(
                pieces,
                "",
                fmt,
                total,
                rounding,
                rht,
                seeds[first],
                offsets[first][i],
                torch.Size((k, total)),
                x.dtype,
                flag,
            )  # fmt: skip
        )
    result.sides = tuple(sides)
    wholes = []
    for i, (direction, rounding, rht) in enumerate(copies):
        if direction == "rowwise":
            shape, cols = (total, k), k
            codes, scales = outs["row"]
            scales = scales.view(-1, scales_per_row)
        elif len(set(pads)) == 1 and not side_by_side:
            # groups of one size (the experts' weight slices): their [K, rows] copies one after
            # another are one [groups x K, rows] tensor (the dgrad weights of 2D blocks)
            shape, cols = (groups * k, pads[0]), pads[0]
            codes, scales = outs["col"]
            scales = scales.view(-1, pads[0] // block)
        else:
            wholes.append(None)
            continue
        pieces = {
            "data": codes.view(shape[0], -1),
            "scales": scales,
            "global_scale": s_dec[first, i],
        }
        wholes.append(
            cute_backend._quantized(
                pieces,
                "",
                fmt,
                cols,
                rounding,
                rht,
                seeds[first],
                offsets[first][i],
                torch.Size(shape),
                x.dtype,
            )  # fmt: skip
        )
    result.wholes = tuple(wholes)
    result.global_scales = s_dec
    return result


@dataclass
class StaticTileCopies:
    """One device-sized grouped tile launch's outputs (``quantize_groups_tile_static``), as the
    kernels wrote them, at the groups' bound (``groups.bound`` padded rows): per copy (the
    rowwise one first) its codes and scales, a rowwise copy [bound, K bytes] and [bound, K / B],
    a columnwise copy side by side [K, bound bytes] and [K, bound / B] (group g's at its first
    padded row); every group's S_dec per copy, fp32 [G, copies]. Rows and columns past the
    groups' last padded row hold nothing."""

    fmt: BlockFormat
    copies: tuple[Copy, ...]
    k: int
    bits: int  # the stored bits of a code
    block: int  # the block length
    dtype: torch.dtype
    groups: Any  # grouped_static.DeviceGroups
    codes: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...]
    global_scales: torch.Tensor

    def group(self, g: int, i: int, counts: Sequence[int]) -> Any:
        """Group ``g``'s copy ``i`` as a QuantizedTensor, its place found from the routing's
        ``counts`` on the host (a check or a debugging read; None for an empty group)."""
        from fp4gen.runtime import cute_backend

        pads = padded_counts(counts, self.groups.multiple)
        if pads[g] == 0:
            return None
        start, pad = sum(pads[:g]), pads[g]
        direction, rounding, rht = self.copies[i]
        bits, block = self.bits, self.block
        if direction == "rowwise":
            codes, scales = self.codes[i][start : start + pad], self.scales[i][start : start + pad]
            shape, cols = (pad, self.k), self.k
        else:
            codes = self.codes[i][:, start * bits // 8 : (start + pad) * bits // 8]
            scales = self.scales[i][:, start // block : (start + pad) // block]
            shape, cols = (self.k, pad), pad
        pieces = {
            "data": codes.contiguous(),
            "scales": scales.contiguous(),
            "global_scale": self.global_scales[g, i],
        }
        return cute_backend._quantized(
            pieces, "", self.fmt, cols, rounding, rht, 0, 0, torch.Size(shape), self.dtype
        )


def quantize_groups_tile_static(
    x: torch.Tensor,
    groups: Any,
    fmt: BlockFormat,
    copies: Sequence[Copy],
    *,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    scope: str = "expert",
) -> StaticTileCopies:
    """The grouped tile launch of ``quantize_groups_tile`` with the groups' sizes on the device
    (``groups``: a ``grouped_static.DeviceGroups`` of x's rows): every table from the counts by
    torch ops, every size from the groups' bound, nothing read on the host, so a CUDA graph can
    replay it for any routing (``fp4gen.runtime.grouped_static``). Each group's copies are
    ``quantize_groups_tile``'s bit for bit, with ``seeds`` int64 [G] and ``offsets`` int64
    [G, copies] on x's device (each copy's Philox offset per group); a columnwise copy is laid
    out side by side. 1D blocks only (the experts' weights are of one size: the host launch
    serves them). A non-finite input makes its group's S_dec NaN inside a propagating scope
    (``fp4gen.runtime.finite``); outside one the input is checked first (a host read).
    FP4GenError where the kernels do not serve the call: there is no per-group fallback."""
    from fp4gen.kernels.grouped_tile import grouped_params
    from fp4gen.runtime import finite
    from fp4gen.runtime.grouped_static import philox_table, static_tile_table

    copies = tuple(copies)
    if scope not in ("expert", "tensor"):
        raise FP4GenError(
            f"quantize_groups_tile_static: scope {scope!r}; expected 'expert' or 'tensor'"
        )
    if x.dim() != 2 or x.shape[0] != groups.rows:
        raise TensorError(
            f"quantize_groups_tile_static: x of shape {tuple(x.shape)} for groups of "
            f"{groups.rows} rows in all; expected a 2-D tensor of those rows"
        )
    if tuple(offsets.shape) != (groups.groups, len(copies)) or seeds.shape != (groups.groups,):
        raise TensorError(
            f"quantize_groups_tile_static: seeds {tuple(seeds.shape)} and offsets "
            f"{tuple(offsets.shape)} for {groups.groups} groups and {len(copies)} copies; "
            "expected [G] and [G, copies]"
        )
    _check_groups(x, [groups.rows], [groups.rows], copies, [0], [(0,) * len(copies)])
    reason = _kernel_reason(x, fmt, copies)
    if reason is None:
        try:
            module, arch = _module(fmt, x, copies)
        except _Refused as refused:
            reason = str(refused)
    if reason is not None:
        raise FP4GenError(f"quantize_groups_tile_static: {reason}")
    params = grouped_params(module.QUANT_PARAMS)
    k = x.shape[1]
    multiple = _row_multiple(module, params)
    problem = None
    if params.two_d:
        problem = "2D blocks (the host launch quantizes the experts' weights)"
    elif k % module.K_MULTIPLE:
        problem = f"K = {k} is not a multiple of {module.K_MULTIPLE}"
    elif groups.multiple % multiple:
        problem = f"the groups' padding multiple {groups.multiple} is not one of {multiple}"
    elif max(groups.rows, groups.bound) * k >= 2**31:
        problem = f"{groups.bound} x {k} values: the kernels index with int32"
    if problem is not None:
        raise FP4GenError(f"quantize_groups_tile_static: {problem}")
    try:
        fns = _compile(params, arch, module.K_MULTIPLE, params.copy("col") is not None)
    except _Refused as refused:
        raise FP4GenError(f"quantize_groups_tile_static: {refused}") from None
    dev, g = x.device, groups.groups
    outs = _outputs(params, groups.bound, k, dev)
    amax, s_dec = _scalars(params, g, dev)
    if params.sr:
        # the stochastically rounded copies' columns by views (a list index would be a host
        # copy, which a capture refuses)
        sr = torch.stack([offsets[:, i] for i, c in enumerate(params.copies) if c.sr_bits], 1)
        philox = philox_table(seeds, sr)
    else:
        philox = unread_table(dev, g, 2)
    table = static_tile_table(groups, params.strip.tile_m, -(-k // params.strip.tile_k))
    if not finite.propagates():
        finite.check(x, "the input of shape {}", x.shape)
    s_dec = _launch(fns, params, x, outs, table, amax, s_dec, philox, groups.bound, scope, g)
    bits, block = params.elem.bits, params.block
    codes, scales = [], []
    for direction, _, _ in copies:
        q, sc = outs["row" if direction == "rowwise" else "col"]
        if direction == "rowwise":
            codes.append(q.view(groups.bound, -1))
            scales.append(sc.view(groups.bound, k // block))
        else:
            codes.append(q.view(k, groups.bound * bits // 8))
            scales.append(sc.view(k, groups.bound // block))
    return StaticTileCopies(
        fmt, copies, k, bits, block, x.dtype, groups, tuple(codes), tuple(scales), s_dec
    )


def _row_multiple(module: Any, params: Any) -> int:
    """What every group's padded rows must be a multiple of: the kernel's M multiple, and with a
    columnwise copy or 2D tiles whole blocks (their scales' offsets, code words, RHT chunks)."""
    if params.copy("col") is not None or params.two_d:
        return math.lcm(module.M_MULTIPLE, params.block)
    return module.M_MULTIPLE


def _outputs(
    params: Any, rows: int, k: int, device: torch.device
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each copy's flat (codes, scales) buffers for ``rows`` padded rows of K = ``k`` values;
    one-element stand-ins for a copy the params lack (never written)."""
    bits, block = params.elem.bits, params.block
    scale_dtype = torch.float32 if params.strip.fp32_scales else torch.uint8
    scale_rows = rows // block if params.two_d else rows
    outs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for tag in ("row", "col"):
        if params.copy(tag) is None:
            outs[tag] = (
                torch.empty(1, dtype=torch.uint8, device=device),
                torch.empty(1, dtype=scale_dtype, device=device),
            )
        else:
            outs[tag] = (
                torch.empty(rows * k * bits // 8, dtype=torch.uint8, device=device),
                torch.empty(scale_rows * (k // block), dtype=scale_dtype, device=device),
            )
    return outs


def _scalars(params: Any, groups: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The zeroed amax slots [G x slots] and the S_dec buffer [G x copies]: the kernel writes
    each group's S_dec with a global scale; 1.0 without (NaN over it for a non-finite group); an
    empty group's is never read."""
    amax = torch.zeros(groups * params.slots, dtype=torch.float32, device=device)
    s_dec = (torch.empty if params.global_scale else torch.ones)(
        groups * len(params.copies), dtype=torch.float32, device=device
    )
    return amax, s_dec


def _launch(
    fns: dict[str, Any],
    params: Any,
    x: torch.Tensor,
    outs: dict[str, tuple[torch.Tensor, torch.Tensor]],
    table: torch.Tensor,
    amax: torch.Tensor,
    s_dec: torch.Tensor,
    philox: torch.Tensor,
    rows: int,
    scope: str,
    groups: int,
) -> torch.Tensor:
    """The grouped amax launch (with a global scale; ``scope="tensor"``: then every group
    reads the largest amax of each slot) and the grouped quantize launch over ``table``'s CTAs;
    ``rows``: the padded rows of the outputs (a side-by-side copy's columns). Returns the S_decs
    as [G, copies]."""
    n_ctas = table.shape[0]
    if params.global_scale:
        fns["amax"](x, table, amax, n_ctas)
        if scope == "tensor":
            amax = amax.view(groups, params.slots).amax(dim=0).repeat(groups)
    (q_row, s_row), (q_col, s_col) = outs["row"], outs["col"]
    fns["quantize"](x, q_row, s_row, q_col, s_col, table, amax, s_dec, philox, n_ctas, rows)
    return s_dec.view(groups, len(params.copies))


def _compile(params: Any, arch: str, k_multiple: int, side_by_side: bool) -> dict[str, Any]:
    """The grouped tile kernels of these (grouped) params and columnwise layout for ``arch``,
    compiled once per process."""
    from fp4gen.kernels.grouped_tile import grouped_tile_reason

    found = compiled_once(
        _compiled,
        _lock,
        (params, arch, side_by_side),
        lambda: grouped_tile_reason(params),
        lambda: compile_grouped_tile(params, arch, k_multiple, side_by_side=side_by_side),
        "the grouped tile kernels",
    )
    if isinstance(found, str):
        raise _Refused(found)
    return found


def compile_grouped_tile(
    params: Any,
    arch: str,
    k_multiple: int,
    *,
    side_by_side: bool = False,
    dump_dir: str | None = None,
) -> dict[str, Any]:
    """The TVM-FFI callables of the grouped tile kernels ("amax" where the format has a global
    scale, "quantize") of grouped params (``grouped_params``) for ``arch`` ("sm_90a" or
    "sm_100a"), the columnwise copy laid out ``side_by_side`` or per group; needs no GPU. With
    ``dump_dir`` the PTX is kept there."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Uint8

    from fp4gen.kernels.grouped_tile import (
        TABLE_COLUMNS,
        GroupedTileAmaxKernel,
        GroupedTileQuantizeKernel,
    )

    options = f"--enable-tvm-ffi --gpu-arch {arch}"
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        options += f" --keep-ptx --dump-dir {shlex.quote(os.fspath(dump_dir))}"
    fake = cute.runtime.make_fake_compact_tensor
    x = fake(
        params.strip.input_type,
        (cute.sym_int(), cute.sym_int(divisibility=k_multiple)),
        stride_order=(1, 0),
        assumed_align=16,
    )
    table = fake(Int32, (cute.sym_int(), TABLE_COLUMNS), stride_order=(1, 0), assumed_align=4)
    amax = fake(Float32, (cute.sym_int(),), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    fns: dict[str, Any] = {}
    if params.global_scale:
        fns["amax"] = cute.compile(
            GroupedTileAmaxKernel(params.amax_params(), arch), x, table, amax, Int32(0), stream,
            options=options,
        )  # fmt: skip
    scale_t = Float32 if params.strip.fp32_scales else Uint8
    codes = [fake(Uint8, (cute.sym_int(),), assumed_align=1) for _ in range(2)]
    scales = [fake(scale_t, (cute.sym_int(),), assumed_align=4) for _ in range(2)]
    s_dec = fake(Float32, (cute.sym_int(),), assumed_align=4)
    philox_cols = 2 + 2 * params.n_sr
    philox = fake(Int32, (cute.sym_int(), philox_cols), stride_order=(1, 0), assumed_align=4)
    fns["quantize"] = cute.compile(
        GroupedTileQuantizeKernel(params, arch, side_by_side),
        x, codes[0], scales[0], codes[1], scales[1], table, amax, s_dec, philox, Int32(0),
        Int32(0), stream,
        options=options,
    )  # fmt: skip
    return fns


__all__ = [
    "GroupedCopies",
    "StaticTileCopies",
    "cached_tile_table",
    "compile_grouped_tile",
    "k_reason",
    "padded_counts",
    "quantize_groups_tile",
    "quantize_groups_tile_static",
    "reference_groups_tile",
    "tile_table",
    "tile_table_tensor",
]
