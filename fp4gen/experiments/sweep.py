"""``fp4gen sweep``: train every recipe (and the BF16 baseline) with K seeds, compare them.

A run is one (recipe, seed). Seed s fixes the initial weights (the model is built from
``torch.manual_seed(s)`` before any conversion), the order of the training batches (a generator
seeded with s that nothing else draws from) and the stochastic-rounding streams
(``convert(seed=s)``); the recipe changes nothing but the numerics. So for one seed every
recipe sees the same model and the same batches, and the paired difference of final losses
isolates the recipe (docs/experiments.md).

Everything is checked before the first run trains: numbers, device, model kind, every recipe,
the data, the output folder and any runs already in it. Each finished run is written atomically
to ``DIR/runs/<recipe>__seed<k>.json``; a rerun of the same command skips those. losses.csv and
summary.json are rewritten after every run, the PNGs at the end.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp4gen.demo.lr_schedule import lr_at
from fp4gen.errors import FP4GenError
from fp4gen.experiments.models import ModelSpec, find_model, require_family
from fp4gen.experiments.progress import Progress, clock
from fp4gen.experiments.stats import Interval, mean, relative_gaps, sample_std, t_interval
from fp4gen.outputs import OutputFiles
from fp4gen.table import render_table

if TYPE_CHECKING:  # torch is imported where a run needs it: the CLI's parser stays light
    import torch

    from fp4gen.experiments.data import TokenData

    Batches = list[tuple[torch.Tensor, torch.Tensor]]

BASELINE = "bf16"
RUN_FORMAT = "fp4gen-sweep-run/1"
SUMMARY_FORMAT = "fp4gen-sweep-summary/1"
# the optimizer and schedule, part of every run's settings: change it and old runs stop matching
SCHEDULE = "adamw(wd=0.1) warmup 5% cosine to 10% clip 1.0, bf16 autocast"
EVALS_PER_RUN = 10  # default held-out evaluations along a run (and always after the last step)
FINAL_TRAIN_STEPS = 10  # the final training loss is the mean of this many last steps
_LABEL = re.compile(r"[A-Za-z0-9_.-]+", re.ASCII)
# what a sweep writes into --out besides runs/<recipe>__seed<k>.json
OUTPUT_FILES = ("losses.csv", "summary.json", "loss_vs_tokens.png", "gap_to_bf16.png")


@dataclass(frozen=True)
class SweepConfig:
    recipes: tuple[str, ...]  # as given on the command line; bf16 is added if missing
    model: str = "gpt-tiny"
    tokens: int = 256_000  # training tokens per run (rounded up to whole steps)
    seeds: int = 3
    data: str | None = None  # None: the Python standard library's source bytes
    out: Path = Path("fp4gen-sweep")
    device: str = "auto"  # auto, cpu or cuda
    confidence: float = 0.95
    batch: int = 16
    lr: float | None = None  # None: the model's default
    eval_every: int | None = None  # steps; None: EVALS_PER_RUN evaluations along the run
    eval_batches: int = 8


@dataclass(frozen=True)
class RecipeEntry:
    label: str  # the name in file names, the CSV and the tables
    source: str  # what the command line said
    recipe: Any  # the loaded Recipe, None for the baseline
    fingerprint: str  # sha256 of the resolved recipe's canonical text ("bf16" for the baseline)
    quantized: int  # linear layers the recipe quantizes in this model
    linears: int  # linear layers of the model


@dataclass
class Plan:
    """A checked sweep: what trains, on what, and which runs are already finished."""

    cfg: SweepConfig
    spec: ModelSpec
    data: TokenData
    recipes: list[RecipeEntry]
    seeds: list[int]
    steps: int
    eval_every: int
    lr: float
    device: str
    settings: dict[str, Any]
    finished: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    parameters: int = 0
    files: OutputFiles = field(init=False)  # what the sweep writes into --out, and replaced

    def __post_init__(self) -> None:
        self.files = OutputFiles(self.cfg.out)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch * self.spec.context

    @property
    def runs(self) -> list[tuple[str, int]]:
        """Every run, seed-major: an interrupted sweep keeps whole seeds, and every recipe is
        timed during the first seed (the ETA needs each one's pace)."""
        return [(e.label, s) for s in self.seeds for e in self.recipes]

    @property
    def todo(self) -> list[tuple[str, int]]:
        return [run for run in self.runs if run not in self.finished]

    def run_name(self, label: str, seed: int) -> str:
        """A run file's name under --out."""
        return f"runs/{label}__seed{seed}.json"

    def run_path(self, label: str, seed: int) -> Path:
        return self.cfg.out / self.run_name(label, seed)


# ---------------------------------------------------------------------------------------------
# checking everything before the first run
# ---------------------------------------------------------------------------------------------


def parse_tokens(text: str) -> int:
    """'256k', '1.5M', '2e6', '1_000_000' -> a positive token count."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9, "t": 10**12}
    raw = text.strip().replace("_", "").lower()
    scale = units.get(raw[-1:], 1)
    number = raw[:-1] if raw[-1:] in units else raw
    try:
        value = float(number) * scale
    except ValueError:
        raise FP4GenError(
            f"--tokens {text!r}: expected a token count such as 300000, 300k or 1.5M"
        ) from None
    if not math.isfinite(value) or value < 1 or value > 1e15:
        raise FP4GenError(f"--tokens {text!r}: must be at least 1 (and at most 1e15)")
    return int(round(value))


def _label(source: str, path: Path | None) -> str:
    label = BASELINE if path is None else path.stem
    if not _LABEL.fullmatch(label) or label in (".", ".."):
        raise FP4GenError(
            f"recipe {source!r}: its file name {label!r} names the run files; use a plain name "
            "(letters, digits, '_', '-', '.')"
        )
    return label


def _load_recipes(names: tuple[str, ...], spec: ModelSpec, vocab: int) -> list[RecipeEntry]:
    """Every recipe loaded and checked, the baseline first; a recipe named twice runs once."""
    import torch

    from fp4gen.dsl import find_recipe, load_recipe, print_recipe
    from fp4gen.experiments.models import build_model
    from fp4gen.runtime.convert import plan_layers

    # the layer plan needs only the module tree: build it on the meta device (no memory, no
    # initialization), so even the largest model costs nothing to check
    with torch.device("meta"):
        skeleton = build_model(spec, vocab)
    from fp4gen.runtime.experts import ExpertsLayout, experts_layout

    # the layers a recipe may quantize: every nn.Linear and every grouped-experts module (one
    # layer each, as plan_layers counts them)
    linears = sum(
        isinstance(m, torch.nn.Linear) or isinstance(experts_layout(m), ExpertsLayout)
        for m in skeleton.modules()
    )

    entries: dict[str, RecipeEntry] = {
        BASELINE: RecipeEntry(BASELINE, BASELINE, None, BASELINE, 0, linears)
    }
    paths: dict[str, Path | None] = {BASELINE: None}
    for name in names:
        if name == BASELINE:
            continue
        path = find_recipe(name).resolve()
        label = _label(name, path)
        if label in paths:
            if paths[label] == path:
                continue  # the same recipe twice
            first = "the baseline" if paths[label] is None else str(paths[label])
            raise FP4GenError(
                f"recipe {name!r} and {first} would both be named {label!r}; rename one file"
            )
        recipe = load_recipe(path)
        text = print_recipe(recipe)
        quantized = sum(not d.kept for d in plan_layers(skeleton, recipe))
        paths[label] = path
        entries[label] = RecipeEntry(
            label,
            name,
            recipe,
            hashlib.sha256(text.encode()).hexdigest(),
            quantized,
            linears,
        )
    return list(entries.values())


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise FP4GenError("--device cuda: torch sees no CUDA device")
    if device not in ("cpu", "cuda"):
        raise FP4GenError(f"--device {device!r}: expected auto, cpu or cuda")
    return device


def _check_numbers(cfg: SweepConfig) -> None:
    if cfg.seeds < 1:
        raise FP4GenError(f"--seeds must be at least 1, got {cfg.seeds}")
    if cfg.seeds > 1000:
        raise FP4GenError(f"--seeds must be at most 1000, got {cfg.seeds}")
    if cfg.tokens < 1:
        raise FP4GenError(f"--tokens must be positive, got {cfg.tokens}")
    if cfg.batch < 1:
        raise FP4GenError(f"--batch must be at least 1, got {cfg.batch}")
    if cfg.eval_batches < 1:
        raise FP4GenError(f"--eval-batches must be at least 1, got {cfg.eval_batches}")
    if cfg.eval_every is not None and cfg.eval_every < 1:
        raise FP4GenError(f"--eval-every must be at least 1, got {cfg.eval_every}")
    # NaN fails every comparison: finiteness first
    if not (math.isfinite(cfg.confidence) and 0.0 < cfg.confidence < 1.0):
        raise FP4GenError(
            f"--confidence must lie strictly between 0 and 1 (0.95 is 95%), got {cfg.confidence}"
        )
    if cfg.lr is not None and not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise FP4GenError(f"--lr must be a positive, finite learning rate, got {cfg.lr}")
    if not cfg.recipes:
        raise FP4GenError("name at least one recipe (bf16 alone trains only the baseline)")


def _prepare_out(out: Path) -> None:
    """The output folder and its runs/ exist, or a one-line error."""
    if "\0" in str(out):
        raise FP4GenError(f"--out {str(out)!r}: a folder name holds no NUL byte")
    if out.exists() and not out.is_dir():
        raise FP4GenError(f"--out {out}: exists and is not a folder")
    try:
        (out / "runs").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise FP4GenError(f"--out {out}: cannot write there ({err.strerror or err})") from None


def _check_out_files(plan: Plan) -> None:
    """Every file the sweep writes can be written: no symbolic link at its name or on its way
    out of --out, and the folder takes files (a one-line error before anything trains)."""
    names = [plan.run_name(label, seed) for label, seed in plan.runs]
    plan.files.refuse_existing([*names, *OUTPUT_FILES])
    probe = f"runs/.probe-{os.getpid()}"
    plan.files.write_bytes(probe, b"")
    plan.files.remove(probe)


def _finished_runs(plan: Plan, log: Callable[[str], None]) -> dict[tuple[str, int], dict]:
    """The runs of this sweep already in DIR/runs. One trained with other settings (model,
    tokens, data, batch, learning rate, ...) or another version of its recipe stops the sweep:
    its results would be mixed with runs they cannot be compared with."""
    finished: dict[tuple[str, int], dict] = {}
    fingerprints = {e.label: e.fingerprint for e in plan.recipes}
    for label, seed in plan.runs:
        path = plan.run_path(label, seed)
        if not path.exists():
            continue
        try:
            run = json.loads(path.read_text())
            if run.get("format") != RUN_FORMAT:
                raise ValueError("not a sweep run file")
        except (OSError, ValueError, AttributeError) as err:
            log(f"note: {path} is unreadable ({err}); that run trains again")
            continue
        if run.get("settings") != plan.settings:
            theirs, ours = run.get("settings") or {}, plan.settings
            diff = [k for k in ours if theirs.get(k) != ours[k]] or ["format"]
            shown = ", ".join(f"{k} {theirs.get(k)!r} (now {ours[k]!r})" for k in diff[:3])
            raise FP4GenError(
                f"{path} was trained with other settings: {shown}; use another --out, or remove "
                f"{plan.cfg.out / 'runs'} to start over"
            )
        if run.get("recipe_fingerprint") != fingerprints[label]:
            raise FP4GenError(
                f"{path} was trained with another version of recipe {label} (its resolved text "
                f"changed); use another --out, or remove that file to train it again"
            )
        finished[(label, seed)] = run
    return finished


def prepare(cfg: SweepConfig, log: Callable[[str], None] = print) -> Plan:
    """Check everything a sweep needs, cheapest first, before anything trains."""
    _check_numbers(cfg)
    spec = find_model(cfg.model)
    require_family(spec)
    device = _resolve_device(cfg.device)
    from fp4gen.experiments.data import load_data

    data = load_data(cfg.data, spec.context)
    recipes = _load_recipes(cfg.recipes, spec, data.vocab)
    _prepare_out(cfg.out)
    steps = max(1, math.ceil(cfg.tokens / (cfg.batch * spec.context)))
    eval_every = cfg.eval_every or max(1, math.ceil(steps / EVALS_PER_RUN))
    lr = cfg.lr if cfg.lr is not None else spec.lr
    settings = {
        "model": spec.name,
        "vocab": data.vocab,
        "context": spec.context,
        "batch": cfg.batch,
        "steps": steps,
        "lr": lr,
        "eval_every": eval_every,
        "eval_batches": cfg.eval_batches,
        "data": data.fingerprint,
        "schedule": SCHEDULE,
    }
    plan = Plan(
        cfg=cfg,
        spec=spec,
        data=data,
        recipes=recipes,
        seeds=list(range(cfg.seeds)),
        steps=steps,
        eval_every=eval_every,
        lr=lr,
        device=device,
        settings=settings,
        parameters=spec.parameters(data.vocab),
    )
    _check_out_files(plan)
    plan.finished = _finished_runs(plan, log)
    return plan


# ---------------------------------------------------------------------------------------------
# training one run
# ---------------------------------------------------------------------------------------------


def build_run_model(plan: Plan, entry: RecipeEntry, seed: int) -> torch.nn.Module:
    """The model of run (entry, seed): the seed's initial weights, built on the CPU (the same
    weights on every device), then converted to the recipe unless it is the baseline."""
    import torch

    from fp4gen.experiments.models import build_model
    from fp4gen.runtime.convert import convert

    torch.manual_seed(seed)
    model = build_model(plan.spec, plan.data.vocab)
    model = model.to(plan.device)
    if entry.recipe is not None:
        convert(model, entry.recipe, seed=seed, total_steps=plan.steps)
    return model


def model_loss(
    model: torch.nn.Module, spec: ModelSpec, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """The training and held-out loss (a module-level name, so tests can watch the batches)."""
    from fp4gen.experiments.models import model_loss as loss

    return loss(model, spec, x, y)


def _held_out_loss(model: torch.nn.Module, plan: Plan, batches: Batches) -> float:
    import torch

    model.eval()
    with torch.no_grad(), torch.autocast(torch.device(plan.device).type, dtype=torch.bfloat16):
        losses = [
            model_loss(model, plan.spec, x.to(plan.device), y.to(plan.device)) for x, y in batches
        ]
    model.train()
    return float(torch.stack([loss.float() for loss in losses]).mean())


def train_run(
    plan: Plan, entry: RecipeEntry, seed: int, held_out: Batches, progress: Progress
) -> dict[str, Any]:
    """Train one (recipe, seed) run and return its record (what runs/<...>.json holds)."""
    import torch

    from fp4gen.experiments.data import TokenBatches
    from fp4gen.runtime.convert import count_converted, set_step

    device = torch.device(plan.device)
    model = build_run_model(plan, entry, seed)
    converted = count_converted(model) if entry.recipe is not None else 0
    # seeded with the run's seed and drawn from by nothing else: the same batches for every
    # recipe of this seed
    batches = TokenBatches(plan.data.tokens, plan.spec.context, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=plan.lr, weight_decay=0.1)
    losses: list[torch.Tensor] = []  # kept on the device: reading one waits for the GPU
    evals: list[tuple[int, float]] = []
    start = time.perf_counter()
    for step in range(plan.steps):
        if entry.recipe is not None:
            set_step(model, step)  # drives the recipe's precision schedule
        for group in opt.param_groups:
            group["lr"] = lr_at(step, plan.steps, plan.lr)
        x, y = batches.batch(plan.cfg.batch)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model_loss(model, plan.spec, x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach().float())
        if (step + 1) % plan.eval_every == 0 or step + 1 == plan.steps:
            evals.append((step, _held_out_loss(model, plan, held_out)))
        progress.step(step, lambda: float(losses[-1]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    train = torch.stack(losses).cpu().tolist()
    if not all(math.isfinite(v) for v in train) or not all(math.isfinite(v) for _, v in evals):
        progress.write(f"warning: {entry.label} seed {seed} diverged (a loss is not finite)")
    tail = train[-FINAL_TRAIN_STEPS:]
    return {
        "format": RUN_FORMAT,
        "recipe": entry.label,
        "recipe_source": entry.source,
        "recipe_fingerprint": entry.fingerprint,
        "seed": seed,
        "settings": plan.settings,
        "parameters": sum(p.numel() for p in model.parameters()),
        "converted_layers": converted,
        "tokens_per_step": plan.tokens_per_step,
        "seconds": seconds,
        "device": plan.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "train_loss": [_finite(v) for v in train],
        "eval": [[s, _finite(v)] for s, v in evals],
        "final_train_loss": _finite(sum(tail) / len(tail)),
        "final_eval_loss": _finite(evals[-1][1]),
    }


def _finite(value: float) -> float | None:
    """JSON holds no NaN or Infinity: a diverged loss is null."""
    return value if math.isfinite(value) else None


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------


def losses_csv(plan: Plan, runs: dict[tuple[str, int], dict]) -> str:
    """recipe, seed, step, tokens, train_loss, eval_loss: one row per training step; eval_loss
    is empty except after the steps that were evaluated (tokens: seen after that step)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["recipe", "seed", "step", "tokens", "train_loss", "eval_loss"])
    for key in plan.runs:
        run = runs.get(key)
        if run is None:
            continue
        evals = {s: v for s, v in run["eval"]}
        tps = run["tokens_per_step"]
        for step, loss in enumerate(run["train_loss"]):
            ev = evals.get(step)
            writer.writerow(
                [
                    run["recipe"],
                    run["seed"],
                    step,
                    (step + 1) * tps,
                    "nan" if loss is None else f"{loss:.6f}",
                    "" if step not in evals else ("nan" if ev is None else f"{ev:.6f}"),
                ]
            )
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------------


