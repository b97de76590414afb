"""benchmarks/host_path.py's piece timer on the CPU: every piece is put back as it was, and the
nested pieces add up (a piece's time includes the pieces it calls)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import fp4gen
from fp4gen.runtime import layer_graphs, linear, ops

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import host_path  # noqa: E402


def test_piece_times_puts_every_piece_back_and_nests(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    before = (
        linear.Linear.__dict__["forward"],
        ops._EagerLinear.__dict__["backward"],
        layer_graphs.__dict__["_replay_static"],
        torch.cuda.CUDAGraph.__dict__["replay"],
    )
    layer = fp4gen.nn.Linear(64, 32, recipe=fp4gen.load_recipe("recipes/nvfp4_small.fp4r"))
    x = torch.randn(16, 64, requires_grad=True)

    def step() -> None:
        layer(x).sum().backward()

    times = dict(host_path.piece_times(step, 3))
    after = (
        linear.Linear.__dict__["forward"],
        ops._EagerLinear.__dict__["backward"],
        layer_graphs.__dict__["_replay_static"],
        torch.cuda.CUDAGraph.__dict__["replay"],
    )
    assert after == before
    assert isinstance(after[1], staticmethod)
    assert times["Linear.forward (autograd wrapper)"] >= times["Linear.forward_gemm"] > 0
    assert times["_EagerLinear.backward"] >= times["Linear.backward_gemms"] > 0
    assert times["LayerGraphs.run_with_meta"] == 0  # CPU tensors: no layer graphs
    total = times["Linear.forward (autograd wrapper)"] + times["_EagerLinear.backward"]
    assert times["whole fwd+bwd"] >= total
