"""fp4gen layers under torch.distributed: DDP and FSDP2 against one process, DCP checkpoints.

N ranks (2 and 4) each run one micro-batch per optimizer step; one process runs the same N
micro-batches as gradient accumulation (each loss divided by N, as the ranks' gradients are
averaged). With a round-to-nearest recipe every quantized operand is a function of the values it
is given, so the gradients, losses and parameters must agree up to the order of the fp32
additions in the gradient reduction (rtol 1e-5: a handful of ulps of an fp32 sum of up to four
terms, then the SGD update).

FSDP2 re-materializes each unsharded weight in place on every all-gather (same storage, same
version counter), which is what once made a quantized-weight cache serve stale weights in a third
to a half of the runs. The repeats vary the model and data seeds; ``FP4GEN_DIST_REPEATS`` sets how
many (CI runs a few; ``FP4GEN_DIST_REPEATS=20 pytest tests/test_distributed.py`` runs the full
check).

Backends: gloo on the CPU always runs (CI). The same tests run with NCCL, rank r on cuda:r, where
CUDA has at least as many devices as ranks (marked ``gpu``; skipped otherwise):
``pytest -m gpu tests/test_distributed.py``. ``FP4GEN_DIST_BACKEND=gloo`` or ``nccl`` runs only
that backend's cases.

Every multi-process run has a deadline (tests/rank_harness.py, shared with the FSDP2
quantized all-gather and amax-group tests): the ranks' collectives time out and the test kills
ranks still alive at its own deadline, so a broken collective fails the test instead of hanging
the suite.
"""

from __future__ import annotations

import copy
import itertools
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp4gen

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_harness import rank_device, spawn  # noqa: E402

RECIPE = """recipe nearest_nvfp4 "NVFP4 with round-to-nearest everywhere"
operands {
    *      : nvfp4 round nearest
    weight : block 16x16
}
"""
WORLDS = (2, 4)
STEPS = 4
WIDTH = 64
TOKENS = 32
REPEATS = int(os.environ.get("FP4GEN_DIST_REPEATS", "3"))

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")


# --- backends and the multi-process harness ------------------------------------------------------
def nccl_ready(world: int) -> bool:
    return dist.is_nccl_available() and torch.cuda.device_count() >= world


def on(backend: str) -> dict[str, Any]:
    """spawn's arguments for ``backend``: the jobs here take the rank's device."""
    return {"backend": backend, "with_device": True}


def selected(backend: str) -> bool:
    """Whether FP4GEN_DIST_BACKEND (unset: both) asks for this backend's cases."""
    only = os.environ.get("FP4GEN_DIST_BACKEND", "")
    if only not in ("", "gloo", "nccl"):
        raise ValueError(f"FP4GEN_DIST_BACKEND={only!r}: expected gloo or nccl (or unset)")
    return only in ("", backend)


def param(*values: Any, backend: str, ranks: int, name: str) -> Any:
    """A pytest param on ``backend``; an NCCL one is marked gpu and needs ``ranks`` devices."""
    if backend == "gloo":
        return pytest.param(*values, id=name)
    reason = f"NCCL needs {ranks} CUDA devices"
    marks = [pytest.mark.gpu, pytest.mark.skipif(not nccl_ready(ranks), reason=reason)]
    return pytest.param(*values, id=name, marks=marks)


def cases(worlds: tuple[int, ...], *modes: str) -> list[Any]:
    """pytest params (mode, backend, world): gloo for every world, NCCL on enough GPUs."""
    return [
        param(mode, backend, world, backend=backend, ranks=world, name=f"{mode}-{backend}-{world}")
        for mode, world, backend in itertools.product(modes, worlds, ("gloo", "nccl"))
        if selected(backend)
    ]


