"""The grouped kernels' per-CTA tables built by torch ops on the launch's device
(``host_tables.spread_groups``, from ``DEVICE_BUILT_ROWS`` rows on CUDA) hold the numpy tables'
rows exactly: the CTA table of the grouped rowwise quantize and the tile table of the grouped
tile quantize, for many groups, empty groups first, last and in between, and one group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp4gen.runtime import grouped_quantize, grouped_tile
from fp4gen.runtime.host_tables import DEVICE_BUILT_ROWS, set_device_built_rows, spread_groups

CPU = torch.device("cpu")
GROUPS = ([5000, 0, 7000], [5024, 0, 7008], 32, 4)  # counts, pads, tile rows, column tiles


def draws(n: int, seed: int = 0):
    """``n`` group counts: 1-70 groups of 0-3000 rows, about a third empty."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        groups = int(rng.integers(1, 71))
        counts = [int(c) if rng.random() > 0.3 else 0 for c in rng.integers(0, 3001, groups)]
        yield rng, counts


def cta_spread(counts: list[int], units_per_row: int, tile: int, device: torch.device):
    units = np.asarray(counts, dtype=np.int64) * units_per_row
    ends = np.cumsum(units)
    return grouped_quantize._spread_cta_table(-(-units // tile), ends - units, ends, tile, device)


def tile_spread(counts: list[int], pads: list[int], tile_m: int, tiles_k: int, device):
    c, p = np.asarray(counts, dtype=np.int64), np.asarray(pads, dtype=np.int64)
    tiles = -(-p // tile_m) * tiles_k
    return grouped_tile._spread_tile_table(tiles, c, p, np.cumsum(c) - c, np.cumsum(p) - p, device)


def test_spread_groups_skips_empty_groups() -> None:
    """Rows of groups [2, 0, 3, 0] (first rows 0, 2, 2, 5): each row's group, its index in it
    and its group's column."""
    tiles = np.array([2, 0, 3, 0])
    group, index, (column,) = spread_groups(tiles, np.array([[10, 20, 30, 40]]), CPU)
    assert group.tolist() == [0, 0, 2, 2, 2]
    assert index.tolist() == [0, 1, 0, 1, 2]
    assert column.tolist() == [10, 10, 30, 30, 30]
    assert group.dtype == index.dtype == column.dtype == torch.int32


def test_the_torch_built_tables_are_the_numpy_ones() -> None:
    """On the CPU (the same torch ops as on CUDA): both tables, 150 draws of groups, units per
    row, tiles and padding."""
    for rng, counts in draws(150):
        if not any(counts):
            continue
        upr, tile = int(rng.choice([1, 2, 8, 48, 128])), int(rng.choice([4, 64, 256]))
        assert torch.equal(
            cta_spread(counts, upr, tile, CPU), grouped_quantize.cta_table_tensor(counts, upr, tile)
        )
        pads = [-(-c // 16) * 16 for c in counts]
        tile_m, tiles_k = int(rng.choice([16, 64, 128])), int(rng.integers(1, 5))
        assert torch.equal(
            tile_spread(counts, pads, tile_m, tiles_k, CPU),
            grouped_tile.tile_table_tensor(counts, pads, tile_m, tiles_k),
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tables_past_the_threshold_are_built_on_cuda_as_on_the_cpu() -> None:
    """On CUDA the tables a launch reads, above and below ``DEVICE_BUILT_ROWS`` rows (built by
    torch ops there, or by numpy and copied), equal the CPU's numpy tables."""
    cuda = torch.device("cuda")
    sizes = set()
    for rng, counts in draws(60, seed=1):
        upr, tile = int(rng.choice([8, 128])), int(rng.choice([4, 64]))
        got = grouped_quantize.cta_table_tensor(counts, upr, tile, cuda)
        assert torch.equal(got.cpu(), grouped_quantize.cta_table_tensor(counts, upr, tile))
        pads = [-(-c // 32) * 32 for c in counts]
        got = grouped_tile.tile_table_tensor(counts, pads, 32, 4, cuda)
        assert torch.equal(got.cpu(), grouped_tile.tile_table_tensor(counts, pads, 32, 4))
        sizes.add(got.shape[0] >= DEVICE_BUILT_ROWS)
    assert sizes == {False, True}  # both builds ran
    previous = set_device_built_rows(None)  # every table by numpy: the same rows
    try:
        got = grouped_tile.tile_table_tensor(*GROUPS, cuda)
    finally:
        set_device_built_rows(previous)
    assert torch.equal(got.cpu(), grouped_tile.tile_table_tensor(*GROUPS))
