"""fp4gen layers under torch.distributed on the CPU (gloo): DDP and FSDP2 against one process.

Two ranks each run one micro-batch per optimizer step; one process runs the same two
micro-batches as gradient accumulation (each loss halved, as the ranks' gradients are averaged).
With a round-to-nearest recipe every quantized operand is a function of the values it is given,
so the gradients, losses and parameters must agree up to the order of the fp32 additions in the
gradient reduction (rtol 1e-5: a handful of ulps of an fp32 sum of two terms, then the SGD update).

FSDP2 re-materializes each unsharded weight in place on every all-gather (same storage, same
version counter), which is what once made a quantized-weight cache serve stale weights in a third
to a half of the runs. The repeats vary the model and data seeds; ``FP4GEN_DIST_REPEATS`` sets how
many (CI runs a few; ``FP4GEN_DIST_REPEATS=20 pytest tests/test_distributed.py`` runs the full
check).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fp4gen

RECIPE = """recipe nearest_nvfp4 "NVFP4 with round-to-nearest everywhere"
operands {
    *      : nvfp4 round nearest
    weight : block 16x16
}
"""
WORLD = 2
STEPS = 4
WIDTH = 64
TOKENS = 32
REPEATS = int(os.environ.get("FP4GEN_DIST_REPEATS", "3"))

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")


def build_model(seed: int) -> nn.Module:
    """Three blocks (Linear + ReLU) and a head, converted: the blocks run NVFP4."""
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(3)]
    model = nn.Sequential(*blocks, nn.Linear(WIDTH, WIDTH))
    fp4gen.convert(model, fp4gen.load_recipe(RECIPE))
    return model


def micro_batch(seed: int, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100_003 + step * 101 + rank)
    return torch.randn(TOKENS, WIDTH, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (FSDP2 shards parameters and gradients), a tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def accumulation_run(seed: int) -> dict[str, list]:
    """One process, WORLD micro-batches per step accumulated."""
    model = build_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, list] = {"loss": [], "grads": [], "params": []}
    for step in range(STEPS):
        opt.zero_grad()
        losses = []
        for rank in range(WORLD):
            loss = loss_of(model, micro_batch(seed, step, rank))
            (loss / WORLD).backward()
            losses.append(loss.detach())
        out["loss"].append(torch.stack(losses))
        out["grads"].append([p.grad.clone() for p in model.parameters()])
        opt.step()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def wrap(model: nn.Module, mode: str) -> nn.Module:
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for block in list(model)[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def distributed_run(rank: int, mode: str, seeds: list[int], store: str, out: str) -> None:
    """One rank: every seed's run, its own micro-batch per step."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        results = []
        for seed in seeds:
            model = wrap(build_model(seed), mode)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            res: dict[str, list] = {"loss": [], "grads": [], "params": []}
            for step in range(STEPS):
                opt.zero_grad()
                loss = loss_of(model, micro_batch(seed, step, rank))
                loss.backward()
                losses = [torch.zeros(()) for _ in range(WORLD)]
                dist.all_gather(losses, loss.detach())
                res["loss"].append(torch.stack(losses))
                res["grads"].append([full(p.grad).clone() for p in model.parameters()])
                opt.step()
            res["params"] = [full(p.detach()).clone() for p in model.parameters()]
            results.append(res)
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without running C++ destructors: gloo's threads may still be joinable at interpreter
    # exit, which aborts the process ("terminate called without an active exception") after
    # the work is done and the results saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(mode: str, seeds: list[int], tmp: Path) -> list[dict[str, list]]:
    out = tmp / f"{mode}.pt"
    mp.start_processes(
        distributed_run,
        args=(mode, seeds, str(tmp / f"{mode}.store"), str(out)),
        nprocs=WORLD,
        join=True,
        start_method="spawn",
    )
    return torch.load(out)


def assert_agree(want: dict[str, list], got: dict[str, list], what: str) -> None:
    close = {"rtol": 1e-5, "atol": 1e-7}
    for step in range(STEPS):
        torch.testing.assert_close(got["loss"][step], want["loss"][step], **close)
        for i, (g, w) in enumerate(zip(got["grads"][step], want["grads"][step], strict=True)):
            torch.testing.assert_close(g, w, **close, msg=f"{what}: step {step}, param {i}")
    for g, w in zip(got["params"], want["params"], strict=True):
        torch.testing.assert_close(g, w, **close)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_data_parallel_equals_gradient_accumulation(mode: str, tmp_path: Path) -> None:
    seeds = list(range(REPEATS))
    got = run_ranks(mode, seeds, tmp_path)
    for seed, res in zip(seeds, got, strict=True):
        assert_agree(accumulation_run(seed), res, f"{mode}, seed {seed}")