# --- the model and its training -----------------------------------------------------------------
def build_model(seed: int) -> nn.Module:
    """Three blocks (Linear + ReLU) and a head, every Linear converted to NVFP4."""
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
    """A DTensor's whole value (FSDP2 shards parameters and gradients) on the CPU."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()


def accumulation_run(seed: int, world: int, device: torch.device, mode: str) -> dict[str, list]:
    """One process, ``world`` micro-batches per step accumulated.

    For ``fsdp2-bf16`` it is what FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32) does: the forward and backward run on a bf16 copy of the fp32 weights
    and inputs, each micro-batch's bf16 gradient is summed in fp32."""
    model = build_model(seed).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    work = copy.deepcopy(model).to(torch.bfloat16) if mode == "fsdp2-bf16" else None
    out: dict[str, list] = {"loss": [], "grads": [], "params": []}
    for step in range(STEPS):
        opt.zero_grad()
        losses = []
        if work is None:
            for rank in range(world):
                loss = loss_of(model, micro_batch(seed, step, rank).to(device))
                (loss / world).backward()
                losses.append(loss.detach().float().cpu())
        else:
            with torch.no_grad():
                for w, p in zip(work.parameters(), model.parameters(), strict=True):
                    w.copy_(p)  # round to nearest even, as FSDP2's cast
            sums = [torch.zeros_like(p) for p in model.parameters()]
            for rank in range(world):
                work.zero_grad()
                x = micro_batch(seed, step, rank).to(device, torch.bfloat16)
                loss = loss_of(work, x)
                loss.backward()
                losses.append(loss.detach().float().cpu())
                for s, w in zip(sums, work.parameters(), strict=True):
                    s += w.grad.float()
            for p, s in zip(model.parameters(), sums, strict=True):
                p.grad = s / world
        out["loss"].append(torch.stack(losses))
        out["grads"].append([p.grad.detach().cpu().clone() for p in model.parameters()])
        opt.step()
    out["params"] = [p.detach().cpu().clone() for p in model.parameters()]
    return out


