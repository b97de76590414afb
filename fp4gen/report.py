"""``fp4gen report``: MoR-paper-style heatmaps of quantization telemetry (registered by the CLI).

Input: a telemetry JSON, either a list of records or an object with a ``records`` list, as
``fp4gen demo --telemetry N`` writes (``telemetry.json``) or as a user writes from
``fp4gen.telemetry(model)``::

    json.dump({"records": fp4gen.telemetry(model)}, open("telemetry.json", "w"))

Each record names its ``layer`` and ``operand`` (and optionally its ``recipe``). MoR records
carry ``rel_error_hist`` (decision units per 0.5% relative-error bin, 0..20% and >= 20%) and
``fallback`` (the fraction of units kept in high precision); a record of a block-scaled operand
counts once, in the bin of its ``mean_rel_error``. Rows of the heatmap are layer/operand pairs
(``--by operand``: one row per operand over all layers), columns the error bins; each row is
normalized to sum to 1 (the MoR paper's Figure 11), and a side panel shows the share of decision
units kept in high precision (over the row's records, weighted by their units).

A second table gives, per recipe and operand, the share of decision units kept in high precision
(BF16 for the shipped MoR recipes) over all layers and records, and at the first and the last
recorded step. When the records carry a ``step`` (the demo's do), a second PNG
(``<name>_fallback.png``) draws that share over training, one line per operand. Needs no torch;
the PNGs need matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4gen.errors import FP4GenError
from fp4gen.outputs import OutputFiles
from fp4gen.table import render_table

BIN_WIDTH = 0.005  # the 0.5% bins of fp4gen.numerics.mor
BINS = 41  # 0..20% in 0.5% steps, then >= 20%
OPERAND_ORDER = (
    "fprop.activation",
    "fprop.weight",
    "dgrad.gradient",
    "dgrad.weight",
    "wgrad.gradient",
    "wgrad.activation",
)

REPORT_EPILOG = """\
examples:
  fp4gen demo --recipes mor_tensor,mor_subtensor_3way --telemetry 10 --out run
  fp4gen report run/telemetry.json --out run/heatmap.png
  fp4gen report run/telemetry.json --by operand --out run/heatmap_by_operand.png
  fp4gen report telemetry.json --recipe mor_tensor --json
"""
ALL_LAYERS = "all layers"


@dataclass(frozen=True)
class Heatmap:
    """Aggregated telemetry: one row per (recipe, layer, operand)."""

    rows: list[tuple[str, str, str]]
    counts: list[list[int]]  # [rows][BINS]
    records: list[int]  # telemetry records per row
    fallback: list[float | None]  # share of decision units kept per row (None: no MoR records)
    threshold: float | None  # the relerr threshold, when every MoR record has the same one

    def normalized(self) -> list[list[float]]:
        return [[c / max(sum(row), 1) for c in row] for row in self.counts]

    def label(self, i: int) -> str:
        recipe, layer, operand = self.rows[i]
        multi = len({r for r, _, _ in self.rows}) > 1
        return f"{recipe}: {layer} {operand}" if multi else f"{layer} {operand}"

    def as_json(self) -> dict[str, Any]:
        return {
            "bin_width": BIN_WIDTH,
            "bins": BINS,
            "threshold": self.threshold,
            "rows": [
                {
                    "recipe": recipe,
                    "layer": layer,
                    "operand": operand,
                    "records": n,
                    "counts": counts,
                    "fallback": fallback,
                }
                for (recipe, layer, operand), counts, n, fallback in zip(
                    self.rows, self.counts, self.records, self.fallback, strict=True
                )
            ],
        }


def load_records(path: Path) -> list[dict[str, Any]]:
    if "\0" in str(path):
        raise FP4GenError(f"cannot read {str(path)!r}: a file name holds no NUL byte")
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise FP4GenError(f"cannot read {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise FP4GenError(f"{path} is not JSON: not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise FP4GenError(f"{path} is not JSON: {err}") from None
    except RecursionError:
        raise FP4GenError(f"{path}: its JSON nests too deeply for telemetry records") from None
    except ValueError as err:  # an integer of more than 4300 digits, a name the OS rejects
        raise FP4GenError(f"cannot read telemetry from {path}: {err}") from None
    records = data.get("records") if isinstance(data, dict) else data
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise FP4GenError(f"{path}: expected a list of telemetry records or {{'records': [...]}}")
    for i, rec in enumerate(records):
        check_record(i, rec)
    return records


def _is_number(value: Any, finite: bool = False) -> bool:
    """A JSON number within float's range (an integer of 400 digits is not), finite if asked."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        number = float(value)
    except OverflowError:
        return False
    return not finite or math.isfinite(number)


