"""Routed groups whose sizes live on the device: the tables a grouped launch needs, at lengths
that hold for any routing, so that one CUDA graph can replay the launch for every routing.

The grouped launches of ``fp4gen.runtime.grouped_tile`` and ``grouped_quantize`` take the
groups' row counts as host ints: the host reads the routing's counts once per MoE layer (a
wait that drains the GPU's queue) and sizes every table and buffer from them. A CUDA graph of
the layer (docs/moe.md, "What the layer goals need") replays one set of launches for every
routing, so there the counts stay a device tensor and every size comes from a bound that holds
for any split of the layer's R routed rows over its G groups:

- **padded rows.** Each group's rows rounded up to a multiple b (0 stays 0) sum to at most
  R + G (b - 1); ``padded_bound`` rounds that up to b. The padded copies, side by side or one
  after another, fit a buffer of that many rows; the rows past the groups' last are never
  written or read.
- **CTAs.** A tile kernel runs ceil(P_g / tile_m) x tiles_k CTAs for a group of P_g padded rows:
  at most (Σ P_g + G (tile_m - 1)) / tile_m row tiles in all (``tile_ctas_bound``); the rowwise
  kernel ceil(U_g / tile) for U_g units (``rowwise_ctas_bound``).

The tables are built by torch ops on the device from the counts alone: no host read, so a
capture records them. Past the real CTAs a table repeats its last real CTA: that CTA reads and
writes what the last real one does (the same amax into the same slot, the same codes, scales and
S_dec at the same place: its group's, its seed's stream), so a launch of the bound's CTAs gives
what a launch of the real ones gives. The rows of the real CTAs are the host tables' rows
(``grouped_tile.tile_table``, ``grouped_quantize.cta_table``), tested on the CPU against them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4gen.errors import TensorError

_WORD = 1 << 32


def padded_bound(rows: int, groups: int, multiple: int) -> int:
    """The most padded rows ``rows`` routed rows split over ``groups`` groups can take, each
    group's count rounded up to ``multiple``: R + G (b - 1), rounded up to b."""
    most = rows + groups * (multiple - 1)
    return -(-most // multiple) * multiple


def tile_ctas_bound(padded: int, groups: int, tile_m: int, tiles_k: int) -> int:
    """The most CTAs of a grouped tile launch over at most ``padded`` padded rows in ``groups``
    groups: Σ ceil(P_g / tile_m) <= (Σ P_g + G (tile_m - 1)) / tile_m row tiles, each
    ``tiles_k`` CTAs."""
    return (padded + groups * (tile_m - 1)) // tile_m * tiles_k


def rowwise_ctas_bound(rows: int, groups: int, units_per_row: int, tile: int) -> int:
    """The most CTAs of a grouped rowwise launch over ``rows`` rows in ``groups`` groups (a CTA
    per ``tile`` units of one group)."""
    return (rows * units_per_row + groups * (tile - 1)) // tile


@dataclass(frozen=True)
class DeviceGroups:
    """Groups of consecutive rows of a [rows, K] tensor, their counts on the device (int32 [G]
    each, on the counts' device): each group's rows, padded rows (rounded up to ``multiple``),
    first input row and first padded row. ``bound``: the padded rows of any routing fit it
    (``padded_bound``)."""

    counts: torch.Tensor
    pads: torch.Tensor
    in_rows: torch.Tensor
    out_rows: torch.Tensor
    rows: int
    multiple: int
    bound: int

    @property
    def groups(self) -> int:
        return self.counts.shape[0]


def device_groups(counts: torch.Tensor, rows: int, multiple: int) -> DeviceGroups:
    """The groups of ``counts`` (an integer [G] tensor whose sum is ``rows``, read by no host
    op: its sum is the caller's promise, as a routing's is T k) padded to ``multiple``."""
    if counts.dim() != 1 or counts.dtype not in (torch.int32, torch.int64):
        raise TensorError(
            f"device_groups: counts of shape {tuple(counts.shape)} and dtype {counts.dtype}; "
            "expected a 1-D int32 or int64 tensor (rows per group)"
        )
    if rows < 1 or multiple < 1 or counts.shape[0] < 1:
        raise TensorError(
            f"device_groups: {rows} rows in {counts.shape[0]} groups padded to {multiple}; "
            "expected at least one row, one group and a multiple >= 1"
        )
    c = counts.to(torch.int32)
    pads = (c + (multiple - 1)) // multiple * multiple
    in_rows = (torch.cumsum(c, 0, dtype=torch.int32) - c).to(torch.int32)
    out_rows = (torch.cumsum(pads, 0, dtype=torch.int32) - pads).to(torch.int32)
    bound = padded_bound(rows, counts.shape[0], multiple)
    return DeviceGroups(c, pads, in_rows, out_rows, rows, multiple, bound)


@dataclass(frozen=True)
class DeviceRouting:
    """A top-k routing of T tokens over E experts as device tensors of fixed shapes: the T k
    (token, choice) slots sorted by expert (``order``: stable, so within an expert in the
    loop's order, [k, tokens] row-major), each sorted slot's token and top-k position, and the
    groups of sorted rows: one per expert, then one of the slots routed to no expert here
    (an expert-parallel sentinel outside [0, E)), which sort last. ``groups`` has E + 1
    groups of T k rows in all, padded to the multiple asked for."""

    order: torch.Tensor
    token_idx: torch.Tensor
    top_k_pos: torch.Tensor
    groups: DeviceGroups


def device_routing(top_k_index: torch.Tensor, num_experts: int, multiple: int) -> DeviceRouting:
    """The routing of ``top_k_index`` ([T, k] expert ids) as ``GroupedExperts``' grouped path
    sorts it (``runtime.experts``: the same order and counts), with no host read: the counts
    stay a device tensor and every shape is fixed by T and k."""
    if top_k_index.dim() != 2 or top_k_index.dtype.is_floating_point or num_experts < 1:
        raise TensorError(
            f"device_routing: top_k_index of shape {tuple(top_k_index.shape)} and dtype "
            f"{top_k_index.dtype} over {num_experts} experts; expected [tokens, k] integer "
            "expert ids and at least one expert"
        )
    tokens, k = top_k_index.shape
    flat = top_k_index.t().reshape(-1)  # k-major: the loop's order within an expert
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=key.device)
    counts.index_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    order = torch.argsort(key, stable=True)
    groups = device_groups(counts, tokens * k, multiple)
    return DeviceRouting(order, order % tokens, order // tokens, groups)


def _spread(per_group: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For groups of ``per_group[g]`` table rows each (int32 [G], group after group; at least
    one in all): each of ``n_rows`` rows' group and its index within its group, the rows past
    the real ones given the last real row's. A row's group is the last one whose first row is at
    or before it, which skips the empty groups (they share their first row with the next)."""
    ends = torch.cumsum(per_group, 0, dtype=torch.int32)
    first = ends - per_group
    index = torch.arange(n_rows, dtype=torch.int32, device=per_group.device)
    index = torch.minimum(index, ends[-1:] - 1)  # past the real rows: the last real one
    group = torch.searchsorted(first, index, right=True, out_int32=True).sub_(1)
    return group, index - first.index_select(0, group)


def static_tile_table(groups: DeviceGroups, tile_m: int, tiles_k: int) -> torch.Tensor:
    """The grouped tile kernels' CTA table (``fp4gen.kernels.grouped_tile``: group, tile in the
    group, first input row, real rows, padded rows, first padded row) at its bound's length
    (``tile_ctas_bound``): the host table's rows, then copies of its last row."""
    n = tile_ctas_bound(groups.bound, groups.groups, tile_m, tiles_k)
    tiles = (groups.pads + (tile_m - 1)) // tile_m * tiles_k
    group, tile = _spread(tiles, n)
    picked = torch.stack((groups.in_rows, groups.counts, groups.pads, groups.out_rows))
    picked = picked.index_select(1, group)
    return torch.stack((group, tile, *picked), 1)


def static_cta_table(groups: DeviceGroups, units_per_row: int, tile: int) -> torch.Tensor:
    """The grouped rowwise kernels' CTA table (``fp4gen.kernels.grouped_quantize``: group,
    first unit of the tile, end unit and first unit of the group) of the groups' real rows at
    its bound's length (``rowwise_ctas_bound``): the host table's rows, then copies of its last
    row."""
    n = rowwise_ctas_bound(groups.rows, groups.groups, units_per_row, tile)
    units = groups.counts * units_per_row
    starts = groups.in_rows * units_per_row
    group, index = _spread((units + (tile - 1)) // tile, n)
    start = starts.index_select(0, group)
    end = start + units.index_select(0, group)
    return torch.stack((group, start + index * tile, end, start), 1)


def _words(values: torch.Tensor) -> torch.Tensor:
    """64-bit values (int64, 0 <= v < 2**64 as their bit pattern) as (lo, hi) int32 words, each
    word's bit pattern: [..., 2]."""
    lo = values & (_WORD - 1)
    hi = (values >> 32) & (_WORD - 1)
    words = torch.stack((lo, hi), -1)
    return torch.where(words >= _WORD // 2, words - _WORD, words).to(torch.int32)


def philox_table(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The grouped kernels' Philox table from device values: per group its seed and each
    stochastically rounded copy's offset as (lo, hi) int32 words: int32 [G, 2 + 2 n] from
    ``seeds`` int64 [G] and ``offsets`` int64 [G, n] (the offsets of a graph's replay come from
    the experts' device counters, not from the host)."""
    if seeds.dim() != 1 or offsets.dim() != 2 or offsets.shape[0] != seeds.shape[0]:
        raise TensorError(
            f"philox_table: seeds of shape {tuple(seeds.shape)} and offsets of shape "
            f"{tuple(offsets.shape)}; expected [G] and [G, copies]"
        )
    if seeds.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise TensorError(
            f"philox_table: seeds {seeds.dtype} and offsets {offsets.dtype}; expected int64"
        )
    words = torch.cat((seeds[:, None], offsets), 1)
    return _words(words).reshape(seeds.shape[0], -1)


__all__ = [
    "DeviceGroups",
    "DeviceRouting",
    "device_groups",
    "device_routing",
    "padded_bound",
    "philox_table",
    "rowwise_ctas_bound",
    "static_cta_table",
    "static_tile_table",
    "tile_ctas_bound",
]
