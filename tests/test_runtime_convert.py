"""fp4gen.convert: layer rules, the precision schedule, and a converted model that trains."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

import fp4gen
from fp4gen.demo.gpt import GPT, GPTConfig
from fp4gen.dsl import load_recipe, parse_recipe
from fp4gen.formats import BlockFormat, HighPrecision
from fp4gen.runtime.convert import find_blocks, plan_layers

CFG = GPTConfig(context=32, layers=6, heads=2, width=32)


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def decisions(recipe_text: str) -> dict[str, str]:
    recipe = parse_recipe(recipe_text, base_dir=None)
    return {d.name: d.precision for d in plan_layers(gpt(), recipe)}


BASE = "operands {\n * : nvfp4\n}\n"


def test_blocks_are_found() -> None:
    container, block_of = find_blocks(gpt())
    assert container == "blocks"
    assert block_of["blocks.0.attn.qkv"] == 0 and block_of["blocks.5.mlp.fc2"] == 5
    assert "lm_head" not in block_of


def test_default_converts_blocks_and_keeps_the_head() -> None:
    got = decisions(BASE)
    assert got["blocks.3.mlp.fc1"] == "recipe recipe"
    assert got["lm_head"] == "unchanged"  # outside the blocks: heads stay unless asked
    assert len(got) == 6 * 4 + 1


def test_first_and_last_blocks() -> None:
    got = decisions(BASE + "layers {\n first 1 blocks : bf16\n last 2 blocks : bf16\n}\n")
    assert all(got[f"blocks.0.{m}"] == "bf16" for m in ("attn.qkv", "attn.proj", "mlp.fc1"))
    assert got["blocks.1.attn.qkv"] == "recipe recipe"
    assert got["blocks.3.mlp.fc2"] == "recipe recipe"
    assert got["blocks.4.mlp.fc2"] == "bf16" and got["blocks.5.attn.qkv"] == "bf16"


def test_fractions_of_layers_and_first_match_wins() -> None:
    # 25 linear layers; last 20% = round(5.0) = 5 layers: blocks.5.* (4) and lm_head
    got = decisions(BASE + 'layers {\n match "*fc2" : mxfp8_e4m3\n last 20% layers : bf16\n}\n')
    assert got["blocks.5.mlp.fc2"] == "mxfp8_e4m3"  # the glob rule comes first
    assert got["blocks.5.mlp.fc1"] == "bf16"
    assert got["lm_head"] == "bf16"
    assert got["blocks.4.mlp.fc1"] == "recipe recipe"
    assert got["blocks.0.mlp.fc2"] == "mxfp8_e4m3"


def test_match_can_convert_the_head_and_use_another_recipe() -> None:
    got = decisions(BASE + 'layers {\n match "lm_head" : recipe "mxfp8.fp4r"\n}\n')
    assert got["lm_head"] == "recipe mxfp8"


def test_convert_replaces_modules_and_keeps_state_dict() -> None:
    model = gpt()
    keys = set(model.state_dict())
    weight = model.blocks[2].mlp.fc1.weight
    fp4gen.convert(model, load_recipe("nvfp4.fp4r"))
    # nvfp4: first 2 and last 8 blocks in bf16: with 6 blocks every block stays bf16
    assert type(model.blocks[2].mlp.fc1) is nn.Linear
    model = gpt()
    fp4gen.convert(model, parse_recipe(BASE + "layers {\n first 1 blocks : bf16\n}\n"))
    layer = model.blocks[2].mlp.fc1
    assert isinstance(layer, fp4gen.nn.Linear)
    assert layer.weight is model.blocks[2].mlp.fc1.weight  # parameters shared, not copied
    assert set(model.state_dict()) == keys
    assert weight.shape == layer.weight.shape
    table = fp4gen.show_plan(model)
    assert "blocks.0.attn.qkv" in table and "rule first 1 blocks" in table


def test_schedule_switches_forward_at_a_step_and_a_fraction() -> None:
    recipe = parse_recipe(BASE + "schedule {\n at step 5 forward : bf16\n at 90% both : mxfp4\n}\n")
    model = fp4gen.convert(gpt(), recipe, total_steps=100)
    layer = model.blocks[1].attn.qkv
    assert isinstance(layer.operands.fprop_activation.format, BlockFormat)
    fp4gen.set_step(model, 4)
    assert layer.operands.fprop_activation.format.name == "nvfp4"
    fp4gen.set_step(model, 5)
    assert isinstance(layer.operands.fprop_activation.format, HighPrecision)
    assert layer.operands.wgrad_gradient.format.name == "nvfp4"  # backward unchanged
    fp4gen.set_step(model, 90)
    assert layer.operands.fprop_activation.format.name == "mxfp4"
    assert layer.operands.wgrad_gradient.format.name == "mxfp4"


def test_fractional_schedule_needs_total_steps() -> None:
    recipe = parse_recipe(BASE + "schedule {\n at 50% forward : bf16\n}\n")
    model = fp4gen.convert(gpt(), recipe)
    with pytest.raises(fp4gen.FP4GenError, match="pass total_steps"):
        model.blocks[0].mlp.fc1.operands  # noqa: B018


def test_converted_model_trains_on_cpu() -> None:
    recipe = parse_recipe(
        "operands {\n * : nvfp4\n gradient : round stochastic\n wgrad : rht 16 signs te\n}\n"
    )
    model = fp4gen.convert(gpt(), recipe)
    fp4gen.enable_telemetry(model, every=5)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 16, (64, CFG.context + 1), generator=g)  # a 16-symbol toy language
    losses = []
    for step in range(15):
        fp4gen.set_step(model, step)
        batch = data[(step * 4) % 60 : (step * 4) % 60 + 4]
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 1.0
    records = fp4gen.telemetry(model)
    assert records and {"layer", "operand", "rel_error", "flushed", "saturated"} <= set(records[0])
    assert all(0 <= r["rel_error"] < 0.5 for r in records)


def test_mor_recipe_converts() -> None:
    model = fp4gen.convert(gpt(), load_recipe("mor_tensor.fp4r"))
    layer = model.blocks[0].mlp.fc1
    assert isinstance(layer, fp4gen.nn.Linear) and set(layer.mors) == {"tensor_e4m3"}


def test_widths_the_quantize_kernels_pad_are_said_once_at_info(caplog) -> None:
    """A feature size that is not a multiple of an operand's block length (after the RHT
    padding): where the kernels zero-pad every such operand exactly (round to nearest), convert
    says so once per size and operand pair at INFO, naming the layers (the copy costs a pass:
    a llama-wide MLP of 10944 under FP8's 1x128 blocks)."""
    model = nn.Sequential(
        nn.Linear(256, 10944), nn.ReLU(), nn.Linear(10944, 256), nn.ReLU(),
        nn.Linear(256, 10944), nn.ReLU(), nn.Linear(10944, 256),
    )  # fmt: skip
    with caplog.at_level("INFO", logger="fp4gen.runtime"):
        fp4gen.convert(model, "recipes/fp8_blockwise.fp4r")
    said = [r for r in caplog.records if r.getMessage().startswith("fp4gen.convert")]
    assert [r.levelname for r in said] == ["INFO", "INFO"]
    out, inp = (r.getMessage() for r in said)
    assert out.startswith(
        "fp4gen.convert: out_features 10944 of 0 (and 1 more layers) is not a multiple of the "
        "blocks of dgrad.gradient (fp8_block 1x128) and dgrad.weight (fp8_block 128x128): "
        "on CUDA the generated quantize kernels zero-pad those operands"
    )
    assert inp.startswith("fp4gen.convert: in_features 10944 of 2 (and 1 more layers) ")
    assert "a multiple of 128 avoids the copy" in inp


def test_widths_whose_operands_go_to_the_reference_are_warned_once(caplog) -> None:
    """A stochastically rounded operand cannot be padded (a value's random bits follow its
    position): such a size sends it to the reference quantizer on CUDA, warned once."""
    recipe = parse_recipe("operands {\n * : nvfp4 round stochastic\n}\n", base_dir=None)
    model = nn.Sequential(nn.Linear(256, 200), nn.ReLU(), nn.Linear(200, 256))
    with caplog.at_level("INFO", logger="fp4gen.runtime"):
        fp4gen.convert(model, recipe)
    said = [r for r in caplog.records if r.getMessage().startswith("fp4gen.convert")]
    assert [r.levelname for r in said] == ["WARNING", "WARNING"]
    assert all("quantized by the torch reference" in r.getMessage() for r in said)
    assert "a multiple of 16 avoids it" in said[0].getMessage()


def test_widths_padded_to_the_rht_or_multiples_of_the_blocks_are_not_warned(caplog) -> None:
    # 256 and 1024: multiples of every block; nvfp4's wgrad RHT pads only the token count
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    recipe = parse_recipe("operands {\n * : nvfp4 rht 16\n}\n", base_dir=None)
    small = nn.Sequential(nn.Linear(40, 24))  # padded to 48 and 32 by the RHT: multiples of 16
    with caplog.at_level("WARNING", logger="fp4gen.runtime"):
        fp4gen.convert(model, "recipes/fp8_blockwise.fp4r")
        fp4gen.convert(small, recipe)
    assert not [r for r in caplog.records if r.getMessage().startswith("fp4gen.convert")]


class _ScaledLinear(nn.Linear):
    """A subclass of nn.Linear: convert replaces exactly nn.Linear, so it stays."""


def _report_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.embed = nn.Embedding(64, 32)  # 2048 elements
    model.blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)) for _ in range(3)
    )
    model.custom = _ScaledLinear(32, 40)  # 1280 + 40
    model.head = nn.Linear(32, 64, bias=False)  # outside the blocks: 2048
    model.norm = nn.LayerNorm(32)
    return model


