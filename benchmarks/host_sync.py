"""Every host synchronization in one training step of fp4gen.nn.Linear, with where it happens.

A synchronizing call (a device-to-host read, a copy from pageable host memory) makes the host
wait for the GPU, so the host's work for the next kernels no longer overlaps the GPU's: a step
then costs GPU time + host time. torch's sync debug mode reports each such call; this script
runs one forward + backward of a layer with it on and prints each distinct call site once, and
tries to capture the step in a CUDA graph (which fails on the same calls).

    python benchmarks/host_sync.py [--recipe recipes/nvfp4_small.fp4r] [--tokens 4096]
                                   [--hidden 1024]
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

import fp4gen  # noqa: E402


def step(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(dy)


def fp4gen_frames(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frames that belong to fp4gen or its generated kernels."""
    own = [f for f in stack if "fp4gen" in f.filename and "warnings" not in f.filename]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in own[::-1][:4])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/nvfp4_small.fp4r")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this script needs a CUDA GPU")
    recipe = fp4gen.load_recipe(args.recipe)
    layer = fp4gen.nn.Linear(args.hidden, args.hidden, recipe=recipe, device="cuda")
    x = torch.randn(args.tokens, args.hidden, device="cuda", requires_grad=True)
    dy = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        step(layer, x, dy)  # compile and load every kernel first
    torch.cuda.synchronize()
    sites: dict[str, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("always")

        def record(message, category, filename, lineno, file=None, line=None):
            # called where the warning is raised: the stack is the synchronizing call's
            where = fp4gen_frames(traceback.extract_stack()[:-1]) or f"{filename}:{lineno}"
            key = f"{str(message).splitlines()[0][:80]} at {where}"
            sites[key] = sites.get(key, 0) + 1

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(layer, x, dy)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"{len(sites)} synchronizing call sites in one forward + backward:")
    for key, n in sites.items():
        print(f"  {n:3d}x {key}")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            step(layer, x, dy)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            step(layer, x, dy)
        print("CUDA graph capture: ok")
    except Exception:
        print("CUDA graph capture failed:")
        print("".join(traceback.format_exc().splitlines(keepends=True)[-12:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
