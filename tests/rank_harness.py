"""Multi-process tests under torch.distributed: one fresh process per rank, under a deadline.

``spawn(job, world, tmp, *args)`` runs ``job(rank, world, *args)`` (``with_device=True``:
``job(rank, world, device, *args)``) in ``world`` spawned processes joined into one process
group through a file store. gloo ranks run on the CPU with one thread each (several ranks on a
small CI machine); NCCL puts rank r on cuda:r. A rank's collectives time out after
``RANK_TIMEOUT_S`` and the test kills ranks still alive after ``SPAWN_TIMEOUT_S``, so a broken
collective fails the test instead of hanging the suite; a rank's failed assertion fails the
test with its traceback. Ranks leave without running C++ destructors: gloo's threads may still
be joinable at interpreter exit, which aborts the process ("terminate called without an active
exception") after the work is done and the results saved.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANK_TIMEOUT_S = 120  # a collective waiting longer than this raises in the rank
SPAWN_TIMEOUT_S = 300  # the whole multi-process run, start-up (imports) included

_spawns = itertools.count()


def rank_device(backend: str, rank: int) -> torch.device:
    """gloo runs on the CPU; NCCL puts rank r on cuda:r."""
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def rank_main(
    rank: int,
    world: int,
    backend: str,
    store: str,
    job: Callable[..., None],
    args: tuple,
    with_device: bool,
) -> None:
    """One rank: join the group, run the job, leave (module docstring)."""
    device = rank_device(backend, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=RANK_TIMEOUT_S),
    )
    try:
        job(rank, world, *((device,) if with_device else ()), *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(
    job: Callable[..., None],
    world: int,
    tmp: Path,
    *args: Any,
    backend: str = "gloo",
    with_device: bool = False,
) -> None:
    """Run ``job`` on ``world`` fresh ranks; fail (never hang) past SPAWN_TIMEOUT_S."""
    store = tmp / f"store-{next(_spawns)}"  # a FileStore's file serves one group only
    ctx = mp.start_processes(
        rank_main,
        args=(world, backend, str(store), job, args, with_device),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    # join raises as soon as a rank fails (and ends the others); True once all exited cleanly
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            pytest.fail(f"{job.__name__} on {world} {backend} ranks ran past {SPAWN_TIMEOUT_S} s")
