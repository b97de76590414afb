"""benchmarks/train.py's loss-curve comparison on the CPU: the same batches and initial weights
for every recipe (BF16 against itself gives a zero difference), a converted model's curve is its
own, and the summary measures the difference against BF16's step-to-step noise."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import train  # noqa: E402


def _args() -> argparse.Namespace:
    return argparse.Namespace(model="gpt", seq=16, tokens=64, loss_lr=3e-3)


def test_loss_curves_start_alike_and_bf16_repeats_itself() -> None:
    args = _args()
    bf16 = train.loss_curve(args, 32, 1, "bf16", 6, "cpu")
    again = train.loss_curve(args, 32, 1, "bf16", 6, "cpu")
    nvfp4 = train.loss_curve(args, 32, 1, "recipes/nvfp4_small.fp4r", 6, "cpu")
    assert bf16 == again  # the same weights, batches and schedule: the same losses
    assert len(nvfp4) == 6 and nvfp4 != bf16  # quantized GEMMs: another curve
    assert abs(nvfp4[0] - bf16[0]) < 0.1 * bf16[0]  # the same start (untrained: about ln 256)
    assert all(v > 0 for v in nvfp4)


def test_the_summary_measures_differences_against_bf16_noise(capsys) -> None:
    curves = {
        "bf16": [3.0, 2.0, 2.2, 1.8, 2.0, 2.0],
        "a.fp4r": [3.1, 2.1, 2.3, 1.9, 2.1, 2.1],  # 0.1 above on every step
    }
    base, other = train.summarize_curves(curves, 4)
    assert base.recipe == "bf16" and base.diff == 0.0 and base.mean == pytest.approx(2.0)
    assert other.diff == pytest.approx(0.1) and other.diff_se == pytest.approx(0.0, abs=1e-12)
    assert other.noise == pytest.approx(0.16329931618554522)  # std of 2.2, 1.8, 2.0, 2.0
    assert other.within_noise
    curves["a.fp4r"] = [v + 0.3 for v in curves["bf16"]]
    assert not train.summarize_curves(curves, 4)[1].within_noise
    train.print_curves(curves, points=3)
    out = capsys.readouterr().out
    assert "a: last 2 steps 2.3000 vs bf16 2.0000, difference +0.3000" in out
    assert "OUTSIDE" in out


def test_the_host_speed_line_times_a_launch_and_an_allocation() -> None:
    """The header's two per-call times, in microseconds (a CPU host here; no bound on them: a
    benchmark's figures are not asserted)."""
    times = train.host_speed("cpu", calls=200)
    assert len(times) == 2 and all(isinstance(t, float) and t > 0.0 for t in times)


def test_the_wall_time_per_linear_counts_each_forward_and_backward_and_restores_the_ops(
    monkeypatch,
) -> None:
    """``wall_us_per_linear``: one figure per Linear forward + backward (the two op bodies
    timed, divided by the forward calls), the ops put back afterwards, None without fp4gen.
    A clock that advances 1 us per reading makes each op body take exactly 1 us."""
    import itertools

    import torch

    import fp4gen

    torch.manual_seed(0)
    layers = [fp4gen.nn.Linear(32, 32, recipe=fp4gen.load_recipe("nvfp4_small.fp4r"))] * 2
    x = torch.randn(16, 32, requires_grad=True)
    calls: list[str] = []
    real = fp4gen.nn.Linear.forward_gemm

    def step() -> None:
        calls.append("step")
        layers[1](layers[0](x)).sum().backward()

    before = dict(fp4gen.nn.Linear.__dict__)
    clock = itertools.count(0, 1000)
    monkeypatch.setattr(train.time, "perf_counter_ns", lambda: next(clock))
    us = train.wall_us_per_linear(torch.nn.ModuleList(layers), step, 3)
    monkeypatch.undo()
    assert calls == ["step"] * 3
    assert us == 2.0  # 6 forwards and 6 backwards, 1 us each: 2 us per forward + backward
    assert fp4gen.nn.Linear.forward_gemm is real
    assert {k: before[k] for k in ("forward_gemm", "backward_gemms")} == {
        k: fp4gen.nn.Linear.__dict__[k] for k in ("forward_gemm", "backward_gemms")
    }
    plain = torch.nn.Linear(4, 4)
    assert train.wall_us_per_linear(plain, lambda: plain(torch.ones(4)), 2) is None


