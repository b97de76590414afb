"""benchmarks/moe.py on the CPU at tiny sizes (a smoke run: the rows and ratios are printed,
BF16 first; no timing is asserted)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import moe  # noqa: E402

TINY = [
    "--device", "cpu", "--hidden", "64", "--inner", "32", "--experts", "4", "--topk", "2",
    "--tokens", "32", "--seq", "16", "--model-layers", "2", "--model-experts", "4",
    "--model-topk", "2", "--steps", "1",
]  # fmt: skip


def rows(out: str) -> list[tuple[str, float]]:
    """(row name, ratio to BF16) of every printed row."""
    return [
        (m.group(1).strip(), float(m.group(2)))
        for m in re.finditer(r"^  (\S.*?)\s+[\d.]+\s+([\d.]+)x", out, re.MULTILINE)
    ]


def test_layer_and_model_sections_print_every_row(capsys) -> None:
    assert moe.main([*TINY, "--recipes", "nvfp4_small,fp8_blockwise"]) == 0
    out = capsys.readouterr().out
    assert "MoE layer fwd+bwd: hidden 64, inner 32, 4 experts, top-2, 32 tokens" in out
    assert "Qwen3MoeForCausalLM training step: 2 layers" in out
    got = rows(out)
    names = [name for name, _ in got]
    assert names == [
        "bf16 grouped_mm", "bf16 eager", "nvfp4_small", "fp8_blockwise",
        "bf16 grouped_mm", "nvfp4_small", "fp8_blockwise",
    ]  # fmt: skip
    assert [ratio for name, ratio in got if name == "bf16 grouped_mm"] == [1.0, 1.0]
    assert all(ratio >= 0 for _, ratio in got)  # a CPU smoke run: no timing is asserted


def test_llama4_layer_rows(capsys) -> None:
    """--layer-family llama4: Llama 4's MoE block (every expert on every token), its own bmm
    as the BF16 baseline, then each recipe."""
    args = [*TINY, "--skip-model", "--layer-family", "llama4", "--recipes", "nvfp4_small"]
    assert moe.main(args) == 0
    out = capsys.readouterr().out
    assert "Llama 4's block: every expert on every token" in out
    assert [name for name, _ in rows(out)] == ["bf16 bmm", "nvfp4_small"]


def test_mixtral_model_only(capsys) -> None:
    assert moe.main([*TINY, "--skip-layer", "--model", "mixtral", "--recipes", "nvfp4_small"]) == 0
    out = capsys.readouterr().out
    assert "MoE layer" not in out and "MixtralForCausalLM training step" in out
    assert [name for name, _ in rows(out)] == ["bf16 grouped_mm", "nvfp4_small"]


def test_profile_prints_the_host_and_gpu_split_under_each_row(capsys) -> None:
    """--profile N: under every row its profiled wall time against the GPU kernels' time (none
    on the CPU) and at most N functions by own time, fp4gen's among them for a recipe."""
    args = [*TINY, "--skip-model", "--recipes", "nvfp4_small", "--profile", "3"]
    assert moe.main(args) == 0
    out = capsys.readouterr().out
    timed, profiled = out.split("profiled pass (--profile)")
    assert "profile: wall" not in timed  # the timed pass runs no profiler
    assert len(rows(timed)) == 3
    lines = profiled.splitlines()
    rows_at = [i for i, line in enumerate(lines) if re.match(r"^  \S.*\d+\.\d+x", line)]
    assert len(rows_at) == 3  # bf16 grouped_mm, bf16 eager, nvfp4_small
    split = re.compile(r"^      profile: wall [\d.]+ ms \(profiled\), GPU kernels 0\.00 ms$")
    assert all(split.match(lines[i + 1]) for i in rows_at)
    per_row = [[line for line in lines[i + 2 : i + 6] if " own time in " in line] for i in rows_at]
    assert all(1 <= len(found) <= 3 for found in per_row)
    # the recipe row runs fp4gen's code: its numerics are among the costliest there
    assert any(re.search(r"calls  numerics/\S+\.py:\d+\(", line) for line in per_row[-1])


def test_help() -> None:
    with pytest.raises(SystemExit) as exit_info:
        moe.main(["--help"])
    assert exit_info.value.code == 0