def wrap(model: nn.Module, mode: str, world: int, device: torch.device) -> nn.Module:
    """DDP (``ddp-compile``: under torch.compile), or FSDP2 ``fully_shard`` per block and at
    the root (``fsdp2-bf16``: bf16 compute with fp32 gradient reduction; ``fsdp2-ckpt``: each
    block's activations recomputed in the backward; ``fsdp2-compile``: each block compiled)."""
    if mode in ("ddp", "ddp-compile"):
        ids = [device.index] if device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        # compiled whole: DDP's graph is split at its gradient buckets (DDPOptimizer)
        return torch.compile(ddp, backend="aot_eager") if mode == "ddp-compile" else ddp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy()
    if mode == "fsdp2-bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(list(model)[:-1]):
        if mode == "fsdp2-ckpt":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            block = model[i] = checkpoint_wrapper(block)
        fully_shard(block, mesh=mesh, mp_policy=policy)
        if mode == "fsdp2-compile":
            block.compile(backend="aot_eager", fullgraph=True)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def train_job(
    rank: int, world: int, device: torch.device, mode: str, seeds: list[int], out: str
) -> None:
    """Every seed's run on this rank, its own micro-batch per step; rank 0 saves the results."""
    results = []
    recomputed: list[str] = []  # the layers' forwards run again in a backward (checkpointing)
    if mode == "fsdp2-ckpt":
        from fp4gen.runtime.linear import recomputing

        real = fp4gen.nn.Linear.forward_gemm

        def counting(self: fp4gen.nn.Linear, *args: Any, **kwargs: Any) -> Any:
            if recomputing():
                recomputed.append(self.name)
            return real(self, *args, **kwargs)

        fp4gen.nn.Linear.forward_gemm = counting  # type: ignore[method-assign]  # this process
    for seed in seeds:
        recomputed.clear()
        model = wrap(build_model(seed).to(device), mode, world, device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        res: dict[str, list] = {"loss": [], "grads": [], "params": []}
        for step in range(STEPS):
            opt.zero_grad()
            loss = loss_of(model, micro_batch(seed, step, rank).to(device))
            loss.backward()
            losses = [torch.zeros(1, device=device) for _ in range(world)]
            dist.all_gather(losses, loss.detach().float().reshape(1))
            res["loss"].append(torch.cat(losses).cpu())
            res["grads"].append([full(p.grad).clone() for p in model.parameters()])
            opt.step()
        res["params"] = [full(p).clone() for p in model.parameters()]
        results.append(res)
        if mode == "fsdp2-ckpt":  # the blocks' forwards did run again in the backward,
            # drawing the streams of the forwards they repeat: no call counted for them
            layers = [m for m in model.modules() if isinstance(m, fp4gen.nn.Linear)]
            assert [m._forward_calls for m in layers] == [STEPS] * 4
            assert len(recomputed) == 3 * STEPS, recomputed
    if mode.endswith("-compile"):  # the model did run as compiled graphs
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    if rank == 0:
        torch.save(results, out)


def assert_agree(want: dict[str, list], got: dict[str, list], what: str) -> None:
    # the first step's losses bit for bit: the same initial weights and micro-batches give the
    # same quantized operands and GEMMs, whatever the wrapper (no reduction has happened yet)
    assert torch.equal(got["loss"][0], want["loss"][0]), what
    close = {"rtol": 1e-5, "atol": 1e-7}
    for step in range(STEPS):
        torch.testing.assert_close(got["loss"][step], want["loss"][step], **close)
        for i, (g, w) in enumerate(zip(got["grads"][step], want["grads"][step], strict=True)):
            torch.testing.assert_close(g, w, **close, msg=f"{what}: step {step}, param {i}")
    for g, w in zip(got["params"], want["params"], strict=True):
        torch.testing.assert_close(g, w, **close)


def check_against_accumulation(
    mode: str, backend: str, world: int, seeds: list[int], tmp: Path
) -> None:
    out = tmp / f"{mode}-{world}.pt"
    spawn(train_job, world, tmp, mode, seeds, str(out), **on(backend))
    got = torch.load(out)
    device = rank_device(backend, 0)
    for seed, res in zip(seeds, got, strict=True):
        want = accumulation_run(seed, world, device, mode)
        assert_agree(want, res, f"{mode} on {world} {backend} ranks, seed {seed}")


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "backend", "world"), cases(WORLDS, "ddp", "fsdp2"))
def test_data_parallel_equals_gradient_accumulation(
    mode: str, backend: str, world: int, tmp_path: Path
) -> None:
    check_against_accumulation(mode, backend, world, list(range(REPEATS)), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "backend", "world"),
    cases((2,), "fsdp2-bf16", "fsdp2-ckpt", "fsdp2-compile", "ddp-compile"),
)
def test_options_equal_gradient_accumulation(
    mode: str, backend: str, world: int, tmp_path: Path
) -> None:
    """FSDP2 with a bf16 mixed precision policy, with activation checkpointing and with
    torch.compile'd blocks, and DDP under torch.compile: still the accumulation run (one seed;
    the ranks' layouts are those of the plain tests).

    bf16: each rank's gradient is a bf16 tensor, exact in fp32, and FSDP2 sums them in fp32
    (reduce_dtype) as the reference does, so the same rtol holds. Checkpointing recomputes the
    forward from the same weights and inputs (round to nearest: the same codes). torch.compile
    (aot_eager: traced, no code generation) runs fp4gen's custom ops as eager mode does."""
    check_against_accumulation(mode, backend, world, [0], tmp_path)


# --- torch.distributed.checkpoint: save at 4 ranks, load at 2 (and in one process) --------------
CKPT_SEED = 7
CKPT_STEPS = 2  # Adam steps before the save, so that the optimizer has state to save