def _stats(values: list[float]) -> dict[str, Any]:
    return {
        "values": values,
        "mean": mean(values) if values else None,
        "std": sample_std(values),
    }


def summarize(plan: Plan, runs: dict[tuple[str, int], dict]) -> dict[str, Any]:
    """summary.json: per recipe the final losses over seeds and the paired relative gap to
    BF16 with its Student-t interval at the chosen confidence."""
    conf = plan.cfg.confidence
    base = {s: runs[(BASELINE, s)]["final_eval_loss"] for s in plan.seeds if (BASELINE, s) in runs}
    rows = []
    for entry in plan.recipes:
        mine = {s: runs[(entry.label, s)] for s in plan.seeds if (entry.label, s) in runs}
        finals = {s: r["final_eval_loss"] for s, r in mine.items()}
        ok = {s: v for s, v in finals.items() if v is not None}
        row: dict[str, Any] = {
            "recipe": entry.label,
            "source": entry.source,
            "quantized_layers": entry.quantized,
            "linear_layers": entry.linears,
            "seeds": sorted(mine),
            "diverged_seeds": sorted(s for s, v in finals.items() if v is None),
            "final_eval_loss": _stats([ok[s] for s in sorted(ok)]),
            "final_train_loss": _stats(
                [r["final_train_loss"] for r in mine.values() if r["final_train_loss"] is not None]
            ),
            "seconds_per_step": (
                mean([r["seconds"] / plan.steps for r in mine.values()]) if mine else None
            ),
            "gap_to_bf16_percent": None,
        }
        if entry.label != BASELINE:
            paired = sorted(s for s in ok if base.get(s) is not None)
            row["gap_to_bf16_percent"] = _gap(
                paired, [ok[s] for s in paired], [base[s] for s in paired], conf
            )
        rows.append(row)
    return {
        "format": SUMMARY_FORMAT,
        "complete": all(run in runs for run in plan.runs),
        "runs_finished": sum(run in runs for run in plan.runs),
        "runs_planned": len(plan.runs),
        "baseline": BASELINE,
        "confidence": conf,
        "model": {
            "name": plan.spec.name,
            "family": plan.spec.family,
            "layers": plan.spec.layers,
            "width": plan.spec.width,
            "heads": plan.spec.heads,
            "context": plan.spec.context,
            "parameters": plan.parameters,
        },
        "data": {
            "source": plan.data.source,
            "tokens": len(plan.data.tokens),
            "vocab": plan.data.vocab,
            "sha256": plan.data.fingerprint,
        },
        "steps": plan.steps,
        "tokens_per_run": plan.steps * plan.tokens_per_step,
        "batch": plan.cfg.batch,
        "lr": plan.lr,
        "eval_every": plan.eval_every,
        "eval_batches": plan.cfg.eval_batches,
        "seeds": plan.seeds,
        "devices": sorted({r["device_name"] or r["device"] for r in runs.values()}),
        "recipes": rows,
    }