def check_record(i: int, rec: dict[str, Any]) -> None:
    """FP4GenError naming the record, the field and the rule for a field value the report
    cannot use (the fields ``fp4gen.telemetry`` writes; others are ignored)."""

    def bad(field: str, rule: str) -> FP4GenError:
        shown = reprlib.repr(rec[field])  # short: nested and long values are elided
        return FP4GenError(f"telemetry record {i}: {field!r} must be {rule}, got {shown}")

    for field in ("recipe", "layer", "operand"):
        if field in rec and not (isinstance(rec[field], str) or _is_number(rec[field])):
            raise bad(field, "a name (a string or a number)")
    hist = rec.get("rel_error_hist")
    if hist is not None and not (
        isinstance(hist, list) and all(_is_number(c, finite=True) and c >= 0 for c in hist)
    ):
        raise bad("rel_error_hist", "a list of finite, non-negative counts")
    if "mean_rel_error" in rec and not _is_number(rec["mean_rel_error"]):
        raise bad("mean_rel_error", "a number")
    if rec.get("fallback") is not None and not _is_number(rec["fallback"]):
        raise bad("fallback", "a number (the share of units kept in high precision) or null")
    units = rec.get("units", 0)
    if not (_is_number(units, finite=True) and 0 <= units < 2**53):
        raise bad("units", "a count of decision units from 0 to 2^53")
    for field in ("step", "call"):
        if field in rec and not _is_number(rec[field], finite=True):
            raise bad(field, "a finite number")
    t = rec.get("threshold")
    if t is not None and not (_is_number(t) and 0 < t < 1):
        raise bad("threshold", "a relative error between 0 and 1 (exclusive) or null")


def error_bin(error: float) -> int:
    """The bin of a relative error: i with i/200 <= error < (i+1)/200, the last for >= 20%."""
    if not math.isfinite(error):
        return BINS - 1
    # clamped before int(): error * 200 of a huge finite error is inf, which int() refuses
    return int(min(max(error * 200, 0.0), BINS - 1))


def _share(recs: list[dict[str, Any]]) -> float:
    units = sum(int(r.get("units", 1)) for r in recs)
    kept = sum(float(r["fallback"]) * int(r.get("units", 1)) for r in recs)
    return kept / max(units, 1)


