"""benchmarks/host_keys.py on the CPU: every timed call is an in-place layer-graph replay (the
path it claims to time), the FP8 GEMM's routes issue no more aten ops per call than measured,
and the stand-ins are put back afterwards."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
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


# aten ops per fp4gen.gemm call of the FP8 routes (fp8_blockwise, 256x256x512), at most: (all,
# launching GPU work), besides the GEMM. Measured before the prepared calls: scaled_mm 7 / 1 with
# one weight, 14 / 2 with a new weight per call; the generated kernel 3 / 0 either way
# (docs/gemm-sm90.md, "Host time of the FP8 GEMM"). A change that adds an op fails here. The
# generated kernel's default is the coalesced variant since it was measured faster: A's scales
# go MN-major per call (a buffer, a transposed view and one copy: 3 ops, 1 launching) until the
# quantize kernels write that layout (docs/gemm-sm90.md, "Switched on since").
FP8_OPS = {
    ("scaled_mm", False): (4, 1),  # A: codes as FP8, its scales M-major with S_dec (one pass)
    ("scaled_mm", True): (10, 2),  # and B's codes and tile scales with S_dec (one pass)
    ("generated", False): (5, 1),  # the output (empty_like), S_a's [1] view, A's scales MN-major
    ("generated", True): (6, 1),  # the output, S_a's and S_b's [1] views, A's scales MN-major
}


@pytest.mark.parametrize("route, fresh_weight", list(FP8_OPS))
def test_the_fp8_routes_issue_at_most_their_ops_per_call(route, fresh_weight) -> None:
    """``fp8_gemm_call``: every call reaches the stood-in GEMM once, on the route asked, and
    issues no more aten ops (and no more launching ones) than ``FP8_OPS`` says; the stand-ins
    go back afterwards. A count, not a time: no timed assertion."""
    from fp4gen import gemm_dispatch
    from fp4gen.compiler import jit
    from fp4gen.runtime import fp8_gemm

    def state() -> tuple:  # what the stand-ins replace or fill while they run
        return (
            dict(jit._archs),
            dict(fp8_gemm.CUTE_AUTO_MIN_M),
            fp8_gemm.cute_kernel,
            fp8_gemm.F.__dict__.get("scaled_mm"),
            dict(gemm_dispatch._choices),
            dict(gemm_dispatch._prepared_fp8),
        )

    before = state()
    got = host_keys.fp8_gemm_call(route, 256, 256, 512, calls=20, fresh_weight=fresh_weight)
    ops, launching = FP8_OPS[(route, fresh_weight)]
    assert got.gemms == 1 and got.us > 0.0
    assert got.ops <= ops and got.launching <= launching, got.names
    assert len(got.names) == got.ops
    assert state() == before


def test_the_op_count_sorts_views_allocations_and_launches() -> None:
    x = torch.ones(4, 4)
    with host_keys.OpCount() as counted:
        y = torch.empty(4, 4)
        torch.mul(x.t(), 2.0, out=y)
        x.view(torch.int32)
    assert counted.ops[0] == "aten.empty.memory_format" and "aten.t.default" in counted.ops
    assert counted.launching == ["aten.mul.out"]


def test_help_and_the_fp8_lines_say_the_fp8_figures(capsys) -> None:
    """``--help`` ends with the FP8 GEMM's figures, whose op counts are ``FP8_OPS``;
    ``--fp8-only`` prints one line per route and weight with its op counts."""
    with pytest.raises(SystemExit):
        host_keys.main(["--help"])
    text = capsys.readouterr().out
    assert "Host time of the FP8 GEMM" in text and "--fp8-only" in text
    rows = {
        ("scaled_mm", False): "scaled_mm, one weight",
        ("scaled_mm", True): "scaled_mm, a new weight per call",
        ("generated", False): "generated kernel, one weight",
        ("generated", True): "generated kernel, new weight",
    }
    for key, label in rows.items():
        row = next(line for line in text.splitlines() if line.strip().startswith(label))
        before, after = re.findall(r"(\d+) ops, (\d+)", row)  # the columns of the row
        assert tuple(int(v) for v in after) == FP8_OPS[key]
    assert host_keys.main(["--fp8-only", "--calls", "40", "--fp8-shape", "128x256x256"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all("128x256x256 fp8_blockwise" in line for line in lines)
    assert "scaled_mm (one weight)" in lines[0] and "generated (a new weight" in lines[3]
