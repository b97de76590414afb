"""The ``fp4gen`` command line: check, show and measure recipes.

Every user error (a bad recipe, a bad tensor) is printed as one readable message and exits with
status 1; usage errors exit with status 2 (argparse's convention).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp4gen import describe
from fp4gen.errors import FP4GenError
from fp4gen.settings import check_environment
from fp4gen.table import render_table

DISTRIBUTIONS = ("normal", "laplace", "student-t", "uniform", "lognormal", "outliers")

EPILOG = """\
examples:
  fp4gen check recipes/*.fp4r
  fp4gen show recipes/nvfp4.fp4r
  fp4gen show recipes/nvfp4.fp4r --json
  fp4gen error recipes/nvfp4.fp4r --dist student-t
  fp4gen error mxfp4 --tensor activations.pt
"""


# ---------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    from fp4gen.dsl import find_recipe, load_recipe

    failures = 0
    for path in args.files:
        try:
            # a path, or a shipped recipe's name: resolved as load_recipe and demo do
            recipe = load_recipe(find_recipe(path))
        except FP4GenError as err:
            failures += 1
            print(err, file=sys.stderr)
            continue
        if not args.quiet:
            print(f"ok  {path}  ({recipe.name})")
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------
# show
# ---------------------------------------------------------------------------------------------


def operand_rows(recipe: Any) -> list[list[str]]:
    from fp4gen.formats import BlockFormat, HighPrecision

    rows = []
    for op, spec in recipe.operands.items():
        fmt = spec.format
        if isinstance(fmt, BlockFormat):
            detail = [
                fmt.element.name,
                describe.block_text(fmt.block),
                "2d" if fmt.is_2d else "1d",
                describe.scale_detail(fmt),
                describe.global_text(fmt),
                spec.rounding,
            ]
        elif isinstance(fmt, HighPrecision):
            detail = [fmt.name, "-", "-", "-", "-", "-"]
        else:
            detail = ["dynamic", "-", "-", "-", "-", spec.rounding]
        rows.append(
            [
                op.gemm,
                op.role,
                op.use,
                describe.operand_format_text(spec),
                *detail,
                describe.rht_text(spec.rht),
            ]
        )
    return rows


def gemm_rows(recipe: Any) -> list[list[str]]:
    from fp4gen.dsl.model import Operand
    from fp4gen.gemm_dispatch import gemm_path

    pairs = {
        "fprop": (Operand.FPROP_ACTIVATION, Operand.FPROP_WEIGHT),
        "dgrad": (Operand.DGRAD_GRADIENT, Operand.DGRAD_WEIGHT),
        "wgrad": (Operand.WGRAD_GRADIENT, Operand.WGRAD_ACTIVATION),
    }
    ops = recipe.operands
    return [[g, *gemm_path(ops[a].format, ops[b].format)] for g, (a, b) in pairs.items()]


def show_text(recipe: Any, with_plan: bool = True) -> str:
    parts = [f"recipe {recipe.name}"]
    if recipe.description:
        parts.append(f"  {recipe.description}")
    if recipe.source:
        parts.append(f"  from {recipe.source}")
    parts.append("")
    parts.append("GEMM operands")
    parts.append(
        render_table(
            [
                "gemm",
                "role",
                "use",
                "format",
                "element",
                "block",
                "layout",
                "scale",
                "global",
                "rounding",
                "rht",
            ],
            operand_rows(recipe),
        )
    )
    parts.append("")
    parts.append("GEMM paths on a GPU (fp4gen.gemm, backend auto)")
    parts.append(render_table(["gemm", "path", "why"], gemm_rows(recipe)))
    for mor in recipe.mors:
        parts.append("")
        parts.append(
            f"MoR rule {mor.name}: decide per {describe.partition_text(mor.decide)}, "
            f"scales per {describe.partition_text(mor.scale)}, {mor.scaling} scaling"
        )
        parts.append(
            render_table(
                ["#", "candidate", "accepted when"],
                [
                    [str(i + 1), describe.format_text(c.format), describe.metric_text(c.metric)]
                    for i, c in enumerate(mor.candidates)
                ],
            )
        )
    parts.append("")
    if recipe.layers:
        parts.append("Layer rules (first match wins)")
        parts.append(
            render_table(
                ["#", "layers", "use"],
                [
                    [str(i + 1), describe.selector_text(r.selector), describe.action_text(r.action)]
                    for i, r in enumerate(recipe.layers)
                ],
            )
        )
    else:
        parts.append("Layer rules: none (every linear layer uses the operand table)")
    parts.append("")
    if recipe.schedule:
        parts.append("Precision schedule")
        parts.append(
            render_table(
                ["from", "passes", "switch to"],
                [
                    [describe.when_text(r), r.passes, describe.action_text(r.action)]
                    for r in recipe.schedule
                ],
            )
        )
    else:
        parts.append("Precision schedule: none")
    parts.append(f"Evaluation (module.eval()): {describe.eval_text(recipe.evaluation)}")
    if with_plan:
        from fp4gen.compiler.plan import plan_recipe

        parts.append("")
        parts.append(describe.plan_text(plan_recipe(recipe)))
    return "\n".join(parts)


def cmd_show(args: argparse.Namespace) -> int:
    from fp4gen.dsl import find_recipe, load_recipe

    recipe = load_recipe(find_recipe(args.file))
    if args.json:
        from fp4gen.compiler.plan import plan_recipe

        data = describe.recipe_json(recipe)
        data["gemm_paths"] = {g: {"path": p, "why": w} for g, p, w in gemm_rows(recipe)}
        data["kernel_plan"] = plan_recipe(recipe).to_json()
        print(json.dumps(data, indent=2))
    elif args.canonical:
        from fp4gen.dsl import print_recipe

        print(print_recipe(recipe), end="")
    else:
        print(show_text(recipe))
    return 0


# ---------------------------------------------------------------------------------------------
# error
# ---------------------------------------------------------------------------------------------


MAX_SAMPLES = 1 << 26  # elements of a synthetic --shape tensor (8192x8192): a few GB of work


def parse_shape(text: str) -> tuple[int, int]:
    """RxC as two integers; their sizes are checked by ``check_shape`` (exit 1, not 2)."""
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must look like 4096x4096, got {text!r}") from None
    return rows, cols


def check_shape(shape: tuple[int, int]) -> None:
    from fp4gen.errors import ArgumentError

    rows, cols = shape
    if rows < 1 or cols < 1:
        raise ArgumentError(f"--shape {rows}x{cols}: both sizes must be at least 1")
    if rows * cols > MAX_SAMPLES:
        raise ArgumentError(
            f"--shape {rows}x{cols}: at most {MAX_SAMPLES} elements (8192x8192) are sampled; "
            "measure a larger tensor with --tensor"
        )


def check_seed(seed: int) -> None:
    """The seed seeds torch's sampling and the Philox stream of stochastic rounding: both take
    [0, 2^64)."""
    from fp4gen.errors import ArgumentError

    if not 0 <= seed < 1 << 64:
        raise ArgumentError(f"--seed must be an integer in [0, 2^64), got {seed}")


def sample_tensor(dist: str, shape: tuple[int, int], seed: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed)
    if dist == "normal":
        return torch.randn(shape, generator=gen)
    if dist == "laplace":
        u = torch.rand(shape, generator=gen) - 0.5
        return -torch.sign(u) * torch.log1p(-2 * u.abs())
    if dist == "student-t":  # 3 degrees of freedom: heavy tails like activation outliers
        z = torch.randn(shape, generator=gen)
        chi2 = torch.randn((3, *shape), generator=gen).pow(2).sum(0)
        return z / torch.sqrt(chi2 / 3)
    if dist == "uniform":
        return torch.rand(shape, generator=gen) * 2 - 1
    if dist == "lognormal":  # signed, magnitudes spanning many binades
        mag = torch.exp(torch.randn(shape, generator=gen) * 2)
        sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
        return mag * sign
    # "outliers": normal data with 0.1% of the values 100x larger
    x = torch.randn(shape, generator=gen)
    mask = torch.rand(shape, generator=gen) < 1e-3
    return torch.where(mask, x * 100, x)


TENSOR_RULE = (
    "the file must hold one tensor saved with torch.save (loaded with weights_only=True, so "
    "nothing else in it runs) or a numeric numpy array saved with numpy.save (.npy)"
)


def load_tensor(path: Path) -> Any:
    """The tensor saved in ``path`` (torch.save, or numpy.save for .npy), as a float32 view of
    at least one dimension. Every failure is a TensorError of one line."""
    import torch

    from fp4gen.errors import TensorError

    if not path.exists():
        raise TensorError(f"{path}: no such file")
    if path.is_dir():
        raise TensorError(f"{path} is a directory; {TENSOR_RULE}")
    try:
        if path.suffix == ".npy":
            import numpy as np

            obj = torch.from_numpy(np.load(path))  # allow_pickle=False: arrays only
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as err:
        raise TensorError(f"{path}: cannot read it ({err.strerror or err})") from None
    except Exception:
        # a corrupt or foreign file fails in many ways inside the unpickler (UnpicklingError,
        # KeyError, EOFError, ...); torch's message advises an unsafe weights_only=False, which
        # is never repeated here
        raise TensorError(f"{path}: cannot load a tensor from it; {TENSOR_RULE}") from None
    if isinstance(obj, dict):
        tensors = [v for v in obj.values() if isinstance(v, torch.Tensor)]
        if len(tensors) != 1:
            raise TensorError(f"{path}: holds {len(tensors)} tensors; save exactly one")
        obj = tensors[0]
    if not isinstance(obj, torch.Tensor):
        raise TensorError(f"{path}: holds a {type(obj).__name__}, not a tensor; {TENSOR_RULE}")
    if obj.is_complex() or obj.dtype == torch.bool or obj.layout != torch.strided:
        raise TensorError(
            f"{path}: holds a {obj.dtype} {str(obj.layout).replace('torch.', '')} tensor; "
            "expected a dense real (floating-point or integer) one"
        )
    if obj.dim() == 0:
        raise TensorError(
            f"{path}: holds a 0-d tensor (a scalar); the error needs at least 1 dimension "
            "(1-D is one row, N-D is viewed as rows x last dimension)"
        )
    if obj.numel() == 0:
        raise TensorError(f"{path}: holds an empty tensor of shape {tuple(obj.shape)}")
    x = obj.float()
    if obj.is_floating_point() and not bool(torch.isfinite(x).all()) and bool(obj.isfinite().all()):
        raise TensorError(
            f"{path}: holds {obj.dtype} values beyond float32's range (|x| > 3.4e38), which the "
            "formats quantize from"
        )
    return x


def error_cases(target: str) -> tuple[str, list[tuple[str, Any, str, Any, str]]]:
    """(title, [(label, BlockFormat, rounding, rht, use)]) for a recipe file or a format name."""
    from fp4gen.formats import BUILTIN_FORMATS, BlockFormat

    if target in BUILTIN_FORMATS:
        fmt = BUILTIN_FORMATS[target]
        if not isinstance(fmt, BlockFormat):
            from fp4gen.errors import TensorError

            raise TensorError(f"{target} is a high-precision dtype: there is no quantization error")
        return f"format {target}", [(target, fmt, "nearest", None, "rowwise")]

    from fp4gen.dsl import find_recipe, load_recipe

    recipe = load_recipe(find_recipe(target))
    cases = []
    seen = set()
    for op, spec in recipe.operands.items():
        if not isinstance(spec.format, BlockFormat):
            continue
        key = (spec.format, spec.rounding, spec.rht, op.use)
        if key in seen:
            continue
        seen.add(key)
        cases.append((op.selector, spec.format, spec.rounding, spec.rht, op.use))
    return f"recipe {recipe.name}", cases


def json_number(value: float) -> float | None:
    """A metric for strict JSON: inf and NaN (an exact SNR, an undefined ratio) become null."""
    import math

    return value if math.isfinite(value) else None


def cmd_error(args: argparse.Namespace) -> int:
    from fp4gen.numerics import error_stats, quantize

    check_seed(args.seed)
    if not args.tensor:
        check_shape(args.shape)
    title, cases = error_cases(args.target)
    if args.tensor:
        x = load_tensor(Path(args.tensor))
        source = f"tensor {args.tensor} {tuple(x.shape)}"
    else:
        x = sample_tensor(args.dist, args.shape, args.seed)
        source = f"{args.dist} samples {args.shape[0]}x{args.shape[1]}, seed {args.seed}"
    results = []
    for label, fmt, rounding, rht, use in cases:
        # 1-D is one row, N-D is viewed as rows x last dimension (the GEMM operand's K)
        data = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if use == "columnwise":
            data = data.t().contiguous()
        if rht is not None:  # signs drawn per layer or step: those of layer 0 at step 0
            rht = rht.at(0, 0)
        qt = quantize(data, fmt, rounding=rounding, hadamard=rht, seed=args.seed)
        stats = error_stats(data, qt)
        results.append(
            {
                "operand": label,
                "format": fmt.name,
                "block": describe.block_text(fmt.block),
                "rounding": rounding,
                "rht": describe.rht_text(rht),
                "relative_error": stats.rel_error,
                "mean_relative_error": stats.mean_rel_error,
                "snr_db": stats.snr_db,
                "flushed_to_zero": stats.flushed,
                "saturated": stats.saturated,
            }
        )
    if args.json:
        # strict JSON (no Infinity or NaN tokens): a metric that is not finite is null
        metrics = ("relative_error", "mean_relative_error", "snr_db")
        for r in results:
            r.update({k: json_number(r[k]) for k in metrics})
        doc = {"target": title, "data": source, "results": results}
        print(json.dumps(doc, indent=2, allow_nan=False))
        return 0
    print(f"{title} on {source}")
    if not results:
        print("no quantized operands (every operand is high precision or dynamic)")
        return 0
    rows = [
        [
            r["operand"],
            r["format"],
            r["block"],
            r["rounding"],
            r["rht"],
            f"{r['relative_error']:.4%}",
            f"{r['mean_relative_error']:.4%}",
            f"{r['snr_db']:.2f}",
            f"{r['flushed_to_zero']:.4%}",
            f"{r['saturated']:.4%}",
        ]
        for r in results
    ]
    print(
        render_table(
            [
                "operand",
                "format",
                "block",
                "rounding",
                "rht",
                "rel err",
                "mean rel err",
                "SNR dB",
                "flushed",
                "saturated",
            ],
            rows,
        )
    )
    return 0


# ---------------------------------------------------------------------------------------------
# formats
# ---------------------------------------------------------------------------------------------


def cmd_formats(args: argparse.Namespace) -> int:
    from fp4gen.formats import BUILTIN_FORMATS, BlockFormat

    rows = []
    for name, fmt in BUILTIN_FORMATS.items():
        if isinstance(fmt, BlockFormat):
            rows.append(
                [
                    name,
                    fmt.element.name,
                    f"{fmt.element.max_finite:g}",
                    describe.block_text(fmt.block),
                    describe.scale_text(fmt.scale),
                    "fp32 amax" if fmt.global_scale else "none",
                ]
            )
        else:
            rows.append([name, fmt.name, "-", "-", "-", "-"])
    if args.json:
        print(
            json.dumps({n: describe.format_json(f) for n, f in BUILTIN_FORMATS.items()}, indent=2)
        )
    else:
        print(render_table(["name", "element", "max", "block", "scale", "global"], rows))
    return 0


# ---------------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------------


DEMO_EPILOG = """\
sizes (GPT on bytes: blocks x width, context; batch 16 by default):
  tiny    4 x  64, context  64,  0.24M parameters: CPU (2 cores) about 0.1 s per step in bf16,
          0.6 s with nvfp4_small / mxfp4_small, 0.9 s with the MoR recipes
  small   6 x 384, context 128, 11M parameters: for a GPU
  medium  8 x 768, context 256, 57M parameters: on an H100 18 ms per step in bf16, 120-130 ms
          with nvfp4_small / mxfp4_small, 170-175 ms with the MoR recipes (docs/demo.md)
  --time-budget S is for the whole run: the demo times several steps and an evaluation of each
  recipe first (the median step), trains every recipe the steps that fit what is left of S (at
  most --steps), and stops a recipe early when its share of S is spent.

recipes: bf16 (the unconverted model under bf16 autocast), a .fp4r file, or a shipped recipe:
  {recipes}
  nvfp4 (first 2 and last 8 blocks in BF16) and mxfp4 (last 8 blocks) follow the papers'
  50-60-block models, which leaves no quantized layer in these 4-8-block models; nvfp4_small
  and mxfp4_small are the same methods with only the last block and the head in BF16.

examples:
  fp4gen demo --steps 200                                  # tiny, on the CPU, a few minutes
  fp4gen demo --size medium --device cuda --time-budget 60 \\
      --recipes bf16,nvfp4_small,mxfp4_small,mor_tensor,mor_subtensor_2way --telemetry 20
  fp4gen report fp4gen-demo/telemetry.json --by operand
"""


def _shipped_recipes() -> str:
    from fp4gen.dsl.resolve import SHIPPED_RECIPES

    names = sorted(p.stem for p in SHIPPED_RECIPES.glob("*.fp4r"))
    lines, line = [], ""
    for name in names:  # wrapped to the epilog's width
        if line and len(line) + len(name) > 90:
            lines.append(line.rstrip())
            line = ""
        line += f"{name}, "
    lines.append(line.rstrip(", "))
    return "\n  ".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    import math

    import torch

    from fp4gen.demo.train import DemoConfig, run_demo
    from fp4gen.errors import ArgumentError

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise FP4GenError("--device cuda: torch sees no CUDA device")
    for name, value in (("--steps", args.steps), ("--batch", args.batch)):
        if value < 1:
            raise FP4GenError(f"{name} must be at least 1, got {value}")
    if args.eval_every < 1 or args.telemetry < 0:
        raise FP4GenError("--eval-every must be at least 1 and --telemetry at least 0")
    # NaN passes every comparison, so finiteness is checked first
    if args.time_budget is not None and not (
        math.isfinite(args.time_budget) and args.time_budget > 0
    ):
        raise ArgumentError(
            f"--time-budget must be a positive, finite number of seconds, got {args.time_budget}"
        )
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ArgumentError(f"--lr must be a positive, finite learning rate, got {args.lr}")
    check_seed(args.seed)
    if "\0" in args.out:
        raise ArgumentError(f"--out {args.out!r}: a folder name holds no NUL byte")
    recipes = tuple(r.strip() for r in args.recipes.split(",") if r.strip())
    if not recipes:
        raise FP4GenError("--recipes names no recipe")
    cfg = DemoConfig(
        recipes=recipes,
        size=args.size,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        eval_every=args.eval_every,
        seed=args.seed,
        device=device,
        out=Path(args.out),
        telemetry_every=args.telemetry,
        time_budget=args.time_budget,
    )
    run_demo(cfg, log=lambda line: print(line, flush=True))
    return 0


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp4gen",
        description="Compile low-precision training recipes (.fp4r) into GPU kernels, "
        "and inspect them.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from fp4gen import __version__

    parser.add_argument("--version", action="version", version=f"fp4gen {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "check",
        help="parse and validate recipes; exit 1 on the first error",
        description="Parse and validate recipe files. Prints 'ok' per file, or "
        "the error with file, line, column and a caret; exits 1 if any failed.",
    )
    p.add_argument(
        "files", nargs="+", metavar="FILE", help=".fp4r files or shipped recipe names (nvfp4)"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="print errors only")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser(
        "show",
        help="print a resolved recipe as tables",
        description="Print the resolved recipe: each GEMM operand (fprop, dgrad, "
        "wgrad x role) with its format, block layout, scales, rounding and RHT; "
        "the MoR rules; the layer rules; the precision schedule.",
    )
    p.add_argument("file", metavar="FILE", help="an .fp4r recipe file or a shipped recipe's name")
    output = p.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON instead of tables")
    output.add_argument(
        "--canonical",
        action="store_true",
        help="print the resolved recipe as self-contained canonical .fp4r text "
        "(extends and imports inlined)",
    )
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
        "error",
        help="measure quantization error of a recipe's formats",
        description="Quantize a tensor with every distinct operand format of a "
        "recipe (or with one built-in format) using the reference numerics and "
        "report relative error, mean relative error over non-zeros (the MoR "
        "metric), SNR, the fraction of non-zero values flushed to zero and the "
        "fraction saturated.",
    )
    p.add_argument(
        "target",
        metavar="FILE|FORMAT",
        help="an .fp4r recipe, or a built-in format name (see 'fp4gen formats')",
    )
    p.add_argument(
        "--dist",
        choices=DISTRIBUTIONS,
        default="normal",
        help="distribution of the synthetic tensor (default: normal)",
    )
    p.add_argument(
        "--shape",
        type=parse_shape,
        default=(1024, 1024),
        metavar="RxC",
        help="shape of the synthetic tensor (default: 1024x1024)",
    )
    p.add_argument(
        "--tensor", metavar="PATH", help="use a saved tensor (torch.save .pt or numpy .npy) instead"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for sampling and stochastic rounding, in [0, 2^64) (default: 0)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print strict JSON instead of a table; a metric that is not finite (the SNR of an "
        "exact quantization) is null",
    )
    p.set_defaults(func=cmd_error)

    p = sub.add_parser(
        "demo",
        help="train a small GPT with several recipes side by side",
        description="Train a small GPT on the Python standard library's source bytes (present on "
        "every machine) with each recipe, from the same initial weights and batches, print "
        "progress (step, loss, elapsed time, ETA) and a summary table, and write losses.csv, "
        "losses.png (needs matplotlib) and summary.json to --out.",
        epilog=DEMO_EPILOG.format(recipes=_shipped_recipes()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--recipes",
        default="bf16,nvfp4_small,mxfp4_small",
        help="comma-separated recipes (default: bf16,nvfp4_small,mxfp4_small)",
    )
    p.add_argument(
        "--size",
        choices=("tiny", "small", "medium"),
        default="tiny",
        help="model size: tiny 0.24M (CPU), small 11M, medium 57M parameters (see below)",
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per recipe")
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="S",
        help="seconds for the whole run: time several steps and an evaluation of each recipe "
        "first, train all of them the steps that fit (at most --steps); a recipe past its "
        "share of S stops early",
    )
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine decay)")
    p.add_argument("--eval-every", type=int, default=25, help="held-out loss every N steps")
    p.add_argument("--seed", type=int, default=0, help="initialization, data and rounding seed")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--out", default="fp4gen-demo", help="output folder (default: fp4gen-demo)")
    p.add_argument(
        "--telemetry",
        type=int,
        default=0,
        metavar="N",
        help="record every converted layer's operand telemetry on every N-th step into "
        "telemetry.json (see 'fp4gen report'); default 0: off",
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "formats",
        help="list the built-in formats",
        description="List the built-in named formats a recipe can use.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_formats)

    from fp4gen.compiler.commands import add_commands

    add_commands(sub)  # compile, cache
    from fp4gen.report import add_commands as add_report_commands

    add_report_commands(sub)  # report
    from fp4gen.experiments.command import add_commands as add_sweep_commands

    add_sweep_commands(sub)  # sweep
    from fp4gen.export_cli import add_commands as add_export_commands

    add_export_commands(sub)  # export
    return parser


# The status of a command whose reader closed its output (``fp4gen show nvfp4 | head -1``):
# what a shell reports for a Unix tool that SIGPIPE ended, 128 + SIGPIPE.
CLOSED_PIPE_STATUS = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status. A reader that stops reading the output early (``head``)
    ends the command quietly with CLOSED_PIPE_STATUS, as it ends a Unix tool."""
    try:
        try:
            status = _run(argv)
        finally:
            # a closed pipe shows here, not in the interpreter's flush at exit, which would print
            # "Exception ignored ... BrokenPipeError" (also after --help, through SystemExit)
            sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()
        return CLOSED_PIPE_STATUS
    return status


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_environment()
        return int(args.func(args))
    except FP4GenError as err:
        print(f"fp4gen {args.command}: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        if isinstance(err, BrokenPipeError) and stdout_closed():
            raise  # the reader went away: main() ends quietly
        # the last line of defence for a file-system error a command did not word itself (a
        # full disk, a folder that vanished): one line naming the path; other errors are bugs
        # and keep their traceback
        print(f"fp4gen {args.command}: {describe_os_error(err)}", file=sys.stderr)
        return 1


def stdout_closed() -> bool:
    """Whether standard output is a pipe or socket whose reader has gone (so a BrokenPipeError
    came from our output, not from a pipe to a child process). Where this cannot be told (no
    poll, no file descriptor), a broken pipe is taken to be stdout's."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an in-memory stream
        return False
    poll = getattr(select, "poll", None)
    if poll is None:
        return True
    poller = poll()
    poller.register(fd, select.POLLOUT)
    # a pipe without readers polls as an error (POLLERR), a closed socket as a hang-up
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _discard_stdout() -> None:
    """Point standard output at the null device, so that what is still buffered for the
    closed pipe goes nowhere when the interpreter flushes it at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


def describe_os_error(err: OSError) -> str:
    """One line: the path(s) involved and the system's reason."""
    reason = err.strerror or str(err) or type(err).__name__
    paths = [str(p) for p in (err.filename, err.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {reason}" if paths else reason


if __name__ == "__main__":
    sys.exit(main())
