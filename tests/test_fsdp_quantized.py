"""FSDP2's quantized weight all-gather (fp4gen.runtime.fsdp), on the CPU with gloo ranks.

What is checked:

- exactness: every rank quantizes its shard with the amax of the whole weight, and the gathered
  codes, scale codes and global scale equal quantizing the gathered weight, bit for bit (2 and 4
  ranks, NVFP4 16x16, fp32 and bf16 parameters; the whole weight's amax on one rank only, and a
  last column block that is partial);
- training: FSDP2 with the quantized all-gather gives the same losses, gradients and parameters
  as with the high-precision all-gather, bit for bit (tolerance zero; also with activation
  checkpointing, at 2 ranks): the fprop and dgrad weight operands are the same bits either
  way, every other operand and GEMM is the same code on the same values, and the gradient
  reduce-scatter sums the same tensors in the same order;
- a NaN in one rank's shard makes every rank raise, as the layer does (none is left waiting);
- fallback: 1D weight blocks, and shards whose row count is not a multiple of 16, keep the
  high-precision all-gather (the same bytes and results as without the option) and say so once;
- bytes: the all-gather moves 0.5 bytes per element for the codes, one byte per 16x16 tile and
  4 bytes for the global scale, against 2 (bf16) or 4 (fp32) per element: measured on the
  collective FSDP2 calls (``torch.distributed.all_gather_single``).

Ranks are spawned as in tests/test_distributed.py: a file store, collective timeouts, a
deadline after which the test kills the ranks, and ranks that leave with ``os._exit`` (gloo's
threads can abort a process in its C++ destructors after the work is done).
"""

from __future__ import annotations

import copy
import itertools
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp4gen
from fp4gen.errors import TensorError
from fp4gen.numerics import pack, quantize
from fp4gen.runtime.fsdp import (
    GatheredWeight,
    ShardedWeight,
    _quantize_shard,
    enable_quantized_all_gather,
    plan_for,
)
from fp4gen.runtime.linear import Conv1DLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_harness import spawn  # noqa: E402

RECIPE = """recipe nearest_nvfp4 "NVFP4, 16x16 weight tiles, round-to-nearest"
operands {
    *      : nvfp4 round nearest
    weight : block 16x16
}
"""
RECIPE_1D = """recipe nearest_nvfp4_1d "NVFP4, 1x16 blocks everywhere, round-to-nearest"
operands {
    * : nvfp4 round nearest
}
"""
STEPS = 2
WIDTH = 64
TOKENS = 32

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")


class ByteCounter:
    """Counts what this rank sends through FSDP2's all-gathers (``dist.all_gather_single``,
    which FSDP2 looks up on every call) and the amax all-reduces."""

    def __init__(self) -> None:
        self.gathered = 0
        self.reduced = 0
        # FSDP2 calls all_gather_single where torch has it, all_gather_into_tensor before
        self._name = "all_gather_single"
        if not hasattr(dist, self._name):
            self._name = "all_gather_into_tensor"
        self._gather, self._reduce = getattr(dist, self._name), dist.all_reduce

    def __enter__(self) -> ByteCounter:
        def gather(output: torch.Tensor, input: torch.Tensor, *a: Any, **k: Any) -> Any:
            self.gathered += input.numel() * input.element_size()
            return self._gather(output, input, *a, **k)

        def reduce(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            self.reduced += tensor.numel() * tensor.element_size()
            return self._reduce(tensor, *a, **k)

        setattr(dist, self._name, gather)
        dist.all_reduce = reduce  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        setattr(dist, self._name, self._gather)
        dist.all_reduce = self._reduce  # type: ignore[assignment]


def policy(param_dtype: torch.dtype | None) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def mesh(world: int, device_type: str = "cpu") -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world,))


def nvfp4_16x16() -> Any:
    return fp4gen.load_recipe(RECIPE).operands.fprop_weight.format