def test_convert_names_the_large_parameters_it_leaves_in_high_precision(caplog) -> None:
    """Every parameter of report_min_elements or more that stays in high precision is named
    once, at WARNING, with the reason; show_plan lists them and the shares quantized."""
    model = _report_model()
    recipe = parse_recipe(BASE + "layers {\n last 1 blocks : bf16\n}\n", base_dir=None)
    with caplog.at_level("WARNING", logger="fp4gen.runtime"):
        fp4gen.convert(model, recipe, report_min_elements=1280)
        fp4gen.convert(model, recipe, report_min_elements=1280)  # a no-op: no second warning
    warnings = [r.getMessage() for r in caplog.records if "left" in r.getMessage()]
    assert len(warnings) == 1
    lines = warnings[0].splitlines()
    assert lines[0] == (
        "fp4gen.convert left 5 parameters of 1280 elements or more in high precision (8192 of "
        "18056 parameter elements quantized, 45.4%):"
    )
    assert [line.split(" [")[0].strip() for line in lines[1:]] == [
        "embed.weight",
        "blocks.2.0.weight",
        "blocks.2.2.weight",
        "custom.weight",
        "head.weight",
    ]
    assert lines[1] == (
        "  embed.weight [64, 32]: an embedding (Embedding): convert quantizes linear layers only"
    )
    assert lines[2] == "  blocks.2.0.weight [64, 32]: kept in bf16 by the rule last 1 blocks"
    assert lines[4] == (
        "  custom.weight [40, 32]: a subclass of nn.Linear (_ScaledLinear): convert replaces "
        "exactly torch.nn.Linear"
    )
    assert lines[5] == (
        "  head.weight [64, 32]: outside the repeated blocks (kept as it is unless a layer rule "
        "names it)"
    )
    done = fp4gen.runtime.convert.report(model)
    # 2 converted blocks x (2048 + 2048) weights; linear layers: 3 blocks x (4096 + 96 biases)
    # + head 2048 (custom is a subclass, not a layer convert takes); the norm's 64 too
    assert (done.quantized, done.parameters, done.layer_parameters) == (8192, 18056, 14624)
    table = fp4gen.show_plan(model)
    assert "left in high precision (parameters of 1280 elements or more):" in table
    assert "custom.weight" in table and "40x32" in table
    assert table.endswith(
        "quantized: 8192 of 18056 parameter elements (45.4%); 8192 of 14624 in linear layers "
        "(56.0%)"
    )


