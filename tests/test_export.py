"""Checkpoint export and import (fp4gen.export, ``fp4gen export``): the NVFP4 file has Model
Optimizer's names, dtypes and shapes; layers a layer rule keeps in BF16 are excluded and written
unquantized; export -> import gives back, bit for bit, the values ``QuantizedTensor.dequantize()``
gives for the recipe's fprop weight quantization (2D and 1D NVFP4, MXFP8, MXFP4); the command
line on a tiny Llama folder and on a state_dict file; one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

import fp4gen  # noqa: E402
from fp4gen.cli import main  # noqa: E402
from fp4gen.demo.gpt import GPT, GPTConfig  # noqa: E402
from fp4gen.dsl import load_recipe  # noqa: E402
from fp4gen.export import (  # noqa: E402
    ExportError,
    export_quantized,
    import_quantized,
    load_quantized,
    skeleton,
)
from fp4gen.runtime.convert import plan_layers  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"
SMALL = load_recipe("nvfp4_small")  # 16x16 weights; last block and lm_head in BF16
NVFP4_1D = load_recipe(
    'recipe nvfp4_1d_small\nextends "nvfp4_small.fp4r"\noperands {\n    weight : block 1x16\n}\n'
)
MXFP8 = load_recipe("mxfp8")
MXFP4 = load_recipe("mxfp4_small")
MIXED = load_recipe(
    'recipe mixed\nextends "nvfp4_small.fp4r"\nlayers {\n    match "*fc1" : mxfp8_e4m3\n'
    '    last 1 blocks : bf16\n    match "*lm_head" : bf16\n}\n'
)


def gpt(layers: int = 3, seed: int = 0) -> GPT:
    """A tiny GPT whose weights hold the values quantizers trip on: large and tiny magnitudes,
    exact zeros and negatives that round to zero."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(layers=layers, width=64))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                w = module.weight
                w.mul_(torch.logspace(-3, 1, w.shape[1]))  # columns from 1e-3 to 10x
                w[0, :5] = torch.tensor([0.0, -1e-9, 1e-9, -0.0, 3e4])
    return model


def bits(t: torch.Tensor) -> torch.Tensor:
    """The fp32 bit patterns: equality of these is equality bit for bit (-0.0 != 0.0)."""
    return t.to(torch.float32).contiguous().view(torch.int32)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def quantized_names(model: nn.Module, recipe: fp4gen.Recipe) -> tuple[list[str], list[str]]:
    plan = plan_layers(model, recipe)
    return [d.name for d in plan if not d.kept], [d.name for d in plan if d.kept]


# ---------------------------------------------------------------------------------------------
# the NVFP4 file
# ---------------------------------------------------------------------------------------------


