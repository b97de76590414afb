"""Data-parallel training throughput under FSDP2: BF16 against recipes, at 1 and N ranks.

The model is the Llama-architecture causal LM of benchmarks/train.py (transformers'
LlamaForCausalLM from a config, no download; fp4gen's built-in GPT without transformers). Every
decoder block and the root are ``fully_shard``-ed with a bf16 mixed precision policy (bf16
parameters in the forward and backward, fp32 master weights and fp32 gradient reduction), AdamW,
``--tokens`` tokens per rank and step in sequences of ``--seq``. One process per rank
(torch.multiprocessing, spawn): rank r on cuda:r with NCCL, or on the CPU with gloo
(``--device cpu``, a smoke test at tiny sizes). For each world size (1 and ``--world``) and
recipe it prints:

- tokens/s over all ranks (the slowest rank's time for ``--steps`` steps after warm-up);
- the ratio to BF16's tokens/s at the same world size;
- the scaling efficiency: tokens/s at N ranks / (N x tokens/s at 1 rank), per recipe;
- the all-gather bytes one rank receives per step, from the parameters' sizes and the bf16
  parameter dtype: every block's parameters are gathered in the forward and again in the
  backward (resharded after the forward), the root's once; a rank holds 1/N of them already,
  so it receives (N-1)/N of the gathered bytes;
- the same figure if the weights of fp4gen's quantized Linears were gathered as codes and
  scales in their fprop weight format (NVFP4 16x16 tiles: 4 bits + one E4M3 scale per 256
  elements, 0.504 bytes instead of 2), as FSDP2's quantized weight all-gather moves them where
  it applies (docs/distributed.md): a projection from the sizes; the runs here gather bf16.

    python benchmarks/distributed.py [--world N] [--device cuda|cpu] [--hidden 1024]
                                     [--layers 8] [--tokens 8192] [--seq 1024] [--steps 10]
                                     [--recipes bf16,recipes/nvfp4_small.fp4r] [--model llama|gpt]

CPU smoke test (a few seconds per world size):

    python benchmarks/distributed.py --device cpu --world 2 --hidden 64 --layers 2 --seq 16 \\
        --tokens 32 --steps 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

import fp4gen  # noqa: E402
from benchmarks.train import VOCAB, build_model, loss_fn  # noqa: E402
from fp4gen.formats import BlockFormat  # noqa: E402

PARAM_DTYPE = torch.bfloat16
WARMUP = 5  # layer graphs capture in the first steps (warm-up, static, in place)
RANK_TIMEOUT_S = 600  # a collective waiting longer than this raises in the rank


@dataclass
class Result:
    world: int
    recipe: str
    tokens_per_s: float
    gather_bytes: float  # received per rank and step, bf16 parameters
    gather_bytes_quantized: float  # the same with quantized Linears' weights as codes+scales


def block_list(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks: the longest ModuleList (Llama's model.layers, the GPT's blocks)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len)


def shard(model: nn.Module, device: torch.device) -> list[tuple[nn.Module, int]]:
    """fully_shard every block and the root; [(unit, all-gathers per step)]."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPE, reduce_dtype=torch.float32)
    units: list[tuple[nn.Module, int]] = []
    for block in block_list(model):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        units.append((block, 2))  # gathered for the forward and again for the backward
    # the root's parameters (embedding, final norm, head) are needed again as soon as the
    # backward starts: kept gathered after the forward
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    units.append((model, 1))
    return units


def quantized_bytes_per_element(layer: fp4gen.nn.Linear) -> float:
    """Bytes per weight element as codes and scales in the layer's fprop weight format (the
    per-tensor global scale aside), or the bf16 size where that format is not block-scaled."""
    fmt = layer.operands.fprop_weight.format
    if not isinstance(fmt, BlockFormat):
        return PARAM_DTYPE.itemsize
    scale_bits = fmt.scale.element.bits if fmt.scale.element is not None else 32
    rows, cols = fmt.block
    return fmt.element.bits / 8 + scale_bits / 8 / (rows * cols)


