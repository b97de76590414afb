"""The host cost of a grouped MoE layer's fwd+bwd, measured on a CPU with the GPU stood in for.

What one forward + backward of a converted Qwen3-MoE sparse block costs the host, on any
machine (no GPU needed).

On an H200 the grouped experts are bound by their host (docs/moe.md, "Measured on an idle
H200"): the GPU's work of a Qwen3-MoE step is 1.25x BF16's for ``nvfp4_small``, its wall time
1.85x. This runs the same Python on the CPU with CUDA stood in for where the path asks for it:
the kernels' arch is sm_90a, the generated quantize kernels (grouped rowwise and tile) and the
grouped FP8 GEMM build every argument and table as on a GPU but launch nothing, the decodes
return zeros of their shape, ``torch._grouped_mm`` an empty result of its shape, and the input
is not scanned for non-finite values (on a GPU: one launch). What it prints is host work alone:

- ms per fwd+bwd on this CPU (torch's CPU ops that stand for launches still compute here, on
  small tensors at the default sizes: compare before and after a change on one machine);
- the calls one fwd+bwd makes, Python's and the C functions cProfile sees (a count: the same
  on any host for one torch version);
- the aten ops one fwd+bwd issues (a ``TorchDispatchMode``): all, and those that would launch
  GPU work (neither views nor allocations: some 5-10 us of host time each on the GPU machine);
- the stood-in kernel launches, and with ``--profile N`` the N functions with the most own time
  (cProfile).

The numbers of ops and launches grow with the experts where the path does per-expert work; the
goal is a host path whose cost does not. ``benchmarks/moe.py`` times the real path on a GPU.

    python benchmarks/moe_host.py [--experts 64] [--topk 8] [--tokens 2048] [--hidden 256]
                                  [--inner 128] [--recipes nvfp4_small,fp8_blockwise]
                                  [--steps 5] [--profile 25] [--ops 12]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import pstats
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

import fp4gen  # noqa: E402
from benchmarks.host_keys import OpCount, _Launches  # noqa: E402


class _Loaded:
    """A loaded quantize kernel whose module takes CPU inputs (its ``check_input`` stood in:
    everything else, its parameters and constants, is the generated module's own)."""

    def __init__(self, loaded: Any) -> None:
        self._loaded = loaded
        self.module = _Module(loaded.module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loaded, name)


class _Module:
    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def check_input(self, x: torch.Tensor) -> None:
        return None


class _OnCuda:
    """A CPU tensor that says it is on CUDA, for the kernels' input checks (every other check
    is theirs: a K the kernels refuse is refused here too)."""

    is_cuda = True

    def __init__(self, x: torch.Tensor) -> None:
        self._x = x

    def __getattr__(self, name: str) -> Any:
        return getattr(self._x, name)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: Any = None, **kw: Any) -> torch.Tensor:
    """``torch._grouped_mm``'s stand-in: an empty result of its shape and dtype."""
    if b.dim() == 3:  # [M, K] x [G, K, N] -> [M, N]
        return torch.empty((a.shape[0], b.shape[2]), dtype=a.dtype)
    return torch.empty((offs.shape[0], a.shape[0], b.shape[1]), dtype=a.dtype)  # grouped K


@contextlib.contextmanager
def stand_ins(launches: _Launches) -> Iterator[None]:
    """CUDA stood in for under the grouped experts' path while the block runs (module
    docstring); everything is put back after."""
    import fp4gen.compiler.jit as jit
    import fp4gen.runtime.cute_backend as cute_backend
    import fp4gen.runtime.fp8_grouped as fp8_grouped
    import fp4gen.runtime.fp8_kgrouped as fp8_kgrouped
    import fp4gen.runtime.grouped as grouped
    import fp4gen.runtime.grouped_quantize as grouped_quantize
    import fp4gen.runtime.grouped_tile as grouped_tile

    fns = {"amax": launches, "quantize": launches}
    real_kernels = cute_backend._kernels
    tile_reason, rows_reason = grouped_tile._kernel_reason, grouped_quantize._kernel_reason

    def kernels(spec: Any) -> Any:
        got = real_kernels(spec)
        return _Loaded(got) if hasattr(got, "module") else got

    def values(q: Any) -> torch.Tensor:
        return torch.zeros((q.rows, q.cols), dtype=torch.bfloat16)

    def grouped_fp8(a: Any, b: Any, **kw: Any) -> torch.Tensor:
        _, args = fp8_grouped.grouped_launch(a, b, **kw)  # every argument, as on a GPU
        launches()
        return args[7]

    def k_grouped_fp8(a: Any, b: Any, **kw: Any) -> torch.Tensor:
        _, args = fp8_kgrouped.k_grouped_launch(a, b, **kw)  # every argument, as on a GPU
        launches()
        return args[7].view(len(a), -1, args[7].shape[1])

    def dense_fp8(a: Any, b: Any, out_dtype: torch.dtype, bias: Any) -> torch.Tensor:
        launches()
        return torch.zeros((a.rows, b.rows), dtype=out_dtype)

    with contextlib.ExitStack() as stack:
        for target, name, new in [
            (jit, "detect_arch", lambda *a, **k: "sm_90a"),
            (cute_backend, "_kernels", kernels),
            (grouped_tile, "_compile", lambda *a, **k: fns),
            (grouped_quantize, "_compile", lambda *a, **k: fns),
            (grouped_tile, "_kernel_reason", lambda x, *a: tile_reason(_OnCuda(x), *a)),
            (grouped_quantize, "_kernel_reason", lambda x, *a: rows_reason(_OnCuda(x), *a)),
            (grouped, "_serves", lambda t: grouped._grouped_quantize[0]),
            (grouped, "_values", values),
            (grouped, "_dense_fp8", dense_fp8),
            (fp8_grouped, "grouped_block_scaled", grouped_fp8),
            (fp8_kgrouped, "k_grouped_block_scaled", k_grouped_fp8),
            (torch, "_grouped_mm", _grouped_mm),
        ]:
            stack.enter_context(mock.patch.object(target, name, new))
        stack.enter_context(mock.patch("fp4gen.runtime.finite.propagates", lambda: True))
        stack.enter_context(mock.patch("fp4gen.runtime.grouped.fp8_grouped_reason", _no_reason))
        yield


