"""GroupedExperts on CUDA (needs a GPU): in the per-expert loop each expert's GEMMs run on the same
kernels as a dense fp4gen.nn.Linear with the expert's seed (bit for bit); the grouped GEMMs
(torch._grouped_mm in BF16) are the float64 product of the same operands within the fp32
summation bound plus one bf16 rounding; a converted MoE model trains either way. The CUDA run
against the CPU's, and the grouped path against the loop, are compared as the recipe fuzzer
compares (tests/moe_harness.py): every expert GEMM's operands bit for bit, every product within
its bound, and with the products handed on, every result bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fp4gen
import fp4gen.runtime.grouped as grouped

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_harness import (  # noqa: E402  (the recipe fuzzer's comparison for experts)
    harnessed_run,
    operand_differences,
    result_differences,
)
from test_moe import (  # noqa: E402  (the same models, routing and dense layers)
    ARCHS,
    build,
    check_dense,
    dense_layers,
    experts_of,
    routing,
)
from test_moe_grouped import (  # noqa: E402
    pair,
    per_group,
    pieces,
    recorded_products,
    unequal_routing,
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
    module.grouped = False  # the per-expert loop: each GEMM is the dense layer's kernel
    dense = dense_layers(module, 5, layer_index=4)
    index, weights = routing(tokens, empty=1)
    hidden = torch.randn(tokens, 64).to(torch.bfloat16)
    check_dense(
        module, dense, hidden.cuda(), index.cuda(), weights.to(torch.bfloat16).cuda(), empty=1
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_experts_match_cpu(arch: str) -> None:
    """The CUDA run (grouped GEMMs on sm_90a, the per-expert kernels on sm_100a) against the
    CPU's per-expert reference, as the recipe fuzzer compares (tests/moe_harness.py): every
    expert GEMM's operands bit for bit (the quantize kernels give the reference's codes, scales
    and global scales), every CUDA product within the fp32 summation-order bound of
    docs/numerics.md 6 (plus one bf16 rounding for the grouped BF16 product), then every GEMM
    hands on the float64 product with the dense epilogue on both sides, and the epilogue,
    activation and bias sums run on the CPU in both runs: the output, dx and every parameter's
    gradient are then the CPU's bits, and the routing weights' gradient (torch's reduction over
    the hidden size on the device) is within ``routing_grad_close``. gpt-oss's biases, clamped
    SwiGLU and interleaved gate/up rows are the model's own, so they are covered as they run."""
    cpu = fp4gen.convert(build(arch, torch.bfloat16), "nvfp4_no_bf16", seed=5)
    gpu = fp4gen.convert(build(arch, torch.bfloat16).cuda(), "nvfp4_no_bf16", seed=5)
    index, weights = routing(64, empty=2)
    hidden = torch.randn(64, 64).to(torch.bfloat16)
    weights = weights.to(torch.bfloat16)
    want = harnessed_run(experts_of(cpu), hidden, index, weights, check=False, glue_on_cpu=True)
    got = harnessed_run(
        experts_of(gpu), hidden.cuda(), index.cuda(), weights.cuda(), check=True, glue_on_cpu=True
    )
    assert got.harness.checked > 0 and len(got.harness.operands) == len(want.harness.operands)
    problems = got.harness.problems + operand_differences(got.harness, want.harness)
    problems += result_differences(got, want, routing_exact=False)
    assert not problems, "\n".join(problems)


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


@pytest.mark.parametrize("product", ["bf16", "fp32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_grouped_products_are_within_the_bound(monkeypatch, arch: str, product: str) -> None:
    """Every grouped GEMM of a training step against the float64 product of the block values it
    was given: within (K + 8) u sum |a b| (any fp32 summation order); with the default "bf16"
    product (torch._grouped_mm, BF16 in and out on sm_90a and sm_100a: the fp32 accumulator
    rounded once to bf16) plus 2^-8 of the accumulator's size, |product| + that bound (one
    rounding to nearest to bf16's 8 significant bits: u = 2^-8), times 1 + 2^-9 for the
    rounding of the bound's own terms; with "fp32" (a GEMM per group, fp32 result) the
    summation bound alone."""
    calls = recorded_products(monkeypatch, arch, device="cuda")
    previous = grouped.set_grouped_product(product)
    try:
        for kind, a, b, ends in calls:
            fn = grouped.group_rows if kind == "rows" else grouped.group_k
            c = fn(a, b, ends).cpu()
            for got, (exact, bound) in zip(
                pieces(kind, c, ends), per_group(kind, a.cpu(), b.cpu(), ends), strict=True
            ):
                allowed = bound
                if product == "bf16":
                    allowed = (bound + 2.0**-8 * (exact.abs() + bound)) * (1 + 2.0**-9)
                assert ((got.double() - exact).abs() <= allowed).all(), kind
    finally:
        grouped.set_grouped_product(previous)


@pytest.mark.parametrize("every", [False, True])  # True: no expert empty (the wholes' path)
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_grouped_experts_match_the_loop(arch: str, every: bool) -> None:
    """The grouped path (taken by default on sm_90a) against the per-expert loop on CUDA, very
    unequal groups with an empty expert, as the recipe fuzzer compares (tests/moe_harness.py):
    every expert GEMM's operands bit for bit, the loop's products within the bound of
    docs/numerics.md 6 and the grouped ones within the summation bound plus one bf16 rounding,
    and with the products handed on (the same float64 product and dense epilogue on both
    paths) the output and every gradient bit for bit."""
    loop, group = pair(arch, torch.bfloat16, device="cuda")
    group.grouped = None
    from fp4gen.compiler.jit import detect_arch

    if detect_arch(torch.device("cuda")) == "sm_90a":
        assert group.loop_reason(group.operands, torch.device("cuda")) is None
    group.grouped = True
    index, weights = routing(70, empty=None) if every else unequal_routing()
    hidden = torch.randn(70, 64).to(torch.bfloat16).cuda()
    args = (hidden, index.cuda(), weights.to(torch.bfloat16).cuda())
    want = harnessed_run(loop, *args, check=True)
    got = harnessed_run(group, *args, check=True)
    assert got.harness.checked > 0 and want.harness.checked > 0
    problems = want.harness.problems + got.harness.problems
    problems += operand_differences(got.harness, want.harness)
    problems += result_differences(got, want)
    assert not problems, "\n".join(problems)
    for name, grad in got.grads.items():
        if not name.endswith("bias"):
            assert grad[2].any() if every else not grad[2].any()  # unequal: expert 2 had none


def test_cuda_grouped_moe_model_trains() -> None:
    model = fp4gen.convert(build("qwen3_moe", torch.bfloat16).cuda(), "nvfp4_small")
    for layer in model.model.layers:
        layer.mlp.experts.grouped = True
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(3)).cuda()
    losses = []
    for step in range(5):
        fp4gen.set_step(model, step)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