def aggregate(
    records: list[dict[str, Any]], recipe: str | None = None, by: str = "layer"
) -> Heatmap:
    """Sum the records' histograms per (recipe, layer, operand), or per (recipe, operand) over
    all layers when ``by`` is "operand"."""
    if by not in ("layer", "operand"):
        raise FP4GenError(f"cannot group telemetry by {by!r}; expected 'layer' or 'operand'")
    order: dict[tuple[str, str, str], int] = {}
    counts: dict[tuple[str, str, str], list[int]] = {}
    n: dict[tuple[str, str, str], int] = {}
    fallbacks: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    recipes: dict[str, int] = {}
    layers: dict[str, int] = {}
    thresholds: set[float | None] = set()
    for i, rec in enumerate(records):
        name = str(rec.get("recipe", ""))
        if recipe is not None and name != recipe:
            continue
        if "layer" not in rec or "operand" not in rec:
            raise FP4GenError(f"telemetry record {i} has no 'layer' or 'operand'")
        layer = ALL_LAYERS if by == "operand" else str(rec["layer"])
        key = (name, layer, str(rec["operand"]))
        hist = rec.get("rel_error_hist")
        if hist is None:
            if "mean_rel_error" not in rec:
                continue
            hist = [0] * BINS
            hist[error_bin(float(rec["mean_rel_error"]))] = 1
        elif len(hist) != BINS:
            raise FP4GenError(f"telemetry record {i}: rel_error_hist has {len(hist)} bins, not 41")
        recipes.setdefault(name, len(recipes))
        layers.setdefault(key[1], len(layers))
        order.setdefault(key, len(order))
        row = counts.setdefault(key, [0] * BINS)
        for b, c in enumerate(hist):
            row[b] += int(c)
        n[key] = n.get(key, 0) + 1
        if rec.get("fallback") is not None:
            fallbacks.setdefault(key, []).append(rec)
        if "mor" in rec:
            t = rec.get("threshold")
            thresholds.add(None if t is None else float(t))
    if not order:
        which = f" of recipe {recipe!r}" if recipe is not None else ""
        raise FP4GenError(f"no telemetry records{which} with a relative error to plot")

    def sort_key(key: tuple[str, str, str]) -> tuple[int, int, int, int]:
        op = OPERAND_ORDER.index(key[2]) if key[2] in OPERAND_ORDER else len(OPERAND_ORDER)
        return recipes[key[0]], layers[key[1]], op, order[key]

    rows = sorted(order, key=sort_key)
    return Heatmap(
        rows=rows,
        counts=[counts[k] for k in rows],
        records=[n[k] for k in rows],
        fallback=[_share(fallbacks[k]) if k in fallbacks else None for k in rows],
        threshold=next(iter(thresholds)) if len(thresholds) == 1 else None,
    )


