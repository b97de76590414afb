"""``fp4gen sweep``, registered on the CLI's subparsers by :func:`add_commands`.

Nothing here imports torch: building the parser (for every fp4gen command) stays cheap.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fp4gen.experiments.models import ALIASES, MODELS, model_table

SWEEP_EPILOG = """\
models (--model; gpt is gpt-tiny, llama is llama-tiny; built from a config, nothing downloaded):
{models}
  parameters for the 256-byte vocabulary; a token file's vocabulary is its largest id + 1.
  The gpt sizes are fp4gen demo's. The llama models (transformers' LlamaForCausalLM: SwiGLU MLP
  of 8/3 x width rounded up to 64, RMSNorm, rotary positions, untied head; pip install
  'fp4gen[hf]') have more blocks so that the papers' layer rules (nvfp4: first 2 and last 8
  blocks in BF16) leave quantized blocks: 6 of llama-medium's 16.

runs: every recipe and bf16 (always trained: it is the baseline) with seeds 0..K-1. Seed s
  fixes the initial weights, the order of the training batches and the stochastic rounding,
  the same for every recipe; the held-out batches are fixed for the whole sweep. AdamW (weight
  decay 0.1), 5% warm-up, cosine decay to 10% of --lr, gradient clipping at 1, bf16 autocast.

output (--out DIR): runs/<recipe>__seed<k>.json (one per finished run, written atomically: run
  the same command again to resume; finished runs are skipped), losses.csv (recipe, seed, step,
  tokens, train_loss, eval_loss), summary.json, loss_vs_tokens.png and gap_to_bf16.png.

the comparison: per recipe the final held-out loss (mean +- std over seeds) and the gap to bf16,
  gap_s = (loss_s - bf16_s) / bf16_s paired by seed, with a Student-t interval at --confidence;
  "yes" when the interval excludes 0. One seed: the interval is undefined. docs/experiments.md.

examples:
  fp4gen sweep nvfp4_small mxfp4_small --seeds 2 --tokens 200k      # CPU, about 9 minutes
  fp4gen sweep nvfp4 nvfp4_no_rht nvfp4_no_sr nvfp4_1d_weights mxfp4 nvfp4_bf16_switch \\
      --model llama-medium --tokens 3.6M --batch 64 --seeds 3 --device cuda   # H100, 11 min
  on a CPU that other programs share, OMP_NUM_THREADS=1 can make steps many times faster
"""


def add_commands(sub: Any) -> None:
    """Register ``fp4gen sweep`` on the CLI's subparsers."""
    p = sub.add_parser(
        "sweep",
        help="train recipes and bf16 with several seeds, compare final losses with an interval",
        description="Train each recipe and the BF16 baseline with K seeds on the same data "
        "order (seed s: the same initial weights and batches for every recipe), on a GPU when "
        "there is one, with a progress bar and an ETA. Prints per recipe the final held-out "
        "loss (mean ± std over seeds) and its relative gap to BF16 with a Student-t confidence "
        "interval, paired over seeds; writes per-run JSON (a rerun resumes), losses.csv, "
        "summary.json and PNG plots to --out. Everything is checked before the first run.",
        epilog=SWEEP_EPILOG.format(models=model_table()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "recipes",
        nargs="+",
        metavar="RECIPE",
        help="a .fp4r path or a shipped recipe's name (nvfp4_small); bf16 is always added",
    )
    p.add_argument(
        "--model",
        default="gpt-tiny",
        metavar="NAME",
        help=f"one of {', '.join([*MODELS, *ALIASES])} (default: gpt-tiny; see the table below)",
    )
    p.add_argument(
        "--tokens",
        default="256k",
        metavar="N",
        help="training tokens per run, rounded up to whole steps of batch x context; "
        "suffixes k, M, B (default: 256k)",
    )
    p.add_argument("--seeds", type=int, default=3, metavar="K", help="seeds 0..K-1 (default: 3)")
    p.add_argument(
        "--data",
        metavar="PATH",
        help="a text file (trained on its bytes) or a token file (.npy, .pt: integers); "
        "default: the Python standard library's source; the last 10%% is held out",
    )
    p.add_argument("--out", default="fp4gen-sweep", metavar="DIR", help="default: fp4gen-sweep")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="default auto: cuda when torch sees a GPU",
    )
    p.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        metavar="C",
        help="confidence of the gap's interval, in (0, 1) (default: 0.95)",
    )
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default: 16)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the model's, below)")
    p.add_argument(
        "--eval-every",
        type=int,
        metavar="STEPS",
        help="held-out loss every STEPS steps and after the last (default: 10 along the run)",
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=8,
        metavar="N",
        help="held-out batches per evaluation, the same for every run (default: 8)",
    )
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    from fp4gen.experiments.sweep import SweepConfig, parse_tokens, run_sweep

    cfg = SweepConfig(
        recipes=tuple(args.recipes),
        model=args.model,
        tokens=parse_tokens(args.tokens),
        seeds=args.seeds,
        data=args.data,
        out=Path(args.out),
        device=args.device,
        confidence=args.confidence,
        batch=args.batch,
        lr=args.lr,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
    )
    try:
        run_sweep(cfg, log=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        # finished runs are already on disk, each whole: say how to go on, without a traceback
        print(
            f"\nfp4gen sweep: interrupted; finished runs are kept in {cfg.out / 'runs'}: run the "
            "same command again to resume",
            file=sys.stderr,
        )
        return 130
    return 0
