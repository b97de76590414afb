"""Export of MoE checkpoints (fp4gen.export): a converted Mixtral's or Qwen3-MoE's experts are
written per expert in the layout of the family's Hugging Face hub checkpoints, which inference
engines load (Mixtral ``block_sparse_moe.experts.<e>.w1/w3/w2``, Qwen3-MoE
``mlp.experts.<e>.gate_proj/up_proj/down_proj``; transformers 5 fuses them on load), each a
quantized layer of Model Optimizer's NVFP4 (or the OCP MX) layout; gate and up share the fused
projection's global scale. ``import_quantized`` puts the 3-D parameters back together: the round
trip gives each expert's fprop weight operand bit for bit, and the state_dict loads into the
model. vLLM's fused-MoE ModelOpt loader is restated as in tests/test_export_loaders.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

import fp4gen  # noqa: E402
from fp4gen.dsl import parse_recipe  # noqa: E402
from fp4gen.dsl.model import Operand  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_export_loaders import vllm_tensors  # noqa: E402
from test_moe import build, experts_of  # noqa: E402

# family -> (the MoE block's name in the checkpoint, per-expert gate, up and down names): the
# ckpt_gate_proj_name / ckpt_up_proj_name / ckpt_down_proj_name vLLM's models give
# FusedMoE.make_expert_params_mapping (mixtral.py: w1, w3, w2; qwen3_moe.py: gate_proj,
# up_proj, down_proj)
HUB = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def exported(arch: str, tmp_path: Path, recipe: str = "nvfp4_no_bf16", **kw) -> tuple:
    model = build(arch)
    fp4gen.convert(model, recipe if "{" not in recipe else parse_recipe(recipe, base_dir=None))
    out = tmp_path / arch
    report = fp4gen.export_quantized(model, out, **kw)
    return model, out, report, load_file(str(out / "model.safetensors"))


def fprop_weights(module, proj: int) -> list[torch.Tensor]:
    """Each expert's fprop weight operand of projection ``proj`` as training quantizes it (the
    expert's GEMM layer, round-to-nearest), dequantized in fp32."""
    lay = module.layout
    weight = getattr(module, lay.weights[proj])
    out = []
    for e in range(lay.num_experts):
        layer = module.gemms[e][proj]
        spec = layer.operands.fprop_weight
        q = layer.quantize(weight[e].detach(), Operand.FPROP_WEIGHT, spec, 0)
        out.append(q.dequantize())
    return out


@pytest.mark.parametrize("arch", list(HUB))
def test_experts_are_written_per_expert_in_the_hub_layout(arch: str, tmp_path: Path) -> None:
    model, out, report, tensors = exported(arch, tmp_path)
    block, names = HUB[arch]
    experts = experts_of(model)
    hidden, inner = 64, experts.layout.inner
    for e in range(4):
        prefix = f"model.layers.0.{block}.experts.{e}"
        shapes = ((inner, hidden), (inner, hidden), (hidden, inner))
        for name, (n, k) in zip(names, shapes, strict=True):
            for suffix, (dtype, shape) in vllm_tensors("W4A16_NVFP4", n, k).items():
                got = tensors[f"{prefix}.{name}.{suffix}"]
                assert (got.dtype, tuple(got.shape)) == (dtype, shape), (name, suffix)
        # w1 and w3 (gate and up) share one global scale: vLLM's fused w13 reads one per expert
        gate, up = (tensors[f"{prefix}.{n}.weight_scale_2"] for n in names[:2])
        assert torch.equal(gate, up)
    assert not [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]
    config = json.loads((out / "hf_quant_config.json").read_text())
    excluded = config["quantization"]["exclude_modules"]
    assert f"model.layers.0.{block}.gate" in excluded  # the router: never quantized
    assert f"model.layers.0.{block}.gate.weight" in tensors
    assert not [name for name in excluded if ".experts" in name]
    assert report.config_algo == "W4A16_NVFP4"
    assert f"model.layers.0.{block}.experts.3.{names[2]}" in report.quantized
    row = next(r for r in report.layers if r[0] == "model.layers.0.mlp.experts (4 experts)")
    assert row[1].startswith("NVFP4") and "gate and up share a global scale" in row[2]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "W4A16_NVFP4"