def _gap(seeds: list[int], losses: list[float], base: list[float], conf: float) -> dict | None:
    if not seeds:
        return None
    gaps = [100.0 * g for g in relative_gaps(losses, base)]
    interval: Interval = t_interval(gaps, conf)
    verdict = interval.distinguishable
    return {
        "paired_seeds": seeds,
        "values": gaps,
        "mean": interval.mean,
        "std": interval.std,
        "ci_low": interval.low,
        "ci_high": interval.high,
        "t_quantile": interval.t,
        "degrees_of_freedom": len(seeds) - 1,
        "distinguishable": None if verdict is None else ("yes" if verdict else "no"),
        "note": (
            "one seed: the interval is undefined (no spread to estimate); run --seeds 2 or more"
            if interval.low is None
            else None
        ),
    }


def summary_table(summary: dict[str, Any]) -> str:
    pct = f"{summary['confidence'] * 100:g}%"
    rows = []
    for r in summary["recipes"]:
        final = r["final_eval_loss"]
        loss = "-" if final["mean"] is None else f"{final['mean']:.4f}"
        if final["std"] is not None:
            loss += f" ± {final['std']:.4f}"
        gap = r["gap_to_bf16_percent"]
        if r["recipe"] == summary["baseline"]:
            gap_text, verdict = "baseline", "-"
        elif gap is None:
            gap_text, verdict = "-", "-"
        elif gap["ci_low"] is None:
            gap_text, verdict = f"{gap['mean']:+.2f}% (interval undefined: 1 seed)", "undefined"
        else:
            gap_text = f"{gap['mean']:+.2f}% [{gap['ci_low']:+.2f}%, {gap['ci_high']:+.2f}%]"
            verdict = gap["distinguishable"]
        rows.append(
            [
                r["recipe"],
                str(len(r["seeds"])),
                f"{r['quantized_layers']}/{r['linear_layers']}",
                loss,
                gap_text,
                verdict,
            ]
        )
    headers = [
        "recipe",
        "seeds",
        "quantized",
        "final eval loss (mean ± std)",
        f"gap to bf16 ({pct} CI)",
        f"distinguishable at {pct}",
    ]
    return render_table(headers, rows)


