"""fp4gen.convert on Hugging Face transformers causal LMs built from tiny configs (no download):
Llama, Qwen2, Qwen3 (where the installed transformers has it), Mistral and GPT-2 (whose Conv1D
layers are wrapped with their [in, out] weight layout kept)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import fp4gen  # noqa: E402
from fp4gen.dsl import load_recipe  # noqa: E402
from fp4gen.runtime.convert import find_blocks, plan_layers  # noqa: E402
from fp4gen.runtime.linear import Conv1DLinear  # noqa: E402

SMALL = load_recipe("nvfp4_small.fp4r")  # NVFP4 method; last block and lm_head in BF16
NO_SR = load_recipe("nvfp4_no_sr.fp4r")
VOCAB = 256


def _decoder_config(name: str, layers: int) -> Any:
    config = getattr(transformers, name)
    extra = {"head_dim": 16} if name == "Qwen3Config" else {}
    return config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        **extra,
    )


def _gpt2_config(layers: int) -> Any:
    return transformers.GPT2Config(
        n_embd=64,
        n_layer=layers,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=512,
        bos_token_id=0,
        eos_token_id=1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


ARCHS = {  # arch: (model class, config builder, repeated container)
    "llama": ("LlamaForCausalLM", lambda n: _decoder_config("LlamaConfig", n), "model.layers"),
    "qwen2": ("Qwen2ForCausalLM", lambda n: _decoder_config("Qwen2Config", n), "model.layers"),
    "qwen3": ("Qwen3ForCausalLM", lambda n: _decoder_config("Qwen3Config", n), "model.layers"),
    "mistral": (
        "MistralForCausalLM",
        lambda n: _decoder_config("MistralConfig", n),
        "model.layers",
    ),
    "gpt2": ("GPT2LMHeadModel", _gpt2_config, "transformer.h"),
}


def build(arch: str, layers: int = 3, seed: int = 0) -> nn.Module:
    cls_name, config, _ = ARCHS[arch]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    torch.manual_seed(seed)
    return cls(config(layers))


def converted(model: nn.Module) -> dict[str, fp4gen.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, fp4gen.nn.Linear)}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_layer_rules_pick_the_blocks_and_keep_the_head(arch: str) -> None:
    model = build(arch, layers=3)
    container, block_of = find_blocks(model)
    assert container == ARCHS[arch][2]
    assert set(block_of.values()) == {0, 1, 2}
    before = {k: (v.shape, v.data_ptr()) for k, v in model.state_dict().items()}
    fp4gen.convert(model, SMALL)
    # parameters shared, state_dict keys and layouts (GPT-2's [in, out] Conv1D weights) kept
    assert {k: (v.shape, v.data_ptr()) for k, v in model.state_dict().items()} == before
    plan = {d.name: d for d in model._fp4gen_plan}
    assert plan["lm_head"].kept and plan["lm_head"].reason == 'rule match "*lm_head"'
    assert type(model.lm_head) is nn.Linear
    per_block = 4 if arch == "gpt2" else 7
    layers = converted(model)
    assert len(layers) == 2 * per_block  # blocks 0 and 1; block 2 is the last: kept
    prefix = ARCHS[arch][2]
    assert all(n.startswith((f"{prefix}.0.", f"{prefix}.1.")) for n in layers)
    assert all(plan[n].reason == "rule last 1 blocks" for n in plan if n.startswith(f"{prefix}.2."))
    if arch == "gpt2":
        assert all(isinstance(m, Conv1DLinear) for m in layers.values())
        assert "transformer.h.0.attn.c_attn (Conv1D)" in fp4gen.show_plan(model)
    else:
        assert "model.layers.0.self_attn.q_proj" in layers
        assert "model.layers.1.mlp.down_proj" in layers


def test_nvfp4_first_2_and_last_8_blocks_on_a_12_layer_llama() -> None:
    plan = plan_layers(build("llama", layers=12), load_recipe("nvfp4.fp4r"))
    quantized = sorted({d.block_index for d in plan if not d.kept})
    assert quantized == [2, 3]
    assert next(d for d in plan if d.name == "lm_head").kept


@pytest.mark.parametrize("arch", list(ARCHS))
def test_trains_on_a_fixed_batch(arch: str) -> None:
    model = build(arch, layers=3)
    fp4gen.convert(model, SMALL)
    layers = converted(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, VOCAB, (3, 37), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(8):
        fp4gen.set_step(model, step)
        loss = model(input_ids=ids, labels=ids).loss
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        for name, layer in layers.items():
            grad = layer.weight.grad
            assert grad is not None and grad.shape == layer.weight.shape, name
            assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("shape", [(3, 37), (2, 257)])
def test_odd_batch_shapes_train_and_evaluate(arch: str, shape: tuple[int, int]) -> None:
    model = build(arch, layers=2)
    fp4gen.convert(model, load_recipe("mxfp4.fp4r"))  # wgrad RHT 32: 111 and 514 tokens pad
    ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(2))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(m.weight.grad).all() for m in converted(model).values())
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    with torch.inference_mode():
        again = model(input_ids=ids).logits
    assert logits.shape == (*shape, VOCAB) and torch.isfinite(logits).all()
    assert torch.equal(logits, again)  # fprop rounds to nearest: eval is deterministic


def test_greedy_generation_one_token_at_a_time() -> None:
    model = build("llama", layers=2)
    fp4gen.convert(model, SMALL).eval()
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 8) and torch.equal(out[:, :5], ids)


def test_conv1d_wrapper_equals_a_linear_on_the_transposed_weight() -> None:
    conv = transformers.pytorch_utils.Conv1D(48, 40)  # nf = 48 outputs, nx = 40 inputs
    torch.manual_seed(4)
    nn.init.normal_(conv.weight, std=0.1)
    nn.init.normal_(conv.bias, std=0.1)
    keys = {k: v.shape for k, v in conv.state_dict().items()}
    wrapped = Conv1DLinear.from_conv1d(conv, recipe=NO_SR, name="c")
    assert wrapped.weight is conv.weight and (wrapped.nf, wrapped.nx) == (48, 40)
    assert {k: v.shape for k, v in wrapped.state_dict().items()} == keys
    linear = fp4gen.nn.Linear(40, 48, recipe=NO_SR, name="l")
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    x, dy = torch.randn(2, 7, 40), torch.randn(2, 7, 48)
    outs = []
    for layer in (wrapped, linear):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(dy)
        outs.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
    (y1, dx1, dw1, db1), (y2, dx2, dw2, db2) = outs
    assert torch.equal(y1, y2) and torch.equal(dx1, dx2) and torch.equal(db1, db2)
    assert dw1.shape == (40, 48) and torch.equal(dw1, dw2.t())


def test_converted_gpt2_saves_and_loads_as_a_plain_checkpoint(tmp_path) -> None:
    pytest.importorskip("safetensors")
    model = build("gpt2", layers=2)
    fp4gen.convert(model, SMALL)
    model.save_pretrained(tmp_path)
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    state = model.state_dict()
    for key, value in plain.state_dict().items():
        assert torch.equal(value, state[key]), key
    back = build("gpt2", layers=2, seed=9)
    fp4gen.convert(back, SMALL)
    back.load_state_dict(plain.state_dict())
    got, want = back.transformer.h[0].attn.c_attn, plain.transformer.h[0].attn.c_attn
    assert isinstance(got, Conv1DLinear) and torch.equal(got.weight, want.weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(16, 257), (1, 7), (3, 1371)])
def test_llama_on_the_gpu_trains_on_odd_batches_and_evaluates(shape: tuple[int, int]) -> None:
    """A Llama with the NVFP4 method (nvfp4_small: 16x16 weights, RHT and SR on wgrad) trains on
    the GPU kernels with token counts that no block or RHT size divides, and evaluates under
    no_grad and inference_mode with the same logits."""
    model = build("llama", layers=3).cuda()
    fp4gen.convert(model, SMALL)
    layers = converted(model)
    assert layers, "nvfp4_small converts the first blocks of a 3-block Llama"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(4)).cuda()
    losses = []
    for step in range(3):
        fp4gen.set_step(model, step)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        for name, layer in layers.items():
            grad = layer.weight.grad
            assert grad is not None and torch.isfinite(grad).all(), name
            assert grad.abs().sum() > 0, name
        opt.step()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses)))
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        again = model(input_ids=ids).logits
    assert logits.shape == (*shape, VOCAB) and torch.isfinite(logits).all()
    assert torch.equal(logits, again)
