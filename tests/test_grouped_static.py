"""Grouped launches with the groups' sizes on the device (``fp4gen.runtime.grouped_static``,
``grouped_tile.quantize_groups_tile_static``): the bounds hold for every routing, the tables
built by torch ops from device counts are the host tables' rows followed by copies of the last
(CPU, drawn groups with empty ones anywhere), the Philox words are the host's; on a GPU one
CUDA graph, captured once, replays the launch for routings of every shape, each group's copies
bit for bit the definition's."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch

from fp4gen.errors import FP4GenError, TensorError
from fp4gen.kernels.host import u64_table
from fp4gen.runtime.grouped_quantize import cta_table
from fp4gen.runtime.grouped_static import (
    device_groups,
    padded_bound,
    philox_table,
    rowwise_ctas_bound,
    static_cta_table,
    static_tile_table,
    tile_ctas_bound,
)
from fp4gen.runtime.grouped_tile import padded_counts, tile_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_moe_grouped_quantize import CASES as rowwise_cases  # noqa: E402


def draws(n: int, seed: int = 7):
    """(counts, multiple, tile_m, tiles_k): groups of 1-70, rows split with empty groups
    anywhere (often), one group holding every row, or spread evenly."""
    rng = random.Random(seed)
    for _ in range(n):
        groups = rng.randint(1, 70)
        rows = rng.randint(1, 3000)
        kind = rng.random()
        if kind < 0.15:
            counts = [0] * groups
            counts[rng.randrange(groups)] = rows
        else:
            cuts = sorted(rng.randint(0, rows) for _ in range(groups - 1))
            counts = [b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]
            if kind < 0.6:  # many empty groups
                for g in rng.sample(range(groups), rng.randint(0, groups - 1)):
                    counts[g] = 0
                counts[rng.randrange(groups)] += rows - sum(counts)
        yield (
            counts,
            rng.choice([1, 16, 32, 64, 128]),
            rng.choice([16, 32, 64, 128]),
            rng.randint(1, 4),
        )


def test_padded_rows_never_pass_the_bound() -> None:
    """Σ round_up(c_g, b) <= padded_bound(R, G, b) for every drawn split of R rows, and the
    bound is reached where every group holds one row past a multiple."""
    for counts, multiple, _, _ in draws(300):
        bound = padded_bound(sum(counts), len(counts), multiple)
        assert sum(padded_counts(counts, multiple)) <= bound and bound % multiple == 0
    worst = [1] * 5 + [16 * 3 + 1]  # every group one row past a multiple of 16
    assert sum(padded_counts(worst, 16)) == padded_bound(sum(worst), 6, 16) == 16 * 9


def test_device_built_tile_table_is_the_host_tables_then_its_last_row() -> None:
    """The grouped tile kernels' table from device counts: its bound's length, which no drawn
    routing passes; the host table's rows (``grouped_tile.tile_table``), then copies of its
    last row."""
    for counts, multiple, tile_m, tiles_k in draws(200):
        groups = device_groups(torch.tensor(counts, dtype=torch.int32), sum(counts), multiple)
        got = static_tile_table(groups, tile_m, tiles_k)
        want = torch.tensor(tile_table(counts, padded_counts(counts, multiple), tile_m, tiles_k))
        assert got.dtype == torch.int32
        assert got.shape[0] == tile_ctas_bound(groups.bound, len(counts), tile_m, tiles_k)
        assert want.shape[0] <= got.shape[0], (counts, multiple, tile_m, tiles_k)
        n = want.shape[0]
        assert torch.equal(got[:n], want.to(torch.int32)), (counts, multiple, tile_m, tiles_k)
        assert torch.equal(got[n:], want[-1:].to(torch.int32).expand(got.shape[0] - n, -1))


def test_device_built_rowwise_table_is_the_host_tables_then_its_last_row() -> None:
    """The same for the grouped rowwise kernels' table (``grouped_quantize.cta_table``): the
    groups' real rows, units per row, a tile of units per CTA."""
    rng = random.Random(3)
    for counts, _, _, _ in draws(200, seed=11):
        units_per_row, tile = rng.choice([1, 2, 8, 16]), rng.choice([32, 128, 256, 512])
        groups = device_groups(torch.tensor(counts), sum(counts), 1)
        got = static_cta_table(groups, units_per_row, tile)
        want = torch.tensor(cta_table(counts, units_per_row, tile), dtype=torch.int32)
        assert got.shape[0] == rowwise_ctas_bound(sum(counts), len(counts), units_per_row, tile)
        n = want.shape[0]
        assert n <= got.shape[0] and torch.equal(got[:n], want), (counts, units_per_row, tile)
        assert torch.equal(got[n:], want[-1:].expand(got.shape[0] - n, -1))