@pytest.mark.parametrize("arch", list(HUB))
@pytest.mark.parametrize("recipe", ["nvfp4_no_bf16", "mxfp8"])
def test_round_trip_is_bit_exact(arch: str, recipe: str, tmp_path: Path) -> None:
    """import_quantized gives each expert's fprop weight operand (the codes, block scales and
    global scale of training) bit for bit, under the model's keys and 3-D shapes; every other
    tensor as written; the state_dict loads into the model."""
    model, out, _, _ = exported(arch, tmp_path, recipe)
    state, config = fp4gen.import_quantized(out)
    assert set(state) == set(model.state_dict())
    for i in range(2):
        experts = experts_of(model, i)
        inner = experts.layout.inner
        gate_up = state[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        down = state[f"model.layers.{i}.mlp.experts.down_proj"]
        assert gate_up.shape == experts.gate_up_proj.shape and gate_up.dtype == torch.float32
        for e, want in enumerate(fprop_weights(experts, 0)):
            assert torch.equal(gate_up[e], want), (i, e)
            assert gate_up[e, :inner].abs().sum() > 0 and gate_up[e, inner:].abs().sum() > 0
        for e, want in enumerate(fprop_weights(experts, 1)):
            assert torch.equal(down[e], want), (i, e)
    router = "model.layers.0.mlp.gate.weight"
    assert torch.equal(state[router], model.state_dict()[router].to(torch.bfloat16))
    assert [d["module"] for d in config["fp4gen"]["experts"]] == [
        f"model.layers.{i}.mlp.experts" for i in range(2)
    ]
    fresh = build(arch)
    fresh.load_state_dict(state)
    assert torch.equal(experts_of(fresh).down_proj[2], fprop_weights(experts_of(model), 1)[2])


def test_mxfp8_experts_are_the_ocp_mx_layout(tmp_path: Path) -> None:
    _, _, report, tensors = exported("qwen3_moe", tmp_path, "mxfp8")
    weight = tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    scale = tensors["model.layers.1.mlp.experts.2.up_proj.weight_scale"]
    assert (weight.dtype, tuple(weight.shape)) == (torch.float8_e4m3fn, (32, 64))
    assert (scale.dtype, tuple(scale.shape)) == (torch.uint8, (32, 2))
    assert report.config_algo == "MXFP8"


def test_experts_kept_in_high_precision_are_written_per_expert(tmp_path: Path) -> None:
    """A rule keeping the experts in BF16: their weights go out per expert in the hub layout,
    in the export dtype, listed in exclude_modules; the round trip gives them as written."""
    recipe = (
        'operands {\n * : nvfp4\n weight : block 16x16\n}\nlayers {\n match "*experts*" : bf16\n}\n'
    )
    model, out, report, tensors = exported("mixtral", tmp_path, recipe)
    w1 = tensors["model.layers.0.block_sparse_moe.experts.1.w1.weight"]
    assert w1.dtype == torch.bfloat16
    assert torch.equal(w1, experts_of(model).gate_up_proj[1, :32].detach().to(torch.bfloat16))
    assert "model.layers.0.block_sparse_moe.experts.1.w1.weight_scale" not in tensors
    assert "model.layers.0.block_sparse_moe.experts.1.w3" in report.excluded
    state, _ = fp4gen.import_quantized(out)
    want = experts_of(model).gate_up_proj.detach().to(torch.bfloat16)
    assert torch.equal(state["model.layers.0.mlp.experts.gate_up_proj"], want)


def routed_amax(model, ids_list) -> dict[tuple[int, int], float]:
    """Each expert's input amax of the first experts module over the batches, from the
    module's arguments: its routed tokens (projection 0) and, computed here in high precision,
    act(x W_up^T) (projection 1)."""
    experts = experts_of(model)
    source = getattr(experts, "source", experts)
    seen: dict[tuple[int, int], float] = {}

    def hook(_, args):
        hidden, index = args[0], args[1]
        for e in range(4):
            # the expert's tokens in its eager loop's order ([k, tokens], row-major), as the
            # module multiplies them: a CPU GEMM may round a row otherwise where it sits at
            # another row of the operand (one ulp of an amax on one host, in token order)
            x = hidden[torch.where((index == e).t())[1]]
            if not x.numel():
                continue
            h = source._apply_gate(torch.nn.functional.linear(x, source.gate_up_proj[e]))
            for proj, t in ((0, x), (1, h)):
                seen[(e, proj)] = max(seen.get((e, proj), 0.0), float(t.abs().amax()))

    handle = experts.register_forward_pre_hook(hook)
    with torch.no_grad():
        for ids in ids_list:
            model(ids)
    handle.remove()
    return seen


@pytest.mark.parametrize("converted", [True, False], ids=["converted", "with-recipe"])
def test_calibration_gives_each_expert_its_input_scales(converted: bool, tmp_path: Path) -> None:
    """Calibrated NVFP4 (W4A4) for the experts too, so the checkpoint stays one vLLM's ModelOpt
    loader reads: gate and up get the global decode scale of the amax of the expert's routed
    tokens, down of its activation's amax (a converted model: its quantized forward's, within
    a few percent of the high-precision one; a model exported with a recipe: the
    transformers module's own forward, exactly, run through a stand-in put back after)."""
    from fp4gen.export import _global_decode_scale

    ids = [
        torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    ]
    model = build("qwen3_moe")
    original = experts_of(model)
    if converted:
        fp4gen.convert(model, "nvfp4_no_bf16")
    report = fp4gen.export_quantized(
        model, tmp_path / "out", None if converted else "nvfp4_no_bf16", calibration=ids
    )
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert report.config_algo == "NVFP4"
    assert experts_of(model) is not original if converted else experts_of(model) is original
    want = routed_amax(model, ids)
    for e in range(4):
        prefix = f"model.layers.0.mlp.experts.{e}"
        gate, up, down = (
            float(tensors[f"{prefix}.{n}.input_scale"])
            for n in ("gate_proj", "up_proj", "down_proj")
        )
        assert gate == up == _global_decode_scale(want[(e, 0)])  # the tokens: exact
        if converted:  # the quantized forward's activation: close to the high-precision one
            assert down == pytest.approx(_global_decode_scale(want[(e, 1)]), rel=0.1)
        else:
            assert down == _global_decode_scale(want[(e, 1)])
    assert "model.layers.0.self_attn.q_proj.input_scale" in tensors
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"][
            "quant_method"
        ]
        == "modelopt"
    )


