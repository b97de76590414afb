"""FSDP2 with the experts sharded, on the CPU with gloo ranks (and NCCL where a machine has two
GPUs): a converted Mixtral's decoder layers are ``fully_shard``-ed, so each rank holds half of
every experts module's 3-D parameters (dim 0: two of its four experts), all-gathered for the
forward and backward, their gradients reduce-scattered. Against one process running the same
micro-batches as gradient accumulation: with a round-to-nearest recipe every quantized operand
is a function of the values it is given, so the first step's losses agree bit for bit and the
gradients, losses and parameters after it up to the order of the fp32 additions of the
reduction (rtol 1e-5, as tests/test_distributed.py). Both the per-expert loop and the grouped
GEMMs (fp4gen.runtime.grouped) run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp4gen
from fp4gen.dsl import parse_recipe
from fp4gen.runtime.experts import GroupedExperts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_harness import rank_device, spawn  # noqa: E402

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")

RNE = "operands {\n * : nvfp4\n weight : block 16x16\n}\n"
STEPS = 3
WORLD = 2


def build(grouped: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = fp4gen.convert(transformers.MixtralForCausalLM(cfg), parse_recipe(RNE, base_dir=None))
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.grouped = grouped
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 101 + rank)
    return torch.randint(0, 128, (2, 16), generator=g)


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()


def accumulation_run(grouped: bool) -> dict[str, list]:
    model = build(grouped)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, list] = {"loss": [], "grads": [], "params": []}
    for step in range(STEPS):
        opt.zero_grad()
        losses = []
        for rank in range(WORLD):
            loss = loss_of(model, batch(step, rank))
            (loss / WORLD).backward()
            losses.append(loss.detach().reshape(1))
        out["loss"].append(torch.cat(losses))
        out["grads"].append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def fsdp_job(rank: int, world: int, device: torch.device, grouped: bool, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build(grouped).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    experts = model.model.layers[0].mlp.experts
    local = experts.gate_up_proj.to_local()
    assert local.shape[0] == 4 // world  # the experts are sharded: this rank's slices only
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res: dict[str, list] = {"loss": [], "grads": [], "params": []}
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, batch(step, rank).to(device))
        loss.backward()
        losses = [torch.zeros(1, device=device) for _ in range(world)]
        dist.all_gather(losses, loss.detach().float().reshape(1))
        res["loss"].append(torch.cat(losses).cpu())
        res["grads"].append([full(p.grad).clone() for p in model.parameters()])
        opt.step()
    res["params"] = [full(p).clone() for p in model.parameters()]
    if rank == 0:
        torch.save(res, out)


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_fsdp2_with_sharded_experts_equals_gradient_accumulation(grouped, tmp_path) -> None:
    out = tmp_path / "fsdp.pt"
    spawn(fsdp_job, WORLD, tmp_path, grouped, str(out), backend="gloo", with_device=True)
    got, want = torch.load(out), accumulation_run(grouped)
    assert torch.equal(got["loss"][0], want["loss"][0])
    close = {"rtol": 1e-5, "atol": 1e-7}
    for step in range(STEPS):
        torch.testing.assert_close(got["loss"][step], want["loss"][step], **close)
        for i, (g, w) in enumerate(zip(got["grads"][step], want["grads"][step], strict=True)):
            torch.testing.assert_close(g, w, **close, msg=f"step {step}, param {i}")
    for g, w in zip(got["params"], want["params"], strict=True):
        torch.testing.assert_close(g, w, **close)
    assert rank_device("gloo", 0).type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(
    not (dist.is_nccl_available() and torch.cuda.device_count() >= WORLD), reason="2 GPUs"
)
def test_fsdp2_with_sharded_experts_on_nccl_trains(tmp_path) -> None:
    """On NCCL (cuda:0 and cuda:1, grouped GEMMs by default on sm_90a): the first step's
    losses are the one-process run's on the CPU within the GEMMs' summation order (the CUDA
    kernels give the reference's codes), and training runs."""
    out = tmp_path / "fsdp.pt"
    spawn(fsdp_job, WORLD, tmp_path, None, str(out), backend="nccl", with_device=True)
    got = torch.load(out)
    want = accumulation_run(False)
    torch.testing.assert_close(got["loss"][0], want["loss"][0], rtol=0.02, atol=0.02)
    assert all(torch.isfinite(loss).all() for loss in got["loss"])


def test_the_quantized_all_gather_leaves_experts_in_high_precision_and_says_so(
    caplog, monkeypatch
) -> None:
    """enable_quantized_all_gather on an MoE model: the Linears get it where exact, every
    experts module keeps the high-precision gather (its plan says why, logged once), and the
    model still trains in one process with the same bits as without the option."""
    from fp4gen.runtime import fsdp

    plain, model = build(False), build(False)
    # an empty record for this test (not the process-wide one cleared: it stays as it was)
    monkeypatch.setattr(fsdp._log_once, "seen", set())
    with caplog.at_level("INFO", logger="fp4gen.runtime"):
        plans = fsdp.enable_quantized_all_gather(model)
        fsdp.enable_quantized_all_gather(model)
    experts = [p for p in plans if p.name.endswith("experts")]
    assert [p.name for p in experts] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert all(p.spec is None and fsdp.EXPERTS_REASON in p.reason for p in experts)
    assert any(p.spec is not None for p in plans)  # the attention projections: 16x16, nearest
    lines = [
        r.getMessage() for r in caplog.records if "model.layers.0.mlp.experts" in r.getMessage()
    ]
    assert len(lines) == 1 and lines[0].startswith("FSDP2 all-gathers a weight in high precision")
    ids = batch(0, 0)
    loss_plain, loss = loss_of(plain, ids), loss_of(model, ids)
    assert torch.equal(loss_plain, loss)
    loss_plain.backward()
    loss.backward()
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
