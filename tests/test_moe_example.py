"""examples/moe.py on the CPU: the plan lists the experts modules, the model trains (the loss
goes down over a few steps on a fixed text), --grouped runs the grouped GEMMs, --export writes
a checkpoint whose experts are per expert and quantized."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent


def load_example():
    name = "fp4gen_example_moe"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "moe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_example_trains_and_prints_the_plan(capsys) -> None:
    result = load_example().main(["--steps", "6"])
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.experts (8 experts)  recipe nvfp4_small" in result.plan
    assert "per expert: CPU tensors" in out
    assert len(result.losses) == 6 and result.losses[-1] < result.losses[0]


def test_grouped_and_export(tmp_path: Path, capsys) -> None:
    result = load_example().main(["--steps", "3", "--grouped", "--export", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.experts: grouped GEMMs" in out
    assert len(result.losses) == 3
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.down_proj.weight_scale_2" in tensors
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in tensors  # kept: bf16, per expert
