"""convert on models with more than one stack of repeated blocks: an encoder-decoder (torch's
nn.Transformer, transformers' T5, BART and Whisper from tiny configs, no download) trains both
stacks in the recipe, and block rules count blocks within each stack. Before, only the stack
holding the most linear layers was the "repeated blocks" and every layer of the other stayed in
high precision as "outside the repeated blocks" (reported, but half the model)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fp4gen
from fp4gen.dsl import load_recipe, parse_recipe
from fp4gen.runtime.convert import block_stacks, find_blocks, layer_decisions, plan_layers, report

BASE = "operands {\n * : nvfp4\n}\n"


def recipe(layers: str):
    return parse_recipe(BASE + "layers {\n" + layers + "}\n", base_dir=None)


def transformer() -> nn.Transformer:
    torch.manual_seed(0)
    return nn.Transformer(64, 4, 3, 2, 128, dropout=0.0, batch_first=True)


def test_both_stacks_of_an_encoder_decoder_are_blocks() -> None:
    model = transformer()
    stacks = {name: sorted(set(ranks.values())) for name, ranks in block_stacks(model)}
    assert stacks == {"encoder.layers": [0, 1, 2], "decoder.layers": [0, 1]}
    assert find_blocks(model)[0] == "encoder.layers"  # the main stack: the most linear layers
    plan = plan_layers(model, recipe(""))
    assert [d.name for d in plan if d.kept] == []  # nothing outside the blocks


def test_block_rules_count_within_each_stack() -> None:
    plan = {d.name: d for d in plan_layers(transformer(), recipe(" first 1 blocks : bf16\n"))}
    kept = sorted(n for n, d in plan.items() if d.kept)
    # (the attention modules' projections join the plan when convert swaps the modules)
    assert kept == [
        "decoder.layers.0.linear1", "decoder.layers.0.linear2",
        "encoder.layers.0.linear1", "encoder.layers.0.linear2",
    ]  # fmt: skip
    assert plan["decoder.layers.0.linear1"].reason == "rule first 1 blocks"
    plan = {d.name: d for d in plan_layers(transformer(), recipe(" last 50% blocks : bf16\n"))}
    # half of 3 blocks rounds to 2, half of 2 to 1: each stack's own count
    assert {n.rsplit(".", 1)[0] for n, d in plan.items() if d.kept and "linear1" in n} == {
        "encoder.layers.1", "encoder.layers.2", "decoder.layers.1",
    }  # fmt: skip


def test_a_head_of_bare_linear_layers_is_not_a_second_stack() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(
                *[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)]
            )
            self.head = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))

    stacks = [name for name, _ in block_stacks(Model())]
    assert stacks == ["layers"]
    plan = {d.name: d for d in plan_layers(Model(), recipe(""))}
    assert plan["head.0"].kept and plan["head.0"].reason == "outside the repeated blocks"


def test_a_converted_nn_transformer_trains_both_stacks() -> None:
    model = transformer()
    fp4gen.convert(model, "nvfp4_small", total_steps=4)
    decisions = {d.name: d for d in layer_decisions(model)}
    for stack, last in (("encoder", 2), ("decoder", 1)):
        assert not decisions[f"{stack}.layers.0.linear1"].kept
        assert decisions[f"{stack}.layers.{last}.linear1"].reason == "rule last 1 blocks"
    src, tgt = torch.randn(2, 10, 64), torch.randn(2, 7, 64)
    model(src, tgt).square().mean().backward()
    assert model.encoder.layers[0].linear1.weight.grad.abs().sum() > 0
    assert not any("outside the repeated blocks" in p.reason for p in report(model).kept)


transformers = pytest.importorskip("transformers")


def t5() -> Any:
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def bart() -> Any:
    config = transformers.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


def whisper() -> Any:
    config = transformers.WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
        max_source_positions=16, max_target_positions=16, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=0, begin_suppress_tokens=None,
        suppress_tokens=None,
    )  # fmt: skip
    return transformers.WhisperForConditionalGeneration(config)


def step_inputs(name: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(3, 64, (2, 6), generator=g)
    if name == "whisper":  # 8 mel bins, 2 x 16 frames (the convolutions halve them)
        return {"input_features": torch.randn(2, 8, 32, generator=g), "labels": labels}
    return {"input_ids": torch.randint(3, 64, (2, 9), generator=g), "labels": labels}


@pytest.mark.parametrize(
    ("name", "build", "stacks"),
    [
        ("t5", t5, {"encoder.block": 3, "decoder.block": 2}),
        ("bart", bart, {"model.encoder.layers": 2, "model.decoder.layers": 3}),
        ("whisper", whisper, {"model.encoder.layers": 2, "model.decoder.layers": 2}),
    ],
)
def test_transformers_encoder_decoders_convert_both_stacks(name: str, build, stacks) -> None:
    """Both stacks are blocks, every linear layer of both is converted but each stack's last
    block (nvfp4_small's rule), a training step reaches the encoder's weights, and no layer is
    left "outside the repeated blocks"."""
    torch.manual_seed(0)
    model = build()
    found = {c: len(set(r.values())) for c, r in block_stacks(model)}
    assert found == stacks
    fp4gen.convert(model, "nvfp4_small", total_steps=4)
    decisions = layer_decisions(model)
    converted = [d.name for d in decisions if not d.kept]
    for stack, blocks in stacks.items():
        first = [n for n in converted if n.startswith(f"{stack}.0.")]
        last = [d for d in decisions if d.name.startswith(f"{stack}.{blocks - 1}.")]
        assert first and all(d.kept and d.reason == "rule last 1 blocks" for d in last), stack
    outside = [d.name for d in decisions if d.reason == "outside the repeated blocks"]
    assert outside == (["proj_out"] if name == "whisper" else [])  # Whisper's output head
    loss = model(**step_inputs(name)).loss
    loss.backward()
    assert torch.isfinite(loss)
    encoder_first = next(iter(stacks))
    grads = [p.grad for n, p in model.named_parameters() if n.startswith(f"{encoder_first}.0.")]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_a_vision_language_models_vision_tower_is_a_stack_too() -> None:
    """LLaVA: the language model's layers (the main stack) and the vision tower's encoder
    layers are both blocks; the projector (two linear layers, not a list) stays outside."""
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=32, patch_size=8, projection_dim=32,
    )  # fmt: skip
    text = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=127)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    stacks = {c: len(set(r.values())) for c, r in block_stacks(model)}
    assert stacks == {"model.language_model.layers": 3, "model.vision_tower.encoder.layers": 2}
    plan = {d.name: d for d in plan_layers(model, load_recipe("nvfp4_small"))}
    assert not plan["model.vision_tower.encoder.layers.0.mlp.fc1"].kept
    assert plan["model.vision_tower.encoder.layers.1.mlp.fc1"].reason == "rule last 1 blocks"
    assert plan["model.multi_modal_projector.linear_1"].reason == "outside the repeated blocks"