def test_the_device_groups_rows() -> None:
    groups = device_groups(torch.tensor([5, 0, 17, 1]), 23, 16)
    assert groups.pads.tolist() == [16, 0, 32, 16]
    assert groups.in_rows.tolist() == [0, 5, 5, 22]
    assert groups.out_rows.tolist() == [0, 16, 16, 48]
    assert groups.bound == padded_bound(23, 4, 16) == 96 and groups.groups == 4


def test_the_device_routing_is_the_loops_order() -> None:
    """The routing sorted on the device, no host read: expert by expert, each expert's (token,
    choice) slots in the loop's order (choice-major, then token), the slots routed nowhere
    here (ids outside [0, E): an expert-parallel sentinel) last as a group of their own; the
    groups' counts, the slots' tokens and top-k positions; over drawn routings with experts
    that get nothing."""
    from fp4gen.runtime.grouped_static import device_routing

    rng = random.Random(5)
    for _ in range(60):
        tokens, k, experts = rng.randint(1, 40), rng.randint(1, 8), rng.randint(1, 12)
        ids = [[rng.randint(-1, experts) for _ in range(k)] for _ in range(tokens)]
        index = torch.tensor(ids, dtype=torch.int64)
        got = device_routing(index, experts, 16)
        want = []
        for e in [*range(experts), None]:  # None: the slots routed to no expert here
            for j in range(k):
                for t in range(tokens):
                    here = 0 <= ids[t][j] < experts
                    if (e is None and not here) or (here and ids[t][j] == e):
                        want.append(j * tokens + t)
        assert got.order.tolist() == want
        assert got.token_idx.tolist() == [slot % tokens for slot in want]
        assert got.top_k_pos.tolist() == [slot // tokens for slot in want]
        counts = [sum(1 for row in ids for i in row if i == e) for e in range(experts)]
        counts.append(tokens * k - sum(counts))
        assert got.groups.counts.tolist() == counts
        assert got.groups.rows == tokens * k and got.groups.groups == experts + 1
        assert got.groups.pads.tolist() == padded_counts(counts, 16)
    with pytest.raises(TensorError, match=r"expected \[tokens, k\] integer expert ids"):
        device_routing(torch.zeros(4), 3, 16)


def test_philox_words_are_the_hosts() -> None:
    """Seeds and offsets from the device give the words ``kernels.host.u64_table`` makes of the
    same values on the host, values of 2^31, 2^32 and from 2^63 on (int64 bit patterns)
    included."""
    values = [0, 1, 2**31, 2**32 + 5, 2**40 + 7, 2**63 + 11, 2**64 - 1, 123456789]
    seeds = values[:4]
    offsets = [[values[4], values[5]], [values[6], values[7]], [0, 2**31 - 1], [2**33, 9]]
    want = u64_table([[s, *o] for s, o in zip(seeds, offsets, strict=True)], ["seed", "o", "o"])

    def as_int64(v: int) -> int:
        return v - 2**64 if v >= 2**63 else v

    got = philox_table(
        torch.tensor([as_int64(s) for s in seeds]),
        torch.tensor([[as_int64(v) for v in row] for row in offsets]),
    )
    assert got.dtype == torch.int32 and torch.equal(got, torch.from_numpy(want))


def test_bad_groups_and_tables_are_one_line_errors() -> None:
    with pytest.raises(TensorError, match=r"counts of shape \(2, 2\)"):
        device_groups(torch.zeros(2, 2, dtype=torch.int32), 4, 16)
    with pytest.raises(TensorError, match="1-D int32 or int64"):
        device_groups(torch.zeros(3), 4, 16)
    with pytest.raises(TensorError, match="at least one row"):
        device_groups(torch.zeros(3, dtype=torch.int32), 0, 16)
    with pytest.raises(TensorError, match=r"expected \[G\] and \[G, copies\]"):
        philox_table(torch.zeros(3, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(TensorError, match="expected int64"):
        philox_table(torch.zeros(2, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int64))


def test_the_static_launch_refuses_what_it_cannot_do() -> None:
    """No per-group fallback: a CPU tensor, a wrong row count, wrong seeds or offsets are
    refused by name."""
    from fp4gen.formats import BUILTIN_FORMATS
    from fp4gen.runtime.grouped_tile import quantize_groups_tile_static

    fmt = BUILTIN_FORMATS["nvfp4"]
    copies = [("columnwise", "nearest", None)]
    groups = device_groups(torch.tensor([3, 5], dtype=torch.int32), 8, 16)
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    seeds, offsets = torch.zeros(2, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(FP4GenError, match="a CPU tensor"):
        quantize_groups_tile_static(x, groups, fmt, copies, seeds=seeds, offsets=offsets)
    with pytest.raises(TensorError, match=r"x of shape \(7, 64\) for groups of 8 rows"):
        quantize_groups_tile_static(x[:7], groups, fmt, copies, seeds=seeds, offsets=offsets)
    with pytest.raises(TensorError, match="expected \\[G\\] and \\[G, copies\\]"):
        quantize_groups_tile_static(x, groups, fmt, copies, seeds=seeds, offsets=offsets[:1])
    with pytest.raises(FP4GenError, match="scope 'layer'"):
        quantize_groups_tile_static(
            x, groups, fmt, copies, seeds=seeds, offsets=offsets, scope="layer"
        )


# ----------------------------------------------------------------------------------------------
# On a GPU: one graph, every routing
# ----------------------------------------------------------------------------------------------
def captured(launch):
    """(a CUDA graph of ``launch()``, its outputs): run once on a side stream first (the
    kernels compile and load outside the capture), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch()
    return graph, out


def replayed(launch, fill):
    """(turn, routing, outputs) of ``launch`` captured once (its inputs filled for the first
    routing) and replayed for each of ``ROUTINGS`` (``fill(turn)`` copies its inputs in)."""
    fill(0)
    graph, out = captured(launch)
    for turn, routing in enumerate(ROUTINGS):
        fill(turn)
        graph.replay()
        torch.cuda.synchronize()
        yield turn, routing, out


# the grouped tile cases of test_moe_grouped_tile: RHT 16 and 32, stochastic rounding, NVFP4,
# MXFP4, MXFP8 and fp8_blockwise, one copy and a rowwise + columnwise pair
GPU_CASES = [
    "nvfp4_gradient_pair",
    "nvfp4_col_sr_rht32",
    "mxfp8_pair",
    "mxfp4_col_sr",
    "fp8_block_pair",
    "nvfp4_wgrad_activation",
]
# routings of the 402 rows of test_moe_grouped_tile's groups: its own (empty and very unequal
# groups), every row in the first or the last group, even, and one group of all but five
ROUTINGS = [
    [37, 0, 5, 60, 0, 300],
    [402, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 402],
    [67, 67, 67, 67, 67, 67],
    [1, 1, 1, 1, 1, 397],
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scope", ["expert", "tensor"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_cuda_one_graph_replays_the_launch_for_any_routing(case: str, scope: str) -> None:
    """The device-sized launch captured once in a CUDA graph (the groups' tables built inside
    it from the counts), then replayed for five routings and fresh Philox offsets copied into
    its inputs: every group's copies (codes, scales, S_dec) are the definition's bit for bit
    (``reference_groups_tile`` of that routing), per expert and per tensor, with RHT and
    stochastic rounding."""
    from test_moe_grouped_tile import CASES, SEEDS, _differences, copies_of, fmt_of, grouped_input

    from fp4gen.runtime import finite
    from fp4gen.runtime.grouped_tile import quantize_groups_tile_static, reference_groups_tile

    fmt_name, raw = CASES[case]
    fmt = fmt_of(fmt_name)
    if scope == "tensor" and not fmt.global_scale:
        pytest.skip(f"{fmt_name} has no global scale")
    copies = copies_of(raw)
    multiple = math.lcm(fmt.block[1], *(size or 1 for _, _, size in raw))
    rows, k, n = sum(ROUTINGS[0]), 128, len(ROUTINGS[0])
    x = torch.empty(rows, k, dtype=torch.bfloat16, device="cuda")
    counts = torch.zeros(n, dtype=torch.int32, device="cuda")
    offsets = torch.zeros(n, len(copies), dtype=torch.int64, device="cuda")
    seeds = torch.tensor(SEEDS, dtype=torch.int64, device="cuda")

    def host_offsets(turn: int) -> list[tuple[int, ...]]:
        return [
            tuple(8 * (1000 * turn + 7 * g + i) + 4 for i in range(len(copies))) for g in range(n)
        ]

    def fill(turn: int) -> None:
        x.copy_(grouped_input("cuda", k, counts=ROUTINGS[turn]))
        counts.copy_(torch.tensor(ROUTINGS[turn]))
        offsets.copy_(torch.tensor(host_offsets(turn)))

    def launch():
        groups = device_groups(counts, rows, multiple)
        return quantize_groups_tile_static(
            x, groups, fmt, copies, seeds=seeds, offsets=offsets, scope=scope
        )

    with finite.propagating():
        bad = []
        for turn, routing, out in replayed(launch, fill):
            pads = padded_counts(routing, multiple)
            want = reference_groups_tile(x.cpu(), routing, pads, fmt, copies, SEEDS,
                                         host_offsets(turn), "reference", scope)  # fmt: skip
            for g, count in enumerate(routing):
                if count == 0:
                    assert out.group(g, 0, routing) is None
                    continue
                for i in range(len(copies)):
                    got = out.group(g, i, routing)
                    bad += _differences(got, want[g][i], f"routing {turn} group {g} copy {i}")
    assert not bad, "\n".join(bad[:20])


def test_the_static_rowwise_launch_refuses_what_it_cannot_do() -> None:
    from fp4gen.formats import BUILTIN_FORMATS
    from fp4gen.runtime.grouped_quantize import quantize_groups_static

    fmt = BUILTIN_FORMATS["nvfp4"]
    groups = device_groups(torch.tensor([3, 5], dtype=torch.int32), 8, 1)
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    seeds = offsets = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(FP4GenError, match="a CPU tensor"):
        quantize_groups_static(x, groups, fmt, seeds=seeds, offsets=offsets)
    with pytest.raises(TensorError, match=r"x of shape \(7, 64\) for groups of 8 rows"):
        quantize_groups_static(x[:7], groups, fmt, seeds=seeds, offsets=offsets)
    with pytest.raises(TensorError, match=r"expected \[G\] each"):
        quantize_groups_static(x, groups, fmt, seeds=seeds, offsets=offsets[:1])
    with pytest.raises(FP4GenError, match="scope 'tensor' needs one global amax"):
        quantize_groups_static(
            x, groups, BUILTIN_FORMATS["mxfp8_e4m3"], seeds=seeds, offsets=offsets, scope="tensor"
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scope", ["expert", "tensor"])
# the grouped rowwise kernels' cases of test_moe_grouped_quantize: NVFP4 to nearest and
# stochastic (8-bit and full), an RHT of 16 and of 128 (across lanes), MXFP8, MXFP4 stochastic
@pytest.mark.parametrize(("fmt_name", "rounding", "rht"), rowwise_cases)
def test_cuda_one_graph_replays_the_rowwise_launch_for_any_routing(
    fmt_name: str, rounding: str, rht, scope: str
) -> None:
    """The device-sized grouped rowwise launch (the experts' fprop tokens) captured once, then
    replayed for five routings with fresh Philox offsets: each group's codes, scales and S_dec
    are ``quantize_groups``' reference bit for bit, per expert and per tensor."""
    from test_moe_grouped_quantize import rht_spec
    from test_moe_grouped_tile import SEEDS, _differences, grouped_input

    from fp4gen.formats import BUILTIN_FORMATS
    from fp4gen.runtime import finite
    from fp4gen.runtime.grouped_quantize import quantize_groups, quantize_groups_static

    fmt = BUILTIN_FORMATS[fmt_name]
    if scope == "tensor" and not fmt.global_scale:
        pytest.skip(f"{fmt_name} has no global scale")
    rows, k, n = sum(ROUTINGS[0]), 128, len(ROUTINGS[0])
    x = torch.empty(rows, k, dtype=torch.bfloat16, device="cuda")
    counts = torch.zeros(n, dtype=torch.int32, device="cuda")
    offsets = torch.zeros(n, dtype=torch.int64, device="cuda")
    seeds = torch.tensor(SEEDS, dtype=torch.int64, device="cuda")

    def host_offsets(turn: int) -> list[int]:
        return [8 * (1000 * turn + 7 * g) + 4 for g in range(n)]

    def fill(turn: int) -> None:
        x.copy_(grouped_input("cuda", k, counts=ROUTINGS[turn]))
        counts.copy_(torch.tensor(ROUTINGS[turn]))
        offsets.copy_(torch.tensor(host_offsets(turn)))

    def launch():
        return quantize_groups_static(
            x, device_groups(counts, rows, 1), fmt, rounding=rounding, rht=rht_spec(rht),
            seeds=seeds, offsets=offsets, scope=scope,
        )  # fmt: skip

    with finite.propagating():
        bad = []
        for turn, routing, out in replayed(launch, fill):
            want = quantize_groups(
                x.cpu(), routing, fmt, rounding=rounding, rht=rht_spec(rht), seeds=SEEDS,
                offsets=host_offsets(turn), backend="reference", scope=scope,
            )  # fmt: skip
            for g, count in enumerate(routing):
                got = out.group(g, routing)
                if count == 0:
                    assert got is None
                    continue
                bad += _differences(got, want[g], f"routing {turn} group {g}")
    assert not bad, "\n".join(bad[:20])
