"""Grouped experts' fprop weight operands made before the routing is known
(``GroupedExperts._weights_ahead``, ``grouped.weights_ahead``).

The host waits for the routing's counts once per MoE layer forward, and that wait lets the GPU
finish everything queued before it while the host idles; the weights' copies do not depend on
the routing, so their launches are issued before it. On the CPU, with the kernels' definitions
standing in for them (as tests/test_moe_grouped_tile.py and test_moe_grouped_quantize.py run
the grouped path): the launches move before the wait and are not made again, the results are
the loop's bit for bit with and without it, and a step with an expert without tokens drops the
copies made ahead and makes its own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fp4gen.runtime.grouped as grouped
import fp4gen.runtime.grouped_quantize as gq
import fp4gen.runtime.grouped_tile as gt
from fp4gen.runtime import experts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_moe import routing, run  # noqa: E402
from test_moe_grouped import dequant_loop, pair  # noqa: E402,F401  (a fixture, used by name)
from test_moe_grouped_quantize import with_whole  # noqa: E402
from test_moe_grouped_tile import definition_standing_in  # noqa: E402

# 16x16 and 128x128 weights (the grouped tile kernel's rowwise copy; FP8 multiplies the codes)
# and 1x32 weights (the grouped rows quantize), the NVFP4 and MXFP8 fprop pairs decoded once for
# every expert
RECIPES = {
    "nvfp4_2d": "nvfp4_no_bf16",
    "mxfp8": "operands {\n * : mxfp8_e4m3\n}\n",
    "fp8_blockwise": "fp8_blockwise",
}


def _stand_ins(monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    """The grouped kernels by their definitions, each launch and each ``tolist`` (the routing's
    wait for its counts) recorded in ``events`` in the order they happen."""
    tile, _ = definition_standing_in(gt.reference_groups_tile)
    real_rows = gq.quantize_groups

    def tile_launch(rows, counts, pads, fmt, copies, **kw):
        events.append("tile " + "+".join(d for d, _, _ in copies))
        return tile(rows, counts, pads, fmt, copies, **kw)

    def rows_launch(rows, counts, fmt, **kw):
        events.append("rows")
        return with_whole(real_rows(rows, counts, fmt, **{**kw, "backend": "reference"}), rows)

    real_tolist = torch.Tensor.tolist

    def tolist(self):
        events.append("tolist")
        return real_tolist(self)

    monkeypatch.setattr(grouped, "_serves", lambda t: True)
    monkeypatch.setattr(grouped, "_grouped_quantize", [True])
    monkeypatch.setattr(grouped, "_grouped_tile_quantize", [True])
    monkeypatch.setattr(gt, "quantize_groups_tile", tile_launch)
    monkeypatch.setattr(gq, "quantize_groups", rows_launch)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)


def _forward_launches(events: list[str]) -> tuple[list[str], list[str]]:
    """The launches of the first forward before and after its routing's wait."""
    wait = events.index("tolist")
    before = [e for e in events[:wait] if e != "tolist"]
    return before, events[wait + 1 :]


@pytest.mark.parametrize("every", [True, False], ids=["every_routed", "one_empty"])
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_weights_made_ahead_are_the_same_launches_moved_before_the_wait(
    monkeypatch,
    dequant_loop,  # noqa: F811
    arch,
    recipe,
    every,
) -> None:
    loop, group = pair(arch, torch.bfloat16, RECIPES[recipe])
    # 40 tokens top-2 over 4 experts: 80 routed rows, at least AHEAD_ROWS_PER_EXPERT each
    assert experts.AHEAD_ROWS_PER_EXPERT * 4 <= 80
    index, weights = routing(40, empty=None if every else 1)
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    weights = weights.to(torch.bfloat16)
    got: dict[bool, tuple] = {}
    launches: dict[bool, list[str]] = {}
    for ahead in (False, True):  # two steps: the loop's step of the same call counts each
        want = run(loop, hidden, index, weights)
        events: list[str] = []
        with monkeypatch.context() as patch:
            _stand_ins(patch, events)
            previous = experts.set_weights_ahead(ahead)
            try:
                got[ahead] = run(group, hidden, index, weights)
            finally:
                experts.set_weights_ahead(previous)
        launches[ahead] = events
        # the loop's bits either way: output, dx, the routing weights' and every parameter's
        # gradient
        assert all(torch.equal(a, b) for a, b in zip(got[ahead][:3], want[:3], strict=True))
        assert all(torch.equal(got[ahead][3][n], want[3][n]) for n in want[3]), ahead
    weight_launch = "rows" if recipe == "mxfp8" else "tile rowwise"  # 1x32 or 2D weights
    before, _ = _forward_launches(launches[False])
    assert before == []  # made after the wait, in each projection's forward
    before, _ = _forward_launches(launches[True])
    assert before == [weight_launch] * 2  # both projections' fprop weights, ahead
    plain = [e for e in launches[False] if e != "tolist"]
    moved = [e for e in launches[True] if e != "tolist"]
    if every:
        # the same launches, none made twice
        assert sorted(moved) == sorted(plain)
    else:
        # an expert without tokens: the copies made ahead are dropped, the projections make
        # their own for the experts with tokens
        assert sorted(moved) == sorted([*plain, weight_launch, weight_launch])


def test_few_rows_per_expert_or_an_observer_make_nothing_ahead(monkeypatch) -> None:
    """Below AHEAD_ROWS_PER_EXPERT routed rows per expert (an expert without tokens likely), with
    an observer of the experts' operands, in raise mode, or switched off (the default until its
    GPU test and timing have run): nothing ahead."""
    from fp4gen.runtime import finite

    _, group = pair("mixtral", torch.bfloat16, RECIPES["mxfp8"])
    made: list[int] = []
    monkeypatch.setattr(experts, "weights_ahead", lambda *a: made.append(1) or None)
    monkeypatch.setattr(experts, "_weights_ahead_on", [False])
    group._weights_ahead(10**6)  # switched off
    assert made == []
    monkeypatch.setattr(experts, "_weights_ahead_on", [True])
    assert group._weights_ahead(4 * experts.AHEAD_ROWS_PER_EXPERT) == (None, None)
    assert len(made) == 2
    made.clear()
    assert group._weights_ahead(4 * experts.AHEAD_ROWS_PER_EXPERT - 1) == (None, None)
    group.observe = lambda *a: None
    try:
        group._weights_ahead(10**6)
    finally:
        group.observe = None
    mode = finite.layer_mode()
    finite.set_layer_mode("raise")
    try:
        group._weights_ahead(10**6)
    finally:
        finite.set_layer_mode(mode)
    assert made == []
