"""Train the demo GPT with several recipes side by side; write a CSV and a PNG of the losses.

Every recipe starts from the same initial weights and sees the same batches, so the curves differ
only by the numerics. "bf16" is the baseline: the unconverted model under bf16 autocast (the
converted models run under the same autocast, so their high-precision layers match it). With
``telemetry_every`` > 0 the converted layers record telemetry, written to telemetry.json (each
record tagged with its recipe) for ``fp4gen report``.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4gen.demo.data import ByteBatches, stdlib_corpus
from fp4gen.demo.gpt import GPT, GPTConfig
from fp4gen.dsl import load_recipe
from fp4gen.runtime.convert import (
    convert,
    count_converted,
    enable_telemetry,
    set_step,
    telemetry,
)

SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(context=64, layers=4, heads=4, width=64),  # ~0.2M parameters: CPU minutes
    "small": GPTConfig(context=128, layers=6, heads=6, width=384),  # ~11M
    "medium": GPTConfig(context=256, layers=8, heads=8, width=768),  # ~57M
}


@dataclass(frozen=True)
class DemoConfig:
    recipes: tuple[str, ...] = ("bf16", "nvfp4_small", "mxfp4_small")
    size: str = "tiny"
    steps: int = 300
    batch: int = 16
    lr: float = 3e-3
    eval_every: int = 25
    seed: int = 0
    device: str = "cpu"
    out: Path = Path("fp4gen-demo")
    telemetry_every: int = 0  # record telemetry every N layer calls (0: off)


@dataclass(frozen=True)
class Point:
    recipe: str
    step: int
    train_loss: float
    val_loss: float | None
    seconds: float


def _lr(step: int, cfg: DemoConfig) -> float:
    warmup = max(cfg.steps // 20, 1)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(cfg.steps - warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def _val_loss(model: GPT, data: ByteBatches, cfg: DemoConfig, device: torch.device) -> float:
    gen_state = data.generator.get_state()
    data.generator.manual_seed(cfg.seed + 1)  # the same held-out batches for every recipe
    losses = []
    for _ in range(4):
        x, y = data.batch(cfg.batch, "val")
        with torch.autocast(device.type, dtype=torch.bfloat16):
            losses.append(float(model(x.to(device), y.to(device))))
    data.generator.set_state(gen_state)
    return sum(losses) / len(losses)


def train_one(
    recipe: str,
    cfg: DemoConfig,
    corpus: bytes,
    log: Callable[[str], None],
    records: list[dict] | None = None,
) -> list[Point]:
    """Train one recipe; its telemetry records (if enabled) are appended to ``records``."""
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = GPT(SIZES[cfg.size]).to(device)
    if recipe != "bf16":
        path = recipe if recipe.endswith(".fp4r") else f"{recipe}.fp4r"  # shipped recipe names
        convert(model, load_recipe(path), seed=cfg.seed, total_steps=cfg.steps)
        enable_telemetry(model, cfg.telemetry_every)
    log(
        f"[{recipe}] {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"{count_converted(model)} linear layers converted"
    )
    data = ByteBatches(corpus, model.cfg.context, seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    points: list[Point] = []
    start = time.perf_counter()
    for step in range(cfg.steps):
        if recipe != "bf16":
            set_step(model, step)
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        x, y = data.batch(cfg.batch)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = step == cfg.steps - 1
        val = _val_loss(model, data, cfg, device) if step % cfg.eval_every == 0 or last else None
        points.append(Point(recipe, step, float(loss.detach()), val, time.perf_counter() - start))
        if val is not None:
            p = points[-1]
            log(
                f"[{recipe}] step {step:5d}/{cfg.steps}  train {p.train_loss:.4f}  "
                f"val {val:.4f}  ({p.seconds:.0f} s)"
            )
    if records is not None and recipe != "bf16":
        records.extend({"recipe": recipe, **r} for r in telemetry(model))
    return points


def write_csv(points: list[Point], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["recipe", "step", "train_loss", "val_loss", "seconds"])
        for p in points:
            val = "" if p.val_loss is None else f"{p.val_loss:.6f}"
            writer.writerow([p.recipe, p.step, f"{p.train_loss:.6f}", val, f"{p.seconds:.3f}"])


def plot(points: list[Point], path: Path, title: str) -> bool:
    """Loss curves as a PNG; False (and nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    for recipe in dict.fromkeys(p.recipe for p in points):
        mine = [p for p in points if p.recipe == recipe]
        steps = [p.step for p in mine]
        raw = [p.train_loss for p in mine]
        smooth, acc = [], raw[0]
        for v in raw:  # exponential moving average, so the curves are readable
            acc = 0.9 * acc + 0.1 * v
            smooth.append(acc)
        ax_train.plot(steps, smooth, label=recipe)
        vals = [(p.step, p.val_loss) for p in mine if p.val_loss is not None]
        ax_val.plot([s for s, _ in vals], [v for _, v in vals], marker="o", label=recipe)
    ax_train.set(title="training loss (EMA 0.9)", xlabel="step", ylabel="cross-entropy (nats)")
    ax_val.set(title="held-out loss", xlabel="step")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_demo(cfg: DemoConfig, log: Callable[[str], None] = print) -> list[Point]:
    cfg.out.mkdir(parents=True, exist_ok=True)
    corpus = stdlib_corpus()
    log(f"corpus: {len(corpus) / 1e6:.1f} MB of Python standard-library source")
    points: list[Point] = []
    records: list[dict] = []
    for recipe in cfg.recipes:
        points += train_one(recipe, cfg, corpus, log, records)
    write_csv(points, cfg.out / "losses.csv")
    if cfg.telemetry_every:
        path = cfg.out / "telemetry.json"
        path.write_text(json.dumps({"records": records}))
        log(f"wrote {path} ({len(records)} records; draw it with: fp4gen report {path})")
    title = f"{cfg.size} GPT on stdlib bytes, {cfg.steps} steps, batch {cfg.batch}"
    if plot(points, cfg.out / "losses.png", title):
        log(f"wrote {cfg.out / 'losses.csv'} and {cfg.out / 'losses.png'}")
    else:
        log(f"wrote {cfg.out / 'losses.csv'} (install matplotlib for the PNG)")
    return points