def test_nvfp4_names_dtypes_and_shapes(tmp_path: Path) -> None:
    model = gpt()
    source = {k: v.clone() for k, v in model.state_dict().items()}
    quantized, kept = quantized_names(model, SMALL)
    report = export_quantized(model, tmp_path / "out", SMALL)
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))

    expected = set(source)
    for name in quantized:
        expected |= {f"{name}.weight_scale", f"{name}.weight_scale_2"}
    assert set(tensors) == expected  # no input_scale without calibration
    for name in quantized:
        n, k = source[f"{name}.weight"].shape
        assert tensors[f"{name}.weight"].dtype == torch.uint8
        assert tuple(tensors[f"{name}.weight"].shape) == (n, k // 2)
        assert tensors[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn
        assert tuple(tensors[f"{name}.weight_scale"].shape) == (n, k // 16)
        assert tensors[f"{name}.weight_scale_2"].dtype == torch.float32
        assert tensors[f"{name}.weight_scale_2"].shape == ()
    plain = [k for k in tensors if k.rpartition(".")[0] not in quantized or k.endswith(".bias")]
    assert plain and all(tensors[k].dtype == torch.bfloat16 for k in plain)

    config = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())
    assert config == {
        "producer": {"name": "fp4gen", "version": fp4gen.__version__},
        "quantization": {
            "quant_algo": "W4A16_NVFP4",  # no input_scale: weights only, never W4A4
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "exclude_modules": kept,
        },
    }
    assert report.quant_algo == "NVFP4" and report.config_algo == "W4A16_NVFP4"
    assert set(report.quantized) == set(quantized) and list(report.excluded) == kept
    assert report.files == ("model.safetensors", "hf_quant_config.json")  # no HF config


def test_nvfp4_tensors_are_the_codes_and_scales_of_the_quantizer(tmp_path: Path) -> None:
    model = gpt()
    export_quantized(model, tmp_path, NVFP4_1D)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    w = model.state_dict()["blocks.0.mlp.fc2.weight"]
    q = fp4gen.quantize(w, "nvfp4")
    packed = tensors["blocks.0.mlp.fc2.weight"]
    assert torch.equal(packed & 0xF, q.codes[:, 0::2])  # element 0 in the low nibble
    assert torch.equal(packed >> 4, q.codes[:, 1::2])
    assert torch.equal(tensors["blocks.0.mlp.fc2.weight_scale"].view(torch.uint8), q.scale_codes)
    scale_2 = tensors["blocks.0.mlp.fc2.weight_scale_2"]
    assert torch.equal(scale_2, q.global_scale)
    amax = float(w.abs().max())
    assert float(scale_2) == pytest.approx(amax / (6 * 448), rel=1e-6)


def test_2d_tile_scales_are_repeated_per_row(tmp_path: Path) -> None:
    model = gpt()
    export_quantized(model, tmp_path, SMALL)
    scales = load_file(str(tmp_path / "model.safetensors"))["blocks.0.attn.qkv.weight_scale"]
    q = fp4gen.quantize(model.state_dict()["blocks.0.attn.qkv.weight"], "nvfp4", block=(16, 16))
    codes = scales.view(torch.uint8)
    assert torch.equal(codes, q.scale_codes.repeat_interleave(16, 0))
    # and the 1x16 quantization of the same weight is a different one: the 2D values are kept
    q1 = fp4gen.quantize(model.state_dict()["blocks.0.attn.qkv.weight"], "nvfp4")
    assert not torch.equal(codes, q1.scale_codes)


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "algo", "config_algo"),
    [
        (SMALL, "NVFP4", "W4A16_NVFP4"),
        (NVFP4_1D, "NVFP4", "W4A16_NVFP4"),
        (MXFP8, "MXFP8", "MXFP8"),
        (MXFP4, "MXFP4", "MXFP4"),
    ],
    ids=["nvfp4-2d", "nvfp4-1d", "mxfp8", "mxfp4"],
)
def test_round_trip_is_bit_exact(
    tmp_path: Path, recipe: fp4gen.Recipe, algo: str, config_algo: str
) -> None:
    model = gpt()
    source = {k: v.clone() for k, v in model.state_dict().items()}
    quantized, kept = quantized_names(model, recipe)
    assert quantized  # the recipe quantizes something on this model
    report = export_quantized(model, tmp_path, recipe, dtype=None)
    assert report.quant_algo == algo
    state_dict, config = import_quantized(tmp_path)
    assert config["quantization"]["quant_algo"] == config_algo
    assert set(state_dict) == set(source)
    spec = recipe.operands.fprop_weight
    for name in quantized:
        # what the forward GEMM multiplies: the fprop weight operand, 2D blocks for 2D recipes
        q = fp4gen.quantize(source[f"{name}.weight"], spec.format, rounding=spec.rounding)
        got = state_dict[f"{name}.weight"]
        assert got.dtype == torch.float32
        assert torch.equal(bits(got), bits(q.dequantize())), name
    for key, value in source.items():  # excluded layers and everything else: unchanged
        if key.rpartition(".")[0] not in quantized or key.endswith(".bias"):
            assert torch.equal(bits(state_dict[key]), bits(value)), key
    assert config["quantization"]["exclude_modules"] == kept