def gather_bytes(units: list[tuple[nn.Module, int]], world: int) -> tuple[float, float]:
    """Bytes one rank receives from all-gathers per step: bf16, and with the quantized Linears'
    weights as codes and scales. Each unit gathers the parameters that no inner unit owns."""
    per_element = {
        id(m.weight): quantized_bytes_per_element(m)
        for m in units[-1][0].modules()
        if isinstance(m, fp4gen.nn.Linear)
    }
    seen: set[int] = set()
    bf16 = quantized = 0.0
    for unit, times in units:
        for p in unit.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = p.numel()  # a DTensor's numel is the whole parameter's
            bf16 += times * n * PARAM_DTYPE.itemsize
            quantized += times * n * per_element.get(id(p), PARAM_DTYPE.itemsize)
    received = (world - 1) / world
    return bf16 * received, quantized * received


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_recipe(args: argparse.Namespace, recipe: str, device: torch.device) -> Result:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    model = build_model(args.model, args.hidden, args.layers, args.seq, str(device))
    if recipe != "bf16":
        # --quantized-all-gather: FSDP2 gathers the exact layers' weights as codes and scales
        fp4gen.convert(
            model, fp4gen.load_recipe(recipe), fsdp_quantized_all_gather=args.quantized_all_gather
        )
    units = shard(model, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss = loss_fn(args.model)
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    batch = args.tokens // args.seq
    tokens = torch.randint(0, VOCAB, (batch, args.seq + (args.model == "gpt")), generator=g)
    tokens = tokens.to(device)

    def step() -> None:
        loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(WARMUP):
        step()
    sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank's does
    bf16, quantized = gather_bytes(units, world)
    tokens_per_s = world * batch * args.seq * args.steps / float(elapsed)
    return Result(world, recipe, tokens_per_s, bf16, quantized)


def rank_main(rank: int, world: int, args: argparse.Namespace, store: str, out: str) -> None:
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # one core per rank: N ranks use N cores, as N GPUs would be N devices (and a rank with
        # every core's threads would contend with the others)
        torch.set_num_threads(1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=RANK_TIMEOUT_S),
        device_id=device if device.type == "cuda" else None,  # NCCL: no guessing rank -> GPU
    )
    try:
        results = [run_recipe(args, recipe, device) for recipe in args.recipe_list]
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # no C++ destructors at exit: gloo's threads may abort an interpreter that is leaving
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_world(args: argparse.Namespace, world: int, tmp: Path) -> list[Result]:
    out = tmp / f"results-{world}.pt"
    mp.start_processes(
        rank_main,
        args=(world, args, str(tmp / f"store-{world}"), str(out)),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    return torch.load(out, weights_only=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=0, help="ranks (default: every GPU; CPU 2)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192, help="per rank and step")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--recipes", default="bf16,recipes/nvfp4_small.fp4r")
    parser.add_argument("--model", choices=["llama", "gpt"], default=None)
    parser.add_argument(
        "--quantized-all-gather",
        action="store_true",
        help="gather the recipes' exact weights as codes and scales (docs/distributed.md)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: run with --device cpu for the gloo smoke test")
        args.world = args.world or torch.cuda.device_count()
        if args.world > torch.cuda.device_count():
            raise SystemExit(f"--world {args.world}: only {torch.cuda.device_count()} GPUs")
    args.world = args.world or 2
    if args.tokens % args.seq:
        raise SystemExit(f"--tokens {args.tokens} is not a multiple of --seq {args.seq}")
    if args.model is None:
        try:
            import transformers  # noqa: F401

            args.model = "llama"
        except ImportError:
            args.model = "gpt"
    args.recipe_list = [r for r in args.recipes.split(",") if r]
    if "bf16" not in args.recipe_list:
        args.recipe_list.insert(0, "bf16")
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (gloo)"
    print(
        f"model {args.model}, hidden {args.hidden}, {args.layers} layers, {args.tokens} tokens "
        f"per rank and step (seq {args.seq}), AdamW, FSDP2 (bf16 parameters, fp32 reduce"
        f"{', quantized weight all-gather' if args.quantized_all_gather else ''}), {where}"
    )
    print(
        f"  {'ranks':>5} {'recipe':24} {'tokens/s':>11} {'x bf16':>7} {'scaling':>8} "
        f"{'all-gather MB/step':>18} {'if quantized MB':>15}"
    )
    worlds = sorted({1, args.world})
    single: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            t0 = time.perf_counter()
            results = run_world(args, world, Path(tmp))
            base = results[0].tokens_per_s  # bf16 runs first
            for res in results:
                single.setdefault(res.recipe, res.tokens_per_s)  # world 1 runs first
                scaling = res.tokens_per_s / (world * single[res.recipe])
                print(
                    f"  {world:>5} {Path(res.recipe).stem:24} {res.tokens_per_s:11.0f} "
                    f"{res.tokens_per_s / base:6.2f}x {scaling:7.0%} "
                    f"{res.gather_bytes / 1e6:18.3f} {res.gather_bytes_quantized / 1e6:15.3f}"
                )
            print(f"        ({time.perf_counter() - t0:.0f} s for {world} rank(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
