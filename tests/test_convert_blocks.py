"""Layer rules count blocks by rank: a block's index is its rank among the repeated container's
children that hold linear layers, not its child position."""

from __future__ import annotations

import torch
from torch import nn

import fp4gen
from fp4gen.demo.gpt import GPT, GPTConfig
from fp4gen.dsl import parse_recipe
from fp4gen.runtime.convert import find_blocks, plan_layers

BASE = "operands {\n * : nvfp4\n}\n"


def recipe(layers: str):
    return parse_recipe(BASE + "layers {\n" + layers + "}\n", base_dir=None)


def interleaved(n: int = 24, width: int = 16) -> nn.Sequential:
    """Linear, ReLU, Linear, ReLU, ...: n linears at child positions 0, 2, 4, ..."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(n):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def test_interleaved_sequential_blocks_are_ranks() -> None:
    container, block_of = find_blocks(interleaved())
    assert container == ""
    assert block_of["0"] == 0 and block_of["2"] == 1 and block_of["46"] == 23
    assert sorted(block_of.values()) == list(range(24))


def test_last_8_blocks_keep_8_linears() -> None:
    plan = plan_layers(interleaved(), recipe(" last 8 blocks : bf16\n"))
    kept = [d.name for d in plan if d.kept]
    assert kept == [str(2 * i) for i in range(16, 24)]
    assert sum(not d.kept for d in plan) == 16


def test_first_2_and_last_8_blocks_as_in_the_nvfp4_recipe() -> None:
    plan = plan_layers(interleaved(), recipe(" first 2 blocks : bf16\n last 8 blocks : bf16\n"))
    by_block = {d.block_index: d for d in plan}
    assert [b for b, d in sorted(by_block.items()) if d.kept] == [0, 1, *range(16, 24)]
    assert by_block[0].reason == "rule first 2 blocks"
    assert by_block[23].reason == "rule last 8 blocks"
    assert sum(d.kept for d in plan) == 10


def test_percent_of_blocks_counts_ranks() -> None:
    # 25% of 24 blocks = 6 blocks: the first six linears, whatever sits between them
    plan = plan_layers(interleaved(), recipe(" first 25% blocks : bf16\n"))
    assert [d.name for d in plan if d.kept] == [str(2 * i) for i in range(6)]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_sequential_of_blocks_with_norms_and_dropouts_between() -> None:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(4):
        mods += [Block(8), nn.LayerNorm(8), nn.Dropout(0.0)]
    model = nn.Sequential(*mods, nn.Linear(8, 3))  # the head is a numbered child too
    _, block_of = find_blocks(model)
    assert block_of["0.fc1"] == 0 and block_of["3.fc2"] == 1 and block_of["9.fc1"] == 3
    assert block_of["12"] == 4  # the head: the fifth child holding a linear layer
    plan = {d.name: d for d in plan_layers(model, recipe(" last 1 blocks : bf16\n"))}
    assert plan["12"].kept and not plan["9.fc1"].kept


def test_modulelist_with_children_that_hold_no_linear() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList([Block(8), nn.Identity(), Block(8), nn.GELU(), Block(8)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    model = Model()
    container, block_of = find_blocks(model)
    assert container == "layers"
    assert {block_of["layers.0.fc1"], block_of["layers.2.fc1"], block_of["layers.4.fc2"]} == {
        0,
        1,
        2,
    }
    assert block_of["layers.2.fc2"] == 1
    fp4gen.convert(model, recipe(" last 1 blocks : bf16\n"))
    assert type(model.layers[4].fc1) is nn.Linear  # the last block: kept
    assert isinstance(model.layers[2].fc1, fp4gen.nn.Linear)
    x = torch.randn(5, 8, requires_grad=True)
    model(x).sum().backward()
    assert torch.isfinite(x.grad).all()
    table = fp4gen.show_plan(model)
    assert "layers.4.fc2" in table and "rule last 1 blocks" in table


def test_gpt_demo_blocks_unchanged() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(context=16, layers=5, heads=2, width=32))
    container, block_of = find_blocks(model)
    assert container == "blocks"
    assert block_of["blocks.0.attn.qkv"] == 0 and block_of["blocks.4.mlp.fc2"] == 4
    plan = {d.name: d for d in plan_layers(model, recipe(" first 1 blocks : bf16\n"))}
    assert plan["blocks.0.mlp.fc1"].kept and not plan["blocks.1.mlp.fc1"].kept
    assert plan["lm_head"].kept and plan["lm_head"].reason == "outside the repeated blocks"