def weight_for(rows: int, cols: int, world: int, seed: int) -> torch.Tensor:
    """A weight whose amax lies in the last rank's shard only (so no other rank could find the
    global scale from its own shard)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w[rows - rows // world :] *= 30.0
    return w


# --- one process: the shard quantizer, the plans, the parameter ----------------------------------
@pytest.mark.parametrize(("rows", "cols", "world"), [(64, 80, 2), (128, 72, 4), (32, 33, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shard_with_the_global_amax_is_the_whole_weights_rows(
    rows: int, cols: int, world: int, dtype: torch.dtype
) -> None:
    fmt = nvfp4_16x16()
    spec = fp4gen.load_recipe(RECIPE).operands.fprop_weight
    w = weight_for(rows, cols, world, seed=rows + cols).to(dtype)
    full = quantize(w, fmt, rounding="nearest")
    amax = w.abs().amax().float()
    per = rows // world
    for rank in range(world):
        shard = w[rank * per : (rank + 1) * per]
        got = _quantize_shard(shard, spec, amax, "reference")
        assert torch.equal(got.codes, full.codes[rank * per : (rank + 1) * per])
        assert torch.equal(got.data, pack(full.codes[rank * per : (rank + 1) * per], 4))
        tiles = slice(rank * per // 16, (rank + 1) * per // 16)
        assert got.scale_codes is not None and full.scale_codes is not None
        assert torch.equal(got.scale_codes, full.scale_codes[tiles])
        assert torch.equal(got.scales, full.scales[tiles])
        assert torch.equal(got.global_scale, full.global_scale)
    # the first shard alone has another global scale: the global amax is what makes it exact
    alone = quantize(w[:per], fmt, rounding="nearest")
    assert not torch.equal(alone.global_scale, full.global_scale)


def recipe_with(weight_line: str) -> Any:
    return fp4gen.load_recipe(
        f'recipe r "r"\noperands {{\n    * : nvfp4 round nearest\n{weight_line}\n}}\n'
    )


@pytest.mark.parametrize(
    ("weight_line", "reason"),
    [
        ("    weight : block 16x16", ""),
        ("", "has no 2D blocks"),
        ("    weight : block 16x16 round stochastic", "rounds stochastic, not nearest"),
        ("    fprop.weight : block 16x16", "the fprop and dgrad weight specs differ"),
        ("    weight : bf16", "(bf16) has no 2D blocks"),
    ],
)
def test_plan_says_where_the_gather_is_exact(weight_line: str, reason: str) -> None:
    layer = fp4gen.nn.Linear(32, 32, recipe=recipe_with(weight_line), name="blk.fc")
    plan = plan_for(layer)
    assert (plan.spec is None) == bool(reason)
    assert reason in plan.reason
    if reason:
        assert plan.reason.startswith("blk.fc: ")
    else:
        assert plan.spec == layer.operands.fprop_weight


def test_a_conv1d_layer_keeps_the_high_precision_gather() -> None:
    """A transformers Conv1D's weight is [in, out]: its shards are not the fprop operand's."""

    class Conv1D(nn.Module):  # the parameters of transformers' Conv1D
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(32, 48))
            self.bias = nn.Parameter(torch.zeros(48))

    layer = Conv1DLinear.from_conv1d(
        Conv1D(), recipe=fp4gen.load_recipe(RECIPE), name="h.0.mlp.c_fc"
    )
    plan = plan_for(layer)
    assert plan.spec is None and plan.reason == "h.0.mlp.c_fc: a Conv1DLinear (only Linear)"


def test_sharded_weight_is_the_weight_in_one_process() -> None:
    """Without FSDP2 the option changes nothing: the same outputs, gradients and state dict."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32))
    fp4gen.convert(model, fp4gen.load_recipe(RECIPE))
    plain = copy.deepcopy(model)
    plans = enable_quantized_all_gather(model)
    assert [p.spec is not None for p in plans] == [True, True]
    assert isinstance(model[0].weight, ShardedWeight)
    assert isinstance(model[0].weight, nn.Parameter)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    y, y_plain = model(x), plain(x)
    assert torch.equal(y, y_plain)
    y.square().mean().backward()
    y_plain.square().mean().backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad)
    state = model.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values())  # loads with weights_only
    for (k, v), (k2, v2) in zip(state.items(), plain.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2)
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    torch.optim.SGD(plain.parameters(), lr=0.5).step()
    assert isinstance(model[0].weight, ShardedWeight)
    assert torch.equal(model[0].weight._inner, plain[0].weight)


