"""Train the demo GPT with several recipes side by side; write a CSV and a PNG of the losses.

Every recipe starts from the same initial weights and sees the same batches, so the curves differ
only by the numerics. "bf16" is the baseline: the unconverted model under bf16 autocast (the
converted models run under the same autocast, so their high-precision layers match it). With
``telemetry_every`` = N > 0 the converted layers record telemetry on every N-th optimizer step
(the forward and backward GEMM operands of that step), written to telemetry.json with each record
tagged with its recipe and step, for ``fp4gen report``.

Every recipe is loaded and checked before the first one trains, so a bad recipe fails at once.

With ``time_budget`` (seconds for the whole run) the demo first calibrates every recipe on a
throw-away model: untimed warm-up steps (they compile the GPU kernels), then several timed steps
(the median is the step time, so one slow step does not skew it) and one held-out evaluation.
It then picks the largest step count, at most ``steps``, whose predicted run (model builds,
steps and evaluations of every recipe) fits what is left of the budget, and all recipes train
that many steps. While training, each recipe has a deadline: what is left of the budget, shared
by the recipes still to run in proportion to their predicted times; a recipe whose next step
and final evaluation would end past it stops early (said in the log and the summary), so the
whole run ends near the budget even when the machine slows down.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4gen.demo.data import ByteBatches, stdlib_corpus
from fp4gen.demo.gpt import GPT, GPTConfig
from fp4gen.demo.lr_schedule import lr_at
from fp4gen.dsl import load_recipe
from fp4gen.dsl.model import Recipe
from fp4gen.outputs import OutputFiles
from fp4gen.runtime.convert import (
    convert,
    count_converted,
    enable_telemetry,
    set_step,
    telemetry,
)
from fp4gen.table import render_table

OUTPUT_FILES = ("losses.csv", "summary.json", "telemetry.json", "losses.png")  # in --out

SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(context=64, layers=4, heads=4, width=64),  # ~0.2M parameters: CPU minutes
    "small": GPTConfig(context=128, layers=6, heads=6, width=384),  # ~11M
    "medium": GPTConfig(context=256, layers=8, heads=8, width=768),  # ~57M
}
CALIBRATION_WARMUP = 2  # untimed steps (kernel compilation, allocator warm-up)
CALIBRATION_TIMED = 7  # timed steps per recipe at most; their median is the step time
CALIBRATION_MIN_TIMED = 3  # ... and at least
CALIBRATION_SHARE = 0.15  # past this share of the budget (all recipes) calibration times no more
BUDGET_USE = 0.9  # share of the budget left after calibration that the plan fills (margin)


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
    telemetry_every: int = 0  # record telemetry every N optimizer steps (0: off)
    time_budget: float | None = None  # seconds for the whole run: fewer steps if it needs it


@dataclass(frozen=True)
class Point:
    recipe: str
    step: int
    train_loss: float
    val_loss: float | None
    seconds: float


@dataclass(frozen=True)
class RecipeResult:
    """One recipe's run: what the summary table and summary.json show."""

    recipe: str
    parameters: int
    converted: int
    steps: int  # steps trained (fewer than planned if the run hit its deadline)
    planned_steps: int
    seconds: float
    final_train_loss: float  # mean of the last 10 steps' training losses
    final_val_loss: float
    stopped_early: bool


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


def load_recipes(names: tuple[str, ...]) -> dict[str, Recipe | None]:
    """Every recipe of the run, loaded and checked (None for the bf16 baseline), before any
    trains: a typo in the last one fails at once with the recipe error, not after the others."""
    # a shipped name or a path: load_recipe resolves it as fp4gen show does
    return {name: None if name == "bf16" else load_recipe(name) for name in names}