def test_an_expert_no_calibration_token_reached_gets_its_modules_widest_scale() -> None:
    from fp4gen.export import ExpertsLayout, ExportError, _experts_amax, _Layer

    lay = ExpertsLayout("m.experts", 3, ("w1", "w3", "w2"), "m.experts", None, 8)
    layer = _Layer("m.experts", torch.empty(0), False, "", experts=lay)
    got = _experts_amax(layer, {(0, 0): 2.0, (0, 1): 5.0, (2, 0): 3.0, (2, 1): 1.0})
    assert got["m.experts.1.w1"] == got["m.experts.1.w3"] == 3.0  # the widest tokens' amax
    assert got["m.experts.1.w2"] == 5.0
    assert got["m.experts.2.w1"] == 3.0 and got["m.experts.0.w2"] == 5.0
    with pytest.raises(ExportError, match="no token was routed to any expert of m.experts"):
        _experts_amax(layer, {})


# ----------------------------------------------------------------------------------------------
# gpt-oss: MXFP4 experts in gpt-oss's own layout (openai/gpt-oss hub checkpoints)
# ----------------------------------------------------------------------------------------------
# the mxfp4 recipe's operands without its layer rules (its "last 8 blocks : bf16" would keep
# both blocks of the two-layer test model)
MXFP4 = "operands {\n * : mxfp4 round nearest\n gradient : round stochastic\n}\n"