# --- several ranks -------------------------------------------------------------------------------
def gather_checks(rank: int, world: int) -> dict[str, tuple[int, int]]:
    """Unshard one sharded layer and compare the gathered operand with quantizing the whole
    weight; count the bytes of the all-gather, quantized and in high precision."""
    from torch.distributed.fsdp import fully_shard

    rows, cols = 32 * world, 72  # 32 rows per rank; the last column block is 8 wide
    fmt = nvfp4_16x16()
    report: dict[str, Any] = {}
    for dtype, quantized in itertools.product((None, torch.bfloat16), (True, False)):
        w = weight_for(rows, cols, world, seed=world)
        layer = fp4gen.nn.Linear(cols, rows, bias=False, recipe=fp4gen.load_recipe(RECIPE))
        with torch.no_grad():
            layer.weight.copy_(w)
        if quantized:
            enable_quantized_all_gather(layer)
        fully_shard(layer, mesh=mesh(world), mp_policy=policy(dtype))
        with ByteCounter() as counted:
            layer.unshard()
        key = f"{'bf16' if dtype else 'fp32'}-{'quantized' if quantized else 'plain'}"
        report[key] = (counted.gathered, counted.reduced)
        gathered = layer.weight
        if not quantized:
            assert type(gathered) is not GatheredWeight
            layer.reshard()
            continue
        assert isinstance(gathered, GatheredWeight)
        assert gathered.shape == (rows, cols) and gathered.dtype == (dtype or torch.float32)
        got = gathered.quantized_weight()
        want = quantize(w.to(dtype or torch.float32), fmt, rounding="nearest")
        assert torch.equal(got.data, pack(want.codes, 4))
        assert torch.equal(got.codes, want.codes)
        assert got.scale_codes is not None and want.scale_codes is not None
        assert torch.equal(got.scale_codes, want.scale_codes)
        assert torch.equal(got.scales, want.scales)
        assert torch.equal(got.global_scale, want.global_scale)
        scales = gathered._parts[0].global_scales  # one per rank, gathered with the codes
        assert torch.equal(scales, want.global_scale.expand(world))
        # dgrad's operand: the transpose of the gathered codes and tile scales
        assert torch.equal(got.transpose().codes, want.transpose().codes)
        assert torch.equal(got.transpose().scale_codes, want.transpose().scale_codes)
        layer.reshard()
        # a second gather (into the same buffers) after every shard changed, the amax moved to
        # rank 0: the new weight's operand, global scale included
        w2 = w + weight_for(rows, cols, 1, seed=world + 1)
        w2[0, 0] = 1000.0
        per = rows // world
        with torch.no_grad():
            layer.weight._local_tensor.copy_(w2[rank * per : (rank + 1) * per])
        layer.unshard()
        again = layer.weight.quantized_weight()
        want2 = quantize(w2.to(dtype or torch.float32), fmt, rounding="nearest")
        assert torch.equal(again.codes, want2.codes)
        assert torch.equal(again.scale_codes, want2.scale_codes)
        assert torch.equal(again.global_scale, want2.global_scale)
        assert not torch.equal(again.global_scale, want.global_scale)
        layer.reshard()
        # a NaN in one rank's shard: every rank raises as the layer would (no rank left waiting)
        with torch.no_grad():
            if rank == world - 1:
                layer.weight._local_tensor[1, 2] = float("nan")
        with pytest.raises(TensorError, match="non-finite"):
            layer.unshard()
    return report


# One spawn per world size serves all the multi-rank tests (start-up is most of a short run's
# time): (parameter dtypes trained, whether the fallback cases run).
WORLD_CASES = {2: ((None, torch.bfloat16), True), 4: ((torch.bfloat16,), False)}