def test_the_report_threshold_defaults_to_a_million_elements(caplog) -> None:
    from fp4gen.runtime.convert import REPORT_MIN_ELEMENTS

    assert REPORT_MIN_ELEMENTS == 1_000_000
    model = _report_model()
    model.big = nn.Embedding(1000, 1000)  # exactly 1M: named
    model.near = nn.Embedding(999, 1000)  # one row short: not named
    with caplog.at_level("WARNING", logger="fp4gen.runtime"):
        fp4gen.convert(model, parse_recipe(BASE, base_dir=None))
    (warning,) = [r.getMessage() for r in caplog.records if "left" in r.getMessage()]
    assert warning.splitlines()[1:] == [
        "  big.weight [1000, 1000]: an embedding (Embedding): convert quantizes linear layers only"
    ]
    assert "big.weight" in fp4gen.show_plan(model) and "near.weight" not in fp4gen.show_plan(model)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1M"])
def test_the_report_threshold_is_checked(bad) -> None:
    with pytest.raises(fp4gen.errors.ArgumentError, match="report_min_elements must be"):
        fp4gen.convert(_report_model(), parse_recipe(BASE, base_dir=None), report_min_elements=bad)


def test_torch_transformer_layers_run_their_converted_layers_in_eval_mode(caplog) -> None:
    """nn.TransformerEncoderLayer in eval mode without grad takes torch's fused inference
    kernel, which reads linear1 / linear2's weights itself (and nn.TransformerEncoder feeds it
    nested tensors for padded batches): the converted feed-forward layers silently ran in high
    precision there. convert closes those paths, so eval without grad runs the converted
    layers (8 calls per forward: the attention's two projections too, fp4gen's
    MultiheadAttention) and gives eval-with-grad's output (the layers' own forwards) up to the
    attention's summation order, with and without a padding mask; said once."""
    from fp4gen.runtime import linear

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)
    with caplog.at_level("INFO", logger="fp4gen"):
        fp4gen.convert(model, "mxfp8")
    said = [r for r in caplog.records if "fused inference path" in r.getMessage()]
    assert len(said) == 1 and "layers.0" in said[0].getMessage()
    calls: list[str] = []
    forward = linear.Linear.forward

    def counted(self, x):
        calls.append(self.name)
        return forward(self, x)

    x = torch.randn(3, 16, 64)
    pad = torch.zeros(3, 16, dtype=torch.bool)
    pad[1, 12:] = True  # a padded sequence: the nested-tensor path before
    model.eval()
    with mock.patch.object(linear.Linear, "forward", counted):
        for mask in (None, pad):
            with torch.no_grad():
                fast = model(x, src_key_padding_mask=mask)
            assert len(calls) == 8, calls  # in_proj, out_proj, linear1, linear2 of both
            calls.clear()
            slow = model(x, src_key_padding_mask=mask).detach()  # grad on: torch's own slow path
            calls.clear()
            # the scaled dot product may take another kernel without grad: another fp32
            # summation order there, a few ulps (the converted layers' bits are the same)
            torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