def test_excluded_layers_are_written_in_the_dtype(tmp_path: Path) -> None:
    model = gpt()
    source = model.state_dict()
    _, kept = quantized_names(model, SMALL)
    assert "lm_head" in kept and "blocks.2.mlp.fc1" in kept  # rule last 1 blocks, and the head
    export_quantized(model, tmp_path, SMALL)  # default: bf16
    state_dict, config = load_quantized(tmp_path)
    assert config["quantization"]["exclude_modules"] == kept
    for name in kept:
        got = state_dict[f"{name}.weight"]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, source[f"{name}.weight"].to(torch.bfloat16))


def test_layer_rules_giving_formats_make_a_mixed_checkpoint(tmp_path: Path) -> None:
    model = gpt()
    source = {k: v.clone() for k, v in model.state_dict().items()}
    report = export_quantized(model, tmp_path, MIXED, dtype=None)
    assert report.quant_algo == "MIXED_PRECISION"
    assert report.quantized["blocks.0.mlp.fc1"] == "MXFP8"
    assert report.quantized["blocks.0.mlp.fc2"] == "NVFP4"
    state_dict, config = import_quantized(tmp_path)
    layers = config["quantization"]["quantized_layers"]
    assert layers["blocks.1.mlp.fc1"] == {"quant_algo": "MXFP8", "group_size": 32}
    assert layers["blocks.0.mlp.fc2"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    q = fp4gen.quantize(source["blocks.1.mlp.fc1.weight"], "mxfp8_e4m3")
    assert torch.equal(bits(state_dict["blocks.1.mlp.fc1.weight"]), bits(q.dequantize()))


def test_converted_model_exports_by_its_own_plan(tmp_path: Path) -> None:
    model = gpt()
    reference = export_quantized(gpt(), tmp_path / "plain", SMALL)
    fp4gen.convert(model, SMALL)
    report = export_quantized(model, tmp_path / "converted")
    assert report.quantized == reference.quantized and report.excluded == reference.excluded
    a = load_file(str(tmp_path / "plain" / "model.safetensors"))
    b = load_file(str(tmp_path / "converted" / "model.safetensors"))
    assert a.keys() == b.keys()
    raw = {k: (a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a}
    assert all(torch.equal(x, y) for x, y in raw.values())
    with pytest.raises(ExportError, match="without a recipe"):
        export_quantized(model, tmp_path / "again", SMALL)


def test_calibration_sets_the_input_scale(tmp_path: Path) -> None:
    model = gpt()
    batches = [torch.randint(0, 256, (2, 16)) for _ in range(2)]
    seen: dict[str, float] = {}
    fc2 = model.blocks[0].mlp.fc2

    def record(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen["amax"] = max(seen.get("amax", 0.0), float(args[0].abs().max()))

    handle = fc2.register_forward_pre_hook(record)
    with torch.no_grad():
        for x in batches:
            model(x)
    handle.remove()
    export_quantized(model, tmp_path, SMALL, calibration=batches)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    quantized, _ = quantized_names(model, SMALL)
    assert {k for k in tensors if k.endswith(".input_scale")} == {
        f"{n}.input_scale" for n in quantized
    }
    scale = tensors["blocks.0.mlp.fc2.input_scale"]
    assert scale.dtype == torch.float32 and scale.shape == ()
    amax = torch.tensor(seen["amax"], dtype=torch.float32)
    assert torch.equal(scale, 1.0 / (torch.tensor(2688.0) / amax))  # the quantizer's S_dec
    assert float(scale) == pytest.approx(seen["amax"] / (6 * 448), rel=1e-6)
    config = json.loads((tmp_path / "hf_quant_config.json").read_text())
    assert config["quantization"]["quant_algo"] == "NVFP4"  # calibrated: W4A4


def test_nvfp4_without_calibration_claims_no_static_input_scale(tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "llama")
    report = export_quantized(model, tmp_path / "out", SMALL)
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert not [k for k in tensors if k.endswith("input_scale")]
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_algo"] == "W4A16_NVFP4" and qc["quant_method"] == "modelopt"
    groups = qc["config_groups"]
    assert list(groups) == ["group_0"] and "input_activations" not in groups["group_0"]
    hf_quant = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())
    assert hf_quant["quantization"]["quant_algo"] == "W4A16_NVFP4"
    assert report.config_algo == "W4A16_NVFP4" and "calibration" in report.engine


def test_calibrated_nvfp4_declares_static_input_scales(tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "llama")
    quantized, _ = quantized_names(model, SMALL)
    batches = [torch.randint(0, 256, (2, 8)) for _ in range(2)]
    report = export_quantized(model, tmp_path / "out", SMALL, calibration=batches)
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {k for k in tensors if k.endswith("input_scale")} == {
        f"{n}.input_scale" for n in quantized
    }
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_algo"] == "NVFP4" and qc["quant_method"] == "modelopt"
    tensor = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    assert qc["config_groups"] == {
        "group_0": {"input_activations": tensor, "weights": tensor, "targets": ["Linear"]}
    }
    assert report.config_algo == "NVFP4" and report.engine.startswith("W4A4 NVFP4")


def test_mx_configs_claim_only_what_an_engine_loads(tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "llama")
    mxfp8 = export_quantized(model, tmp_path / "mxfp8", MXFP8)
    qc = json.loads((tmp_path / "mxfp8" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "MXFP8"
    weights = {"dynamic": False, "num_bits": 8, "type": "float", "group_size": 32}
    assert qc["config_groups"]["group_0"] == {  # activation block scales: at run time
        "input_activations": {**weights, "dynamic": True},
        "weights": weights,
        "targets": ["Linear"],
    }
    assert "modelopt_mxfp8" in mxfp8.engine
    # MXFP4 and mixed formats: no engine's loader reads them, so no engine is named
    mixed = load_recipe(
        'recipe mixed\nextends "nvfp4_small.fp4r"\nlayers {\n    match "*gate_proj" : '
        'mxfp8_e4m3\n    last 1 blocks : bf16\n    match "*lm_head" : bf16\n}\n'
    )
    for recipe, algo in ((MXFP4, "MXFP4"), (mixed, "MIXED_PRECISION")):
        out = tmp_path / algo
        report = export_quantized(model, out, recipe)
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["quant_method"] == "fp4gen" and qc["quant_algo"] == algo
        assert report.engine.startswith(f"{algo}: no inference engine")


def test_cli_calibrate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_llama(tmp_path / "llama")
    quantized, _ = quantized_names(model, SMALL)
    ids = torch.randint(0, 256, (3, 2, 8))  # 3 batches of 2 sequences of 8 tokens
    torch.save(ids, tmp_path / "ids.pt")
    out = tmp_path / "out"
    llama = str(tmp_path / "llama")
    argv = ("export", llama, "--recipe", "nvfp4_small", "--out", str(out))
    code, stdout, err = run(capsys, *argv, "--calibrate", str(tmp_path / "ids.pt"))
    assert code == 0, err
    assert "checkpoint: W4A4 NVFP4 with calibrated static input scales" in stdout
    tensors = load_file(str(out / "model.safetensors"))
    # the input amax of one layer over the 3 batches, as the CLI ran them
    seen: list[float] = []
    layer = model.get_submodule(quantized[0])
    handle = layer.register_forward_pre_hook(
        lambda _, args: seen.append(float(args[0].abs().max()))
    )
    with torch.no_grad():
        for batch in ids:
            model(batch)
    handle.remove()
    expected = 1.0 / (torch.tensor(2688.0) / torch.tensor(max(seen), dtype=torch.float32))
    assert torch.equal(tensors[f"{quantized[0]}.input_scale"], expected)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_algo"] == "NVFP4"

    # bad calibration data: one line, exit 1, before anything is written
    torch.save(ids.float(), tmp_path / "float.pt")
    torch.save(torch.full((2, 8), 300), tmp_path / "big.pt")
    torch.save({"ids": ids}, tmp_path / "dict.pt")
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    cases = [
        (
            (llama, "--calibrate", str(tmp_path / "float.pt")),
            r"torch.float32 \[3, 2, 8\]; .*integer tensor of token ids",
        ),
        ((llama, "--calibrate", str(tmp_path / "big.pt")), r"span \[300, 300\].*\[0, 256\)"),
        ((llama, "--calibrate", str(tmp_path / "dict.pt")), "holds a dict"),
        ((llama, "--calibrate", str(tmp_path / "none.pt")), "no such calibration file"),
        ((str(tmp_path / "weights.pt"), "--calibrate", str(tmp_path / "ids.pt")), "state_dict"),
    ]
    for (source, *flags), message in cases:
        target = tmp_path / "bad"
        code, stdout, err = run(
            capsys, "export", source, "--recipe", "nvfp4_small", "--out", str(target), *flags
        )
        assert code == 1 and re.search(message, err), (message, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert not target.exists()


def test_shards_and_index(tmp_path: Path) -> None:
    model = gpt()
    export_quantized(model, tmp_path, SMALL, max_shard_size="20KB", dtype=None)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    assert all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", s) for s in shards)
    whole = tmp_path / "whole"
    export_quantized(gpt(), whole, SMALL, dtype=None)
    a, _ = import_quantized(tmp_path)
    b, _ = import_quantized(whole)
    assert a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def test_a_state_dict_is_planned_as_its_model(tmp_path: Path) -> None:
    model = gpt()
    state = model.state_dict()
    plan = [(d.name, d.kept, d.block_index) for d in plan_layers(model, SMALL)]
    assert [(d.name, d.kept, d.block_index) for d in plan_layers(skeleton(state), SMALL)] == plan
    from_module = export_quantized(model, tmp_path / "m", SMALL)
    from_state = export_quantized(dict(state), tmp_path / "s", SMALL)
    assert from_state.quantized == from_module.quantized
    assert from_state.excluded == from_module.excluded


# ---------------------------------------------------------------------------------------------
# Hugging Face models
# ---------------------------------------------------------------------------------------------


def tiny_llama(folder: Path) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return model


def test_cli_exports_a_llama_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_llama(tmp_path / "llama")
    source = {k: v.clone() for k, v in model.state_dict().items()}
    quantized, kept = quantized_names(model, SMALL)
    out = tmp_path / "llama-nvfp4"
    code, stdout, err = run(
        capsys, "export", str(tmp_path / "llama"), "--recipe", "nvfp4_small", "--out", str(out)
    )
    assert code == 0, err
    assert "NVFP4, 14 linear layers quantized, 8 kept" in stdout
    assert "model.layers.2.mlp.down_proj" in stdout and "rule last 1 blocks" in stdout
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "hf_quant_config.json", "config.json"} <= names
    assert "tokenizer_config.json" in names  # the folder's other files come along

    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "W4A16_NVFP4"
    assert qc["ignore"] == kept
    assert qc["config_groups"]["group_0"] == {  # weights only: no activation scheme claimed
        "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
        "targets": ["Linear"],
    }
    assert "checkpoint: NVFP4 weights only (W4A16_NVFP4" in stdout
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())
    assert hf_quant["quantization"]["exclude_modules"] == kept == qc["ignore"]
    assert "lm_head" in kept

    state_dict, _ = import_quantized(out)
    for name in quantized:
        q = fp4gen.quantize(source[f"{name}.weight"], "nvfp4", block=(16, 16))
        assert torch.equal(bits(state_dict[f"{name}.weight"]), bits(q.dequantize())), name


def test_gpt2_conv1d_round_trip(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=64, n_layer=3, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0
    )
    config.eos_token_id = 1
    model = transformers.GPT2LMHeadModel(config)  # lm_head tied to wte
    source = {k: v.clone() for k, v in model.state_dict().items()}
    report = export_quantized(model, tmp_path, MXFP4, dtype=None)
    assert "transformer.h.0.attn.c_attn" in report.quantized
    state_dict, hf_quant = import_quantized(tmp_path)
    assert "transformer.h.0.attn.c_attn" in hf_quant["fp4gen"]["transposed_conv1d"]
    assert set(state_dict) == set(source)  # the tied head is written under both names
    w = source["transformer.h.0.mlp.c_fc.weight"]  # Conv1D: [in, out]
    q = fp4gen.quantize(w.t().contiguous(), "mxfp4")
    got = state_dict["transformer.h.0.mlp.c_fc.weight"]
    assert got.shape == w.shape and torch.equal(bits(got), bits(q.dequantize().t()))


def test_cli_exports_a_state_dict_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = gpt()
    path = tmp_path / "weights.pt"
    torch.save(model.state_dict(), path)
    out = tmp_path / "out"
    code, stdout, err = run(
        capsys, "export", str(path), "--recipe", "mxfp8", "--out", str(out), "--dtype", "keep"
    )
    assert code == 0, err
    assert "MXFP8, 12 linear layers quantized, 1 kept" in stdout  # lm_head: outside the blocks
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["blocks.0.attn.qkv.weight"].dtype == torch.float8_e4m3fn
    assert tuple(tensors["blocks.0.attn.qkv.weight"].shape) == (192, 64)
    assert tensors["blocks.0.attn.qkv.weight_scale"].dtype == torch.uint8
    assert tuple(tensors["blocks.0.attn.qkv.weight_scale"].shape) == (192, 2)
    assert tensors["tok.weight"].dtype == torch.float32  # an embedding: as it is
    config = json.loads((out / "hf_quant_config.json").read_text())
    assert config["quantization"] == {
        "quant_algo": "MXFP8",
        "group_size": 32,
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head"],
    }
    state_dict, _ = import_quantized(out)
    q = fp4gen.quantize(model.state_dict()["blocks.1.mlp.fc2.weight"], "mxfp8_e4m3")
    assert torch.equal(bits(state_dict["blocks.1.mlp.fc2.weight"]), bits(q.dequantize()))


# ---------------------------------------------------------------------------------------------
# errors and help
# ---------------------------------------------------------------------------------------------


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, _, err = run(capsys, "export", *argv)
    assert code == 1
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fp4gen export: ")
    return lines[0]


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = tmp_path / "weights.pt"
    torch.save(gpt().state_dict(), weights)
    out = str(tmp_path / "out")

    missing = one_line_error(capsys, str(tmp_path / "nope"), "--recipe", "nvfp4", "--out", out)
    assert "no such file or folder" in missing
    (tmp_path / "empty").mkdir()
    folder = one_line_error(capsys, str(tmp_path / "empty"), "--recipe", "nvfp4", "--out", out)
    assert "no config.json" in folder

    fmt = one_line_error(capsys, str(weights), "--recipe", "fp8_blockwise", "--out", out)
    assert "fp8_block" in fmt and "128x128" in fmt
    assert "exportable: NVFP4" in fmt and "MXFP8" in fmt and "MXFP4" in fmt
    mor = one_line_error(capsys, str(weights), "--recipe", "mor_tensor", "--out", out)
    assert "MoR rule 'tensor_e4m3'" in mor
    rht = load_recipe("recipe r\noperands {\n    * : nvfp4\n    fprop : rht 16 signs te\n}\n")
    with pytest.raises(ExportError, match="Random Hadamard Transform"):
        export_quantized(gpt(), tmp_path / "rht", rht)

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    is_file = one_line_error(capsys, str(weights), "--recipe", "nvfp4_small", "--out", str(a_file))
    assert "is a file, not a folder" in is_file

    not_torch = tmp_path / "notes.txt"
    not_torch.write_text("hello")
    bad = one_line_error(capsys, str(not_torch), "--recipe", "nvfp4_small", "--out", out)
    assert "not a torch state_dict file" in bad
    assert not Path(out).exists()  # nothing written on an error


def test_existing_checkpoint_needs_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = tmp_path / "weights.pt"
    torch.save(gpt().state_dict(), weights)
    out = str(tmp_path / "out")
    args = (str(weights), "--recipe", "nvfp4_small", "--out", out)
    assert run(capsys, "export", *args, "--max-shard-size", "20KB")[0] == 0
    assert "already holds a checkpoint" in one_line_error(capsys, *args)
    code, _, err = run(capsys, "export", *args, "--overwrite")
    assert code == 0, err
    # the old shards went: one file and no index remain
    assert sorted(p.name for p in Path(out).glob("*.safetensors")) == ["model.safetensors"]
    assert not (Path(out) / "model.safetensors.index.json").exists()


def test_a_recipe_that_quantizes_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="keeps all 13 linear layers in high precision"):
        export_quantized(gpt(), tmp_path, "nvfp4")  # first 2 and last 8 blocks: all of them


def test_import_errors(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="no such folder"):
        import_quantized(tmp_path / "nope")
    with pytest.raises(ExportError, match="no hf_quant_config.json"):
        import_quantized(tmp_path)


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["export", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "usage: fp4gen export" in text
    for word in ("Model Optimizer", "OCP MX", "exclude_modules", "weight_scale_2", "--recipe"):
        assert word in text


def test_readme_export_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = README.read_text()
    section = text.split("## Exporting checkpoints", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    quantization = namespace["config"]["quantization"]  # type: ignore[index]
    assert quantization["quant_algo"] == "W4A16_NVFP4"  # no calibration: weights only
    assert "fp4gen export MODEL_DIR" in text


# ---------------------------------------------------------------------------------------------
# damaged sources, NaN weights, and the output folder's files
# ---------------------------------------------------------------------------------------------


def test_missing_and_unexpected_tensors_are_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "llama"
    tiny_llama(folder)
    capsys.readouterr()  # its saving progress bar
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    del tensors["model.layers.1.mlp.down_proj.weight"]
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    line = one_line_error(capsys, str(folder), "--recipe", "nvfp4_small", "--out", str(out))
    assert "2 tensor(s) missing from the checkpoint" in line and "randomly" in line
    assert "model.layers.0.self_attn.q_proj.weight" in line
    assert "model.layers.1.mlp.down_proj.weight" in line
    assert "1 tensor(s) in the checkpoint but not in the model: model.extra.weight" in line
    assert not out.exists()


def test_a_truncated_safetensors_file_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "llama"
    tiny_llama(folder)
    capsys.readouterr()  # its saving progress bar
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:12288])
    out = tmp_path / "out"
    line = one_line_error(capsys, str(folder), "--recipe", "nvfp4_small", "--out", str(out))
    assert f"{weights}: not a whole safetensors file" in line and "truncated" in line
    assert not out.exists()


class _RunsCode:
    """A pickle that would create ``marker`` when loaded without weights_only."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def test_a_pickle_weights_only_loading_refuses_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "code-ran"
    bad = {"w": torch.zeros(2), "x": _RunsCode(marker)}
    torch.save(bad, tmp_path / "weights.pt")
    folder = tmp_path / "llama"
    tiny_llama(folder)
    (folder / "model.safetensors").unlink()
    torch.save(bad, folder / "pytorch_model.bin")
    capsys.readouterr()
    out = str(tmp_path / "out")
    for source in (tmp_path / "weights.pt", folder):
        line = one_line_error(capsys, str(source), "--recipe", "nvfp4_small", "--out", out)
        assert line.startswith(f"fp4gen export: {source}: a pickle file holding more than tensors")
        assert "nothing in it ran" in line and "open" in line  # the global it refused
        # torch's advice comes with why not to follow it, and torch's own wording is gone
        assert "weights_only=False would run whatever code it holds" in line
        assert "Weights only load failed" not in line and "\x1b" not in line
    assert not marker.exists() and not Path(out).exists()


def test_a_nan_weight_names_its_tensor(tmp_path: Path) -> None:
    model = gpt()
    with torch.no_grad():
        model.blocks[1].mlp.fc1.weight[3, 7] = float("nan")
    with pytest.raises(ExportError) as err:
        export_quantized(model, tmp_path / "out", SMALL)
    message = str(err.value)
    assert message.startswith("blocks.1.mlp.fc1.weight [256, 64]: ")
    assert "1 non-finite value(s)" in message and "(3, 7)" in message
    assert not (tmp_path / "out").exists()


def test_export_writes_through_no_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "llama"
    tiny_llama(folder)
    capsys.readouterr()  # its saving progress bar
    victim = tmp_path / "users-file.json"
    victim.write_text("precious")
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        out = tmp_path / f"out-{name}"
        out.mkdir()
        (out / name).symlink_to(victim)
        for extra in ((), ("--overwrite",)):  # --overwrite does not make a link writable
            argv = (str(folder), "--recipe", "nvfp4_small", "--out", str(out), *extra)
            line = one_line_error(capsys, *argv)
            assert f"{out / name} is a symbolic link (to {victim})" in line
        assert victim.read_text() == "precious"
        assert [p.name for p in out.iterdir()] == [name]  # nothing else was written


def test_export_refuses_then_replaces_config_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "llama"
    tiny_llama(folder)
    capsys.readouterr()  # its saving progress bar
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"mine": 1}\n')
    args = (str(folder), "--recipe", "nvfp4_small", "--out", str(out))
    line = one_line_error(capsys, *args)
    assert f"{out}: already holds config.json; pass overwrite=True (--overwrite)" in line
    assert (out / "config.json").read_text() == '{"mine": 1}\n'
    code, stdout, err = run(capsys, "export", *args, "--overwrite")
    assert code == 0, err
    assert f"replaced 1 existing file(s) in {out}: config.json" in stdout
    assert "quantization_config" in json.loads((out / "config.json").read_text())


def test_export_on_a_full_disk_leaves_the_old_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    import safetensors.torch
    from safetensors import SafetensorError

    from fp4gen import outputs

    weights = tmp_path / "weights.pt"
    torch.save(gpt().state_dict(), weights)
    out = tmp_path / "out"
    args = (str(weights), "--recipe", "nvfp4_small", "--out", str(out))
    assert run(capsys, "export", *args, "--max-shard-size", "20KB")[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len(before) > 3  # shards, index and hf_quant_config.json

    def full_disk_save(tensors: dict, path: str, metadata: dict | None = None) -> None:
        Path(path).write_bytes(b"\0" * 100)  # part of it, then the disk is full
        raise SafetensorError(f"Error while serializing: {os.strerror(errno.ENOSPC)}")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk_save)
    line = one_line_error(capsys, *args, "--overwrite")
    assert f"cannot write {out / 'model.safetensors'}: Error while serializing: No space" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    monkeypatch.undo()

    def full_disk_text(file, data: bytes) -> None:  # the shard is written, the JSON is not
        file.write(data[:10])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(outputs, "_write_data", full_disk_text)
    line = one_line_error(capsys, *args, "--overwrite")
    assert f"cannot write {out / 'hf_quant_config.json'}: No space left on device" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # old shards, no temp
    monkeypatch.undo()
    code, stdout, err = run(capsys, "export", *args, "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["hf_quant_config.json", "model.safetensors"]
    gone = sorted(name for name in before if name != "hf_quant_config.json")  # shards, index
    listed = ", ".join(["hf_quant_config.json", *gone])
    assert f"replaced {len(before)} existing file(s) in {out}: {listed}" in stdout
