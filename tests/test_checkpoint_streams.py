"""Activation checkpointing with stochastically rounded forward operands: a recomputed forward
draws the random streams of the forward it repeats, so a checkpointed model trains bit for bit
as without checkpointing.

Before, a recomputation ran as one more forward call: it drew the next call's streams, so the
activations and weights the backward differentiated were other roundings than those the loss
was computed from (a Llama's loss moved in the fourth digit from the second step on; shipped
recipes round their forward operands to nearest and were not affected). A forward that runs
inside a backward (``fp4gen.runtime.linear.recomputing``) now takes the backward's call count,
reads the backward pass's device counter on CUDA, runs eagerly, and counts no call."""

from __future__ import annotations

import logging

import pytest
import torch
from device_params import CPU_AND_CUDA
from torch import nn
from torch.utils.checkpoint import checkpoint

import fp4gen
import fp4gen.runtime.linear as linear
from fp4gen.dsl import parse_recipe
from fp4gen.settings import LAYER_GRAPHS_VAR

# every operand stochastically rounded, the forward's too; the x copy of the wgrad GEMM from
# the forward's (the backward then derives it from the forward's rounding)
RECIPE = """
operands {
    *                : nvfp4 round stochastic
    wgrad.activation : from fprop.activation
}
"""
PLAIN = "operands {\n    * : nvfp4 round stochastic\n}\n"
STEPS = 3

DEVICES = CPU_AND_CUDA


class Blocks(nn.Module):
    """Two blocks of two fp4gen Linears, each block checkpointed (or not)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64)) for _ in range(2)
        )
        fp4gen.convert(self, parse_recipe(RECIPE, base_dir=None), total_steps=STEPS)
        self.to(device)
        self.mode: str | None = None  # None, "reentrant" or "non-reentrant"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.mode is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return x


def train(model: Blocks, device: str) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    seen = []
    for step in range(STEPS):
        fp4gen.set_step(model, step)
        x = torch.randn(48, 64, generator=g).to(device).requires_grad_()
        loss = model(x).float().square().mean()
        opt.zero_grad()
        loss.backward()
        seen += [loss.detach(), x.grad.clone()]
        seen += [p.grad.clone() for p in model.parameters()]
        opt.step()
    return seen + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "layer-graphs"])
@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("device", DEVICES)
def test_checkpointing_trains_as_without_it(
    device: str, mode: str, graphs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if graphs and device == "cpu":
        pytest.skip("layer graphs are CUDA graphs")
    monkeypatch.setenv(LAYER_GRAPHS_VAR, "1" if graphs else "0")
    want = train(Blocks(device), device)
    model = Blocks(device)
    model.mode = mode
    got = train(model, device)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i
    layer = model.blocks[0][0]
    assert (layer._forward_calls, layer._backward_calls) == (STEPS, STEPS)  # no extra calls


@pytest.mark.parametrize("backend", ["aot_eager", "inductor", "reduce-overhead"])
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_checkpointed_blocks_train_as_compiled_ones(device: str, backend: str) -> None:
    """torchtitan's order: each block wrapped for checkpointing, then compiled whole
    (``fullgraph``); the checkpoint's recomputation runs inside the compiled backward (on CUDA
    also under inductor's CUDA graphs, ``reduce-overhead``). The same bits as the compiled
    blocks without checkpointing (inductor's own kernels for the GELU may round otherwise than
    eager, so compiled is compared with compiled)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if backend == "reduce-overhead" and device == "cpu":
        pytest.skip("reduce-overhead is inductor with CUDA graphs")
    options = {"mode": backend} if backend == "reduce-overhead" else {"backend": backend}

    def compiled(checkpointed: bool) -> Blocks:
        model = Blocks(device)
        for i, block in enumerate(model.blocks):
            wrapped = checkpoint_wrapper(block) if checkpointed else block
            model.blocks[i] = torch.compile(wrapped, fullgraph=True, **options)
        return model

    torch._dynamo.reset()
    want = train(compiled(False), device)
    model = compiled(True)
    got = train(model, device)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i
    if backend != "reduce-overhead":  # a CUDA graph's replay runs no Python: the device
        # counters hold the count there (bits above), the host's stop at the recorded steps
        layer = model.blocks[0]._orig_mod._checkpoint_wrapped_module[0]
        assert (layer._forward_calls, layer._backward_calls) == (STEPS, STEPS)


def test_a_transformers_model_with_gradient_checkpointing_trains_as_without_it() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip

    def build(enabled: bool) -> nn.Module:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        fp4gen.convert(model, parse_recipe(RECIPE, base_dir=None), total_steps=STEPS)
        return model

    want, got = (train_causal_lm(build(enabled), enabled) for enabled in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def train_causal_lm(model: nn.Module, checkpointed: bool) -> list[torch.Tensor]:
    """STEPS SGD steps of a transformers causal LM (with gradient checkpointing where
    ``checkpointed``): the losses, then the trained parameters."""
    if checkpointed:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(2, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    seen = []
    for step in range(STEPS):
        fp4gen.set_step(model, step)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.append(loss.detach())
    return seen + [p.detach().clone() for p in model.parameters()]


def test_a_recomputation_out_of_step_is_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A no_grad forward moves the forward count past the backward's: a recomputation then
    repeats a forward with another call's streams, which is logged once."""
    monkeypatch.setattr(linear, "_warned_out_of_step", set())
    model = Blocks("cpu")
    model.mode = "non-reentrant"
    x = torch.randn(48, 64, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="fp4gen"):
        model(x).sum().backward()
        assert not caplog.records
        with torch.no_grad():
            model(x)
        model(x).sum().backward()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "recomputes a forward as call 1 after 3 forward calls" in lines[0]


@pytest.mark.parametrize("grouped", [False, True], ids=["per-expert", "grouped"])
def test_a_checkpointed_moe_model_trains_as_without_it(grouped: bool) -> None:
    """The experts' GEMM layers too (each expert's own, and the grouped path's launches)."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_moe import build

    def experts_model() -> nn.Module:
        model = build("qwen3_moe", torch.float32)
        # no 'from' copy here: a table with one runs the experts one by one
        fp4gen.convert(model, parse_recipe(PLAIN, base_dir=None), total_steps=STEPS)
        for layer in model.model.layers:
            layer.mlp.experts.grouped = grouped
        return model

    want, got = (train_causal_lm(experts_model(), enabled) for enabled in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