def test_the_call_timers_time_whole_layer_calls_beside_the_ops_and_put_everything_back(
    monkeypatch,
) -> None:
    """``timers(OPS, CALLS)``, as ``host_us`` uses them: the ops (forward_gemm, backward_gemms)
    and the whole calls (the module's ``__call__``, the autograd node's backward) each timed
    once per call, nested timers in one group not counted twice, and afterwards every
    attribute as it was (``__call__`` inherited again, the backward the same staticmethod).
    A clock that advances 1 us per reading: an op body takes 1 us, a call around one 3 us."""
    import itertools

    import torch

    import fp4gen
    from fp4gen.runtime import ops

    torch.manual_seed(0)
    recipe = fp4gen.load_recipe("nvfp4_small.fp4r")
    model = torch.nn.Sequential(fp4gen.nn.Linear(32, 32, recipe=recipe), torch.nn.ReLU())
    x = torch.randn(16, 32, requires_grad=True)
    backward = ops._EagerLinear.__dict__["backward"]
    clock = itertools.count(0, 1000)
    monkeypatch.setattr(train.time, "perf_counter_ns", lambda: next(clock))
    with train.timers(train.OPS, train.CALLS) as spent:
        assert "__call__" in fp4gen.nn.Linear.__dict__  # timed while the block runs
        for _ in range(2):
            model(x).sum().backward()
    monkeypatch.undo()
    assert spent == [4000, 12000]  # 2 steps: ops 1 + 1 us, calls 3 + 3 us (each around an op)
    assert "__call__" not in fp4gen.nn.Linear.__dict__  # nn.Module's again
    assert ops._EagerLinear.__dict__["backward"] is backward
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_graph_counts_sum_the_layers_graph_counters() -> None:
    import torch

    import fp4gen
    from fp4gen.runtime.layer_graphs import LayerGraphs

    recipe = fp4gen.load_recipe("nvfp4_small.fp4r")
    model = torch.nn.Sequential(*(fp4gen.nn.Linear(8, 8, recipe=recipe) for _ in range(3)))
    assert train.graph_counts(model) == (0, 0)  # no layer graphs made (a CPU model)
    for i, layer in enumerate(model[:2]):
        layer._graphs = LayerGraphs(f"l{i}")
        layer._graphs.graph_calls, layer._graphs.in_place_replays = 5 + i, 3 + i
    assert train.graph_counts(model) == (11, 7)
    # a layer group's graph call serves each of its members
    from fp4gen.runtime import layer_groups

    layer_groups.sighted(list(model[1:]))
    layer_groups.sighted(list(model[1:]))
    group = layer_groups.group_of(model[1])
    assert group is not None and group is layer_groups.group_of(model[2]) and group.size == 2
    group.graphs.graph_calls, group.graphs.in_place_replays = 4, 1
    assert train.graph_counts(model) == (11 + 8, 7 + 2)
    group.dissolve()


def _result(eager: float, graph: float | None, host: float | None) -> train.Result:
    return train.Result(eager, graph, "", None, host, None, 1.0)


def test_rounds_summarize_each_ratio_against_its_own_rounds_bf16(capsys) -> None:
    """--rounds: each round's eager and graph ratios are taken against that round's BF16 run
    (a slow round's BF16 is slow too), then the median and range over the rounds printed."""
    rounds = []
    for bf16_ms, nvfp4_ms, host in ((40.0, 52.0, 150.0), (50.0, 75.0, 250.0), (36.0, 45.0, 140.0)):
        base = _result(bf16_ms, 37.5, None)
        rounds.append({"bf16": (base, base), "nvfp4_small": (_result(nvfp4_ms, 45.0, host), base)})
    train.print_rounds(rounds)
    out = capsys.readouterr().out
    assert "over 3 rounds" in out
    # eager ratios 1.30, 1.50, 1.25 -> median 1.30; graph 1.20 each; host 140-250
    assert "nvfp4_small" in out and "eager x bf16 1.30x (1.25x-1.50x)" in out
    assert "graph x bf16 1.20x (1.20x-1.20x)" in out and "host us/lin 150 us (140 us-250 us)" in out
    assert "bf16  " not in out.split("over 3 rounds")[1]  # the base has no row of its own
    assert train.spread([2.0, 1.0]) == "1.50x (1.00x-2.00x)" and train.spread([]) == "-"


