"""Exported checkpoint configs against the code of the tools that read or write them.

- NVIDIA Model Optimizer (``pip install nvidia-modelopt``, pure Python on CPU): its own
  ``convert_hf_quant_config_format`` turns an hf_quant_config.json into the config.json
  ``quantization_config`` it writes; fp4gen's config.json must be exactly that for the NVFP4
  formats, so a loader sees what it sees from a Model Optimizer checkpoint.
- compressed-tensors (``pip install compressed-tensors``): its ``QuantizationConfig`` parses
  the ``config_groups``; the parsed schemes must say weight-only for W4A16_NVFP4 (no
  activation scheme), static activations for calibrated NVFP4, dynamic ones for MXFP8.
- vLLM cannot be installed here (it needs CUDA): ``vllm_modelopt_reads`` restates the rules of
  its ModelOpt loader (vllm/model_executor/layers/quantization/modelopt.py, 2026): the
  quant_algo values it accepts, the fields it requires in hf_quant_config.json, and the tensors
  each linear method registers; every tensor a quantized layer needs must be in the file.

Each test skips where its package is missing: ``pip install 'fp4gen[loaders]'``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from test_export import tiny_llama  # noqa: E402  (the same small Llama checkpoint)

from fp4gen.dsl import load_recipe  # noqa: E402
from fp4gen.export import export_quantized  # noqa: E402

# vLLM's ModelOpt loader: the quant_algo values it accepts, and for each the tensors (name,
# dtype, shape from [N, K]) a quantized linear layer registers and loads
VLLM_ALGOS = (
    "FP8",
    "FP8_PER_CHANNEL_PER_TOKEN",
    "FP8_PB_WO",
    "NVFP4",
    "W4A16_NVFP4",
    "MXFP8",
    "MIXED_PRECISION",
)
VLLM_REQUIRED = {  # fields its config class requires in hf_quant_config.json
    "NVFP4": ("group_size", "kv_cache_quant_algo", "exclude_modules"),
    "W4A16_NVFP4": ("group_size", "kv_cache_quant_algo", "exclude_modules"),
    "MXFP8": ("kv_cache_quant_algo", "exclude_modules"),
}
SCALAR = ()


def vllm_tensors(algo: str, n: int, k: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tensors vLLM's ModelOpt linear method for ``algo`` fills from the checkpoint."""
    if algo in ("NVFP4", "W4A16_NVFP4"):
        out = {
            "weight": (torch.uint8, (n, k // 2)),
            "weight_scale": (torch.float8_e4m3fn, (n, k // 16)),
            "weight_scale_2": (torch.float32, SCALAR),
        }
        if algo == "NVFP4":  # W4A4: the static input global scale, read, never defaulted
            out["input_scale"] = (torch.float32, SCALAR)
        return out
    assert algo == "MXFP8"
    return {"weight": (torch.float8_e4m3fn, (n, k)), "weight_scale": (torch.uint8, (n, k // 32))}


def vllm_modelopt_reads(folder: Path) -> str:
    """The quant_algo vLLM's ModelOpt loader would serve ``folder`` with; AssertionError naming
    what it would refuse or misread."""
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"].lower().startswith("modelopt"), qc["quant_method"]
    algo = str(qc["quant_algo"]).upper()
    assert algo in VLLM_ALGOS, algo
    section = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]
    assert section["quant_algo"] == qc["quant_algo"]
    missing = [f for f in VLLM_REQUIRED.get(algo, ()) if f not in section]
    assert not missing, missing
    tensors = load_file(str(folder / "model.safetensors"))
    layers = [k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale")]
    assert layers
    for name in layers:
        assert name not in qc["ignore"]
        weight = tensors[f"{name}.weight"]
        n = weight.shape[0]
        k = weight.shape[1] * (1 if algo == "MXFP8" else 2)
        for suffix, (dtype, shape) in vllm_tensors(algo, n, k).items():
            got = tensors.get(f"{name}.{suffix}")
            assert got is not None, f"{name}.{suffix} missing"
            assert (got.dtype, tuple(got.shape)) == (dtype, shape), f"{name}.{suffix}"
    return algo


def export(tmp_path: Path, recipe: str, calibrate: bool = False) -> Path:
    model = tiny_llama(tmp_path / "llama")
    batches = [torch.randint(0, 256, (2, 8)) for _ in range(2)] if calibrate else None
    out = tmp_path / f"{recipe}-{calibrate}"
    export_quantized(model, out, load_recipe(recipe), calibration=batches)
    return out


def configs(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hf_quant_config.json, config.json's quantization_config)"""
    hf_quant = json.loads((folder / "hf_quant_config.json").read_text())
    return hf_quant, json.loads((folder / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize(
    ("calibrate", "algo"), [(False, "W4A16_NVFP4"), (True, "NVFP4")], ids=["w4a16", "w4a4"]
)
def test_vllm_modelopt_loader_reads_nvfp4(tmp_path: Path, calibrate: bool, algo: str) -> None:
    assert vllm_modelopt_reads(export(tmp_path, "nvfp4_small", calibrate)) == algo


def test_vllm_modelopt_loader_reads_mxfp8(tmp_path: Path) -> None:
    assert vllm_modelopt_reads(export(tmp_path, "mxfp8")) == "MXFP8"


def test_mxfp4_is_not_offered_to_the_modelopt_loader(tmp_path: Path) -> None:
    _, qc = configs(export(tmp_path, "mxfp4_small"))
    assert qc["quant_method"] == "fp4gen" and qc["quant_algo"] == "MXFP4"
    assert "MXFP4" not in VLLM_ALGOS  # why: the loader has no MXFP4


@pytest.mark.parametrize("calibrate", [False, True], ids=["w4a16", "w4a4"])
def test_config_json_is_what_model_optimizer_derives(tmp_path: Path, calibrate: bool) -> None:
    convert = pytest.importorskip("modelopt.torch.export.convert_hf_config")
    hf_quant, qc = configs(export(tmp_path, "nvfp4_small", calibrate))
    assert qc == convert.convert_hf_quant_config_format(hf_quant)


def test_compressed_tensors_parses_the_schemes(tmp_path: Path) -> None:
    quantization = pytest.importorskip("compressed_tensors.quantization")
    parse = quantization.QuantizationConfig.model_validate

    _, qc = configs(export(tmp_path, "nvfp4_small"))
    scheme = parse(qc).config_groups["group_0"]
    assert scheme.input_activations is None  # weight-only: no activation scale is claimed
    w = scheme.weights
    assert (w.num_bits, w.type, w.group_size, w.strategy.value) == (4, "float", 16, "group")
    assert scheme.targets == ["Linear"]

    _, qc = configs(export(tmp_path, "nvfp4_small", calibrate=True))
    a = parse(qc).config_groups["group_0"].input_activations
    assert (a.num_bits, a.group_size, a.dynamic) == (4, 16, False)  # static: input_scale written

    _, qc = configs(export(tmp_path, "mxfp8"))
    scheme = parse(qc).config_groups["group_0"]
    a, w = scheme.input_activations, scheme.weights
    assert (a.num_bits, a.group_size, a.dynamic) == (8, 32, True)  # block scales at run time
    assert (w.num_bits, w.group_size, w.dynamic) == (8, 32, False)
