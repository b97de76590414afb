"""benchmarks/host_keys.py on the CPU: every timed call is an in-place layer-graph replay (the
path it claims to time), and the stand-ins are put back afterwards."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from fp4gen.runtime import layer_graphs, linear

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import host_keys  # noqa: E402


def test_the_timed_calls_are_in_place_replays_and_the_stand_ins_go_back() -> None:
    before = (
        layer_graphs._fresh,
        layer_graphs._capture,
        layer_graphs._current_stream_id,
        torch.cuda.is_current_stream_capturing,
        linear.Linear._graphs_for,
    )
    us, graphs = host_keys.keying("recipes/nvfp4_small.fp4r", 64, calls=20)
    # 5 warm-up steps: eager, a static capture, an in-place capture, then 2 in-place replays
    # per step (forward and backward), as on the timed calls
    assert graphs.replays == graphs.in_place_replays == 2 * 2 + 2 * 20
    assert not graphs.failed and us > 0.0
    after = (
        layer_graphs._fresh,
        layer_graphs._capture,
        layer_graphs._current_stream_id,
        torch.cuda.is_current_stream_capturing,
        linear.Linear._graphs_for,
    )
    assert after == before


def test_the_gemm_measure_launches_once_per_call_and_puts_everything_back(monkeypatch) -> None:
    """``gemm_call``: every call reaches the (stood-in) kernel once; with ``prepared`` every
    timed call goes through the prepared call (B prepared at its second call), without it none;
    afterwards torch.empty, the plans, the arch table and the registry of prepared calls are as
    before."""
    from fp4gen import gemm_dispatch
    from fp4gen.compiler import jit
    from fp4gen.runtime import cute_gemm

    served: list[bool] = []
    real = cute_gemm.PreparedGemm.__call__

    def counting(self, a, b, out_dtype):
        c = real(self, a, b, out_dtype)
        served.append(c is not None)
        return c

    monkeypatch.setattr(cute_gemm.PreparedGemm, "__call__", counting)
    before = (torch.empty, dict(cute_gemm._plans), dict(jit._archs), len(gemm_dispatch._prepared))
    for prepared, hits in ((True, 6 + 30), (False, 0)):
        served.clear()
        us, launches = host_keys.gemm_call(16, 256, 512, calls=30, prepared=prepared)
        assert launches == 8 + 30 and us > 0.0
        assert served == [True] * hits
    after = (torch.empty, dict(cute_gemm._plans), dict(jit._archs), len(gemm_dispatch._prepared))
    assert after == before


def test_the_siblings_measure_runs_the_group_or_each_layer_and_puts_everything_back() -> None:
    """``siblings``: q, k and v on one x as one layer group (every timed step a group run) or
    each alone (no group formed); the stand-ins and the setting go back afterwards."""
    import os

    from fp4gen.runtime import layer_groups

    before = (layer_graphs._fresh, layer_graphs._addresses, linear.Linear._graphable)
    setting = os.environ.get("FP4GEN_LAYER_GROUPS")
    us, group = host_keys.siblings("recipes/nvfp4_small.fp4r", 64, calls=10, grouped=True)
    assert group is not None and group.size == 3 and us > 0.0
    assert group.runs == 8 - layer_groups.SIGHTINGS + 10  # every step after the sightings
    leader = group.refs[0]()  # dissolved at the end of the measure (the layers may be gone)
    assert leader is None or layer_groups.group_of(leader) is None
    us, group = host_keys.siblings("recipes/nvfp4_small.fp4r", 64, calls=10, grouped=False)
    assert group is None and us > 0.0
    assert (layer_graphs._fresh, layer_graphs._addresses, linear.Linear._graphable) == before
    assert os.environ.get("FP4GEN_LAYER_GROUPS") == setting
