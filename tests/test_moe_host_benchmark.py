"""benchmarks/moe_host.py on the CPU at tiny sizes: the grouped experts' host path runs with the
GPU's work stood in, every experts module grouped; and what one fwd+bwd issues per expert
(the host cost that grows with the experts) is held at what it is now: no op that launches GPU
work per expert (the grouped quantize, decodes and GEMMs serve every expert at once; FP8
blockwise's wgrad is one K-grouped launch per projection), and no aten op per expert at all:
the grouped tile launches write the wgrad copies of every expert side by side, which the
wgrad GEMMs read whole (4 views per expert for NVFP4 and 8 for FP8 before, each expert's
columns cut out of copies laid out one after another and concatenated). NVFP4
builds no QuantizedTensor per expert: the GEMMs read every expert's operands whole, and a
grouped launch's per-group operands are built only when read (``grouped_quantize.LazyGroups``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import moe_host  # noqa: E402


def sizes(experts: int) -> argparse.Namespace:
    # widths of whole FP8 blocks (128): the kernels refuse others, as on a GPU
    return argparse.Namespace(
        hidden=128, inner=128, experts=experts, topk=2, tokens=64, steps=1, profile=0
    )


# Python calls per expert of one fwd+bwd (cProfile's count, torch 2.13): 28 for NVFP4 and 36
# for FP8 blockwise (40 and 44 before the side-by-side wgrad copies; 54 and 86 before the
# groups' ends, the flat copies' gcd and the FP8 launches' shape checks took one call per
# column; 182 and 206 before the per-expert loops did only what varies by expert and a
# projection call's seeds were looked at once), with a few calls of room for torch's own
# changes
@pytest.mark.parametrize(
    "recipe, launching_per_expert, ops_per_expert, calls_per_expert",
    [("nvfp4_small", 0, 0, 32), ("fp8_blockwise", 0, 0, 40)],
)
def test_host_cost_per_expert(recipe, launching_per_expert, ops_per_expert, calls_per_expert):
    few, more = (moe_host.measure(sizes(e), recipe) for e in (4, 8))
    assert few["grouped"] and more["grouped"]
    assert few["kernels"] > 0  # the stood-in kernels were launched: the grouped path ran
    assert more["launching"] - few["launching"] <= 4 * launching_per_expert
    assert more["ops"] - few["ops"] <= 4 * ops_per_expert
    assert more["calls"] - few["calls"] <= 4 * calls_per_expert


def test_prints_a_row_per_recipe(capsys) -> None:
    argv = ["--experts", "4", "--topk", "2", "--tokens", "64", "--hidden", "128"]
    assert moe_host.main([*argv, "--inner", "128", "--steps", "1", "--ops", "3"]) == 0
    out = capsys.readouterr().out
    assert "64 tokens" in out and "most issued:" in out
    assert [line.split()[0] for line in out.splitlines() if line.endswith("grouped")] == [
        "nvfp4_small",
        "fp8_blockwise",
    ]


def test_nvfp4_builds_no_operand_per_expert(monkeypatch) -> None:
    """The grouped launches' per-group QuantizedTensors are never read on NVFP4's whole path:
    as many are built at 8 experts as at 4 (the wholes and sides, a few per launch)."""
    from fp4gen.runtime import cute_backend

    built = []
    real = cute_backend._quantized

    def counted(*args, **kwargs):
        built.append(args[8])  # the shape
        return real(*args, **kwargs)

    monkeypatch.setattr(cute_backend, "_quantized", counted)
    per_run = []
    for experts in (4, 8):
        built.clear()
        moe_host.measure(sizes(experts), "nvfp4_small")
        per_run.append(len(built))
    assert per_run[0] == per_run[1] > 0


@pytest.mark.parametrize(("recipe", "tables"), [("fp8_blockwise", 0), ("nvfp4_small", 2)])
def test_philox_tables_only_for_launches_that_draw_random_bits(monkeypatch, recipe, tables):
    """A grouped launch that rounds to nearest gets the kept zero table (its kernel reads no
    Philox words) instead of a table built and copied per launch: FP8 blockwise (every
    operand round to nearest) builds none per fwd+bwd, NVFP4 only the gradients' launches
    (stochastic rounding; one per projection)."""
    from fp4gen.kernels import host

    built = []
    real = host.u64_table

    def counted(rows, names):
        built.append(len(names))
        return real(rows, names)

    monkeypatch.setattr(host, "u64_table", counted)
    moe_host.measure(sizes(4), recipe)  # two warm-up passes, one timed, one counted, ...
    per_pass = len(built) / 5  # ... one profiled (moe_host.measure: five fwd+bwd at steps=1)
    assert per_pass == tables


def test_the_unread_table_is_kept_per_device_and_width() -> None:
    """One zero buffer per device and width, viewed at the launch's groups (the compiled
    kernels match its rows to the groups' other tables), grown where more are asked for."""
    from fp4gen.runtime.host_tables import unread_table

    cpu = torch.device("cpu")
    t = unread_table(cpu, 3, 4)
    assert t.shape == (3, 4) and t.dtype == torch.int32 and not t.any()
    assert unread_table(cpu, 2, 4).data_ptr() == t.data_ptr()  # the same buffer
    assert unread_table(cpu, 64, 4).shape == (64, 4) and unread_table(cpu, 5, 2).shape == (5, 2)
    assert unread_table(cpu, 0, 4).shape == (0, 4)
