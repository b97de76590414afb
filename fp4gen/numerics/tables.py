"""Constant tables the oracle indexes on a device (decode tables, value grids, fixed RHT signs).

A table is made once per device and kept for the process, so it must not land in a CUDA
graph's memory pool: made while torch.compile's CUDA graphs warm up, a kept table is a tensor
of the pool that no graph output accounts for, and inductor refuses to record the graph
("tensor(s) in the cudagraph pool not tracked as outputs"; met by a backward that dequantizes a
`from` copy's stochastically rounded source under ``mode="reduce-overhead"``). Tables are
therefore made by ``fp4gen.runtime.device_memory.kept``: outside every pool, or, during a
capture, uncached and owned by the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

_tables: dict[Hashable, torch.Tensor] = {}


def device_table(
    key: Hashable, values: Callable[[], Sequence[float]], device: torch.device
) -> torch.Tensor:
    """float32 ``values()`` on ``device``, kept per (``key``, device)."""
    found = _tables.get((key, device))
    if found is not None:
        return found
    from fp4gen.runtime.device_memory import kept  # on first use: the import loads no runtime

    return kept(
        _tables,
        (key, device),
        lambda: torch.tensor(values(), dtype=torch.float32, device=device),
        device,
    )


__all__ = ["device_table"]