def test_the_issue_targets_and_the_per_expert_quantize_row(capsys) -> None:
    """The goals a recipe row is held to (layer and model); --quantize-per-expert adds a row
    only after a recipe whose experts run grouped (on the CPU they loop: no row)."""
    assert moe.target_note("layer", "fp8_blockwise", 0.8) == "target <= 0.85x: met"
    assert moe.target_note("layer", "nvfp4_small", 1.3) == "target <= 1.20x: missed"
    assert moe.target_note("model", "nvfp4_no_bf16", 1.25) == "target <= 1.25x: met"
    assert moe.target_note("model", "mxfp8", 0.5) == ""
    assert (
        moe.main([*TINY, "--skip-model", "--recipes", "nvfp4_small", "--quantize-per-expert"]) == 0
    )
    out = capsys.readouterr().out
    assert [name for name, _ in rows(out)] == ["bf16 grouped_mm", "bf16 eager", "nvfp4_small"]
    assert "target" not in out  # a CPU smoke run holds no row to a goal


def test_the_baseline_runs_an_fp32_models_experts_in_bf16_under_autocast() -> None:
    """transformers' grouped_mm would multiply an fp32 model's experts in fp32 under autocast;
    the baseline casts the weights to bf16 as autocast casts a Linear's: its output is the bf16
    model's bit for bit, and the gradients reach the fp32 parameters."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    moe.register_baseline()
    cfg = moe.moe_config("qwen3_moe", moe_args(), 4, 2, 1)
    cfg._experts_implementation = moe.BASELINE
    torch.manual_seed(0)
    fp32 = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        for param in fp32.parameters():
            param.normal_(0.0, 0.05)
    bf16 = Qwen3MoeExperts(cfg)
    bf16.load_state_dict(fp32.state_dict())
    bf16 = bf16.to(torch.bfloat16)
    hidden = torch.randn(16, cfg.hidden_size)
    index = torch.randint(0, 4, (16, 2), generator=torch.Generator().manual_seed(1))
    weights = torch.softmax(torch.randn(16, 2), dim=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fp32(hidden, index, weights)
    want = bf16(hidden.to(torch.bfloat16), index, weights.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    got.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in fp32.parameters())
    # without autocast: transformers' grouped_mm itself, in the parameters' dtype
    assert fp32(hidden, index, weights).dtype == torch.float32


def moe_args():
    """moe.py's parsed defaults at TINY's sizes."""
    import argparse

    return argparse.Namespace(hidden=64, inner=32, tokens=32, seq=16)


def test_gpu_busy_counts_the_device_events_once() -> None:
    """An aten op's row repeats the time of the kernels it launched: only the device events
    count (torch's own table total), not the op rows or user annotations."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(kind, us, annotation=False):
        return SimpleNamespace(
            device_type=kind, self_device_time_total=us, is_user_annotation=annotation
        )

    events = [
        event(DeviceType.CPU, 900.0),  # aten::mul, its kernel's time again
        event(DeviceType.CUDA, 900.0),  # the kernel
        event(DeviceType.CUDA, 100.0),
        event(DeviceType.CUDA, 5000.0, annotation=True),  # a profiler range on the GPU
    ]
    assert moe.gpu_busy_ms(events) == 1.0


def test_no_loop_leaves_out_the_per_expert_rows(capsys, monkeypatch) -> None:
    """Where the experts run grouped, each recipe is measured again expert by expert (its
    ``loop`` row) unless ``loop`` is off (``--no-loop``)."""

    class Grouped:
        operands = None
        grouped = None

        def loop_reason(self, table, device):
            return None  # grouped

    model = moe.nn.Module()
    monkeypatch.setattr(moe, "experts_rows", lambda m: [Grouped()])
    monkeypatch.setattr(moe.fp4gen, "convert", lambda m, recipe: model)
    measured: list[object] = []

    def measure(m):
        measured.append(m)
        return 2.0, None

    for loop, want in ((True, ["nvfp4_small", "nvfp4_small loop"]), (False, ["nvfp4_small"])):
        measured.clear()
        moe.recipe_rows(
            lambda name: model, ["nvfp4_small"], "cpu", measure, 1.0, "layer", loop=loop
        )
        assert [name for name, _ in rows(capsys.readouterr().out)] == want
        assert len(measured) == len(want)
    # a variant's row is measured under its setting, which is undone afterwards
    from fp4gen.runtime import host_tables

    limits = []
    variants = moe.variants_of(moe.argparse.Namespace(
        quantize_per_expert=False, fp8_per_expert=False, numpy_tables=True
    ))  # fmt: skip
    moe.recipe_rows(
        lambda name: model, ["nvfp4_small"], "cpu",
        lambda m: (limits.append(host_tables._device_built_rows[0]), (2.0, None))[1],
        1.0, "layer", variants, loop=False,
    )  # fmt: skip
    names = [name for name, _ in rows(capsys.readouterr().out)]
    assert names == ["nvfp4_small", "nvfp4_small numpy tables"]
    assert limits == [host_tables.DEVICE_BUILT_ROWS, None]
    assert host_tables._device_built_rows[0] == host_tables.DEVICE_BUILT_ROWS
