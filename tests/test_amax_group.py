"""Sequence-parallel inputs: ``fp4gen.nn.Linear``'s ``amax_group`` on 2 gloo ranks (CPU).

Each rank holds a slice of the tokens of one batch; with ``amax_group`` a layer quantizes the
chosen activation and gradient operands with the amax of the whole batch (one all-reduce MAX)
and rounds its activations and gradients with its own Philox stream (seed + rank * 2**20).

- Per operand: a rank's codes, block scale codes and global scale equal quantizing the
  concatenation of every rank's tensor with the rank's own part first (so that its elements
  keep their stochastic-rounding fields) and keeping its rows, for round-to-nearest and
  stochastic rounding; with round-to-nearest they equal the rank's rows (or token columns, for
  the wgrad copies) of the whole batch quantized in rank order.
- Training: ranks with a token slice each, weights replicated and gradients all-reduced (sum),
  equal one process running the whole batch (below, ``test_sequence_parallel_training...``).
- Stochastic rounding: ranks holding the same data round it differently; two runs with the same
  seed and world size give the same bits.
- Refusals (one process: the checks run before the group is read).

Ranks are spawned as in tests/test_distributed.py: a file store, collective timeouts, a
deadline after which the test kills the ranks and fails.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp4gen
from fp4gen.dsl.model import Operand
from fp4gen.errors import FP4GenError
from fp4gen.numerics import quantize
from fp4gen.runtime.convert import count_converted
from fp4gen.runtime.global_amax import DEFAULT_AMAX_OPERANDS, RANK_SEED_STRIDE
from fp4gen.runtime.linear import SLOT, STREAMS_PER_CALL

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_harness import spawn  # noqa: E402

WORLD = 2
TOKENS = 32  # per rank: a multiple of the 16-token blocks of the wgrad copies
IN, OUT = 64, 48
WIDTH = 64
STEPS = 3
DATA_OPERANDS = ("fprop.activation", "dgrad.gradient", "wgrad.gradient", "wgrad.activation")

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")


def recipe(rounding: str) -> Any:
    """NVFP4 without an RHT: 1x16 activations and gradients rounded ``rounding``, 16x16
    round-to-nearest weights."""
    return fp4gen.load_recipe(
        f'recipe sp "NVFP4, 1x16 activations and gradients rounded {rounding}"\n'
        "operands {\n"
        f"    *      : nvfp4 round {rounding}\n"
        "    weight : block 16x16 round nearest\n"
        "}\n"
    )


def capture(layer: fp4gen.nn.Linear) -> dict[Operand, Any]:
    """The layer's quantized operands of its first forward and backward call, by slot: every
    quantized operand passes through ``record`` (telemetry's hook), replaced here."""
    got: dict[Operand, Any] = {}

    def record(op: Operand, source: torch.Tensor, quantized: Any, call: int) -> None:
        got.setdefault(op, quantized)

    layer.record = record  # type: ignore[method-assign]
    return got


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


# --- 1: each operand against the concatenation --------------------------------------------------
def slices(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's x [TOKENS, IN] and dy [TOKENS, OUT]: x's amax lies on rank 1, dy's on rank 0, so
    every rank's local amax differs from the global one for one of them."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(TOKENS, IN, generator=g) * (8.0 if rank == 1 else 1.0)
    dy = torch.randn(TOKENS, OUT, generator=g) * (16.0 if rank == 0 else 1.0)
    return x, dy


def operands_job(rank: int, world: int) -> None:
    xs, dys = zip(*(slices(r) for r in range(world)), strict=True)
    # the tensor each operand quantizes, per rank: rowwise x and dy, columnwise x^T and dy^T
    parts = {
        Operand.FPROP_ACTIVATION: list(xs),
        Operand.DGRAD_GRADIENT: list(dys),
        Operand.WGRAD_GRADIENT: [d.t() for d in dys],
        Operand.WGRAD_ACTIVATION: [x.t() for x in xs],
    }
    for rounding in ("nearest", "stochastic8"):
        rec = recipe(rounding)
        torch.manual_seed(0)
        layer = fp4gen.nn.Linear(
            IN, OUT, recipe=rec, seed=7, amax_group=dist.group.WORLD, amax_operands=DATA_OPERANDS
        )
        got = capture(layer)
        x = xs[rank].clone().requires_grad_()
        layer(x).backward(dys[rank])
        assert layer.data_seed == 7 + rank * RANK_SEED_STRIDE
        for op, tensors in parts.items():
            spec = getattr(rec.operands, op.name.lower())
            q, mine = got[op], tensors[rank]
            rows = mine.shape[0]
            # the rank's part first: its elements keep their random fields (row * cols + col)
            first = torch.cat([mine, *(t for r, t in enumerate(tensors) if r != rank)])
            want = quantize(
                first,
                spec.format,
                rounding=spec.rounding,
                seed=layer.data_seed,
                offset=STREAMS_PER_CALL * 0 + SLOT[op],  # the first forward / backward call
            )
            what = f"{op.selector}, {rounding}, rank {rank}"
            assert torch.equal(q.codes, want.codes[:rows]), what
            assert torch.equal(q.scale_codes, want.scale_codes[:rows]), what
            assert torch.equal(q.global_scale, want.global_scale), what
            # the rank's own amax alone gives another global scale where it is not the max
            alone = quantize(mine, spec.format, rounding="nearest")
            holds_max = mine.abs().amax() == max(t.abs().amax() for t in tensors)
            assert torch.equal(alone.global_scale, q.global_scale) == bool(holds_max), what
            if rounding != "nearest":
                continue
            # the whole batch in rank order: its rows (rowwise) or token columns (wgrad copies)
            rowwise = op in (Operand.FPROP_ACTIVATION, Operand.DGRAD_GRADIENT)
            whole = quantize(torch.cat(tensors, dim=0 if rowwise else 1), spec.format)
            if rowwise:
                cut, scut = (slice(rank * rows, (rank + 1) * rows),), None
            else:
                cols = mine.shape[1]
                cut = (slice(None), slice(rank * cols, (rank + 1) * cols))
                scut = (slice(None), slice(rank * cols // 16, (rank + 1) * cols // 16))
            assert torch.equal(q.codes, whole.codes[cut]), what
            assert torch.equal(q.scale_codes, whole.scale_codes[scut or cut]), what
            assert torch.equal(q.global_scale, whole.global_scale), what


@pytest.mark.slow
def test_each_operand_is_its_rows_of_the_concatenation(tmp_path: Path) -> None:
    spawn(operands_job, WORLD, tmp_path)


# --- 2: sequence-parallel training against one process running the whole batch -----------------
def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(3)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, WIDTH))


def batch(step: int) -> torch.Tensor:
    """The whole batch of a step, [WORLD * TOKENS, WIDTH]; rank r holds rows r*TOKENS..."""
    g = torch.Generator().manual_seed(77 + step)
    return torch.randn(WORLD * TOKENS, WIDTH, generator=g)


def loss_of(y: torch.Tensor) -> torch.Tensor:
    # the whole batch's mean square, as a sum over this part: dy = 2 y / N on every rank
    return y.square().sum() / (WORLD * TOKENS * WIDTH)


def whole_batch_run(operands: tuple[str, ...] | None) -> dict[str, list]:
    """One process, the whole batch, no group; ``operands`` only says which ones compare."""
    model = fp4gen.convert(build_model(5), recipe("nearest"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, list] = {"y": [], "dx": [], "loss": [], "grads": []}
    for step in range(STEPS):
        opt.zero_grad()
        x = batch(step).requires_grad_()
        y = model(x)
        loss = loss_of(y)
        loss.backward()
        out["y"].append(y.detach().clone())
        out["dx"].append(x.grad.clone())
        out["loss"].append(loss.detach().clone())
        out["grads"].append([p.grad.clone() for p in model.parameters()])
        opt.step()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def training_job(rank: int, world: int, operands: tuple[str, ...] | None, out: str) -> None:
    model = fp4gen.convert(
        build_model(5), recipe("nearest"), amax_group=dist.group.WORLD, amax_operands=operands
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res: dict[str, list] = {"y": [], "dx": [], "loss": [], "grads": []}
    for step in range(STEPS):
        opt.zero_grad()
        x = batch(step)[rank * TOKENS : (rank + 1) * TOKENS].clone().requires_grad_()
        y = model(x)
        loss = loss_of(y)
        loss.backward()
        for p in model.parameters():  # replicated weights: the ranks' gradients summed
            dist.all_reduce(p.grad)
        res["y"].append(torch.cat(gather(y.detach())))
        res["dx"].append(torch.cat(gather(x.grad)))
        res["loss"].append(torch.stack(gather(loss.detach())).sum())
        res["grads"].append([p.grad.clone() for p in model.parameters()])
        opt.step()
    res["params"] = [p.detach().clone() for p in model.parameters()]
    if rank == 0:
        torch.save(res, out)


@pytest.mark.slow
@pytest.mark.parametrize("operands", [DATA_OPERANDS, None], ids=["all-data-operands", "default"])
def test_sequence_parallel_training_equals_the_whole_batch(
    operands: tuple[str, ...] | None, tmp_path: Path
) -> None:
    """Two ranks, 32 tokens each, against one process with the 64 tokens (round to nearest).

    Every reduced operand of a rank is its rows (tokens) of the whole batch's operand (test 1),
    and each GEMM output row (fprop, dgrad) depends on its own row only. So on the first step,
    where the weights are the same, the outputs y and input gradients dx equal the whole
    batch's bit for bit, whichever of the two operand sets is reduced.

    With all four data operands reduced (no RHT) the wgrad operands are the token columns of
    the whole batch's, 16-token blocks inside one rank, so each rank's dW is a partial sum of
    the whole batch's dW: the sum of the ranks' dW differs from it only in the order of the fp32
    additions (the partial products are rounded to fp32 before the all-reduce adds them), as
    does the loss (a sum of the ranks' sums). Hence rtol 1e-5 (a few ulps of fp32 sums of two
    terms, then the SGD update) on the losses, gradients, outputs and parameters of every step.

    With the default set (fprop.activation, dgrad.gradient) each rank quantizes its wgrad
    operands with its own amax, so dW is another quantization of the same product than the
    whole batch's: only the first step's y and dx (and loss, to summation order) compare."""
    out = tmp_path / "sp.pt"
    spawn(training_job, WORLD, tmp_path, operands, str(out))
    got = torch.load(out)
    want = whole_batch_run(operands)
    assert torch.equal(got["y"][0], want["y"][0])
    assert torch.equal(got["dx"][0], want["dx"][0])
    close = {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(got["loss"][0], want["loss"][0], **close)
    if operands is None:
        # the wgrad operands' local scales make dW differ from the whole batch's
        assert not all(
            torch.equal(g, w) for g, w in zip(got["grads"][0], want["grads"][0], strict=True)
        )
        return
    for step in range(STEPS):
        for key in ("y", "dx", "loss"):
            torch.testing.assert_close(got[key][step], want[key][step], **close)
        for i, (g, w) in enumerate(zip(got["grads"][step], want["grads"][step], strict=True)):
            torch.testing.assert_close(g, w, **close, msg=f"step {step}, parameter {i}")
    for g, w in zip(got["params"], want["params"], strict=True):
        torch.testing.assert_close(g, w, **close)


# --- 3: stochastic rounding streams per rank ------------------------------------------------------
def streams_job(rank: int, world: int, out: str) -> None:
    """Every rank quantizes the same x and dy (the default operand set, stochastic rounding)."""
    x, dy = slices(0)
    torch.manual_seed(0)
    layer = fp4gen.nn.Linear(IN, OUT, recipe=recipe("stochastic8"), seed=11)
    layer.set_amax_group(dist.group.WORLD)
    twin = copy.deepcopy(layer)  # an EMA or reference copy shares the group, not a copy of it
    assert twin.amax_group is layer.amax_group and twin.data_seed == layer.data_seed
    got = capture(layer)
    xg = x.clone().requires_grad_()
    y = layer(xg)
    y.backward(dy)
    ops = (Operand.FPROP_ACTIVATION, Operand.DGRAD_GRADIENT, Operand.WGRAD_GRADIENT)
    res = {
        "codes": {op.selector: gather(got[op].codes) for op in ops},
        "scales": {op.selector: gather(got[op].scale_codes) for op in ops},
        "weight": gather(got[Operand.FPROP_WEIGHT].codes),
        "y": gather(y.detach()),
        "dx": gather(xg.grad),
        "data_seed": gather(torch.tensor([layer.data_seed])),
    }
    if rank == 0:
        torch.save(res, out)


@pytest.mark.slow
def test_stochastic_rounding_differs_per_rank_and_repeats(tmp_path: Path) -> None:
    runs = []
    for run in range(2):  # two fresh sets of ranks
        out = tmp_path / f"streams-{run}.pt"
        spawn(streams_job, WORLD, tmp_path, str(out))
        runs.append(torch.load(out))
    first, second = runs
    for name, (rank0, rank1) in first["codes"].items():
        # the same values and scales, other random bits: many elements round the other way
        s0, s1 = first["scales"][name]
        assert torch.equal(s0, s1), name
        differ = (rank0 != rank1).float().mean().item()
        assert differ > 0.1, f"{name}: only {differ:.1%} of the codes differ between ranks"
    assert [int(s) for s in first["data_seed"]] == [11, 11 + RANK_SEED_STRIDE]
    w0, w1 = first["weight"]
    assert torch.equal(w0, w1)  # the replicated weight rounds to nearest, as one process
    assert not torch.equal(first["y"][0], first["y"][1])
    assert not torch.equal(first["dx"][0], first["dx"][1])
    # the same seed and world size: the same bits
    for key in ("y", "dx", "weight"):
        for a, b in zip(first[key], second[key], strict=True):
            assert torch.equal(a, b), key
    for name in first["codes"]:
        for a, b in zip(first["codes"][name], second["codes"][name], strict=True):
            assert torch.equal(a, b), name


# --- 4 and 5: refusals, and nothing changes without the option (one process) --------------------
NO_GROUP = object()  # the checks run before the group is read: no process group is needed


@pytest.mark.parametrize(
    ("operands", "message"),
    [
        (["wgrad.activation"], "wgrad.activation: it has a Hadamard transform"),
        (["wgrad.gradient"], "wgrad.gradient: it has a Hadamard transform"),
        (["fprop.weight"], "fprop.weight: it is a weight operand"),
        (["dgrad.weight"], "dgrad.weight: it is a weight operand"),
        (["fprop.actvation"], "unknown operand 'fprop.actvation'"),
    ],
)
def test_refused_operands_of_nvfp4(operands: list[str], message: str) -> None:
    with pytest.raises(FP4GenError, match=message):
        fp4gen.nn.Linear(
            IN,
            OUT,
            recipe=fp4gen.load_recipe("recipes/nvfp4.fp4r"),
            name="blk.0.fc",
            amax_group=NO_GROUP,
            amax_operands=operands,
        )


def test_refused_2d_blocks_and_formats_without_a_global_scale() -> None:
    table = recipe("nearest").operands
    fmt = table.fprop_activation.format
    tiled = replace(
        table, fprop_activation=replace(table.fprop_activation, format=fmt.with_block((16, 16)))
    )
    with pytest.raises(FP4GenError, match=r"fprop.activation: its 16x16 blocks span several"):
        fp4gen.nn.Linear(IN, OUT, operands=tiled, amax_group=NO_GROUP)
    mx = fp4gen.load_recipe("recipes/mxfp8.fp4r")
    with pytest.raises(FP4GenError, match="fprop.activation: its format .* has no per-tensor"):
        fp4gen.nn.Linear(IN, OUT, recipe=mx, amax_group=NO_GROUP)
    mor = fp4gen.load_recipe("recipes/mor_tensor.fp4r")
    with pytest.raises(FP4GenError, match="Mixture-of-Representations"):
        fp4gen.nn.Linear(IN, OUT, recipe=mor, amax_group=NO_GROUP)


def test_convert_refuses_before_replacing_any_layer() -> None:
    model = build_model(0)
    before = copy.deepcopy(model.state_dict())
    rht = fp4gen.load_recipe(
        'recipe rht "NVFP4 with an RHT on the wgrad operands"\n'
        "operands {\n    * : nvfp4 round nearest\n    weight : block 16x16\n"
        "    wgrad : rht 16 signs te\n}\n"
    )
    with pytest.raises(FP4GenError, match=r"0\.0: amax_group cannot reduce wgrad.gradient"):
        fp4gen.convert(model, rht, amax_group=NO_GROUP, amax_operands=DATA_OPERANDS)
    assert count_converted(model) == 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_without_a_group_nothing_changes() -> None:
    layer = fp4gen.nn.Linear(IN, OUT, recipe=recipe("stochastic8"), seed=3)
    assert layer.amax_group is None and layer.amax_operands == frozenset()
    assert layer.data_seed == 3
    assert DEFAULT_AMAX_OPERANDS == (Operand.FPROP_ACTIVATION, Operand.DGRAD_GRADIENT)
