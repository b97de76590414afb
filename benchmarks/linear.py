"""Forward + backward time of fp4gen.nn.Linear against torch.nn.Linear in BF16, in one run.

For hidden sizes 2048 to 8192 and 8192 tokens (a square layer hidden x hidden), prints
milliseconds per forward+backward and the ratio to BF16 (goal: <= 1.3x at 8192).

    python benchmarks/linear.py [--recipe recipes/nvfp4.fp4r] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

import fp4gen  # noqa: E402
from benchmarks.common import cuda_time_ms, require_cuda  # noqa: E402


def step(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
    y = layer(x)
    y.backward(dy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="nvfp4.fp4r")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--sizes", default="2048,4096,8192")
    args = parser.parse_args()
    require_cuda()
    recipe = fp4gen.load_recipe(args.recipe)
    print(
        f"recipe {recipe.name}, {args.tokens} tokens, fwd+bwd, bf16 activations, "
        f"device {torch.cuda.get_device_name()}"
    )
    for hidden in (int(s) for s in args.sizes.split(",")):
        torch.manual_seed(0)
        x = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16)
        x.requires_grad_(True)
        dy = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.Linear(hidden, hidden, device="cuda", dtype=torch.bfloat16)
        ours = fp4gen.nn.Linear(hidden, hidden, device="cuda", dtype=torch.bfloat16, recipe=recipe)
        t_ref = cuda_time_ms(lambda: step(ref, x, dy))  # noqa: B023
        t_ours = cuda_time_ms(lambda: step(ours, x, dy))  # noqa: B023
        flops = 3 * 2 * args.tokens * hidden * hidden
        print(
            f"hidden {hidden:5d}: torch.nn.Linear bf16 {t_ref:8.3f} ms "
            f"({flops / t_ref / 1e9:6.1f} TFLOP/s)   fp4gen {t_ours:8.3f} ms   "
            f"ratio {t_ours / t_ref:5.2f}x bf16"
        )


if __name__ == "__main__":
    main()
