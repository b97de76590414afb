"""fp4gen sweep on a Mixture-of-Experts model (transformers' Qwen3-MoE): the model table's
counts are exact, every block's experts module counts as a layer a recipe quantizes, and a
tiny sweep of BF16 and two recipes runs on the CPU and writes its summary."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fp4gen.cli import main
from fp4gen.experiments import sweep
from fp4gen.experiments.models import MODELS, build_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread, as tests/test_sweep.py runs its tiny sweeps (a shared CI machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["qwen3moe-tiny", "qwen3moe-small"])
def test_moe_model_table_counts_are_exact(name: str) -> None:
    spec = MODELS[name]
    with torch.device("meta"):
        model = build_model(spec, 300)
    assert isinstance(model, transformers.Qwen3MoeForCausalLM)
    assert spec.parameters(300) == sum(p.numel() for p in model.parameters())
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (spec.experts, 2 * spec.expert_width, spec.width)
    assert all(layer.mlp.experts.num_experts == spec.experts for layer in model.model.layers)


def test_experts_count_as_quantized_layers() -> None:
    """Per block 4 attention projections and one experts module, plus the head: nvfp4_small
    keeps the last block and the head in BF16; fp8_blockwise keeps only the head."""
    spec = MODELS["qwen3moe-tiny"]
    entries = {e.label: e for e in sweep._load_recipes(["nvfp4_small", "fp8_blockwise"], spec, 256)}
    total = spec.layers * 5 + 1
    assert {e.linears for e in entries.values()} == {total}
    assert entries["nvfp4_small"].quantized == (spec.layers - 1) * 5
    assert entries["fp8_blockwise"].quantized == spec.layers * 5


def test_a_tiny_moe_sweep_on_the_cpu(tmp_path: Path) -> None:
    argv = ["sweep", "nvfp4_small", "fp8_blockwise", "--model", "qwen3moe-tiny", "--seeds", "1"]
    argv += ["--device", "cpu", "--out", str(tmp_path), "--tokens", "256", "--batch", "2"]
    argv += ["--eval-batches", "1"]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["recipe"] for r in summary["recipes"]] == ["bf16", "nvfp4_small", "fp8_blockwise"]
    assert all(r["final_eval_loss"]["mean"] > 0 for r in summary["recipes"]), summary["recipes"]