def _build(
    recipe: str, cfg: DemoConfig, steps: int, device: torch.device, loaded: Recipe | None = None
) -> GPT:
    """The demo GPT from the seed's initial weights, converted to ``recipe`` unless bf16
    (``loaded``: the recipe already loaded, else it is loaded here)."""
    torch.manual_seed(cfg.seed)
    model = GPT(SIZES[cfg.size]).to(device)
    if recipe != "bf16":
        convert(model, loaded or load_recipe(recipe), seed=cfg.seed, total_steps=steps)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(
    model: GPT,
    opt: torch.optim.Optimizer,
    data: ByteBatches,
    step: int,
    steps: int,
    cfg: DemoConfig,
    device: torch.device,
    converted: bool,
) -> torch.Tensor:
    if converted:
        set_step(model, step)
    for group in opt.param_groups:
        group["lr"] = lr_at(step, steps, cfg.lr)
    x, y = data.batch(cfg.batch)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(x.to(device), y.to(device))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


def _optimizer(model: GPT, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


@dataclass(frozen=True)
class Calibration:
    """What one recipe's calibration measured, in seconds."""

    step: float  # median of the timed training steps
    evaluation: float  # one held-out evaluation
    build: float  # building and converting the model
    total: float  # the whole calibration (warm-up included)
    timed_steps: int


def evaluations(steps: int, eval_every: int) -> int:
    """Held-out evaluations of a ``steps``-step run: every ``eval_every``-th step and the last."""
    if steps < 1:
        return 0
    return -(-steps // eval_every) + (0 if (steps - 1) % eval_every == 0 else 1)


def predicted_seconds(cal: Calibration, steps: int, eval_every: int) -> float:
    """Predicted seconds of one recipe's run of ``steps`` steps."""
    return cal.build + steps * cal.step + evaluations(steps, eval_every) * cal.evaluation


def calibrate(
    recipe: str,
    cfg: DemoConfig,
    corpus: bytes,
    loaded: Recipe | None = None,
    time_limit: float = math.inf,
) -> Calibration:
    """Time ``recipe`` on a throw-away model: CALIBRATION_WARMUP untimed steps (they compile
    the GPU kernels), then CALIBRATION_MIN_TIMED to CALIBRATION_TIMED timed steps (no more once
    the calibration has taken ``time_limit`` seconds), each timed alone so that their median
    ignores a step a busy moment slowed down, and one held-out evaluation."""
    device = torch.device(cfg.device)
    start = time.perf_counter()
    model = _build(recipe, cfg, cfg.steps, device, loaded)
    _sync(device)
    build = time.perf_counter() - start
    data = ByteBatches(corpus, model.cfg.context, seed=cfg.seed)
    opt = _optimizer(model, cfg.lr)
    converted = recipe != "bf16"
    for step in range(CALIBRATION_WARMUP):
        _train_step(model, opt, data, step, cfg.steps, cfg, device, converted)
    _sync(device)
    times: list[float] = []
    for step in range(CALIBRATION_WARMUP, CALIBRATION_WARMUP + CALIBRATION_TIMED):
        if len(times) >= CALIBRATION_MIN_TIMED and time.perf_counter() - start > time_limit:
            break
        t0 = time.perf_counter()
        _train_step(model, opt, data, step, cfg.steps, cfg, device, converted)
        _sync(device)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    _val_loss(model, data, cfg, device)
    _sync(device)
    evaluation = time.perf_counter() - t0
    return Calibration(
        step=statistics.median(times),
        evaluation=evaluation,
        build=build,
        total=time.perf_counter() - start,
        timed_steps=len(times),
    )


def fit_steps(runs: Sequence[Calibration], seconds: float, eval_every: int, max_steps: int) -> int:
    """The largest step count in [1, max_steps] whose predicted runs (one calibration per run)
    take at most ``seconds`` together (1 when not even one step fits)."""

    def cost(steps: int) -> float:
        return sum(predicted_seconds(c, steps, eval_every) for c in runs)

    if cost(max_steps) <= seconds:
        return max_steps
    lo, hi = 1, max_steps  # the cost grows with the steps: bisect for the last that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= seconds:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_steps(
    cfg: DemoConfig,
    corpus: bytes,
    log: Callable[[str], None],
    loaded: dict[str, Recipe | None] | None = None,
    started: float | None = None,
) -> tuple[int, dict[str, Calibration]]:
    """The step count every recipe trains: ``cfg.steps``, or fewer so that the whole run
    (calibration included, timed from ``started``, default now) fits ``cfg.time_budget``
    seconds; and each recipe's calibration (none without a budget)."""
    if cfg.time_budget is None:
        return cfg.steps, {}
    started = time.perf_counter() if started is None else started
    loaded = load_recipes(cfg.recipes) if loaded is None else loaded
    limit = cfg.time_budget * CALIBRATION_SHARE / len(set(cfg.recipes))
    calibrations: dict[str, Calibration] = {}
    for recipe in dict.fromkeys(cfg.recipes):  # a recipe named twice is timed once
        cal = calibrate(recipe, cfg, corpus, loaded.get(recipe), limit)
        calibrations[recipe] = cal
        log(
            f"[{recipe}] {cal.step * 1e3:.1f} ms per step (median of {cal.timed_steps} timed "
            f"steps), {cal.evaluation * 1e3:.0f} ms per evaluation; calibration took "
            f"{cal.total:.1f} s"
        )
    runs = [calibrations[r] for r in cfg.recipes]
    left = cfg.time_budget - (time.perf_counter() - started)
    steps = fit_steps(runs, left * BUDGET_USE, cfg.eval_every, cfg.steps)

    def predicted(n: int) -> float:
        return sum(predicted_seconds(c, n, cfg.eval_every) for c in runs)

    line = (
        f"{steps} steps per recipe: about {predicted(steps):.0f} s of the {max(left, 0):.0f} s "
        f"left of the {cfg.time_budget:g} s budget"
    )
    if steps < cfg.steps:
        line += f" (--steps {cfg.steps} would take {predicted(cfg.steps):.0f} s)"
    if predicted(steps) > left:
        line += "; not even one step per recipe fits, so the run will take longer"
    log(line)
    return steps, calibrations


def _set_telemetry(model: GPT, on: bool) -> None:
    enable_telemetry(model, 1 if on else 0)


def _tag_records(model: GPT, seen: dict[int, int], step: int) -> None:
    """Give the records each converted layer appended since the last call the step number."""
    for module in model.modules():
        records = getattr(getattr(module, "telemetry", None), "records", None)
        if records is None:
            continue
        for record in records[seen.get(id(module), 0) :]:
            record["step"] = step
        seen[id(module)] = len(records)


def _clock(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds >= 60 else f"{seconds} s"


def train_one(
    recipe: str,
    cfg: DemoConfig,
    corpus: bytes,
    log: Callable[[str], None],
    records: list[dict] | None = None,
    steps: int | None = None,
    *,
    loaded: Recipe | None = None,
    deadline: float | None = None,
    calibration: Calibration | None = None,
) -> tuple[list[Point], RecipeResult]:
    """Train one recipe for ``steps`` (default ``cfg.steps``); its telemetry records (if
    enabled) are appended to ``records``. With ``deadline`` (a ``time.perf_counter()`` value)
    the run stops early when its next step and final evaluation would end past it, their cost
    taken from ``calibration`` and the steps so far."""
    steps = cfg.steps if steps is None else steps
    device = torch.device(cfg.device)
    model = _build(recipe, cfg, steps, device, loaded)
    converted = recipe != "bf16"
    n_converted = count_converted(model)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"[{recipe}] {n_params / 1e6:.2f}M parameters, "
        f"{n_converted} linear layers converted, {steps} steps"
    )
    if converted and n_converted == 0:
        log(
            f"[{recipe}] warning: the recipe's layer rules keep every linear layer of this "
            f"{SIZES[cfg.size].layers}-block model in high precision, so it trains like bf16 "
            "(for small models use the *_small recipes)"
        )
    data = ByteBatches(corpus, model.cfg.context, seed=cfg.seed)
    opt = _optimizer(model, cfg.lr)
    points: list[Point] = []
    seen: dict[int, int] = {}
    start = last_log = time.perf_counter()
    step_times: list[float] = []
    stopped_early = False
    for step in range(steps):
        record = bool(cfg.telemetry_every) and converted and step % cfg.telemetry_every == 0
        if record:
            _set_telemetry(model, True)
        t0 = time.perf_counter()
        loss = _train_step(model, opt, data, step, steps, cfg, device, converted)
        if record:
            _set_telemetry(model, False)
            _tag_records(model, seen, step)
        if deadline is not None and step < steps - 1:
            step_times.append(time.perf_counter() - t0)  # host time: enough to stop in time
            stopped_early = _past_deadline(deadline, step_times, calibration)
        last = step == steps - 1 or stopped_early
        val = _val_loss(model, data, cfg, device) if step % cfg.eval_every == 0 or last else None
        points.append(Point(recipe, step, float(loss), val, time.perf_counter() - start))
        p = points[-1]
        if val is not None or p.seconds - (last_log - start) >= 10.0:
            last_log = time.perf_counter()
            rate = (step + 1) / max(p.seconds, 1e-9)
            shown = f"val {val:.4f}" if val is not None else " " * 10
            log(
                f"[{recipe}] step {step + 1:5d}/{steps}  train {p.train_loss:.4f}  {shown}  "
                f"{_clock(p.seconds)} elapsed, {rate:.2f} steps/s, "
                f"ETA {_clock((steps - step - 1) / rate)}"
            )
        if stopped_early:
            log(
                f"[{recipe}] stopped after {step + 1} of {steps} steps: its share of the time "
                "budget is spent"
            )
            break
    if records is not None and converted:
        records.extend({"recipe": recipe, **r} for r in telemetry(model))
    tail = [p.train_loss for p in points[-10:]]
    result = RecipeResult(
        recipe=recipe,
        parameters=n_params,
        converted=n_converted,
        steps=len(points),
        planned_steps=steps,
        seconds=points[-1].seconds,
        final_train_loss=sum(tail) / len(tail),
        final_val_loss=next(p.val_loss for p in reversed(points) if p.val_loss is not None),
        stopped_early=stopped_early,
    )
    return points, result


def _past_deadline(
    deadline: float, step_times: list[float], calibration: Calibration | None
) -> bool:
    """Would one more step and the final evaluation end past ``deadline``? A step costs the
    larger of the calibrated median and the median of the last steps (so a machine that slowed
    down is seen), the evaluation what calibration measured (without one: two steps)."""
    recent = statistics.median(step_times[-9:])
    step = recent if calibration is None else max(calibration.step, recent)
    evaluation = 2 * step if calibration is None else calibration.evaluation
    return time.perf_counter() + step + evaluation > deadline


def losses_csv(points: list[Point]) -> str:
    """recipe, step, train_loss, val_loss, seconds: one row per training step."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["recipe", "step", "train_loss", "val_loss", "seconds"])
    for p in points:
        val = "" if p.val_loss is None else f"{p.val_loss:.6f}"
        writer.writerow([p.recipe, p.step, f"{p.train_loss:.6f}", val, f"{p.seconds:.3f}"])
    return buf.getvalue()


def plot(points: list[Point], files: OutputFiles, name: str, title: str) -> bool:
    """Loss curves as the PNG ``name`` of ``files``; False (and nothing written) when matplotlib
    is not installed."""
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
    try:
        files.write_with(name, lambda path: fig.savefig(path, dpi=110, format="png"))
    finally:
        plt.close(fig)
    return True


@dataclass(frozen=True)
class Comparison:
    """A recipe's held-out loss against the baseline's, at one step both evaluated."""

    recipe: str
    baseline: str
    steps: int  # steps both had trained when compared
    gap: float  # recipe's held-out loss - the baseline's
    final: bool  # both runs ended there (else at least one trained on past it)


def compare(points: list[Point], recipe: str, baseline: str) -> Comparison | None:
    """``recipe``'s held-out loss minus ``baseline``'s at the last step both evaluated: runs that
    stopped at different steps (a time budget on a busy machine) are compared where they are
    comparable, not at their ends. None when no step was evaluated by both."""
    mine = {p.step: p for p in points if p.recipe == recipe and p.val_loss is not None}
    base = {p.step: p for p in points if p.recipe == baseline and p.val_loss is not None}
    common = sorted(mine.keys() & base.keys())
    if not common:
        return None
    step = common[-1]
    last = {max(p.step for p in points if p.recipe == r) for r in (recipe, baseline)}
    gap = mine[step].val_loss - base[step].val_loss  # type: ignore[operator]
    return Comparison(recipe, baseline, step + 1, gap, last == {step})


def summary_table(
    results: list[RecipeResult], points: list[Point], baseline: str = "bf16"
) -> tuple[str, list[str]]:
    """The summary table and the notes under it (what the gap column compares, when the runs
    stopped at different steps)."""
    has_base = any(r.recipe == baseline for r in results)
    rows, notes = [], []
    for r in results:
        gap = "-"
        if has_base and r.recipe != baseline:
            found = compare(points, r.recipe, baseline)
            if found is None:
                gap = "none"
                notes.append(
                    f"{r.recipe} and {baseline} have no evaluated step in common: their "
                    "held-out losses cannot be compared"
                )
            elif found.final:
                gap = f"{found.gap:+.4f}"
            else:
                gap = f"{found.gap:+.4f} @{found.steps}"
                notes.append(
                    f"{r.recipe} trained {r.steps} steps and {baseline} "
                    f"{_steps_of(results, baseline)}: val - {baseline} compares them after "
                    f"{found.steps} step(s), the last both evaluated, not their final losses"
                )
        steps = f"{r.steps}" + (f" of {r.planned_steps}" if r.stopped_early else "")
        rows.append(
            [
                r.recipe,
                str(r.converted),
                steps,
                f"{r.seconds:.1f}",
                f"{r.seconds / max(r.steps, 1) * 1e3:.1f}",
                f"{r.final_train_loss:.4f}",
                f"{r.final_val_loss:.4f}",
                gap,
            ]
        )
    headers = ["recipe", "converted", "steps", "seconds", "ms/step", "train (last 10)", "val"]
    return render_table([*headers, f"val - {baseline}"], rows), notes


def _steps_of(results: list[RecipeResult], recipe: str) -> int:
    return next(r.steps for r in results if r.recipe == recipe)


def _comparisons_json(
    results: list[RecipeResult], points: list[Point], baseline: str = "bf16"
) -> list[dict]:
    """summary.json's comparisons: each recipe against the baseline at a common step."""
    out = []
    if not any(r.recipe == baseline for r in results):
        return out
    for r in results:
        if r.recipe == baseline:
            continue
        found = compare(points, r.recipe, baseline)
        out.append(
            {"recipe": r.recipe, "baseline": baseline, "steps": None, "val_gap": None}
            if found is None
            else {
                "recipe": r.recipe,
                "baseline": baseline,
                "steps": found.steps,
                "val_gap": found.gap,
                "at_final_steps": found.final,
            }
        )
    return out


def run_demo(cfg: DemoConfig, log: Callable[[str], None] = print) -> list[Point]:
    if cfg.size not in SIZES:
        raise ValueError(f"unknown size {cfg.size!r}; expected one of {', '.join(SIZES)}")
    files = OutputFiles(cfg.out)
    files.refuse_existing(OUTPUT_FILES)  # a link in --out fails before anything trains
    handler = _LogLines(log)  # the runtime's notes (kernel fallbacks, logged once) in the log
    logger = logging.getLogger("fp4gen")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        return _run(cfg, log, files)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class _LogLines(logging.Handler):
    def __init__(self, log: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log(f"note ({record.name}): {record.getMessage()}")


def _recipe_deadline(
    cfg: DemoConfig,
    calibrations: dict[str, Calibration],
    remaining: tuple[str, ...],
    steps: int,
    started: float,
) -> float | None:
    """When the first of ``remaining`` must stop: what is left of the budget, shared by the
    remaining recipes in proportion to their predicted times (None without a budget)."""
    if cfg.time_budget is None:
        return None
    now = time.perf_counter()
    left = max(started + cfg.time_budget - now, 0.0)
    predicted = [predicted_seconds(calibrations[r], steps, cfg.eval_every) for r in remaining]
    return now + left * predicted[0] / max(sum(predicted), 1e-9)


def _run(cfg: DemoConfig, log: Callable[[str], None], files: OutputFiles) -> list[Point]:
    total = time.perf_counter()  # the time budget is for all of it
    loaded = load_recipes(cfg.recipes)  # every recipe checked before the first trains
    corpus = stdlib_corpus()
    gpt = SIZES[cfg.size]
    log(
        f"corpus: {len(corpus) / 1e6:.1f} MB of Python standard-library source; {cfg.size} GPT "
        f"({gpt.layers} blocks, width {gpt.width}, context {gpt.context}), batch {cfg.batch}, "
        f"device {cfg.device}"
    )
    steps, calibrations = plan_steps(cfg, corpus, log, loaded, started=total)
    timing = {r: c.step for r, c in calibrations.items()}
    points: list[Point] = []
    results: list[RecipeResult] = []
    records: list[dict] = []
    device_name = torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda") else None
    for i, recipe in enumerate(cfg.recipes):
        deadline = _recipe_deadline(cfg, calibrations, cfg.recipes[i:], steps, total)
        mine, result = train_one(
            recipe,
            cfg,
            corpus,
            log,
            records,
            steps,
            loaded=loaded[recipe],
            deadline=deadline,
            calibration=calibrations.get(recipe),
        )
        points += mine
        results.append(result)
        # written after every recipe, so an interrupted run keeps what it finished
        files.write_text("losses.csv", losses_csv(points))
        summary = {
            "size": cfg.size,
            "parameters": result.parameters,
            "batch": cfg.batch,
            "context": gpt.context,
            "device": cfg.device,
            "device_name": device_name,
            "steps": steps,
            "time_budget": cfg.time_budget,
            "calibration_seconds_per_step": timing,
            "seconds": time.perf_counter() - total,
            "recipes": [vars(r) for r in results],
            "comparisons": _comparisons_json(results, points),
        }
        files.write_text("summary.json", json.dumps(summary, indent=2))
        if cfg.telemetry_every:
            files.write_text("telemetry.json", json.dumps({"records": records}))
    table, notes = summary_table(results, points)
    log("\n" + table)
    for note in notes:
        log(note)
    if cfg.telemetry_every:
        path = cfg.out / "telemetry.json"
        log(f"wrote {path} ({len(records)} records; draw it with: fp4gen report {path})")
    title = f"{cfg.size} GPT on stdlib bytes, {steps} steps, batch {cfg.batch}"
    if plot(points, files, "losses.png", title):
        log(f"wrote {cfg.out / 'losses.csv'}, {cfg.out / 'losses.png'} and summary.json")
    else:
        log(f"wrote {cfg.out / 'losses.csv'} and summary.json (install matplotlib for the PNG)")
    replaced = files.replaced_text()
    if replaced is not None:
        log(replaced)
    log(f"total {_clock(time.perf_counter() - total)}")
    return points