def draw(heatmap: Heatmap, path: Path, title: str, files: OutputFiles | None = None) -> None:
    """Write the heatmap (and the fallback panel) as a PNG (``files``: the output folder's
    files, ``path`` one of them; default: the folder of ``path``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FP4GenError("fp4gen report needs matplotlib: pip install matplotlib") from None
    n = len(heatmap.rows)
    height = min(2.0 + 0.22 * n, 300.0)
    fig, (ax, ax_fb) = plt.subplots(
        1,
        2,
        figsize=(13, height),
        gridspec_kw={"width_ratios": [6, 1]},
        sharey=True,
        squeeze=True,
    )
    image = ax.imshow(
        heatmap.normalized(), aspect="auto", cmap="Blues", vmin=0.0, vmax=1.0, interpolation="none"
    )
    ticks = list(range(0, BINS, 2))
    ax.set_xticks(ticks)
    ax.set_xticklabels(
        [f"{t * BIN_WIDTH * 100:g}%" if t < BINS - 1 else "20%+" for t in ticks], rotation=90
    )
    ax.set_yticks(range(n))
    ax.set_yticklabels([heatmap.label(i) for i in range(n)], fontsize=7)
    ax.set_xlabel("mean relative error of the first candidate, 0.5% bins (row-normalized)")
    if heatmap.threshold is not None:
        edge = heatmap.threshold / BIN_WIDTH - 0.5  # bin i covers [i - 0.5, i + 0.5]
        label = f"threshold {heatmap.threshold:.1%}"
        ax.axvline(edge, color="tab:blue", linewidth=1.5, label=label)
        ax.legend(loc="lower right", fontsize=8)
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.01)
    fallback = [f if f is not None else 0.0 for f in heatmap.fallback]
    ax_fb.barh(range(n), fallback, color="tab:green")
    ax_fb.set_xlim(0, 1)
    ax_fb.set_xlabel("high-precision fallback")
    ax_fb.grid(axis="x", alpha=0.3)
    ax.set_title(title)
    fig.tight_layout()
    _save_figure(fig, path, files)


def summary_rows(heatmap: Heatmap) -> list[list[str]]:
    rows = []
    for i in range(len(heatmap.rows)):
        counts = heatmap.counts[i]
        total = sum(counts)
        below = sum(counts[: int(round(heatmap.threshold / BIN_WIDTH))]) if heatmap.threshold else 0
        mode = max(range(BINS), key=lambda b: counts[b])
        fb = heatmap.fallback[i]
        rows.append(
            [
                heatmap.label(i),
                str(heatmap.records[i]),
                str(total),
                f"{mode * 0.5:g}%" if mode < BINS - 1 else "20%+",
                "-" if heatmap.threshold is None or fb is None else f"{below / max(total, 1):.1%}",
                "-" if fb is None else f"{fb:.1%}",
            ]
        )
    return rows


@dataclass(frozen=True)
class Fallback:
    """The share of MoR decision units kept in high precision, for one (recipe, operand)."""

    recipe: str
    operand: str
    records: int
    units: int
    overall: float  # over every layer and record, weighted by decision units
    first: float  # at the first recorded step (or the first record, without steps)
    last: float  # at the last recorded step
    worst_layer: str  # the layer with the largest share
    worst: float


def _mor_groups(
    records: list[dict[str, Any]], recipe: str | None
) -> dict[tuple[str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rec in records:
        name = str(rec.get("recipe", ""))
        if rec.get("fallback") is None or (recipe is not None and name != recipe):
            continue
        groups.setdefault((name, str(rec.get("operand", ""))), []).append(rec)
    return groups


def _operand_order(key: tuple[str, str]) -> int:
    return OPERAND_ORDER.index(key[1]) if key[1] in OPERAND_ORDER else len(OPERAND_ORDER)


def fallback_summary(records: list[dict[str, Any]], recipe: str | None = None) -> list[Fallback]:
    """Per (recipe, operand) of the MoR records: the high-precision share overall, at the first
    and the last recorded step, and in the worst layer."""
    groups = _mor_groups(records, recipe)
    recipes = list(dict.fromkeys(name for name, _ in groups))
    out = []
    for key in sorted(groups, key=lambda k: (recipes.index(k[0]), _operand_order(k))):
        recs = groups[key]
        steps = [r.get("step", r.get("call", 0)) for r in recs]
        lo, hi = min(steps), max(steps)
        layers: dict[str, list[dict[str, Any]]] = {}
        for r in recs:
            layers.setdefault(str(r.get("layer", "")), []).append(r)
        worst_layer = max(layers, key=lambda name: _share(layers[name]))
        out.append(
            Fallback(
                recipe=key[0],
                operand=key[1],
                records=len(recs),
                units=sum(int(r.get("units", 1)) for r in recs),
                overall=_share(recs),
                first=_share([r for r, s in zip(recs, steps, strict=True) if s == lo]),
                last=_share([r for r, s in zip(recs, steps, strict=True) if s == hi]),
                worst_layer=worst_layer,
                worst=_share(layers[worst_layer]),
            )
        )
    return out


def fallback_rows(summary: list[Fallback]) -> list[list[str]]:
    return [
        [
            f.recipe,
            f.operand,
            str(f.records),
            str(f.units),
            f"{f.overall:.1%}",
            f"{f.first:.1%}",
            f"{f.last:.1%}",
            f"{f.worst_layer} {f.worst:.1%}",
        ]
        for f in summary
    ]


def draw_fallback(
    records: list[dict[str, Any]],
    path: Path,
    title: str,
    recipe: str | None,
    files: OutputFiles | None = None,
) -> bool:
    """The high-precision share over training per operand (one panel per MoR recipe); False
    (nothing written) when the records have no MoR decisions or no steps."""
    groups = _mor_groups(records, recipe)
    if not groups or not all("step" in r for recs in groups.values() for r in recs):
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FP4GenError("fp4gen report needs matplotlib: pip install matplotlib") from None
    recipes = list(dict.fromkeys(name for name, _ in groups))
    fig, axes = plt.subplots(
        1, len(recipes), figsize=(6 * len(recipes), 4), squeeze=False, sharey=True
    )
    for ax, name in zip(axes[0], recipes, strict=True):
        for key in sorted((k for k in groups if k[0] == name), key=_operand_order):
            by_step: dict[int, list[dict[str, Any]]] = {}
            for r in groups[key]:
                by_step.setdefault(int(r["step"]), []).append(r)
            steps = sorted(by_step)
            ax.plot(steps, [100 * _share(by_step[s]) for s in steps], marker=".", label=key[1])
        ax.set(title=name, xlabel="step", ylabel="decision units kept in high precision (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    _save_figure(fig, path, files)
    return True


def _save_figure(fig: Any, path: Path, files: OutputFiles | None) -> None:
    """Write a figure whole, never through a link (fp4gen.outputs), in the format its suffix
    names (none: PNG), and close it."""
    import matplotlib.pyplot as plt

    files = files or OutputFiles(path.parent)
    kind = path.suffix[1:].lower() or "png"
    try:
        files.write_with(path.name, lambda tmp: fig.savefig(tmp, dpi=100, format=kind))
    finally:
        plt.close(fig)


def check_out(out: Path) -> None:
    """FP4GenError for an --out path no PNG (or other matplotlib image) can be written to."""
    if "\0" in str(out):
        raise FP4GenError(f"--out {str(out)!r}: a file name holds no NUL byte")
    if not out.name:
        raise FP4GenError(f"--out {out}: names no file; give an image path such as heatmap.png")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return  # draw() reports that matplotlib is missing
    kinds = FigureCanvasBase.get_supported_filetypes()
    kind = out.suffix[1:].lower()
    if kind and kind not in kinds:
        raise FP4GenError(
            f"--out {out}: matplotlib cannot write .{kind} images; use one of "
            f"{', '.join(sorted(kinds))} (or no suffix: .png)"
        )


def cmd_report(args: argparse.Namespace) -> int:
    path = Path(args.telemetry)
    if not args.no_png and args.out:
        check_out(Path(args.out))
    pictures: tuple[Path, Path, OutputFiles] | None = None
    if not args.no_png and (args.out or path.name):  # no name: load_records says what is wrong
        out = Path(args.out) if args.out else path.with_suffix(".png")
        over_time = out.with_name(f"{out.stem}_fallback.png")
        pictures = (out, over_time, OutputFiles(out.parent))
        pictures[2].refuse_existing([out.name, over_time.name])  # a link fails before any work
    records = load_records(path)
    heatmap = aggregate(records, args.recipe, args.by)
    fallback = fallback_summary(records, args.recipe)
    if args.json:
        data = heatmap.as_json()
        data["fallback"] = [vars(f) for f in fallback]
        print(json.dumps(data, indent=2))
    else:
        headers = ["layer / operand", "records", "units", "mode bin", "below thr", "fallback"]
        print(render_table(headers, summary_rows(heatmap)))
        if fallback:
            print("\nshare of MoR decision units kept in high precision, per operand:")
            headers = ["recipe", "operand", "records", "units", "overall", "first step"]
            headers += ["last step", "worst layer"]
            print(render_table(headers, fallback_rows(fallback)))
    if pictures is not None:
        out, over_time, files = pictures
        title = f"relative-error heatmap of {path.name}"
        if args.recipe:
            title += f" ({args.recipe})"
        draw(heatmap, out, title, files)
        written = [out]
        title = f"high-precision fallback over training, {path.name}"
        if draw_fallback(records, over_time, title, args.recipe, files):
            written.append(over_time)
        if not args.json:
            print("wrote " + " and ".join(str(w) for w in written))
            replaced = files.replaced_text()
            if replaced is not None:
                print(replaced)
    return 0


def add_commands(sub: Any) -> None:
    """Register ``fp4gen report`` on the CLI's subparsers."""
    p = sub.add_parser(
        "report",
        help="draw relative-error heatmaps from a telemetry JSON",
        description="Aggregate a telemetry JSON (from 'fp4gen demo --telemetry N' or "
        "fp4gen.telemetry(model)) per layer and operand: relative-error histograms in 0.5%% "
        "bins (0..20%%+), normalized per row as in the MoR paper's heatmaps, and the fraction "
        "of decision units kept in high precision. Prints a table and writes a PNG.",
        epilog=REPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("telemetry", metavar="JSON", help="telemetry records (a list or {records})")
    p.add_argument("--out", help="the PNG to write (default: the JSON's path with .png)")
    p.add_argument("--recipe", help="only the records of this recipe (their 'recipe' field)")
    p.add_argument(
        "--by",
        choices=("layer", "operand"),
        default="layer",
        help="heatmap rows: each layer's operands (default), or each operand over all layers",
    )
    p.add_argument("--json", action="store_true", help="print the aggregated rows as JSON")
    p.add_argument("--no-png", action="store_true", help="print only; write no PNG")
    p.set_defaults(func=cmd_report)