# ---------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------


def _ema(values: list[float | None], weight: float = 0.9) -> list[float]:
    out, acc = [], None
    for v in values:
        v = math.nan if v is None else v
        acc = v if acc is None or not math.isfinite(acc) else weight * acc + (1 - weight) * v
        out.append(acc)
    return out


def plot(
    plan: Plan, runs: dict[tuple[str, int], dict], summary: dict, files: OutputFiles
) -> list[Path]:
    """loss_vs_tokens.png (mean over seeds, band from the lowest to the highest seed) and
    gap_to_bf16.png (each seed's gap, the mean and its interval; not for bf16 alone); the
    paths written, [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, entry in enumerate(plan.recipes):
        mine = [runs[(entry.label, s)] for s in plan.seeds if (entry.label, s) in runs]
        if not mine:
            continue
        color = f"C{i % 10}"
        tps = mine[0]["tokens_per_step"]
        tokens = [(k + 1) * tps for k in range(plan.steps)]
        curves = [_ema(r["train_loss"]) for r in mine]  # smoothed per run, then over seeds
        _band(ax_train, tokens, curves, color, f"{entry.label} ({len(mine)} seeds)")
        steps = [s for s, _ in mine[0]["eval"]]
        evals = [[math.nan if v is None else v for _, v in r["eval"]] for r in mine]
        _band(ax_eval, [(s + 1) * tps for s in steps], evals, color, entry.label, marker="o")
    title = (
        f"{plan.spec.name}, {plan.steps} steps x {plan.tokens_per_step} tokens; "
        "line: mean over seeds, band: min to max"
    )
    ax_train.set(title="training loss (EMA 0.9)", xlabel="tokens", ylabel="cross-entropy (nats)")
    ax_eval.set(title="held-out loss", xlabel="tokens")
    for ax in (ax_train, ax_eval):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    curves_path = _save_png(fig, files, "loss_vs_tokens.png")

    rows = [r for r in summary["recipes"] if r["gap_to_bf16_percent"] is not None]
    if not rows:  # bf16 alone: no gap to draw
        return [curves_path]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.6 * len(rows)))
    pct = f"{summary['confidence'] * 100:g}%"
    for y, r in enumerate(rows):
        gap = r["gap_to_bf16_percent"]
        ax.scatter(gap["values"], [y] * len(gap["values"]), color="0.55", s=14, zorder=2)
        if gap["ci_low"] is not None:
            ax.errorbar(
                gap["mean"],
                y,
                xerr=[[gap["mean"] - gap["ci_low"]], [gap["ci_high"] - gap["mean"]]],
                fmt="o",
                color="C3" if gap["distinguishable"] == "yes" else "C0",
                capsize=4,
                zorder=3,
            )
        else:
            ax.scatter([gap["mean"]], [y], color="C0", marker="o", zorder=3)
    ax.axvline(0.0, color="k", lw=0.8)
    ax.set_yticks(range(len(rows)), [r["recipe"] for r in rows])
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.invert_yaxis()
    ax.set_xlabel("final held-out loss gap to bf16 (%), paired by seed")
    ax.set_title(
        f"mean and {pct} t-interval over {len(plan.seeds)} seeds (grey: each seed; red: "
        "interval excludes 0)",
        fontsize=9,
    )
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    gap_path = _save_png(fig, files, "gap_to_bf16.png")
    return [curves_path, gap_path]


def _save_png(fig: Any, files: OutputFiles, name: str) -> Path:
    """Write a figure whole (fp4gen.outputs) and close it."""
    import matplotlib.pyplot as plt

    try:
        return files.write_with(name, lambda path: fig.savefig(path, dpi=110, format="png"))
    finally:
        plt.close(fig)


def _band(ax: Any, x: list[int], curves: list[list[float]], color: str, label: str, **kw) -> None:
    n = min(len(c) for c in curves)
    x = x[:n]
    columns = list(zip(*(c[:n] for c in curves), strict=True))
    ax.plot(x, [mean(col) for col in columns], color=color, label=label, lw=1.3, **kw)
    if len(curves) > 1:
        ax.fill_between(
            x, [min(col) for col in columns], [max(col) for col in columns], color=color, alpha=0.2
        )


# ---------------------------------------------------------------------------------------------
# the sweep
# ---------------------------------------------------------------------------------------------


@contextmanager
def _runtime_notes(progress: Progress) -> Iterator[None]:
    """The runtime's notes (a kernel that falls back to the reference, logged once) go to the
    sweep's log, between the progress lines, each text once per sweep: every run converts a
    fresh model, so ``fp4gen.convert``'s list of the parameters it keeps in high precision
    would otherwise repeat before every run of a recipe."""
    written: set[str] = set()

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            line = f"note ({record.name}): {record.getMessage()}"
            if line not in written:
                written.add(line)
                progress.write(line)

    logger = logging.getLogger("fp4gen")
    handler, level = Lines(logging.INFO), logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def describe_plan(plan: Plan) -> list[str]:
    spec, data = plan.spec, plan.data
    lines = [
        f"sweep: {len(plan.recipes)} recipes x {len(plan.seeds)} seeds = {len(plan.runs)} runs "
        f"on {plan.device}; {spec.name} ({plan.parameters / 1e6:.2f}M parameters, "
        f"{spec.layers} blocks x {spec.width}, context {spec.context}), batch {plan.cfg.batch}, "
        f"lr {plan.lr:g}: {plan.steps} steps = {plan.steps * plan.tokens_per_step:,} tokens "
        "per run",
        f"data: {data.source} ({data.split:,} training / {len(data.tokens) - data.split:,} "
        f"held-out tokens); held-out loss every {plan.eval_every} steps on "
        f"{plan.cfg.eval_batches} fixed batches",
    ]
    for e in plan.recipes:
        what = (
            "the baseline: the unconverted model under bf16 autocast"
            if e.recipe is None
            else f"{e.quantized} of {e.linears} linear layers quantized"
        )
        lines.append(f"  {e.label}: {what}")
        if e.recipe is not None and e.quantized == 0:
            lines.append(
                f"  warning: {e.label} keeps every linear layer of {spec.name} in high precision "
                f"({spec.layers} blocks), so it trains like bf16; its layer rules are meant for "
                "deeper models (use the *_small recipes or a deeper --model)"
            )
    return lines


def run_sweep(
    cfg: SweepConfig,
    log: Callable[[str], None] = print,
    progress_factory: Callable[..., Progress] = Progress,
) -> dict[str, Any]:
    """Check, train what is not finished, write losses.csv, summary.json and the PNGs, print
    the summary table; returns the summary."""
    started = time.perf_counter()
    plan = prepare(cfg, log)  # everything checked before the first run trains
    for line in describe_plan(plan):
        log(line)
    out = cfg.out
    if plan.finished:
        names = ", ".join(f"{r} seed {s}" for r, s in plan.runs if (r, s) in plan.finished)
        log(
            f"resuming: {len(plan.finished)} of {len(plan.runs)} runs already finished in "
            f"{out / 'runs'}, skipped ({names})"
        )
    todo = plan.todo
    runs = dict(plan.finished)
    if todo:
        from fp4gen.experiments.data import held_out_batches

        held_out = held_out_batches(plan.data, plan.spec.context, cfg.eval_batches, cfg.batch)
        entries = {e.label: e for e in plan.recipes}
        progress = progress_factory(todo, plan.steps)
        try:
            with _runtime_notes(progress):
                for label, seed in todo:
                    progress.start_run(label, seed)
                    run = train_run(plan, entries[label], seed, held_out, progress)
                    text = json.dumps(run, indent=1, allow_nan=False)
                    path = plan.files.write_text(plan.run_name(label, seed), text)
                    runs[(label, seed)] = run
                    progress.end_run(run["final_eval_loss"] or math.nan, str(path))
                    # rewritten after every run: an interrupted sweep's files show what finished
                    _write_tables(plan, runs)
        finally:
            progress.close()
    else:
        log("nothing to train: every run is finished")
    summary = _write_tables(plan, runs)
    log("\n" + summary_table(summary))
    if any(
        r["gap_to_bf16_percent"] and r["gap_to_bf16_percent"]["note"] for r in summary["recipes"]
    ):
        log("with one seed the interval is undefined: run --seeds 2 or more")
    pngs = plot(plan, runs, summary, plan.files)
    written = ["losses.csv", "summary.json", *(p.name for p in pngs)]
    log(f"wrote {', '.join(str(out / w) for w in written)}")
    if not pngs:
        log("(install matplotlib for the PNGs: pip install matplotlib)")
    replaced = plan.files.replaced_text()
    if replaced is not None:  # files of an earlier sweep (or anyone's) in --out
        log(replaced)
    log(f"total {clock(time.perf_counter() - started)}")
    return summary


def _write_tables(plan: Plan, runs: dict[tuple[str, int], dict]) -> dict[str, Any]:
    summary = summarize(plan, runs)
    plan.files.write_text("losses.csv", losses_csv(plan, runs))
    plan.files.write_text("summary.json", json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return summary