def gpt_oss_fprop(module, proj: int) -> torch.Tensor:
    """Each expert's fprop weight operand of projection ``proj`` (the expert GEMM's [N, K] =
    W^T of gpt-oss's [E, K, N] weight, quantized as training quantizes it), dequantized in fp32
    and put back as the model holds it: [E, K, N]."""
    lay = module.layout
    weight = getattr(module, lay.weights[proj])
    out = []
    for e in range(lay.num_experts):
        layer = module.gemms[e][proj]
        spec = layer.operands.fprop_weight
        q = layer.quantize(weight[e].detach().t().contiguous(), Operand.FPROP_WEIGHT, spec, 0)
        out.append(q.dequantize().t())
    return torch.stack(out)


def test_gpt_oss_mxfp4_experts_are_written_in_gpt_oss_layout(tmp_path: Path) -> None:
    """gpt-oss's hub layout: per experts module ``gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16],
    ``gate_up_proj_scales`` uint8 [E, 2I, H/32], ``down_proj_blocks`` [E, H, I/32, 16] and
    ``down_proj_scales`` [E, H, I/32], the biases as they are; config.json says quant_method
    mxfp4 (gpt-oss's own entry) and the other linear layers go out in high precision, as its
    loaders read them."""
    model, out, report, tensors = exported("gpt_oss", tmp_path, MXFP4)
    experts = experts_of(model)
    e, hidden, inner = 4, 64, experts.layout.inner
    prefix = "model.layers.0.mlp.experts"
    shapes = {
        "gate_up_proj_blocks": (e, 2 * inner, hidden // 32, 16),
        "gate_up_proj_scales": (e, 2 * inner, hidden // 32),
        "down_proj_blocks": (e, hidden, inner // 32, 16),
        "down_proj_scales": (e, hidden, inner // 32),
    }
    for name, shape in shapes.items():
        got = tensors[f"{prefix}.{name}"]
        assert (got.dtype, tuple(got.shape)) == (torch.uint8, shape), name
    for bias in ("gate_up_proj_bias", "down_proj_bias"):
        want = getattr(experts, bias).detach().to(torch.bfloat16)
        assert torch.equal(tensors[f"{prefix}.{bias}"], want)
    assert f"{prefix}.gate_up_proj" not in tensors and f"{prefix}.down_proj" not in tensors
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert (q.dtype, tuple(q.shape)) == (torch.bfloat16, (64, 64))
    assert "model.layers.0.self_attn.q_proj.weight_scale" not in tensors
    assert report.quant_algo == "MXFP4" and "gpt-oss's MXFP4 checkpoint" in report.engine
    assert report.quantized == {f"model.layers.{i}.mlp.experts": "MXFP4" for i in range(2)}
    row = next(r for r in report.layers if r[0] == "model.layers.1.self_attn.o_proj")
    assert row[1] == "kept, bf16" and "quantize the experts only" in row[2]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "mxfp4"
    assert "model.layers.0.self_attn.q_proj" in qc["modules_to_not_convert"]
    assert not [m for m in qc["modules_to_not_convert"] if m.endswith("experts")]


def test_gpt_oss_mxfp4_round_trip_is_bit_exact(tmp_path: Path) -> None:
    """import_quantized decodes the blocks and scales into the model's [E, H, 2I] and
    [E, I, H] weights: each expert's fprop weight operand bit for bit (fp32; MXFP4 values are
    exact there), and the state_dict loads into the model."""
    model, out, _, _ = exported("gpt_oss", tmp_path, MXFP4)
    state, config = fp4gen.import_quantized(out)
    assert set(state) == set(model.state_dict())
    assert config["fp4gen"]["gpt_oss_experts"] == [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
    for i in range(2):
        experts = experts_of(model, i)
        for proj, key in enumerate(("gate_up_proj", "down_proj")):
            got = state[f"model.layers.{i}.mlp.experts.{key}"]
            assert got.shape == getattr(experts, key).shape and got.dtype == torch.float32
            assert torch.equal(got, gpt_oss_fprop(experts, proj)), (i, key)
    fresh = build("gpt_oss")
    fresh.load_state_dict(state)


def test_gpt_oss_mxfp4_loads_through_transformers(tmp_path: Path) -> None:
    """transformers' own MXFP4 code on the exported folder: its dequantize
    (``convert_moe_packed_tensors``, what its Mxfp4 quantizer runs without MXFP4 kernels) gives
    the fprop weight operands bit for bit, and ``from_pretrained`` (quant_method mxfp4,
    dequantized to bf16 on the CPU) loads every tensor with no key missing or left over: the
    experts in bf16 equal the operands (MXFP4 values are exact in bf16)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model, out, _, tensors = exported("gpt_oss", tmp_path, MXFP4)
    experts = experts_of(model)
    prefix = "model.layers.0.mlp.experts"
    for proj, key in enumerate(("gate_up_proj", "down_proj")):
        blocks, scales = tensors[f"{prefix}.{key}_blocks"], tensors[f"{prefix}.{key}_scales"]
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(theirs, gpt_oss_fprop(experts, proj)), key
    config = transformers.Mxfp4Config(dequantize=True)
    loaded, info = transformers.GptOssForCausalLM.from_pretrained(
        out, quantization_config=config, dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    for i in range(2):
        mine, theirs = experts_of(model, i), experts_of(loaded, i)
        for proj, key in enumerate(("gate_up_proj", "down_proj")):
            want = gpt_oss_fprop(mine, proj).to(torch.bfloat16)
            assert torch.equal(getattr(theirs, key).detach(), want), (i, key)
    q = loaded.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q, model.model.layers[0].self_attn.q_proj.weight.detach().bfloat16())


def test_gpt_oss_in_other_formats_keeps_its_experts_in_high_precision(tmp_path: Path) -> None:
    """Only MXFP4 has gpt-oss's layout: NVFP4 experts go out as 3-D tensors in the export
    dtype, excluded, with the reason; the attention layers stay quantized as before."""
    model, out, report, tensors = exported("gpt_oss", tmp_path, "nvfp4_no_bf16")
    prefix = "model.layers.0.mlp.experts"
    want = experts_of(model).gate_up_proj.detach().to(torch.bfloat16)
    assert torch.equal(tensors[f"{prefix}.gate_up_proj"], want)
    assert f"{prefix}.gate_up_proj_blocks" not in tensors
    assert prefix in report.excluded
    row = next(r for r in report.layers if r[0] == prefix)
    assert "gpt-oss checkpoints hold 3-D experts tensors" in row[2]
    assert "model.layers.0.self_attn.q_proj.weight_scale" in tensors
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt"


def test_gpt_oss_exported_with_a_recipe_gives_the_converted_models_bits(tmp_path: Path) -> None:
    """A gpt-oss model exported with the recipe (not converted): the same MXFP4 experts, bit for
    bit, as a converted model's fprop weight operands."""
    recipe = parse_recipe(MXFP4, base_dir=None)
    fp4gen.export_quantized(build("gpt_oss"), tmp_path / "out", recipe)
    state, _ = fp4gen.import_quantized(tmp_path / "out")
    converted = fp4gen.convert(build("gpt_oss"), recipe)
    for i in range(2):
        for proj, key in enumerate(("gate_up_proj", "down_proj")):
            want = gpt_oss_fprop(experts_of(converted, i), proj)
            assert torch.equal(state[f"model.layers.{i}.mlp.experts.{key}"], want), (i, key)