@pytest.fixture(scope="module")
def ranks_ran(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict[Any, Any]]:
    """world -> what ``world_job`` saved, run on first use."""
    done: dict[int, dict[Any, Any]] = {}

    def get(world: int) -> dict[Any, Any]:
        if world not in done:
            tmp = tmp_path_factory.mktemp(f"world{world}")
            spawn(world_job, world, tmp, str(tmp / "out.pt"), *WORLD_CASES[world])
            done[world] = torch.load(tmp / "out.pt", weights_only=False)
        return done[world]

    return get


@pytest.mark.parametrize("world", [2, 4])
def test_quantized_all_gather_equals_gather_then_quantize(
    world: int, ranks_ran: Callable[[int], dict[Any, Any]]
) -> None:
    """The comparisons run in every rank (``gather_checks``); here the bytes they counted."""
    report = ranks_ran(world)["gather"]
    rows, cols = 32 * world, 72
    per = rows // world * cols  # elements per rank
    quantized = per // 2 + (rows // world // 16) * -(-cols // 16) + 4  # codes, tiles, S_dec
    assert report["fp32-plain"] == (per * 4, 0)
    assert report["bf16-plain"] == (per * 2, 0)
    # the amax all-reduce: one fp32 pair (the amax and a non-finite flag)
    assert report["fp32-quantized"] == (quantized, 8)
    assert report["bf16-quantized"] == (quantized, 8)
    assert per * 2 / quantized > 3.9  # bf16 -> NVFP4 16x16: about 3.97x fewer bytes
    assert per * 4 / quantized > 7.8


def build_model(seed: int, quantized: bool, recipe: str = RECIPE, rows: int = WIDTH) -> nn.Module:
    """Three blocks (Linear + ReLU) and a head, all four converted (the head is a numbered
    child of the model too); every weight has ``rows`` rows (which sets the shard sizes)."""
    torch.manual_seed(seed)
    sizes = [(WIDTH, rows), (rows, rows), (rows, rows)]
    blocks = [nn.Sequential(nn.Linear(i, o), nn.ReLU()) for i, o in sizes]
    model = nn.Sequential(*blocks, nn.Linear(rows, rows))
    fp4gen.convert(model, fp4gen.load_recipe(recipe), fsdp_quantized_all_gather=quantized)
    return model


def train(
    rank: int,
    world: int,
    model: nn.Module,
    dtype: torch.dtype | None,
    ckpt: bool = False,
    device: torch.device | None = None,
) -> tuple[dict[str, list], ByteCounter, list[type]]:
    """STEPS of FSDP2 training (each block and the root sharded; with ``ckpt`` each block's
    activations recomputed in the backward), this rank's micro-batch per step: the losses of
    all ranks, the full gradients and parameters (on the CPU), the bytes and the weight types
    the converted layers were called with. ``device``: where the model trains (the CPU, or
    the rank's GPU under NCCL)."""
    device = device or torch.device("cpu")
    model.to(device)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    seen: list[type] = []
    for module in model.modules():
        if isinstance(module, fp4gen.nn.Linear):
            module.register_forward_pre_hook(lambda m, _: seen.append(type(m.weight)))
    for i, block in enumerate(list(model)[:-1]):
        if ckpt:
            block = model[i] = checkpoint_wrapper(block)
        fully_shard(block, mesh=mesh(world, device.type), mp_policy=policy(dtype))
    fully_shard(model, mesh=mesh(world, device.type), mp_policy=policy(dtype))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    res: dict[str, list] = {"loss": [], "grads": [], "params": []}
    with ByteCounter() as counted:
        for step in range(STEPS):
            opt.zero_grad()
            g = torch.Generator().manual_seed(step * 101 + rank)
            x = torch.randn(TOKENS, WIDTH, generator=g).to(device)
            loss = model(x).float().square().mean()
            loss.backward()
            losses = [torch.zeros(1, device=device) for _ in range(world)]
            dist.all_gather(losses, loss.detach().reshape(1))
            res["loss"].append(torch.cat(losses).cpu())
            res["grads"].append([p.grad.full_tensor().cpu() for p in model.parameters()])
            opt.step()
    res["params"] = [p.detach().full_tensor().cpu() for p in model.parameters()]
    # the state dict holds plain shards with the option too: checkpoints do not change
    assert all(type(v._local_tensor) is torch.Tensor for v in model.state_dict().values())
    return res, counted, seen


