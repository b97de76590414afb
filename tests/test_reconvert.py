"""fp4gen.convert on a model that was converted before: the same recipe and options change
nothing; another recipe, other options, or a model holding layers a convert of one of its parts
made raise FP4GenError and leave the model as it was, so its plan (show_plan) and what
export_quantized writes stay one recipe's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import fp4gen
from fp4gen.demo.gpt import GPT, GPTConfig
from fp4gen.errors import FP4GenError
from fp4gen.runtime.convert import count_converted, layer_decisions
from fp4gen.runtime.linear import Linear


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(context=16, layers=4, heads=2, width=64))


def modules(model: nn.Module) -> dict[str, nn.Module]:
    return dict(model.named_modules())


def test_the_same_recipe_again_changes_nothing() -> None:
    model = fp4gen.convert(gpt(), "nvfp4_small", total_steps=100)
    plan, before = fp4gen.show_plan(model), modules(model)
    assert fp4gen.convert(model, fp4gen.load_recipe("nvfp4_small")) is model
    assert fp4gen.show_plan(model) == plan
    after = modules(model)
    assert after.keys() == before.keys()
    assert all(after[name] is module for name, module in before.items())
    # 12 layers of blocks 0-2 quantized; block 3 and lm_head kept, still plain nn.Linear
    assert count_converted(model) == 12
    assert type(model.blocks[3].mlp.fc1) is nn.Linear
    assert [d.layer_index for d in layer_decisions(model)] == list(range(17))
    # total_steps given again is set on the model's clock, as set_step sets it
    fp4gen.convert(model, "nvfp4_small", total_steps=500)
    assert model.blocks[0].attn.qkv.schedule.clock.total_steps == 500


def test_another_recipe_is_refused_and_leaves_the_model_as_it_was() -> None:
    model = fp4gen.convert(gpt(), "nvfp4_small")
    plan, before = fp4gen.show_plan(model), modules(model)
    with pytest.raises(FP4GenError, match="already converted .* recipe 'nvfp4_small'.*'mxfp8'"):
        fp4gen.convert(model, "mxfp8")
    assert fp4gen.show_plan(model) == plan
    assert all(modules(model)[name] is module for name, module in before.items())
    assert type(model.blocks[3].attn.qkv) is nn.Linear  # the kept block was not converted
    assert {d.precision for d in layer_decisions(model) if not d.kept} == {"recipe nvfp4_small"}


def test_other_options_are_refused_and_named() -> None:
    model = fp4gen.convert(gpt(), "nvfp4_small", seed=0)
    with pytest.raises(FP4GenError, match=r"'nvfp4_small' and seed=0; .* again with seed=1"):
        fp4gen.convert(model, "nvfp4_small", seed=1)
    assert model.blocks[0].attn.qkv.seed == 0


def test_a_model_holding_a_converted_part_is_refused() -> None:
    model = gpt()
    fp4gen.convert(model.blocks[0], "nvfp4_small")
    with pytest.raises(FP4GenError, match=r"blocks\.0\.attn\.qkv was already converted"):
        fp4gen.convert(model, "nvfp4_small")
    assert type(model.blocks[1].attn.qkv) is nn.Linear  # nothing else replaced
    # and a part of a converted model
    whole = fp4gen.convert(gpt(), "nvfp4_small")
    with pytest.raises(FP4GenError, match=r"attn\.qkv was already converted .*'nvfp4_small'"):
        fp4gen.convert(whole.blocks[0], "mxfp8")
    assert whole.blocks[0].attn.qkv.operands == fp4gen.load_recipe("nvfp4_small").operands


def test_layers_built_with_fp4gen_nn_linear_are_left_alone() -> None:
    """A model's own fp4gen.nn.Linear (not made by convert) does not count as a conversion."""
    model = nn.Sequential(
        fp4gen.nn.Linear(64, 64, recipe="mxfp8"), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 64)
    )
    own = model[0]
    fp4gen.convert(model, "nvfp4_small")
    assert model[0] is own and own.converted_by is None
    assert isinstance(model[2], Linear) and model[2].converted_by == "nvfp4_small"


def _config(out: Path) -> dict:
    return json.loads((out / "hf_quant_config.json").read_text())


def test_export_after_converting_twice_is_the_export_of_one_conversion(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    once = fp4gen.convert(gpt(), "nvfp4_small")
    twice = fp4gen.convert(gpt(), "nvfp4_small")
    fp4gen.convert(twice, "nvfp4_small")
    with pytest.raises(FP4GenError, match="already converted"):
        fp4gen.convert(twice, "mxfp8")
    a = fp4gen.export_quantized(once, tmp_path / "once")
    b = fp4gen.export_quantized(twice, tmp_path / "twice")
    assert b.quant_algo == a.quant_algo == "NVFP4"
    assert b.quantized == a.quantized and len(b.quantized) == 12
    assert b.excluded == a.excluded
    assert {"lm_head", "blocks.3.attn.qkv", "blocks.3.mlp.fc2"} <= set(b.excluded)
    assert _config(tmp_path / "twice") == _config(tmp_path / "once")
    ta = load_file(str(tmp_path / "once" / "model.safetensors"))
    tb = load_file(str(tmp_path / "twice" / "model.safetensors"))
    assert ta.keys() == tb.keys()
    raw = {
        k: (ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8)) for k in ta
    }
    assert all(torch.equal(x, y) for x, y in raw.values())


def test_a_converted_model_deep_copies_and_the_copy_keeps_its_conversion() -> None:
    import copy

    model = fp4gen.convert(gpt(), "nvfp4_small")
    twin = copy.deepcopy(model)
    assert fp4gen.show_plan(twin) == fp4gen.show_plan(model)
    assert fp4gen.convert(twin, "nvfp4_small") is twin  # the same conversion: nothing to do
    with pytest.raises(FP4GenError, match="already converted"):
        fp4gen.convert(twin, "mxfp8")
