"""Forward + backward time of fp4gen.nn.Linear against torch.nn.Linear in BF16, in one run.

For hidden sizes 2048 to 8192 and 8192 tokens (a square layer hidden x hidden), prints
milliseconds per forward+backward and the ratio to BF16 (goal: <= 1.3x at 8192), twice: for
steps run back to back as a training loop runs them (the host queues the next step while the
GPU works: the goal's line) and for one step timed from an idle GPU (host time exposed), the path
``fp4gen.gemm`` took for each of the layer's three GEMMs (fprop, dgrad, wgrad), and with
``--profile`` the GPU time of one fp4gen step by kernel (torch.profiler). The weight does not
change between steps (no optimizer step), so its quantization and its decoded bf16 values are
made once and reused, as across the micro-batches of one optimizer step.

    python benchmarks/linear.py [--recipe recipes/nvfp4.fp4r] [--tokens 8192] [--steps 10]
                                [--profile]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

import fp4gen  # noqa: E402
import fp4gen.gemm_dispatch as dispatch  # noqa: E402
from benchmarks.common import cuda_time_ms, require_cuda  # noqa: E402


def run_steps(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        step(layer, x, dy)


def step(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
    y = layer(x)
    y.backward(dy)


def gemm_paths(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> str:
    """The backend ``fp4gen.gemm(backend="auto")`` chose for each GEMM of one step."""
    seen: list[str] = []
    real = dispatch.auto_backend

    def spy(a, b):
        choice = real(a, b)
        seen.append(f"{a.rows}x{b.rows}x{a.cols} {choice.backend}")
        return choice

    dispatch.auto_backend = spy
    try:
        step(layer, x, dy)
        torch.cuda.synchronize()
    finally:
        dispatch.auto_backend = real
    return ", ".join(seen)


def profile(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, top: int = 16) -> None:
    """GPU time of one step by kernel and by torch operator, largest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step(layer, x, dy)
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with torch_profile(activities=activities) as prof:
        step(layer, x, dy)
        torch.cuda.synchronize()
    times: Counter[str] = Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:150]] += event.device_time
    total = sum(times.values())
    print(f"  GPU time of one fp4gen step: {total / 1e3:.3f} ms in {len(times)} kernels")
    for name, us in times.most_common(top):
        print(f"  {us / 1e3:8.3f} ms  {name}")
    table = prof.key_averages().table(
        sort_by="self_device_time_total", row_limit=top, max_name_column_width=70
    )
    print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="nvfp4.fp4r")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--sizes", default="2048,4096,8192")
    parser.add_argument(
        "--steps",
        type=int,
        default=10,
        help="steps per timing in the back-to-back line, as a training loop runs them (the "
        "isolated line times one step from an idle GPU, host launch time included)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="GPU time by kernel of one step per size"
    )
    args = parser.parse_args()
    require_cuda()
    recipe = fp4gen.load_recipe(args.recipe)
    print(
        f"recipe {recipe.name}, {args.tokens} tokens, fwd+bwd, bf16 activations, "
        f"device {torch.cuda.get_device_name()}"
    )
    # profiled after every size is timed: a torch.profiler session leaves every later launch of
    # the process slower (6.9 -> 9.5 us per small launch on an H200 host)
    to_profile: list[tuple[int, torch.nn.Module, torch.Tensor, torch.Tensor]] = []
    for hidden in (int(s) for s in args.sizes.split(",")):
        torch.manual_seed(0)
        x = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16)
        x.requires_grad_(True)
        dy = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.Linear(hidden, hidden, device="cuda", dtype=torch.bfloat16)
        ours = fp4gen.nn.Linear(hidden, hidden, device="cuda", dtype=torch.bfloat16, recipe=recipe)
        flops = 3 * 2 * args.tokens * hidden * hidden
        for label, steps in (("back-to-back", args.steps), ("isolated", 1)):
            t_ref = cuda_time_ms(lambda: run_steps(ref, x, dy, steps)) / steps  # noqa: B023
            t_ours = cuda_time_ms(lambda: run_steps(ours, x, dy, steps)) / steps  # noqa: B023
            print(
                f"hidden {hidden:5d} {label:>12s}: torch.nn.Linear bf16 {t_ref:8.3f} ms "
                f"({flops / t_ref / 1e9:6.1f} TFLOP/s)   fp4gen {t_ours:8.3f} ms   "
                f"ratio {t_ours / t_ref:5.2f}x bf16",
                flush=True,
            )
        print(f"  GEMM paths (MxNxK): {gemm_paths(ours, x, dy)}", flush=True)
        if args.profile:
            to_profile.append((hidden, ours, x, dy))
    for hidden, ours, x, dy in to_profile:
        print(f"hidden {hidden:5d} profile:")
        try:
            profile(ours, x, dy)
        except Exception as err:  # the profiler's event API differs across torch versions
            print(f"  (no profile: {type(err).__name__}: {err})")


if __name__ == "__main__":
    main()