def assert_identical(a: dict[str, list], b: dict[str, list]) -> None:
    for step in range(STEPS):
        assert torch.equal(a["loss"][step], b["loss"][step]), step
        for i, (g, h) in enumerate(zip(a["grads"][step], b["grads"][step], strict=True)):
            assert torch.equal(g, h), (step, i)
    for p, q in zip(a["params"], b["params"], strict=True):
        assert torch.equal(p, q)


def world_job(rank: int, world: int, out: str, dtypes: tuple, fallbacks: bool) -> None:
    """Everything the multi-rank tests check at one world size: ``gather_checks``, then each
    parameter dtype's training with and without the quantized all-gather, and with
    ``fallbacks`` the two fallback cases (``fallback_runs``). Rank 0 saves the results."""
    results: dict[Any, Any] = {"gather": gather_checks(rank, world)}
    for dtype, quantized in itertools.product(dtypes, (False, True)):
        res, counted, seen = train(rank, world, build_model(3, quantized), dtype)
        results[(dtype, quantized)] = (res, counted.gathered, seen)
    if fallbacks:
        results["fallback"] = fallback_runs(rank, world)
        # activation checkpointing: the recomputed forwards read the regathered codes
        res, _, seen = train(rank, world, build_model(3, True), torch.bfloat16, ckpt=True)
        results["ckpt"] = (res, seen)
    if rank == 0:
        torch.save(results, out)


