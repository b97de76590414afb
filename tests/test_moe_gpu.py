"""GroupedExperts on CUDA (needs a GPU): each expert's GEMMs run on the same kernels as a dense
fp4gen.nn.Linear with the expert's seed (bit for bit), a converted MoE model trains, and the
CUDA result is the CPU reference's up to the GEMMs' fp32 summation order."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fp4gen

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_moe import (  # noqa: E402  (the same models, routing and dense layers)
    ARCHS,
    build,
    check_dense,
    dense_layers,
    experts_of,
    routing,
    run,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tokens", [40, 512])  # per expert: odd counts, and the large-M path
def test_cuda_experts_are_dense_fp4gen_linears(arch: str, tokens: int) -> None:
    model = build(arch, torch.bfloat16).cuda()
    fp4gen.convert(model, "nvfp4_no_bf16", seed=5)
    module = experts_of(model)
    dense = dense_layers(module, 5, layer_index=4)
    index, weights = routing(tokens, empty=1)
    hidden = torch.randn(tokens, 64).to(torch.bfloat16)
    check_dense(
        module, dense, hidden.cuda(), index.cuda(), weights.to(torch.bfloat16).cuda(), empty=1
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_experts_match_cpu(arch: str) -> None:
    """The quantize kernels give the reference's codes; the GEMMs sum in another fp32 order,
    so outputs and gradients agree within a few bf16 units."""
    cpu = fp4gen.convert(build(arch, torch.bfloat16), "nvfp4_no_bf16", seed=5)
    gpu = fp4gen.convert(build(arch, torch.bfloat16).cuda(), "nvfp4_no_bf16", seed=5)
    index, weights = routing(64, empty=2)
    hidden = torch.randn(64, 64).to(torch.bfloat16)
    weights = weights.to(torch.bfloat16)
    want = run(experts_of(cpu), hidden, index, weights)
    got = run(experts_of(gpu), hidden.cuda(), index.cuda(), weights.cuda())
    for a, b in zip(got[:3], want[:3], strict=True):
        torch.testing.assert_close(a.cpu().float(), b.float(), rtol=0.05, atol=0.05)
    for name, grad in want[3].items():
        torch.testing.assert_close(got[3][name].cpu().float(), grad.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_moe_model_trains(arch: str) -> None:
    model = fp4gen.convert(build(arch, torch.bfloat16).cuda(), "nvfp4_no_bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(3)).cuda()
    for step in range(3):
        fp4gen.set_step(model, step)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        grad = experts_of(model).gate_up_proj.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
        assert torch.isfinite(loss.detach())
        opt.step()