def probe() -> torch.Tensor:
    return torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(99))


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def snapshot(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> dict[str, Any]:
    """The whole model and optimizer state as plain CPU tensors (on rank 0; collective), and
    this rank's forward of the probe input."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=options)
    with torch.no_grad():
        y = model(probe().to(device)).cpu()
    # copies: a CPU tensor comes back as itself (Adam's step), which the next step would change
    state = copy.deepcopy({"model": msd, "optim": osd.get("state", {})})  # empty but on rank 0
    return {**state, "forward": y}


def continue_step(
    model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, device: torch.device
) -> list[torch.Tensor]:
    """One more step on step CKPT_STEPS's 4 micro-batches, split over the ranks (accumulated
    where a rank has several): the same global batch at any world size."""
    opt.zero_grad()
    per_rank = 4 // world
    for i in range(per_rank):
        x = micro_batch(CKPT_SEED, CKPT_STEPS, rank * per_rank + i).to(device)
        (loss_of(model, x) / per_rank).backward()
    opt.step()
    return [full(p).clone() for p in model.parameters()]


def save_job(rank: int, world: int, device: torch.device, ckpt: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = wrap(build_model(CKPT_SEED).to(device), "fsdp2", world, device)
    opt = adam(model)
    for step in range(CKPT_STEPS):
        opt.zero_grad()
        loss_of(model, micro_batch(CKPT_SEED, step, rank).to(device)).backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)  # sharded: each rank writes its own shards
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    saved = snapshot(model, opt, device)
    saved["next"] = continue_step(model, opt, rank, world, device)
    if rank == 0:
        torch.save(saved, out)


def load_job(rank: int, world: int, device: torch.device, ckpt: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = wrap(build_model(CKPT_SEED + 1).to(device), "fsdp2", world, device)  # other values
    opt = adam(model)
    msd, osd = get_state_dict(model, opt)  # this world's shards, the optimizer state made
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)  # read into them, resharded
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    loaded = snapshot(model, opt, device)
    loaded["next"] = continue_step(model, opt, rank, world, device)
    if rank == 0:
        torch.save(loaded, out)


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend",
    [param(b, backend=b, ranks=4, name=b) for b in ("gloo", "nccl") if selected(b)],
)
def test_checkpoint_saved_at_4_ranks_loads_at_2_and_at_1(backend: str, tmp_path: Path) -> None:
    """A DCP checkpoint of a converted FSDP2 model and its Adam state, written by 4 ranks, read
    by 2 (resharded) and by one process: every parameter and optimizer state tensor equal bit
    for bit, and the forward of a probe input too (the same weights and input give the same
    codes and the same GEMM). One more step on the same global batch then agrees up to fp32
    summation order (the 4 micro-batch gradients are summed in another order at 2 ranks;
    rtol 1e-5 as above, Adam's update being a smooth function of them)."""
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt"
    spawn(save_job, 4, tmp_path, str(ckpt), str(tmp_path / "saved.pt"), **on(backend))
    spawn(load_job, 2, tmp_path, str(ckpt), str(tmp_path / "loaded.pt"), **on(backend))
    saved, loaded = torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "loaded.pt")

    assert saved["model"].keys() == loaded["model"].keys()
    assert len(saved["model"]) == 8  # 4 converted Linears, weight and bias each
    for name, value in saved["model"].items():
        assert torch.equal(loaded["model"][name], value), name
    assert saved["optim"].keys() == loaded["optim"].keys() == saved["model"].keys()
    for name, state in saved["optim"].items():
        assert state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert float(state["step"]) == CKPT_STEPS
        for key, value in state.items():
            assert torch.equal(loaded["optim"][name][key], value), (name, key)
    assert torch.equal(loaded["forward"], saved["forward"])
    for got, want in zip(loaded["next"], saved["next"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)

    # One process, no process group: DCP reads the shards into a plain converted model.
    device = rank_device(backend, 0)
    model = build_model(CKPT_SEED + 1).to(device)
    state = model.state_dict()
    with warnings.catch_warnings():  # that it loads in one process is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    model.load_state_dict(state)
    for name, value in model.state_dict().items():
        assert torch.equal(value.cpu(), saved["model"][name]), name
    assert all(isinstance(m, fp4gen.nn.Linear) for m in (model[0][0], model[1][0], model[3]))
    with torch.no_grad():
        assert torch.equal(model(probe().to(device)).cpu(), saved["forward"])