@pytest.mark.parametrize(
    ("name", "kind"),
    [  # kernel names from torch.profiler on an H200 (a Llama step, fp8_blockwise / nvfp4_small)
        ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN", "gemm"),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
        (
            "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128",
            "attention",
        ),
        (
            "kernel_cutlass_kernel_fp4gen_generated_dbab02dc4f2cab35QuantizeKernel_object_at_",
            "quantize",
        ),
        ("kernel_cutlass_kernel_fp4gen_generated_0123AmaxKernel_object_at_", "quantize"),
        ("kernel_cutlass_kernel_fp4gen_generated_0123DequantKernel_object_at_", "decode"),
        ("kernel_cutlass_kernel_fp4gen_generated_0123GemmSm90Kernel_object_at_", "gemm"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::",
            "optimizer",
        ),
        ("Memcpy DtoD (Device -> Device)", "copies"),
        ("kernel_cutlass_kernel_fp4gen_generated_0123MoRDecideKernel_object_at_", "quantize"),
        ("void at::native::memory_efficient_kernel", "other"),
        ("kernel_cutlass_kernel_fp4gen_generated_0123TableKernel_object_at_", "fp4gen other"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>",
            "other",
        ),
    ],
)
def test_kernels_are_sorted_into_kinds_by_name(name: str, kind: str) -> None:
    assert train.kernel_kind(name) == kind


def test_the_kinds_line_puts_bf16s_figure_beside_each_kind() -> None:
    bf16 = {"gemm": 25.0, "other": 20.5}
    fp8 = {"gemm": 16.8, "quantize": 4.0, "other": 19.5}
    assert train.kinds_line(fp8, bf16) == "other 19.50 (20.50), gemm 16.80 (25.00), quantize 4.00"
    assert train.kinds_line(bf16, bf16) == "gemm 25.00, other 20.50"


def test_the_kernel_lines_rank_kernels_by_time_and_name_their_kind() -> None:
    kernels = {
        "void at::native::elementwise_kernel<copy>": (0.5, 12.0),
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT": (6.25, 4.0),
        "kernel_cutlass_kernel_fp4gen_generated_quantize_rows": (1.0, 8.0),
    }
    lines = train.kernel_lines(kernels, 2, width=20)
    assert lines == [
        "   6.250 ms     4x  gemm         nvjet_tst_128x256_64",
        "   1.000 ms     8x  fp4gen other kernel_cutlass_kerne",
    ]
    assert train.kernel_lines(kernels, 0) == []


def test_profiles_print_by_group_each_against_its_first_row(capsys) -> None:
    """Every row's profile runs after every row is timed (a profiler session slows the
    process's later launches); each group's rows are compared with its first (BF16)."""
    ran: list[str] = []

    def job(group: str, label: str, busy: float | None) -> train.ProfileJob:
        def run() -> train.Profiled | None:
            ran.append(label)
            if busy is None:
                return None
            kinds = {"gemm": busy * 0.5, "other": busy * 0.5}
            return train.Profiled(busy, 200.0 if label != "bf16" else None, kinds, {})

        return train.ProfileJob(group, label, run)

    jobs = [
        job("hidden 2048, 4 layers, eager", "bf16", 40.0),
        job("hidden 2048, 4 layers, eager", "fp8_blockwise", 30.0),
        job("hidden 2048, 4 layers, compiled blocks default", "bf16", 20.0),
        job("hidden 2048, 4 layers, compiled blocks default", "nvfp4_small", None),
        job("hidden 2048, 4 layers, compiled blocks default", "fp8_blockwise", 25.0),
    ]
    train.run_profiles(argparse.Namespace(kernels=0, kernel_width=90), jobs)
    out = capsys.readouterr().out
    assert ran == [j.label for j in jobs]
    assert "profiled after every row was timed" in out
    lines = [
        line.split() for line in out.splitlines() if line.startswith("  ") and "ms" not in line
    ]
    assert ["fp8_blockwise", "30.00", "0.75x", "200"] in [line[:4] for line in lines]
    assert ["fp8_blockwise", "25.00", "1.25x", "200"] in [line[:4] for line in lines]  # vs 20
    assert "(its profile failed)" in out
    assert "GPU ms by kind: gemm 15.00 (20.00), other 15.00 (20.00)" in out
    train.run_profiles(argparse.Namespace(kernels=0, kernel_width=90), [])
    assert capsys.readouterr().out == ""