def _no_reason(*args: Any, **kwargs: Any) -> None:
    return None


def build(args: argparse.Namespace, recipe: str) -> nn.Module:
    """A Qwen3-MoE sparse block in bf16 at the given sizes, converted by ``recipe``, its experts
    grouped."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.inner,
        intermediate_size=4 * args.inner,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=args.hidden // 2,
    )
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg).to(torch.bfloat16)
    with torch.no_grad():  # a bare block is not initialized by transformers
        for param in block.parameters():
            param.normal_(0.0, 0.02)
    fp4gen.convert(block, recipe)
    return block


def measure(args: argparse.Namespace, recipe: str) -> dict[str, Any]:
    """One recipe's row: ms per fwd+bwd, aten ops (all, launching), stood-in launches, and
    whether every experts module ran grouped."""
    from fp4gen.runtime.experts import GroupedExperts

    block = build(args, recipe)
    experts = [m for m in block.modules() if isinstance(m, GroupedExperts)]
    for module in experts:  # on a CPU tensor the default (None) would run the per-expert loop
        module.grouped = True
    x = torch.randn(1, args.tokens, args.hidden, dtype=torch.bfloat16)
    dy = torch.randn_like(x)

    def step() -> None:
        inp = x.detach().requires_grad_()
        out = block(inp)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dy)

    launches = _Launches()
    with stand_ins(launches):
        reasons = {e.loop_reason(e.operands, torch.device("cuda")) for e in experts}
        for _ in range(2):  # warm-up: kernels loaded, tables cached
            step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        launches.count = 0
        with OpCount() as counted:
            step()
        calls = cProfile.Profile()  # Python calls (and C calls cProfile sees) of one fwd+bwd
        calls.enable()
        step()
        calls.disable()
        row = {
            "recipe": recipe,
            "calls": pstats.Stats(calls).total_calls,
            "ms": ms,
            "ops": len(counted.ops),
            "launching": len(counted.launching),
            "kernels": launches.count,
            "grouped": reasons == {None},
            "by_op": collections.Counter(counted.ops),
        }
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            step()
            profiler.disable()
            row["profile"] = profiler
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64, help="experts of the layer")
    parser.add_argument("--topk", type=int, default=8, help="experts per token")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256, help="the model's width")
    parser.add_argument("--inner", type=int, default=128, help="each expert's intermediate size")
    parser.add_argument("--recipes", default="nvfp4_small,fp8_blockwise", help="comma-separated")
    parser.add_argument("--steps", type=int, default=5, help="timed fwd+bwd per recipe")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="the N functions with most own time"
    )
    parser.add_argument(
        "--ops", type=int, default=0, metavar="N", help="the N aten ops issued most often"
    )
    args = parser.parse_args(argv)
    print(
        f"MoE layer host path (CPU, GPU work stood in): hidden {args.hidden}, inner "
        f"{args.inner}, {args.experts} experts, top-{args.topk}, {args.tokens} tokens"
    )
    print(
        f"  {'recipe':20} {'ms':>8} {'calls':>7} {'aten ops':>9} {'launching':>10} "
        f"{'kernels':>8}  path"
    )
    for recipe in [r for r in args.recipes.split(",") if r]:
        row = measure(args, recipe)
        path = "grouped" if row["grouped"] else "per expert"
        print(
            f"  {recipe:20} {row['ms']:8.2f} {row['calls']:7d} {row['ops']:9d} "
            f"{row['launching']:10d} "
            f"{row['kernels']:8d}  {path}",
            flush=True,
        )
        if args.ops:
            most = ", ".join(f"{op} x{n}" for op, n in row["by_op"].most_common(args.ops))
            print(f"      most issued: {most}")
        if "profile" in row:
            stats = pstats.Stats(row["profile"], stream=sys.stdout)
            stats.sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