def runtime_messages() -> list[str]:
    """A list that every later fp4gen.runtime log line (INFO and up) of this rank is added to."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("fp4gen.runtime")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    return messages


def fallback_runs(rank: int, world: int) -> dict[str, list[str]]:
    """1D weight blocks (RECIPE_1D), and 16x16 tiles with 48 and 47 rows on 2 ranks (24 rows
    per rank, and an uneven split FSDP2 pads): the high-precision all-gather, the same results
    and bytes as without the option; the log lines of each."""
    messages = runtime_messages()
    report = {}
    cases = (("1d", RECIPE_1D, WIDTH), ("rows", RECIPE, 48), ("uneven", RECIPE, 47))
    for name, recipe, rows in cases:
        plain, plain_counted, _ = train(rank, world, build_model(5, False, recipe, rows), None)
        start = len(messages)
        quant, quant_counted, seen = train(rank, world, build_model(5, True, recipe, rows), None)
        assert_identical(plain, quant)
        assert quant_counted.gathered == plain_counted.gathered
        assert GatheredWeight not in seen and len(seen) == 4 * STEPS
        report[name] = messages[start:]
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_training_with_the_quantized_all_gather_is_bit_identical(
    world: int, ranks_ran: Callable[[int], dict[Any, Any]]
) -> None:
    """fp32 parameters (2 ranks), and bf16 parameters with fp32 gradient reduction (2 and 4
    ranks; at 2 also with activation checkpointing): tolerance zero (module docstring)."""
    results = ranks_ran(world)
    for dtype in WORLD_CASES[world][0]:
        plain, plain_bytes, plain_seen = results[(dtype, False)]
        quant, quant_bytes, quant_seen = results[(dtype, True)]
        assert_identical(plain, quant)
        assert plain["loss"][0].unique().numel() == world  # the ranks' batches differ
        # every converted layer read the gathered codes
        assert len(quant_seen) == 4 * STEPS and set(quant_seen) == {GatheredWeight}
        assert GatheredWeight not in plain_seen
        # the weights are most of the bytes (the biases are gathered in high precision)
        assert plain_bytes / quant_bytes > 2.5
    if "ckpt" in results:
        ckpt, seen = results["ckpt"]
        assert_identical(results[(torch.bfloat16, False)][0], ckpt)
        assert len(seen) == (3 * 2 + 1) * STEPS and set(seen) == {GatheredWeight}


def test_fallbacks_gather_in_high_precision_and_say_so_once(
    ranks_ran: Callable[[int], dict[Any, Any]],
) -> None:
    report = ranks_ran(2)["fallback"]
    prefix = "FSDP2 all-gathers a weight in high precision: "
    # one line per layer over STEPS steps of gathers (forward and backward), the root's first
    assert sorted(report["1d"]) == [
        f"{prefix}{name}: the weight's format (nvfp4 1x16) has no 2D blocks"
        for name in ("0.0", "1.0", "2.0", "3")
    ]
    for case, rows in (("rows", 48), ("uneven", 47)):
        # 47 rows is also a width the quantize kernels do not take: convert says that first
        widths = [m for m in report[case] if m.startswith("fp4gen.convert: ")]
        assert len(widths) == (2 if rows == 47 else 0)
        gathers = [m for m in report[case] if not m.startswith("fp4gen.convert: ")]
        assert sorted(gathers) == [
            f"{prefix}{name}: {rows} rows on 2 ranks is not a multiple of the 16-row block per "
            "rank, so blocks would straddle shards"
            for name in ("0.0", "1.0", "2.0", "3")
        ]


def nccl_job(rank: int, world: int, device: torch.device, out: str) -> None:
    """The training comparison of ``world_job`` on the ranks' GPUs: bf16 parameters, the
    shards quantized by the CUDA kernels, the codes gathered by NCCL."""
    results: dict[Any, Any] = {}
    for quantized in (False, True):
        res, counted, seen = train(
            rank, world, build_model(3, quantized), torch.bfloat16, device=device
        )
        results[quantized] = (res, counted.gathered, seen)
    if rank == 0:
        torch.save(results, out)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (dist.is_nccl_available() and torch.cuda.device_count() >= 2), reason="needs 2 GPUs"
)
def test_quantized_all_gather_on_nccl_is_bit_identical(tmp_path: Path) -> None:
    """On 2 GPUs (NCCL): training with the quantized all-gather gives the bits of training
    with the bf16 all-gather (tolerance zero, as on gloo): the CUDA quantize kernels are
    bit-exact with the reference, and each rank's shard is quantized with the global amax."""
    out = tmp_path / "out.pt"
    spawn(nccl_job, 2, tmp_path, str(out), backend="nccl", with_device=True)
    results = torch.load(out, weights_only=False)
    plain, plain_bytes, plain_seen = results[False]
    quant, quant_bytes, quant_seen = results[True]
    assert_identical(plain, quant)
    assert plain["loss"][0].unique().numel() == 2  # the ranks' batches differ
    assert len(quant_seen) == 4 * STEPS and set(quant_seen) == {GatheredWeight}
    assert GatheredWeight not in plain_seen
    assert plain_bytes / quant_bytes > 2.5


def one_rank_job(rank: int, world: int, out: str) -> None:
    """FSDP2 on a single rank, with and without the quantized all-gather."""
    messages = runtime_messages()
    plain, _, _ = train(rank, world, build_model(3, False), torch.bfloat16)
    quant, _, seen = train(rank, world, build_model(3, True), torch.bfloat16)
    torch.save({"plain": plain, "quant": quant, "seen": seen, "messages": messages}, out)


def test_one_rank_gathers_in_high_precision(tmp_path: Path) -> None:
    """On one rank FSDP2 skips the all-gather and passes on only the first of an extension's
    inputs: the quantized all-gather steps aside there (the layer quantizes the whole weight
    itself), trains the same bits and says so once per layer."""
    out = tmp_path / "out.pt"
    spawn(one_rank_job, 1, tmp_path, str(out))
    got = torch.load(out, weights_only=False)
    assert_identical(got["plain"], got["quant"])
    assert GatheredWeight not in got["seen"]
    prefix = "FSDP2 all-gathers a weight in high precision: "
    assert sorted(m for m in got["messages"] if m.startswith(prefix)) == [
        f"{prefix}{name}: one rank, nothing to gather" for name in ("0.0", "1.0", "2.0", "3")
    ]
